"""Window figures: what the last N seconds of samples say beyond the latest one.

Counters become rates, NVML utilization samples become a mean, memory used becomes a trend
(a robust slope, and a time to full when the growth is real). Pure functions of the history:
they run once per sample in the sampler thread, never per scrape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import islice

import numpy as np

from gpubalance.telemetry import (
    SLOWDOWN_REASONS,
    DiskWindow,
    GpuSample,
    GpuWindow,
    HostSample,
    HostWindow,
    NetworkWindow,
    ProcessWindow,
    Sample,
    ServingSample,
    ServingWindow,
    Window,
)


@dataclass(frozen=True, slots=True)
class TrendRule:
    """When memory used is worth a slope, and when that slope is worth a time to full.

    GPU memory moves in steps (a model load, an allocator segment) more than in lines: a slope
    through a few points or over a short span turns one step into a fast "leak". So the slope
    needs ``min_points`` readings spanning ``min_span_ratio`` of the trend window, and is the
    Theil-Sen estimate (the median of the pairwise slopes), which a step near either end of the
    span does not move. A time to full is given only for growth that is real: the slope's 95 %
    confidence interval (Sen's) lies above zero, and the line fits the readings better (sum of
    squared residuals) than the best single step does. One step, wherever it falls in the span,
    fails the second test, and so do two even steps; a steady leak, or one in three steps or
    more, passes.
    """

    min_points: int = 10
    min_span_ratio: float = 0.5
    # Beyond this many readings the fit runs on medians of runs of consecutive readings: the
    # cost stays bounded (max_points**2 / 2 pairs per GPU) whatever the trend window holds.
    max_points: int = 64


DEFAULT_TREND = TrendRule()
Z_95 = 1.959964  # two-sided 95 % quantile of the normal distribution


def compute_window(
    history: Sequence[Sample],
    seconds: float,
    trend_seconds: float,
    trend_rule: TrendRule = DEFAULT_TREND,
) -> Window:
    """Window figures for the last ``seconds`` (trends over ``trend_seconds``) of ``history``."""
    if not history:
        return Window(start_seconds=0.0, end_seconds=0.0)
    last = history[-1]
    end = last.timestamp_seconds
    recent = _since(history, end - seconds)
    first = recent[0]
    memory = _memory_readings(_since(history, end - trend_seconds))
    min_span = trend_rule.min_span_ratio * trend_seconds
    return Window(
        start_seconds=first.timestamp_seconds,
        end_seconds=end,
        gpus=tuple(
            _gpu_window(
                gpu,
                recent,
                end - seconds,
                _memory_trend(gpu, memory.get(gpu.uuid), trend_rule, min_span),
            )
            for gpu in last.gpus
        ),
        host=_host_window(first.host, last.host, end - first.timestamp_seconds),
        processes=_process_windows(recent),
        serving=_serving_windows(recent),
    )


def _since(history: Sequence[Sample], start: float) -> Sequence[Sample]:
    # History is short (minutes of samples) and ordered: walk back from the end.
    i = len(history) - 1
    while i > 0 and history[i - 1].timestamp_seconds >= start:
        i -= 1
    return list(islice(history, i, None))  # history may be a deque: no slicing


def _same_gpu(sample: Sample, uuid: str) -> GpuSample | None:
    for gpu in sample.gpus:
        if gpu.uuid == uuid:
            return gpu
    return None


def _gpu_window(
    gpu: GpuSample,
    recent: Sequence[Sample],
    start: float,
    trend: tuple[float | None, float | None],
) -> GpuWindow:
    series = [g for s in recent if (g := _same_gpu(s, gpu.uuid)) is not None and not g.lost]
    nvml_samples = [v for g in series for (t, v) in g.utilization_samples if t >= start]
    if nvml_samples:
        utilization: float | None = sum(nvml_samples) / len(nvml_samples)
        source: str | None = "samples"
        count = len(nvml_samples)
    else:
        rates = [g.utilization_ratio for g in series if g.utilization_ratio is not None]
        utilization = sum(rates) / len(rates) if rates else None
        source = "rates" if rates else None
        count = len(rates)
    slope, time_to_full = trend
    reasons = [g.throttle_reasons for g in series if g.throttle_reasons is not None]
    throttled = sum(1 for r in reasons if r & SLOWDOWN_REASONS) / len(reasons) if reasons else None
    return GpuWindow(
        index=gpu.index,
        uuid=gpu.uuid,
        utilization_ratio=utilization,
        utilization_source=source,
        utilization_sample_count=count,
        memory_used_slope_bytes_per_second=slope,
        memory_time_to_full_seconds=time_to_full,
        throttled_ratio=throttled,
    )


def _memory_readings(trend: Sequence[Sample]) -> dict[str, tuple[list[float], list[int]]]:
    """Per GPU (by UUID), the times and memory used of its readings: one pass for all GPUs."""
    readings: dict[str, tuple[list[float], list[int]]] = {}
    for sample in trend:
        for gpu in sample.gpus:
            if gpu.memory_used_bytes is not None:
                times, used = readings.setdefault(gpu.uuid, ([], []))
                times.append(sample.timestamp_seconds)
                used.append(gpu.memory_used_bytes)
    return readings


def _memory_trend(
    gpu: GpuSample,
    readings: tuple[list[float], list[int]] | None,
    rule: TrendRule,
    min_span: float,
) -> tuple[float | None, float | None]:
    """Slope of memory used (bytes/s) and time to full (s); None where the history cannot say."""
    if readings is None or len(readings[0]) < rule.min_points:
        return None, None
    t = np.array(readings[0])
    y = np.array(readings[1], dtype=float)
    # from the first reading: epoch seconds would cost the pairwise differences their
    # precision; centred: so would the running sums of squares in _one_step_error
    t, y = _medians_of_runs(t - t[0], y - y.mean(), rule.max_points)
    span = t[-1] - t[0]
    if not span > 0 or span < min_span:  # not > 0: the wall clock stepped back
        return None, None
    slope, lower = _theil_sen(t, y)
    residuals = y - slope * t
    line_error = float(np.sum((residuals - residuals.mean()) ** 2))
    if lower <= 0 or line_error >= _one_step_error(y) or gpu.memory_free_bytes is None:
        return slope, None
    return slope, gpu.memory_free_bytes / slope


def _medians_of_runs(
    t: np.ndarray, y: np.ndarray, max_points: int
) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points: the medians of runs of consecutive points (the oldest
    points that do not fill a run are left out; of an even run, the lower middle one)."""
    n = len(t)
    if n <= max_points:
        return t, y
    run = -(-n // max_points)
    runs = n // run
    middle = (run - 1) // 2
    t = t[n - runs * run :].reshape(runs, run)[:, middle]  # times are in order already
    y = np.partition(y[n - runs * run :].reshape(runs, run), middle, axis=1)[:, middle]
    return t, y


@cache  # one entry per point count, at most max_points of them
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, 1)


