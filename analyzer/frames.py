"""Frames: one GPU over one analysis window, whatever the telemetry came from.

A source (the exporter's snapshot history, a lab run, Prometheus) delivers samples or series;
this module cuts them into windows ``[origin + k·W, origin + (k+1)·W)`` and gives each GPU of
each window one :class:`GpuFrame`: means of gauges, rates of counters, the state of the feed.
The features step compares frames against their peers and their own history; nothing here
judges.

A window's counters are differenced against the last sample before the window when there is
one (what Prometheus' ``increase()`` over the window approximates), so consecutive windows
account every event once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from gpubalance.telemetry import (
    SLOWDOWN_REASONS,
    GpuSample,
    ProcessHostStats,
    Sample,
    ServingSample,
)


@dataclass(frozen=True, slots=True)
class GpuFrame:
    """One GPU over one window ``[t_start, t_end)`` (Unix seconds), as its telemetry shows it.

    ``None`` means the telemetry does not say (unsupported, no serving source, no samples),
    never "zero".
    """

    host: str
    gpu: int
    uuid: str
    card: str | None
    t_start: float
    t_end: float
    sample_count: int  # samples in the window with a fresh reading of this GPU
    expected_sample_count: int  # samples a window holds at the source's interval
    lost: bool  # NVML reported it lost in the window
    utilization_mean_ratio: float | None
    utilization_p95_ratio: float | None
    memory_used_bytes: int | None  # at the window's last reading
    memory_total_bytes: int | None
    memory_used_slope_bytes_per_second: float | None  # least squares over the window
    sm_clock_ratio: float | None  # mean SM clock over the card's maximum
    throttled_ratio: float | None  # share of readings with a slowdown reason active
    throttle_reasons: frozenset[str]  # slowdown reasons seen in the window
    power_ratio: float | None  # mean power over the limit
    temperature_celsius: float | None
    # serving, summed over the queues mapped to this GPU (0 queues: no serving source)
    serving_queues: int
    queue_depth_mean: float | None
    queue_depth_max: float | None
    queue_depth_slope_per_second: float | None
    running_mean: float | None
    batch_delay_seconds: float | None  # mean enqueue -> batch start per request
    request_duration_seconds: float | None  # mean per completed request
    batch_size_mean: float | None
    completions_per_second: float | None
    allocation_failures: float | None  # counted in the window
    # the classes its queues served in the window: a queue listed with nothing waiting and no
    # request completed is a class that did not come
    service_classes: tuple[str, ...]
    queue_names: tuple[str, ...]  # the serving queues' names (a model, an engine): its pools
    # the feed: the processes holding the GPU, and the host
    feeder_processes: int
    feeder_cpu_cores_max: float | None  # the busiest feeding process, in cores
    feeder_read_bytes_per_second: float | None
    host_cpu_busy_ratio: float | None  # mean over the host's CPUs
    host_cpu_pressure_ratio: float | None  # PSI cpu "some": share of the window
    host_io_pressure_ratio: float | None  # PSI io "some"
    host_iowait_ratio: float | None
    # readings NVML did not deliver in time (the GPU's read is stuck): not counted in
    # sample_count; stale_call is the pynvml function the last of them waited in
    stale_sample_count: int = 0
    stale_call: str | None = None
    # the serving workers of its queues (HAProxy server names in the lab): whom a weight is for
    workers: tuple[str, ...] = ()
    # the slowest service class's mean request duration over the fastest's, where the GPU's
    # queues report classes apart (None: fewer than two classes completed in the window)
    class_duration_ratio: float | None = None
    # the slowest service class's share of the time the GPU's requests spent being served
    # (duration less the wait for a batch, summed per class): its share of the GPU's work,
    # where a batch is held for its longest request (None: fewer than two classes completed,
    # or a class's batch wait is not reported)
    slow_class_work_share: float | None = None
    # mean over the window of the fullest KV cache among the GPU's queues (vLLM's
    # kv_cache_usage_perc, TensorRT-LLM's used blocks): None where no queue reports it
    kv_cache_usage_ratio: float | None = None
    # the largest batch limit its queues' servers are configured with (the exporter's
    # max_batch_size of an endpoint, an OTLP worker's gpubalance.batch.size.limit): None
    # where none says
    max_batch_size: float | None = None
    # prompt tokens prefilled and tokens generated per second over the window, summed over
    # the GPU's queues (vLLM's and SGLang's token counters, TGI's length histograms, the
    # OTLP token counters): None where no queue counts tokens
    prompt_tokens_per_second: float | None = None
    generation_tokens_per_second: float | None = None

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start

    @property
    def coverage_ratio(self) -> float:
        if self.expected_sample_count == 0:
            return 0.0
        return self.sample_count / self.expected_sample_count


def window_index(timestamp: float, origin: float, seconds: float) -> int:
    # a sample at the very end of a window belongs to it: samples cover the period before them
    return math.ceil((timestamp - origin) / seconds) - 1


def frames_from_samples(
    samples: Iterable[Sample],
    *,
    window_seconds: float,
    interval_seconds: float,
    origin: float = 0.0,
) -> Iterator[GpuFrame]:
    """Frames of every GPU in every window the samples cover, in time order.

    ``samples`` must be in time order, taken every ``interval_seconds``; a sample at ``t``
    covers the period before ``t`` and belongs to the window that ends at or after it. Windows
    with no sample give no frame.
    """
    if not 0 < interval_seconds <= window_seconds:
        raise ValueError(
            f"need 0 < interval_seconds <= window_seconds, got {interval_seconds} and "
            f"{window_seconds}"
        )
    expected = max(1, round(window_seconds / interval_seconds))
    before: Sample | None = None
    current: list[Sample] = []
    current_index: int | None = None
    for sample in samples:
        index = window_index(sample.timestamp_seconds, origin, window_seconds)
        if current_index is not None and index < current_index:
            raise ValueError(
                f"samples out of order: {sample.timestamp_seconds} after a window ending at "
                f"{origin + (current_index + 1) * window_seconds}"
            )
        if current_index is not None and index != current_index:
            yield from _window_frames(
                before, current, current_index, window_seconds, origin, expected
            )
            before = current[-1]
            current = []
        current_index = index
        current.append(sample)
    if current_index is not None:
        yield from _window_frames(before, current, current_index, window_seconds, origin, expected)


def _window_frames(
    before: Sample | None,
    samples: Sequence[Sample],
    index: int,
    seconds: float,
    origin: float,
    expected: int,
) -> Iterator[GpuFrame]:
    t_start = origin + index * seconds
    t_end = t_start + seconds
    if before is not None and before.timestamp_seconds < t_start - seconds:
        before = None  # a gap: the last sample is from an older window, not a baseline
    host = _HostFigures(before, samples)
    uuids: dict[str, GpuSample] = {}
    for sample in samples:
        for gpu in sample.gpus:
            uuids[gpu.uuid] = gpu
    for uuid, last_seen in sorted(uuids.items(), key=lambda item: item[1].index):
        yield _gpu_frame(before, samples, uuid, last_seen, host, t_start, t_end, expected)


def _gpu_of(sample: Sample, uuid: str) -> GpuSample | None:
    for gpu in sample.gpus:
        if gpu.uuid == uuid:
            return gpu
    return None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    # nearest rank, as Prometheus' quantile_over_time interpolates between ranks
    position = 0.95 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope (what PromQL's ``deriv()`` computes)."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t <= 0:
        return None
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / var_t


def _increase(new: float | None, old: float | None) -> float | None:
    if new is None or old is None:
        return None
    delta = new - old
    return new if delta < 0 else delta  # a reset counts from zero, as increase() does


class _HostFigures:
    """The host's rates over the window, shared by every GPU of the host."""

    def __init__(self, before: Sample | None, samples: Sequence[Sample]) -> None:
        first = before if before is not None else samples[0]
        last = samples[-1]
        elapsed = last.timestamp_seconds - first.timestamp_seconds
        self.first, self.last, self.elapsed = first, last, elapsed
        self.samples = samples
        self.cpu_busy = self.iowait = self.cpu_pressure = self.io_pressure = None
        if elapsed <= 0 or first.host is None or last.host is None:
            return
        old = {c.cpu: c for c in first.host.cpus}
        busy, total, iowait = 0.0, 0.0, 0.0
        for cpu in last.host.cpus:
            prior = old.get(cpu.cpu)
            if prior is None:
                continue
            span = cpu.total_seconds - prior.total_seconds
            if span <= 0:
                continue
            busy += min(span, max(0.0, cpu.busy_seconds - prior.busy_seconds))
            iowait += max(0.0, cpu.iowait_seconds - prior.iowait_seconds)
            total += span
        if total > 0:
            self.cpu_busy = busy / total
            self.iowait = iowait / total
        self.cpu_pressure = self._pressure("cpu", first, last, elapsed)
        self.io_pressure = self._pressure("io", first, last, elapsed)

    @staticmethod
    def _pressure(resource: str, first: Sample, last: Sample, elapsed: float) -> float | None:
        assert first.host is not None and last.host is not None
        if first.host.pressure is None or last.host.pressure is None:
            return None
        old = next((p for p in first.host.pressure if p.resource == resource), None)
        new = next((p for p in last.host.pressure if p.resource == resource), None)
        if old is None or new is None:
            return None
        waited = _increase(new.some_total_seconds, old.some_total_seconds)
        return None if waited is None else min(1.0, waited / elapsed)

    def process_rates(self, pids: set[int]) -> tuple[float | None, float | None]:
        """Cores used by the busiest of ``pids``, and their summed read rate."""
        if self.elapsed <= 0 or not pids:
            return None, None
        cores: list[float] = []
        reads: list[float] = []
        for pid in pids:
            new = self.last.processes.get(pid)
            old = self._oldest(pid, new)
            if new is None or old is None:
                continue
            seconds = self.last.timestamp_seconds - old[0]
            if seconds <= 0:
                continue
            cores.append(max(0.0, new.cpu_seconds_total - old[1].cpu_seconds_total) / seconds)
            read = _increase(new.read_bytes_total, old[1].read_bytes_total)
            if read is not None:
                reads.append(read / seconds)
        return (max(cores) if cores else None), (sum(reads) if reads else None)

    def _oldest(
        self, pid: int, new: ProcessHostStats | None
    ) -> tuple[float, ProcessHostStats] | None:
        if new is None:
            return None
        # the same process (pid and start time) at the baseline, else at its first sight
        for sample in (self.first, *self.samples):
            old = sample.processes.get(pid)
            if old is not None and old.create_time_seconds == new.create_time_seconds:
                return sample.timestamp_seconds, old
        return None


