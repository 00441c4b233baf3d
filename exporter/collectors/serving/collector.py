"""Serving collector: the queues in front of each GPU, from scrapes and OTLP pushes.

Reads the store that the scrape loop and the OTLP receiver fill (never the network itself), drops
what is older than ``stale_after`` — a stale source's values are not served as current — and
maps each queue to its GPU: the source's own GPU UUID (Triton), the configuration, OTLP's
``gpu.index``, or the process listening on the endpoint's port (mapping.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from gpubalance.exporter.collectors.base import SampleParts, register
from gpubalance.exporter.collectors.serving.mapping import PortMapper
from gpubalance.exporter.collectors.serving.scraper import ServingScraper
from gpubalance.exporter.collectors.serving.store import ServingStore, StoredReading
from gpubalance.exporter.config import ExporterConfig, ServingEndpoint
from gpubalance.telemetry import GpuSample, ServingSample, ServingSourceStatus

FORGET_AFTER_SECONDS = 300.0


class _Gpus:
    """The GPUs of one sample that are not lost, looked up by UUID and index."""

    def __init__(self, live: Sequence[GpuSample]) -> None:
        self.live = live
        self.by_uuid = {g.uuid: g for g in live}
        self.by_index = {g.index: g for g in live}


class ServingCollector:
    name = "serving"

    def __init__(self, config: ExporterConfig) -> None:
        self.config = config.serving
        self.store = ServingStore(max_series=config.serving.otlp.max_series)
        self.scraper = ServingScraper(config.serving, self.store)
        self.mapper = PortMapper(config.procfs)
        self.endpoints = {(e.format, e.url): e for e in config.serving.endpoints}

    def update(self, parts: SampleParts) -> None:
        now = parts.timestamp_seconds
        stale_after = self.config.stale_after
        # stale series are not served; long-stale ones are forgotten, so pushed series of
        # workers that are gone cannot fill the store
        self.store.prune(now - max(FORGET_AFTER_SECONDS, 10 * stale_after))
        gpus = _Gpus([g for g in parts.gpus if not g.lost])
        fresh = [r for r in self.store.readings() if now - r.received_at <= stale_after]
        parts.serving = tuple(
            sorted(
                (self._sample(r, gpus) for r in fresh),
                key=lambda s: (
                    s.gpu_index if s.gpu_index is not None else 1 << 30,
                    s.source,
                    s.worker,
                    s.queue,
                ),
            )
        )
        live_sources = {(r.source, r.endpoint) for r in fresh}
        parts.serving_sources = tuple(
            ServingSourceStatus(
                source=status.source,
                endpoint=status.endpoint,
                up=status.up,
                stale=(status.source, status.endpoint) not in live_sources,
                last_success_timestamp_seconds=status.last_success_seconds,
                scrape_duration_seconds=status.duration_seconds,
                error=status.error,
                errors_total=dict(status.errors_total),
                requests_total=dict(status.requests_total),
                points_total=dict(status.points_total),
            )
            for status in sorted(self.store.statuses(), key=lambda s: (s.source, s.endpoint))
        )

    def close(self) -> None:
        pass

    def _sample(self, stored: StoredReading, gpus: _Gpus) -> ServingSample:
        reading = stored.reading
        gpu = self._gpu(stored, gpus)
        endpoint = self.endpoints.get((stored.source, stored.endpoint))
        service_class = reading.service_class or (endpoint.service_class if endpoint else None)
        measures = reading.measures()
        if measures["max_batch_size"] is None and endpoint is not None:
            measures["max_batch_size"] = endpoint.max_batch_size
        return ServingSample(
            source=stored.source,
            worker=stored.worker,
            gpu_index=gpu.index if gpu else stored.gpu_index,
            gpu_uuid=gpu.uuid if gpu else reading.gpu_uuid,
            service_class=service_class,
            tenant=reading.tenant,
            queue=reading.key,
            **measures,
        )

    def _gpu(self, stored: StoredReading, gpus: _Gpus) -> GpuSample | None:
        reading = stored.reading
        if reading.gpu_uuid is not None:
            return gpus.by_uuid.get(reading.gpu_uuid)
        endpoint = self.endpoints.get((stored.source, stored.endpoint))
        if endpoint is not None:
            return self._configured(endpoint, reading.rank, gpus)
        if stored.gpu_index is not None:
            return gpus.by_index.get(stored.gpu_index)
        return None

    def _configured(
        self, endpoint: ServingEndpoint, rank: int | None, gpus: _Gpus
    ) -> GpuSample | None:
        if endpoint.gpus is not None and rank is not None and rank < len(endpoint.gpus):
            return gpus.by_index.get(endpoint.gpus[rank])
        if isinstance(endpoint.gpu, int):
            return gpus.by_index.get(endpoint.gpu)
        if isinstance(endpoint.gpu, str):
            return gpus.by_uuid.get(endpoint.gpu)
        port = urlsplit(endpoint.url).port
        if port is None:
            port = 443 if endpoint.url.startswith("https") else 80
        found = sorted(self.mapper.gpus(port, gpus.live), key=lambda g: g.index)
        if len(found) == 1:
            return found[0]
        if rank is not None and rank < len(found):
            return found[rank]
        return None


@register("serving", order=40, help="serving queues: Triton/vLLM/TGI/SGLang scrapes, OTLP pushes")
def create(config: ExporterConfig) -> ServingCollector:
    return ServingCollector(config)
