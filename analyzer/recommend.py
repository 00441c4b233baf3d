"""Recommendations: typed actions for a pool, from persisted verdicts and the capacity model.

Policy, not learning (scikit-learn's split: features, model, then plain code): for each pool of
a diagnosis, from the verdicts that have held for ``persistence_windows`` windows
(``reweight_windows`` for a re-weighting: the cheapest change, which the controller verifies
and undoes, waits least),

- a lost GPU: ``drain`` it (its work goes to the others). Its worker's process may live on and
  pass HAProxy's health check while every request it takes fails. A crashed worker gets no
  drain: its server fails the health check, which takes it out and brings it back when the
  worker restarts, while a drain would keep the restarted worker out until someone readied it;
- a GPU drained so that serves again (for ``reweight_windows``, within ``ttl_seconds`` of its
  last lost window, while the drain may still stand): ``add_worker`` it back into rotation;
- an imbalance the pool has the capacity for (total ρ < 1): ``set_weights``, weights per GPU in
  proportion to fitted capacity over the GPUs that can take work (those held back by their host,
  memory or a crash keep their share; one whose feeding process is pinned at its threads,
  ``target_rho`` of it);
- a GPU starved by its host with its feeding process pinned at its threads, where the pool's
  other GPUs can take what it cannot (none of them at ρ ≥ 1 after): ``set_weights`` that send it
  ``target_rho`` of what it serves now. Its requests wait for its host's threads, out of sight
  of its serving queue: leastconn evens out requests in flight, which wait far longer there
  than behind a GPU's batches;
- a shortage (total ρ ≥ 1 with no GPU that could take work, or the fleet verdict says so):
  ``scale_out`` by as many GPUs of the pool's card as bring the pool under ``target_rho``;
- over-provisioning (every GPU starved for want of demand): ``remove_worker`` of the GPU with the
  least capacity, when the rest stay under ``target_rho`` at the pool's busiest of the latest
  ``scale_in_windows`` windows (none before the pool has that many): demand that comes in
  bursts would otherwise lose a GPU in each lull and queue in the next burst;
- batching that idles the GPU: ``tune_batching``; interactive work behind batch work in one
  queue: ``split_pools``; a host, disk, memory or clock limit: ``investigate_host`` (a person or a
  runbook must look: no routing change cures it).

And across the pools of a host:

- demand that has shifted between pools (one pool at ρ ≥ ``move_rho`` with requests queued,
  still when a moved GPU would be ready, beside a quieter pool of the same host with two GPUs
  or more): ``move_worker`` of the quiet pool's least-loaded GPU to the busy pool, whose model
  it then serves at the capacity the busy pool's GPUs of its card have; when the higher ρ of
  the two pools is lower by ``min_gain_rho`` at least after it (so a move back, which would
  raise it again, is never recommended next), and only when the prediction outlasts the
  move's model load (``move_load_seconds`` < ``ttl_seconds``). The quiet pool's verdicts must
  have held; the busy pool's need not: its load and queue say it needs a GPU before its verdict
  has turned and held, and the GPU takes a model load to arrive. The quiet pool then gets no
  ``remove_worker``: a GPU another pool of its host needs is moved there, not taken out. A
  pool's ρ here is its latest window's offered load, or its trend where it rises (over the
  load time for the busy pool, the recommendation's horizon for the quiet one), over its GPUs'
  capacity: the 4-window mean the other rules use lags a shifting demand by minutes.
  Capacities are at the batches a pool can run (the capacity model's): one that ran short
  batches after a quiet spell serves more as its queue grows, before it needs another GPU. At
  most one per host: a move changes both pools, and the next is judged on what it left.

``add_worker`` returns a GPU that was lost only: the frames do not say which GPU has room for
another model.

Each carries what the capacity model expects: ρ per GPU of the pool before and after, and
idle-while-queued before and after. An action that physics rules out is never recommended: no
weights that send more work to a GPU its host holds back, no scale-out for a pool with room,
no drain of a pool's last GPU, nothing for a pool whose GPUs are all balanced. The same
situation gives the same id on every call (so an executor's ack sticks to it); its created time
is the start of the run of windows that made it, its expiry ``ttl_seconds`` after the call.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpubalance.analyzer.capacity import (
    CapacityModel,
    GpuCapacity,
    drain_seconds,
    idle_while_queued,
    offered_rate,
    pool_of,
)
from gpubalance.analyzer.causes import PINNED_FEEDER
from gpubalance.analyzer.features import FeatureTable
from gpubalance.analyzer.verdict import Diagnosis
from gpubalance.diagnosis import Action, ExpectedEffect, FleetVerdict, Recommendation, Verdict

# cheapest first: re-weighting is a runtime API call, a drain loses a GPU's throughput, moving
# or adding a worker reloads a model, new GPUs cost money
COST_RANK: Mapping[Action, int] = {
    "set_weights": 0,
    "tune_batching": 1,
    "drain": 2,
    "investigate_host": 3,
    "split_pools": 4,
    "move_worker": 5,
    "add_worker": 6,
    "remove_worker": 6,
    "scale_out": 7,
}
# starved for want of work: these GPUs can take more
TAKES_WORK = frozenset({"routing_skew", "low_demand"})
# overloaded because the routing sends more than it serves now: other weights relieve it (a
# throttled card's capacity is measured at its clock, so weights follow the throttle too)
MISROUTED = frozenset({"routing_skew", "slow_card", "throttling"})
# what holds a GPU back whatever it is sent: more work would only wait
HELD_BACK = frozenset({"host_bound", "io_bound", "memory_pressure"})
# a pool split tries every choice of batch GPUs up to this many GPUs (2^12 splits)
SPLIT_SEARCH_GPUS = 12
# A GPU whose capacity is a guess, not measured (the capacity model's prior and busy-rate
# figures: its card's batch times extrapolated from the small batches it ran, where a slow
# card at batch 1 looks like a fast one, its prefill cost showing only in full batches), is
# sent at most this many times its share now, or half an even share if that is more: at the
# larger load its capacity is measured, and the next re-weighting trusts it with more
GUESSED_GROWTH = 2.0


@dataclass(frozen=True, slots=True)
class _Held:
    """A GPU's verdict that has held for the last windows, and since when."""

    verdict: Verdict
    since_seconds: float
    windows: int  # how many windows in a row it has held


