"""Features: each GPU's frame against its peers in the same window and against its own past.

Every feature is dimensionless or in a named unit, so that a model trained on one mix of
cards, models and rates reads another: queues are counted in batches, throughput against the
GPU's own best and its peers', utilization together with how full its batches run (NVML
utilization counts any kernel and saturates long before a card is full).

Peers are the GPUs of the same host that serve the same queues (the same model or engine);
against them each figure also gets a robust z-score (median and MAD), as the best fleet
diagnosers compare a machine with the machines that should look like it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpubalance.analyzer.frames import GpuFrame

# a queue is "waiting work" when it holds at least this share of a batch on average
QUEUED_BATCHES = 0.5
# how many past windows a GPU's own best and trends look back over
HISTORY_WINDOWS = 20

COLUMNS: tuple[str, ...] = (
    "coverage_ratio",
    "utilization_ratio",
    "utilization_p95_ratio",
    "batch_fill_ratio",
    "effective_utilization_ratio",
    "queue_batches",
    "queue_max_batches",
    "queue_slope_batches_per_window",
    "batch_delay_share",
    "throughput_vs_own_best_ratio",
    "throughput_vs_peers_ratio",
    "throughput_share_vs_equal_ratio",
    "utilization_peer_z",
    "effective_utilization_peer_z",
    "queue_peer_z",
    "throughput_peer_z",
    "peer_count",
    "peer_queue_max_batches",
    "peer_effective_utilization_max",
    "peer_effective_utilization_min",
    "pool_effective_utilization_mean",
    "pool_queue_batches_mean",
    "pool_busy_share",
    "idle_while_peer_queued",
    "clock_ratio",
    "throttled_ratio",
    "feeder_cpu_cores",
    "feeder_cpu_pinned",
    "host_cpu_pressure_ratio",
    "host_io_pressure_ratio",
    "host_iowait_ratio",
    "memory_used_ratio",
    "memory_growth_ratio_per_window",
    "allocation_failures_per_completion",
    "serving_present",
)


@dataclass(frozen=True, slots=True)
class FeatureTable:
    """One row per frame; columns are :data:`COLUMNS`; NaN where the telemetry does not say."""

    frames: tuple[GpuFrame, ...]
    values: np.ndarray  # shape (len(frames), len(COLUMNS)), float64
    columns: tuple[str, ...] = COLUMNS

    def column(self, name: str) -> np.ndarray:
        return self.values[:, self.columns.index(name)]

    def row(self, index: int) -> dict[str, float]:
        return dict(zip(self.columns, self.values[index].tolist(), strict=True))


@dataclass
class _Past:
    """What one GPU's earlier windows say."""

    completions: list[float] = field(default_factory=list)  # windows with work waiting
    batch_sizes: list[float] = field(default_factory=list)
    memory: list[tuple[float, float]] = field(default_factory=list)  # (t_end, used ratio)


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _robust_z(value: float, others: Sequence[float]) -> float:
    if math.isnan(value):
        return math.nan
    values = [v for v in others if not math.isnan(v)]
    if len(values) < 2:
        return 0.0
    median = float(np.median(values))
    mad = float(np.median([abs(v - median) for v in values]))
    # a floor on the spread: identical peers must not turn a rounding error into a verdict
    scale = max(1.4826 * mad, 0.05 * abs(median), 0.02)
    return max(-10.0, min(10.0, (value - median) / scale))


def _theil_sen(points: Sequence[tuple[float, float]]) -> float | None:
    """Median of the pairwise slopes: one step (a model load) does not make a trend."""
    if len(points) < 3:
        return None
    slopes = [
        (y2 - y1) / (t2 - t1)
        for i, (t1, y1) in enumerate(points)
        for t2, y2 in points[i + 1 :]
        if t2 > t1
    ]
    return float(np.median(slopes)) if slopes else None


def _pools(frames: Sequence[GpuFrame]) -> dict[tuple[str, tuple[str, ...]], list[GpuFrame]]:
    pools: dict[tuple[str, tuple[str, ...]], list[GpuFrame]] = {}
    for frame in frames:
        pools.setdefault((frame.host, frame.queue_names), []).append(frame)
    return pools


