"""Verify and undo: Little's law over a backend's passes, and a bad re-weighting on a lab run
put back after its freeze (the controller, the lab's observer and actuator; the analyzer is a
fixed list of recommendations, as its HTTP API gives them)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from gpubalance.controller.audit import AuditLog
from gpubalance.controller.loop import Controller
from gpubalance.controller.metrics import Metrics
from gpubalance.controller.model import Change, Observed, ObservedServer, Settings
from gpubalance.controller.verify import (
    Load,
    TimeInSystem,
    Verdict,
    Verifier,
    time_in_system,
    worse,
)
from gpubalance.diagnosis import Ack, AckStatus, Recommendation
from gpubalance.lab import scenario, traffic
from gpubalance.lab.control import LabActuator, LabBalancer
from gpubalance.lab.fast import ORIGIN_SECONDS, FastRun
from gpubalance.lab.loop_bench import bench_plan


def test_time_in_system_is_the_mean_in_flight_over_the_throughput() -> None:
    # 4 requests in flight on average, 2 served a second: 2 s each
    history = [Load(0.0, 3, 100), Load(10.0, 5, 120), Load(20.0, 4, 140)]
    whole = time_in_system(history, 0.0, 20.0)
    assert whole is not None and whole.seconds == pytest.approx(4 / 2)
    # readings 3, 5, 4: standard deviation 1, over the root of 3 readings, over 2 a second
    assert whole.error_seconds == pytest.approx(1 / 3**0.5 / 2)
    late = time_in_system(history, 10.0, 20.0)
    assert late is not None and late.seconds == pytest.approx(4.5 / 2)
    assert time_in_system(history, 15.0, 20.0) is None  # one pass: no throughput
    assert time_in_system([Load(0.0, 3, 100), Load(10.0, 3, 100)], 0.0, 10.0) is None


def test_slower_within_the_readings_noise_is_not_worse() -> None:
    # 1.4 times slower, but the readings scatter so that the difference is within 2 errors
    assert not worse(TimeInSystem(0.50, 0.08), TimeInSystem(0.70, 0.08), 1.25)
    # the same means, read steadily: worse
    assert worse(TimeInSystem(0.50, 0.02), TimeInSystem(0.70, 0.02), 1.25)
    # far past the noise but under the ratio: not worse
    assert not worse(TimeInSystem(0.50, 0.0), TimeInSystem(0.60, 0.0), 1.25)


def test_a_recommendation_is_judged_once_its_freeze_has_passed() -> None:
    verifier = Verifier(freeze_seconds=20.0, worse_ratio=1.25)
    verifier.history["be"] = deque(
        # 1 s before the change at 20 s, 3 s after it
        [
            Load(0.0, 2, 0),
            Load(10.0, 2, 20),
            Load(20.0, 2, 40),
            Load(30.0, 6, 60),
            Load(40.0, 6, 80),
        ]
    )
    verifier.applied(Change("set_weight", "be", "s0", 200, 100, "r"), 20.0)
    assert verifier.due(39.0) == []
    [verdict] = verifier.due(40.0)
    assert verdict.worse and verdict.before.seconds == pytest.approx(1.0)
    assert verdict.after.seconds == pytest.approx(4.67 / 2, rel=0.01)
    assert verifier.due(50.0) == []  # judged once


def test_the_figures_before_a_long_ramp_are_kept_until_it_is_judged() -> None:
    verifier = Verifier(freeze_seconds=20.0, worse_ratio=1.25)
    verifier.observe(_at(0.0, 2, 0))
    verifier.observe(_at(10.0, 2, 20))
    verifier.observe(_at(20.0, 2, 40))
    for t in range(20, 200, 10):  # a step every pass for three minutes
        verifier.applied(Change("set_weight", "be", "s0", 100 + t, 100, "r"), float(t))
        verifier.observe(_at(t + 10.0, 2, 40 + 2 * (t - 10)))
    verifier.observe(_at(210.0, 2, 420))
    [verdict] = verifier.due(210.0)
    assert verdict.before.seconds == pytest.approx(1.0) and not verdict.worse


def test_a_server_returned_to_rotation_is_kept_when_demand_made_the_backend_slower() -> None:
    # the controller readies a server it took out because the demand came back: the freeze
    # after is slower (the demand's doing), which would undo a re-weighting
    def judged(change: Change) -> bool:
        verifier = Verifier(freeze_seconds=20.0, worse_ratio=1.25)
        # 1 s a request before the change at 20 s, 3 s after it (as in the test above)
        loads = [(0.0, 2, 0), (10.0, 2, 20), (20.0, 2, 40), (30.0, 6, 60), (40.0, 6, 80)]
        verifier.history["be"] = deque(Load(*load) for load in loads)
        verifier.applied(change, 20.0)
        [verdict] = verifier.due(40.0)
        assert verdict.after.seconds > 2 * verdict.before.seconds
        return verdict.worse

    assert not judged(Change("set_state", "be", "s3", "ready", "maint", "r"))
    assert judged(Change("set_state", "be", "s3", "maint", "drain", "r"))
    assert judged(Change("set_weight", "be", "s3", 200, 100, "r"))


def test_a_split_is_judged_by_the_shared_backend_and_undone_both_ways() -> None:
    """A split readies its batch side in the batch backend, which had no traffic before: it
    is judged by the shared backend's time in the system (the interactive requests it is
    for), and its readying there returns no capacity that would keep it whatever."""

    def judged(after_seconds_each: int) -> Verdict:
        verifier = Verifier(freeze_seconds=20.0, worse_ratio=1.25)
        # be: 1 s a request before the split at 20 s; after it `after_seconds_each`
        in_flight = 2 * after_seconds_each
        shared = [(0.0, 2, 0), (10.0, 2, 20), (20.0, 2, 40), (30.0, in_flight, 60)]
        verifier.history["be"] = deque(Load(*load) for load in [*shared, (40.0, in_flight, 80)])
        batch = [(0.0, 0, 0), (10.0, 0, 0), (20.0, 0, 0), (30.0, 1, 5), (40.0, 1, 10)]
        verifier.history["be_batch"] = deque(Load(*load) for load in batch)
        verifier.applied(Change("set_state", "be_batch", "w3", "ready", "maint", "s"), 20.0)
        verifier.applied(Change("set_state", "be", "w3", "drain", "ready", "s"), 20.0)
        verifier.applied(Change("set_state", "be", "w3", "maint", "drain", "s"), 20.0)
        [verdict] = verifier.due(40.0)
        assert verdict.backend == "be" and verdict.before.seconds == pytest.approx(1.0)
        return verdict

    kept = judged(1)
    assert not kept.worse and kept.reason.startswith("kept: be's mean time")
    undone = judged(3)
    assert undone.worse
    now = Observed(
        40.0,
        {
            s.key: s
            for s in (
                ObservedServer("be_batch", "w3", "ready", 100, 100, True, 1),
                ObservedServer("be", "w3", "maint", 100, 100, True, 0),
            )
        },
    )
    assert [(c.key, c.value) for c in undone.watch.undo(now)] == [
        ("be_batch/w3", "maint"),
        ("be/w3", "ready"),
    ]


def _at(t: float, in_flight: int, served: int) -> Observed:
    server = ObservedServer("be", "s0", "ready", 100, 100, True, in_flight, requests_total=served)
    return Observed(at_seconds=t, servers={server.key: server})


class FixedAnalyzer:
    """The analyzer's two calls over a fixed list of recommendations."""

    def __init__(self, recommendations: list[Recommendation]) -> None:
        self.listed = {r.id: r for r in recommendations}

    async def recommendations(self) -> list[Recommendation]:
        return list(self.listed.values())

    async def ack(self, recommendation_id: str, status: AckStatus, reason: str, by: str) -> None:
        r = self.listed[recommendation_id]
        self.listed[recommendation_id] = dataclasses.replace(
            r, acks=(*r.acks, Ack(status, reason, by, 0.0))
        )


