"""Ground truth: the state and cause of every GPU in every window, from the model's own
quantities, never from what the telemetry shows.

It is a function of the scenario and its request stream alone (no simulation dynamics, no
realized queue), so the fast and the live speed, which send the same requests, get identical
truth. The rules are written out in lab/scenarios/README.md, "Ground truth"; the constants
below are the thresholds named there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpubalance.lab.model.service import ServiceModel
from gpubalance.lab.routing import sticky_target
from gpubalance.lab.scenario import Plan, PlannedWorker
from gpubalance.lab.workload import Request

OVERLOADED_RHO = 0.85  # the GPU needs this share of the window or more: queues build
STARVED_RHO = 0.30  # the GPU needs less than this share: it idles most of the window
BUSY_PEER_RHO = 0.60  # a peer this busy means the work exists but went elsewhere
THROTTLED_CLOCK = 0.90  # mean clock ratio at or below this counts as throttled
SLOW_CARD_COST = 1.25  # a card this much slower per request than its pool's fastest
MEMORY_RATIO = 0.80  # a full batch of the window's mean request needs this share of KV
MEMORY_BUSY_RHO = 0.50  # ... while the worker is busy enough to fill batches
INTERFERENCE_COST = 4.0  # batch-class requests this much costlier than interactive ones
INTERFERENCE_SHARE = 0.25  # ... making up this share of the worker's work
BATCH_IDLE_SHARE = 0.50  # GPU idle while requests wait for their batch to fill
DOWN_SHARE = 0.50  # a worker down this share of the window starves its GPU
CAPACITY_AWARE = frozenset({"least_connections", "random_of_2", "pooled"})

STATES = ("starved", "overloaded", "balanced")
CAUSES = (
    "none",
    "routing_skew",
    "slow_card",
    "host_bound",
    "io_bound",
    "memory_pressure",
    "throttling",
    "batch_delay",
    "class_interference",
    "capacity_shortage",
    "low_demand",
    "worker_crash",
)


@dataclass(frozen=True, slots=True)
class TruthRow:
    t_start: float
    t_end: float
    gpu: int
    state: str
    cause: str
    # evidence, written to truth_evidence.csv
    rho: float
    rho_unthrottled: float
    clock_ratio: float
    cpu_limited: bool
    io_limited: bool
    memory_ratio: float
    batch_idle_share: float
    share_of_pool_work: float
    capacity_share: float
    down_share: float
    fair_rho: float


class _Timeline:
    """Scenario state at any time: clock ratios, worker availability, weights, preprocessing."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        scenario = plan.scenario
        self.events = sorted(scenario.events, key=lambda e: e.at)
        self.duration = scenario.duration_seconds

    def clock_ratio(self, gpu: int, start: float, end: float) -> float:
        """Time-weighted mean clock ratio of ``gpu`` over [start, end)."""
        points = [(0.0, 1.0)] + [
            (e.at, e.throttle.clock_ratio)
            for e in self.events
            if e.throttle is not None and e.throttle.gpu == gpu
        ]
        return _time_weighted(points, start, end)

    def lost_at(self, gpu: int) -> float | None:
        return next((e.at for e in self.events if e.gpu_lost and e.gpu_lost.gpu == gpu), None)

    def up_share(self, worker: PlannedWorker, start: float, end: float) -> float:
        points = [(0.0, 1.0)]
        for e in self.events:
            if e.worker_crash is not None and e.worker_crash.worker == worker.name:
                points.append((e.at, 0.0))
                if e.worker_crash.restart_after_seconds is not None:
                    points.append((e.at + e.worker_crash.restart_after_seconds, 1.0))
            if e.gpu_lost is not None and e.gpu_lost.gpu == worker.gpu:
                points.append((e.at, 0.0))
                points.append((math.inf, 0.0))
        points.sort(key=lambda p: p[0])
        # once the GPU is lost the worker never comes back
        lost = self.lost_at(worker.gpu)
        if lost is not None:
            points = [p for p in points if p[0] < lost] + [(lost, 0.0)]
        return _time_weighted(points, start, end)

    def at(self, t: float) -> dict[str, object]:
        """Weights, preprocessing and disk bandwidth in force at time ``t``."""
        scenario = self.plan.scenario
        weights = dict(scenario.router.weights)
        cpu = {
            w.name: (w.preprocess.cpu_ms, w.preprocess.cpu_ms_per_1k_prompt_tokens)
            for w in self.plan.workers
        }
        disk = scenario.hardware.host.disk_mb_per_second
        for e in self.events:
            if e.at > t:
                break
            if e.router is not None:
                weights.update(e.router.weights)
            if e.preprocess is not None:
                ms, per_1k = cpu[e.preprocess.worker]
                cpu[e.preprocess.worker] = (
                    ms if e.preprocess.cpu_ms is None else e.preprocess.cpu_ms,
                    per_1k
                    if e.preprocess.cpu_ms_per_1k_prompt_tokens is None
                    else e.preprocess.cpu_ms_per_1k_prompt_tokens,
                )
            if e.disk is not None:
                disk = e.disk.disk_mb_per_second
        return {"weights": weights, "cpu": cpu, "disk": disk}