class FeatureBuilder:
    """Frames (in time order, any hosts) to a :class:`FeatureTable`.

    A transformer in scikit-learn's sense, with nothing to fit: a GPU's own history is the
    frames before it in the same call.
    """

    def __init__(self, history_windows: int = HISTORY_WINDOWS) -> None:
        self.history_windows = history_windows

    def transform(self, frames: Iterable[GpuFrame]) -> FeatureTable:
        ordered = sorted(frames, key=lambda f: (f.t_start, f.host, f.gpu))
        past: dict[tuple[str, str], _Past] = {}
        rows: list[list[float]] = []
        kept: list[GpuFrame] = []
        start = 0
        while start < len(ordered):
            end = start
            while end < len(ordered) and ordered[end].t_start == ordered[start].t_start:
                end += 1
            window = ordered[start:end]
            for pool in _pools(window).values():
                pasts = [past.setdefault((f.host, f.uuid), _Past()) for f in pool]
                # peers run the same queues, so the same largest batch: a starved GPU that never
                # filled one is measured against what its busiest peer reached
                largest = max(
                    [1.0]
                    + [b for p in pasts for b in p.batch_sizes]
                    + [f.batch_size_mean for f in pool if f.batch_size_mean is not None]
                )
                base = [self._base(f, largest) for f in pool]
                for frame, own, mine in zip(pool, base, pasts, strict=True):
                    rows.append(self._row(frame, own, base, mine))
                    kept.append(frame)
            for frame in window:
                self._remember(frame, past.setdefault((frame.host, frame.uuid), _Past()))
            start = end
        values = np.array(rows, dtype=np.float64).reshape(len(rows), len(COLUMNS))
        return FeatureTable(tuple(kept), values)

    def _base(self, frame: GpuFrame, largest: float) -> dict[str, float]:
        """Figures of one frame that its peers' rows use too."""
        fill = _nan(frame.batch_size_mean) / largest
        utilization = _nan(frame.utilization_mean_ratio)
        queue = _nan(frame.queue_depth_mean) / largest
        completions = _nan(frame.completions_per_second)
        live = frame.sample_count > 0 and not frame.lost
        return {
            "largest": largest,
            "fill": fill,
            "utilization": utilization if live else math.nan,
            "effective": utilization * fill if live else math.nan,
            "queue": queue if live else math.nan,
            "completions": completions if live else math.nan,
        }

    def _row(
        self,
        frame: GpuFrame,
        own: dict[str, float],
        pool: list[dict[str, float]],
        past: _Past,
    ) -> list[float]:
        peers = [p for p in pool if p is not own]
        largest = own["largest"]
        current = own["completions"] if not math.isnan(own["completions"]) else 0.0
        best = max([*past.completions, current])
        peer_completions = [p["completions"] for p in peers if not math.isnan(p["completions"])]
        all_completions = [p["completions"] for p in pool if not math.isnan(p["completions"])]
        peer_queue = [p["queue"] for p in peers if not math.isnan(p["queue"])]
        peer_effective = [p["effective"] for p in peers if not math.isnan(p["effective"])]
        pool_effective = [p["effective"] for p in pool if not math.isnan(p["effective"])]
        pool_queue = [p["queue"] for p in pool if not math.isnan(p["queue"])]
        total = sum(all_completions)
        mean_peer = float(np.mean(peer_completions)) if peer_completions else math.nan
        memory_ratio = (
            frame.memory_used_bytes / frame.memory_total_bytes
            if frame.memory_used_bytes is not None and frame.memory_total_bytes
            else math.nan
        )
        growth = math.nan
        if not math.isnan(memory_ratio):
            slope = _theil_sen([*past.memory, (frame.t_end, memory_ratio)])
            growth = math.nan if slope is None else slope * frame.seconds
        clock = frame.sm_clock_ratio
        if clock is None and frame.throttled_ratio is not None:
            clock = 1.0 - 0.5 * frame.throttled_ratio  # no clocks: throttled time as a proxy
        cores = _nan(frame.feeder_cpu_cores_max)
        completions = own["completions"]
        failures = _nan(frame.allocation_failures)
        peer_queued = bool(peer_queue) and max(peer_queue) >= QUEUED_BATCHES
        values = {
            "coverage_ratio": frame.coverage_ratio,
            "utilization_ratio": own["utilization"],
            "utilization_p95_ratio": _nan(frame.utilization_p95_ratio),
            "batch_fill_ratio": own["fill"],
            "effective_utilization_ratio": own["effective"],
            "queue_batches": own["queue"],
            "queue_max_batches": _nan(frame.queue_depth_max) / largest,
            "queue_slope_batches_per_window": _nan(frame.queue_depth_slope_per_second)
            * frame.seconds
            / largest,
            "batch_delay_share": (
                frame.batch_delay_seconds / frame.request_duration_seconds
                if frame.batch_delay_seconds is not None and frame.request_duration_seconds
                else math.nan
            ),
            "throughput_vs_own_best_ratio": completions / best if best > 0 else math.nan,
            "throughput_vs_peers_ratio": completions / mean_peer if mean_peer > 0 else math.nan,
            "throughput_share_vs_equal_ratio": (
                completions * len(all_completions) / total if total > 0 else math.nan
            ),
            "utilization_peer_z": _robust_z(own["utilization"], [p["utilization"] for p in pool]),
            "effective_utilization_peer_z": _robust_z(
                own["effective"], [p["effective"] for p in pool]
            ),
            "queue_peer_z": _robust_z(own["queue"], [p["queue"] for p in pool]),
            "throughput_peer_z": _robust_z(completions, [p["completions"] for p in pool]),
            "peer_count": float(len(peers)),
            "peer_queue_max_batches": max(peer_queue) if peer_queue else math.nan,
            "peer_effective_utilization_max": max(peer_effective) if peer_effective else math.nan,
            "peer_effective_utilization_min": min(peer_effective) if peer_effective else math.nan,
            "pool_effective_utilization_mean": float(np.mean(pool_effective))
            if pool_effective
            else math.nan,
            "pool_queue_batches_mean": float(np.mean(pool_queue)) if pool_queue else math.nan,
            "pool_busy_share": (
                sum(1 for q in pool_queue if q >= QUEUED_BATCHES) / len(pool_queue)
                if pool_queue
                else math.nan
            ),
            "idle_while_peer_queued": (
                (1.0 - min(1.0, own["effective"])) * float(peer_queued)
                if not math.isnan(own["effective"])
                else math.nan
            ),
            "clock_ratio": _nan(clock),
            "throttled_ratio": _nan(frame.throttled_ratio),
            "feeder_cpu_cores": cores,
            # a feeding process near a whole number of busy cores is pinned at its threads
            "feeder_cpu_pinned": (
                max(0.0, 1.0 - abs(cores - round(cores)) * 5) if cores >= 0.9 else 0.0
            )
            if not math.isnan(cores)
            else math.nan,
            "host_cpu_pressure_ratio": _nan(frame.host_cpu_pressure_ratio),
            "host_io_pressure_ratio": _nan(frame.host_io_pressure_ratio),
            "host_iowait_ratio": _nan(frame.host_iowait_ratio),
            "memory_used_ratio": memory_ratio,
            "memory_growth_ratio_per_window": growth,
            "allocation_failures_per_completion": (
                failures / max(1.0, completions * frame.seconds)
                if not math.isnan(failures) and not math.isnan(completions)
                else failures
            ),
            "serving_present": float(frame.serving_queues > 0),
        }
        return [values[name] for name in COLUMNS]

    def _remember(self, frame: GpuFrame, past: _Past) -> None:
        if frame.sample_count == 0 or frame.lost:
            return
        if frame.batch_size_mean is not None:
            past.batch_sizes.append(frame.batch_size_mean)
        if frame.completions_per_second is not None and (frame.queue_depth_mean or 0.0) > 0:
            past.completions.append(frame.completions_per_second)
        if frame.memory_used_bytes is not None and frame.memory_total_bytes:
            past.memory.append((frame.t_end, frame.memory_used_bytes / frame.memory_total_bytes))
        for series in (past.batch_sizes, past.completions, past.memory):
            del series[: -self.history_windows]
