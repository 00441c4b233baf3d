"""Pools as policies: the `haproxy:` config section, the HAProxy config `gpubalance deploy
haproxy` renders from it, and admission control on a real HAProxy in front of real workers
(tests/controller/hold_worker.py), the shed requests counted by the controller's pass."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from controller_harness import (
    Analyzer,
    free_port,
    haproxy_installed,
    make_controller,
    recommendation,
)

from gpubalance.cli import main
from gpubalance.config import ConfigError
from gpubalance.controller.backpressure import BackendCounts
from gpubalance.controller.haproxy import RuntimeApi, ServerStat
from gpubalance.controller.loop import Controller
from gpubalance.controller.model import Observed, ObservedServer, Settings
from gpubalance.controller.plan import plan, plan_moves
from gpubalance.controller.pools import PoolsConfig, load, render
from gpubalance.lab.live.haproxy import HaproxyRun, check
from gpubalance.lab.live.ports import on_a_free_port


def haproxy(test: Callable[..., None]) -> Callable[..., None]:
    """A test on a real HAProxy process: marked, and skipped where none is installed."""
    marked = pytest.mark.haproxy(test)
    return pytest.mark.skipif(not haproxy_installed(), reason="haproxy is not installed")(marked)


HOLD_WORKER = str(Path(__file__).parent / "hold_worker.py")

# what the operator's own haproxy.cfg holds; the rendered pools go beside it
GLOBAL = """global
    stats socket {socket} mode 600 level admin
    # a server's maxconn holds exactly with one thread in 2.6 (lab/live/haproxy.py)
    nbthread 1

defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
"""


def pool(name: str, **fields: Any) -> dict[str, Any]:
    servers = [{"name": "gpu0", "address": "127.0.0.1:9001", "maxconn": 4}]
    admission = {"max_queue": 4}
    return {
        "name": name,
        "bind": "127.0.0.1:8080",
        "servers": servers,
        "admission": admission,
        **fields,
    }


SHARES = pool(
    "be_llm",
    policy="fixed_share",
    servers=[
        {"name": "gpu0", "address": "10.0.0.1:9001", "maxconn": 4},
        {"name": "gpu1", "address": "10.0.0.2:9001", "maxconn": 5},
    ],
    tenants=[{"name": "a", "share": 0.75}, {"name": "b", "share": 0.25}],
    admission={"max_queue": 8, "queue_timeout_seconds": 20, "retry_after_seconds": 5},
)


def write(tmp_path: Path, pools: list[dict[str, Any]]) -> Path:
    path = tmp_path / "gpubalance.yaml"
    path.write_text(yaml.safe_dump({"haproxy": {"pools": pools}}, sort_keys=False))
    return path


# -- the config and its validation ---------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"tenants": [{"name": "a", "share": 0.7}, {"name": "b", "share": 0.25}]},
            "pool be_llm: the tenants' shares add up to 0.95, not 1 (a 0.7, b 0.25)",
        ),
        (
            {"tenants": [{"name": "a", "share": 0.9}, {"name": "b", "share": 0.1}]},
            "tenant b's share 0.1 of server gpu0's 4 connections (maxconn) is 0.4, less than "
            "one; raise its share to at least 0.25 or the worker's maxconn",
        ),
        (
            {"tenants": [{"name": "a", "share": 0.5}, {"name": "a", "share": 0.5}]},
            "pool be_llm: tenant names repeat: a",
        ),
        (
            {"tenants": [{"name": "a", "share": 0.75}, {"name": "b", "weight": 1}]},
            "fixed_share needs a share on every tenant, or a weight on every tenant",
        ),
        ({"default_tenant": "c"}, "default_tenant 'c' is not among its tenants ['a', 'b']"),
        (
            {"policy": "utilization_first"},
            "utilization_first keeps one queue for every request; remove its tenants",
        ),
        ({"policy": "equal_share"}, "equal_share gives every tenant the same share"),
        (
            {"servers": [{"name": "gpu0", "address": "10.0.0.1:9001", "maxconn": 4}] * 2},
            "pool be_llm: server names repeat: gpu0",
        ),
        ({"tenant_header": "X Tenant"}, "'X Tenant' is not a header name"),
        ({"admission": {"max_queue": 0}}, "haproxy.pools.0.admission.max_queue"),
    ],
)
def test_a_bad_pool_is_refused_with_the_file_line_and_reason(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    path = write(tmp_path, [{**SHARES, **change}])
    with pytest.raises(ConfigError) as caught:
        load(path)
    # FILE:LINE: KEY: the pool's line, or the key's where one key is wrong
    assert str(caught.value).startswith(f"{path}:") and ": haproxy.pools.0" in str(caught.value)
    assert message in str(caught.value)


def test_pool_names_binds_and_backends_are_unique_across_pools(tmp_path: Path) -> None:
    twice = write(tmp_path, [SHARES, {**SHARES, "bind": "127.0.0.1:8081"}])
    with pytest.raises(ConfigError, match="pool names repeat: be_llm"):
        load(twice)
    # pool be_llm's tenant a is backend be_llm.a: a pool of that name would share it
    clash = write(tmp_path, [SHARES, pool("be_llm.a", bind="127.0.0.1:8081")])
    with pytest.raises(
        ConfigError,
        match=r"frontend and backend names \(fe_POOL, POOL or POOL.TENANT\) repeat: be_llm.a",
    ):
        load(clash)
    shared_bind = write(tmp_path, [SHARES, pool("be_embed")])
    with pytest.raises(ConfigError, match=r"pool binds repeat: 127\.0\.0\.1:8080"):
        load(shared_bind)


def test_each_tenant_gets_its_share_of_every_worker_in_whole_connections() -> None:
    config = PoolsConfig.model_validate({"pools": [SHARES]})
    # 0.75 and 0.25 of 4 are 3 and 1; of 5, 3.75 and 1.25: 4 and 1, still 5 in all
    assert config.pools[0].backends() == {
        "be_llm.a": {"gpu0": 3, "gpu1": 4},
        "be_llm.b": {"gpu0": 1, "gpu1": 1},
    }
    equal = {**SHARES, "policy": "equal_share", "tenants": [{"name": t} for t in "xyz"]}
    equal["servers"] = [{"name": "gpu0", "address": "10.0.0.1:9001", "maxconn": 7}]
    config = PoolsConfig.model_validate({"pools": [equal]})
    assert config.pools[0].backends() == {
        "be_llm.x": {"gpu0": 3},
        "be_llm.y": {"gpu0": 2},
        "be_llm.z": {"gpu0": 2},
    }
    weights = {**SHARES, "tenants": [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}]}
    assert PoolsConfig.model_validate({"pools": [weights]}).pools[0].shares() == {
        "a": 0.75,
        "b": 0.25,
    }


# -- the rendered HAProxy config -----------------------------------------------------------


def test_a_share_pool_renders_a_backend_per_tenant_with_its_slots_and_admission() -> None:
    shares = {**SHARES, "tenants": [*SHARES["tenants"][:1], {"name": "b", "share": 0.25}]}
    shares["tenants"][1]["max_queue"] = 2
    text = render(PoolsConfig.model_validate({"pools": [shares]}), "pools.yaml")
    frontend, a, b = text.split("\n\n")[1:]
    assert frontend.splitlines() == [
        "# fixed_share: a 0.75, b 0.25",
        "frontend fe_be_llm",
        "    bind 127.0.0.1:8080",
        "    use_backend be_llm.b if { req.hdr(X-Tenant) -m str b }",
        "    default_backend be_llm.a",
    ]
    retry = 'retry after 5 s" hdr Retry-After 5'
    assert a.splitlines() == [
        "backend be_llm.a",
        "    balance leastconn",
        "    timeout queue 20000ms",
        "    http-request return status 503 content-type text/plain string "
        f'"no serving server in pool be_llm; {retry} if {{ nbsrv eq 0 }}',
        "    http-request deny deny_status 429 content-type text/plain string "
        f'"8 requests wait in be_llm.a; {retry} if {{ queue ge 8 }}',
        "    http-error status 503 content-type text/plain string "
        f'"waited 20 s in be_llm.a; {retry}',
        "    server gpu0 10.0.0.1:9001 weight 100 maxconn 3 check inter 2000ms",
        "    server gpu1 10.0.0.2:9001 weight 100 maxconn 4 check inter 2000ms",
    ]
    # tenant b: its own bound, its own slots
    assert "if { queue ge 2 }" in b
    assert "server gpu0 10.0.0.1:9001 weight 100 maxconn 1 check" in b


def test_utilization_first_renders_one_leastconn_backend_at_the_workers_maxconn() -> None:
    one = pool("be_embed", admission={"max_queue": 16}, health_path="/healthz")
    text = render(PoolsConfig.model_validate({"pools": [one]}), "pools.yaml")
    assert text.count("\nbackend ") == 1 and "frontend fe_be_embed\n" in text
    assert "    default_backend be_embed\n" in text and "use_backend" not in text
    assert "    option httpchk GET /healthz\n" in text
    assert "server gpu0 127.0.0.1:9001 weight 100 maxconn 4 check inter 2000ms\n" in text


@haproxy
def test_the_deploy_command_writes_a_config_haproxy_accepts(tmp_path: Path) -> None:
    config = write(tmp_path, [SHARES, pool("be_embed", bind=":8081")])
    out = tmp_path / "pools.cfg"
    assert main(["deploy", "haproxy", "--config", str(config), "--out", str(out)]) == 0
    assert out.read_text() == render(load(config), str(config))
    full = tmp_path / "haproxy.cfg"
    full.write_text(GLOBAL.format(socket=tmp_path / "s.sock") + "\n" + out.read_text())
    check(full)


def test_the_deploy_command_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, [{**SHARES, "policy": "equal_share"}])
    assert main(["deploy", "haproxy", "--config", str(config)]) == 2
    assert "gpubalance deploy haproxy: " in capsys.readouterr().err


# -- the controller across a pool's tenant backends -----------------------------------------


def tenant_servers() -> Observed:
    servers = [
        ObservedServer(backend, name, "ready", 100, 100, True, 0, "10.0.0.1", port)
        for backend in ("be_llm.a", "be_llm.b")
        for name, port in (("gpu0", 9001), ("gpu1", 9002))
    ]
    return Observed(at_seconds=time.time(), servers={s.key: s for s in servers})


def test_a_weight_or_drain_of_a_worker_applies_to_each_tenant_backend_it_serves() -> None:
    weights = [{"gpu": 0, "worker": "gpu0", "weight": 0.25}, {"gpu": 1, "worker": "gpu1"}]
    weights[1]["weight"] = 0.5
    recs = [
        recommendation("w", "set_weights", "pool:be_llm", {"weights": weights}),
        recommendation("d", "drain", "gpu:1", {"workers": ["gpu1"]}, cost_rank=1),
    ]
    settings = Settings(act=True, max_weight_step=256)
    planned = plan(tenant_servers(), recs[:1], [], settings)
    assert [(c.key, c.value) for c in planned.changes] == [
        ("be_llm.a/gpu0", 50),
        ("be_llm.b/gpu0", 50),
    ]
    planned = plan(tenant_servers(), recs[1:], [], settings)
    assert [(c.key, c.value) for c in planned.changes] == [
        ("be_llm.a/gpu1", "drain"),
        ("be_llm.b/gpu1", "drain"),
    ]


def test_a_move_out_of_a_pool_of_tenant_backends_is_refused() -> None:
    move = recommendation(
        "m", "move_worker", "gpu:1", {"gpu": 1, "to": "be_x", "workers": ["gpu1"]}
    )
    passed, refused = plan_moves([move], tenant_servers(), [], [], Settings(act=True))
    assert passed == []
    assert refused[0].reason == "unsupported_action"
    assert "serve the tenant backends be_llm.a, be_llm.b" in refused[0].detail


# -- counting what HAProxy shed -------------------------------------------------------------


def counts(denied: int, own: int, servers: dict[str, int], total: int = 100) -> BackendCounts:
    return BackendCounts("be", total, denied, own, servers, 0)


def test_shed_requests_are_counted_between_readings_across_reloads_and_deleted_servers() -> None:
    first = counts(4, 3, {"s1": 1, "s2": 0})
    assert first.shed_since(None) == {"429": 4, "503": 2}  # the workers' 5xx are not shed
    later = counts(6, 5, {"s1": 2})  # s2 deleted; s1 answered one 5xx more
    assert later.shed_since(first) == {"429": 2, "503": 1}
    readded = counts(6, 6, {"s1": 2, "s2": 1})  # s2 back under its name, counting from 0
    assert readded.shed_since(later) == {"429": 0, "503": 0}
    reloaded = counts(1, 0, {"s1": 0}, total=3)  # a new HAProxy process counts from 0
    assert reloaded.shed_since(readded) == {"429": 1, "503": 0}


def test_a_controllers_first_reading_is_its_baseline() -> None:
    from gpubalance.controller.metrics import Metrics

    metrics = Metrics()

    def total(status: str) -> float | None:
        labels = {"backend": "be", "status": status}
        return metrics.registry.get_sample_value(
            "gpubalance_controller_shed_requests_total", labels
        )

    # HAProxy shed 4 and 2 before this controller started: a restart does not count them again
    metrics.backends({"be": counts(4, 3, {"s1": 1})})
    assert (total("429"), total("503")) == (0.0, 0.0)
    metrics.backends({"be": counts(6, 5, {"s1": 1})})
    assert (total("429"), total("503")) == (2.0, 2.0)


# -- admission on a real HAProxy ------------------------------------------------------------


@dataclass
class Rig:
    """Three pools on one HAProxy over hold_worker.py's workers: be_flood (utilization_first,
    two workers of concurrency 2, max_queue 3), be_down (one worker, Retry-After 7) and be_share
    (fixed_share a 0.75, b 0.25 over two workers of concurrency 4, max_queue 2)."""

    api: RuntimeApi
    binds: dict[str, int]  # pool -> frontend port
    workers: list[int]  # worker ports
    socket_path: Path

    def row(self, backend: str, server: str = "BACKEND") -> ServerStat:
        return next(s for s in self.api.show_stat(backend) if s.svname == server)

    def servers(self, backend: str) -> list[ServerStat]:
        return [s for s in self.api.show_stat(backend) if s.type == "server"]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    run = tmp_path_factory.mktemp("pools")
    workers = subprocess.Popen(
        [sys.executable, HOLD_WORKER, "5"], stdout=subprocess.PIPE, text=True
    )
    haproxy = None
    try:
        assert workers.stdout is not None
        ports = [int(p) for p in workers.stdout.readline().split()[1:]]
        socket_path = run / "haproxy.sock"
        binds: dict[str, int] = {}

        def start(port: int) -> HaproxyRun:
            # a port chosen free may be taken before HAProxy binds it: all three anew then
            binds.update(be_flood=port, be_down=free_port(), be_share=free_port())
            text = (
                GLOBAL.format(socket=socket_path)
                + "\n"
                + render(_pools_config(binds, ports), "test")
            )
            process = HaproxyRun(text, run, socket_path, [("127.0.0.1", p) for p in binds.values()])
            process.start()
            return process

        haproxy = on_a_free_port(start)
        api = RuntimeApi(socket_path, timeout_seconds=2.0)
        yield Rig(api, binds, ports, socket_path)
    finally:
        if haproxy is not None:
            haproxy.stop()
        workers.terminate()
        try:
            workers.wait(10)
        except subprocess.TimeoutExpired:
            workers.kill()
            workers.wait()


def _pools_config(binds: dict[str, int], ports: list[int]) -> PoolsConfig:
    def servers(*names_ports: tuple[str, int, int]) -> list[dict[str, Any]]:
        return [
            {"name": n, "address": f"127.0.0.1:{port}", "maxconn": c} for n, port, c in names_ports
        ]

    return PoolsConfig.model_validate(
        {
            "pools": [
                pool(
                    "be_flood",
                    bind=f"127.0.0.1:{binds['be_flood']}",
                    servers=servers(("f0", ports[0], 2), ("f1", ports[1], 2)),
                    admission={"max_queue": 3},
                ),
                pool(
                    "be_down",
                    bind=f"127.0.0.1:{binds['be_down']}",
                    servers=servers(("d0", ports[2], 2)),
                    admission={"max_queue": 3, "retry_after_seconds": 7},
                ),
                pool(
                    "be_share",
                    bind=f"127.0.0.1:{binds['be_share']}",
                    policy="fixed_share",
                    servers=servers(("s0", ports[3], 4), ("s1", ports[4], 4)),
                    tenants=[{"name": "a", "share": 0.75}, {"name": "b", "share": 0.25}],
                    admission={"max_queue": 2},
                ),
            ]
        }
    )


@dataclass(frozen=True)
class Answer:
    status: int
    retry_after: str | None
    body: str


async def get(http: aiohttp.ClientSession, port: int, path: str, tenant: str = "") -> Answer:
    headers = {"X-Tenant": tenant} if tenant else {}
    async with http.get(f"http://127.0.0.1:{port}{path}", headers=headers) as resp:
        return Answer(resp.status, resp.headers.get("Retry-After"), await resp.text())


def key(name: str) -> str:
    """A hold key of this test's run alone: the rig's workers are the module's, and a key once
    released stays released there, so a repeated test (make test-repeat) must not reuse one."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def until(
    check: Callable[[], bool] | Callable[[], Coroutine[Any, Any, bool]],
    what: str,
    limit_seconds: float = 10.0,
) -> None:
    """Wait for what HAProxy (or a worker) reports, read every 10 ms: a blocking check runs in a
    thread, a coroutine function is awaited."""

    async def holds() -> bool:
        if inspect.iscoroutinefunction(check):
            return await check()
        return await asyncio.to_thread(check)

    deadline = time.monotonic() + limit_seconds
    while not await holds():
        assert time.monotonic() < deadline, f"waited {limit_seconds} s for {what}"
        await asyncio.sleep(0.01)


