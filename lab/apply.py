"""Apply a recommendation to a scenario and compare what it did with what was predicted.

At the fast speed: run the scenario to a time T, diagnose the frames so far with the
classifier given, ask the analyzer's recommender, then apply each recommendation to the
scenario's plan and read the **realised** ρ per GPU from the lab's ground truth over the
recommendation's horizon (T to its expiry, or the run's end), beside the capacity model's
prediction; idle-while-queued the same way, from the frames of the changed run.

The change takes effect at T where the scenario has an event for it (weights, a drain: a
``router`` event at T); structural changes (GPUs added, pools split, the batcher retuned) are
made to the plan itself, which the ground truth reads per window, so its windows from T on are
those of a server changed at T. Router events after T are dropped from the changed scenario:
from T on the weights are the executor's. The rest of the run is the changed scenario's; its
idle-while-queued is read from the features of its frames over the same horizon (what is queued
at T drains first, as the prediction expects).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpubalance.analyzer.capacity import CapacityModel
from gpubalance.analyzer.features import FeatureBuilder, FeatureTable
from gpubalance.analyzer.frames import frames_from_samples
from gpubalance.analyzer.recommend import Recommender
from gpubalance.analyzer.verdict import Classifier, Verdicts
from gpubalance.config import validate
from gpubalance.controller.plan import per_connection_weights
from gpubalance.diagnosis import Recommendation
from gpubalance.lab import traffic, truth
from gpubalance.lab.catalogue import CARDS
from gpubalance.lab.fast import ORIGIN_SECONDS, simulate
from gpubalance.lab.scenario import Plan, Scenario, plan

# what the lab can carry out; investigate_host needs a person
APPLIED = frozenset(
    {"set_weights", "drain", "remove_worker", "scale_out", "tune_batching", "split_pools"}
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One GPU under one applied recommendation: predicted against realised."""

    scenario: str
    action: str
    recommendation_id: str
    gpu: int
    at_seconds: float  # T, seconds since the run's start
    horizon_seconds: float  # realised figures are means over [T, T + horizon)
    predicted_rho: float
    realised_rho: float | None  # None: the ground truth has no row (a lost GPU)
    predicted_idle_while_queued: float | None
    realised_idle_while_queued: float | None
    capacity_source: str  # how the capacity model measured this GPU (ExpectedEffect)
    taken_out: bool  # the action takes the GPU out of rotation (a drain): ρ 0 by design
    # what the error is made of: the prediction's ρ before the action, and the ground truth's
    # mean ρ over the windows the capacity model reads the offered load from (those before T)
    # and over the horizon of the run left unchanged
    predicted_rho_before: float | None = None
    truth_rho_before: float | None = None
    unchanged_rho: float | None = None

    @property
    def rho_error(self) -> float | None:
        if self.realised_rho is None:
            return None
        return abs(self.predicted_rho - self.realised_rho)


def outcomes(
    document: Mapping[str, Any],
    name: str,
    seed: int,
    classifier: Classifier,
    *,
    at_seconds: float | None = None,
    recommender: Recommender | None = None,
) -> list[Outcome]:
    """Run ``document`` to ``at_seconds`` (default: the whole window nearest half its
    duration), recommend, apply each recommendation the lab can carry out, and compare."""
    scenario = validate(Scenario, dict(document), source=name)
    resolved = plan(scenario, name)
    width = scenario.truth_window_seconds
    duration = scenario.duration_seconds
    at = at_seconds if at_seconds is not None else width * round(duration / 2 / width)
    if not width <= at < duration:
        raise ValueError(f"at_seconds {at:g} must be within [{width:g}, {duration:g})")
    recommender = recommender or Recommender()
    table = _table(resolved, seed, at)
    fit = getattr(classifier, "fit", None)
    if fit is not None and not hasattr(classifier, "classes_"):
        fit(table)  # the rule baselines learn nothing; fit sets their classes
    diagnosis = Verdicts(classifier).diagnose(table)
    found = recommender.recommend(diagnosis, table, ORIGIN_SECONDS + at)
    out: list[Outcome] = []
    unchanged: list[truth.TruthRow] | None = None  # the run's own truth, once one is applied
    for recommendation in found:
        if recommendation.action not in APPLIED or recommendation.expected is None:
            continue
        if unchanged is None:
            requests = traffic.generate(scenario.traffic, duration, seed)
            unchanged = truth.compute(resolved, requests, duration)
        changed = apply(dict(document), resolved, recommendation, at)
        horizon = min(recommendation.expires_seconds - ORIGIN_SECONDS, duration) - at
        found_here = _compare(name, changed, recommendation, seed, at, horizon)
        lookback = (recommender.capacity or CapacityModel()).recent_windows * width
        out += [
            dataclasses.replace(
                o,
                predicted_rho_before=recommendation.expected.rho_before.get(o.gpu),
                truth_rho_before=_mean_rho(unchanged, o.gpu, at - lookback, at),
                unchanged_rho=_mean_rho(unchanged, o.gpu, at, at + horizon),
            )
            for o in found_here
        ]
    return out


