"""HAProxy config, process and runtime API, against a real HAProxy and in-process echo servers.

Each echo server answers its own name, so the response body says where HAProxy sent a request;
`/hold` keeps a request in flight until the test releases it, so "busy" never depends on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest
from aiohttp import web

from gpubalance.lab.live import haproxy as haproxy_module
from gpubalance.lab.live.haproxy import (
    APT_INSTALL,
    POLICIES,
    STICKY_COOKIE,
    Backend,
    Frontend,
    HaproxyConfig,
    HaproxyError,
    HaproxyNotFoundError,
    HaproxyProcess,
    RuntimeApi,
    RuntimeApiError,
    Server,
    check,
    find_haproxy,
    render,
)

F = TypeVar("F", bound=Callable[..., object])


def _installed() -> bool:
    try:
        find_haproxy()
    except HaproxyNotFoundError:
        return False
    return True


def needs_haproxy(test: F) -> F:
    """A test that drives a real HAProxy (marker `haproxy`), skipped where none is installed."""
    installed = pytest.mark.skipif(
        not _installed(), reason=f"haproxy is not installed; install it with: {APT_INSTALL}"
    )
    return pytest.mark.haproxy(installed(test))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EchoServers:
    """aiohttp servers in this event loop, one per name, each answering its name."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(names)
        self.ports: dict[str, int] = {}
        self.held: Counter[str] = Counter()
        self.unhealthy: set[str] = set()
        self.release = asyncio.Event()
        self._runners: list[web.AppRunner] = []

    async def __aenter__(self) -> EchoServers:
        for name in self.names:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handler(name))
            runner = web.AppRunner(app, shutdown_timeout=1.0)
            await runner.setup()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(runner, sock).start()
            self.ports[name] = sock.getsockname()[1]
            self._runners.append(runner)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        for runner in self._runners:
            await runner.cleanup()

    def _handler(self, name: str) -> Callable[[web.Request], object]:
        async def handle(request: web.Request) -> web.Response:
            if request.path == "/healthz" and name in self.unhealthy:
                return web.Response(status=503)
            if request.path == "/hold":
                self.held[name] += 1
                await self.release.wait()
                self.held[name] -= 1
            return web.Response(text=name)

        return handle

    def servers(self, **options: dict[str, object]) -> tuple[Server, ...]:
        """One `Server` per echo server; `options[name]` overrides its fields."""
        return tuple(
            Server(name, "127.0.0.1", self.ports[name], **options.get(name, {}))
            for name in self.names
        )

    async def wait_held(self, total: int) -> None:
        async with asyncio.timeout(20):
            while sum(self.held.values()) < total:
                await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(config: HaproxyConfig) -> AsyncIterator[HaproxyProcess]:
    """HAProxy started and stopped off the event loop, so the echo servers keep answering."""
    process = HaproxyProcess(config)
    await asyncio.to_thread(process.start)
    try:
        yield process
    finally:
        await asyncio.to_thread(process.stop)


def one_backend(tmp_path: Path, backend: Backend, **config: object) -> HaproxyConfig:
    return HaproxyConfig(
        frontends=(Frontend("fe", free_port(), backend.name),),
        backends=(backend,),
        run_dir=tmp_path,
        **config,
    )


def url(config: HaproxyConfig, path: str = "/") -> str:
    frontend = config.frontends[0]
    return f"http://{frontend.host}:{frontend.port}{path}"


