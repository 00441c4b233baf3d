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

import copy
import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from gpubalance.analyzer.frames import GpuFrame

# a queue is "waiting work" when it holds at least this share of a batch on average
QUEUED_BATCHES = 0.5
# how many past windows a GPU's own best and trends look back over
HISTORY_WINDOWS = 20
# how many (batch size, batch time) points of one card on one pool the batch-time fit keeps
BATCH_POINTS = 60
# a batch's time grows as its size to this power where the sizes seen do not tell: prefill
# grows with the batch, a decode step hardly does, and a batch decodes until its longest
# request is done; over batches of 1 to 64 the measured prefill and decode times
# (lab/data, splitwise) give 0.4 to 0.8 for prompts of 256 to 4,096 tokens
BATCH_TIME_EXPONENT = 0.5
# where the servers count tokens the prior follows the work's mix instead: a decode step costs
# about as much as prefilling this many prompt tokens (splitwise's A100 measurements, batch 1:
# 55 ms a step, 0.38 ms a prompt token; the ratio is a card's tensor throughput over its
# memory bandwidth, 140 to 400 over today's data-centre and RTX cards) ...
DECODE_STEP_PROMPT_TOKENS = 150.0
# ... and batches whose time is all decoding grow as their size to this power (a step hardly
# grows; a static batch runs until its longest request is done, which a larger batch draws
# longer), those all prefill as their size
DECODE_BATCH_EXPONENT = 0.4
# how much spread of the sizes seen (the sum of squares of ln batch size about its mean)
# weighs as much as that prior: about eight windows at 1.6 times or 1 / 1.6 of the mean size
BATCH_TIME_PRIOR = 2.0
# the KV cache share a batch can fill before the server stops adding requests to it
KV_FULL_RATIO = 0.95

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

    def take(self, rows: Sequence[int] | np.ndarray) -> FeatureTable:
        """The table of these rows, in this order."""
        index = np.asarray(rows, dtype=np.intp)
        return FeatureTable(
            tuple(self.frames[i] for i in index.tolist()), self.values[index], self.columns
        )


# the frame fields the features read, as float64 columns (None: NaN)
_FIELDS: tuple[str, ...] = (
    "t_start",
    "t_end",
    "sample_count",
    "expected_sample_count",
    "lost",
    "utilization_mean_ratio",
    "utilization_p95_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "sm_clock_ratio",
    "throttled_ratio",
    "serving_queues",
    "queue_depth_mean",
    "queue_depth_max",
    "queue_depth_slope_per_second",
    "batch_delay_seconds",
    "request_duration_seconds",
    "batch_size_mean",
    "completions_per_second",
    "allocation_failures",
    "feeder_cpu_cores_max",
    "host_cpu_pressure_ratio",
    "host_io_pressure_ratio",
    "host_iowait_ratio",
    "class_duration_ratio",
    "kv_cache_usage_ratio",
    "max_batch_size",
    "prompt_tokens_per_second",
    "generation_tokens_per_second",
)
_NAN = math.nan