def _gpu_frame(
    before: Sample | None,
    samples: Sequence[Sample],
    uuid: str,
    last_seen: GpuSample,
    host: _HostFigures,
    t_start: float,
    t_end: float,
    expected: int,
) -> GpuFrame:
    readings = [(s, g) for s in samples if (g := _gpu_of(s, uuid)) is not None]
    live = [(s, g) for s, g in readings if not g.lost and not g.stale]
    stale = [g for _, g in readings if g.stale]
    utilization = [v for _, g in live for (t, v) in g.utilization_samples if t_start <= t < t_end]
    if not utilization:
        utilization = [g.utilization_ratio for _, g in live if g.utilization_ratio is not None]
    clocks = [
        g.sm_clock_hertz / g.max_sm_clock_hertz
        for _, g in live
        if g.sm_clock_hertz is not None and g.max_sm_clock_hertz
    ]
    reasons = [g.throttle_reasons for _, g in live if g.throttle_reasons is not None]
    power = [
        g.power_watts / g.power_limit_watts
        for _, g in live
        if g.power_watts is not None and g.power_limit_watts
    ]
    temperatures = [g.temperature_celsius for _, g in live if g.temperature_celsius is not None]
    memory = [
        (s.timestamp_seconds, float(g.memory_used_bytes))
        for s, g in live
        if g.memory_used_bytes is not None
    ]
    last_memory = next((g for _, g in reversed(live) if g.memory_used_bytes is not None), None)
    serving = _ServingFigures(before, samples, last_seen)
    pids = {p.pid for _, g in live for p in g.processes}
    feeder_cores, feeder_reads = host.process_rates(pids)
    return GpuFrame(
        host=samples[-1].hostname,
        gpu=last_seen.index,
        uuid=uuid,
        card=last_seen.name,
        t_start=t_start,
        t_end=t_end,
        sample_count=len(live),
        expected_sample_count=expected,
        lost=any(g.lost for _, g in readings),
        utilization_mean_ratio=_mean(utilization),
        utilization_p95_ratio=_p95(utilization),
        memory_used_bytes=None if last_memory is None else last_memory.memory_used_bytes,
        memory_total_bytes=None if last_memory is None else last_memory.memory_total_bytes,
        memory_used_slope_bytes_per_second=_slope(memory),
        sm_clock_ratio=_mean(clocks),
        throttled_ratio=(
            sum(1 for r in reasons if r & SLOWDOWN_REASONS) / len(reasons) if reasons else None
        ),
        throttle_reasons=frozenset().union(*reasons) & SLOWDOWN_REASONS,
        power_ratio=_mean(power),
        temperature_celsius=_mean(temperatures),
        serving_queues=serving.queues,
        queue_depth_mean=serving.depth_mean,
        queue_depth_max=serving.depth_max,
        queue_depth_slope_per_second=serving.depth_slope,
        running_mean=serving.running_mean,
        batch_delay_seconds=serving.mean_of("batch_assembly_delay_seconds"),
        request_duration_seconds=serving.mean_of("request_duration_seconds"),
        batch_size_mean=serving.mean_of("batch_size"),
        completions_per_second=serving.rate_of("request_duration_seconds_count"),
        allocation_failures=serving.increase_of("allocation_failures_total"),
        service_classes=serving.classes,
        queue_names=tuple(sorted({key[2] for key in serving.series})),
        workers=tuple(sorted({key[0] for key in serving.series})),
        feeder_processes=len(pids),
        feeder_cpu_cores_max=feeder_cores,
        feeder_read_bytes_per_second=feeder_reads,
        host_cpu_busy_ratio=host.cpu_busy,
        host_cpu_pressure_ratio=host.cpu_pressure,
        host_io_pressure_ratio=host.io_pressure,
        host_iowait_ratio=host.iowait,
        stale_sample_count=len(stale),
        stale_call=next((g.stale_call for g in reversed(stale) if g.stale_call), None),
        class_duration_ratio=serving.class_duration_ratio(),
        slow_class_work_share=serving.slow_class_work_share(),
        kv_cache_usage_ratio=serving.kv_usage_mean,
        max_batch_size=serving.max_batch_size,
        prompt_tokens_per_second=serving.rate_of("prompt_tokens_total"),
        generation_tokens_per_second=serving.rate_of("generation_tokens_total"),
    )


