"""The worker supervisor's systemd backend over the shipped template unit and real worker
processes (the lab's live worker, serve_worker.py), systemd faked at the edge only: its
`systemctl` and `journalctl` (tests/fixtures/systemd), which start the unit's ExecStart."""

from __future__ import annotations

import asyncio
import shlex
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from controller_harness import (
    Analyzer,
    make_mover_controller,
    move_log,
    needs_haproxy,
    pools,
    run_until_moved,
    workers_config,
)

from gpubalance.controller.audit import AuditLog
from gpubalance.controller.cli import _workers
from gpubalance.controller.supervisor import SupervisorError, WorkersConfig, wait_ready
from gpubalance.controller.systemd_supervisor import SystemdSupervisor

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "systemd" / "gpubalance-worker@.service"
SHIPPED_ENVIRONMENT_DIR = "/var/lib/gpubalance/workers"
FAKE_BIN = ROOT / "tests" / "fixtures" / "systemd" / "bin"


def systemd_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, drop_in: bool = True, **fields: object
) -> WorkersConfig:
    """Workers as instances of the shipped template unit, under the fake systemd in
    tmp_path/systemd; the drop-in's ExecStart is the test worker's command (workers_config)."""
    process = workers_config(tmp_path / "state", **fields)  # type: ignore[arg-type]
    assert process.command is not None
    units = tmp_path / "systemd" / "units"
    units.mkdir(parents=True)
    environment_dir = tmp_path / "workers"
    template = TEMPLATE.read_text()
    assert SHIPPED_ENVIRONMENT_DIR in template
    (units / TEMPLATE.name).write_text(
        template.replace(SHIPPED_ENVIRONMENT_DIR, str(environment_dir))
    )
    if drop_in:
        words = [
            word.replace("{port}", "${GPUBALANCE_PORT}").replace("{pool}", "${GPUBALANCE_POOL}")
            for word in process.command
        ]
        (units / f"{TEMPLATE.name}.d").mkdir()
        (units / f"{TEMPLATE.name}.d" / "serve.conf").write_text(
            f"[Service]\nExecStart=\nExecStart={shlex.join(words)}\n"
        )
    monkeypatch.setenv("FAKE_SYSTEMD_ROOT", str(tmp_path / "systemd"))
    settings = process.model_dump(exclude={"backend", "command", "systemd", "kubernetes"})
    return WorkersConfig(
        **settings,
        backend="systemd",
        systemd={
            "environment_dir": environment_dir,
            "systemctl": str(FAKE_BIN / "systemctl"),
            "journalctl": str(FAKE_BIN / "journalctl"),
        },
    )


async def _gone(supervisor: SystemdSupervisor, http: aiohttp.ClientSession, gpu: int) -> None:
    async with asyncio.timeout(30):
        while gpu in await supervisor.observe(http):
            await asyncio.sleep(0.05)


async def _gpu_of(http: aiohttp.ClientSession, port: int) -> int:
    body = {"id": 1, "prompt_tokens": 100, "output_tokens": 10}
    async with http.post(f"http://127.0.0.1:{port}/infer", json=body) as resp:
        assert resp.status == 200
        return int((await resp.json())["gpu"])


def test_a_unit_started_runs_its_worker_on_its_gpu_until_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        config = systemd_workers(tmp_path, monkeypatch)
        supervisor = SystemdSupervisor(config)
        async with aiohttp.ClientSession() as http:
            assert await supervisor.observe(http) == {}
            started = supervisor.start(1, "be_a")
            env = (tmp_path / "workers" / "1.env").read_text()
            assert f"GPUBALANCE_POOL=be_a\nGPUBALANCE_PORT={started.port}\n" in env
            ready = await wait_ready(supervisor, http, 1)
            assert (ready.pool, ready.port) == ("be_a", started.port)
            assert abs(ready.started_seconds - started.started_seconds) < 5
            # the unit's MainPID, and the GPU the unit gave it (CUDA_VISIBLE_DEVICES=%i)
            assert Path(f"/proc/{ready.pid}/cmdline").read_bytes().count(b"serve_worker") == 1
            assert await _gpu_of(http, ready.port) == 1
            # a restarted controller finds it again from systemd and the environment file (its
            # start time from systemd's monotonic clock: to the microsecond)
            again = (await SystemdSupervisor(config).observe(http))[1]
            assert replace(again, started_seconds=ready.started_seconds) == ready
            assert again.started_seconds == pytest.approx(ready.started_seconds, abs=0.01)
            with pytest.raises(SupervisorError, match=r"gpubalance-worker@1\.service is active"):
                supervisor.start(1, "be_b")
            # a second worker is given another port
            other = supervisor.start(0, "be_b")
            assert other.port != ready.port
            await wait_ready(supervisor, http, 0)
            supervisor.signal(ready, signal.SIGTERM)
            await _gone(supervisor, http, 1)
            supervisor.signal(ready, signal.SIGTERM)  # stopped already: fine
            # SIGKILL, then SIGKILL once it is gone: fine as well
            worker = (await supervisor.observe(http))[0]
            supervisor.signal(worker, signal.SIGKILL)
            await _gone(supervisor, http, 0)
            supervisor.signal(worker, signal.SIGKILL)
            assert await supervisor.observe(http) == {}

    asyncio.run(scenario())