class Recommender:
    """Recommendations for a diagnosis and its feature table.

    ``capacity``: the (unfitted) capacity model, copied and fitted on each call.
    ``persistence_windows``: windows in a row a GPU's verdict must hold before it is acted on.
    ``reweight_windows``: the same before a re-weighting, the cheapest change, which the
    controller bounds per step, verifies and undoes: each window a skew is left alone adds to
    the queue every later request waits behind.
    ``target_rho``: the pool ρ a scale-out or a scale-in aims at. ``min_gain_rho``: the least
    drop of the pool's highest ρ that makes a re-weighting or a move worth its change.
    ``ttl_seconds``: how long a recommendation stands unless a later call renews it.
    ``move_rho``: the pool ρ from which a pool with requests queued takes a GPU from a quieter
    pool. ``move_load_seconds``: how long a moved GPU serves nothing (drain, model load, first
    health check). ``scale_in_windows``: the windows whose busiest the GPUs left after a
    scale-in must serve under ``target_rho`` (Kubernetes' autoscaler looks back 5 minutes
    before it scales down, for the same reason; 8 windows of 30 s fit in an exporter's
    default 300 s of history).
    """

    def __init__(
        self,
        capacity: CapacityModel | None = None,
        persistence_windows: int = 2,
        reweight_windows: int = 1,
        target_rho: float = 0.7,
        min_gain_rho: float = 0.1,
        ttl_seconds: float = 120.0,
        move_rho: float = 0.8,
        move_load_seconds: float = 30.0,
        scale_in_windows: int = 8,
    ) -> None:
        self.capacity = capacity
        self.persistence_windows = persistence_windows
        self.reweight_windows = reweight_windows
        self.target_rho = target_rho
        self.min_gain_rho = min_gain_rho
        self.ttl_seconds = ttl_seconds
        self.move_rho = move_rho
        self.move_load_seconds = move_load_seconds
        self.scale_in_windows = scale_in_windows

    def recommend(
        self, diagnosis: Diagnosis, table: FeatureTable, now_seconds: float
    ) -> tuple[Recommendation, ...]:
        if self.persistence_windows < 1:
            raise ValueError(f"persistence_windows must be 1 or more: {self.persistence_windows}")
        if self.reweight_windows < 1:
            raise ValueError(f"reweight_windows must be 1 or more: {self.reweight_windows}")
        if not 0 < self.target_rho < 1:
            raise ValueError(f"target_rho must be between 0 and 1: {self.target_rho}")
        if self.move_rho <= 0:
            raise ValueError(f"move_rho must be above 0: {self.move_rho}")
        if self.move_load_seconds < 0:
            raise ValueError(f"move_load_seconds must not be negative: {self.move_load_seconds}")
        if self.scale_in_windows < 1:
            raise ValueError(f"scale_in_windows must be 1 or more: {self.scale_in_windows}")
        model = copy.deepcopy(self.capacity or CapacityModel()).fit(table)
        held = self._held(diagnosis.verdicts)
        lost_until = self._lost_until(diagnosis.verdicts)
        fleet: dict[tuple[str, str], FleetVerdict] = {}
        for verdict in diagnosis.fleet:
            fleet[(verdict.host, verdict.pool)] = verdict  # time order: the latest wins
        pools: dict[tuple[str, str], list[_Held]] = {}
        for item in held.values():
            pools.setdefault((item.verdict.host, item.verdict.pool), []).append(item)
        # the workers behind each GPU, as its latest frame that names any has them
        workers: dict[tuple[str, int], tuple[str, ...]] = {}
        # the service classes each GPU's queues served in its latest frames (the capacity
        # model's recent windows): a class that comes now and then on every GPU is shared, one
        # a split sent elsewhere is gone from them within those windows
        served: dict[tuple[str, int], list[tuple[str, ...]]] = {}
        # whether each GPU's feeding process was pinned at its threads in its latest frame
        pinned: dict[tuple[str, int], bool] = {}
        readings = zip(table.frames, table.column("feeder_cpu_pinned").tolist(), strict=True)
        for frame, pinned_ratio in sorted(readings, key=lambda fr: fr[0].t_start):
            if frame.workers:
                workers[(frame.host, frame.gpu)] = frame.workers
            served.setdefault((frame.host, frame.gpu), []).append(frame.service_classes)
            pinned[(frame.host, frame.gpu)] = pinned_ratio >= PINNED_FEEDER
        classes = {
            key: tuple(sorted({c for seen in kept[-model.recent_windows :] for c in seen}))
            for key, kept in served.items()
        }
        out: list[Recommendation] = []
        by_host: dict[str, list[_Pool]] = {}
        # each host's rows, split once: what follows reads one host at a time, and a fleet's
        # table read whole per host or pool costs its size times the hosts
        rows: dict[str, list[int]] = {}
        for i, frame in enumerate(table.frames):
            rows.setdefault(frame.host, []).append(i)
        tables = {host: table.take(rows[host]) for host in {host for host, _ in pools}}
        lost_on: dict[str, dict[int, float]] = {}
        for (host, gpu), until in lost_until.items():
            lost_on.setdefault(host, {})[gpu] = until
        pinned_on: dict[str, set[int]] = {}
        for (host, gpu), is_pinned in pinned.items():
            if is_pinned:
                pinned_on.setdefault(host, set()).add(gpu)
        # a pool a GPU joined or left within the persistence windows and one more: its verdicts
        # span the change (a moved GPU's model load, when it serves nothing by design), so it
        # gets no recommendation until its new shape has held that long
        reshaped = {
            host: _reshaped(mine, host, self.persistence_windows + 1)
            for host, mine in tables.items()
        }
        for (host, pool), members in sorted(pools.items()):
            context = _Pool(
                self,
                model,
                host,
                pool,
                members,
                fleet.get((host, pool)),
                now_seconds,
                workers,
                _busiest(tables[host], host, pool, self.scale_in_windows),
                classes,
                tables[host],
                lost_on.get(host, {}),
                pinned_on.get(host, set()),
            )
            if pool not in reshaped[host]:
                out += context.recommendations()
            by_host.setdefault(host, []).append(context)
        for host, contexts in by_host.items():
            move = self._move(contexts, tables[host], reshaped[host])
            if move is not None:
                # the quiet pool's GPU is wanted by a busy pool of its host: moved, not removed
                giver = move.parameters["pool"]
                out = [
                    r
                    for r in out
                    if not (
                        r.action == "remove_worker"
                        and r.host == move.host
                        and r.parameters["pool"] == giver
                    )
                ]
                out.append(move)
        out.sort(key=lambda r: (r.cost_rank, r.host, r.target, r.id))
        return tuple(out)

    def _move(
        self, pools: Sequence[_Pool], table: FeatureTable, reshaped: set[str]
    ) -> Recommendation | None:
        """The best move of one GPU between two pools of a host, if one is worth it;
        ``reshaped``: the host's pools whose GPUs changed within the persistence windows and one
        more."""
        if self.move_load_seconds >= self.ttl_seconds:
            return None  # the GPU would still be loading when the prediction lapses
        demand = {p.pool: _Demand.of(table, p) for p in pools}
        # a reshaped pool is judged on too few windows of its new shape (its load, its
        # capacity): a second move at it would stack on the first before anyone saw what the
        # first did. A pool gives a GPU away only on verdicts that have held (one whose
        # verdicts are too fresh for any action but a re-weighting is not yet judged at all);
        # it takes one on its load, capacity and queue, which the verdicts would only follow:
        # a pool whose demand rises past what its GPUs serve is judged overloaded a window or
        # two after its queue starts to grow, and a moved GPU still has its model to load
        shaped = [p for p in pools if p.pool not in reshaped]
        settled = [p for p in shaped if p.held]
        moves: list[_Move] = []
        for busy in [p for p in shaped if p.known]:
            queued = [c.queue_depth or 0.0 for c in busy.gpus.values()]
            if statistics.fmean(queued or [0.0]) < 1.0:
                continue
            for quiet in settled:
                move = None if quiet is busy else _Move.of(self, busy, quiet, demand)
                if move is not None and move.gain >= self.min_gain_rho:
                    moves.append(move)
        if not moves:
            return None
        return max(moves, key=lambda m: (m.gain, -m.gpu)).recommendation()

    def _lost_until(self, verdicts: Iterable[Verdict]) -> dict[tuple[str, int], float]:
        """Per GPU that was lost for ``persistence_windows`` windows in a row, long enough to
        be drained: when its latest such run ended."""
        by_gpu: dict[tuple[str, int], list[Verdict]] = {}
        for verdict in verdicts:
            by_gpu.setdefault((verdict.host, verdict.gpu), []).append(verdict)
        out: dict[tuple[str, int], float] = {}
        for key, series in by_gpu.items():
            run = 0
            for verdict in sorted(series, key=lambda v: v.t_start):
                run = run + 1 if _is_lost(verdict) else 0
                if run >= self.persistence_windows:
                    out[key] = verdict.t_end
        return out

    def _held(self, verdicts: Iterable[Verdict]) -> dict[tuple[str, int], _Held]:
        """Per GPU, its latest verdict when the last ``persistence_windows`` agree, or the
        last ``reweight_windows`` where those are fewer."""
        by_gpu: dict[tuple[str, int], list[Verdict]] = {}
        for verdict in verdicts:
            by_gpu.setdefault((verdict.host, verdict.gpu), []).append(verdict)
        out: dict[tuple[str, int], _Held] = {}
        for key, series in by_gpu.items():
            series.sort(key=lambda v: v.t_start)
            last = series[-1]
            run = 0
            for verdict in reversed(series):
                if _situation(verdict) != _situation(last):
                    break
                run += 1
            if run >= min(self.persistence_windows, self.reweight_windows):
                out[key] = _Held(last, series[-run].t_start, run)
        return out


