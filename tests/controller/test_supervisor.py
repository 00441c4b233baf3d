"""The worker supervisor over real worker processes (the lab's live worker, serve_worker.py)."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import aiohttp
import pytest
from controller_harness import kill_workers, workers_config
from pydantic import ValidationError

from gpubalance.controller.supervisor import (
    MARK,
    Supervisor,
    SupervisorError,
    WorkersConfig,
    wait_ready,
)


async def _infer(http: aiohttp.ClientSession, port: int) -> dict[str, object]:
    body = {"id": 1, "prompt_tokens": 100, "output_tokens": 10}
    async with http.post(f"http://127.0.0.1:{port}/infer", json=body) as resp:
        assert resp.status == 200
        return dict(await resp.json())


def test_a_started_worker_runs_on_its_gpu_once_loaded_and_stops(tmp_path: Path) -> None:
    async def scenario() -> None:
        supervisor = Supervisor(workers_config(tmp_path))
        async with aiohttp.ClientSession() as http:
            started = supervisor.start(1, "be_a")
            try:
                ready = await wait_ready(supervisor, http, 1)
                assert (ready.pid, ready.port, ready.pool) == (
                    started.pid,
                    started.port,
                    "be_a",
                )
                # the worker found its GPU in CUDA_VISIBLE_DEVICES
                assert (await _infer(http, ready.port))["gpu"] == 1
                # a restarted controller finds it again from /proc alone; another one does not
                again = await Supervisor(workers_config(tmp_path)).observe(http)
                assert again == {1: ready}
                other = Supervisor(workers_config(tmp_path, instance="other"))
                assert await other.observe(http) == {}
            finally:
                await supervisor.stop(started)
            assert await supervisor.observe(http) == {}

    asyncio.run(scenario())


def test_a_loading_worker_is_seen_but_not_ready(tmp_path: Path) -> None:
    async def scenario() -> None:
        supervisor = Supervisor(workers_config(tmp_path, load_seconds=600))
        async with aiohttp.ClientSession() as http:
            started = supervisor.start(0, "be_b")
            try:
                # it answers its health check (503) while it loads: seen, not ready
                async with asyncio.timeout(30):
                    while True:
                        url = f"http://127.0.0.1:{started.port}/healthz"
                        try:
                            async with http.get(url) as resp:
                                if resp.status == 503:
                                    break
                        except aiohttp.ClientError:
                            await asyncio.sleep(0.05)
                seen = (await supervisor.observe(http))[0]
                assert seen.pool == "be_b" and not seen.ready
                with pytest.raises(SupervisorError, match=r"not ready within 0\.2 s"):
                    await wait_ready(supervisor, http, 0, timeout_seconds=0.2)
            finally:
                await supervisor.stop(started)

    asyncio.run(scenario())


def test_a_worker_started_here_is_seen_before_proc_shows_it_as_ours(tmp_path: Path) -> None:
    # the kernel sets a new program's environment up just after the exec Popen waits for:
    # for that moment /proc shows no mark, and a worker observed then is no worker exited.
    # Here the mark stays away for good (the command drops it), and the worker is still seen
    config = workers_config(tmp_path)
    config = config.model_copy(update={"command": ("env", "-u", MARK, *config.command)})
    supervisor = Supervisor(config)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            started = supervisor.start(0, "be_a")
            try:
                ready = await wait_ready(supervisor, http, 0)
                assert (ready.pid, ready.port, ready.pool) == (started.pid, started.port, "be_a")
            finally:
                await supervisor.stop(started)
            assert 0 not in await supervisor.observe(http)  # and once it has exited, it is not

    asyncio.run(scenario())


def test_a_worker_that_exits_while_loading_is_reported(tmp_path: Path) -> None:
    async def scenario() -> None:
        supervisor = Supervisor(workers_config(tmp_path, fail_on="2:be_b"))
        async with aiohttp.ClientSession() as http:
            supervisor.start(2, "be_b")
            # with what it said last: the reason is one line, not a search through logs
            with pytest.raises(
                SupervisorError,
                match=r"GPU 2 exited during start-up; its log \(.*gpu2\.log\) ends: "
                "the model of be_b does not fit on GPU 2$",
            ):
                await wait_ready(supervisor, http, 2)
        with pytest.raises(SupervisorError, match="GPU 7 is not among"):
            supervisor.start(7, "be_a")

    asyncio.run(scenario())


def test_bad_worker_settings_are_refused_with_the_key() -> None:
    with pytest.raises(ValidationError, match="must pass the worker its"):
        WorkersConfig(command=("serve",), gpus=(0,))
    with pytest.raises(ValidationError, match="only"):
        WorkersConfig(command=("serve", "--port", "{port}", "{model}"), gpus=(0,))
    with pytest.raises(ValidationError, match="distinct"):
        WorkersConfig(command=("serve", "{port}"), gpus=(0, 0))
    with pytest.raises(ValidationError, match="server name"):
        WorkersConfig(command=("serve", "{port}"), gpus=(0,), server_name="gpu {gpu}")


def test_workers_get_ports_of_the_configured_range_that_nothing_holds(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        held.listen()
        supervisor = Supervisor(workers_config(tmp_path, ports=(port, port)))
        with pytest.raises(SupervisorError, match=re.escape(f"no free port in {port}..{port}")):
            supervisor.start(0, "be_a")
    # free again: the worker gets it
    started = supervisor.start(0, "be_a")
    try:
        assert started.port == port
        # a second worker cannot have the first one's port
        with pytest.raises(SupervisorError, match=r"widen controller\.workers\.ports"):
            supervisor.start(1, "be_a")
    finally:
        kill_workers(supervisor.config.instance)