def _time_weighted(points: list[tuple[float, float]], start: float, end: float) -> float:
    """Mean over [start, end) of a step function given as sorted (time, value) changes."""
    total = 0.0
    for i, (t, value) in enumerate(points):
        nxt = points[i + 1][0] if i + 1 < len(points) else math.inf
        lo, hi = max(t, start), min(nxt, end)
        if hi > lo:
            total += value * (hi - lo)
    return total / (end - start)


def compute(plan: Plan, requests: Sequence[Request], duration_seconds: float) -> list[TruthRow]:
    scenario = plan.scenario
    width = scenario.truth_window_seconds
    timeline = _Timeline(plan)
    workers = plan.workers
    models = {
        w.name: ServiceModel(
            plan.gpus[w.gpu].card, w.model.params_billions, w.model.bytes_per_param
        )
        for w in workers
    }
    arrival = np.array([r.arrival_seconds for r in requests])
    prompt = np.array([r.prompt_tokens for r in requests], dtype=float)
    output = np.array([r.output_tokens for r in requests], dtype=float)
    is_batch = np.array([r.service_class == "batch" for r in requests], dtype=bool)
    # per worker, per request: its share of a full batch, prefill and decode seconds
    costs = {
        w.name: models[w.name].request_cost_seconds(w.max_batch_size, prompt, output)
        for w in workers
    }
    rows: list[TruthRow] = []
    n_windows = math.ceil(duration_seconds / width - 1e-9)
    for k in range(n_windows):
        start, end = k * width, min((k + 1) * width, duration_seconds)
        if end - start < width / 2:
            break  # a stub window at the end says little: leave it out
        index = np.nonzero((arrival >= start) & (arrival < end))[0]
        rows += _window(
            plan, timeline, requests, index, costs, models, prompt, output, is_batch, start, end
        )
    return rows


@dataclass
class _WorkerLoad:
    prefill: float = 0.0  # GPU seconds at full batches, unthrottled
    decode: float = 0.0
    requests: float = 0.0
    cpu_seconds: float = 0.0
    io_mb: float = 0.0
    kv_bytes: float = 0.0
    interactive_cost: float = 0.0
    interactive_n: float = 0.0
    batch_cost: float = 0.0
    batch_n: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0