def _ring_push(ring: np.ndarray, counts: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
    """Append one value to each of the rows ``ids`` of a ring of the last ``ring.shape[1]``."""
    ring[ids, counts[ids] % ring.shape[1]] = values
    counts[ids] += 1


def _grown(array: np.ndarray, size: int, fill: float | int) -> np.ndarray:
    if len(array) >= size:
        return array
    grown = np.full((max(size, 2 * len(array)), *array.shape[1:]), fill, dtype=array.dtype)
    grown[: len(array)] = array
    return grown


def _sorted_median(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's median over its known values, and how many it has (median NaN for none)."""
    ordered = np.sort(matrix, axis=1)  # NaN last
    count = np.count_nonzero(~np.isnan(matrix), axis=1)
    rows = np.arange(len(matrix))
    low = ordered[rows, np.maximum(count - 1, 0) // 2]
    high = ordered[rows, np.minimum(count // 2, matrix.shape[1] - 1)]
    median = np.where(count % 2 == 1, low, (low + high) / 2)
    return np.where(count > 0, median, _NAN), count


def _robust_z(pool_values: np.ndarray, own: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Each row's robust z-score against its pool's known values (itself among them), from the
    pool's median and MAD computed once per pool. ``pool_values``: (pools, GPUs), NaN-padded."""
    median, count = _sorted_median(pool_values)
    mad, _ = _sorted_median(np.abs(pool_values - median[:, None]))
    # a floor on the spread: identical peers must not turn a rounding error into a verdict
    scale = np.maximum(np.maximum(1.4826 * mad, 0.05 * np.abs(median)), 0.02)
    z = np.clip((own - median[pool]) / scale[pool], -10.0, 10.0)
    return np.where(np.isnan(own), _NAN, np.where(count[pool] < 2, 0.0, z))


def _theil_sen(t: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per row, the median of the pairwise slopes of its points (NaN where a point is not
    known): one step (a model load) does not make a trend. NaN under 3 points."""
    first, second = np.triu_indices(t.shape[1], 1)
    dt = np.take(t, second, axis=1) - np.take(t, first, axis=1)
    # (y2 - y1) / (t2 - t1) is the same number whichever point comes first
    slopes = (np.take(y, second, axis=1) - np.take(y, first, axis=1)) / dt
    slopes[dt == 0] = _NAN
    median, _ = _sorted_median(slopes)
    return np.where(np.count_nonzero(~np.isnan(t), axis=1) >= 3, median, _NAN)


class _Interner(dict[object, int]):
    """Small ints for hosts, cards and pools' queue names, so that numpy can group by them."""

    def code(self, value: object) -> int:
        code = self.get(value)
        if code is None:
            code = self[value] = len(self)
        return code


class _Memory:
    """What the builder keeps of every GPU and card between windows: a GPU's last
    ``history`` windows of each figure it looks back at (rings of arrays, a row per GPU),
    the best each card served on one pool's queues, and the batch points of each card of a
    host on one pool's queues."""

    def __init__(self, history: int) -> None:
        self.history = history
        self.gpus: dict[tuple[str, str], int] = {}
        self.hosts, self.cards, self.names = _Interner(), _Interner(), _Interner()
        self.names.code(())  # code 0: no queues
        self.batch_sizes = np.full((0, history), _NAN)
        self.batch_sizes_n = np.zeros(0, dtype=np.int64)
        self.completions = np.full((0, history), _NAN)  # windows with work waiting
        self.completions_n = np.zeros(0, dtype=np.int64)
        self.saturated = np.full((0, history), _NAN)  # completions with a batch waiting
        self.saturated_n = np.zeros(0, dtype=np.int64)
        self.memory_t = np.full((0, history), _NAN)  # (t_end, used ratio)
        self.memory_y = np.full((0, history), _NAN)
        self.memory_n = np.zeros(0, dtype=np.int64)
        # queue, effective utilization and rho of the last two live windows: [-1], [-2]
        self.recent = np.full((0, 3, 2), _NAN)
        self.recent_n = np.zeros(0, dtype=np.int64)
        self.queue_names = np.zeros(0, dtype=np.int64)  # the pool it last served
        self.without_serving = np.zeros(0, dtype=np.int64)
        self.card_best: dict[tuple[int, int], float] = {}
        self.batch_keys: dict[tuple[int, int, int], int] = {}
        self.batch_points = np.full((0, BATCH_POINTS, 2), _NAN)  # (size, seconds per batch)
        self.batch_points_n = np.zeros(0, dtype=np.int64)

    def gpu_ids(self, keys: Sequence[tuple[str, str]]) -> np.ndarray:
        ids = np.fromiter(
            (self.gpus.setdefault(key, len(self.gpus)) for key in keys), np.int64, len(keys)
        )
        size = len(self.gpus)
        for name in ("batch_sizes", "completions", "saturated", "memory_t", "memory_y", "recent"):
            setattr(self, name, _grown(getattr(self, name), size, _NAN))
        for name in ("batch_sizes_n", "completions_n", "saturated_n", "memory_n", "recent_n"):
            setattr(self, name, _grown(getattr(self, name), size, 0))
        self.queue_names = _grown(self.queue_names, size, 0)
        self.without_serving = _grown(self.without_serving, size, 0)
        return ids

    def batch_ids(self, keys: Sequence[tuple[int, int, int]]) -> np.ndarray:
        ids = np.fromiter(
            (self.batch_keys.setdefault(key, len(self.batch_keys)) for key in keys),
            np.int64,
            len(keys),
        )
        self.batch_points = _grown(self.batch_points, len(self.batch_keys), _NAN)
        self.batch_points_n = _grown(self.batch_points_n, len(self.batch_keys), 0)
        return ids


class _Frames:
    """The frames of one call as columns, in the order the features run them."""

    def __init__(self, ordered: Sequence[GpuFrame], memory: _Memory) -> None:
        read = operator.attrgetter(*_FIELDS)
        columns = list(zip(*(read(f) for f in ordered), strict=True))
        self.values = {
            name: np.array(column, dtype=np.float64)
            for name, column in zip(_FIELDS, columns, strict=True)
        }
        self.gpu = memory.gpu_ids([(f.host, f.uuid) for f in ordered])
        self.host = np.array([memory.hosts.code(f.host) for f in ordered], dtype=np.int64)
        self.card = np.array([memory.cards.code(f.card) for f in ordered], dtype=np.int64)
        self.names = np.array([memory.names.code(f.queue_names) for f in ordered], dtype=np.int64)
        self.classes = np.array([len(f.service_classes) for f in ordered], dtype=np.float64)
        v = self.values
        self.seconds = v["t_end"] - v["t_start"]
        self.coverage = np.array([f.coverage_ratio for f in ordered], dtype=np.float64)
        self.live = (v["sample_count"] > 0) & (v["lost"] == 0)
        # (mean batch size, GPU seconds per batch) of a window: busy time over batches run
        size, utilization = v["batch_size_mean"], v["utilization_mean_ratio"]
        completions = v["completions_per_second"]
        completions = np.where(np.isnan(completions), 0.0, completions)  # None: no batches run
        self.point = (completions != 0) & (v["lost"] == 0) & (size >= 1) & (utilization > 0)
        self.point_seconds = np.where(self.point, utilization * size / completions, _NAN)


class FeatureBuilder:
    """Frames (in time order, any hosts) to a :class:`FeatureTable`.

    A transformer in scikit-learn's sense, with nothing to fit: a GPU's own history is the
    frames before it in the same call. :class:`FeatureStream` keeps that history between calls.
    """

    def __init__(self, history_windows: int = HISTORY_WINDOWS) -> None:
        self.history_windows = history_windows

    def transform(self, frames: Iterable[GpuFrame]) -> FeatureTable:
        return _build(frames, _Memory(self.history_windows))


class FeatureStream:
    """A :class:`FeatureBuilder` that remembers, for a service that reads a lookback every
    cycle: each :meth:`add` builds only the windows after those it already made final, on
    the history the earlier calls left.

    The newest window of each call is provisional: the source may not hold all of its samples
    yet (a scrape still on its way), so its rows are built on a copy of the history and built
    again, from what the next call gives, until a later window comes. Rows of the windows
    before are final: the same numbers :meth:`FeatureBuilder.transform` gives for all the
    frames the calls were given.
    """

    def __init__(self, history_windows: int = HISTORY_WINDOWS) -> None:
        self.history_windows = history_windows
        self._memory = _Memory(history_windows)
        self.final_t_start = -math.inf  # the latest window whose rows are final

    def add(self, frames: Iterable[GpuFrame]) -> FeatureTable:
        """The rows of the frames of windows after :attr:`final_t_start` (those before it
        were built once, final, and are skipped)."""
        new = sorted((f for f in frames if f.t_start > self.final_t_start), key=_order)
        if not new:
            return _build([], self._memory)
        newest = new[-1].t_start
        final = [f for f in new if f.t_start < newest]
        settled = _build(final, self._memory)
        if final:
            self.final_t_start = final[-1].t_start
        latest = _build(new[len(final) :], copy.deepcopy(self._memory))
        return concatenate([settled, latest])


def concatenate(tables: Sequence[FeatureTable]) -> FeatureTable:
    """The rows of ``tables``, one after another."""
    frames = tuple(f for table in tables for f in table.frames)
    values = np.concatenate([table.values for table in tables]) if tables else None
    return FeatureTable(frames, np.empty((0, len(COLUMNS))) if values is None else values)


def _order(frame: GpuFrame) -> tuple[float, str, int]:
    return frame.t_start, frame.host, frame.gpu


def _build(frames: Iterable[GpuFrame], memory: _Memory) -> FeatureTable:
    ordered = sorted(frames, key=_order)
    values = np.empty((len(ordered), len(COLUMNS)), dtype=np.float64)
    if not ordered:
        return FeatureTable((), values)
    order = np.empty(len(ordered), dtype=np.int64)
    # NaN is "the telemetry does not say": arithmetic on it, and on a damaged recording's
    # infinities, gives NaN features, not warnings
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        columns = _Frames(ordered, memory)
        t_start = columns.values["t_start"]
        bounds = [0, *(np.flatnonzero(t_start[1:] != t_start[:-1]) + 1).tolist(), len(ordered)]
        for start, end in itertools.pairwise(bounds):
            rows, values[start:end] = _window(columns, np.arange(start, end), memory)
            order[start:end] = rows
    return FeatureTable(tuple(ordered[i] for i in order.tolist()), values)


def _window(c: _Frames, index: np.ndarray, memory: _Memory) -> tuple[np.ndarray, np.ndarray]:
    """One window's rows: which frames, in the order they come out, and their features.

    Rows come pool by pool, pools in the order their first GPU comes in the window."""
    m = memory
    v = c.values
    # pools: GPUs of one host serving the same queues; a GPU whose queues vanished (a crashed
    # worker, a lost GPU) stays in the pool it last served
    names = np.where(c.names[index] != 0, c.names[index], m.queue_names[c.gpu[index]])
    keys = c.host[index] * (len(m.names) + 1) + names
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    local = np.argsort(rank[inverse], kind="stable")
    index, names = index[local], names[local]
    pool = rank[inverse][local]
    n, pools = len(index), len(first)
    pool_start = np.searchsorted(pool, np.arange(pools))
    pool_size = np.bincount(pool, minlength=pools)
    slot = np.arange(n) - pool_start[pool]
    width = int(pool_size.max())
    gpu = c.gpu[index]

    def col(name: str) -> np.ndarray:
        return v[name][index]

    def by_pool(values: np.ndarray, fill: float = _NAN) -> np.ndarray:
        matrix = np.full((pools, width), fill, dtype=values.dtype)
        matrix[pool, slot] = values
        return matrix

    rows = np.arange(n)

    def peers_of(values: np.ndarray) -> np.ndarray:
        """(rows, GPUs): each row's pool, itself left out (NaN)."""
        matrix = by_pool(values)[pool]
        matrix[rows, slot] = _NAN
        return matrix

    def pool_sum(values: np.ndarray) -> np.ndarray:
        return np.add.reduceat(np.where(np.isnan(values), 0.0, values), pool_start)[pool]

    def pool_count(mask: np.ndarray) -> np.ndarray:
        return np.add.reduceat(mask.astype(np.int64), pool_start)[pool]

    def pool_mean(values: np.ndarray) -> np.ndarray:
        count = pool_count(~np.isnan(values))
        return np.where(count > 0, pool_sum(values) / count, _NAN)

    def known_peers(values: np.ndarray) -> np.ndarray:
        return np.count_nonzero(~np.isnan(values), axis=1)

    # peers run the same queues, so the same largest batch: a starved GPU that never filled
    # one is measured against what its busiest peer reached
    size = col("batch_size_mean")
    seen = np.fmax(np.fmax.reduce(m.batch_sizes[gpu], axis=1), size)
    largest = np.fmax(np.fmax.reduceat(seen, pool_start), 1.0)[pool]

    # each card of a pool: GPU seconds per request at full batches, from its batch points
    card = c.card[index]
    group_keys = pool * (len(m.cards) + 1) + card
    _, group_first, group_inverse = np.unique(group_keys, return_index=True, return_inverse=True)
    group_rank = np.empty(len(group_first), dtype=np.int64)
    group_rank[np.argsort(group_first, kind="stable")] = np.arange(len(group_first))
    group = group_rank[group_inverse]
    group_local = np.sort(group_first)  # the first row of each group, groups in order
    batch = m.batch_ids(
        list(
            zip(
                c.host[index[group_local]].tolist(),
                card[group_local].tolist(),
                names[group_local].tolist(),
                strict=True,
            )
        )
    )
    point = c.point[index]
    groups = len(group_first)
    by_group = np.argsort(group, kind="stable")
    group_start = np.searchsorted(group[by_group], np.arange(groups))
    in_group = np.arange(n) - group_start[group[by_group]]
    current = np.full((groups, int(np.bincount(group).max()), 2), _NAN)
    current[group[by_group], in_group, 0] = np.where(point, size, _NAN)[by_group]
    current[group[by_group], in_group, 1] = c.point_seconds[index][by_group]
    points = np.concatenate([m.batch_points[batch], current], axis=1)
    # the work's mix on each card of a pool: tokens per request answered in the window
    answered = col("completions_per_second")
    prompt_rate = col("prompt_tokens_per_second")
    generation_rate = col("generation_tokens_per_second")
    counted = (answered > 0) & ~np.isnan(prompt_rate) & ~np.isnan(generation_rate)

    def group_sum(values: np.ndarray) -> np.ndarray:
        return np.add.reduceat(np.where(counted, values, 0.0)[by_group], group_start)

    group_answered = group_sum(answered)
    with np.errstate(divide="ignore", invalid="ignore"):
        group_prompt = np.where(group_answered > 0, group_sum(prompt_rate) / group_answered, _NAN)
        group_generation = np.where(
            group_answered > 0, group_sum(generation_rate) / group_answered, _NAN
        )
    # priced at the largest batch any GPU of the card there can run
    reach = batch_reach(size, largest, col("max_batch_size"), col("kv_cache_usage_ratio"))
    fit = batch_time_fit(points, group_prompt, group_generation)
    cost = fit.cost(np.fmax.reduceat(reach[by_group], group_start))[group]

    live = c.live[index]
    utilization = np.where(live, col("utilization_mean_ratio"), _NAN)
    fill = np.where(live, size / largest, _NAN)
    queue = np.where(live, col("queue_depth_mean") / largest, _NAN)
    completions = np.where(live, col("completions_per_second"), _NAN)
    effective = utilization * fill
    # a queue of half a batch or more all window: the GPU serves as fast as it can
    saturated = (queue >= QUEUED_BATCHES) & (completions > 0)
    # the most a card of one kind served on one pool's queues with work waiting, over the
    # fleet: the capacity of a GPU that has not been saturated itself; pools earlier in the
    # window count, as they do in a window read pool by pool
    served_saturated = np.where(saturated, completions, _NAN)[by_group]
    group_saturated = np.fmax.reduceat(served_saturated, group_start)
    card_best = np.empty(groups)
    best_keys = zip(card[group_local].tolist(), names[group_local].tolist(), strict=True)
    for i, (key, served) in enumerate(zip(best_keys, group_saturated.tolist(), strict=True)):
        card_best[i] = best = m.card_best.get(key, 0.0)
        if not math.isnan(served):
            m.card_best[key] = max(best, served)
    best = np.fmax(np.fmax.reduce(m.saturated[gpu], axis=1), card_best[group])
    best = np.where(saturated, np.fmax(best, completions), best)
    # batches take about as long whatever their size (decode is bound by memory), so a
    # GPU busy u of the time with batches f full would serve 1/(u*f) times as much
    capacity = np.where(
        best > 0,
        best,
        np.where((effective > 0.05) & (completions > 0), completions / effective, _NAN),
    )
    able = capacity > 0
    rho = np.minimum(np.where(able, completions / capacity, _NAN), 5.0)
    slope = col("queue_depth_slope_per_second")
    growth = np.where(slope > 0, slope, 0.0)
    offered = np.where(able, np.minimum((completions + growth) / capacity, 5.0), _NAN)
    fitted = np.minimum(completions * cost, 5.0)
    kv = np.where(live, col("kv_cache_usage_ratio"), _NAN)

    out: dict[str, np.ndarray] = {}
    seconds = c.seconds[index]
    out["coverage_ratio"] = c.coverage[index]
    out["utilization_ratio"] = utilization
    out["utilization_p95_ratio"] = col("utilization_p95_ratio")
    out["batch_fill_ratio"] = fill
    out["effective_utilization_ratio"] = effective
    out["queue_batches"] = queue
    out["queue_max_batches"] = col("queue_depth_max") / largest
    out["queue_slope_batches_per_window"] = slope * seconds / largest
    delay, duration = col("batch_delay_seconds"), col("request_duration_seconds")
    out["batch_delay_share"] = np.where(
        ~np.isnan(delay) & ~np.isnan(duration) & (duration != 0), delay / duration, _NAN
    )
    current_completions = np.where(np.isnan(completions), 0.0, completions)
    own_best = np.fmax(np.fmax.reduce(m.completions[gpu], axis=1), current_completions)
    out["throughput_vs_own_best_ratio"] = np.where(own_best > 0, completions / own_best, _NAN)
    peer_completions = peers_of(completions)
    known = known_peers(peer_completions)
    mean_peer = np.where(
        known > 0, np.nansum(peer_completions, axis=1) / np.maximum(known, 1), _NAN
    )
    out["throughput_vs_peers_ratio"] = np.where(mean_peer > 0, completions / mean_peer, _NAN)
    total = pool_sum(completions)
    out["throughput_share_vs_equal_ratio"] = np.where(
        total > 0, completions * pool_count(~np.isnan(completions)) / total, _NAN
    )
    out["utilization_peer_z"] = _robust_z(by_pool(utilization), utilization, pool)
    out["effective_utilization_peer_z"] = _robust_z(by_pool(effective), effective, pool)
    out["queue_peer_z"] = _robust_z(by_pool(queue), queue, pool)
    out["throughput_peer_z"] = _robust_z(by_pool(completions), completions, pool)
    out["peer_count"] = (pool_size[pool] - 1).astype(np.float64)
    peer_queue = peers_of(queue)
    peer_queue_max = np.fmax.reduce(peer_queue, axis=1)
    out["peer_queue_max_batches"] = peer_queue_max
    peer_effective = peers_of(effective)
    out["peer_effective_utilization_max"] = np.fmax.reduce(peer_effective, axis=1)
    out["peer_effective_utilization_min"] = np.fmin.reduce(peer_effective, axis=1)
    out["pool_effective_utilization_mean"] = pool_mean(effective)
    out["pool_queue_batches_mean"] = pool_mean(queue)
    queued = pool_count(queue >= QUEUED_BATCHES)
    out["pool_busy_share"] = np.where(
        pool_count(~np.isnan(queue)) > 0, queued / pool_count(~np.isnan(queue)), _NAN
    )
    peer_queued = peer_queue_max >= QUEUED_BATCHES
    out["idle_while_peer_queued"] = (1.0 - np.minimum(1.0, effective)) * peer_queued
    clock, throttled = col("sm_clock_ratio"), col("throttled_ratio")
    # no clocks: throttled time as a proxy
    out["clock_ratio"] = np.where(np.isnan(clock), 1.0 - 0.5 * throttled, clock)
    out["throttled_ratio"] = throttled
    cores = col("feeder_cpu_cores_max")
    out["feeder_cpu_cores"] = cores
    # a feeding process near a whole number of busy cores is pinned at its threads
    out["feeder_cpu_pinned"] = np.where(
        cores >= 0.9, np.maximum(0.0, 1.0 - np.abs(cores - np.round(cores)) * 5), 0.0
    )
    out["feeder_cpu_pinned"][np.isnan(cores)] = _NAN
    out["host_cpu_pressure_ratio"] = col("host_cpu_pressure_ratio")
    out["host_io_pressure_ratio"] = col("host_io_pressure_ratio")
    out["host_iowait_ratio"] = col("host_iowait_ratio")
    used, total_bytes = col("memory_used_bytes"), col("memory_total_bytes")
    memory_ratio = np.where(
        ~np.isnan(used) & ~np.isnan(total_bytes) & (total_bytes != 0),
        used / total_bytes,
        _NAN,
    )
    out["memory_used_ratio"] = memory_ratio
    growth_memory = np.full(n, _NAN)
    known_memory = np.flatnonzero(~np.isnan(memory_ratio))
    if len(known_memory):
        ids = gpu[known_memory]
        t = np.concatenate([m.memory_t[ids], col("t_end")[known_memory, None]], axis=1)
        y = np.concatenate([m.memory_y[ids], memory_ratio[known_memory, None]], axis=1)
        growth_memory[known_memory] = _theil_sen(t, y) * seconds[known_memory]
    out["memory_growth_ratio_per_window"] = growth_memory
    failures = col("allocation_failures")
    out["allocation_failures_per_completion"] = np.where(
        np.isnan(completions), failures, failures / np.maximum(1.0, completions * seconds)
    )
    serving = col("serving_queues")
    out["serving_present"] = (serving > 0).astype(np.float64)

    # the ground truth's quantities as telemetry estimates them: rho (the share of the
    # window the GPU needs for its work at full batches), its capacity against its peers',
    # and how the router splits work against capacity
    peer_capacity = peers_of(np.where(able, capacity, _NAN))
    median_capacity, known_capacity = _sorted_median(peer_capacity)
    has_peer_capacity = (known_capacity > 0) & able
    out["capacity_vs_peers_ratio"] = np.where(has_peer_capacity, capacity / median_capacity, _NAN)
    out["capacity_vs_peers_best_ratio"] = np.where(
        has_peer_capacity, capacity / np.fmax.reduce(peer_capacity, axis=1), _NAN
    )
    both = able & ~np.isnan(completions)
    served = pool_sum(np.where(both, completions, _NAN))
    able_sum = pool_sum(np.where(both, capacity, _NAN))
    out["work_share_vs_capacity_share_ratio"] = np.where(
        (served > 0) & (able_sum > 0) & both,
        (completions / served) / (capacity / able_sum),
        _NAN,
    )
    peer_rho = peers_of(rho)
    out["peer_rho_estimate_max"] = np.fmax.reduce(peer_rho, axis=1)
    out["peer_rho_estimate_min"] = np.fmin.reduce(peer_rho, axis=1)
    out["pool_rho_estimate_mean"] = pool_mean(rho)
    peer_card = by_pool(card.astype(np.float64), -1.0)[pool]
    peer_card[rows, slot] = -1.0
    differs = np.count_nonzero((peer_card != card[:, None]) & (peer_card >= 0), axis=1)
    peers = pool_size[pool] - 1
    out["peer_card_differs_share"] = np.where(peers > 0, differs / np.maximum(peers, 1), _NAN)
    # work waits yet batches run part full: something other than work limits them
    out["queued_unfilled_batches"] = np.minimum(queue, 4.0) * np.maximum(0.0, 1.0 - fill)
    out["rho_fitted_ratio"] = fitted
    peer_fitted = peers_of(fitted)
    out["peer_rho_fitted_max"] = np.fmax.reduce(peer_fitted, axis=1)
    out["pool_rho_fitted_mean"] = pool_mean(fitted)
    # the pool's work at full batches over its GPUs' capacity (1 / cost each, an idle GPU's
    # too): each GPU's rho were the work split by capacity, the ground truth's fair rho
    counted_fair = ~np.isnan(completions) & (cost > 0)
    capacity_fitted = np.where(counted_fair, 1.0 / cost, _NAN)
    fair_capacity = pool_sum(capacity_fitted)
    out["pool_fair_rho_fitted_ratio"] = np.where(
        fair_capacity > 0,
        np.minimum(pool_sum(np.where(counted_fair, completions, _NAN)) / fair_capacity, 5.0),
        _NAN,
    )
    # how much batching gains on the card (1: none) and how much of that the sizes seen say
    out["batch_time_exponent"] = fit.exponent[group]
    out["batch_fit_measured_ratio"] = fit.measured[group]
    with np.errstate(divide="ignore", invalid="ignore"):
        own_answered = np.where(answered > 0, answered, _NAN)
        out["prompt_tokens_per_request"] = prompt_rate / own_answered
        out["generation_tokens_per_request"] = generation_rate / own_answered
    # the share of a batch cycle spent waiting for the batch to fill
    cycle = delay + c.point_seconds[index]
    out["batch_wait_share_estimate"] = np.where(cycle > 0, delay / cycle, _NAN)
    out["rho_estimate_ratio"] = rho
    out["offered_rho_estimate_ratio"] = offered
    # interactive requests that wait behind long batch-class ones in one queue
    out["service_class_count"] = c.classes[index]
    out["class_duration_ratio"] = col("class_duration_ratio")
    out["kv_cache_usage_ratio"] = kv
    out["kv_cache_usage_peer_z"] = _robust_z(by_pool(kv), kv, pool)
    recent, recent_n = m.recent[gpu], m.recent_n[gpu]
    out["queue_batches_previous"] = np.where(recent_n >= 1, recent[:, 0, 0], _NAN)
    out["effective_utilization_previous"] = np.where(recent_n >= 1, recent[:, 1, 0], _NAN)
    for name, figure, now in (
        ("queue_batches_recent_mean", 0, queue),
        ("effective_utilization_recent_mean", 1, effective),
        ("rho_estimate_recent_mean", 2, rho),
    ):
        values = np.stack(
            [
                np.where(recent_n >= 2, recent[:, figure, 1], _NAN),
                np.where(recent_n >= 1, recent[:, figure, 0], _NAN),
                now,
            ],
            axis=1,
        )
        count = np.count_nonzero(~np.isnan(values), axis=1)
        out[name] = np.where(count > 0, np.nansum(values, axis=1) / count, _NAN)
    out["windows_without_serving"] = m.without_serving[gpu] + (
        (col("sample_count") > 0) & (serving == 0)
    )

    # remember the window
    has_point = point & ~np.isnan(c.point_seconds[index])
    appended = np.flatnonzero(has_point[by_group])
    if len(appended):
        ids = batch[group[by_group][appended]]
        position = (
            m.batch_points_n[ids] + _in_group_rank(group[by_group], appended)
        ) % BATCH_POINTS
        m.batch_points[ids, position, 0] = size[by_group][appended]
        m.batch_points[ids, position, 1] = c.point_seconds[index][by_group][appended]
        np.add.at(m.batch_points_n, ids, 1)
    frame_names = c.names[index]
    m.queue_names[gpu[frame_names != 0]] = frame_names[frame_names != 0]
    ids = gpu[live]
    m.without_serving[ids] = np.where(
        serving[live] > 0, 0, np.minimum(m.without_serving[ids] + 1, 10)
    )
    m.recent[ids, :, 1] = m.recent[ids, :, 0]
    m.recent[ids, :, 0] = np.stack([queue[live], effective[live], rho[live]], axis=1)
    m.recent_n[ids] += 1
    _ring_push(m.saturated, m.saturated_n, gpu[saturated & live], completions[saturated & live])
    known_size = live & ~np.isnan(size)
    _ring_push(m.batch_sizes, m.batch_sizes_n, gpu[known_size], size[known_size])
    raw = col("completions_per_second")
    waiting = live & ~np.isnan(raw) & (col("queue_depth_mean") > 0)
    _ring_push(m.completions, m.completions_n, gpu[waiting], raw[waiting])
    known_memory_live = live & ~np.isnan(memory_ratio)
    m.memory_y[gpu[known_memory_live], m.memory_n[gpu[known_memory_live]] % m.history] = (
        memory_ratio[known_memory_live]
    )
    _ring_push(m.memory_t, m.memory_n, gpu[known_memory_live], col("t_end")[known_memory_live])
    return index, np.column_stack([out[name] for name in COLUMNS])


def _in_group_rank(sorted_groups: np.ndarray, picked: np.ndarray) -> np.ndarray:
    """For picked positions of an array sorted by group: each one's rank among the picked of
    its group."""
    groups = sorted_groups[picked]
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    return np.arange(len(picked)) - np.repeat(starts, np.diff(np.r_[starts, len(picked)]))


class BatchTimeFit(NamedTuple):
    """Per row, a power law T = c * b ** a through batch times T against batch sizes b (in
    logs: ln T = mean_y + a * (ln b - mean_x)); each NaN where there was no point."""

    mean_x: np.ndarray  # the mean ln batch size of the points
    mean_y: np.ndarray  # the mean ln batch time, seconds
    exponent: np.ndarray  # a
    measured: np.ndarray  # the share of a the sizes seen decide (0: the prior alone)

    def cost(self, largest: np.ndarray) -> np.ndarray:
        """GPU seconds per request in batches of ``largest``."""
        with np.errstate(invalid="ignore"):
            return np.exp(self.mean_y + self.exponent * (np.log(largest) - self.mean_x)) / largest


def batch_time_fit(
    points: np.ndarray,
    prompt_tokens: np.ndarray | None = None,
    generation_tokens: np.ndarray | None = None,
) -> BatchTimeFit:
    """The power law through each row of (batch size, batch time) points (NaN-padded):
    prefill grows with the batch, a decode step hardly does, so a GPU running small batches
    back to back can still have room for more. The exponent a is the least squares slope of
    ln T on ln b shrunk toward a prior (a ridge of weight ``BATCH_TIME_PRIOR``), so sizes that
    spread little say little, and is kept within [0, 1]: a larger batch never takes less time,
    nor more per request. Its ``measured`` share is the sizes' spread (the sum of squares of
    ln b about its mean) over itself plus the prior's.

    The prior is :func:`token_exponent` of the row's ``prompt_tokens`` and
    ``generation_tokens`` per request (NaN: not counted), or ``BATCH_TIME_EXPONENT`` where the
    tokens are not known."""
    b, t = points[:, :, 0], points[:, :, 1]
    known = (b > 0) & (t > 0)  # a NaN pad is neither
    n = np.count_nonzero(known, axis=1)
    x = np.log(np.where(known, b, 1.0))
    y = np.log(np.where(known, t, 1.0))
    with np.errstate(divide="ignore", invalid="ignore"):  # a row without points: NaN
        mean_x = x.sum(axis=1) / n
        mean_y = y.sum(axis=1) / n
        dx = np.where(known, x - mean_x[:, None], 0.0)
        dy = np.where(known, y - mean_y[:, None], 0.0)
        spread = (dx * dx).sum(axis=1)
        prior = np.full(len(points), BATCH_TIME_EXPONENT)
        if prompt_tokens is not None and generation_tokens is not None:
            by_tokens = token_exponent(prompt_tokens, generation_tokens)
            prior = np.where(np.isnan(by_tokens), prior, by_tokens)
        exponent = ((dx * dy).sum(axis=1) + BATCH_TIME_PRIOR * prior) / (spread + BATCH_TIME_PRIOR)
    some = n > 0
    return BatchTimeFit(
        mean_x,
        mean_y,
        np.where(some, np.clip(exponent, 0.0, 1.0), _NAN),
        np.where(some, spread / (spread + BATCH_TIME_PRIOR), _NAN),
    )


def token_exponent(prompt_tokens: np.ndarray, generation_tokens: np.ndarray) -> np.ndarray:
    """How a batch's time grows with its size, from the work's mix: ``prompt_tokens`` and
    ``generation_tokens`` per request. With s the prefill's share of one request's time,
    P / (P + k·G), k the prompt tokens a decode step costs as much as
    (``DECODE_STEP_PROMPT_TOKENS``), the exponent is s + (1 - s)·``DECODE_BATCH_EXPONENT``:
    1 for work all prefill, ``DECODE_BATCH_EXPONENT`` for work all decoding. (Prefill grows a
    little less than the batch, and a larger static batch decodes a longer longest output: at
    one request's share the two about cancel. Over the lab's measured shapes, batches of 1 to
    16 and five mixes of 128 to 4,096 prompt and 13 to 256 output tokens, this is within 0.1
    of the exponent the batch times have.) NaN where a count is unknown or there were no
    tokens."""
    decode = DECODE_STEP_PROMPT_TOKENS * generation_tokens
    with np.errstate(divide="ignore", invalid="ignore"):
        share = prompt_tokens / (prompt_tokens + decode)
    return share + (1.0 - share) * DECODE_BATCH_EXPONENT


def full_batch_cost(
    points: np.ndarray,
    largest: np.ndarray,
    prompt_tokens: np.ndarray | None = None,
    generation_tokens: np.ndarray | None = None,
) -> np.ndarray:
    """GPU seconds per request in batches of ``largest``, per row of (batch size, batch time)
    points (NaN-padded), along :func:`batch_time_fit`'s power law (its prior from the tokens
    per request where given); NaN where there is no point."""
    return batch_time_fit(points, prompt_tokens, generation_tokens).cost(largest)


def batch_reach(
    size: np.ndarray, largest: np.ndarray, limit: np.ndarray, kv_usage: np.ndarray
) -> np.ndarray:
    """The largest batch a GPU can run, per row: its configured ``limit`` (NaN: unknown, then
    the ``largest`` its pool ran), no more than its KV cache holds at the window's usage per
    request (``kv_usage`` with batches of ``size``), never less than the batch it ran."""
    with np.errstate(divide="ignore", invalid="ignore"):
        room = np.where(kv_usage > 0, size * KV_FULL_RATIO / kv_usage, np.inf)
    return np.fmax(np.fmin(np.where(np.isnan(limit), largest, limit), room), size)
