"""The latest word of every serving source, shared by the writers and the sampler.

Scrape loops and the OTLP receiver write here from the HTTP server's event loop; the serving
collector reads a copy once per sample in the sampler thread. Nothing here blocks on I/O, so a
slow or dead serving endpoint never holds up a sample or a scrape of /metrics.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpubalance.exporter.collectors.serving.base import ServingReading

DEFAULT_MAX_SERIES = 10_000


@dataclass(frozen=True, slots=True)
class StoredReading:
    source: str  # triton | vllm | tgi | sglang | otlp
    worker: str  # the endpoint's worker name, or OTLP's service.instance.id
    endpoint: str  # URL scraped, or "otlp"
    reading: ServingReading
    received_at: float  # Unix time the reading arrived
    gpu_index: int | None = None  # from the configuration or OTLP's gpu.index


@dataclass
class SourceStatus:
    """How one endpoint (or the OTLP receiver) is doing."""

    source: str
    endpoint: str
    up: bool = False
    last_success_seconds: float | None = None
    last_attempt_seconds: float | None = None
    duration_seconds: float | None = None
    error: str | None = None
    errors_total: Counter[str] = field(default_factory=Counter)  # reason -> count
    # scrapes ("ok" or the error's reason) or pushes (accepted, partial, or the refusal's reason)
    requests_total: Counter[str] = field(default_factory=Counter)
    points_total: Counter[str] = field(default_factory=Counter)  # pushes: accepted/rejected/ignored


class SeriesLimitReached(Exception):
    pass


class ServingStore:
    def __init__(self, max_series: int = DEFAULT_MAX_SERIES) -> None:
        self.max_series = max_series
        self._lock = threading.Lock()
        # (source, endpoint, worker, reading key) -> reading
        self._readings: dict[tuple[str, str, str, str], StoredReading] = {}
        self._status: dict[tuple[str, str], SourceStatus] = {}

    def replace_endpoint(
        self,
        source: str,
        endpoint: str,
        worker: str,
        readings: Iterable[ServingReading],
        now: float,
        gpu_index: int | None = None,
    ) -> None:
        """A scrape's whole answer: queues it no longer reports are dropped."""
        readings = list(readings)
        with self._lock:
            kept = {k: v for k, v in self._readings.items() if k[:2] != (source, endpoint)}
            if len(kept) + len(readings) > self.max_series:
                raise SeriesLimitReached(
                    f"{endpoint}: {len(readings)} series would pass the limit of {self.max_series}"
                )
            for r in readings:
                kept[(source, endpoint, worker, r.key)] = StoredReading(
                    source, worker, endpoint, r, now, gpu_index
                )
            self._readings = kept

    def put(self, stored: StoredReading) -> None:
        """One pushed series (OTLP); raises SeriesLimitReached for a new series past the limit."""
        key = (stored.source, stored.endpoint, stored.worker, stored.reading.key)
        with self._lock:
            if key not in self._readings and len(self._readings) >= self.max_series:
                raise SeriesLimitReached(f"more than {self.max_series} serving series")
            self._readings[key] = stored

    def prune(self, before: float) -> int:
        """Forget series last heard of before ``before`` (a worker renamed or gone for good);
        returns how many were dropped."""
        with self._lock:
            old = [k for k, v in self._readings.items() if v.received_at < before]
            for key in old:
                del self._readings[key]
            return len(old)

    def get(self, source: str, endpoint: str, worker: str, key: str) -> StoredReading | None:
        with self._lock:
            return self._readings.get((source, endpoint, worker, key))

    def status(self, source: str, endpoint: str) -> SourceStatus:
        """The live status record of a source (create it on first use); mutate under lock()."""
        with self._lock:
            return self._status.setdefault((source, endpoint), SourceStatus(source, endpoint))

    def lock(self) -> threading.Lock:
        return self._lock

    def readings(self) -> list[StoredReading]:
        with self._lock:
            return list(self._readings.values())

    def statuses(self) -> list[SourceStatus]:
        with self._lock:
            return [
                SourceStatus(
                    s.source,
                    s.endpoint,
                    s.up,
                    s.last_success_seconds,
                    s.last_attempt_seconds,
                    s.duration_seconds,
                    s.error,
                    Counter(s.errors_total),
                    Counter(s.requests_total),
                    Counter(s.points_total),
                )
                for s in self._status.values()
            ]

    def __len__(self) -> int:
        with self._lock:
            return len(self._readings)
