"""Applying a recommendation in the lab: the realised ρ beside the capacity model's."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpubalance.analyzer.baselines import QueueUtilization
from gpubalance.config import load_yaml, validate
from gpubalance.diagnosis import ExpectedEffect, Recommendation
from gpubalance.lab import apply, traffic, truth
from gpubalance.lab.scenario import Scenario, plan, scenario_path


def _document(name: str) -> dict[str, Any]:
    data, _ = load_yaml(scenario_path(name))
    return dict(data)


def _recommendation(action: str, parameters: dict[str, object]) -> Recommendation:
    return Recommendation(
        id="x",
        action=action,  # type: ignore[arg-type]
        host="h",
        target="pool:qwen2.5-7b",
        parameters={"pool": "qwen2.5-7b", **parameters},
        reason="",
        evidence=(),
        confidence=1.0,
        created_seconds=0.0,
        expires_seconds=0.0,
        expected=ExpectedEffect({}, {}, None, None),
    )


def test_reweighting_a_default_target_realises_the_predicted_rho() -> None:
    # default-target's own fix comes at 240 s: recommending at 150 s, the analyzer's weights
    # stand in for it (router events after T are the executor's)
    found = apply.outcomes(
        _document("default-target"), "default-target", 3, QueueUtilization(), at_seconds=150
    )
    assert {o.action for o in found} == {"set_weights"}
    assert sorted(o.gpu for o in found) == [0, 1, 2, 3]
    for outcome in found:
        assert outcome.at_seconds == 150 and outcome.horizon_seconds == 120
        assert outcome.realised_rho is not None
        assert outcome.rho_error is not None and outcome.rho_error < 0.1, outcome
    # GPU 0's backlog from before T drains while its peers idle, as predicted; loosely, since
    # the features count a GPU's unused capacity as utilization x batch fill, the model as ρ
    predicted, realised = found[0].predicted_idle_while_queued, found[0].realised_idle_while_queued
    assert predicted is not None and realised is not None
    assert predicted == pytest.approx(realised, abs=0.25)
    # the parts of the error: the run left unchanged keeps GPU 0 (the default target) over
    # full while the weights move its work away; the model reads the present of the GPUs
    # with room within 0.05, and that of the one over full (its backlog growing) within 0.15
    hot = found[0]
    assert hot.predicted_rho_before is not None and hot.predicted_rho_before > 1
    assert hot.truth_rho_before is not None and hot.truth_rho_before > 1
    assert hot.unchanged_rho is not None and hot.unchanged_rho > 1 > hot.realised_rho
    parts = apply.error_parts(found)
    assert [len(values) for values in parts.values()] == [4, 4]
    reading, _ = parts.values()
    assert reading[0] < 0.15 and max(reading[1:]) < 0.05


def test_error_parts_take_the_prediction_apart() -> None:
    def outcome(
        predicted: float,
        realised: float,
        before: float | None,
        truth_before: float,
        unchanged: float | None,
        out: bool = False,
    ) -> apply.Outcome:
        return apply.Outcome(
            "s",
            "set_weights",
            "x",
            0,
            60.0,
            120.0,
            predicted,
            realised,
            None,
            None,
            "saturated",
            out,
            before,
            truth_before,
            unchanged,
        )

    parts = list(
        apply.error_parts(
            [
                # the truth said 1.2 where the model said 1.0; nothing done it would have been
                # 1.1
                outcome(0.5, 0.6, 1.0, 1.2, 1.1),
                outcome(0.5, 0.6, None, 1.2, None),  # no figure: no part
                outcome(0.0, 0.0, 1.0, 1.0, 1.0, out=True),  # drained: ρ 0 by design
            ]
        ).values()
    )
    assert parts == [[pytest.approx(0.2)], [pytest.approx(0.1)]]


def test_set_weights_becomes_weighted_round_robin_from_t() -> None:
    document = _document("default-target")
    resolved = plan(validate(Scenario, document, source="x"), "x")
    weights = [
        {"gpu": g, "worker": f"w{g}", "weight": share}
        for g, share in enumerate((0.4, 0.2, 0.2, 0.2))
    ]
    changed = apply.apply(
        document, resolved, _recommendation("set_weights", {"weights": weights}), 150
    )
    assert changed["router"]["policy"] == "weighted_round_robin"
    # the scenario's own weight fix at 240 s is dropped: from T on the weights are the executor's
    assert changed["events"] == [
        {"at": 150.0, "router": {"weights": {"w0": 0.4, "w1": 0.2, "w2": 0.2, "w3": 0.2}}}
    ]
    assert document["events"][0]["at"] == 240  # the caller's document is left alone
    validate(Scenario, changed, source="changed")


def test_on_least_connections_each_worker_is_weighed_by_its_share_over_its_capacity() -> None:
    # as the controller weighs a leastconn backend: the balancer sends a worker its weight
    # times its capacity, so the shares asked for are the shares routed
    document = _document("skewed-heterogeneous")
    document["router"] = {**document["router"], "policy": "least_connections"}
    resolved = plan(validate(Scenario, document, source="x"), "x")
    duration = resolved.scenario.duration_seconds
    requests = traffic.generate(resolved.scenario.traffic, duration, 1)
    rows = truth.compute(resolved, requests, duration)
    # three RTX 4090s and an RTX 3090: the shares by capacity, as the truth prices them
    capacity = {row.gpu: row.capacity_share for row in rows if row.t_start == 0}
    assert min(capacity.values()) < 0.9 * max(capacity.values())
    weights = [{"gpu": g, "worker": f"w{g}", "weight": c} for g, c in sorted(capacity.items())]
    recommendation = dataclasses.replace(
        _recommendation("set_weights", {"weights": weights}),
        parameters={"pool": "llama-3.2-3b", "weights": weights},
        expected=ExpectedEffect({}, {}, None, None, capacity_per_second=capacity),
    )
    changed = apply.apply(document, resolved, recommendation, 150)
    assert changed["router"]["policy"] == "least_connections"
    # capacity shares come out as equal weights: leastconn already sends a slow card less
    (event,) = [e for e in changed["events"] if "router" in e]
    assert event["at"] == 150.0
    assert set(event["router"]["weights"].values()) == {1.0}
    # and route as leastconn does unweighted (the scenario's own weights 8:2:2:1 skew it)
    after = truth.compute(plan(validate(Scenario, changed, source="y"), "y"), requests, duration)
    document["router"] = {"policy": "least_connections"}
    plain = truth.compute(plan(validate(Scenario, document, source="z"), "z"), requests, duration)
    shares = [(r.t_start, r.gpu, r.share_of_pool_work) for r in after if r.t_start >= 150]
    assert shares == [(r.t_start, r.gpu, r.share_of_pool_work) for r in plain if r.t_start >= 150]
    assert max(r.share_of_pool_work for r in rows if r.gpu == 0) > 0.5


def test_a_drain_takes_the_gpu_out_of_rotation_at_t() -> None:
    document = _document("default-target")
    resolved = plan(validate(Scenario, document, source="x"), "x")
    changed = apply.apply(document, resolved, _recommendation("drain", {"gpu": 2}), 90)
    assert changed["events"] == [{"at": 90.0, "router": {"weights": {"w2": 0.0}}}]


def test_a_scale_out_adds_cards_and_workers_that_take_work_from_t() -> None:
    document = _document("default-target")
    resolved = plan(validate(Scenario, document, source="x"), "x")
    weights = [{"gpu": g, "worker": None, "weight": 1 / 6} for g in range(6)]
    parameters = {"gpus": 2, "card": "NVIDIA GeForce RTX 4090", "weights": weights}
    changed = apply.apply(document, resolved, _recommendation("scale_out", parameters), 120)
    new = plan(validate(Scenario, changed, source="changed"), "changed")
    assert [g.card.model for g in new.gpus] == ["NVIDIA GeForce RTX 4090"] * 6
    assert [w.name for w in new.workers] == ["w0", "w1", "w2", "w3", "w4", "w5"]
    assert changed["router"]["weights"]["w4"] == 0.0  # not before T
    assert changed["events"][-1]["router"]["weights"]["w5"] == pytest.approx(1 / 6, abs=1e-5)


def test_batching_and_pools_change_only_the_workers_named() -> None:
    document = _document("default-target")
    resolved = plan(validate(Scenario, document, source="x"), "x")
    tuned = apply.apply(document, resolved, _recommendation("tune_batching", {"gpu": 1}), 60)
    delays = {w["name"]: w["max_queue_delay_ms"] for w in tuned["workers"]}
    assert delays == {"w0": 10, "w1": 0.0, "w2": 10, "w3": 10}
    split = apply.apply(
        document,
        resolved,
        _recommendation("split_pools", {"batch_gpus": [0, 1], "interactive_gpus": [2, 3]}),
        60,
    )
    new = plan(validate(Scenario, split, source="split"), "split")
    assert [w.pool for w in new.workers] == [apply.SPLIT_POOL] * 2 + ["default"] * 2
    assert new.pool_of("batch") == apply.SPLIT_POOL and new.pool_of("interactive") == "default"


def test_what_the_lab_cannot_carry_out_is_named() -> None:
    document = _document("default-target")
    resolved = plan(validate(Scenario, document, source="x"), "x")
    with pytest.raises(ValueError, match="investigate_host"):
        apply.apply(document, resolved, _recommendation("investigate_host", {"gpu": 1}), 60)
    with pytest.raises(ValueError, match="at_seconds"):
        apply.outcomes(document, "default-target", 3, QueueUtilization(), at_seconds=600)


def test_errors_leave_out_what_a_drain_takes_out() -> None:
    def outcome(gpu: int, predicted: float, realised: float | None, out: bool) -> apply.Outcome:
        return apply.Outcome(
            "s", "drain", "x", gpu, 60.0, 120.0, predicted, realised, None, None, "saturated", out
        )

    found = [outcome(0, 0.5, 0.6, False), outcome(1, 0.0, 0.0, True), outcome(2, 0.4, None, False)]
    assert apply.rho_errors(found) == [pytest.approx(0.1)]
