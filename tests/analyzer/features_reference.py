"""The feature builder as it was before it ran per pool and window in numpy, frozen.

tests/analyzer/test_features_equivalence.py holds today's FeatureBuilder to these numbers: the
trained model was fitted on them. Kept as it was (a row at a time in Python); change it only
with a feature's definition, and retrain the model with it (the full-batch cost's power law,
priced at the batches a GPU can run, 2026-12-05; its prior from the work's tokens,
2026-12-06).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpubalance.analyzer.features import (
    BATCH_TIME_EXPONENT,
    BATCH_TIME_PRIOR,
    DECODE_BATCH_EXPONENT,
    DECODE_STEP_PROMPT_TOKENS,
    KV_FULL_RATIO,
)
from gpubalance.analyzer.frames import GpuFrame

# a queue is "waiting work" when it holds at least this share of a batch on average
QUEUED_BATCHES = 0.5
# how many past windows a GPU's own best and trends look back over
HISTORY_WINDOWS = 20
# how many (batch size, batch time) points of one card on one pool the batch-time fit keeps
BATCH_POINTS = 60

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
    # the physics of the ground truth, estimated from telemetry
    "rho_estimate_ratio",
    "offered_rho_estimate_ratio",
    "capacity_vs_peers_ratio",
    "capacity_vs_peers_best_ratio",
    "work_share_vs_capacity_share_ratio",
    "peer_rho_estimate_max",
    "peer_rho_estimate_min",
    "pool_rho_estimate_mean",
    "peer_card_differs_share",
    "queued_unfilled_batches",
    "rho_fitted_ratio",
    "peer_rho_fitted_max",
    "pool_rho_fitted_mean",
    "pool_fair_rho_fitted_ratio",
    "batch_time_exponent",
    "batch_fit_measured_ratio",
    "prompt_tokens_per_request",
    "generation_tokens_per_request",
    "batch_wait_share_estimate",
    "service_class_count",
    "class_duration_ratio",
    "kv_cache_usage_ratio",
    "kv_cache_usage_peer_z",
    "queue_batches_previous",
    "effective_utilization_previous",
    "queue_batches_recent_mean",
    "effective_utilization_recent_mean",
    "rho_estimate_recent_mean",
    "windows_without_serving",
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


# one frame's figures that its peers' rows use too: floats, and its card and pool names
_Base = dict[str, Any]


@dataclass
class _Past:
    """What one GPU's earlier windows say."""

    completions: list[float] = field(default_factory=list)  # windows with work waiting
    batch_sizes: list[float] = field(default_factory=list)
    memory: list[tuple[float, float]] = field(default_factory=list)  # (t_end, used ratio)
    saturated: list[float] = field(default_factory=list)  # completions with a batch waiting
    queues: list[float] = field(default_factory=list)  # queue in batches, per window
    effective: list[float] = field(default_factory=list)  # utilization x batch fill
    rho: list[float] = field(default_factory=list)  # rho estimate, per window
    queue_names: tuple[str, ...] = ()  # the pool it last served
    without_serving: int = 0  # windows in a row with the GPU read and no serving queue up


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _median(values: Sequence[float]) -> float:
    """The median of a short list (numpy's costs more than the sort for a pool's GPUs)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _fair_rho(pool: Sequence[_Base]) -> float:
    """The pool's completions over its GPUs' capacity at full batches (1 / cost each)."""
    counted = [p for p in pool if not math.isnan(p["completions"]) and p["cost"] > 0]
    capacity = sum(1.0 / p["cost"] for p in counted)
    return min(sum(p["completions"] for p in counted) / capacity, 5.0) if capacity > 0 else math.nan


def _nanmean(values: Sequence[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return sum(known) / len(known) if known else math.nan


def _robust_z(value: float, others: Sequence[float]) -> float:
    if math.isnan(value):
        return math.nan
    values = [v for v in others if not math.isnan(v)]
    if len(values) < 2:
        return 0.0
    median = _median(values)
    mad = _median([abs(v - median) for v in values])
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
    return _median(slopes) if slopes else None


def _batch_point(frame: GpuFrame) -> tuple[float, float] | None:
    """(mean batch size, GPU seconds per batch) of a window: busy time over batches run."""
    size, utilization = frame.batch_size_mean, frame.utilization_mean_ratio
    completions = frame.completions_per_second
    if size is None or utilization is None or not completions or frame.lost:
        return None
    if size < 1 or utilization <= 0:
        return None
    return size, utilization * size / completions


def _full_batch_fit(
    points: Sequence[tuple[float, float]], largest: float, tokens: tuple[float, float] | None
) -> tuple[float, float, float]:
    """GPU seconds per request in batches of ``largest``, from a power law T = c * b ** a
    through the batch times T of batch sizes b: a is the slope of ln T on ln b with a ridge
    toward a prior, weighing BATCH_TIME_PRIOR of spread, within [0, 1]; with a and the share
    of a the spread decides. The prior: BATCH_TIME_EXPONENT, or where ``tokens`` (prompt and
    generated per request) are known, the prefill's share s of one request's time,
    P / (P + DECODE_STEP_PROMPT_TOKENS * G), plus DECODE_BATCH_EXPONENT of the rest."""
    prior = BATCH_TIME_EXPONENT
    if tokens is not None and tokens[0] + tokens[1] > 0:
        share = tokens[0] / (tokens[0] + DECODE_STEP_PROMPT_TOKENS * tokens[1])
        prior = share + (1 - share) * DECODE_BATCH_EXPONENT
    if not points:
        return math.nan, math.nan, math.nan
    n = len(points)
    xs = [math.log(b) for b, _ in points]
    ys = [math.log(t) for _, t in points]
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mean_x) ** 2 for x in xs)
    exponent = (sxy + BATCH_TIME_PRIOR * prior) / (sxx + BATCH_TIME_PRIOR)
    exponent = min(1.0, max(0.0, exponent))
    cost = math.exp(mean_y + exponent * (math.log(largest) - mean_x)) / largest
    return cost, exponent, sxx / (sxx + BATCH_TIME_PRIOR)


def _tokens_per_request(pool: Sequence[GpuFrame], card: str | None) -> tuple[float, float] | None:
    """Prompt and generated tokens per request answered on the pool's GPUs of ``card``, over
    those whose servers count both; None where none does."""
    counted = [
        f
        for f in pool
        if f.card == card
        and (f.completions_per_second or 0.0) > 0
        and f.prompt_tokens_per_second is not None
        and f.generation_tokens_per_second is not None
    ]
    answered = sum(_nan(f.completions_per_second) for f in counted)
    if not counted or answered <= 0:
        return None
    return (
        sum(_nan(f.prompt_tokens_per_second) for f in counted) / answered,
        sum(_nan(f.generation_tokens_per_second) for f in counted) / answered,
    )


def _reach(frame: GpuFrame, largest: float) -> float:
    """The largest batch a GPU can run: its limit (else the pool's largest), no more than
    its KV cache holds, never less than the batch it ran."""
    reach = frame.max_batch_size if frame.max_batch_size is not None else largest
    size = frame.batch_size_mean
    if size is not None and frame.kv_cache_usage_ratio:
        reach = min(reach, size * KV_FULL_RATIO / frame.kv_cache_usage_ratio)
    return max(reach, size) if size is not None else reach


def _pools(
    frames: Sequence[GpuFrame], pasts: dict[str, _Past]
) -> dict[tuple[str, tuple[str, ...]], list[GpuFrame]]:
    """GPUs of one host serving the same queues; a GPU whose queues vanished (a crashed
    worker, a lost GPU) stays in the pool it last served."""
    pools: dict[tuple[str, tuple[str, ...]], list[GpuFrame]] = {}
    for frame in frames:
        names = frame.queue_names or pasts[frame.uuid].queue_names
        pools.setdefault((frame.host, names), []).append(frame)
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
        # the most a card of one kind served on one pool's queues with work waiting: the
        # capacity of a GPU that has not been saturated itself
        card_best: dict[tuple[str | None, tuple[str, ...]], float] = {}
        # (batch size, GPU seconds per batch) of each card of a host on one pool's queues
        batches: dict[tuple[str, str | None, tuple[str, ...]], list[tuple[float, float]]] = {}
        rows: list[list[float]] = []
        kept: list[GpuFrame] = []
        start = 0
        while start < len(ordered):
            end = start
            while end < len(ordered) and ordered[end].t_start == ordered[start].t_start:
                end += 1
            window = ordered[start:end]
            pasts = {f.uuid: past.setdefault((f.host, f.uuid), _Past()) for f in window}
            bases: dict[str, _Base] = {}
            for pool in _pools(window, pasts).values():
                mine = [pasts[f.uuid] for f in pool]
                # peers run the same queues, so the same largest batch: a starved GPU that never
                # filled one is measured against what its busiest peer reached
                largest = max(
                    [1.0]
                    + [b for p in mine for b in p.batch_sizes]
                    + [f.batch_size_mean for f in pool if f.batch_size_mean is not None]
                )
                seen = {f.uuid: _batch_point(f) for f in pool}
                fits: dict[str | None, tuple[float, float, float]] = {}
                for frame, history in zip(pool, mine, strict=True):
                    if frame.card not in fits:
                        key = (frame.host, frame.card, frame.queue_names or history.queue_names)
                        points = batches.get(key, []) + [
                            point
                            for f in pool
                            if f.card == frame.card and (point := seen[f.uuid]) is not None
                        ]
                        reach = max(_reach(f, largest) for f in pool if f.card == frame.card)
                        fits[frame.card] = _full_batch_fit(
                            points, reach, _tokens_per_request(pool, frame.card)
                        )
                base = [
                    self._base(f, p, largest, card_best, fits[f.card])
                    for f, p in zip(pool, mine, strict=True)
                ]
                for frame, own, history in zip(pool, base, mine, strict=True):
                    rows.append(self._row(frame, own, base, history))
                    kept.append(frame)
                for frame, own in zip(pool, base, strict=True):
                    bases[frame.uuid] = own
                    if (point := seen[frame.uuid]) is not None:
                        series = batches.setdefault(
                            (frame.host, frame.card, own["queue_names"]), []
                        )
                        series.append(point)
                        del series[:-BATCH_POINTS]
                    if own["saturated"]:
                        key = (frame.card, own["queue_names"])
                        card_best[key] = max(card_best.get(key, 0.0), own["completions"])
            for frame in window:
                self._remember(frame, past[(frame.host, frame.uuid)], bases[frame.uuid])
            start = end
        values = np.array(rows, dtype=np.float64).reshape(len(rows), len(COLUMNS))
        return FeatureTable(tuple(kept), values)

    def _base(
        self,
        frame: GpuFrame,
        past: _Past,
        largest: float,
        card_best: dict[tuple[str | None, tuple[str, ...]], float],
        fit: tuple[float, float, float],
    ) -> _Base:
        """Figures of one frame that its peers' rows use too."""
        fill = _nan(frame.batch_size_mean) / largest
        utilization = _nan(frame.utilization_mean_ratio)
        queue = _nan(frame.queue_depth_mean) / largest
        completions = _nan(frame.completions_per_second)
        live = frame.sample_count > 0 and not frame.lost
        if not live:
            utilization = fill = queue = completions = math.nan
        effective = utilization * fill
        names = frame.queue_names or past.queue_names
        # a queue of half a batch or more all window: the GPU serves as fast as it can
        saturated = queue >= QUEUED_BATCHES and completions > 0
        best = max(
            [*past.saturated, card_best.get((frame.card, names), 0.0)]
            + ([completions] if saturated else [])
        )
        if best > 0:
            capacity = best
        elif effective > 0.05 and completions > 0:
            # batches take about as long whatever their size (decode is bound by memory), so a
            # GPU busy u of the time with batches f full would serve 1/(u*f) times as much
            capacity = completions / effective
        else:
            capacity = math.nan
        rho = completions / capacity if capacity > 0 else math.nan
        growth = max(0.0, _nan(frame.queue_depth_slope_per_second))
        cost, exponent, measured = fit
        fitted = completions * cost
        return {
            "largest": largest,
            "fill": fill,
            "utilization": utilization,
            "effective": effective,
            "queue": queue,
            "completions": completions,
            "saturated": float(saturated),
            "queue_names": names,
            "card": frame.card,
            "capacity": capacity,
            "rho": min(rho, 5.0),
            "rho_fitted": min(fitted, 5.0),
            "cost": cost,
            "exponent": exponent,
            "measured": measured,
            "kv": _nan(frame.kv_cache_usage_ratio) if live else math.nan,
            "offered": min((completions + growth) / capacity, 5.0) if capacity > 0 else math.nan,
        }

    def _row(
        self,
        frame: GpuFrame,
        own: _Base,
        pool: list[_Base],
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
        mean_peer = _mean(peer_completions)
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
            "pool_effective_utilization_mean": _mean(pool_effective),
            "pool_queue_batches_mean": _mean(pool_queue),
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
            **self._physics(frame, own, pool, peers, past),
        }
        return [values[name] for name in COLUMNS]

    @staticmethod
    def _physics(
        frame: GpuFrame,
        own: _Base,
        pool: list[_Base],
        peers: list[_Base],
        past: _Past,
    ) -> dict[str, float]:
        """The ground truth's quantities as telemetry estimates them: rho (the share of the
        window the GPU needs for its work at full batches), its capacity against its peers',
        and how the router splits work against capacity."""
        capacity, rho = own["capacity"], own["rho"]
        peer_capacity = [p["capacity"] for p in peers if p["capacity"] > 0]
        peer_rho = [p["rho"] for p in peers if not math.isnan(p["rho"])]
        pool_rho = [p["rho"] for p in pool if not math.isnan(p["rho"])]
        peer_fitted = [p["rho_fitted"] for p in peers if not math.isnan(p["rho_fitted"])]
        pool_fitted = [p["rho_fitted"] for p in pool if not math.isnan(p["rho_fitted"])]
        point = _batch_point(frame)
        busy = point[1] if point is not None else math.nan
        delay = _nan(frame.batch_delay_seconds)
        both = [p for p in pool if p["capacity"] > 0 and not math.isnan(p["completions"])]
        served = sum(p["completions"] for p in both)
        able = sum(p["capacity"] for p in both)
        work_share = math.nan
        if served > 0 and able > 0 and capacity > 0 and not math.isnan(own["completions"]):
            work_share = (own["completions"] / served) / (capacity / able)
        queues = [*past.queues[-2:], own["queue"]]
        effective = [*past.effective[-2:], own["effective"]]
        rhos = [*past.rho[-2:], rho]
        fill = own["fill"]
        return {
            "rho_fitted_ratio": own["rho_fitted"],
            # interactive requests that wait behind long batch-class ones in one queue
            "service_class_count": float(len(frame.service_classes)),
            "class_duration_ratio": _nan(frame.class_duration_ratio),
            "kv_cache_usage_ratio": own["kv"],
            "kv_cache_usage_peer_z": _robust_z(own["kv"], [p["kv"] for p in pool]),
            "peer_rho_fitted_max": max(peer_fitted) if peer_fitted else math.nan,
            "pool_rho_fitted_mean": _mean(pool_fitted),
            "pool_fair_rho_fitted_ratio": _fair_rho(pool),
            "batch_time_exponent": own["exponent"],
            "batch_fit_measured_ratio": own["measured"],
            "prompt_tokens_per_request": _per_request(frame.prompt_tokens_per_second, frame),
            "generation_tokens_per_request": _per_request(
                frame.generation_tokens_per_second, frame
            ),
            # the share of a batch cycle spent waiting for the batch to fill
            "batch_wait_share_estimate": delay / (delay + busy) if delay + busy > 0 else math.nan,
            "rho_estimate_ratio": rho,
            "offered_rho_estimate_ratio": own["offered"],
            "capacity_vs_peers_ratio": capacity / _median(peer_capacity)
            if peer_capacity and capacity > 0
            else math.nan,
            "capacity_vs_peers_best_ratio": capacity / max(peer_capacity)
            if peer_capacity and capacity > 0
            else math.nan,
            "work_share_vs_capacity_share_ratio": work_share,
            "peer_rho_estimate_max": max(peer_rho) if peer_rho else math.nan,
            "peer_rho_estimate_min": min(peer_rho) if peer_rho else math.nan,
            "pool_rho_estimate_mean": _mean(pool_rho),
            "peer_card_differs_share": (
                sum(1 for p in peers if p["card"] != own["card"]) / len(peers)
                if peers
                else math.nan
            ),
            # work waits yet batches run part full: something other than work limits them
            "queued_unfilled_batches": min(own["queue"], 4.0) * max(0.0, 1.0 - fill)
            if not math.isnan(fill) and not math.isnan(own["queue"])
            else math.nan,
            "queue_batches_previous": past.queues[-1] if past.queues else math.nan,
            "effective_utilization_previous": past.effective[-1] if past.effective else math.nan,
            "queue_batches_recent_mean": _nanmean(queues),
            "effective_utilization_recent_mean": _nanmean(effective),
            "rho_estimate_recent_mean": _nanmean(rhos),
            "windows_without_serving": float(past.without_serving)
            + float(frame.sample_count > 0 and frame.serving_queues == 0),
        }

    def _remember(self, frame: GpuFrame, past: _Past, own: _Base) -> None:
        if frame.queue_names:
            past.queue_names = frame.queue_names
        if frame.sample_count == 0 or frame.lost:
            return
        past.without_serving = 0 if frame.serving_queues else min(past.without_serving + 1, 10)
        past.queues.append(own["queue"])
        past.effective.append(own["effective"])
        past.rho.append(own["rho"])
        if own["saturated"]:
            past.saturated.append(own["completions"])
        if frame.batch_size_mean is not None:
            past.batch_sizes.append(frame.batch_size_mean)
        if frame.completions_per_second is not None and (frame.queue_depth_mean or 0.0) > 0:
            past.completions.append(frame.completions_per_second)
        if frame.memory_used_bytes is not None and frame.memory_total_bytes:
            past.memory.append((frame.t_end, frame.memory_used_bytes / frame.memory_total_bytes))
        for series in (
            past.batch_sizes,
            past.completions,
            past.memory,
            past.queues,
            past.effective,
            past.rho,
            past.saturated,
        ):
            del series[: -self.history_windows]


def _per_request(tokens_per_second: float | None, frame: GpuFrame) -> float:
    """Tokens per request the frame's GPU answered (NaN where it answered none)."""
    answered = _nan(frame.completions_per_second)
    return _nan(tokens_per_second) / answered if answered > 0 else math.nan