async def release(http: aiohttp.ClientSession, rig: Rig, key: str) -> None:
    async with http.post(f"http://127.0.0.1:{rig.workers[0]}/release/{key}") as resp:
        assert resp.status == 204


def shed(controller: Controller, backend: str, status: str) -> float | None:
    labels = {"backend": backend, "status": status}
    return controller.metrics.registry.get_sample_value(
        "gpubalance_controller_shed_requests_total", labels
    )


@contextlib.asynccontextmanager
async def controlled(
    rig: Rig, tmp_path: Path
) -> AsyncIterator[tuple[Controller, aiohttp.ClientSession]]:
    """A dry-run controller on the rig's HAProxy, and an HTTP client."""
    async with Analyzer() as analyzer, aiohttp.ClientSession() as http:
        controller = make_controller(
            rig.socket_path, analyzer.url, http, tmp_path / "audit.jsonl", Settings()
        )
        yield controller, http


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


@haproxy
def test_a_flood_beyond_max_queue_gets_429_with_retry_after_counted_as_shed(
    rig: Rig, tmp_path: Path
) -> None:
    port = rig.binds["be_flood"]

    async def scenario() -> None:
        a = key("a")
        async with controlled(rig, tmp_path) as (controller, http):
            await controller.run_once()
            busy = [asyncio.create_task(get(http, port, f"/hold/{a}")) for _ in range(4)]
            await until(lambda: sum(s.scur for s in rig.servers("be_flood")) == 4, "4 in flight")
            waiting = [asyncio.create_task(get(http, port, f"/hold/{a}")) for _ in range(3)]
            await until(lambda: rig.row("be_flood").qcur == 3, "3 waiting")
            flood = await asyncio.gather(*(get(http, port, f"/hold/{a}") for _ in range(6)))
            assert {(a.status, a.retry_after) for a in flood} == {(429, "5")}
            assert "3 requests wait in be_flood; retry after 5 s" in flood[0].body
            await controller.run_once()
            queue = {"backend": "be_flood"}
            gauge = "gpubalance_controller_backend_queue"
            assert controller.metrics.registry.get_sample_value(gauge, queue) == 3
            await release(http, rig, a)
            admitted = await asyncio.gather(*busy, *waiting)
            assert [a.status for a in admitted] == [200] * 7
            await controller.run_once()
            assert shed(controller, "be_flood", "429") == len(flood)
            assert shed(controller, "be_flood", "503") == 0
            assert controller.metrics.registry.get_sample_value(gauge, queue) == 0
            assert rig.row("be_flood").qmax == 3  # the bound held

    run(scenario)