def _window(
    plan: Plan,
    timeline: _Timeline,
    requests: Sequence[Request],
    index: np.ndarray,
    costs: dict[str, tuple[np.ndarray, np.ndarray]],
    models: dict[str, ServiceModel],
    prompt: np.ndarray,
    output: np.ndarray,
    is_batch: np.ndarray,
    start: float,
    end: float,
) -> list[TruthRow]:
    scenario = plan.scenario
    width = end - start
    state = timeline.at((start + end) / 2)
    weights: dict[str, float] = state["weights"]  # type: ignore[assignment]
    cpu_params: dict[str, tuple[float, float]] = state["cpu"]  # type: ignore[assignment]
    disk_mb_s: float = state["disk"]  # type: ignore[assignment]
    policy = scenario.router.policy
    up = {w.name: timeline.up_share(w, start, end) for w in plan.workers}
    clock = {g.index: timeline.clock_ratio(g.index, start, end) for g in plan.gpus}
    loads = {w.name: _WorkerLoad() for w in plan.workers}

    def cost_of(worker: PlannedWorker, ids: np.ndarray) -> tuple[float, float]:
        # Static batching: a batch decodes until its longest request is done, so decode costs
        # what the expected longest of a full batch costs, not the mean.
        prefill, decode = costs[worker.name]
        mean = float(output[ids].mean())
        inflation = expected_max(output[ids], worker.max_batch_size) / mean if mean else 1.0
        return float(prefill[ids].sum()), float(decode[ids].sum()) * inflation

    for pool_name in sorted({w.pool for w in plan.workers}):
        pool = plan.workers_in(pool_name)
        in_pool = [
            i for i in index.tolist() if plan.pool_of(requests[i].service_class) == pool_name
        ]
        if not in_pool:
            continue
        ids = np.array(in_pool)
        live = [w for w in pool if up[w.name] > 0 and weights.get(w.name, 1.0) > 0]
        if not live:
            continue
        groups: list[tuple[np.ndarray, dict[str, float]]] = []
        if policy == "sticky":
            names = [w.name for w in pool]
            by_target: dict[str, list[int]] = {}
            loose: list[int] = []
            for i in in_pool:
                session = requests[i].session
                if session is None:
                    loose.append(i)
                    continue
                target = sticky_target(session, names)
                # the router takes a weight-0 worker out of rotation, sticky sessions included
                if up.get(target, 0.0) >= DOWN_SHARE and weights.get(target, 1.0) > 0:
                    by_target.setdefault(target, []).append(i)
                else:
                    loose.append(i)
            for target, members in by_target.items():
                groups.append((np.array(members), {target: 1.0}))
            if loose:
                groups.append((np.array(loose), _even(live, up)))
        elif policy == "weighted_round_robin":
            total = sum(weights.get(w.name, 1.0) * up[w.name] for w in live)
            groups.append(
                (ids, {w.name: weights.get(w.name, 1.0) * up[w.name] / total for w in live})
            )
        elif policy in CAPACITY_AWARE:
            # these policies steer work to whoever drains it: the share follows capacity
            capacity = {}
            for w in live:
                prefill, decode = cost_of(w, ids)
                c = clock[w.gpu]
                per_request = (prefill / c + decode / math.sqrt(c)) / len(ids)
                capacity[w.name] = up[w.name] / per_request
            if policy == "least_connections":
                # in flight per unit of weight is what it evens out: a server weighted k times
                # holds k times the requests, so it is sent k times its capacity's share, up
                # to what it can serve
                limit = {n: v * width / len(ids) for n, v in capacity.items()}
                shares = _fill({n: weights.get(n, 1.0) * v for n, v in capacity.items()}, limit)
            else:
                total = sum(capacity.values())
                shares = {n: v / total for n, v in capacity.items()}
            groups.append((ids, shares))
        else:
            groups.append((ids, _even(live, up)))
        by_name = {w.name: w for w in plan.workers}
        for members, shares in groups:
            batch_class = is_batch[members]
            for name, share in shares.items():
                worker = by_name[name]
                load = loads[name]
                prefill, decode = cost_of(worker, members)
                load.prefill += share * prefill
                load.decode += share * decode
                load.requests += share * len(members)
                load.prompt_tokens += share * float(prompt[members].sum())
                load.output_tokens += share * float(output[members].sum())
                ms, per_1k = cpu_params[name]
                load.cpu_seconds += (
                    share
                    * (ms * len(members) + per_1k * float(prompt[members].sum()) / 1000)
                    / 1000
                )
                load.io_mb += share * worker.io_mb_per_request * len(members)
                load.kv_bytes += (
                    share
                    * float((prompt[members] + output[members]).sum())
                    * worker.model.kv_bytes_per_token
                )
                each = costs[name][0][members] + costs[name][1][members]
                load.batch_cost += share * float(each[batch_class].sum())
                load.batch_n += share * int(batch_class.sum())
                load.interactive_cost += share * float(each[~batch_class].sum())
                load.interactive_n += share * int((~batch_class).sum())
    return _judge(
        plan,
        loads,
        up,
        clock,
        disk_mb_s,
        models,
        prompt,
        output,
        index,
        start,
        end,
        width,
        policy,
        timeline,
    )


