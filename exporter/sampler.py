"""The background sampler: every interval, run the collectors into one Sample, keep a bounded
history, compute the window figures and publish a View that scrapes serve as they are.

Scrapes never reach NVML or /proc: however many scrapers there are, the hardware is read once
per interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from gpubalance.exporter.collectors.base import Collector, NoDataError, SampleParts
from gpubalance.exporter.config import ExporterConfig
from gpubalance.exporter.view import View
from gpubalance.exporter.window import compute_window
from gpubalance.telemetry import CollectorResult, NvmlStatus, Sample

log = logging.getLogger(__name__)

_NO_GPU_COLLECTOR = NvmlStatus(up=False, error="the gpu collector is disabled")


class Sampler:
    def __init__(
        self, config: ExporterConfig, collectors: Sequence[Collector], hostname: str
    ) -> None:
        self.config = config
        self.collectors = list(collectors)
        self.hostname = hostname
        self.history: deque[Sample] = deque(maxlen=config.history_length)
        # Replaced whole after each sample; readers take the reference without a lock.
        self.view: View | None = None
        self._samples_total = 0
        self._overruns_total = 0
        self._last_errors: dict[str, str | None] = {}
        self._last_success: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> View:
        started = time.perf_counter()
        parts = SampleParts(timestamp_seconds=time.time())
        results = [self._run_collector(collector, parts) for collector in self.collectors]
        sample = Sample(
            timestamp_seconds=parts.timestamp_seconds,
            duration_seconds=time.perf_counter() - started,
            hostname=self.hostname,
            nvml=parts.nvml or _NO_GPU_COLLECTOR,
            gpus=parts.gpus,
            host=parts.host,
            processes=dict(parts.processes),
            serving=parts.serving,
            serving_sources=parts.serving_sources,
            collectors=tuple(results),
        )
        self.history.append(sample)
        window = compute_window(
            self.history,
            self.config.window,
            self.config.trend_window,
            trend_rule=self.config.trend_rule,
        )
        self._samples_total += 1
        view = View(
            generation=self._samples_total,
            sample=sample,
            window=window,
            samples_total=self._samples_total,
            overruns_total=self._overruns_total,
            interval_seconds=self.config.interval,
            window_seconds=self.config.window,
            trend_window_seconds=self.config.trend_window,
        )
        self.view = view
        return view

    def _run_collector(self, collector: Collector, parts: SampleParts) -> CollectorResult:
        started = time.perf_counter()
        error: str | None = None
        try:
            collector.update(parts)
        except NoDataError as exc:
            error = str(exc)
            self._log_change(collector.name, error, logging.DEBUG)
        except Exception as exc:
            error = str(exc) or type(exc).__name__
            self._log_change(collector.name, error, logging.ERROR, exc)
        else:
            self._log_change(collector.name, None, logging.INFO)
            self._last_success[collector.name] = parts.timestamp_seconds
        return CollectorResult(
            name=collector.name,
            success=error is None,
            duration_seconds=time.perf_counter() - started,
            error=error,
            last_success_timestamp_seconds=self._last_success.get(collector.name),
        )

    def _log_change(
        self, name: str, error: str | None, level: int, exc: BaseException | None = None
    ) -> None:
        # Log when a collector's state changes, not every second it stays broken.
        previous = self._last_errors.get(name)
        self._last_errors[name] = error
        if error == previous:
            return
        if error is None:
            if previous is not None:
                log.info("collector %s recovered", name)
            return
        log.log(
            level,
            "collector %s failed: %s",
            name,
            error,
            exc_info=exc if level >= logging.ERROR and not isinstance(exc, RuntimeError) else None,
        )

    # -- background thread ------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpubalance-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self.config.interval
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # the sampler must outlive any bug in one sample
                log.exception("sample failed")
            next_tick += interval
            now = time.monotonic()
            if now > next_tick:
                # Too slow for the interval: skip the ticks already missed rather than
                # sampling back to back.
                missed = int((now - next_tick) / interval) + 1
                self._overruns_total += missed
                next_tick += missed * interval
            self._stop.wait(next_tick - now)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for collector in self.collectors:
            try:
                collector.close()
            except Exception:
                log.exception("closing collector %s failed", collector.name)