# worker, source, queue, service class: a server that counts classes apart has a series each
_Queue = tuple[str, str, str, str | None]


def _key(serving: ServingSample) -> _Queue:
    return (serving.worker, serving.source, serving.queue, serving.service_class)


def _on_gpu(serving: ServingSample, gpu: GpuSample) -> bool:
    if serving.gpu_uuid is not None:
        return serving.gpu_uuid == gpu.uuid
    return serving.gpu_index == gpu.index


class _ServingFigures:
    """The serving queues mapped to one GPU, over the window."""

    def __init__(self, before: Sample | None, samples: Sequence[Sample], gpu: GpuSample) -> None:
        self.series: dict[_Queue, list[tuple[float, ServingSample]]] = {}
        self.baseline: dict[_Queue, ServingSample] = {}
        if before is not None:
            for serving in before.serving:
                if _on_gpu(serving, gpu):
                    self.baseline[_key(serving)] = serving
        totals: list[tuple[float, float]] = []
        running: list[float] = []
        kv_usage: list[float] = []
        limit: float | None = None
        classes: set[str] = set()
        for sample in samples:
            depth: float | None = None
            run: float | None = None
            kv: float | None = None
            for serving in sample.serving:
                if not _on_gpu(serving, gpu) or not serving.up:
                    continue
                key = _key(serving)
                self.series.setdefault(key, []).append((sample.timestamp_seconds, serving))
                if serving.service_class is not None:
                    classes.add(serving.service_class)
                if serving.queue_depth is not None:
                    depth = (depth or 0.0) + serving.queue_depth
                if serving.running is not None:
                    run = (run or 0.0) + serving.running
                if serving.kv_cache_usage_ratio is not None:
                    kv = max(kv or 0.0, serving.kv_cache_usage_ratio)
                if serving.max_batch_size is not None:
                    limit = max(limit or 0.0, serving.max_batch_size)
            if depth is not None:
                totals.append((sample.timestamp_seconds, depth))
            if run is not None:
                running.append(run)
            if kv is not None:
                kv_usage.append(kv)
        self.queues = len(self.series)
        self.max_batch_size = limit
        depths = [d for _, d in totals]
        self.depth_mean = _mean(depths)
        self.depth_max = max(depths) if depths else None
        self.depth_slope = _slope(totals)
        self.running_mean = _mean(running)
        self.kv_usage_mean = _mean(kv_usage)
        # a server lists each class's queue whether or not the class came: the classes served
        self.classes = tuple(sorted(c for c in classes if not self._idle(c)))
        self.elapsed = samples[-1].timestamp_seconds - (
            before.timestamp_seconds if before is not None else samples[0].timestamp_seconds
        )

    def _idle(self, service_class: str) -> bool:
        """Its queues held no request waiting and completed none over the window (where they
        count completions: without a count, who can say). What runs is no test: a server may
        report its batch as a whole on one class's series."""
        for key, series in self.series.items():
            if key[3] != service_class:
                continue
            first = self.baseline.get(key, series[0][1])
            last = series[-1][1]
            done = _increase(
                last.request_duration_seconds_count, first.request_duration_seconds_count
            )
            if done is None or done > 0:
                return False
            if any((s.queue_depth or 0) > 0 for _, s in series):
                return False
        return True

    def _increases(self, name: str) -> list[float]:
        out = []
        for key, series in self.series.items():
            first = self.baseline.get(key, series[0][1])
            value = _increase(getattr(series[-1][1], name), getattr(first, name))
            if value is not None:
                out.append(value)
        return out

    def _by_class(self, name: str) -> dict[str, float | None]:
        """The increase of counter ``name`` over the window per service class, summed over the
        class's queues (None where one of them does not report it)."""
        out: dict[str, float | None] = {}
        for key, series in self.series.items():
            serving = series[-1][1]
            if serving.service_class is None:
                continue
            first = self.baseline.get(key, series[0][1])
            value = _increase(getattr(serving, name), getattr(first, name))
            mine = out.get(serving.service_class, 0.0)
            out[serving.service_class] = None if value is None or mine is None else mine + value
        return out

    def _class_means(self, sums: Mapping[str, float | None]) -> dict[str, float]:
        """Each class's mean request duration over the window, where it completed any, from
        its summed durations (``_by_class("request_duration_seconds_sum")``)."""
        counts = self._by_class("request_duration_seconds_count")
        return {
            c: total / count
            for c, total in sums.items()
            if total is not None and total > 0 and (count := counts.get(c))
        }

    def class_duration_ratio(self) -> float | None:
        means = list(self._class_means(self._by_class("request_duration_seconds_sum")).values())
        return max(means) / min(means) if len(means) >= 2 else None

    def slow_class_work_share(self) -> float | None:
        durations = self._by_class("request_duration_seconds_sum")
        means = self._class_means(durations)
        if len(means) < 2:
            return None
        waits = self._by_class("batch_assembly_delay_seconds_sum")
        served: dict[str, float] = {}
        for c in means:
            duration, wait = durations.get(c), waits.get(c)
            if duration is None or wait is None:
                return None
            served[c] = max(0.0, duration - wait)
        total = sum(served.values())
        slowest = max(means, key=lambda c: (means[c], c))
        return served[slowest] / total if total > 0 else None

    def increase_of(self, name: str) -> float | None:
        values = self._increases(name)
        return sum(values) if values else None

    def rate_of(self, name: str) -> float | None:
        total = self.increase_of(name)
        if total is None or self.elapsed <= 0:
            return None
        return total / self.elapsed

    def mean_of(self, stem: str) -> float | None:
        """Mean per event over the window from a cumulative ``stem_sum`` and ``stem_count``."""
        sums = self._increases(f"{stem}_sum")
        counts = self._increases(f"{stem}_count")
        if not counts or sum(counts) <= 0 or len(sums) != len(counts):
            return None
        return sum(sums) / sum(counts)