@haproxy
def test_a_pool_with_no_serving_server_answers_503_with_retry_after(
    rig: Rig, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with controlled(rig, tmp_path) as (controller, http):
            await controller.run_once()
            rig.api.set_state("be_down", "d0", "maint")
            try:
                answers = [await get(http, rig.binds["be_down"], "/") for _ in range(3)]
            finally:
                rig.api.set_state("be_down", "d0", "ready")
            assert {(a.status, a.retry_after) for a in answers} == {(503, "7")}
            assert "no serving server in pool be_down" in answers[0].body
            assert (await get(http, rig.binds["be_down"], "/")).status == 200
            await controller.run_once()
            assert shed(controller, "be_down", "503") == 3
            assert shed(controller, "be_down", "429") == 0

    run(scenario)


@haproxy
def test_fixed_share_keeps_a_tenants_slots_while_another_floods(rig: Rig, tmp_path: Path) -> None:
    port = rig.binds["be_share"]

    async def scenario() -> None:
        ca, cb = key("c-a"), key("c-b")
        async with controlled(rig, tmp_path) as (controller, http):
            await controller.run_once()
            # b's share of two workers of concurrency 4 is one slot each; two more may wait
            before = rig.row("be_share.b").stot  # the rig is the module's: counters go on
            flood = [asyncio.create_task(get(http, port, f"/hold/{cb}", "b")) for _ in range(10)]
            await until(
                lambda: rig.row("be_share.b").stot == before + 10, "b's flood through HAProxy"
            )
            assert [s.scur for s in rig.servers("be_share.b")] == [1, 1]
            assert rig.row("be_share.b").qcur == 2
            # a still has its three slots on each worker, at once
            held = [asyncio.create_task(get(http, port, f"/hold/{ca}", "a")) for _ in range(5)]
            await until(lambda: sum(s.scur for s in rig.servers("be_share.a")) == 5, "a's 5")
            quick = await asyncio.wait_for(get(http, port, "/", "a"), 5)
            assert quick.status == 200 and rig.row("be_share.a").qmax == 0
            # no tenant header: the default tenant, a
            assert (await asyncio.wait_for(get(http, port, "/"), 5)).status == 200
            assert max(s.smax for s in rig.servers("be_share.b")) == 1
            await release(http, rig, cb)
            await release(http, rig, ca)
            b = [a.status for a in await asyncio.gather(*flood)]
            assert sorted(b) == [200] * 4 + [429] * 6
            assert [a.status for a in await asyncio.gather(*held)] == [200] * 5
            await controller.run_once()
            assert shed(controller, "be_share.b", "429") == 6
            assert shed(controller, "be_share.a", "429") == 0

    run(scenario)


@haproxy
def test_utilization_first_keeps_one_queue_for_the_first_free_slot(
    rig: Rig, tmp_path: Path
) -> None:
    port = rig.binds["be_flood"]

    async def held_at(http: aiohttp.ClientSession, worker: int) -> list[str]:
        async with http.get(f"http://127.0.0.1:{worker}/held") as resp:
            return json.loads(await resp.text())

    async def scenario() -> None:
        d = key("d") + "-"
        async with aiohttp.ClientSession() as http:
            busy = [asyncio.create_task(get(http, port, f"/hold/{d}{i}")) for i in range(4)]
            await until(lambda: sum(s.scur for s in rig.servers("be_flood")) == 4, "4 in flight")
            waiting = [asyncio.create_task(get(http, port, f"/hold/{d}q")) for _ in range(2)]
            await until(lambda: rig.row("be_flood").qcur == 2, "2 waiting")
            # they wait in the backend's queue, not in a server's
            assert [s.qcur for s in rig.servers("be_flood")] == [0, 0]
            # a slot frees on f1: the first request waiting takes it
            on_f1 = await held_at(http, rig.workers[1])
            await release(http, rig, on_f1[0])
            await until(lambda: rig.row("be_flood").qcur == 1, "1 waiting")
            # HAProxy has sent it on; the worker holds it once its request has arrived

            async def f1_holds_it() -> bool:
                return f"{d}q" in await held_at(http, rig.workers[1])

            await until(f1_holds_it, "the waiting request to take f1's slot")
            for each in (*(f"{d}{i}" for i in range(4)), f"{d}q"):
                await release(http, rig, each)
            answers = await asyncio.gather(*busy, *waiting)
            assert [a.status for a in answers] == [200] * 6

    run(scenario)


@haproxy
def test_the_readme_example_renders_a_config_haproxy_accepts(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (example,) = [
        b for b in re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL) if b.startswith("haproxy:")
    ]
    path = tmp_path / "gpubalance.yaml"
    path.write_text(example)
    config = load(path)
    assert config.pools[0].backends() == {
        "be_llm.a": {"gpu0": 3, "gpu1": 3},
        "be_llm.b": {"gpu0": 1, "gpu1": 1},
    }
    full = tmp_path / "haproxy.cfg"
    full.write_text(GLOBAL.format(socket=tmp_path / "s.sock") + "\n" + render(config, str(path)))
    check(full)