def expected_max(values: np.ndarray, draws: int) -> float:
    """E[max of ``draws`` picks] from the empirical distribution of ``values``."""
    if len(values) == 0:
        return 0.0
    ordered = np.sort(values)
    n = len(ordered)
    cdf = np.arange(1, n + 1) / n
    weights = cdf**draws - (cdf - 1 / n) ** draws
    return float((ordered * weights).sum())


def _even(live: Sequence[PlannedWorker], up: dict[str, float]) -> dict[str, float]:
    total = sum(up[w.name] for w in live)
    return {w.name: up[w.name] / total for w in live}


@dataclass(frozen=True, slots=True)
class _Figures:
    """One GPU in one window: what the rules read about the GPU itself."""

    rho: float
    rho_free: float
    clock: float
    cpu_limited: bool
    io_limited: bool
    memory: bool  # memory pressure
    memory_ratio: float
    batch_idle: float
    interference: bool
    down: float

    @property
    def limited(self) -> bool:
        """Its worker is down most of the window or its host caps what reaches it: work sent
        here would wait, so the GPU cannot relieve another."""
        return self.down >= DOWN_SHARE or self.cpu_limited or self.io_limited

    @property
    def takes_work(self) -> bool:
        """More work sent here would be served: not limited, and its KV cache has room."""
        return not (self.limited or self.memory)


@dataclass(frozen=True, slots=True)
class _View:
    """One GPU among the others: its pool's shares and whether its work could go elsewhere."""

    share: float  # of its pool peers' requests
    capacity_share: float  # of its pool peers' capacity
    slow: bool
    busy_peer: bool
    fair_rho: float  # rho of a capacity-proportional split over the GPUs that take its work
    fair_rho_unthrottled: float  # the same with this GPU at full clock


def _judge(
    plan: Plan,
    loads: dict[str, _WorkerLoad],
    up: dict[str, float],
    clock: dict[int, float],
    disk_mb_s: float,
    models: dict[str, ServiceModel],
    prompt: np.ndarray,
    output: np.ndarray,
    index: np.ndarray,
    start: float,
    end: float,
    width: float,
    policy: str,
    timeline: _Timeline,
) -> list[TruthRow]:
    cores = plan.scenario.hardware.host.cores
    threads_total = sum(w.preprocess.threads for w in plan.workers)
    disk_seconds = sum(load.io_mb for load in loads.values()) / disk_mb_s
    io_factor = min(1.0, width / disk_seconds) if disk_seconds > 0 else 1.0
    figures: dict[int, _Figures] = {}
    for gpu in plan.gpus:
        lost = timeline.lost_at(gpu.index)
        if lost is not None and lost < end:
            continue  # a lost GPU has no truth from the window it was lost in
        c = clock[gpu.index]
        rho = rho_free = 0.0
        cpu_limited = io_limited = memory = interference = False
        memory_ratio = batch_idle = 0.0
        down = 0.0
        for w in (w for w in plan.workers if w.gpu == gpu.index):
            load = loads[w.name]
            cpu_capacity = (
                width
                * up[w.name]
                * min(
                    w.preprocess.threads, cores * w.preprocess.threads / max(threads_total, cores)
                )
            )
            cpu_factor = min(1.0, cpu_capacity / load.cpu_seconds) if load.cpu_seconds else 1.0
            factor = cpu_factor
            if w.io_mb_per_request > 0:
                factor = min(factor, io_factor)
                io_limited |= io_factor < 1.0
            cpu_limited |= cpu_factor < 1.0
            work = load.prefill / c + load.decode / math.sqrt(c)
            rho += factor * work / width
            rho_free += factor * (load.prefill + load.decode) / width
            down = max(down, 1.0 - up[w.name])
            if load.requests > 0:
                mean_kv = load.kv_bytes / load.requests
                ratio = w.max_batch_size * mean_kv / w.kv_cache_bytes if w.kv_cache_bytes else 1.0
                memory_ratio = max(memory_ratio, ratio)
                w_rho = factor * work / width
                if ratio >= MEMORY_RATIO and w_rho >= MEMORY_BUSY_RHO:
                    memory = True
                batch_idle = max(batch_idle, _batch_idle_share(w, load, models[w.name], width, c))
                if load.batch_n and load.interactive_n:
                    b_cost = load.batch_cost / load.batch_n
                    i_cost = load.interactive_cost / load.interactive_n
                    total = load.batch_cost + load.interactive_cost
                    if (
                        b_cost >= INTERFERENCE_COST * i_cost
                        and (load.batch_cost / total >= INTERFERENCE_SHARE)
                        and w_rho >= STARVED_RHO
                    ):
                        interference = True
        figures[gpu.index] = _Figures(
            rho=rho,
            rho_free=rho_free,
            clock=c,
            cpu_limited=cpu_limited,
            io_limited=io_limited,
            memory=memory,
            memory_ratio=memory_ratio,
            batch_idle=batch_idle,
            interference=interference,
            down=down,
        )
    # per worker: the mean cost of the window's requests on it, at its GPU's clock
    sample_p = prompt[index] if len(index) else np.array([512.0])
    sample_o = output[index] if len(index) else np.array([128.0])
    cost: dict[str, float] = {}
    cost_free: dict[str, float] = {}  # the same at full clock
    for w in plan.workers:
        if w.gpu in figures:
            a, d = models[w.name].request_cost_seconds(w.max_batch_size, sample_p, sample_o)
            c = figures[w.gpu].clock
            cost[w.name] = float((a / c + d / math.sqrt(c)).mean())
            cost_free[w.name] = float((a + d).mean())
    rows = []
    for gpu, v in figures.items():
        view = _pool_view(plan, gpu, figures, loads, cost, cost_free, up)
        state, cause = _classify(v, view, policy)
        rows.append(
            TruthRow(
                t_start=start,
                t_end=end,
                gpu=gpu,
                state=state,
                cause=cause,
                rho=round(v.rho, 4),
                rho_unthrottled=round(v.rho_free, 4),
                clock_ratio=round(v.clock, 4),
                cpu_limited=v.cpu_limited,
                io_limited=v.io_limited,
                memory_ratio=round(v.memory_ratio, 4),
                batch_idle_share=round(v.batch_idle, 4),
                share_of_pool_work=round(view.share, 4),
                capacity_share=round(view.capacity_share, 4),
                down_share=round(v.down, 4),
                fair_rho=round(view.fair_rho, 4),
            )
        )
    return rows