def _number(row: dict[str, str], column: str) -> float | None:
    text = row.get(column, "")
    return float(text) if text not in ("", None) else None


def frames_from_lab_rows(
    rows: Iterable[dict[str, str]], *, window_seconds: float, host: str
) -> Iterator[GpuFrame]:
    """Frames from a lab run's ``frames.csv`` (one row per GPU per sample period).

    The CSV is what the lab records beside its snapshots (alone with ``--no-snapshots``):
    per-period figures, times in seconds since the run's start, no host or process series,
    clock or power limits or queue names (those frames say None; ``sources.lab_run_shortfall``
    says so to the user).
    """
    by_window: dict[int, dict[int, list[dict[str, str]]]] = {}
    period: float | None = None
    first_t: float | None = None
    for row in rows:
        t = float(row["t"])
        if first_t is None:
            first_t = t
        elif period is None and t > first_t:
            period = t - first_t
        index = window_index(t, 0.0, window_seconds)
        by_window.setdefault(index, {}).setdefault(int(row["gpu"]), []).append(row)
    period = period or first_t or 1.0
    expected = max(1, round(window_seconds / period))
    for index in sorted(by_window):
        t_start = index * window_seconds
        for gpu, gpu_rows in sorted(by_window[index].items()):
            yield _lab_frame(
                gpu_rows, host, gpu, t_start, t_start + window_seconds, expected, period
            )


