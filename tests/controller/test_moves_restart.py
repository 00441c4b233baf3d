"""kill -9 of the controller command in the middle of a move, at several of its steps: each
restarted controller reads the intent record, re-observes HAProxy and the workers, and the move
finishes with every step carried out once, and no pool without a serving server meanwhile."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from controller_harness import (
    TOKEN,
    Analyzer,
    handing,
    held_listener,
    move_log,
    needs_haproxy,
    pools,
    port_of,
    workers_config,
)

from gpubalance.controller.mover import INTENT_FILE

pytestmark = needs_haproxy

STEPS = ["drain", "maint", "stop", "del_server", "start", "add_server", "ready"]


def _steps(intent_path: Path) -> list[str]:
    try:
        return [s["action"] for s in json.loads(intent_path.read_text())["steps"]]
    except (FileNotFoundError, ValueError, KeyError):
        return []  # no move in flight


async def _start(args: list[str], log: Path, listener: socket.socket) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpubalance",
            "controller",
            *args,
            stdout=out,
            stderr=out,
            **handing(listener),
        )


async def _kill(process: asyncio.subprocess.Process) -> None:
    process.send_signal(signal.SIGKILL)
    await process.wait()


def test_a_move_killed_at_several_steps_finishes_each_step_once(tmp_path: Path) -> None:
    async def scenario(listener: socket.socket) -> None:
        workers = workers_config(tmp_path / "state")
        config = tmp_path / "gpubalance.yaml"
        config.write_text(
            yaml.safe_dump({"controller": {"workers": workers.model_dump(mode="json")}})
        )
        token = tmp_path / "token"
        token.write_text(TOKEN)
        intent = workers.state_dir / INTENT_FILE
        audit = tmp_path / "audit.jsonl"
        port = port_of(listener)
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            args = [
                *("--analyzer", analyzer.url, "--haproxy-socket", str(rig.config.socket_path)),
                *("--act", "--listen", f"127.0.0.1:{port}", "--token-file", str(token)),
                *("--audit-log", str(audit), "--interval", "0.05", "--config", str(config)),
            ]
            lowest = {"be_a": 2, "be_b": 1}

            async def watch() -> None:
                while True:
                    for backend, n in (await asyncio.to_thread(rig.serving)).items():
                        lowest[backend] = min(lowest[backend], n)
                    await asyncio.sleep(0.01)

            async def approve(gpu: int, to: str) -> dict[str, Any]:
                url = f"http://127.0.0.1:{port}/api/v1/moves"
                headers = {"Authorization": f"Bearer {TOKEN}"}
                while True:
                    try:
                        body = {"gpu": gpu, "to": to}
                        async with http.post(url, json=body, headers=headers) as resp:
                            assert resp.status == 202, await resp.text()
                            return dict(await resp.json())
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)  # a kept connection to a killed controller

            watcher = asyncio.create_task(watch())
            killed_at: list[list[str]] = []
            process: asyncio.subprocess.Process | None = None
            try:
                async with asyncio.timeout(240):
                    for gpu_to, points, before in (
                        ("be_b", ["drain", "stop", "start", "add_server"], {"be_a": 2, "be_b": 1}),
                        ("be_a", ["maint", "del_server", "ready"], {"be_a": 1, "be_b": 2}),
                    ):
                        # as HAProxy shows it: the pool left keeps a serving server
                        while await asyncio.to_thread(rig.serving) != before:
                            await asyncio.sleep(0.05)
                        process = await _start(args, tmp_path / "controller.log", listener)
                        assert (await approve(1, gpu_to))["mode"] == "act"
                        for point in points:
                            while point not in _steps(intent):
                                assert process.returncode is None
                                await asyncio.sleep(0.005)
                            await _kill(process)
                            killed_at.append(_steps(intent))
                            process = await _start(args, tmp_path / "controller.log", listener)
                        while intent.exists():
                            await asyncio.sleep(0.02)
                        process.send_signal(signal.SIGTERM)
                        assert await process.wait() == 0
            finally:
                watcher.cancel()
                if process is not None and process.returncode is None:
                    await _kill(process)  # failed midway: it must not act on the next test
            assert rig.placement() == {
                "be_a": [("gpu0", "ready", True), ("gpu1", "ready", True)],
                "be_b": [("gpu2", "ready", True)],
            }
            assert lowest == {"be_a": 1, "be_b": 1}, "a pool was left with no serving server"
            assert len(killed_at) == 7
            # every step of both moves once, in order, whatever the kills interrupted
            log = move_log(audit)
            one_move = [
                ("applied", "", "move"),
                *(("step", "move", step) for step in STEPS),
                ("moved", "", "move"),
            ]
            assert log == one_move * 2, (killed_at, log)
            # and the workers agree: one start per move besides the first
            starts = (workers.state_dir / "logs" / "gpu1.log").read_text().count(" loads ")
            assert starts == 3
            assert Counter(e[2] for e in log)["start"] == 2

    with held_listener() as listener:
        asyncio.run(scenario(listener))