def _theil_sen(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Median of the pairwise slopes, and the lower end of its 95 % confidence interval (Sen
    1968: a rank from the variance of Kendall's S; without the tie correction, so a little
    wider, the cautious side)."""
    i, j = _pairs(len(t))
    dt = t[j] - t[i]
    valid = dt > 0
    slopes = (y[j] - y[i])[valid] / dt[valid]
    n = len(t)
    spread = Z_95 * np.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    low = max(round((len(slopes) - spread) / 2) - 1, 0)
    return float(np.median(slopes)), float(np.partition(slopes, low)[low])


def _one_step_error(y: np.ndarray) -> float:
    """Least sum of squared residuals of a single step: a level before some point, another
    after it (every split at once, from running sums)."""
    n = len(y)
    total, squares = np.cumsum(y), np.cumsum(y * y)
    before = np.arange(1, n)
    left = squares[:-1] - total[:-1] ** 2 / before
    right = (squares[-1] - squares[:-1]) - (total[-1] - total[:-1]) ** 2 / (n - before)
    return float(np.min(left + right))


def _rate(new: float, old: float, seconds: float) -> float:
    # A counter that went backwards was reset (device re-added, exporter restarted the
    # source): count from zero rather than report a negative rate.
    delta = new - old
    if delta < 0:
        delta = new
    return delta / seconds if seconds > 0 else 0.0


def _host_window(
    first: HostSample | None, last: HostSample | None, elapsed: float
) -> HostWindow | None:
    if first is None or last is None or first is last or elapsed <= 0:
        return None
    old_cpus = {c.cpu: c for c in first.cpus}
    busy: list[float] = []
    iowait_total = total_total = 0.0
    for cpu in last.cpus:
        old = old_cpus.get(cpu.cpu)
        if old is None:
            busy.append(0.0)
            continue
        total = cpu.total_seconds - old.total_seconds
        busy.append(
            min(1.0, max(0.0, (cpu.busy_seconds - old.busy_seconds) / total)) if total > 0 else 0.0
        )
        iowait_total += max(0.0, cpu.iowait_seconds - old.iowait_seconds)
        total_total += max(0.0, total)
    old_disks = {d.device: d for d in first.disks}
    disks = []
    for disk in last.disks:
        old = old_disks.get(disk.device)
        if old is None:
            continue
        ios = (disk.reads_total + disk.writes_total) - (old.reads_total + old.writes_total)
        waited = (disk.read_time_seconds_total + disk.write_time_seconds_total) - (
            old.read_time_seconds_total + old.write_time_seconds_total
        )
        disks.append(
            DiskWindow(
                device=disk.device,
                read_bytes_per_second=_rate(disk.read_bytes_total, old.read_bytes_total, elapsed),
                written_bytes_per_second=_rate(
                    disk.written_bytes_total, old.written_bytes_total, elapsed
                ),
                await_seconds=waited / ios if ios > 0 and waited >= 0 else None,
                busy_ratio=min(
                    1.0,
                    _rate(disk.io_time_seconds_total, old.io_time_seconds_total, elapsed),
                ),
            )
        )
    old_nets = {n.device: n for n in first.networks}
    networks = []
    for net in last.networks:
        old = old_nets.get(net.device)
        if old is None:
            continue
        networks.append(
            NetworkWindow(
                device=net.device,
                receive_bytes_per_second=_rate(
                    net.receive_bytes_total, old.receive_bytes_total, elapsed
                ),
                transmit_bytes_per_second=_rate(
                    net.transmit_bytes_total, old.transmit_bytes_total, elapsed
                ),
                errors_per_second=_rate(
                    net.receive_errors_total + net.transmit_errors_total,
                    old.receive_errors_total + old.transmit_errors_total,
                    elapsed,
                ),
                drops_per_second=_rate(
                    net.receive_drops_total + net.transmit_drops_total,
                    old.receive_drops_total + old.transmit_drops_total,
                    elapsed,
                ),
            )
        )
    retransmit: float | None = None
    if (
        last.tcp_out_segments_total is not None
        and first.tcp_out_segments_total is not None
        and last.tcp_retransmitted_segments_total is not None
        and first.tcp_retransmitted_segments_total is not None
    ):
        sent = last.tcp_out_segments_total - first.tcp_out_segments_total
        resent = last.tcp_retransmitted_segments_total - first.tcp_retransmitted_segments_total
        retransmit = resent / sent if sent > 0 and resent >= 0 else None
    return HostWindow(
        cpu_busy_ratio=tuple(busy),
        cpu_iowait_ratio=iowait_total / total_total if total_total > 0 else 0.0,
        disks=tuple(disks),
        networks=tuple(networks),
        tcp_retransmit_ratio=retransmit,
    )


def _process_windows(recent: Sequence[Sample]) -> dict[int, ProcessWindow]:
    last = recent[-1]
    windows: dict[int, ProcessWindow] = {}
    for pid, stats in last.processes.items():
        # The oldest sample of the same process (same pid and start time) in the window.
        first = next(
            (
                (s.timestamp_seconds, p)
                for s in recent
                if (p := s.processes.get(pid)) is not None
                and p.create_time_seconds == stats.create_time_seconds
            ),
            None,
        )
        if first is None:
            continue
        start, old = first
        elapsed = last.timestamp_seconds - start
        if elapsed <= 0 or old is stats:
            continue
        windows[pid] = ProcessWindow(
            pid=pid,
            cpu_usage_ratio=max(0.0, stats.cpu_seconds_total - old.cpu_seconds_total) / elapsed,
            read_bytes_per_second=(
                None
                if stats.read_bytes_total is None or old.read_bytes_total is None
                else _rate(stats.read_bytes_total, old.read_bytes_total, elapsed)
            ),
            written_bytes_per_second=(
                None
                if stats.written_bytes_total is None or old.written_bytes_total is None
                else _rate(stats.written_bytes_total, old.written_bytes_total, elapsed)
            ),
        )
    return windows


def _mean_of_delta(
    first: ServingSample, last: ServingSample, total: str, count: str
) -> float | None:
    """Mean per event over the window from a cumulative sum and count (histogram style)."""
    values = [getattr(s, name) for s in (first, last) for name in (total, count)]
    if any(v is None for v in values):
        return None
    d_sum, d_count = values[2] - values[0], values[3] - values[1]
    if d_count <= 0 or d_sum < 0:
        return None  # nothing happened in the window, or the source restarted
    return d_sum / d_count


def _serving_windows(recent: Sequence[Sample]) -> tuple[ServingWindow, ...]:
    """A window per queue of the latest sample, from that queue's samples in ``recent``.

    A queue is (worker, source, queue); each sample is indexed once, so the cost grows with
    samples times queues, not with the square of the queues.
    """
    series: dict[tuple[str, str, str], list[tuple[float, ServingSample]]] = {}
    for sample in recent:
        seen: set[tuple[str, str, str]] = set()
        for serving in sample.serving:
            key = (serving.worker, serving.source, serving.queue)
            if key not in seen:  # a queue reported twice in one sample counts once
                seen.add(key)
                series.setdefault(key, []).append((sample.timestamp_seconds, serving))
    end = recent[-1].timestamp_seconds
    return tuple(
        _serving_window(serving, series[(serving.worker, serving.source, serving.queue)], end)
        for serving in recent[-1].serving
    )


def _serving_window(
    serving: ServingSample, series: Sequence[tuple[float, ServingSample]], end: float
) -> ServingWindow:
    start, first = series[0]
    depths = [s.queue_depth for _, s in series if s.queue_depth is not None]
    elapsed = end - start

    def per_second(counter: str) -> float | None:
        new, old = getattr(serving, counter), getattr(first, counter)
        if elapsed <= 0 or first is serving or new is None or old is None:
            return None
        return _rate(new, old, elapsed)

    return ServingWindow(
        worker=serving.worker,
        source=serving.source,
        gpu_index=serving.gpu_index,
        gpu_uuid=serving.gpu_uuid,
        service_class=serving.service_class,
        queue=serving.queue,
        tenant=serving.tenant,
        queue_depth_mean=sum(depths) / len(depths) if depths else None,
        batch_assembly_delay_seconds=_mean_of_delta(
            first,
            serving,
            "batch_assembly_delay_seconds_sum",
            "batch_assembly_delay_seconds_count",
        ),
        batch_size_mean=_mean_of_delta(first, serving, "batch_size_sum", "batch_size_count"),
        request_duration_seconds=_mean_of_delta(
            first, serving, "request_duration_seconds_sum", "request_duration_seconds_count"
        ),
        requests_per_second=per_second("request_duration_seconds_count"),
        allocation_failures_per_second=per_second("allocation_failures_total"),
        prompt_tokens_per_second=per_second("prompt_tokens_total"),
        generation_tokens_per_second=per_second("generation_tokens_total"),
    )
