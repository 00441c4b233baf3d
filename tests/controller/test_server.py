"""The controller's HTTP endpoints, its command line, and the analyzer's wire format."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from controller_harness import (
    TOKEN,
    Analyzer,
    Backends,
    acting_args,
    haproxy_installed,
    haproxy_over,
    held_listener,
    make_controller,
    port_of,
    recommendation,
    start_command,
    stop_command,
    weights,
    workers_config,
)
from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter

from gpubalance.children import signal_child
from gpubalance.cli import main
from gpubalance.controller.analyzer_client import AnalyzerError, parse_recommendations
from gpubalance.controller.loop import Controller
from gpubalance.controller.mover import Mover
from gpubalance.controller.runtime_actuator import RuntimeApiActuator
from gpubalance.controller.server import ControlServer
from gpubalance.controller.supervisor import Supervisor
from gpubalance.diagnosis import Ack, ExpectedEffect, Recommendation

REPO = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def serving(controller: Controller, token: str | None) -> AsyncIterator[str]:
    runner = web.AppRunner(ControlServer(controller, token).app())
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_pause_resume_and_rearm_need_the_bearer_token(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            controller = make_controller(
                tmp_path / "none.sock", "http://127.0.0.1:9", http, tmp_path / "audit.jsonl"
            )
            controller.breaker_open = True
            async with serving(controller, TOKEN) as url:
                for name in ("pause", "resume", "rearm"):
                    for headers in (
                        {},
                        {"Authorization": "Bearer wrong"},
                        {"Authorization": f"Basic {TOKEN}"},
                    ):
                        async with http.post(f"{url}/api/v1/{name}", headers=headers) as r:
                            assert r.status == 401, (name, headers)
                            assert r.headers["WWW-Authenticate"] == "Bearer"
                assert not controller.paused and controller.breaker_open
                good = {"Authorization": f"Bearer {TOKEN}"}
                async with http.post(f"{url}/api/v1/pause", headers=good) as r:
                    assert r.status == 200 and (await r.json())["paused"] is True
                assert controller.paused
                async with http.post(f"{url}/api/v1/rearm", headers=good) as r:
                    assert r.status == 200 and (await r.json())["breaker_open"] is False
                async with http.post(f"{url}/api/v1/resume", headers=good) as r:
                    assert r.status == 200 and not controller.paused
                decisions = [
                    json.loads(line)["decision"]
                    for line in (tmp_path / "audit.jsonl").read_text().splitlines()
                ]
                assert decisions == ["paused", "rearmed", "resumed"]
                # reads are open
                async with http.get(f"{url}/api/v1/status") as r:
                    status = await r.json()
                assert status["mode"] == "act" and status["last_pass"] is None
            async with serving(controller, None) as url:
                good = {"Authorization": f"Bearer {TOKEN}"}
                async with http.post(f"{url}/api/v1/pause", headers=good) as r:
                    assert r.status == 403 and "--token-file" in await r.text()
                assert not controller.paused

    asyncio.run(scenario())


def test_an_approved_move_needs_the_token_and_a_well_formed_body(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            controller = make_controller(
                tmp_path / "none.sock", "http://127.0.0.1:9", http, tmp_path / "audit.jsonl"
            )
            mover = Mover(
                Supervisor(workers_config(tmp_path / "state")),
                RuntimeApiActuator(controller.api),
                controller.audit,
                controller.metrics,
                controller.settings,
                http,
            )
            controller.mover = mover
            good = {"Authorization": f"Bearer {TOKEN}"}
            async with serving(controller, TOKEN) as url:
                moves = f"{url}/api/v1/moves"
                async with http.post(moves, json={"gpu": 1, "to": "be_b"}) as r:
                    assert r.status == 401
                for body, error in (
                    ({"to": "be_b"}, "gpu must be a GPU index, got None"),
                    ({"gpu": True, "to": "be_b"}, "gpu must be a GPU index, got True"),
                    ({"gpu": 1}, "to must name the backend to serve"),
                    ([1, "be_b"], "gpu must be a GPU index"),
                ):
                    async with http.post(moves, json=body, headers=good) as r:
                        assert r.status == 400 and error in (await r.json())["error"], body
                async with http.post(moves, data=b"{", headers=good) as r:
                    assert r.status == 400 and "must be JSON" in (await r.json())["error"]
                assert mover.approved == []
                async with http.post(moves, json={"gpu": 1, "to": "be_b"}, headers=good) as r:
                    assert r.status == 202
                    answer = await r.json()
                assert answer["mode"] == "act" and answer["id"].startswith("approved-")
                assert [(m.gpu, m.to) for m in mover.approved] == [(1, "be_b")]
            # without a supervisor there is nothing to move with
            controller.mover = None
            async with serving(controller, TOKEN) as url:
                body = {"gpu": 1, "to": "be_b"}
                async with http.post(f"{url}/api/v1/moves", json=body, headers=good) as r:
                    assert r.status == 409 and "controller.workers" in (await r.json())["error"]

    asyncio.run(scenario())


def test_metrics_serve_the_controller_series(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            controller = make_controller(
                tmp_path / "none.sock", "http://127.0.0.1:9", http, tmp_path / "audit.jsonl"
            )
            await controller.run_once()
            async with serving(controller, None) as url, http.get(f"{url}/metrics") as r:
                text = await r.text()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {
            "gpubalance_controller_actions",
            "gpubalance_controller_refusals",
            "gpubalance_controller_breaker_tripped",
            "gpubalance_controller_dry_run",
            "gpubalance_controller_cycle_duration_seconds",
            "gpubalance_controller_source_up",
        } <= names
        assert 'gpubalance_controller_source_up{source="haproxy"} 0.0' in text
        assert 'gpubalance_controller_refusals_total{reason="last_ready_server"} 0.0' in text
        if shutil.which("promtool") is not None:
            result = subprocess.run(
                ["promtool", "check", "metrics"],
                input=text,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, result.stdout + result.stderr

    asyncio.run(scenario())


def test_listening_beyond_loopback_needs_a_token_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["controller", "--analyzer", "http://127.0.0.1:9", "--haproxy-socket", "x.sock"]
    assert main([*args, "--listen", "0.0.0.0:0"]) == 2
    assert "needs --token-file" in capsys.readouterr().err
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert main([*args, "--token-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_recommendations_parse_from_the_analyzers_json_dump() -> None:
    rec = Recommendation(
        id="r1",
        action="set_weights",
        host="h1",
        target="be",
        parameters={"weights": {"s1": 40}},
        reason="slow card",
        evidence=("queue 14 vs peer median 0",),
        confidence=0.8,
        created_seconds=1.0,
        expires_seconds=2.0,
        expected=ExpectedEffect({0: 1.4, 1: 0.3}, {0: 0.9, 1: 0.8}, 0.2, 0.01),
        cost_rank=0,
        acks=(Ack("accepted", "", "someone", 1.5),),
    )
    body = TypeAdapter(list[Recommendation]).dump_json([rec])
    assert parse_recommendations(body) == [rec]
    wrapped = json.dumps({"recommendations": json.loads(body)}).encode()
    assert parse_recommendations(wrapped) == [rec]
    with pytest.raises(AnalyzerError, match="not JSON"):
        parse_recommendations(b"<html>")
    with pytest.raises(AnalyzerError, match="expected shape"):
        parse_recommendations(b'[{"id": "r1"}]')


def test_the_controller_imports_no_lab_module() -> None:
    code = (
        "import sys, gpubalance.controller.cli as c, gpubalance.controller.loop, "
        "gpubalance.controller.agent, gpubalance.controller.server, "
        "gpubalance.controller.runtime_actuator\n"
        "bad = sorted(m for m in sys.modules if m.startswith('gpubalance.lab'))\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.haproxy
@pytest.mark.skipif(not haproxy_installed(), reason="haproxy is not installed")
@pytest.mark.parametrize("paused", [False, True], ids=["acting", "started-paused"])
def test_the_controller_command_acts_serves_status_and_stops_on_sigterm(
    tmp_path: Path, paused: bool
) -> None:
    async def scenario(listener: socket.socket) -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                analyzer.recommendations = [
                    recommendation("r1", "set_weights", "be", {"weights": {"s1": 60}})
                ]
                port = port_of(listener)
                args = acting_args(analyzer.url, config.socket_path, tmp_path, port)
                process = await start_command(
                    *args, *(["--paused"] if paused else []), listener=listener
                )
                status_url = f"http://127.0.0.1:{port}/api/v1/status"
                try:
                    if paused:
                        # its passes plan the change and carry none of it out until a person
                        # resumes it
                        async with asyncio.timeout(30):
                            while True:
                                async with http.get(status_url) as r:
                                    status = await r.json()
                                if status["passes"] >= 5:
                                    break
                                await asyncio.sleep(0.05)
                        assert status["paused"] and status["mode"] == "act"
                        assert weights(haproxy.api)["s1"] == (100, "ready")
                        assert not analyzer.acks_of("r1")
                        good = {"Authorization": f"Bearer {TOKEN}"}
                        async with http.post(
                            f"http://127.0.0.1:{port}/api/v1/resume", headers=good
                        ):
                            pass
                    # the default dwell (2 passes) and step (32): 100 -> 68 -> 60
                    async with asyncio.timeout(30):
                        while not analyzer.acks_of("r1"):
                            await asyncio.sleep(0.05)
                    assert weights(haproxy.api)["s1"] == (60, "ready")
                    async with http.get(status_url) as r:
                        status = await r.json()
                    assert status["mode"] == "act" and status["last_pass"]["ok"]
                    assert analyzer.acks_of("r1")[0][0] == "applied"
                finally:
                    err = await stop_command(process)
                assert process.returncode == 0, err.decode()
                assert b"acting" in err
                if paused:
                    assert b"paused: it plans and logs" in err
                    decisions = [
                        json.loads(line)["decision"]
                        for line in (tmp_path / "audit.jsonl").read_text().splitlines()
                    ]
                    assert decisions.index("paused") < decisions.index("resumed")
                    assert decisions.index("resumed") < decisions.index("applied")

    with held_listener() as listener:
        asyncio.run(scenario(listener))


def test_paused_without_a_token_file_it_exits_2_saying_why(capsys) -> None:
    argv = ["controller", "--analyzer", "http://127.0.0.1:9", "--haproxy-socket", "/nope"]
    assert main([*argv, "--paused"]) == 2
    assert "--paused needs --token-file" in capsys.readouterr().err


@pytest.mark.haproxy
@pytest.mark.skipif(not haproxy_installed(), reason="haproxy is not installed")
def test_killed_mid_drain_a_restarted_controller_finishes_it_without_repeating(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                front = f"http://127.0.0.1:{haproxy.config.frontends[0].port}"
                held = asyncio.create_task(http.get(f"{front}/hold"))  # round robin: s1
                async with asyncio.timeout(10):
                    while sum(backends.held.values()) < 1:
                        await asyncio.sleep(0.01)
                analyzer.recommendations = [recommendation("r1", "remove_worker", "be/s1")]
                log = tmp_path / "audit.jsonl"
                token = tmp_path / "token"
                token.write_text(TOKEN)
                args = (
                    "--token-file",
                    str(token),
                    "--analyzer",
                    analyzer.url,
                    "--haproxy-socket",
                    str(config.socket_path),
                    "--act",
                    "--listen",
                    "127.0.0.1:0",
                    "--audit-log",
                    str(log),
                    "--interval",
                    "0.1",
                    "--dwell-cycles",
                    "1",
                )
                first = await start_command(*args)
                try:
                    async with asyncio.timeout(30):
                        while weights(haproxy.api)["s1"] != (100, "drain"):
                            await asyncio.sleep(0.02)
                        # it keeps passing while s1 drains; kill it in the middle of that
                        while not any(
                            e.get("reason", "").startswith("draining") for e in entries(log)
                        ):
                            await asyncio.sleep(0.02)
                finally:
                    signal_child(first, signal.SIGKILL)
                    await stop_command(first)
                assert first.returncode == -signal.SIGKILL
                backends.release.set()
                (await held).release()
                second = await start_command(*args)
                try:
                    async with asyncio.timeout(30):
                        while not analyzer.acks_of("r1"):
                            await asyncio.sleep(0.05)
                finally:
                    err = await stop_command(second)
                assert second.returncode == 0, err.decode()
                assert weights(haproxy.api) == {"s1": (100, "maint"), "s2": (100, "ready")}
                applied = [
                    (e["target"], e["action"]) for e in entries(log) if e["decision"] == "applied"
                ]
                assert applied == [("be/s1", "drain"), ("be/s1", "maint")]
                assert analyzer.acks_of("r1") == [("applied", "HAProxy shows what it asks for")]

    asyncio.run(scenario())


def entries(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    # the writer may be mid-line: only whole lines count
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def test_the_audit_log_reads_back_past_a_torn_or_hand_edited_line(tmp_path: Path) -> None:
    from gpubalance.controller.audit import AuditLog
    from gpubalance.controller.model import Applied

    path = tmp_path / "audit.jsonl"
    good = {"at_seconds": 10.0, "decision": "applied", "target": "be/s1"}
    good |= {"recommendation": "r1", "action": "drain"}
    lines = [
        json.dumps(good),
        json.dumps({"at_seconds": 11.0, "decision": "applied"}),  # edited by hand
        json.dumps({"at_seconds": 12.0, "decision": "breaker_tripped"}),
        '{"at_seconds": 13.0, "decis',  # the process died mid-write
    ]
    path.write_text("\n".join(lines))
    log = AuditLog(path)
    assert log.applied_since(0) == [Applied(10.0, "be/s1", "r1", "drain")]
    assert log.applied_since(10.5) == []
    assert log.breaker_open() and log.last_rearm() == 0.0