def _batch_idle_share(
    worker: PlannedWorker, load: _WorkerLoad, model: ServiceModel, width: float, clock: float
) -> float:
    """Share of a batch cycle the GPU idles while requests wait for the batch to fill."""
    delay = worker.max_queue_delay_seconds
    rate = load.requests / width
    if delay <= 0 or rate <= 0:
        return 0.0
    fill = (worker.max_batch_size - 1) / rate
    wait = min(delay, fill)
    batch = max(1, min(worker.max_batch_size, round(1 + rate * wait)))
    # the batch that forms in that wait, of the window's mean request, on the service model
    prompt = round(load.prompt_tokens / load.requests)
    output = round(load.output_tokens / load.requests)
    busy, _ = model.batch_timeline([prompt] * batch, [output] * batch, clock)
    return wait / (wait + busy) if wait + busy > 0 else 0.0


def _pool_view(
    plan: Plan,
    gpu: int,
    figures: dict[int, _Figures],
    loads: dict[str, _WorkerLoad],
    cost: dict[str, float],
    cost_free: dict[str, float],
    up: dict[str, float],
) -> _View:
    def first(g: int, accept: Callable[[PlannedWorker], bool]) -> PlannedWorker | None:
        return next((w for w in plan.workers if w.gpu == g and accept(w)), None)

    mine = first(gpu, lambda w: True)
    if mine is None:  # a GPU without workers gets no work and relieves no one
        return _View(0.0, 0.0, False, False, figures[gpu].rho, figures[gpu].rho)
    # pool peers: the GPUs the same router spreads this GPU's requests over
    pools = {w.pool for w in plan.workers if w.gpu == gpu}
    pool_worker = {g: w for g in figures if (w := first(g, lambda w: w.pool in pools)) is not None}
    capacity = {g: up[w.name] / cost[w.name] for g, w in pool_worker.items()}
    work = {g: sum(loads[w.name].requests for w in plan.workers if w.gpu == g) for g in pool_worker}
    total_work = sum(work.values())
    share = work[gpu] / total_work if total_work else 0.0
    total_capacity = sum(capacity.values())
    capacity_share = capacity[gpu] / total_capacity if total_capacity else 0.0
    # slow next to the peers that could take its work, and sent more than its capacity share
    able = [g for g in pool_worker if g == gpu or figures[g].takes_work]
    cheapest = min(cost[pool_worker[g].name] for g in able)
    slow = cost[pool_worker[gpu].name] >= SLOW_CARD_COST * cheapest and share > capacity_share
    busy_peer = any(figures[g].rho >= BUSY_PEER_RHO for g in pool_worker if g != gpu)
    # the GPUs that could serve this GPU's work (its model, any pool: pools are the router's
    # choice, models are not) and can take more, with their work split by capacity
    fair = {
        g: w
        for g in figures
        if (g == gpu or figures[g].takes_work)
        and (w := first(g, lambda w: w.model_name == mine.model_name)) is not None
    }
    weight = {g: up[w.name] / cost[w.name] for g, w in fair.items()}
    rho = {g: figures[g].rho for g in fair}
    fair_rho = _weighted(rho, weight, figures[gpu].rho)
    # the same split with this GPU at full clock: what a capacity-aware router would do once
    # a throttle is lifted
    weight[gpu] = up[mine.name] / cost_free[mine.name]
    rho[gpu] = figures[gpu].rho_free
    fair_rho_unthrottled = _weighted(rho, weight, figures[gpu].rho_free)
    return _View(share, capacity_share, slow, busy_peer, fair_rho, fair_rho_unthrottled)


