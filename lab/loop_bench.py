"""`gpubalance bench loop`: one scenario under one balancing policy at the fast speed, closed
loop included, and what it did to latency and to the GPUs.

The scenario's cards, workers, pools, traffic, events and server weights are the static
baseline; the policy replaces only its balance algorithm, as `balance` does in HAProxy (and
under the controller, the weights are its own: the scenario's `router` events, a person
changing them, are left out):

- `round_robin`: HAProxy's roundrobin, by the servers' weights;
- `leastconn`: fewest requests in flight per unit of weight;
- `random2`: the fewer in flight of two random servers;
- `controller`: leastconn, with the analyzer and the controller acting on it every analysis
  window (`gpubalance.lab.control`);
- `oracle`: one central queue per pool that every worker pulls from when it has room;
- `static-best`: where GPUs serve two pools or more, one worker each: every split of the GPUs
  between the pools (each pool one GPU at least; GPUs of one card alike) under leastconn, and
  the split whose highest p99 of a class is lowest, the baseline a controller that moves GPUs
  between pools has to beat (its `placement` says which split).

Figures: p50 and p99 latency (arrival to answer, answered requests) per traffic class and
overall, and the same over the requests that arrived after the first two analysis windows
(`settled`: a scenario is skewed from t = 0, and no controller acts before its first verdict;
the backlog the start left still counts); requests failed (rejected, out of KV memory, lost
to a crash); idle-while-queued over the run (below); utilization spread (the largest minus
the smallest GPU's mean utilization); the controller's actions by kind, and the most actions
any one server took within one freeze period.

**Idle-while-queued** is the run's truth, from the simulator's timeline, not the analyzer's
estimate from window means: the share of the GPUs' time in service in which a GPU runs no
batch while a request it could serve (one of its pool's) waits, either in the pool's central
queue or in another GPU's batch queue behind the batch that GPU runs. A GPU is in a pool's
service while its server is one of the pool's, not in maint, and its worker is up: one the
controller took out (a removal, a move between taking it out and readying it in the other
pool) idles for nobody, nor does one whose worker crashed or whose GPU fell off the bus
(HAProxy's health check has it down; a restart, not a balancer, brings it back), and that
time is no GPU-time of the pools; while it drains it still counts. After
a split, the batch class comes by its own route (the pool's batch backend): only the GPUs
ready there serve it, and a GPU kept for the other classes idles for no batch request. A
request waiting for its own idle GPU's batch to fill, or for a host core before it reaches a
batch queue, is batching or the host, not balance, and does not count; nor does a GPU's idle
time while its host could take no more work for it (every preprocessing thread of its worker
busy, or a request waiting for a core or the disk): a balancer sending it more would add to
the host's queue, not to the GPU's work. One central queue
keeps it near 0 (only a dispatch that hands a worker requests it cannot start at once leaves
some).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gpubalance.arguments import seconds, seed

if TYPE_CHECKING:  # the modules load when a run needs them: `gpubalance --help` stays quick
    from gpubalance.analyzer.verdict import Classifier
    from gpubalance.controller.model import Settings
    from gpubalance.lab.fast import FastRun, RunResult
    from gpubalance.lab.scenario import Plan
    from gpubalance.lab.workload import RequestRecord
    from gpubalance.telemetry import Sample

POLICIES: dict[str, str] = {
    "round_robin": "weighted_round_robin",
    "leastconn": "least_connections",
    "random2": "random_of_2",
    "controller": "least_connections",
    "oracle": "pooled",
    "static-best": "least_connections",
}
STATIC_BEST = "static-best"  # leastconn on the best static split of the GPUs between pools
ALL = "all"  # the latency row over every class
REFUSED = frozenset({"rejected", "waiting", "failed"})  # the audit log's refusals
# the settled latency counts the requests that arrived after this many analysis windows: a
# scenario's skew is there from t = 0, and the controller acts on the first window's verdict
# at the earliest (two, where the verdict's persistence asks for two)
SETTLE_WINDOWS = 2


class BenchError(Exception):
    """A scenario, policy or model that cannot be used: exit code 2 with the message."""


@dataclass(frozen=True, slots=True)
class Latency:
    requests: int  # answered
    p50_seconds: float | None
    p99_seconds: float | None


@dataclass(frozen=True, slots=True)
class LoopResult:
    scenario: str
    policy: str
    seed: int
    duration_seconds: float
    requests: int
    failed: int
    latency: dict[str, Latency]  # per traffic class, and ALL
    # the same, of the requests that arrived after SETTLE_WINDOWS analysis windows
    settled: dict[str, Latency]
    settled_after_seconds: float
    idle_while_queued_ratio: float | None
    utilization_spread_ratio: float | None
    actions: dict[str, int] = field(default_factory=dict)  # applied, by action; and undone
    # the analyzer's recommendations over the run, by action, and the controller's refusals
    # of them, by reason (each recommendation and reason once)
    recommended: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    # recommendations carried out on any one server within freeze_seconds (most_actions_per_freeze)
    max_actions_per_freeze: int = 0
    passes: int = 0
    placement: dict[str, list[int]] = field(default_factory=dict)  # static-best: pool -> GPUs


def bench_settings() -> Settings:
    """The controller's settings in the benchmark: its defaults (a pass every 10 s), acting."""
    from gpubalance.controller.model import Settings

    return Settings(act=True)