async def fetch(
    http: aiohttp.ClientSession, target: str, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    async with http.get(target, headers=headers) as response:
        return response.status, await response.text()


async def where(
    http: aiohttp.ClientSession, target: str, count: int, headers: dict[str, str] | None = None
) -> Counter[str]:
    """Send `count` requests one after another; count which server answered each."""
    answered: Counter[str] = Counter()
    for _ in range(count):
        status, name = await fetch(http, target, headers)
        assert status == 200, name
        answered[name] += 1
    return answered


def test_render_is_plain_haproxy_text(tmp_path: Path) -> None:
    config = HaproxyConfig(
        frontends=(Frontend("fe", 18080, "be_interactive", routes={"batch": "be_batch"}),),
        backends=(
            Backend(
                "be_interactive",
                (
                    Server("gpu0", "127.0.0.1", 19000),
                    Server("gpu1", "127.0.0.1", 19001, weight=50, cookie="g1"),
                ),
                policy="sticky",
            ),
            Backend(
                "be_batch",
                (Server("gpu2", "127.0.0.1", 19002, maxconn=4),),
                policy="pooled",
                queue_timeout_seconds=2.5,
                health_check_path="/healthz",
            ),
        ),
        run_dir=Path("/run/lab"),
        stats_port=18099,
    )
    assert render(config) == (
        "# Generated by gpubalance.lab.live.haproxy; change the HaproxyConfig, not this file.\n"
        "global\n"
        "    stats socket /run/lab/haproxy.sock mode 600 level admin\n"
        "    maxconn 4096\n"
        "    nbthread 1\n"
        "\n"
        "defaults\n"
        "    mode http\n"
        "    option redispatch\n"
        "    retries 2\n"
        "    timeout connect 5s\n"
        "    timeout client 120s\n"
        "    timeout server 120s\n"
        "\n"
        "frontend fe\n"
        "    bind 127.0.0.1:18080\n"
        "    use_backend be_batch if { req.hdr(X-Class) -m str batch }\n"
        "    default_backend be_interactive\n"
        "\n"
        "backend be_interactive\n"
        "    balance roundrobin\n"
        "    timeout queue 30s\n"
        "    cookie SERVERID indirect nocache\n"
        "    server gpu0 127.0.0.1:19000 weight 100 cookie gpu0\n"
        "    server gpu1 127.0.0.1:19001 weight 50 cookie g1\n"
        "\n"
        "backend be_batch\n"
        "    balance leastconn\n"
        "    timeout queue 2500ms\n"
        "    option httpchk GET /healthz\n"
        "    server gpu2 127.0.0.1:19002 weight 100 maxconn 4 check inter 1s\n"
        "\n"
        "frontend stats\n"
        "    bind 127.0.0.1:18099\n"
        "    http-request use-service prometheus-exporter if { path /metrics }\n"
        "    stats enable\n"
        "    stats uri /stats\n"
    )


@needs_haproxy
@pytest.mark.parametrize("policy", POLICIES)
def test_haproxy_accepts_every_policy(tmp_path: Path, policy: str) -> None:
    servers = tuple(Server(f"gpu{i}", "127.0.0.1", 19000 + i, maxconn=2) for i in range(3))
    backend = Backend("be", servers, policy=policy, health_check_path="/healthz")
    config = one_backend(tmp_path, backend, stats_port=free_port())
    path = tmp_path / "haproxy.cfg"
    path.write_text(render(config))
    check(path)


@needs_haproxy
def test_check_raises_with_haproxys_message(tmp_path: Path) -> None:
    config = one_backend(tmp_path, Backend("be", (Server("gpu0", "127.0.0.1", 19000),)))
    path = tmp_path / "haproxy.cfg"
    path.write_text(render(config).replace("balance roundrobin", "balance fastest"))
    with pytest.raises(HaproxyError, match="balance only supports"):
        check(path)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: Backend("be", (Server("gpu0", "127.0.0.1", 1),), policy="pooled"),
            "pooled needs maxconn",
        ),
        (lambda: Server("gpu0", "127.0.0.1", 1, weight=300), "outside 0..256"),
        (lambda: Server("gpu 0", "127.0.0.1", 1), "letters, digits"),
        (lambda: Backend("be", (), policy="round_robin"), "at least one server"),
        (
            lambda: Backend("be", (Server("a", "h", 1),), health_check_path="healthz"),
            "must start with '/'",
        ),
        (
            lambda: Backend("be", (Server("a", "h", 1), Server("b", "h", 2)), policy="fastest"),
            "not one of round_robin",
        ),
        (
            lambda: HaproxyConfig(
                (Frontend("fe", 1, "be_missing"),),
                (Backend("be", (Server("a", "h", 1),)),),
                Path("/run"),
            ),
            "routes to backend 'be_missing'",
        ),
        (
            lambda: HaproxyConfig(
                (Frontend("fe", 1, "be"),),
                (Backend("be", (Server("a", "h", 1),)),),
                Path("/x" * 60),
            ),
            "shorter run_dir",
        ),
        (
            lambda: HaproxyConfig(
                (Frontend("fe", 1, "be_a", routes={"batch": "be_b"}),),
                (
                    Backend("be_a", (Server("gpu0", "h", 1, maxconn=4),), "pooled"),
                    Backend("be_b", (Server("gpu0", "h", 1, maxconn=4),), "pooled"),
                ),
                Path("/run"),
            ),
            r"worker h:1 has maxconn in backends be_a, be_b.*up to 8 requests at once; route "
            "those classes to one backend",
        ),
    ],
)
def test_config_errors_say_what_to_change(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_missing_haproxy_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(haproxy_module.shutil, "which", lambda *args, **kwargs: None)
    config = one_backend(tmp_path, Backend("be", (Server("gpu0", "127.0.0.1", 19000),)))
    with pytest.raises(HaproxyNotFoundError, match="sudo apt-get install haproxy"):
        HaproxyProcess(config).start()


@needs_haproxy
def test_start_failure_shows_haproxys_log(tmp_path: Path) -> None:
    # a plain listening socket (no SO_REUSEPORT) makes HAProxy's bind fail
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        backend = Backend("be", (Server("gpu0", "127.0.0.1", 19000),))
        config = HaproxyConfig(
            frontends=(Frontend("fe", taken.getsockname()[1], "be"),),
            backends=(backend,),
            run_dir=tmp_path,
        )
        process = HaproxyProcess(config)
        with pytest.raises(HaproxyError, match=r"(?s)exited with code.*cannot bind"):
            process.start()


def test_unreachable_socket_says_what_to_check(tmp_path: Path) -> None:
    with pytest.raises(RuntimeApiError, match="stats socket"):
        RuntimeApi(tmp_path / "none.sock", timeout_seconds=1).show_stat()


@needs_haproxy
def test_round_robin_spreads_evenly(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with EchoServers(["s1", "s2", "s3"]) as echo:
            config = one_backend(tmp_path, Backend("be", echo.servers()))
            async with running(config), aiohttp.ClientSession() as http:
                assert await where(http, url(config), 30) == {"s1": 10, "s2": 10, "s3": 10}

    asyncio.run(scenario())


@needs_haproxy
def test_weights_split_traffic_in_proportion(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with EchoServers(["s1", "s2", "s3"]) as echo:
            servers = echo.servers(s1={"weight": 3}, s2={"weight": 1}, s3={"weight": 0})
            config = one_backend(tmp_path, Backend("be", servers))
            async with running(config), aiohttp.ClientSession() as http:
                answered = await where(http, url(config), 80)
            assert answered["s3"] == 0
            assert abs(answered["s1"] - 60) <= 2, answered
            assert abs(answered["s2"] - 20) <= 2, answered

    asyncio.run(scenario())


@needs_haproxy
def test_least_connections_prefers_the_idle_server(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with EchoServers(["s1", "s2", "s3"]) as echo:
            config = one_backend(tmp_path, Backend("be", echo.servers(), "least_connections"))
            async with running(config), aiohttp.ClientSession() as http:
                busy = []
                for held in (1, 2):
                    busy.append(asyncio.create_task(fetch(http, url(config, "/hold"))))
                    await echo.wait_held(held)
                idle = set(echo.names) - {name for name, n in echo.held.items() if n}
                assert len(idle) == 1
                assert await where(http, url(config), 10) == {idle.pop(): 10}
                echo.release.set()
                assert [status for status, _ in await asyncio.gather(*busy)] == [200, 200]

    asyncio.run(scenario())


@needs_haproxy
def test_sticky_cookie_pins_to_the_named_server(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with EchoServers(["s1", "s2", "s3"]) as echo:
            servers = echo.servers(s2={"cookie": "gpu2"})
            config = one_backend(tmp_path, Backend("be", servers, "sticky"))
            async with running(config) as haproxy, aiohttp.ClientSession() as http:
                pinned = await where(http, url(config), 12, {"Cookie": f"{STICKY_COOKIE}=gpu2"})
                assert pinned == {"s2": 12}
                assert await where(http, url(config), 12, {"Cookie": f"{STICKY_COOKIE}=s3"}) == {
                    "s3": 12
                }
                # draining keeps the pinned requests: the controller must move the sessions
                haproxy.api.set_state("be", "s2", "drain")
                assert await where(http, url(config), 4, {"Cookie": f"{STICKY_COOKIE}=gpu2"}) == {
                    "s2": 4
                }
                haproxy.api.set_state("be", "s2", "ready")
                # no cookie: plain round robin, and HAProxy sets none (the client owns it)
                async with http.get(url(config)) as response:
                    assert STICKY_COOKIE not in response.cookies
                assert set(await where(http, url(config), 12)) == {"s1", "s2", "s3"}

    asyncio.run(scenario())


@needs_haproxy
def test_pooled_classes_share_the_workers_slots_and_one_queue(tmp_path: Path) -> None:
    """Two classes on the same workers: `X-Class: batch` and the default share one backend, so
    a worker's `maxconn` counts both, and an interactive request waits behind batch work."""

    async def scenario() -> None:
        async with EchoServers(["s1", "s2"]) as echo:
            backend = Backend(
                "be_pool", echo.servers(s1={"maxconn": 1}, s2={"maxconn": 1}), "pooled"
            )
            config = HaproxyConfig(
                frontends=(Frontend("fe", free_port(), "be_pool", routes={"batch": "be_pool"}),),
                backends=(backend,),
                run_dir=tmp_path,
            )
            async with running(config) as haproxy, aiohttp.ClientSession() as http:
                batch = [
                    asyncio.create_task(fetch(http, url(config, "/hold"), {"X-Class": "batch"}))
                    for _ in range(2)
                ]
                await echo.wait_held(2)
                interactive = asyncio.create_task(fetch(http, url(config, "/hold")))
                await _wait_queued(haproxy.api, "be_pool", 1)
                rows = {s.svname: s for s in haproxy.api.show_stat("be_pool")}
                assert dict(echo.held) == {"s1": 1, "s2": 1}
                # the central queue holds it, not one server's own queue
                assert [(rows[s].scur, rows[s].qcur) for s in ("s1", "s2")] == [(1, 0), (1, 0)]

                echo.release.set()
                answers = await asyncio.gather(*batch, interactive)
                assert [status for status, _ in answers] == [200] * 3
                rows = {s.svname: s for s in haproxy.api.show_stat("be_pool")}
                assert (rows["s1"].smax, rows["s2"].smax, rows["BACKEND"].stot) == (1, 1, 3)

    asyncio.run(scenario())


@needs_haproxy
def test_pooled_rejects_after_queue_timeout(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with EchoServers(["s1"]) as echo:
            backend = Backend(
                "be", echo.servers(s1={"maxconn": 1}), "pooled", queue_timeout_seconds=0.2
            )
            config = one_backend(tmp_path, backend)
            async with running(config) as haproxy, aiohttp.ClientSession() as http:
                held = asyncio.create_task(fetch(http, url(config, "/hold")))
                await echo.wait_held(1)
                async with http.get(url(config, "/hold")) as response:
                    assert response.status == 503
                    assert response.content_type == "text/html"  # HAProxy's page, no worker's
                echo.release.set()
                assert (await held)[0] == 200
                assert _row(haproxy.api, "be", "BACKEND").hrsp_5xx == 1

    asyncio.run(scenario())


@needs_haproxy
def test_pooled_bursts_never_exceed_maxconn(tmp_path: Path) -> None:
    """Requests arriving together never share a slot: with several HAProxy threads 2.6 lets two
    of them take the same server's last slot (see the haproxy module)."""
    servers, burst = 4, 8

    async def scenario() -> None:
        async with EchoServers([f"s{i}" for i in range(servers)]) as echo:
            limits = {name: {"maxconn": 1} for name in echo.names}
            config = one_backend(tmp_path, Backend("be", echo.servers(**limits), "pooled"))
            async with running(config) as haproxy, aiohttp.ClientSession() as http:
                for _ in range(25):
                    echo.release.clear()
                    sent = [
                        asyncio.create_task(fetch(http, url(config, "/hold"))) for _ in range(burst)
                    ]
                    # every request of the burst is either held by a worker or queued
                    async with asyncio.timeout(20):
                        while True:
                            rows = haproxy.api.show_stat("be")
                            queued = sum(row.qcur or 0 for row in rows)
                            if sum(echo.held.values()) + queued == burst:
                                break
                            await asyncio.sleep(0.005)
                    assert dict(echo.held) == dict.fromkeys(echo.names, 1)
                    assert {r.svname: r.qcur for r in rows if r.type == "server"} == dict.fromkeys(
                        echo.names, 0
                    )
                    echo.release.set()
                    assert [status for status, _ in await asyncio.gather(*sent)] == [200] * burst
                smax = {r.svname: r.smax for r in haproxy.api.show_stat("be") if r.type == "server"}
                assert smax == dict.fromkeys(echo.names, 1)

    asyncio.run(scenario())


async def _wait_queued(api: RuntimeApi, backend: str, count: int) -> None:
    async with asyncio.timeout(20):
        while _row(api, backend, "BACKEND").qcur != count:
            await asyncio.sleep(0.02)


@needs_haproxy
def test_health_check_takes_a_failing_server_out_and_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with EchoServers(["s1", "s2"]) as echo:
            backend = Backend(
                "be",
                echo.servers(),
                health_check_path="/healthz",
                health_check_interval_seconds=0.05,
            )
            config = one_backend(tmp_path, backend)
            async with running(config) as haproxy, aiohttp.ClientSession() as http:
                echo.unhealthy.add("s2")
                await _wait_status(haproxy.api, "s2", "DOWN")
                assert await where(http, url(config), 6) == {"s1": 6}
                echo.unhealthy.clear()
                await _wait_status(haproxy.api, "s2", "UP")
                assert set(await where(http, url(config), 6)) == {"s1", "s2"}

    asyncio.run(scenario())


async def _wait_status(api: RuntimeApi, server: str, status: str) -> None:
    async with asyncio.timeout(20):
        while _row(api, "be", server).status != status:
            await asyncio.sleep(0.02)


def _row(api: RuntimeApi, proxy: str, svname: str) -> haproxy_module.ServerStat:
    (row,) = [s for s in api.show_stat(proxy) if s.svname == svname]
    return row


@needs_haproxy
def test_runtime_api_sees_sessions_and_moves_traffic(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with EchoServers(["s1", "s2", "s3"]) as echo:
            config = one_backend(tmp_path, Backend("be", echo.servers()), stats_port=free_port())
            async with running(config) as haproxy, aiohttp.ClientSession() as http:
                api = haproxy.api
                hold = asyncio.create_task(fetch(http, url(config, "/hold")))
                await echo.wait_held(1)
                (holder,) = [name for name, n in echo.held.items() if n]
                rows = {s.svname: s for s in api.show_stat("be")}
                assert rows[holder].scur == 1 and rows[holder].stot == 1
                assert rows[holder].type == "server" and rows[holder].status == "no check"
                assert rows["BACKEND"].scur == 1 and rows["BACKEND"].type == "backend"

                api.set_weight("be", "s1", 0)
                assert set(await where(http, url(config), 12)) == {"s2", "s3"}
                api.set_state("be", "s2", "drain")
                assert await where(http, url(config), 6) == {"s3": 6}
                states = {s.server: s for s in api.show_servers_state("be")}
                assert (states["s1"].uweight, states["s1"].iweight) == (0, 100)
                assert [states[s].admin for s in ("s1", "s2", "s3")] == ["ready", "drain", "ready"]
                assert {s.svname: s.status for s in api.show_stat("be")}["s2"] == "DRAIN"

                api.set_state("be", "s3", "maint")
                api.set_state("be", "s2", "ready")
                assert await where(http, url(config), 6) == {"s2": 6}
                assert {s.server: s.admin for s in api.show_servers_state("be")}["s3"] == "maint"

                with pytest.raises(RuntimeApiError, match="No such server"):
                    api.set_weight("be", "s9", 10)
                with pytest.raises(RuntimeApiError, match="No such backend"):
                    api.set_state("be_none", "s1", "drain")
                with pytest.raises(RuntimeApiError, match="No such proxy"):
                    api.show_stat("be_none")
                with pytest.raises(ValueError, match=r"0\.\.256"):
                    api.set_weight("be", "s1", 300)

                async with http.get(f"http://127.0.0.1:{config.stats_port}/metrics") as metrics:
                    assert 'haproxy_server_current_sessions{proxy="be",server="s1"}' in (
                        await metrics.text()
                    )

                echo.release.set()
                assert (await hold)[0] == 200

    asyncio.run(scenario())


@needs_haproxy
def test_haproxy_runs_one_thread(tmp_path: Path) -> None:
    # HAProxy 2.6 overshoots a server's maxconn when two threads take its last slot at once
    config = one_backend(tmp_path, Backend("be", (Server("gpu0", "127.0.0.1", 19000),)))
    with HaproxyProcess(config) as process:
        assert "\nNbthread: 1\n" in process.api.command("show info")


@needs_haproxy
def test_stop_ends_the_process(tmp_path: Path) -> None:
    config = one_backend(tmp_path, Backend("be", (Server("gpu0", "127.0.0.1", 19000),)))
    with HaproxyProcess(config) as process:
        pid = process.pid
        assert "haproxy" in Path(f"/proc/{pid}/cmdline").read_text()
    assert not Path(f"/proc/{pid}").exists()
    assert "Proxy fe stopped" in (tmp_path / "haproxy.log").read_text()