def error_parts(found: Sequence[Outcome]) -> dict[str, list[float]]:
    """Two parts of the prediction's |error|, over the GPUs that keep serving: how far the
    capacity model's ρ before the action is from the truth's over the same windows (its
    reading of the present), and how far the truth itself moves from those windows to the
    horizon with nothing done (what no reading of the past foresees)."""
    parts: dict[str, list[float]] = {
        "predicted ρ before vs the truth's over the same windows": [],
        "the truth's ρ before vs over the horizon, nothing done": [],
    }
    reading, moving = parts.values()
    for o in found:
        if o.realised_rho is None or o.taken_out or o.truth_rho_before is None:
            continue
        if o.predicted_rho_before is not None:
            reading.append(abs(o.predicted_rho_before - o.truth_rho_before))
        if o.unchanged_rho is not None:
            moving.append(abs(o.truth_rho_before - o.unchanged_rho))
    return parts


def _mean_rho(rows: Sequence[truth.TruthRow], gpu: int, start: float, end: float) -> float | None:
    """The ground truth's mean ρ of ``gpu`` over the windows starting in [start, end)."""
    values = [row.rho for row in rows if row.gpu == gpu and start <= row.t_start < end]
    return statistics.fmean(values) if values else None


def rho_errors(found: Sequence[Outcome]) -> list[float]:
    """|predicted - realised| ρ of the GPUs that keep serving (a drained GPU's 0 is no
    prediction), where the ground truth has a row."""
    return [o.rho_error for o in found if o.rho_error is not None and not o.taken_out]


def _table(resolved: Plan, seed: int, until: float) -> FeatureTable:
    scenario = resolved.scenario
    requests = traffic.generate(scenario.traffic, until, seed)
    samples: list[Any] = []
    simulate(resolved, requests, seed, until, samples.append)
    frames = frames_from_samples(
        samples,
        window_seconds=scenario.truth_window_seconds,
        interval_seconds=scenario.interval_seconds,
        origin=ORIGIN_SECONDS,
    )
    return FeatureBuilder().transform(frames)


def _compare(
    name: str,
    document: dict[str, Any],
    recommendation: Recommendation,
    seed: int,
    at: float,
    horizon: float,
) -> list[Outcome]:
    assert recommendation.expected is not None
    scenario = validate(Scenario, document, source=name)
    changed = plan(scenario, name)
    duration = scenario.duration_seconds
    requests = traffic.generate(scenario.traffic, duration, seed)
    rows = truth.compute(changed, requests, duration)
    end = at + horizon
    gpus = set(recommendation.expected.rho_after)
    iwq = _idle_while_queued(changed, requests, seed, gpus, at, end)
    return [
        Outcome(
            scenario=name,
            action=recommendation.action,
            recommendation_id=recommendation.id,
            gpu=gpu,
            at_seconds=at,
            horizon_seconds=horizon,
            predicted_rho=predicted,
            realised_rho=_mean_rho(rows, gpu, at, end),
            predicted_idle_while_queued=recommendation.expected.idle_while_queued_after,
            realised_idle_while_queued=iwq,
            capacity_source=recommendation.expected.capacity_source.get(gpu, "new"),
            taken_out=predicted == 0.0 and recommendation.action in ("drain", "remove_worker"),
        )
        for gpu, predicted in sorted(recommendation.expected.rho_after.items())
    ]


def _idle_while_queued(
    changed: Plan, requests: Sequence[Any], seed: int, gpus: set[int], start: float, end: float
) -> float | None:
    samples: list[Any] = []
    scenario = changed.scenario
    simulate(changed, requests, seed, scenario.duration_seconds, samples.append)
    table = FeatureBuilder().transform(
        frames_from_samples(
            samples,
            window_seconds=scenario.truth_window_seconds,
            interval_seconds=scenario.interval_seconds,
            origin=ORIGIN_SECONDS,
        )
    )
    values = [
        value
        for frame, value in zip(table.frames, table.column("idle_while_peer_queued"), strict=True)
        if frame.gpu in gpus
        and start <= frame.t_start - ORIGIN_SECONDS < end
        and not math.isnan(value)
    ]
    return statistics.fmean(values) if values else None


# -- applying ---------------------------------------------------------------------------------