def bench_plan(plan: Plan, policy: str) -> Plan:
    """The scenario's plan with the policy's balance algorithm and HAProxy's whole weights."""
    from gpubalance.lab.control import haproxy_weight

    if policy not in POLICIES:
        raise BenchError(f"--policy {policy!r}: unknown; one of {', '.join(POLICIES)}")
    router = plan.scenario.router
    weights = {w.name: float(haproxy_weight(router.weights.get(w.name, 1.0))) for w in plan.workers}
    changed: dict[str, Any] = {
        "router": router.model_copy(update={"policy": POLICIES[policy], "weights": weights})
    }
    if policy == "controller":
        # the weights are the controller's: a person's change of them (a `router` event) is
        # left out, as gpubalance.lab.apply leaves those after the time it applies at
        plan = without_router_events(plan)
    return dataclasses.replace(plan, scenario=plan.scenario.model_copy(update=changed))


def without_router_events(plan: Plan) -> Plan:
    """The plan without its `router` events: a person changing the weights mid-run."""
    kept = [e for e in plan.scenario.events if e.router is None]
    return dataclasses.replace(plan, scenario=plan.scenario.model_copy(update={"events": kept}))


def run_policy(
    plan: Plan,
    policy: str,
    seed_value: int,
    duration_seconds: float,
    classifier: Classifier | None = None,
    *,
    settings: Settings | None = None,
    on_sample: Callable[[Sample], None] | None = None,
    audit_to: Path | None = None,
) -> LoopResult:
    """Run ``plan`` under ``policy``; ``classifier`` judges for the controller (default the
    analyzer's default, the shipped model). ``audit_to``: where the controller's audit log (JSON
    lines, simulated times in ``at_seconds``) is written after the run."""
    from gpubalance.lab import traffic
    from gpubalance.lab.control import closed_loop
    from gpubalance.lab.fast import FastRun

    if policy == STATIC_BEST:
        return _static_best(plan, seed_value, duration_seconds, on_sample)
    changed = bench_plan(plan, policy)
    scenario = changed.scenario
    requests = traffic.generate(scenario.traffic, duration_seconds, seed_value)
    run = FastRun(changed, requests, seed_value, duration_seconds, on_sample)
    run.start()
    audit: list[dict[str, Any]] = []
    passes = 0
    recommended: dict[str, str] = {}
    if policy == "controller":
        settings = settings or bench_settings()
        with tempfile.TemporaryDirectory(prefix="gpubalance-loop-") as tmp:
            loop = closed_loop(run, classifier or _shipped(), settings, Path(tmp) / "a.log")
            loop.run_to_end()
            loop.controller.audit.close()
            audit = loop.controller.audit.entries()
            if audit_to is not None:
                lines = (json.dumps(e, sort_keys=True) + "\n" for e in audit)
                audit_to.write_text("".join(lines), encoding="utf-8")
            passes = len(loop.reports)
            recommended = loop.recommended
    result = run.finish()
    figures = _figures(changed, policy, seed_value, duration_seconds, run, result)
    refused = {
        (e["recommendation"], str(e["reason"]).split(":")[0])
        for e in audit
        if e.get("decision") in REFUSED
    }
    applied = [e for e in audit if e.get("decision") == "applied"]
    actions = Counter(str(e["action"]) for e in applied)
    # the changes put back after their recommendation made the pool slower
    actions.update("undone" for e in audit if e.get("decision") == "undone")
    return dataclasses.replace(
        figures,
        actions=dict(sorted(actions.items())),
        recommended=dict(sorted(Counter(recommended.values()).items())),
        refused=dict(sorted(Counter(reason for _, reason in refused).items())),
        max_actions_per_freeze=most_actions_per_freeze(applied, settings),
        passes=passes,
    )