def _bad_reweighting(
    tmp_path: Path, restart_at: float | None = None
) -> tuple[list[dict[str, Any]], FastRun, FixedAnalyzer, Controller]:
    """Four equal cards, equal weights: balanced, until a bad recommendation at 100 s sends
    one card nearly everything; a pass every 10 s for 300 s, the controller started afresh
    (a new process, the same audit log) at ``restart_at``. The audit's lines, the run, the
    analyzer and the last controller."""
    base = bench_plan(scenario.load("default-target"), "controller")
    router = base.scenario.router.model_copy(update={"weights": {f"w{i}": 1.0 for i in range(4)}})
    plan = dataclasses.replace(base, scenario=base.scenario.model_copy(update={"router": router}))
    run = FastRun(plan, traffic.generate(plan.scenario.traffic, 300.0, 3), 3, 300.0)
    run.start()
    bad = Recommendation(
        id="bad",
        action="set_weights",
        host="lab",
        target="be_default",
        parameters={"weights": {"w0": 256, "w1": 1, "w2": 1, "w3": 1}},
        reason="forced",
        evidence=(),
        confidence=1.0,
        created_seconds=ORIGIN_SECONDS + 90.0,
        expires_seconds=ORIGIN_SECONDS + 10_000.0,
    )
    analyzer = FixedAnalyzer([])
    settings = Settings(act=True, interval_seconds=10.0, dwell_cycles=1, max_weight_step=256)
    path = tmp_path / "audit.jsonl"

    def start() -> Controller:
        return Controller(
            LabBalancer(run),  # type: ignore[arg-type]
            LabActuator(run),
            analyzer,  # type: ignore[arg-type]
            AuditLog(path),
            Metrics(),
            settings,
            clock=lambda: ORIGIN_SECONDS + run.env.now,
        )

    controller = start()
    for t in range(10, 300, 10):
        if t == 100:
            analyzer.listed["bad"] = bad
        run.advance(t + 1e-6)
        if t == restart_at:
            controller.audit.close()
            controller = start()
        asyncio.run(controller.run_once())
    run.finish()
    controller.audit.close()
    return [json.loads(line) for line in path.read_text().splitlines()], run, analyzer, controller


