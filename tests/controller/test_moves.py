"""Moving a GPU's worker between pools: the reconcile loop over a real HAProxy and real worker
processes (the lab's live worker), one step per pass, each step seen in HAProxy and the audit."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
from controller_harness import (
    FAST,
    Analyzer,
    make_mover_controller,
    move_log,
    needs_haproxy,
    pools,
    recommendation,
    run_until_moved,
    workers_config,
)

from gpubalance.controller.audit import AuditLog

pytestmark = needs_haproxy

MOVED = [
    ("applied", "", "move"),
    ("step", "move", "drain"),
    ("step", "move", "maint"),
    ("step", "move", "stop"),
    ("step", "move", "del_server"),
    ("step", "move", "start"),
    ("step", "move", "add_server"),
    ("step", "move", "ready"),
    ("moved", "", "move"),
]


def test_an_approved_move_takes_the_gpu_to_the_other_pool_step_by_step(tmp_path: Path) -> None:
    async def scenario() -> None:
        workers = workers_config(tmp_path / "state")
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            audit = tmp_path / "audit.jsonl"
            controller = make_mover_controller(rig, analyzer.url, http, audit)
            controller.approve_move(1, "be_b")
            await controller.run_once()  # admitted: in flight, nothing changed yet
            metrics = controller.metrics.registry
            assert metrics.get_sample_value("gpubalance_controller_moves_in_flight") == 1
            assert controller.status()["move"]["last_step"] == "begin"
            await run_until_moved(controller)
            assert rig.placement() == {
                "be_a": [("gpu0", "ready", True)],
                "be_b": [("gpu1", "ready", True), ("gpu2", "ready", True)],
            }
            # the server gauges follow it: gpu1 left be_a and serves in be_b
            await controller.run_once()
            weight = "gpubalance_controller_server_weight"
            assert metrics.get_sample_value(weight, {"backend": "be_a", "server": "gpu1"}) is None
            serving = {"backend": "be_b", "server": "gpu1"}
            assert metrics.get_sample_value("gpubalance_controller_server_serving", serving) == 1
            moved = (await controller.mover.observe())[1]
            assert moved.pool == "be_b" and moved.ready
            ports = {s.server: s.port for s in rig.api.show_servers_state("be_b")}
            assert ports["gpu1"] == moved.port
            assert move_log(audit) == MOVED
            # converged: further passes do nothing
            report = await controller.run_once()
            assert report.applied == [] and move_log(audit) == MOVED
            assert metrics.get_sample_value("gpubalance_controller_moves_in_flight") == 0
            assert (
                metrics.get_sample_value(
                    "gpubalance_controller_actions_total",
                    {"action": "move", "outcome": "applied"},
                )
                == 1
            )
            # and the GPU comes back the same way
            controller.approve_move(1, "be_a")
            await run_until_moved(controller)
            assert rig.serving() == {"be_a": 2, "be_b": 1}

    asyncio.run(scenario())


def test_a_worker_that_fails_to_start_is_undone_and_the_gpu_returns(tmp_path: Path) -> None:
    async def scenario() -> None:
        workers = workers_config(tmp_path / "state", fail_on="1:be_b")
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            audit = tmp_path / "audit.jsonl"
            rec = recommendation("m1", "move_worker", "gpu:1", {"gpu": 1, "to": "be_b"})
            analyzer.recommendations = [rec]
            controller = make_mover_controller(rig, analyzer.url, http, audit)
            await controller.run_once()
            await run_until_moved(controller)
            assert rig.serving() == {"be_a": 2, "be_b": 1}
            assert (await controller.mover.observe())[1].pool == "be_a"
            assert move_log(audit) == [
                *MOVED[:6],
                ("step", "move", "undo"),
                ("step", "undo", "start"),
                ("step", "undo", "add_server"),
                ("step", "undo", "ready"),
                ("undone", "", "move"),
            ]
            undo = next(e for e in AuditLog(audit).entries() if e.get("action") == "undo")
            assert "exited during start-up" in undo["reason"]
            assert undo["reason"].endswith("ends: the model of be_b does not fit on GPU 1")
            assert [status for status, _ in analyzer.acks_of("m1")] == ["failed"]

    asyncio.run(scenario())


def test_a_move_that_would_leave_a_pool_empty_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        workers = workers_config(tmp_path / "state")
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            audit = tmp_path / "audit.jsonl"
            analyzer.recommendations = [
                recommendation("m2", "move_worker", "gpu:2", {"gpu": 2, "to": "be_a"}),
                recommendation("m3", "move_worker", "gpu:1", {"gpu": 1, "to": "be_c"}),
                recommendation("m4", "move_worker", "gpu:1", {"to": "be_b"}),
            ]
            controller = make_mover_controller(rig, analyzer.url, http, audit)
            for _ in range(2):
                await controller.run_once()
            assert rig.serving() == {"be_a": 2, "be_b": 1}
            assert controller.mover.in_flight() is None
            reasons = {e["recommendation"]: e["reason"] for e in AuditLog(audit).entries()}
            assert reasons["m2"].startswith("last_ready_server: moving GPU 2 would leave be_b")
            assert reasons["m3"].startswith("unknown_target: backend 'be_c'")
            assert reasons["m4"].startswith("bad_parameters: move_worker needs parameters.gpu")
            for rec_id in ("m2", "m3", "m4"):
                assert [status for status, _ in analyzer.acks_of(rec_id)] == ["rejected"]

    asyncio.run(scenario())


def test_a_move_in_dry_run_is_recorded_and_changes_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        workers = workers_config(tmp_path / "state")
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            audit = tmp_path / "audit.jsonl"
            dry = replace(FAST, act=False)
            controller = make_mover_controller(rig, analyzer.url, http, audit, dry)
            controller.approve_move(1, "be_b")
            for _ in range(3):
                await controller.run_once()
            assert rig.serving() == {"be_a": 2, "be_b": 1}
            assert controller.mover.in_flight() is None
            assert move_log(audit) == [("dry_run", "", "move")]

    asyncio.run(scenario())


def test_moves_count_against_the_hourly_limit_and_a_wait_is_logged_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        workers = workers_config(tmp_path / "state")
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            audit = tmp_path / "audit.jsonl"
            one = replace(FAST, max_actions_per_hour=1)
            controller = make_mover_controller(rig, analyzer.url, http, audit, one)
            controller.approve_move(1, "be_b")
            await run_until_moved(controller)
            controller.approve_move(1, "be_a")
            for _ in range(3):
                await controller.run_once()
            assert controller.mover.in_flight() is None and rig.serving()["be_b"] == 2
            waits = [e for e in AuditLog(audit).entries() if e["decision"] == "waiting"]
            assert [e["reason"] for e in waits] == ["rate_limited: 1 actions in the last hour"]

    asyncio.run(scenario())


def test_a_pool_a_move_changed_takes_no_second_move_within_the_freeze(tmp_path: Path) -> None:
    async def scenario() -> None:
        workers = workers_config(tmp_path / "state")
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            audit = tmp_path / "audit.jsonl"
            # both made on the same windows: GPU 1 to be_b, and (be_b then having two) GPU 2
            # back to be_a, the second stacking on the first before anyone saw its effect
            analyzer.recommendations = [
                recommendation("m1", "move_worker", "gpu:1", {"gpu": 1, "to": "be_b"}),
                recommendation("m2", "move_worker", "gpu:2", {"gpu": 2, "to": "be_a"}),
            ]
            settings = replace(FAST, freeze_seconds=3.0)
            controller = make_mover_controller(rig, analyzer.url, http, audit, settings)
            await controller.run_once()  # m1 admitted; m2 waits for the move in flight
            await run_until_moved(controller)
            ended = time.time()
            assert rig.serving() == {"be_a": 1, "be_b": 2}
            report = await controller.run_once()
            assert controller.mover.in_flight() is None
            assert any(r.startswith("m2: frozen") for r in report.refused), report.refused
            frozen = [e for e in AuditLog(audit).entries() if e["decision"] == "waiting"]
            assert "be_b changed its GPUs" in frozen[-1]["reason"]
            # a restarted controller knows it too, from the audit log
            again = make_mover_controller(rig, analyzer.url, http, audit, settings)
            assert any(r.startswith("m2: frozen") for r in (await again.run_once()).refused)
            # once the freeze is over, m2 goes ahead
            await asyncio.sleep(max(0.0, ended + settings.freeze_seconds - time.time()))
            await again.run_once()
            await run_until_moved(again)
            assert rig.serving() == {"be_a": 2, "be_b": 1}
            assert [
                e["recommendation"] for e in AuditLog(audit).entries() if e["decision"] == "moved"
            ] == ["m1", "m2"]

    asyncio.run(scenario())