def _latest_windows(table: FeatureTable, host: str, windows: int) -> list[float]:
    """The starts of the host's latest ``windows`` windows, oldest first."""
    return sorted({f.t_start for f in table.frames if f.host == host})[-windows:]


def _busiest(table: FeatureTable, host: str, pool: str, windows: int) -> float | None:
    """The pool's offered load, per second, in its busiest of the host's latest ``windows``
    windows (a GPU whose load a window does not give counts none in it); None when the table
    holds fewer windows of the host."""
    recent = _latest_windows(table, host, windows)
    if len(recent) < windows:
        return None
    rates = _offered_by_window(table, host, pool)
    return max(rates.get(t, 0.0) for t in recent)


def _slow_class_share(table: FeatureTable, host: str, pool: str, windows: int) -> float | None:
    """The slowest service class's share of the pool's work over the host's latest
    ``windows`` windows: each frame's share weighed by how busy its GPU was (None where no
    frame gives one)."""
    recent = set(_latest_windows(table, host, windows))
    pairs = [
        (f.slow_class_work_share, f.utilization_mean_ratio or 0.0)
        for f in table.frames
        if f.host == host
        and f.t_start in recent
        and pool_of(f) == pool
        and f.slow_class_work_share is not None
    ]
    busy = sum(u for _, u in pairs)
    return sum(s * u for s, u in pairs) / busy if busy > 0 else None


def _offered_by_window(table: FeatureTable, host: str, pool: str) -> dict[float, float]:
    """The pool's offered load per second in each window (by its start) in which one of its
    GPUs gives one, summed over those GPUs."""
    by_window: dict[float, float] = {}
    for frame in table.frames:
        if frame.host != host or pool_of(frame) != pool:
            continue
        rate = offered_rate(frame)
        if rate is not None:
            by_window[frame.t_start] = by_window.get(frame.t_start, 0.0) + rate
    return by_window


def _reshaped(table: FeatureTable, host: str, windows: int) -> set[str]:
    """The host's pools whose GPUs, over its latest ``windows`` windows, were not the same in
    each: a GPU joined, left, or was between pools (a window with no frame of it)."""
    members: dict[float, dict[str, set[int]]] = {}
    for frame in table.frames:
        if frame.host == host:
            members.setdefault(frame.t_start, {}).setdefault(pool_of(frame), set()).add(frame.gpu)
    recent = [members[t] for t in sorted(members)[-windows:]]
    pools = {pool for window in recent for pool in window}
    return {p for p in pools if len({frozenset(w.get(p, set())) for w in recent}) > 1}


def _is_lost(verdict: Verdict) -> bool:
    """The GPU fell off the bus."""
    return verdict.state == "unknown" and verdict.unknown_reason == "GPU lost"


def _is_down(verdict: Verdict) -> bool:
    """The GPU fell off the bus, or its worker crashed."""
    return _is_lost(verdict) or (verdict.state == "starved" and verdict.cause == "worker_crash")


def _situation(verdict: Verdict) -> tuple[str, str, str | None]:
    return (verdict.state, verdict.cause, verdict.unknown_reason)


def _stable_id(action: Action, host: str, pool: str, target: str) -> str:
    text = f"{action}|{host}|{pool}|{target}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _gpus(indices: Iterable[int]) -> str:
    ordered = sorted(indices)
    return ("GPU " if len(ordered) == 1 else "GPUs ") + ", ".join(map(str, ordered))