def _fill(pull: Mapping[str, float], limit: Mapping[str, float]) -> dict[str, float]:
    """Shares of a pool's work in proportion to ``pull``, none above its ``limit`` (the share
    that keeps it at ρ 1): what a server cannot take goes to the others in proportion to
    theirs. With more work than the pool serves, every server is at its limit: shares in
    proportion to the limits."""
    shares: dict[str, float] = {}
    free = dict(pull)
    left = 1.0
    while free:
        total = sum(free.values())
        over = [n for n, v in free.items() if left * v / total > limit[n]]
        if not over:
            shares.update({n: left * v / total for n, v in free.items()})
            return shares
        for n in over:
            shares[n] = limit[n]
            left -= limit[n]
            del free[n]
        if left <= 0:
            break
    whole = sum(limit.values())
    return {n: v / whole for n, v in limit.items()}


def _weighted(values: dict[int, float], weights: dict[int, float], default: float) -> float:
    total = sum(weights.values())
    return sum(weights[k] * values[k] for k in values) / total if total else default


def _classify(v: _Figures, view: _View, policy: str) -> tuple[str, str]:
    """State and cause, in the order of lab/scenarios/README.md, "Decision, in this order"."""
    rho = v.rho
    if rho >= OVERLOADED_RHO or v.memory or v.interference:
        if v.memory:
            return "overloaded", "memory_pressure"
        # at full clock, would it cope? A capacity-aware router would send it more work then
        free = view.fair_rho_unthrottled if policy in CAPACITY_AWARE else v.rho_free
        if v.clock <= THROTTLED_CLOCK and free < OVERLOADED_RHO:
            return "overloaded", "throttling"
        if v.interference and rho < OVERLOADED_RHO:
            return "overloaded", "class_interference"
        if view.fair_rho >= OVERLOADED_RHO:
            # no GPU that could take the work has room for it: moving work cannot help
            return "overloaded", "capacity_shortage"
        if view.slow and policy not in CAPACITY_AWARE:
            return "overloaded", "slow_card"
        if v.interference:
            return "overloaded", "class_interference"
        return "overloaded", "routing_skew"
    if rho < STARVED_RHO:
        # down most of the window, or up all of it the GPU would not have starved
        if v.down >= DOWN_SHARE or (v.down > 0 and v.rho / (1 - v.down) >= STARVED_RHO):
            return "starved", "worker_crash"
        if v.cpu_limited:
            return "starved", "host_bound"
        if v.io_limited:
            return "starved", "io_bound"
        if v.batch_idle >= BATCH_IDLE_SHARE:
            return "starved", "batch_delay"
        if view.busy_peer and view.fair_rho >= STARVED_RHO:
            # the work exists, went to a peer, and a split by capacity would feed this GPU
            return "starved", "routing_skew"
        return "starved", "low_demand"
    return "balanced", "none"