@functools.cache
def _shipped() -> Classifier:
    """The shipped model, loaded once however many runs judge with it."""
    from gpubalance.analyzer import model

    return model.load_shipped()


def splits(plan: Plan) -> list[Plan]:
    """Every split of the plan's GPUs between its pools, each pool on one GPU or more, each GPU
    a worker like its pool's first (`lab.fast.placed`); splits that give each pool the same
    cards are one."""
    from gpubalance.lab.fast import placed

    pools = sorted({w.pool for w in plan.workers})
    ok = len(pools) > 1 and sorted(w.gpu for w in plan.workers) == [g.index for g in plan.gpus]
    if not ok:
        raise BenchError(
            f"--policy {STATIC_BEST}: needs GPUs serving two pools or more, one worker each; "
            f"{plan.scenario.name} has {len(pools)} pool(s), {len(plan.workers)} workers on "
            f"{len(plan.gpus)} GPUs"
        )
    templates = {pool: plan.workers_in(pool)[0] for pool in pools}
    out: dict[tuple[tuple[str, ...], ...], Plan] = {}
    for choice in itertools.product(pools, repeat=len(plan.gpus)):
        if set(choice) != set(pools):
            continue
        cards = tuple(
            tuple(sorted(plan.gpus[g].card.model for g, p in enumerate(choice) if p == pool))
            for pool in pools
        )
        workers = tuple(
            placed(plan, templates[pool], gpu, f"w{gpu}", gpu) for gpu, pool in enumerate(choice)
        )
        out.setdefault(cards, dataclasses.replace(plan, workers=workers))
    return list(out.values())


def _static_best(
    plan: Plan, seed_value: int, duration: float, on_sample: Callable[[Sample], None] | None
) -> LoopResult:
    best: tuple[float, LoopResult] | None = None
    for split in splits(plan):
        result = run_policy(split, "leastconn", seed_value, duration, on_sample=on_sample)
        worst = max(
            (v.p99_seconds for c, v in result.latency.items() if c != ALL and v.p99_seconds),
            default=math.inf,
        )
        if best is None or worst < best[0]:
            pools = sorted({w.pool for w in split.workers})
            placement = {p: [w.gpu for w in split.workers_in(p)] for p in pools}
            best = (worst, dataclasses.replace(result, policy=STATIC_BEST, placement=placement))
    assert best is not None
    return best[1]


def _figures(
    plan: Plan, policy: str, seed_value: int, duration: float, run: FastRun, result: RunResult
) -> LoopResult:
    """What the run's requests and telemetry say, whoever balanced it."""
    from gpubalance.analyzer.frames import frames_from_samples
    from gpubalance.lab.fast import ORIGIN_SECONDS

    scenario = plan.scenario
    settle = SETTLE_WINDOWS * scenario.truth_window_seconds
    answered: dict[str, list[float]] = {}
    late: dict[str, list[float]] = {}
    for record in result.records:
        if record.outcome == "ok":
            seconds_taken = record.end_seconds - record.arrival_seconds
            into = [answered, late] if record.arrival_seconds >= settle else [answered]
            for figures in into:
                figures.setdefault(record.service_class, []).append(seconds_taken)
                figures.setdefault(ALL, []).append(seconds_taken)
    classes = sorted({t.service_class for t in scenario.traffic})
    latency = {c: _latency(answered.get(c, [])) for c in [*classes, ALL]}
    settled = {c: _latency(late.get(c, [])) for c in [*classes, ALL]}
    frames = list(
        frames_from_samples(
            result.samples,
            window_seconds=scenario.truth_window_seconds,
            interval_seconds=scenario.interval_seconds,
            origin=ORIGIN_SECONDS,
        )
    )
    per_gpu: dict[int, list[float]] = {}
    for frame in frames:
        if frame.utilization_mean_ratio is not None:
            per_gpu.setdefault(frame.gpu, []).append(frame.utilization_mean_ratio)
    means = [statistics.fmean(v) for v in per_gpu.values()]
    return LoopResult(
        scenario=scenario.name,
        policy=policy,
        seed=seed_value,
        duration_seconds=duration,
        requests=len(result.records),
        failed=sum(1 for r in result.records if r.outcome != "ok"),
        latency=latency,
        settled=settled,
        settled_after_seconds=settle,
        idle_while_queued_ratio=run_idle_while_queued(run, result.records),
        utilization_spread_ratio=max(means) - min(means) if means else None,
    )