def _rho_text(rho: Mapping[int, float], measured: set[int]) -> str:
    # a GPU whose capacity is only bounded from below has its ρ bounded from above
    return ", ".join(
        f"GPU {g} {'' if g in measured else '≤ '}{r:.2f}" for g, r in sorted(rho.items())
    )


class _Pool:
    """One pool's held verdicts, its capacity figures, and the recommendations they make."""

    def __init__(
        self,
        recommender: Recommender,
        model: CapacityModel,
        host: str,
        pool: str,
        members: Sequence[_Held],
        fleet: FleetVerdict | None,
        now_seconds: float,
        workers: Mapping[tuple[str, int], tuple[str, ...]],
        busiest_per_second: float | None,
        classes: Mapping[tuple[str, int], tuple[str, ...]] | None = None,
        table: FeatureTable | None = None,
        lost_until: Mapping[int, float] | None = None,
        pinned: Iterable[int] = (),
    ) -> None:
        self.r = recommender
        # per GPU that was lost long enough to be drained, when it last was
        self.lost_until = lost_until or {}
        self.workers = workers
        # the classes each GPU serves, and the windows a split reads the classes' work from
        # (only a split does: read then, not for every pool)
        self.classes = classes or {}
        self.table = table
        # the pool's offered load in its busiest of the latest scale_in_windows windows
        self.busiest_per_second = busiest_per_second
        self.model = model
        self.host, self.pool = host, pool
        # every held verdict, the freshest too (what limits a GPU's share); of those, what a
        # re-weighting may rest on (``recent``) and what every action may (``held``)
        self.known = {m.verdict.gpu: m for m in members}
        self.recent = {
            g: m for g, m in self.known.items() if m.windows >= recommender.reweight_windows
        }
        self.held = {
            g: m for g, m in self.known.items() if m.windows >= recommender.persistence_windows
        }
        self.fleet = fleet
        self.now = now_seconds
        self.gpus: dict[int, GpuCapacity] = {g.gpu: g for g in model.pool(host, pool)}
        # every GPU's ρ, bounds included, decides; only measured ones are predicted
        self.rho_now = model.rho(host, pool)
        self.measured = {g for g, c in self.gpus.items() if c.measured}
        self.iwq_now = self._idle_while_queued(self.rho_now)
        # the GPUs whose feeding process was pinned at its threads in their latest frame
        self.pinned = set(pinned) & set(self.gpus)

    def recommendations(self) -> list[Recommendation]:
        out: list[Recommendation] = []
        out += self._drains()
        balance = self._balance() or self._shed_host()
        if balance is not None:
            out.append(balance)
        out += self._host_limits()
        out += self._batching()
        out += self._interference()
        scale_in = self._scale_in()
        if scale_in is not None:
            out.append(scale_in)
        # a GPU the pool can do without is not returned to it
        out += self._returns(set() if scale_in is None else {scale_in.parameters["gpu"]})
        return out

    # building blocks

    def _weight_list(self, shares: Mapping[int, float]) -> list[dict[str, object]]:
        """A GPU's share of the pool's work as ``weights`` carry it: per worker (a GPU's share
        split over its workers; worker None where the telemetry names none, or a GPU to add)."""
        out: list[dict[str, object]] = []
        for gpu, share in sorted(shares.items()):
            names: tuple[str | None, ...] = self.workers.get((self.host, gpu)) or (None,)
            for name in names:
                out.append({"gpu": gpu, "worker": name, "weight": round(share / len(names), 4)})
        return out

    def _worker_names(self, gpus: Iterable[int]) -> list[str]:
        return [name for g in gpus for name in self.workers.get((self.host, g), ())]

    def _held_where(
        self, state: str, causes: Iterable[str] | None = None, *, recent: bool = False
    ) -> list[_Held]:
        """The held verdicts of ``state`` (of ``causes``); ``recent``: those a re-weighting may
        rest on."""
        wanted = None if causes is None else set(causes)
        return [
            h
            for g, h in sorted((self.recent if recent else self.held).items())
            if h.verdict.state == state and (wanted is None or h.verdict.cause in wanted)
        ]

    def _make(
        self,
        action: Action,
        target: str,
        parameters: Mapping[str, object],
        reason: str,
        because: Sequence[_Held],
        rho_after: Mapping[int, float] | None,
        receivers: Iterable[int] = (),
    ) -> Recommendation:
        evidence: list[str] = []
        for h in because:
            v = h.verdict
            head = f"GPU {v.gpu} {v.state}" + (f"/{v.cause}" if v.cause != "none" else "")
            detail = v.unknown_reason or (v.evidence[0] if v.evidence else "")
            evidence.append(f"{head} since {h.since_seconds:.0f}: {detail}".rstrip(": "))
        if self.rho_now:
            evidence.append(f"capacity model, ρ now: {_rho_text(self.rho_now, self.measured)}")
        # as sure as its least sure verdict, times its least measured capacity
        confidence = min([h.verdict.confidence for h in because] or [1.0])
        confidence *= min([self.gpus[g].confidence for g in receivers if g in self.gpus] or [1.0])
        expected = None
        # a GPU whose capacity is only bounded gets no prediction: the telemetry cannot say;
        # new GPUs take the measured capacity of their card
        predicted = {
            g: r for g, r in (rho_after or {}).items() if g in self.measured or g not in self.gpus
        }
        if rho_after is not None and predicted:
            expected = ExpectedEffect(
                rho_before={g: round(r, 4) for g, r in self.rho_now.items() if g in self.measured},
                rho_after={g: round(r, 4) for g, r in sorted(predicted.items())},
                idle_while_queued_before=_round(self.iwq_now),
                idle_while_queued_after=_round(self._idle_while_queued(rho_after or {})),
                capacity_per_second={
                    g: round(c.capacity_per_second, 4)
                    for g, c in sorted(self.gpus.items())
                    if c.capacity_per_second is not None
                },
                capacity_source={g: c.source for g, c in sorted(self.gpus.items())},
            )
        since = min([h.since_seconds for h in because] or [self.now])
        # what it rests on was last seen in the newest of their windows (of the pool's, when it
        # rests on no GPU's verdict)
        rests_on = because or list(self.known.values())
        observed = max([h.verdict.t_end for h in rests_on] or [self.now])
        return Recommendation(
            id=_stable_id(action, self.host, self.pool, target),
            action=action,
            host=self.host,
            target=target,
            parameters={"pool": self.pool, **parameters},
            reason=reason,
            evidence=tuple(evidence),
            confidence=round(min(1.0, confidence), 4),
            created_seconds=since,
            expires_seconds=self.now + self.r.ttl_seconds,
            expected=expected,
            cost_rank=COST_RANK[action],
            observed_seconds=observed,
        )

    def _idle_while_queued(self, rho: Mapping[int, float]) -> float | None:
        """Over the recommendation's horizon: the backlogs queued now drain first."""
        drain = drain_seconds(self.gpus, rho)
        return idle_while_queued(rho, drain, self.r.ttl_seconds)

    def _shares_now(self) -> dict[int, float]:
        return {
            g: c.offered_per_second or 0.0
            for g, c in self.gpus.items()
            if c.offered_per_second is not None
        }

    def _down(self, among: Mapping[int, _Held] | None = None) -> list[_Held]:
        """The GPUs lost or crashed, of ``among`` (default: the verdicts actions rest on)."""
        return [h for h in (self.held if among is None else among).values() if _is_down(h.verdict)]

    def _split(self, pool_rho: float) -> tuple[list[int], list[int], dict[int, float]]:
        """Of the GPUs whose queues serve more than one class, those that serve the batch
        class alone and those that serve the others, and each GPU's ρ after: the split that
        leaves the busier side least loaded, the batch class's share of their work being the
        slowest class's (each side spreading its class by capacity; of equal splits the one
        nearest half the GPUs, then the lowest indices); a GPU that serves one class keeps its
        work. Without that share, or a load and capacity for each GPU, the pool's first half
        and the rest, and the pool's ρ everywhere."""
        ordered = sorted(self.gpus)
        first = max(1, len(ordered) // 2)
        fallback = ordered[:first], ordered[first:], {g: pool_rho for g in ordered}
        shared = [g for g in ordered if len(self.classes.get((self.host, g), ())) >= 2]
        share = (
            None
            if self.table is None
            else _slow_class_share(self.table, self.host, self.pool, self.model.recent_windows)
        )
        capacity = {g: self.gpus[g].capacity_per_second or 0.0 for g in shared}
        offered = [self.gpus[g].offered_per_second for g in shared]
        if share is None or len(shared) < 2 or not all(capacity.values()) or None in offered:
            return fallback
        load = sum(o or 0.0 for o in offered)
        whole = sum(capacity.values())
        half = max(1, len(shared) // 2)

        def sides(batch: tuple[int, ...]) -> tuple[float, float]:
            mine = sum(capacity[g] for g in batch)
            return load * share / mine, load * (1.0 - share) / (whole - mine)

        # every split of a host's few GPUs; of more, the first k by index
        if len(shared) <= SPLIT_SEARCH_GPUS:
            splits = [c for k in range(1, len(shared)) for c in itertools.combinations(shared, k)]
        else:
            splits = [tuple(shared[:k]) for k in range(1, len(shared))]
        batch = min(splits, key=lambda c: (max(sides(c)), abs(len(c) - half), c))
        rho_batch, rho_interactive = sides(batch)
        after = {g: r for g, r in self.rho_now.items() if g not in shared}
        after.update({g: rho_batch if g in batch else rho_interactive for g in shared})
        return list(batch), [g for g in shared if g not in batch], after

    # the rules

    def _drains(self) -> list[Recommendation]:
        out = []
        down = sorted(self._down(), key=lambda h: h.verdict.gpu)
        live = [g for g in self.gpus if g not in {h.verdict.gpu for h in down}]
        if not live:
            return []  # the pool's last GPU: draining it would drop all of its work
        for h in [h for h in down if _is_lost(h.verdict)]:
            gpu = h.verdict.gpu
            shares = {g: s for g, s in self._shares_now().items() if g != gpu}
            shares[gpu] = 0.0
            after = self.model.predict_rho(self.host, self.pool, shares)
            out.append(
                self._make(
                    "drain",
                    f"gpu:{gpu}",
                    {"gpu": gpu, "workers": self._worker_names([gpu])},
                    f"GPU {gpu} is lost: take it out of rotation so that no request is sent "
                    "to it (its worker may still pass the health check) and its share goes to "
                    "the others",
                    [h],
                    after,
                    receivers=shares,
                )
            )
        return out

    def _returns(self, leaving: set[int]) -> list[Recommendation]:
        """``add_worker`` for each GPU back from being lost whose drain may still stand (a
        drain stands ``ttl_seconds`` after the call that renewed it last), from its first
        window back; none for one in ``leaving``."""
        out = []
        # one window back will do: a GPU lost again is drained again
        back = [
            (gpu, h, until)
            for gpu, h in sorted(self.recent.items())
            if (until := self.lost_until.get(gpu)) is not None
            and gpu not in leaving
            and self.now - until <= self.r.ttl_seconds
            and h.verdict.state != "unknown"
            and not _is_down(h.verdict)
        ]
        if not back:
            return out
        # once readied, the pool's load spreads by capacity over every GPU that takes work
        weights = self._capacity_weights()
        after = None if weights is None else self.model.predict_rho(self.host, self.pool, weights)
        for gpu, h, until in back:
            out.append(
                self._make(
                    "add_worker",
                    f"gpu:{gpu}",
                    {"gpu": gpu, "workers": self._worker_names([gpu])},
                    f"GPU {gpu} was lost until {until:.0f} and its worker serves again: return "
                    "it to rotation, where the drain for its loss would keep it out",
                    [h],
                    after,
                    receivers=[gpu],
                )
            )
        return out

    def _limited(self) -> set[int]:
        """GPUs more work would not help: held back by their host, disk or memory, or down."""
        out = {h.verdict.gpu for h in self._down(self.known)}
        for g, h in self.known.items():
            if h.verdict.cause in HELD_BACK or h.verdict.state == "unknown":
                out.add(g)
        return out

    def _balance(self) -> Recommendation | None:
        over = self._held_where("overloaded", MISROUTED | {"capacity_shortage"}, recent=True)
        takers = self._held_where("starved", TAKES_WORK, recent=True)
        short = self._held_where("overloaded", {"capacity_shortage"}, recent=True)
        fleet_short = self.fleet is not None and self.fleet.kind == "capacity_shortage"
        # GPUs starved because the routing sends them too little say the others get too much,
        # before any of those is judged overloaded (its queue still building): the capacity
        # model's gain below decides whether other weights help
        skewed = self._held_where("starved", {"routing_skew"}, recent=True)
        overloaded = self._held_where("overloaded", recent=True)
        if not over and not (takers and overloaded) and not skewed:
            return None
        pool_rho = self.model.pool_rho(self.host, self.pool)
        if pool_rho is None:
            return None
        # a starved GPU that could take work says the pool has room, whatever a ρ resting on
        # capacity bounds adds up to
        if (pool_rho >= 1.0 and not takers) or (fleet_short and short):
            # a GPU added is no cheap change: only on verdicts that have persisted
            lasting = [h for h in over or short if h.windows >= self.r.persistence_windows]
            return self._scale_out(lasting, pool_rho) if lasting else None
        starved = {h.verdict.gpu for h in takers}
        hot = (
            [h.verdict.gpu for h in over]
            or [h.verdict.gpu for h in overloaded]
            or [g for g in sorted(self.measured) if g not in starved]
        )
        if not self.measured & set(hot):
            return None  # how much the hot GPUs serve is unmeasured: no weight would be fair
        weights = self._capacity_weights()
        if weights is None:
            return None
        after = self.model.predict_rho(self.host, self.pool, weights)
        if after is None or not self.rho_now:
            return None
        gain = max(self.rho_now.values()) - max(after.values())
        if gain < self.r.min_gain_rho:
            return None
        total = sum(weights.values())
        normalised = self._weight_list({g: w / total for g, w in weights.items()})
        return self._make(
            "set_weights",
            f"pool:{self.pool}",
            {"weights": normalised},
            f"{_gpus(hot)} {'gets' if len(hot) == 1 else 'get'} more work than "
            f"{'its' if len(hot) == 1 else 'their'} capacity while the pool has room (pool ρ "
            f"{pool_rho:.2f}): weight each GPU by its fitted capacity",
            over + takers,
            after,
            receivers=weights,
        )

    def _shed_host(self) -> Recommendation | None:
        """Weights that send a GPU whose feeding process is pinned ``target_rho`` of what it
        serves, the rest to the GPUs that can take work, where none of those reaches ρ 1."""
        pinned = [
            h
            for h in self._held_where("starved", {"host_bound"}, recent=True)
            if h.verdict.gpu in self.pinned
        ]
        if not pinned:
            return None
        weights = self._capacity_weights()
        free = set(weights or ()) - self._limited()
        if weights is None or not free:
            return None
        after = self.model.predict_rho(self.host, self.pool, weights)
        if after is None or any(after.get(g, math.inf) >= 1.0 for g in free):
            return None  # what it cannot serve the others cannot either
        total = sum(weights.values())
        gpus = [h.verdict.gpu for h in pinned]
        return self._make(
            "set_weights",
            f"pool:{self.pool}",
            {"weights": self._weight_list({g: w / total for g, w in weights.items()})},
            f"{_gpus(gpus)}: requests wait for the host, whose feeding process is pinned at "
            "its threads (leastconn evens out requests in flight, not waits); send each "
            f"{self.r.target_rho:.0%} of what it serves until the host is fixed, the rest to "
            "the GPUs with room",
            pinned,
            after,
            receivers=free,
        )

    def _capacity_weights(self, new: Mapping[int, float] | None = None) -> dict[int, float] | None:
        """Shares of the pool's offered load by capacity, ``new`` GPUs (index -> capacity)
        included; GPUs that cannot take more keep at most theirs (a down one none: one held
        back by its memory may still shed work), one whose capacity is a guess grows by
        :data:`GUESSED_GROWTH` at most; None when a free GPU's capacity is unknown."""
        limited, down = self._limited(), {h.verdict.gpu for h in self._down(self.known)}
        now = self._shares_now()
        total = sum(now.values())
        free = {g: c.capacity_per_second for g, c in self.gpus.items() if g not in limited}
        free.update(new or {})
        if total <= 0 or not free or not all(free.values()):
            return None
        # what each GPU would get were none of them held back
        every = {g: c.capacity_per_second or 0.0 for g, c in self.gpus.items() if g not in down}
        every.update(new or {})
        whole = sum(every.values())
        weights: dict[int, float] = {}
        for g in limited:
            share = 0.0 if g in down else now.get(g, 0.0) / total
            if g in self.pinned:
                share *= self.r.target_rho  # what its host serves, less: its wait drains
            if every.get(g) and whole > 0:
                share = min(share, every[g] / whole)
            weights[g] = share
        rest = max(0.0, 1.0 - sum(weights.values()))
        weights.update(self._by_capacity(rest, free, now, total, set(new or ())))
        return weights

    def _by_capacity(
        self,
        rest: float,
        free: Mapping[int, float | None],
        now: Mapping[int, float],
        total: float,
        new: set[int],
    ) -> dict[int, float]:
        """``rest`` of the pool's load over the ``free`` GPUs by capacity, a GPU whose capacity
        is not measured at most :data:`GUESSED_GROWTH` times its share now (or half an even
        share); what it cannot take goes to the others by capacity, and when every one is held
        so, the guesses take the rest after all."""
        floor = 0.5 / len(self.gpus) if self.gpus else 0.0
        cap = {
            g: max(GUESSED_GROWTH * now.get(g, 0.0) / total, floor)
            for g in free
            if g not in new and not self.gpus[g].measured
        }
        out: dict[int, float] = {}
        uncapped = dict(free)
        while uncapped:
            capacity = sum(c or 0.0 for c in uncapped.values())
            left = rest - sum(out.values())
            shares = {g: left * (c or 0.0) / capacity for g, c in uncapped.items()}
            over = {g for g, v in shares.items() if g in cap and v > cap[g]}
            if not over or over == uncapped.keys():
                out.update(shares)
                break
            for g in over:
                out[g] = cap[g]
                del uncapped[g]
        return out

    def _scale_out(self, because: Sequence[_Held], pool_rho: float) -> Recommendation | None:
        members = [c for c in self.gpus.values() if c.capacity_per_second]
        if not members:
            return None
        # the new GPUs are like the pool's commonest card whose capacity is measured
        basis = [c for c in members if c.measured] or members
        cards = [c.card for c in basis]
        card = max(set(cards), key=lambda x: (cards.count(x), x or ""))
        each = statistics.median(c.capacity_per_second or 0.0 for c in basis if c.card == card)
        capacity = sum(c.capacity_per_second or 0.0 for c in members)
        needed = max(1, math.ceil(pool_rho * capacity / self.r.target_rho / each - len(members)))
        # the new GPUs take the host's next indices
        last = max(g.gpu for g in self.model.gpus_.values() if g.host == self.host)
        new = {last + 1 + k: each for k in range(needed)}
        shares = self._capacity_weights(new)
        if shares is None:
            return None
        after = self.model.predict_rho(self.host, self.pool, shares, new)
        if after is not None and not basis[0].measured:
            after = {g: r for g, r in after.items() if g not in new}
        return self._make(
            "scale_out",
            f"pool:{self.pool}",
            {
                "gpus": needed,
                "card": card,
                "weights": self._weight_list(shares),
            },
            f"the pool is offered {pool_rho:.2f} of what its GPUs serve: no weighting can "
            f"cure it; add {needed} GPU(s) like its {card or 'cards'} to bring it to about "
            f"{self.r.target_rho:.2f}",
            because,
            after,
            receivers=[g for g in shares if g in self.gpus],
        )

    def _scale_in(self) -> Recommendation | None:
        if self.fleet is None or self.fleet.kind != "over_provisioning":
            return None
        idle = self._held_where("starved", {"low_demand"})
        if len(idle) < len(self.gpus) or len(self.gpus) < 2:
            return None
        smallest = min(
            (c for c in self.gpus.values() if c.capacity_per_second),
            key=lambda c: (c.capacity_per_second, -c.gpu),
            default=None,
        )
        if smallest is None:
            return None
        shares = {g: s for g, s in self._shares_now().items() if g != smallest.gpu}
        if not any(shares.values()):
            return None
        shares[smallest.gpu] = 0.0
        after = self.model.predict_rho(self.host, self.pool, shares)
        if after is None or max(after.values()) >= self.r.target_rho:
            return None
        # the GPUs left must serve the recent peak too: a lull between bursts is no surplus
        busiest = self.busiest_per_second
        if busiest is None:
            return None  # too few windows yet to know the pool's recent peak
        peak = self.model.predict_rho(self.host, self.pool, shares, offered_per_second=busiest)
        if peak is None or max(peak.values()) >= self.r.target_rho:
            return None
        windows = self.r.scale_in_windows
        return self._make(
            "remove_worker",
            f"gpu:{smallest.gpu}",
            {
                "gpu": smallest.gpu,
                "workers": self._worker_names([smallest.gpu]),
            },
            f"every GPU of the pool is starved for want of demand: GPU {smallest.gpu}'s "
            f"worker can go and the others stay under ρ {self.r.target_rho:.2f}, at the "
            f"busiest of the last {windows} windows too ({busiest:.2f} requests/s: ρ up to "
            f"{max(peak.values()):.2f})",
            idle,
            after,
            receivers=shares,
        )

    def _host_limits(self) -> list[Recommendation]:
        out = []
        what = {
            "host_bound": "its feeding process is pinned at its CPU threads: more threads or "
            "cores for preprocessing, or less work per request on the host",
            "io_bound": "the host waits on its disk: faster storage, caching of what each "
            "request reads, or fewer readers",
            "memory_pressure": "its KV region limits its batches (allocations fail, or a "
            "full batch of its requests would not fit): a smaller maximum batch, a larger KV "
            "region, or shorter contexts",
            "throttling": "its clock is held down: cooling, power limit or the board's "
            "slowdown reason",
        }
        for h in self._held_where("overloaded") + self._held_where("starved"):
            cause = h.verdict.cause
            if cause not in what:
                continue
            out.append(
                self._make(
                    "investigate_host",
                    f"gpu:{h.verdict.gpu}",
                    {"gpu": h.verdict.gpu, "cause": cause},
                    f"GPU {h.verdict.gpu} is {h.verdict.state} for a reason no routing change "
                    f"cures: {what[cause]}",
                    [h],
                    None,
                )
            )
        return out

    def _batching(self) -> list[Recommendation]:
        out = []
        for h in self._held_where("starved", {"batch_delay"}):
            gpu = h.verdict.gpu
            # the capacity model's ρ is at full batches: a shorter wait changes how long the
            # GPU idles for a batch to fill, not the work it is offered
            after = dict(self.rho_now) if self.rho_now else None
            out.append(
                self._make(
                    "tune_batching",
                    f"gpu:{gpu}",
                    {"gpu": gpu, "max_queue_delay_seconds": 0.0},
                    f"GPU {gpu} idles while its requests wait for a batch to fill: run what is "
                    "waiting as soon as the GPU is free (a shorter maximum queue delay)",
                    [h],
                    after,
                )
            )
        return out

    def _interference(self) -> list[Recommendation]:
        mixed = self._held_where("overloaded", {"class_interference"})
        if not mixed or len(self.gpus) < 2:
            return []
        served = [self.classes.get((self.host, g), ()) for g in sorted(self.gpus)]
        if len({c for mine in served for c in mine}) >= 2 and sum(len(m) >= 2 for m in served) < 2:
            return []  # its GPUs serve its classes apart already: split (verdicts lag it)
        pool_rho = self.model.pool_rho(self.host, self.pool)
        if pool_rho is None:
            return []
        batch, interactive, after = self._split(pool_rho)
        return [
            self._make(
                "split_pools",
                f"pool:{self.pool}",
                {
                    "batch_gpus": batch,
                    "interactive_gpus": interactive,
                    "batch_workers": self._worker_names(batch),
                    "interactive_workers": self._worker_names(interactive),
                },
                f"interactive requests wait behind batch work in the queues of "
                f"{_gpus(h.verdict.gpu for h in mixed)}: serve the batch class from its own "
                "GPUs",
                mixed,
                after,
                receivers=sorted(self.gpus),
            )
        ]


@dataclass(frozen=True, slots=True)
class _Demand:
    """A pool's offered load over its latest windows: the latest, and its trend."""

    latest_per_second: float | None
    slope_per_second2: float  # least squares over the windows

    @classmethod
    def of(cls, table: FeatureTable, pool: _Pool, windows: int = 4) -> _Demand:
        recent = sorted(_offered_by_window(table, pool.host, pool.pool).items())[-windows:]
        if not recent:
            return cls(None, 0.0)
        slope = 0.0
        if len(recent) > 1:
            t_mean = statistics.fmean(t for t, _ in recent)
            r_mean = statistics.fmean(r for _, r in recent)
            spread = sum((t - t_mean) ** 2 for t, _ in recent)
            slope = sum((t - t_mean) * (r - r_mean) for t, r in recent) / spread
        return cls(recent[-1][1], slope)

    def per_second(self, ahead_seconds: float) -> float | None:
        """The offered load ``ahead_seconds`` on, if the trend holds."""
        if self.latest_per_second is None:
            return None
        return max(0.0, self.latest_per_second + self.slope_per_second2 * ahead_seconds)

    def load(self, ahead_seconds: float) -> float | None:
        """What to plan for over the next ``ahead_seconds``: the latest load, or more where it
        rises."""
        later = self.per_second(ahead_seconds)
        if later is None or self.latest_per_second is None:
            return None
        return max(later, self.latest_per_second)


@dataclass(frozen=True, slots=True)
class _Move:
    """One GPU of ``quiet`` moved to ``busy``, and the ρ of both pools after it."""

    busy: _Pool
    quiet: _Pool
    gpu: int
    capacity_per_second: float  # what it serves of the busy pool's model
    rho_before: Mapping[int, float]  # both pools' GPUs
    rho_after: Mapping[int, float]
    busy_rho: float  # the busy pool's, when the moved GPU is ready if it stayed as it is
    gain: float  # the drop of the higher ρ of the two pools

    @classmethod
    def of(
        cls, r: Recommender, busy: _Pool, quiet: _Pool, demand: Mapping[str, _Demand]
    ) -> _Move | None:
        """The move of the quiet pool's least-loaded GPU, when the busy pool is at ``move_rho``
        or more still when the GPU is ready and the quiet pool keeps a GPU; its gain is how
        much lower the higher ρ of the two pools is after it, the quiet pool's over the
        recommendation's horizon (its latest load, or its trend where it rises). None when a
        capacity or load is unknown.

        ρ here is a pool's: its load over its GPUs' summed capacity, as the capacity weights
        spread it."""
        gives, takes = quiet.gpus.values(), busy.gpus.values()
        if len(quiet.gpus) < 2 or not all(c.capacity_per_second for c in (*gives, *takes)):
            return None
        if any(c.offered_per_second is None for c in gives):
            return None
        # a GPU serves what its pool's GPUs of its card serve (the median: a GPU measured over
        # few windows, one just moved, is only bounded from below), at the batches its pool
        # can run: more load grows its batches before it needs another GPU
        quiet_cards, busy_cards = _card_capacity(quiet), _card_capacity(busy)
        busy_load = demand[busy.pool].load(r.move_load_seconds)
        quiet_now = demand[quiet.pool].latest_per_second
        quiet_load = demand[quiet.pool].load(r.ttl_seconds)
        if busy_load is None or quiet_now is None or quiet_load is None:
            return None
        moved = min(gives, key=lambda c: (c.offered_per_second or 0.0, c.gpu))
        # on the busy pool's model it serves what the busy pool's GPUs of its card serve
        if moved.card not in busy_cards:
            return None
        each = busy_cards[moved.card]
        busy_capacity = sum(busy_cards[c.card] for c in takes)
        quiet_capacity = sum(quiet_cards[c.card] for c in gives)
        left = quiet_capacity - quiet_cards[moved.card]
        busy_rho, quiet_after = busy_load / busy_capacity, quiet_load / left
        if busy_rho < r.move_rho:
            return None
        busy_after = busy_load / (busy_capacity + each)
        before = {g: quiet_now / quiet_capacity for g in quiet.gpus}
        before.update(dict.fromkeys(busy.gpus, busy_rho))
        after = {g: quiet_after for g in quiet.gpus if g != moved.gpu}
        after.update(dict.fromkeys([*busy.gpus, moved.gpu], busy_after))
        # what it buys: the higher ρ of the two pools, lower (a move back would raise it again)
        gain = max(before.values()) - max(after.values())
        return cls(busy, quiet, moved.gpu, each, before, after, busy_rho, gain)

    @property
    def rho_after_quiet(self) -> float:
        return max(r for g, r in self.rho_after.items() if g in self.quiet.gpus)

    def recommendation(self) -> Recommendation:
        busy, quiet, gpu = self.busy, self.quiet, self.gpu
        made = quiet._make(
            "move_worker",
            f"gpu:{gpu}",
            {
                "gpu": gpu,
                "workers": list(quiet.workers.get((quiet.host, gpu), ())),
                # the busy pool as the analyzer names it, and its workers: the servers an
                # executor finds its backend by
                "to": busy.pool,
                "to_workers": sorted(
                    name for g in busy.gpus for name in busy.workers.get((busy.host, g), ())
                ),
            },
            f"{busy.pool} is offered {self.busy_rho:.2f} of what its GPUs serve with requests "
            f"queued, while {quiet.pool} would be at ρ {self.rho_after_quiet:.2f} with one GPU "
            f"fewer: move GPU {gpu} to {busy.pool}",
            [],
            None,
        )
        capacity = {g: c for p in (quiet, busy) for g, c in p.gpus.items()}
        sure = min([busy.gpus[g].confidence for g in busy.gpus] or [1.0])
        return dataclasses.replace(
            made,
            # a move back is another recommendation: the pool it goes to is part of its id
            id=_stable_id("move_worker", quiet.host, quiet.pool, f"gpu:{gpu}->{busy.pool}"),
            evidence=(
                *made.evidence,
                f"capacity model, ρ of {busy.pool} now: {_rho_text(busy.rho_now, busy.measured)}",
                "ρ before and after: each pool's latest offered load (its trend where it rises) "
                "over its GPUs' capacity",
            ),
            confidence=round(min(made.confidence, sure), 4),
            expected=ExpectedEffect(
                rho_before={g: round(r, 4) for g, r in sorted(self.rho_before.items())},
                rho_after={g: round(r, 4) for g, r in sorted(self.rho_after.items())},
                idle_while_queued_before=None,
                idle_while_queued_after=None,
                # as the ρ above take them: each pool's GPUs of a card at their median
                capacity_per_second={
                    **{
                        g: round(cards[c.card], 4)
                        for p, cards in (
                            (quiet, _card_capacity(quiet)),
                            (busy, _card_capacity(busy)),
                        )
                        for g, c in sorted(p.gpus.items())
                        if g != gpu
                    },
                    gpu: round(self.capacity_per_second, 4),
                },
                capacity_source={g: c.source for g, c in sorted(capacity.items())},
            ),
        )


def _card_capacity(pool: _Pool) -> dict[str | None, float]:
    """The median capacity of the pool's GPUs of each card."""
    by_card: dict[str | None, list[float]] = {}
    for c in pool.gpus.values():
        by_card.setdefault(c.card, []).append(c.capacity_per_second or 0.0)
    return {card: statistics.median(values) for card, values in by_card.items()}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