def test_a_unit_that_fails_to_start_is_reported_with_its_journals_last_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        supervisor = SystemdSupervisor(systemd_workers(tmp_path, monkeypatch, fail_on="2:be_b"))
        async with aiohttp.ClientSession() as http:
            supervisor.start(2, "be_b")
            # the worker's own last line, not systemd's "Failed with result 'exit-code'"
            with pytest.raises(
                SupervisorError,
                match=r"GPU 2 exited during start-up; its journal \(gpubalance-worker@2\.service\) "
                "ends: the model of be_b does not fit on GPU 2$",
            ):
                await wait_ready(supervisor, http, 2)
            # failed units start again
            supervisor.start(2, "be_a")
            await wait_ready(supervisor, http, 2)
            supervisor.signal((await supervisor.observe(http))[2], signal.SIGTERM)
            await _gone(supervisor, http, 2)

    asyncio.run(scenario())


def test_the_template_without_a_drop_in_says_where_the_command_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        supervisor = SystemdSupervisor(systemd_workers(tmp_path, monkeypatch, drop_in=False))
        async with aiohttp.ClientSession() as http:
            supervisor.start(0, "be_a")
            with pytest.raises(
                SupervisorError, match=r"ends: no serving command: write ExecStart="
            ):
                await wait_ready(supervisor, http, 0)

    asyncio.run(scenario())


def test_a_failing_systemctl_is_an_error_with_what_it_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        supervisor = SystemdSupervisor(systemd_workers(tmp_path, monkeypatch))
        monkeypatch.delenv("FAKE_SYSTEMD_ROOT")  # as a machine whose PID 1 is not systemd
        async with aiohttp.ClientSession() as http:
            with pytest.raises(SupervisorError, match=r"systemctl show .*not been booted"):
                await supervisor.observe(http)
        with pytest.raises(SupervisorError, match="not been booted"):
            supervisor.start(0, "be_a")
        assert supervisor.last_words(0) == ""

    asyncio.run(scenario())


def test_the_backend_is_chosen_and_checked_in_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "gpubalance.yaml"
    config.write_text(
        "controller:\n  workers:\n    backend: systemd\n    gpus: [0, 1]\n"
        "    systemd: {unit: 'serve@', environment_dir: /run/serve}\n"
    )
    workers = _workers(str(config))
    assert workers is not None and workers.backend == "systemd"
    assert SystemdSupervisor(workers).unit_of(1) == "serve@1.service"
    assert workers.command is None
    config.write_text("controller:\n  workers:\n    backend: podman\n    gpus: [0]\n")
    with pytest.raises(ValueError, match=r":3: controller\.workers\.backend: Input should be"):
        _workers(str(config))
    config.write_text(
        "controller:\n  workers:\n    backend: systemd\n    command: [serve, '{port}']\n"
        "    gpus: [0]\n"
    )
    with pytest.raises(ValueError, match="command: with backend systemd the worker's command is"):
        _workers(str(config))
    config.write_text(
        "controller:\n  workers:\n    command: [serve, '{port}']\n    gpus: [0]\n"
        "    systemd: {unit: 'serve@'}\n"
    )
    with pytest.raises(ValueError, match="systemd: set, but backend is process"):
        _workers(str(config))
    # and the command exits 2 with it
    result = subprocess.run(
        [
            *(sys.executable, "-m", "gpubalance", "controller"),
            *("--analyzer", "http://127.0.0.1:1", "--haproxy-socket", str(tmp_path / "none.sock")),
            *("--config", str(config)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "controller.workers: systemd: set, but backend is process" in result.stderr


@needs_haproxy[0]  # haproxy
@needs_haproxy[1]  # skipped without it
def test_a_move_through_systemd_units_and_an_undone_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        # GPU 2's worker for be_a does not load: moving GPU 2 there is undone
        workers = systemd_workers(tmp_path, monkeypatch, fail_on="2:be_a")
        async with (
            aiohttp.ClientSession() as http,
            Analyzer() as analyzer,
            pools(tmp_path / "run", workers, http) as rig,
        ):
            audit = tmp_path / "audit.jsonl"
            controller = make_mover_controller(rig, analyzer.url, http, audit)
            controller.approve_move(1, "be_b")
            await run_until_moved(controller)
            assert rig.placement() == {
                "be_a": [("gpu0", "ready", True)],
                "be_b": [("gpu1", "ready", True), ("gpu2", "ready", True)],
            }
            assert "GPUBALANCE_POOL=be_b" in (tmp_path / "workers" / "1.env").read_text()
            assert [action for _, _, action in move_log(audit)] == [
                *("move", "drain", "maint", "stop", "del_server", "start", "add_server"),
                *("ready", "move"),
            ]
            controller.approve_move(2, "be_a")
            await run_until_moved(controller)
            assert rig.serving() == {"be_a": 1, "be_b": 2}
            undo = [e for e in AuditLog(audit).entries() if e.get("action") == "undo"]
            assert undo[-1]["reason"].endswith(
                "its journal (gpubalance-worker@2.service) ends: the model of be_a does not fit "
                "on GPU 2"
            )
            assert (await controller.mover.observe())[2].pool == "be_b"

    asyncio.run(scenario())
