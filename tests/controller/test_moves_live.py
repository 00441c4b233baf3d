"""Done when: 100 worker moves under steady load, through a real HAProxy, with 0 failed or lost
requests (counted at the client: sent == answered), and never a pool without a serving server.

Three GPUs serve two pools (be_a: 0 and 1, be_b: 2); each move takes a GPU from the pool that
has two to the other one, so a pool never gives up its last server. The workers are the lab's
live worker (serve_worker.py) with a short model-load time; the drain is as short as the
requests (some 35 ms each), so the moves take a few minutes on two busy cores.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from controller_harness import (
    FAST,
    Analyzer,
    SteadyLoad,
    make_mover_controller,
    needs_haproxy,
    pools,
    run_until_moved,
    workers_config,
)

from gpubalance.controller.audit import AuditLog

MOVES = 100

pytestmark = [*needs_haproxy, pytest.mark.live, pytest.mark.timeout(900)]


def test_a_hundred_moves_under_steady_load_lose_no_request(tmp_path: Path) -> None:
    async def scenario() -> None:
        workers = workers_config(tmp_path / "state", load_seconds=0.05)
        settings = replace(
            FAST, drain_timeout_seconds=10.0, interval_seconds=0.05, max_actions_per_hour=1000
        )
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            audit = tmp_path / "audit.jsonl"
            controller = make_mover_controller(rig, analyzer.url, http, audit, settings)
            load = SteadyLoad(rig.port, per_second=10.0)
            stop = asyncio.Event()
            sending = asyncio.create_task(load.run(stop))
            lowest = {"be_a": 2, "be_b": 1}

            async def watch() -> None:
                while True:
                    for backend, n in (await asyncio.to_thread(rig.serving)).items():
                        lowest[backend] = min(lowest[backend], n)
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            started = time.monotonic()
            try:
                where = {0: "be_a", 1: "be_a", 2: "be_b"}
                for n in range(MOVES):
                    # a GPU of the pool with two goes to the other; the GPUs take turns
                    crowded = "be_a" if list(where.values()).count("be_a") == 2 else "be_b"
                    gpu = [g for g in sorted(where) if where[g] == crowded][n % 2]
                    to = "be_b" if crowded == "be_a" else "be_a"
                    controller.approve_move(gpu, to)
                    await run_until_moved(controller)
                    where[gpu] = to
                    assert rig.serving() == {
                        "be_a": list(where.values()).count("be_a"),
                        "be_b": list(where.values()).count("be_b"),
                    }, f"after move {n + 1}"
            finally:
                stop.set()
                await sending
                watcher.cancel()
            took = time.monotonic() - started
            moved = [e for e in AuditLog(audit).entries() if e["decision"] == "moved"]
            print(
                f"{MOVES} moves in {took:.0f} s ({took / MOVES:.2f} s each); "
                f"{load.sent} requests sent, {load.answered} answered, "
                f"failures {dict(load.failures)}"
            )
            assert len(moved) == MOVES
            assert load.sent > 20 * took * 0.5  # the load was steady all along
            assert load.failures == {} and load.answered == load.sent
            assert lowest == {"be_a": 1, "be_b": 1}, "a pool was left with no serving server"

    asyncio.run(scenario())
