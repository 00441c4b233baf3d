"""Capacity: what each GPU can serve, what it is offered, and ρ, from telemetry alone.

A GPU's **capacity** is its service rate in completions per second when work never runs out,
in the pool it serves now (a GPU moved from another pool ran another model there), in the
batches its pool can run: measured in the windows in which its queue holds work all along and
it is busy (``queue batches`` ≥ ``saturated_queue_batches``, by default half a batch on
average, the features' ``QUEUED_BATCHES``; utilization ≥ ``saturated_utilization_ratio``);
then it serves without pause, and what it completes is what it can at the batches it ran.
Half a small batch waiting keeps a GPU busy too, and a batching GPU serves more per second in
larger batches: one that runs short batches back to back (work arrives about as fast as it
is served, a pool after a quiet spell) is busy all the time yet has room, and reads ρ near 1
at the batches it runs whatever its headroom. So what it served is scaled up to the batches
its pool can run (the features' :func:`batch_reach`: its configured limit, else the largest
its pool ran; no more than its KV cache holds) along its card's batch times against their
sizes (the features' :func:`full_batch_cost`). A GPU with few such windows is shrunk toward
the GPUs of the same card in its pool (``prior_windows`` windows' worth of the peers' figure);
one with none takes its peers' figure, else what its card's full batches cost it (``fitted``:
the features' fit of its card's batch times against their sizes, as ``rho_fitted_ratio``
reads it, where those sizes spread; never below its busy rate). Where they do not, the fit is
the exponent's prior alone (``prior``), and where there is no batch figure either, its own
best rate per busy second (``busy_rate``: completions over utilization): both guesses, not
measures (``measured`` is False), the busy rate a lower bound (partial batches serve fewer
requests per busy second than full ones, so that GPU's ρ is an upper bound). Where none
exists the capacity is None: the telemetry cannot say.

The **offered** load of a GPU is what arrived for it: its completions, plus its KV allocation
failures (work that came and failed), plus the growth of its queue, per second, over the
latest ``recent_windows`` windows. **ρ** = offered / capacity: the share of the GPU's time the
work sent to it needs. ρ ≥ 1 means its queue grows; a pool whose total offered load exceeds
its total capacity needs more GPUs, not other weights.

The model only reads: ``fit(table)`` learns per GPU, ``predict_rho(shares)`` says what ρ each
GPU would have if the pool's offered load were split in the given shares.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gpubalance.analyzer.features import (
    QUEUED_BATCHES,
    BatchTimeFit,
    FeatureTable,
    batch_reach,
    batch_time_fit,
)
from gpubalance.analyzer.frames import GpuFrame

CapacitySource = Literal["saturated", "shrunk", "peers", "fitted", "prior", "busy_rate", "none"]
# saturated windows a GPU needs before its capacity counts as measured rather than guessed
MEASURED_WINDOWS = 3
# a card's batch times measure how they grow with its batch size (its fit is "fitted", not
# the exponent's "prior") with this many windows whose sizes spread this much (their
# coefficient of variation)
FIT_WINDOWS = 4
FIT_SPREAD_RATIO = 0.15


def pool_of(frame: GpuFrame) -> str:
    """The pool a GPU serves, as the verdicts name it (its serving queues' names)."""
    return ",".join(frame.queue_names)


@dataclass(frozen=True, slots=True)
class GpuCapacity:
    """One GPU as the capacity model sees it at the end of the table."""

    host: str
    gpu: int
    uuid: str
    card: str | None
    pool: str
    capacity_per_second: float | None  # completions/s with work always waiting, full batches
    source: CapacitySource  # where the capacity came from
    saturated_windows: int  # windows of its own the capacity was measured in
    offered_per_second: float | None  # completions + failures + queue growth, recent windows
    t_end: float  # the end of its latest window
    queue_depth: float | None = None  # requests waiting at it, mean over its latest window

    @property
    def rho(self) -> float | None:
        if self.offered_per_second is None or not self.capacity_per_second:
            return None
        return self.offered_per_second / self.capacity_per_second

    @property
    def measured(self) -> bool:
        """Whether the capacity was measured with work waiting (here or on a same-card peer),
        not only bounded from below by the busy rate."""
        return self.source in ("saturated", "shrunk", "peers", "fitted")

    @property
    def confidence(self) -> float:
        """How far the capacity is measured: 1 with enough saturated windows of its own."""
        return {
            "saturated": 1.0,
            "shrunk": 0.5 + 0.5 * min(1.0, self.saturated_windows / MEASURED_WINDOWS),
            "peers": 0.6,
            "fitted": 0.5,
            "prior": 0.4,
            "busy_rate": 0.3,
            "none": 0.0,
        }[self.source]


class CapacityModel:
    """Per GPU capacity, offered load and ρ, fitted from a :class:`FeatureTable`.

    ``saturated_queue_batches`` / ``saturated_utilization_ratio``: the queue (in batches) and
    utilization a window needs for its completions to measure capacity. ``history_windows``:
    the latest saturated windows the capacity is the median of (a throttle changes it).
    ``prior_windows``: how many windows' weight the same-card peers' figure has against a
    GPU's own. ``recent_windows``: the windows the offered load is the mean over.
    """

    def __init__(
        self,
        saturated_queue_batches: float = QUEUED_BATCHES,
        saturated_utilization_ratio: float = 0.9,
        history_windows: int = 10,
        prior_windows: float = 2.0,
        recent_windows: int = 4,
    ) -> None:
        self.saturated_queue_batches = saturated_queue_batches
        self.saturated_utilization_ratio = saturated_utilization_ratio
        self.history_windows = history_windows
        self.prior_windows = prior_windows
        self.recent_windows = recent_windows

    def fit(self, table: FeatureTable) -> CapacityModel:
        # a damaged recording's NaN or infinite figure is unknown here, as everywhere
        table = FeatureTable(tuple(_finite(f) for f in table.frames), table.values, table.columns)
        queue = table.column("queue_batches")
        fitted_rho = table.column("rho_fitted_ratio")
        rows: dict[tuple[str, str], list[int]] = {}
        for i, frame in enumerate(table.frames):
            rows.setdefault((frame.host, frame.uuid), []).append(i)
        own: dict[tuple[str, str], list[float]] = {}
        busy_rate: dict[tuple[str, str], float] = {}
        fitted: dict[tuple[str, str], float] = {}
        prior: dict[tuple[str, str], float] = {}
        latest: dict[tuple[str, str], GpuFrame] = {}
        offered: dict[tuple[str, str], float | None] = {}
        full_clock: dict[tuple[str, str], list[float]] = {}
        throttled: dict[tuple[str, str], bool] = {}
        pools: dict[tuple[str, str], str] = {}
        for key, indices in rows.items():
            indices.sort(key=lambda i: table.frames[i].t_start)
            # a GPU keeps its pool while its worker is down (its frames name no queue then)
            pools[key] = next(
                (
                    pool_of(table.frames[i])
                    for i in reversed(indices)
                    if table.frames[i].queue_names
                ),
                "",
            )
            # only what it did in that pool speaks for it: a GPU moved from another pool ran
            # another model there, at another rate
            indices[:] = [
                i
                for i in indices
                if not table.frames[i].queue_names or pool_of(table.frames[i]) == pools[key]
            ]
        lines = _BatchLines(table.frames, rows, pools)
        for key, indices in rows.items():
            live = [i for i in indices if _live(table.frames[i])]
            saturated = [
                i
                for i in live
                if table.frames[i].completions_per_second
                and queue[i] >= self.saturated_queue_batches
                and (table.frames[i].utilization_mean_ratio or 0.0)
                >= self.saturated_utilization_ratio
            ][-self.history_windows :]
            # what each served at the batches it ran, scaled to the batches its pool can run
            served = {
                i: lines.scaled(table.frames[i], table.frames[i].completions_per_second or 0.0)
                for i in saturated
            }
            # its capacity at the clock it runs at now: a throttle lowers it, a lifted one
            # restores it; only its full-clock windows speak for its card
            now_throttled = bool(live) and _throttled(table.frames[live[-1]])
            throttled[key] = now_throttled
            mine = [i for i in saturated if _throttled(table.frames[i]) == now_throttled]
            full = [i for i in saturated if not _throttled(table.frames[i])]
            own[key] = [served[i] for i in mine]
            full_clock[key] = [served[i] for i in full]
            rates = [
                f.completions_per_second / f.utilization_mean_ratio
                for f in (table.frames[i] for i in live)
                if f.completions_per_second and f.utilization_mean_ratio
            ]
            if rates:
                busy_rate[key] = max(rates)
            # one over what a full batch costs it per request, fitted from its card's batch
            # times against their sizes (the features' rho_fitted_ratio is completions times
            # that cost)
            at_full_batches = [
                f.completions_per_second / fitted_rho[i]
                for i in live[-self.history_windows :]
                if (f := table.frames[i]).completions_per_second
                and math.isfinite(fitted_rho[i])
                and fitted_rho[i] > 0
                and _throttled(f) == now_throttled
            ]
            if at_full_batches:
                which = fitted if lines.spread(table.frames[indices[-1]]) else prior
                which[key] = statistics.median(at_full_batches)
            latest[key] = table.frames[indices[-1]]
            offered[key] = self._offered([table.frames[i] for i in indices])
        # the same card in the same pool: the same model on the same silicon
        by_card = _by_card(full_clock, latest, pools)
        self.gpus_: dict[tuple[str, str], GpuCapacity] = {}
        for key, frame in latest.items():
            group = (frame.host, pools[key], frame.card)
            # a throttled card is not its full-clock peers: only its own windows speak for it
            peers = (
                []
                if throttled[key]
                else [v for other, v in by_card.get(group, {}).items() if other != key]
            )
            capacity, source = self._capacity(
                own[key], peers, fitted.get(key), prior.get(key), busy_rate.get(key)
            )
            self.gpus_[key] = GpuCapacity(
                host=frame.host,
                gpu=frame.gpu,
                uuid=frame.uuid,
                card=frame.card,
                pool=pools[key],
                capacity_per_second=capacity,
                source=source,
                saturated_windows=len(own[key]),
                offered_per_second=offered[key],
                t_end=frame.t_end,
                queue_depth=frame.queue_depth_mean if _live(frame) else None,
            )
        # each pool's GPUs by index, for pool(): a fleet asks it per pool
        self.pools_: dict[tuple[str, str], list[GpuCapacity]] = {}
        for gpu in self.gpus_.values():
            self.pools_.setdefault((gpu.host, gpu.pool), []).append(gpu)
        for members in self.pools_.values():
            members.sort(key=lambda g: g.gpu)
        return self

    def _capacity(
        self,
        mine: list[float],
        peers: list[float],
        fitted: float | None,
        prior: float | None,
        busy_rate: float | None,
    ) -> tuple[float | None, CapacitySource]:
        if mine and len(mine) >= MEASURED_WINDOWS:
            return statistics.median(mine), "saturated"
        if mine:
            if not peers:
                return statistics.median(mine), "saturated"
            k = self.prior_windows
            shrunk = (len(mine) * statistics.median(mine) + k * statistics.median(peers)) / (
                len(mine) + k
            )
            return shrunk, "shrunk"
        if peers:
            return statistics.median(peers), "peers"
        if fitted:
            # never below what it has served per busy second
            return max(fitted, busy_rate or 0.0), "fitted"
        if prior:
            return max(prior, busy_rate or 0.0), "prior"
        if busy_rate:
            return busy_rate, "busy_rate"
        return None, "none"

    def _offered(self, frames: list[GpuFrame]) -> float | None:
        recent = frames[-self.recent_windows :]
        if not recent or not _live(recent[-1]):
            # a lost GPU or a crashed worker is offered nothing the router can still send it
            return 0.0 if recent and recent[-1].lost else None
        total = seconds = 0.0
        for frame in recent:
            rate = offered_rate(frame)
            if rate is None:
                continue
            total += rate * frame.seconds
            seconds += frame.seconds
        return total / seconds if seconds > 0 else None

    # what the fitted model says

    def pool(self, host: str, pool: str) -> list[GpuCapacity]:
        """The GPUs of one pool, by index."""
        return list(self.pools_.get((host, pool), []))

    def rho(self, host: str, pool: str) -> dict[int, float]:
        """ρ now of each GPU of the pool whose ρ the telemetry gives (an upper bound where its
        capacity is not ``measured``)."""
        return {g.gpu: rho for g in self.pool(host, pool) if (rho := g.rho) is not None}

    def offered(self, host: str, pool: str) -> float:
        """The pool's offered load, per second (GPUs whose load is unknown count none)."""
        return sum(g.offered_per_second or 0.0 for g in self.pool(host, pool))

    def pool_rho(self, host: str, pool: str) -> float | None:
        """The pool's offered load over its total capacity."""
        members = self.pool(host, pool)
        capacity = [g.capacity_per_second for g in members if g.capacity_per_second]
        if any(g.offered_per_second is None for g in members) or not capacity:
            return None
        return self.offered(host, pool) / sum(capacity)

    def predict_rho(
        self,
        host: str,
        pool: str,
        shares: Mapping[int, float],
        capacity_per_second: Mapping[int, float] | None = None,
        offered_per_second: float | None = None,
    ) -> dict[int, float] | None:
        """ρ of each GPU if the pool's offered load went in ``shares`` (GPU index -> share,
        normalised here); ``capacity_per_second`` gives GPUs the pool does not have yet (scale
        out); ``offered_per_second`` a load other than the pool's now (its busiest window).
        None when a share lands on a GPU whose capacity is unknown, or the pool's offered load
        is."""
        members = {g.gpu: g for g in self.pool(host, pool)}
        offered = [g.offered_per_second for g in members.values()]
        if any(o is None for o in offered):
            return None
        total = self.offered(host, pool) if offered_per_second is None else offered_per_second
        weight = sum(shares.values())
        if weight <= 0:
            return None
        capacities = {g: m.capacity_per_second for g, m in members.items()}
        capacities.update(capacity_per_second or {})
        out: dict[int, float] = {}
        for gpu, share in shares.items():
            capacity = capacities.get(gpu)
            if share <= 0:
                out[gpu] = 0.0
                continue
            if not capacity:
                return None
            out[gpu] = total * share / weight / capacity
        return out


def _by_card(
    values: Mapping[tuple[str, str], list[float]],
    latest: Mapping[tuple[str, str], GpuFrame],
    pools: Mapping[tuple[str, str], str],
) -> dict[tuple[str, str, str | None], dict[tuple[str, str], float]]:
    """Each GPU's median figure, grouped by host, pool and card."""
    out: dict[tuple[str, str, str | None], dict[tuple[str, str], float]] = {}
    for key, figures in values.items():
        if figures:
            frame = latest[key]
            out.setdefault((frame.host, pools[key], frame.card), {})[key] = statistics.median(
                figures
            )
    return out


class _BatchLines:
    """Per host, pool and card: its GPUs' batch times against their sizes (what the features'
    :func:`full_batch_cost` fits), the tokens per request of what they answered (where their
    servers count tokens), and the largest batch the pool ran."""

    def __init__(
        self,
        frames: tuple[GpuFrame, ...],
        rows: Mapping[tuple[str, str], list[int]],
        pools: Mapping[tuple[str, str], str],
    ) -> None:
        points: dict[tuple[str, str, str | None], list[tuple[float, float]]] = {}
        # (answered, prompt tokens, generated tokens) per second, summed over windows
        tokens: dict[tuple[str, str, str | None], np.ndarray] = {}
        self.largest: dict[tuple[str, str], float] = {}
        for key, indices in rows.items():
            for i in indices:
                f = frames[i]
                if not _live(f) or not f.batch_size_mean or f.batch_size_mean < 1:
                    continue
                pool = (f.host, pools[key])
                counted = (
                    f.completions_per_second,
                    f.prompt_tokens_per_second,
                    f.generation_tokens_per_second,
                )
                if counted[0] and counted[1] is not None and counted[2] is not None:
                    line = (*pool, f.card)
                    tokens[line] = tokens.get(line, np.zeros(3)) + np.array(counted, dtype=float)
                self.largest[pool] = max(self.largest.get(pool, 1.0), f.batch_size_mean)
                if f.completions_per_second and f.utilization_mean_ratio and not _throttled(f):
                    seconds = f.utilization_mean_ratio * f.batch_size_mean
                    points.setdefault((*pool, f.card), []).append(
                        (f.batch_size_mean, seconds / f.completions_per_second)
                    )
        self.points = {k: np.array(v, dtype=float) for k, v in points.items()}
        self.tokens = {k: (v[1] / v[0], v[2] / v[0]) for k, v in tokens.items() if v[0] > 0}
        self.pools = pools
        self._fits: dict[tuple[str, str, str | None], BatchTimeFit] = {}

    def fit(self, line: tuple[str, str, str | None]) -> BatchTimeFit:
        """The power law through the line's points (:func:`full_batch_cost`'s), fitted once."""
        fitted = self._fits.get(line)
        if fitted is None:
            prompt, generated = self.tokens.get(line, (math.nan, math.nan))
            fitted = batch_time_fit(
                self.points[line][None], np.full(1, prompt), np.full(1, generated)
            )
            self._fits[line] = fitted
        return fitted

    def spread(self, frame: GpuFrame) -> bool:
        """Whether the batch sizes of the GPU's card in its pool spread enough for its batch
        times to say how they grow (``FIT_WINDOWS``, ``FIT_SPREAD_RATIO``)."""
        pool = (frame.host, self.pools[(frame.host, frame.uuid)])
        points = self.points.get((*pool, frame.card))
        if points is None or len(points) < FIT_WINDOWS:
            return False
        sizes = points[:, 0]
        return bool(sizes.std() > FIT_SPREAD_RATIO * sizes.mean())

    def scaled(self, frame: GpuFrame, served: float) -> float:
        """What the GPU would serve of a window's work at the batches its pool can run,
        having served ``served`` per second at the window's: a batching GPU serves more per
        second in larger batches, so one that ran short ones served under what more load
        would get from it. The largest batch it can run is the features' :func:`batch_reach`
        (its configured limit, else the largest its pool ran; no more than its KV cache
        holds); its card's batch times price it."""
        size = frame.batch_size_mean
        pool = (frame.host, self.pools[(frame.host, frame.uuid)])
        points = self.points.get((*pool, frame.card))
        if not size or points is None:
            return served
        reach = float(
            batch_reach(
                np.float64(size),
                np.float64(self.largest.get(pool, size)),
                np.float64(frame.max_batch_size or math.nan),
                np.float64(frame.kv_cache_usage_ratio or math.nan),
            )
        )
        if reach <= size:
            return served
        cost = self.fit((*pool, frame.card)).cost(np.array([size, reach]))
        if not np.isfinite(cost).all() or cost[1] <= 0:
            return served
        return served * max(1.0, float(cost[0] / cost[1]))


def drain_seconds(gpus: Mapping[int, GpuCapacity], rho: Mapping[int, float]) -> dict[int, float]:
    """How long each GPU's queue takes to empty at these ρ: its backlog over the capacity left
    beside the new work (infinite at ρ ≥ 1: it grows)."""
    out: dict[int, float] = {}
    for gpu, r in rho.items():
        held = gpus.get(gpu)
        backlog = (held.queue_depth or 0.0) if held is not None else 0.0
        if r >= 1.0:
            out[gpu] = math.inf
        elif backlog > 0 and held is not None and held.capacity_per_second:
            out[gpu] = backlog / ((1.0 - r) * held.capacity_per_second)
        else:
            out[gpu] = 0.0
    return out


def offered_rate(frame: GpuFrame) -> float | None:
    """What arrived for the GPU in the window, per second."""
    if frame.completions_per_second is None or not _live(frame):
        return None
    rate = frame.completions_per_second
    if frame.allocation_failures:
        rate += frame.allocation_failures / frame.seconds
    if frame.queue_depth_slope_per_second is not None:
        rate += frame.queue_depth_slope_per_second
    return max(0.0, rate)


_FRAME_FIELDS = tuple(f.name for f in dataclasses.fields(GpuFrame))


def _finite(frame: GpuFrame) -> GpuFrame:
    bad = {
        name: None
        for name in _FRAME_FIELDS
        if isinstance(value := getattr(frame, name), float) and not math.isfinite(value)
    }
    return dataclasses.replace(frame, **bad) if bad else frame


def _throttled(frame: GpuFrame) -> bool:
    # a slowdown reason most of the window; a clock under its maximum alone is boost at work
    return (frame.throttled_ratio or 0.0) >= 0.5


def _live(frame: GpuFrame) -> bool:
    return frame.sample_count > 0 and not frame.lost and frame.serving_queues > 0


def idle_while_queued(
    rho: Mapping[int, float],
    drain: Mapping[int, float] | None = None,
    horizon_seconds: float | None = None,
) -> float | None:
    """The pool's idle-while-queued share the capacity model expects at these ρ, over a
    horizon: a GPU with ρ < 1 leaves 1 - ρ of its capacity unused, for the share of the
    horizon in which another GPU still has work queued: all of it beside a GPU at ρ ≥ 1, until
    its backlog drains (``drain``: seconds per GPU, :func:`drain_seconds`) beside the others.
    The verdicts' definition, with ρ in place of utilization times batch fill."""
    if not rho:
        return None

    def queued_share(gpu: int) -> float:
        if rho[gpu] >= 1.0:
            return 1.0
        if drain is None or not horizon_seconds:
            return 0.0
        return min(1.0, drain.get(gpu, 0.0) / horizon_seconds)

    shares = {g: queued_share(g) for g in rho}
    idle = [
        (1.0 - min(1.0, r)) * max([shares[h] for h in rho if h != g] or [0.0])
        for g, r in rho.items()
        if not math.isnan(r)
    ]
    return sum(idle) / len(idle) if idle else None
