"""Report a custom Python serving worker's queue to the gpubalance exporter over OTLP.

Workers that no scrape adapter understands (Triton, vLLM, TGI and SGLang have one) push seven
metrics (and, when given one, their batch limit) to ``POST /v1/metrics`` on the exporter's OTLP
listener (``127.0.0.1:4318`` unless ``exporter.serving.otlp.listen`` says otherwise)::

    from gpubalance.instrument import ServingMetrics

    with ServingMetrics(worker="llm-0", gpu_index=0, service_class="chat") as metrics:
        ...
        metrics.set_queue_depth(queue.qsize())  # whenever the queue changes
        metrics.batch_started(waits)  # each request's wait since it was enqueued
        metrics.request_finished(seconds, tenant="acme", prompt_tokens=812, generated_tokens=64)
        metrics.allocation_failed()  # on CUDA out-of-memory

It runs on its own OpenTelemetry MeterProvider, never the global one, so it composes with
whatever telemetry the application already sends elsewhere. Exports are CUMULATIVE (the SDK's
default): a lost push or an exporter restart costs nothing but the time until the next push.

Queue depth is an observable gauge fed by :meth:`ServingMetrics.set_queue_depth`, not an
UpDownCounter fed by +1/-1: a worker knows its queue's length (``qsize()``), and a level
cannot drift the way a sum of increments does when one decrement is lost to an exception.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from types import TracebackType

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

DEFAULT_ENDPOINT = "http://127.0.0.1:4318/v1/metrics"  # the exporter's OTLP listener
SERVICE_NAME = "gpubalance-worker"
# A dead exporter must hold an export (and so shutdown()) for seconds, not the SDK's 10 s.
EXPORT_TIMEOUT_SECONDS = 3.0

# Bucket bounds, in seconds: batch assembly waits from sub-millisecond (a busy worker) to
# seconds (a starved one waiting for a full batch); requests from a short embedding call to
# a long generation.
ASSEMBLY_DELAY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
REQUEST_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServingMetrics:
    """The seven gpubalance serving metrics of one worker, pushed every ``export_interval_seconds``.

    ``worker`` becomes ``service.instance.id``; pass the name the exporter's configuration knows
    the worker by (default: host name and process id). ``gpu_uuid`` and ``gpu_index`` say which
    GPU serves the queue, ``service_class`` its class of service, ``max_batch_size`` the most
    requests the worker puts in one batch (pushed as ``gpubalance.batch.size.limit``: the
    analyzer's capacity estimates are sharper with it).
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        worker: str | None = None,
        gpu_uuid: str | None = None,
        gpu_index: int | None = None,
        service_class: str | None = None,
        export_interval_seconds: float = 1.0,
        max_batch_size: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.worker = worker
        self.gpu_uuid = gpu_uuid
        self.gpu_index = gpu_index
        self.service_class = service_class
        self.export_interval_seconds = export_interval_seconds

        attributes: dict[str, str | int] = {
            "service.name": SERVICE_NAME,
            "service.instance.id": worker or f"{socket.gethostname()}-{os.getpid()}",
        }
        if gpu_uuid is not None:
            attributes["gpu.uuid"] = gpu_uuid
        if gpu_index is not None:
            attributes["gpu.index"] = gpu_index
        if service_class is not None:
            attributes["gpubalance.class"] = service_class
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_SECONDS),
            export_interval_millis=export_interval_seconds * 1000,
        )
        self._provider = MeterProvider(
            metric_readers=[reader], resource=Resource.create(attributes)
        )
        meter = self._provider.get_meter("gpubalance.instrument")
        self._queue_depth: float | None = None  # None until set: no point rather than a 0
        meter.create_observable_gauge(
            "gpubalance.queue.depth",
            callbacks=[self._observe_queue_depth],
            unit="{request}",
            description="Requests waiting for a batch",
        )
        self._assembly_delay = meter.create_histogram(
            "gpubalance.batch.assembly_delay",
            unit="s",
            description="Mean wait of a batch's requests, from enqueue to batch start",
            explicit_bucket_boundaries_advisory=ASSEMBLY_DELAY_BUCKETS,
        )
        self._batch_size = meter.create_histogram(
            "gpubalance.batch.size",
            unit="{request}",
            description="Requests per batch",
            explicit_bucket_boundaries_advisory=BATCH_SIZE_BUCKETS,
        )
        self._request_duration = meter.create_histogram(
            "gpubalance.request.duration",
            unit="s",
            description="Time from a request's arrival to its answer",
            explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS,
        )
        self._allocation_failures = meter.create_counter(
            "gpubalance.memory.allocation_failures",
            unit="{failure}",
            description="GPU memory allocations that failed (CUDA out of memory)",
        )
        self._prompt_tokens = meter.create_counter(
            "gpubalance.prompt.tokens",
            unit="{token}",
            description="Prompt tokens of the requests the worker prefilled",
        )
        self._generation_tokens = meter.create_counter(
            "gpubalance.generation.tokens",
            unit="{token}",
            description="Tokens the worker generated",
        )
        if max_batch_size is not None:
            limit = Observation(max_batch_size)
            meter.create_observable_gauge(
                "gpubalance.batch.size.limit",
                callbacks=[lambda options: (limit,)],
                unit="{request}",
                description="The most requests the worker puts in one batch",
            )
        self._closed = False

    def set_queue_depth(self, n: float) -> None:
        """The number of requests waiting now; each push reports the latest value set."""
        self._queue_depth = n

    def batch_started(self, waits_seconds: Sequence[float]) -> None:
        """A batch starts; ``waits_seconds`` holds, for each of its requests, the time it waited
        since it was enqueued (its batch-assembly delay).

        Each request's wait is recorded (about 8 µs each), so the exporter's mean delay weighs
        requests alike, as Triton's and vLLM's do.
        """
        self._batch_size.record(len(waits_seconds))
        for wait in waits_seconds:
            self._assembly_delay.record(wait)

    def request_finished(
        self,
        duration_seconds: float,
        tenant: str | None = None,
        *,
        prompt_tokens: int | None = None,
        generated_tokens: int | None = None,
    ) -> None:
        """A request was answered ``duration_seconds`` after it arrived; with its prompt's
        length and the tokens generated for it where the worker counts tokens (the analyzer
        tells prefill-heavy work, whose batches cost in proportion to their size, from them)."""
        attributes = {"gpubalance.tenant": tenant} if tenant is not None else None
        self._request_duration.record(duration_seconds, attributes)
        if prompt_tokens is not None:
            self._prompt_tokens.add(prompt_tokens, attributes)
        if generated_tokens is not None:
            self._generation_tokens.add(generated_tokens, attributes)

    def allocation_failed(self) -> None:
        """A GPU memory allocation failed."""
        self._allocation_failures.add(1)

    def flush(self, timeout_seconds: float = 10.0) -> bool:
        """Push now; False when the push did not finish in time."""
        return self._provider.force_flush(timeout_millis=timeout_seconds * 1000)

    def shutdown(self) -> None:
        """Push what is left and stop; later calls do nothing."""
        if not self._closed:
            self._closed = True
            self._provider.shutdown()

    def __enter__(self) -> ServingMetrics:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.shutdown()

    def _observe_queue_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        depth = self._queue_depth
        return () if depth is None else (Observation(depth),)