def _lab_frame(
    rows: Sequence[dict[str, str]],
    host: str,
    gpu: int,
    t_start: float,
    t_end: float,
    expected: int,
    period: float,
) -> GpuFrame:
    live = [r for r in rows if r["lost"] != "1"]

    def values(column: str) -> list[float]:
        return [v for r in live if (v := _number(r, column)) is not None]

    utilization = values("utilization")
    # instant depths, as a sampled source has them (the CSV's time-integral mean is finer,
    # but frames must mean the same whatever their source)
    depths = [(float(r["t"]), v) for r in live if (v := _number(r, "queue_depth")) is not None]
    batches = values("batches")
    batch_sizes = values("batch_size_mean")
    delays = values("batch_delay_seconds")
    completed = values("requests_completed")
    failures = values("allocation_failures_total")
    # a frames.csv written before the token columns: unknown
    prompt, generated = values("prompt_tokens"), values("generation_tokens")
    reasons = [frozenset(r["throttle_reasons"].split("|")) - {""} for r in live]
    last = live[-1] if live else None
    seconds = len(live) * period
    batch_total = sum(batches)
    return GpuFrame(
        host=host,
        gpu=gpu,
        uuid=rows[-1]["uuid"],
        card=rows[-1]["card"] or None,
        t_start=t_start,
        t_end=t_end,
        sample_count=len(live),
        expected_sample_count=expected,
        lost=len(live) < len(rows),
        utilization_mean_ratio=_mean(utilization),
        utilization_p95_ratio=_p95(utilization),
        memory_used_bytes=None if last is None else int(float(last["memory_used_bytes"])),
        memory_total_bytes=None if last is None else int(float(last["memory_total_bytes"])),
        memory_used_slope_bytes_per_second=_slope(
            [(float(r["t"]), float(r["memory_used_bytes"])) for r in live]
        ),
        sm_clock_ratio=None,  # the CSV has no maximum clock
        throttled_ratio=(
            sum(1 for r in reasons if r & SLOWDOWN_REASONS) / len(reasons) if reasons else None
        ),
        throttle_reasons=frozenset().union(*reasons) & SLOWDOWN_REASONS,
        power_ratio=None,
        temperature_celsius=_mean(values("temperature_celsius")),
        serving_queues=1 if live else 0,
        queue_depth_mean=_mean([d for _, d in depths]),
        queue_depth_max=max(values("queue_depth"), default=None),
        queue_depth_slope_per_second=_slope(depths),
        running_mean=_mean(values("running")),
        batch_delay_seconds=(
            sum(d * b for d, b in zip(delays, batches, strict=False)) / batch_total
            if batch_total
            else None
        ),
        request_duration_seconds=None,
        batch_size_mean=(
            sum(s * b for s, b in zip(batch_sizes, batches, strict=False)) / batch_total
            if batch_total
            else None
        ),
        completions_per_second=sum(completed) / seconds if seconds else None,
        allocation_failures=(failures[-1] - failures[0]) if len(failures) > 1 else None,
        service_classes=(),
        queue_names=(),
        feeder_processes=1 if live else 0,
        feeder_cpu_cores_max=max(values("worker_cpu_cores"), default=None),
        # a frames.csv written before the column: unknown
        kv_cache_usage_ratio=_mean(values("kv_cache_usage_ratio")),
        max_batch_size=max(values("max_batch_size"), default=None),
        prompt_tokens_per_second=sum(prompt) / seconds if prompt and seconds else None,
        generation_tokens_per_second=sum(generated) / seconds if generated and seconds else None,
        feeder_read_bytes_per_second=None,
        host_cpu_busy_ratio=None,
        host_cpu_pressure_ratio=None,
        host_io_pressure_ratio=None,
        host_iowait_ratio=None,
    )