@dataclass(frozen=True, slots=True)
class Wait:
    """A request waiting to be served from `start_seconds` to `end_seconds`."""

    start_seconds: float
    end_seconds: float
    pool: str  # the route it came by: its pool, or after a split its pool's batch backend
    gpu: int | None  # the GPU whose batch queue it waits in; None: the pool's central queue


Interval = tuple[float, float]


def idle_while_queued(
    busy: Mapping[int, Sequence[Interval]],
    waits: Sequence[Wait],
    service: Mapping[int, Mapping[str, Sequence[Interval]]],
    duration_seconds: float,
    host_full: Mapping[int, Sequence[Interval]] | None = None,
) -> float | None:
    """The share of the GPUs' time in service over [0, duration] in which a GPU ran no batch
    while a request of a pool it served then waited for a GPU: in the pool's queue, or at
    another GPU while that GPU ran a batch (``busy``: each GPU's batches as (start, end);
    ``service``: each GPU's stretches in service, per pool: a GPU taken out of its pool, or
    loading another pool's model, serves none and idles for nobody). A GPU idle while its
    host could take no more work (``host_full``: every preprocessing thread of its worker
    busy, or a request waiting for a core or the disk) waits for its host, not for work a
    balancer could send it: not counted. None without GPU time."""
    served = {
        gpu: {pool: _merged(stretches, duration_seconds) for pool, stretches in pools.items()}
        for gpu, pools in service.items()
    }
    in_service = {
        gpu: _merged([s for stretches in pools.values() for s in stretches], duration_seconds)
        for gpu, pools in served.items()
    }
    total = sum(_length(stretches) for stretches in in_service.values())
    if total <= 0:
        return None
    ran = {g: _merged(busy.get(g, ()), duration_seconds) for g in served}
    # the stretches of each wait that another GPU could have taken
    takeable: list[tuple[Wait, list[Interval]]] = []
    for wait in waits:
        span = [(wait.start_seconds, wait.end_seconds)]
        if wait.gpu is not None:
            span = _intersect(_merged(span, duration_seconds), ran.get(wait.gpu, []))
        takeable.append((wait, _merged(span, duration_seconds)))
    idle = 0.0
    for gpu, pools in served.items():
        waiting = _merged(
            [
                piece
                for pool, stretches in pools.items()
                for wait, pieces in takeable
                if wait.pool == pool and wait.gpu != gpu
                for piece in _intersect(pieces, stretches)
            ],
            duration_seconds,
        )
        occupied = _merged([*ran[gpu], *(host_full or {}).get(gpu, ())], duration_seconds)
        idle += _length(waiting) - _length(_intersect(waiting, occupied))
    return idle / total