def test_a_reweighting_that_makes_the_pool_slower_is_undone_after_its_freeze(
    tmp_path: Path,
) -> None:
    entries, run, analyzer, controller = _bad_reweighting(tmp_path)
    decisions = [(e["decision"], e.get("target"), e.get("after")) for e in entries]
    assert ("applied", "be_default/w0", 256) in decisions
    # undone at the end of its freeze: w0 back to 1, and nothing applied again after
    undone = [e for e in entries if e["decision"] == "undone"]
    assert [(e["target"], e["before"], e["after"]) for e in undone] == [("be_default/w0", 256, 1)]
    assert undone[0]["at_seconds"] == pytest.approx(ORIGIN_SECONDS + 160.0)
    assert undone[0]["reason"].startswith("undone: be_default's mean time in the system")
    assert not [
        e
        for e in entries
        if e["decision"] == "applied" and e["at_seconds"] > undone[0]["at_seconds"]
    ]
    assert run.router.weights["w0"] == 1.0
    assert [a.status for a in analyzer.listed["bad"].acks][-1] == "failed"
    sample = controller.metrics.registry.get_sample_value
    assert sample("gpubalance_controller_verifications_total", {"result": "undone"}) == 1
    assert (
        sample("gpubalance_controller_actions_total", {"action": "set_weight", "outcome": "undone"})
        == 1
    )


def test_a_controller_restarted_within_the_freeze_still_verifies_and_undoes(
    tmp_path: Path,
) -> None:
    entries, run, _, controller = _bad_reweighting(tmp_path, restart_at=130)
    # the figure it is judged against went to the audit log with the first change
    first = next(e for e in entries if e["decision"] == "applied")
    assert first["verify_before_seconds"] > 0 and first["verify_before_error_seconds"] >= 0
    undone = [e for e in entries if e["decision"] == "undone"]
    assert [(e["target"], e["before"], e["after"]) for e in undone] == [("be_default/w0", 256, 1)]
    assert undone[0]["at_seconds"] == pytest.approx(ORIGIN_SECONDS + 160.0)
    assert run.router.weights["w0"] == 1.0
    sample = controller.metrics.registry.get_sample_value
    assert sample("gpubalance_controller_verifications_total", {"result": "undone"}) == 1
    # and once verified, a later restart does not judge it again
    again = Controller(
        LabBalancer(run),  # type: ignore[arg-type]
        LabActuator(run),
        FixedAnalyzer([]),  # type: ignore[arg-type]
        AuditLog(tmp_path / "audit.jsonl"),
        Metrics(),
        controller.settings,
        clock=lambda: ORIGIN_SECONDS + 170.0,
    )
    assert again.verifier.watches == {}