def apply(
    document: dict[str, Any], resolved: Plan, recommendation: Recommendation, at: float
) -> dict[str, Any]:
    """The scenario document with the recommendation carried out from ``at`` on."""
    doc = copy.deepcopy(document)
    doc["router"] = dict(doc.get("router", {}))
    doc["events"] = [
        e for e in doc.get("events", []) if not ("router" in e and float(e["at"]) >= at)
    ]
    # one `workers:` entry per planned worker, named and placed: a change touches only its own
    doc["workers"] = [
        {**doc["workers"][spec], "name": w.name, "gpu": w.gpu}
        for w, spec in zip(resolved.workers, _entries(resolved), strict=True)
    ]
    params = recommendation.parameters
    pool = str(params.get("pool", ""))
    serving = {g.index: _workers(resolved, pool, g.index) for g in resolved.gpus}
    action = recommendation.action
    if action == "set_weights":
        _weights_at(doc, serving, recommendation, at)
    elif action in ("drain", "remove_worker"):
        names = serving[int(str(params["gpu"]))]
        _event(doc, at, {"router": {"weights": dict.fromkeys(names, 0.0)}})
    elif action == "scale_out":
        _scale_out(doc, resolved, serving, recommendation, at)
    elif action == "tune_batching":
        names = set(serving[int(str(params["gpu"]))])
        for entry in doc["workers"]:
            if entry["name"] in names:
                entry["max_queue_delay_ms"] = 0.0
    elif action == "split_pools":
        gpus = {int(g) for g in params["batch_gpus"]}  # type: ignore[attr-defined]
        names = {n for g in gpus for n in serving[g]}
        for entry in doc["workers"]:
            if entry["name"] in names:
                entry["pool"] = SPLIT_POOL
        doc["router"]["pools"] = {**doc["router"].get("pools", {}), "batch": SPLIT_POOL}
    else:
        raise ValueError(f"the lab cannot carry out {action!r}")
    return doc


SPLIT_POOL = "batch-split"


def _entries(resolved: Plan) -> list[int]:
    """The `workers:` entry each planned worker came from."""
    from gpubalance.lab.scenario import _spec_index

    index = _spec_index(resolved.scenario)
    return [index[w.index] for w in resolved.workers]


def _by_gpu(weights: object) -> dict[int, float]:
    """The share of the pool each GPU gets, summed over its workers' entries."""
    assert isinstance(weights, list)
    out: dict[int, float] = {}
    for item in weights:
        out[int(item["gpu"])] = out.get(int(item["gpu"]), 0.0) + float(item["weight"])
    return out


def _workers(resolved: Plan, pool: str, gpu: int) -> list[str]:
    """The workers on ``gpu`` that serve the analyzer's pool (its serving queues' names)."""
    models = set(pool.split(",")) if pool else None
    return [
        w.name
        for w in resolved.workers
        if w.gpu == gpu and (models is None or w.model_name in models)
    ]


def _event(doc: dict[str, Any], at: float, action: dict[str, Any]) -> None:
    doc["events"] = sorted([*doc["events"], {"at": float(at), **action}], key=lambda e: e["at"])


def _weights_at(
    doc: dict[str, Any],
    serving: Mapping[int, list[str]],
    recommendation: Recommendation,
    at: float,
) -> None:
    """The balancer spreads by the recommendation's per-GPU shares (split over a GPU's
    workers) from ``at``, weighed as the controller weighs HAProxy's servers: weighted round
    robin, as roundrobin with server weights does (sticky sessions no longer stick); least
    connections stays, each worker weighed by its share over its GPU's capacity (it is sent
    its weight times its capacity); the other capacity-aware policies stay, weights 0 taking
    GPUs out."""
    policy = doc["router"].get("policy", "round_robin")
    if policy not in truth.CAPACITY_AWARE:
        doc["router"]["policy"] = "weighted_round_robin"
    shares: dict[str, float] = {}
    items: list[dict[str, object]] = []
    for gpu, share in _by_gpu(recommendation.parameters["weights"]).items():
        names = serving.get(gpu, [])
        for name in names:
            shares[name] = share / len(names)
            items.append({"worker": name, "gpu": gpu})
    if policy == "least_connections":
        shares = per_connection_weights(shares, items, recommendation)
    by_worker = {name: round(weight, 6) for name, weight in shares.items()}
    _event(doc, at, {"router": {"weights": by_worker}})


def _scale_out(
    doc: dict[str, Any],
    resolved: Plan,
    serving: dict[int, list[str]],
    recommendation: Recommendation,
    at: float,
) -> None:
    params = recommendation.parameters
    count = int(str(params["gpus"]))
    card = next((key for key, spec in CARDS.items() if spec.model == params.get("card")), None)
    # the new workers are copies of one on a card of the kind added (batch sizes follow cards)
    like = next(
        (
            names[0]
            for gpu, names in serving.items()
            if names and resolved.gpus[gpu].card.model == params.get("card")
        ),
        next((names[0] for names in serving.values() if names), None),
    )
    if card is None or like is None:
        raise ValueError(f"scale_out: no card {params.get('card')!r} or no worker to copy")
    first = len(resolved.gpus)
    doc["hardware"] = {
        **doc["hardware"],
        "gpus": [*doc["hardware"]["gpus"], {"card": card, "count": count}],
    }
    template = next(dict(e) for e in doc["workers"] if e["name"] == like)
    template.pop("kv_cache_gib", None)  # what the new card leaves
    added = [f"w{first + k}" for k in range(count)]
    for k, name in enumerate(added):
        doc["workers"].append({**template, "name": name, "gpu": first + k})
        serving[first + k] = [name]
    # the new workers take work from T on, spread as the recommendation weighs the pool
    doc["router"]["weights"] = {**doc["router"].get("weights", {}), **dict.fromkeys(added, 0.0)}
    _weights_at(doc, serving, recommendation, at)