def _merged(intervals: Iterable[Interval], duration: float) -> list[Interval]:
    """Sorted, disjoint, within [0, duration]."""
    out: list[Interval] = []
    for start, end in sorted((max(0.0, a), min(duration, b)) for a, b in intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Of two merged lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: Sequence[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def run_idle_while_queued(run: FastRun, records: Sequence[RequestRecord]) -> float | None:
    """:func:`idle_while_queued` of a finished fast-speed run, from its requests' timeline."""
    batches: dict[tuple[int, float], float] = {}  # a batch, (gpu, start): its longest request
    waits: list[Wait] = []
    for r in records:
        # after a split the batch class waits in its own route: no GPU kept for the other
        # classes idles for it
        pool = run.route_of(r.id, r.service_class)
        if r.outcome == "ok" and r.gpu is not None and r.start_seconds is not None:
            key = (r.gpu, r.start_seconds)
            batches[key] = max(batches.get(key, r.start_seconds), r.end_seconds or 0.0)
        admitted = run.admitted_at.get(r.id)
        # in the pool's queue until a worker took it (at once, but behind the oracle's queue)
        pool_end = admitted if admitted is not None else r.end_seconds
        if pool_end is not None and pool_end > r.arrival_seconds:
            waits.append(Wait(r.arrival_seconds, pool_end, pool, None))
        queued = run.queued_at.get(r.id)
        # then in its worker's batch queue until its batch began (or it ran out of KV memory);
        # a request a crash failed may have been running, and is left out
        served = (
            r.start_seconds if r.outcome == "ok" else r.end_seconds if r.outcome == "oom" else None
        )
        if queued is not None and served is not None and r.gpu is not None:
            waits.append(Wait(queued, served, pool, r.gpu))
    busy: dict[int, list[Interval]] = {}
    for (gpu, start), end in batches.items():
        busy.setdefault(gpu, []).append((start, end))
    return idle_while_queued(busy, waits, run.service_intervals(), run.duration, host_full(run))


def host_full(run: FastRun) -> dict[int, list[Interval]]:
    """Per GPU, when its host could take no more work for it: for each of its workers, every
    preprocessing thread busy or a request waiting for a host core or the disk."""
    out: dict[int, list[Interval]] = {}
    for gpu in sorted({w.plan.gpu for w in run.workers}):
        full: list[Interval] | None = None
        for w in (w for w in run.workers if w.plan.gpu == gpu):
            mine = _merged(
                [
                    *_all_held(run.thread_holds.get(w.name, []), w.plan.preprocess.threads),
                    *run.host_waits.get(w.name, []),
                ],
                run.duration,
            )
            full = mine if full is None else _intersect(full, mine)
        out[gpu] = full or []
    return out


def _all_held(holds: Sequence[Interval], capacity: int) -> list[Interval]:
    """When at least ``capacity`` of ``holds`` overlap."""
    # a hold that ends when another starts frees its thread first
    events = sorted([(start, 1) for start, _ in holds] + [(end, -1) for _, end in holds])
    out: list[Interval] = []
    held, since = 0, 0.0
    for at, step in events:
        if held >= capacity and held + step < capacity:
            out.append((since, at))
        elif held < capacity <= held + step:
            since = at
        held += step
    return out


def _latency(values: list[float]) -> Latency:
    if not values:
        return Latency(0, None, None)
    p50, p99 = np.percentile(np.asarray(values), [50, 99])
    return Latency(len(values), float(p50), float(p99))


def most_actions_per_freeze(applied: Sequence[dict[str, Any]], settings: Settings | None) -> int:
    """The most actions one server (or GPU) took within any one freeze period: an action is a
    recommendation carried out on it, counted at its first change there (a removal's drain
    and maint, a re-weighting's bounded steps, are one action; two recommendations acting on
    one server within a freeze are two)."""
    if not applied or settings is None:
        return 0
    freeze = settings.freeze_seconds
    first: dict[tuple[str, str], float] = {}
    for entry in applied:
        key = (str(entry["target"]), str(entry["recommendation"]))
        first[key] = min(first.get(key, math.inf), float(entry["at_seconds"]))
    by_target: dict[str, list[float]] = {}
    for (target, _), at in first.items():
        by_target.setdefault(target, []).append(at)
    most = 0
    for times in by_target.values():
        times.sort()
        for i, t in enumerate(times):
            most = max(most, sum(1 for u in times[i:] if u - t < freeze))
    return most


# -- the command -------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    """`gpubalance bench` itself has only its subcommands."""
    parser.description = (
        "Benchmarks on the lab. `gpubalance bench loop`: one scenario under one balancing "
        "policy at the fast speed, the controller's closed loop included."
    )


def run(args: argparse.Namespace) -> int:
    print("gpubalance bench: name a benchmark: loop (see gpubalance bench --help)", file=sys.stderr)
    return 2


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    loop = sub.add_parser(
        "loop",
        help="one scenario under one balancing policy, closed loop included, at the fast speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    loop.add_argument(
        "--scenario",
        required=True,
        metavar="SCENARIO_OR_FILE",
        help="a shipped scenario's name (see `gpubalance lab list`) or a YAML file",
    )
    loop.add_argument("--policy", required=True, metavar="POLICY", help=", ".join(POLICIES))
    loop.add_argument("--seed", type=seed, metavar="N", help="default: the scenario's seed")
    loop.add_argument(
        "--duration",
        type=seconds,
        metavar="SECONDS",
        help="simulated seconds (default: the scenario's duration_seconds)",
    )
    loop.add_argument(
        "--model",
        type=Path,
        metavar="FILE",
        help="the controller's analyzer judges with this trained model (default: the shipped "
        "model, the analyzer's default)",
    )
    loop.add_argument(
        "--audit",
        type=Path,
        metavar="FILE",
        help="with --policy controller: write the controller's audit log there (JSON lines: "
        "each decision, its reason and its simulated time, at_seconds)",
    )
    loop.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    loop.set_defaults(_run=_run_loop)


def _run_loop(args: argparse.Namespace) -> int:
    try:
        plan, classifier = _inputs(args)
    except BenchError as exc:
        print(f"gpubalance bench loop: {exc}", file=sys.stderr)
        return 2
    duration = plan.scenario.duration_seconds if args.duration is None else args.duration
    seed_value = plan.scenario.seed if args.seed is None else args.seed
    with _progress(duration, plan.scenario.interval_seconds) as on_sample:
        result = run_policy(
            plan,
            args.policy,
            seed_value,
            duration,
            classifier,
            on_sample=on_sample,
            audit_to=args.audit,
        )
    if args.json:
        print(json.dumps(dataclasses.asdict(result), sort_keys=True))
    else:
        print(format_result(result))
    return 0


@contextlib.contextmanager
def _progress(duration: float, interval: float) -> Iterator[Callable[[Sample], None] | None]:
    """A bar over simulated time on a terminal's stderr (stdout stays the result); nothing in
    pipes and CI."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("simulated {task.completed:.0f}/{task.total:.0f} s"),
        BarColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("run", total=duration)
        start: list[float] = []

        def on_sample(sample: Sample) -> None:
            if not start:
                start.append(sample.timestamp_seconds - interval)
            bar.update(task, completed=sample.timestamp_seconds - start[0])

        yield on_sample


def _inputs(args: argparse.Namespace) -> tuple[Plan, Classifier | None]:
    from gpubalance.config import ConfigError
    from gpubalance.lab import scenario

    if args.policy not in POLICIES:
        raise BenchError(f"--policy {args.policy!r}: unknown; one of {', '.join(POLICIES)}")
    try:
        plan = scenario.load(args.scenario)
    except ConfigError as exc:
        raise BenchError(f"--scenario: {exc}") from None
    if args.policy == STATIC_BEST:
        splits(plan)  # says why it has none
    if args.audit is not None:
        if args.policy != "controller":
            raise BenchError(f"--audit: only the controller keeps one, not {args.policy}")
        if not args.audit.parent.is_dir():
            raise BenchError(f"--audit {args.audit}: {args.audit.parent} is not a directory")
        if args.audit.is_dir():
            raise BenchError(f"--audit {args.audit}: a directory, not a file")
    classifier: Classifier | None = None
    if args.model is not None:
        from gpubalance.analyzer import model

        try:
            classifier = model.load(args.model)
        except model.ModelError as exc:
            raise BenchError(f"--model {exc}") from None
    return plan, classifier


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def format_result(result: LoopResult) -> str:
    lines = [
        f"{result.scenario}, policy {result.policy}, seed {result.seed}, "
        f"{result.duration_seconds:g} s simulated: {result.requests} requests, "
        f"{result.failed} failed",
        f"{'class':16} {'answered':>9} {'p50':>10} {'p99':>10} {'p99 settled':>12}",
    ]
    for name, figures in result.latency.items():
        lines.append(
            f"{name:16} {figures.requests:>9} {_ms(figures.p50_seconds):>10} "
            f"{_ms(figures.p99_seconds):>10} {_ms(result.settled[name].p99_seconds):>12}"
        )
    lines.append(
        f"(settled: the requests that arrived after {result.settled_after_seconds:g} s, "
        f"{SETTLE_WINDOWS} analysis windows)"
    )
    actions = ", ".join(f"{k} {v}" for k, v in result.actions.items()) or "none"
    recommended = ", ".join(f"{k} {v}" for k, v in result.recommended.items()) or "none"
    refused = ", ".join(f"{k} {v}" for k, v in result.refused.items()) or "none"
    lines += [
        f"idle while queued {_pct(result.idle_while_queued_ratio)}, utilization spread "
        f"{_pct(result.utilization_spread_ratio)}",
    ]
    if result.policy == "controller":
        lines += [
            f"recommended: {recommended}; refused or waiting: {refused}",
            f"actions: {actions} (at most {result.max_actions_per_freeze} on one server per "
            "freeze)",
        ]
    else:
        lines.append("actions: none (no controller)")
    if result.placement:
        split = "; ".join(
            f"{p}: GPUs {', '.join(map(str, g))}" for p, g in result.placement.items()
        )
        lines.append(f"best static split: {split}")
    return "\n".join(lines)
