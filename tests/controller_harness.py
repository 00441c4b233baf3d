"""Test parts for the controller: a real HAProxy over in-process backends, and an analyzer.

The analyzer is the system's edge for the controller: a small aiohttp app serving
`Recommendation`s as the analyzer's API does (a pydantic dump, mode="json") and recording the
acks it is sent. Backends answer their name; `/hold` keeps a request in flight until released,
so "a server has sessions" never depends on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from harness import EchoServers, haproxy_over
from pydantic import TypeAdapter

from gpubalance.children import signal_child
from gpubalance.controller.analyzer_client import AnalyzerClient
from gpubalance.controller.audit import AuditLog
from gpubalance.controller.haproxy import RuntimeApi
from gpubalance.controller.loop import Controller
from gpubalance.controller.metrics import Metrics
from gpubalance.controller.model import Settings
from gpubalance.controller.mover import Mover
from gpubalance.controller.runtime_actuator import RuntimeApiActuator
from gpubalance.controller.supervisor import MARK, WorkersConfig, WorkerSupervisor, wait_ready
from gpubalance.controller.worker_backends import supervisor_for
from gpubalance.diagnosis import Ack, Recommendation
from gpubalance.lab.live.haproxy import (
    APT_INSTALL,
    Backend,
    Frontend,
    HaproxyConfig,
    HaproxyNotFoundError,
    HaproxyProcess,
    Server,
    find_haproxy,
)
from gpubalance.lab.live.ports import free_port
from gpubalance.webconfig import INHERITED_LISTENER

TOKEN = "s3cret-token"
_ADAPTER: TypeAdapter[list[Recommendation]] = TypeAdapter(list[Recommendation])


def haproxy_installed() -> bool:
    try:
        find_haproxy()
    except HaproxyNotFoundError:
        return False
    return True


needs_haproxy = [
    pytest.mark.haproxy,
    pytest.mark.skipif(
        not haproxy_installed(), reason=f"haproxy is not installed; install it with: {APT_INSTALL}"
    ),
]


def recommendation(
    rec_id: str,
    action: str,
    target: str,
    parameters: Mapping[str, object] | None = None,
    *,
    cost_rank: int = 0,
    age_seconds: float = 1.0,
    ttl_seconds: float = 600.0,
) -> Recommendation:
    now = time.time()
    return Recommendation(
        id=rec_id,
        action=action,  # type: ignore[arg-type]
        host="h1",
        target=target,
        parameters=parameters or {},
        reason="test",
        evidence=("queue 14 vs peer median 0",),
        confidence=0.9,
        created_seconds=now - age_seconds,
        expires_seconds=now + ttl_seconds,
        cost_rank=cost_rank,
    )


@dataclass
class Analyzer:
    """The analyzer's API: GET recommendations, POST acks (bearer token required)."""

    recommendations: list[Recommendation] = field(default_factory=list)
    acks: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    broken: bool = False  # answer 500, as an analyzer in trouble would
    _runner: web.AppRunner | None = None

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {TOKEN}"

    async def _list(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(status=401)
        if self.broken:
            return web.Response(status=500, text="model not loaded")
        body = _ADAPTER.dump_json(self.recommendations)
        return web.Response(body=body, content_type="application/json")

    async def _ack(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(status=401)
        body = await request.json()
        rec_id = request.match_info["id"]
        self.acks.append({"id": rec_id, **body})
        # listed with its acks from now on, as the analyzer lists them
        ack = Ack(body["status"], body["reason"], body["by"], time.time())
        self.recommendations = [
            replace(r, acks=(*r.acks, ack)) if r.id == rec_id else r for r in self.recommendations
        ]
        return web.Response(status=204)

    def acks_of(self, rec_id: str) -> list[tuple[str, str]]:
        return [(a["status"], a["reason"]) for a in self.acks if a["id"] == rec_id]

    async def __aenter__(self) -> Analyzer:
        app = web.Application()
        app.router.add_get("/api/v1/recommendations", self._list)
        app.router.add_post("/api/v1/recommendations/{id}/ack", self._ack)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


class Backends(EchoServers):
    """Echo servers behind the HAProxy a controller test drives."""

    def config(self, run_dir: Path, backend: str = "be") -> HaproxyConfig:
        servers = tuple(Server(n, "127.0.0.1", self.ports[n]) for n in self.names)
        return HaproxyConfig(
            frontends=(Frontend("fe", free_port(), backend),),
            backends=(Backend(backend, servers),),
            run_dir=run_dir,
        )


# settings for tests: act, one pass of dwell, a large step
FAST = Settings(act=True, dwell_cycles=1, max_weight_step=256, interval_seconds=0.05)


def make_controller(
    socket_path: Path,
    analyzer_url: str,
    session: Any,
    audit_path: Path,
    settings: Settings = FAST,
    actuator: Any = None,
) -> Controller:
    api = RuntimeApi(socket_path, timeout_seconds=2.0)
    return Controller(
        api,
        actuator if actuator is not None else RuntimeApiActuator(api),
        AnalyzerClient(analyzer_url, session, token=TOKEN),
        AuditLog(audit_path),
        Metrics(),
        settings,
    )


def acting_args(analyzer_url: str, socket_path: Path, tmp_path: Path, port: int) -> list[str]:
    """`gpubalance controller` acting on HAProxy's socket every 0.1 s, listening on ``port``,
    with the test token (written to tmp_path/token) and the audit log tmp_path/audit.jsonl."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return [
        *("--analyzer", analyzer_url, "--haproxy-socket", str(socket_path), "--act"),
        *("--listen", f"127.0.0.1:{port}", "--token-file", str(token)),
        *("--audit-log", str(tmp_path / "audit.jsonl"), "--interval", "0.1"),
    ]


@contextlib.contextmanager
def held_listener() -> Iterator[socket.socket]:
    """A socket listening on a port of 127.0.0.1, held by the test and handed to each
    controller it starts there (:func:`handing`), as `gpubalance run` hands each part its own:
    a port only chosen free can be taken by another process (an outgoing connection, a test
    beside this one) before the controller binds it, or between a controller's exit and its
    restart; a held one stays the controller's. Connections made while no controller serves
    it wait in its backlog."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        yield sock


def port_of(listener: socket.socket) -> int:
    return int(listener.getsockname()[1])


def handing(listener: socket.socket | None, env: Mapping[str, str] = {}) -> dict[str, Any]:
    """The keywords that start a controller process with ``env`` over this process's
    environment, handed ``listener`` (its descriptor, named in INHERITED_LISTENER)."""
    if listener is None:
        return {"env": {**os.environ, "PYTHONUNBUFFERED": "1", **env}}
    handed = {INHERITED_LISTENER: str(listener.fileno())}
    return {
        "env": {**os.environ, "PYTHONUNBUFFERED": "1", **env, **handed},
        "pass_fds": (listener.fileno(),),
    }


async def start_command(
    *args: str, env: Mapping[str, str] = {}, listener: socket.socket | None = None
) -> asyncio.subprocess.Process:
    """`gpubalance controller ARGS` with ``env`` over this process's environment, serving on
    ``listener`` where one is given (its ``--listen`` must name the listener's port)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpubalance",
        "controller",
        *args,
        stderr=asyncio.subprocess.PIPE,
        **handing(listener, env),
    )


async def stop_command(process: asyncio.subprocess.Process) -> bytes:
    """SIGTERM (unless it exited) and its stderr once it has."""
    signal_child(process, signal.SIGTERM)
    async with asyncio.timeout(30):
        _, err = await process.communicate()
    return err


def weights(api: RuntimeApi, backend: str = "be") -> dict[str, tuple[int, str]]:
    return {s.server: (s.uweight, s.admin) for s in api.show_servers_state(backend)}


SERVE_WORKER = str(Path(__file__).parent / "controller" / "serve_worker.py")


def lane() -> str:
    """This pytest-xdist worker's name (gw0 outside xdist)."""
    return os.environ.get("PYTEST_XDIST_WORKER", "gw0")


def run_id() -> str:
    """This pytest run's id, the same in each of its xdist workers (the main process's pid
    outside xdist): two runs on one machine (two clones' `make test`) tell their workers apart."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID", "")[:8] or str(os.getpid())


def lane_mark() -> str:
    """The start of the supervisor instance of each worker this lane's tests start: the
    cleanup after each test kills what it finds under it, and only that (before it named the
    lane alone, so a run's cleanup killed the workers of another run's lane of the same name)."""
    return f"t-{run_id()}-{lane()}-"


def lane_ports() -> tuple[int, int]:
    """The worker ports of this pytest-xdist worker's tests: a supervisor takes the first port
    of its range that nothing holds, so two tests started side by side on one range can both
    take it before either worker binds it (seen: a worker exiting at start-up). The lanes of
    one run get blocks of their own; another run on the machine most likely other blocks."""
    run = int(hashlib.sha1(run_id().encode()).hexdigest(), 16) % 10
    first = 20000 + 200 * (5 * run + int(lane().removeprefix("gw") or 0) % 5)
    return first, first + 199


def marked_processes(key: str, prefix: str) -> dict[int, dict[bytes, bytes]]:
    """pid -> environment of every process whose environment has ``key`` with a value that
    starts with ``prefix``: a test's own processes, found by what it gave them, never by a pid
    it once saw (pids are reused, the more so on a host whose pid_max is 32768)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.partition(b"=")[::2] for item in raw.split(b"\0") if item)
        if key.encode() in env and env[key.encode()].decode().startswith(prefix):
            found[int(entry.name)] = env
    return found


def kill_groups(pids: Iterable[int], timeout_seconds: float = 10.0) -> None:
    """SIGKILL the process group of each of ``pids`` (never the caller's) and wait until each
    has exited."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group != os.getpgrp():  # a worker runs in a session of its own; never ours
                os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + timeout_seconds
    for pid in pids:
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.01)


def kill_workers(instance_prefix: str, timeout_seconds: float = 10.0) -> list[str]:
    """SIGKILL the process group of every worker whose supervisor instance starts with
    ``instance_prefix`` and wait until each has exited (its port free again); what each was.

    A worker that outlives its test holds its port into the next test, whose supervisor may
    give that port out while the survivor still loads (it binds only then): the next test's
    worker exits at start-up, or a health check meant for it is answered by the survivor."""
    found = {
        pid: (
            f"pid {pid} of {env[MARK.encode()].decode()}: GPU {env[b'GPUBALANCE_GPU'].decode()}, "
            f"{env[b'GPUBALANCE_POOL'].decode()}, port {env[b'GPUBALANCE_PORT'].decode()}"
        )
        for pid, env in marked_processes(MARK, instance_prefix).items()
        if b"GPUBALANCE_PORT" in env
    }
    kill_groups(found, timeout_seconds)
    return sorted(found.values())


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no port)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def workers_config(
    state_dir: Path,
    *,
    load_seconds: float = 0.1,
    fail_on: str | None = None,
    instance: str | None = None,
    gpus: tuple[int, ...] = (0, 1, 2),
    **fields: Any,
) -> WorkersConfig:
    """Workers of serve_worker.py (the lab's live worker), after `load_seconds` of model load;
    by default marked as this test's own (its state directory's), apart from any other test's."""
    command = [sys.executable, SERVE_WORKER, "--port", "{port}", "--pool", "{pool}"]
    command += ["--locks", str(state_dir / "locks"), "--load-seconds", str(load_seconds)]
    if fail_on is not None:
        command += ["--fail-on", fail_on]  # GPU:POOL, whose worker exits as it loads
    settings: dict[str, Any] = {
        "ready_timeout_seconds": 60.0,
        "stop_timeout_seconds": 10.0,
        "ports": lane_ports(),
    }
    return WorkersConfig(
        command=tuple(command),
        gpus=gpus,
        # this lane's, so that what a test leaves running is found (tests/controller/conftest.py)
        instance=instance or lane_mark() + hashlib.sha1(str(state_dir).encode()).hexdigest()[:12],
        state_dir=state_dir,
        **{**settings, **fields},
    )


@dataclass
class Pools:
    """Workers on GPUs 0 and 1 serving be_a, on GPU 2 serving be_b, behind a real HAProxy that
    routes `X-Class: a` and `b` to them; the workers are the supervisor's, servers `gpu{N}`."""

    supervisor: WorkerSupervisor
    haproxy: HaproxyProcess
    config: HaproxyConfig

    @property
    def api(self) -> RuntimeApi:
        return self.haproxy.api

    @property
    def port(self) -> int:
        return self.haproxy.config.frontends[0].port

    def placement(self) -> dict[str, list[tuple[str, str, bool]]]:
        """Backend -> (server, admin, up) of each of its servers, as HAProxy shows them."""
        stats = {(s.pxname, s.svname): s.status for s in self.api.show_stat()}
        found: dict[str, list[tuple[str, str, bool]]] = {"be_a": [], "be_b": []}
        for s in self.api.show_servers_state():
            up = s.op_state == 2 and not stats.get((s.backend, s.server), "").startswith("DOWN")
            found[s.backend].append((s.server, s.admin, up))
        return {backend: sorted(servers) for backend, servers in found.items()}

    def serving(self) -> dict[str, int]:
        """Backend -> how many of its servers take requests now."""
        return {
            backend: sum(1 for _, admin, up in servers if admin == "ready" and up)
            for backend, servers in self.placement().items()
        }


PLACEMENT = {0: "be_a", 1: "be_a", 2: "be_b"}


@contextlib.asynccontextmanager
async def pools(
    run_dir: Path, workers: WorkersConfig, http: Any, placement: Mapping[int, str] = PLACEMENT
) -> AsyncIterator[Pools]:
    supervisor = supervisor_for(workers)
    started = [supervisor.start(gpu, pool) for gpu, pool in placement.items()]
    try:
        ready = [await wait_ready(supervisor, http, w.gpu) for w in started]
        backends = tuple(
            Backend(
                pool,
                tuple(
                    Server(workers.server_of(w.gpu), w.host, w.port)
                    for w in ready
                    if w.pool == pool
                ),
                health_check_path=workers.health_path,
                # a dead worker is out within 0.6 s (its port refuses); a slow answer on a
                # loaded machine is not a dead worker
                health_check_interval_seconds=0.2,
                health_check_timeout_seconds=2.0,
            )
            for pool in sorted(set(placement.values()))
        )
        config = HaproxyConfig(
            frontends=(Frontend("fe", free_port(), "be_a", routes={"a": "be_a", "b": "be_b"}),),
            backends=backends,
            run_dir=run_dir,
        )
        async with haproxy_over(config) as haproxy:
            yield Pools(supervisor, haproxy, config)
    finally:
        # every worker of this supervisor, the ones a move started too, gone before the next
        await asyncio.to_thread(kill_workers, workers.instance)


def make_mover_controller(
    rig: Pools,
    analyzer_url: str,
    http: Any,
    audit_path: Path,
    settings: Settings = FAST,
) -> Controller:
    audit = AuditLog(audit_path)
    metrics = Metrics()
    api = RuntimeApi(rig.config.socket_path, timeout_seconds=2.0)
    actuator = RuntimeApiActuator(api)
    mover = Mover(supervisor_for(rig.supervisor.config), actuator, audit, metrics, settings, http)
    return Controller(
        api,
        actuator,
        AnalyzerClient(analyzer_url, http, token=TOKEN),
        audit,
        metrics,
        settings,
        mover=mover,
    )


async def run_until_moved(controller: Controller, limit_seconds: float = 60.0) -> None:
    """Passes, as the loop runs them, until no move is in flight and none is waiting."""
    assert controller.mover is not None
    async with asyncio.timeout(limit_seconds):
        while True:
            await controller.run_once()
            if controller.mover.in_flight() is None and not controller.mover.approved:
                return
            await asyncio.sleep(controller.settings.interval_seconds)


def move_log(audit_path: Path) -> list[tuple[str, str, str]]:
    """(decision, phase, action) of each move entry in the audit log, in order."""
    return [
        (e["decision"], e.get("phase", ""), e["action"])
        for e in AuditLog(audit_path).entries()
        if "move" in e
    ]


@dataclass
class SteadyLoad:
    """Requests at a steady rate per class through HAProxy's frontend, counted at the client:
    each request sent ends answered (200 from a worker) or failed, with the reason."""

    port: int
    per_second: float  # per class
    classes: tuple[str, ...] = ("a", "b")
    sent: int = 0
    answered: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self, stop: asyncio.Event) -> None:
        """Send until `stop` is set, then wait for every answer."""
        period = 1.0 / (self.per_second * len(self.classes))
        url = f"http://127.0.0.1:{self.port}/infer"
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            due = time.monotonic()
            while not stop.is_set():
                cls = self.classes[self.sent % len(self.classes)]
                task = asyncio.create_task(self._one(http, url, self.sent, cls))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                self.sent += 1
                due += period
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            await asyncio.gather(*self._tasks)

    async def _one(self, http: aiohttp.ClientSession, url: str, rid: int, cls: str) -> None:
        body = {"id": rid, "prompt_tokens": 100, "output_tokens": 10}
        try:
            async with http.post(url, json=body, headers={"X-Class": cls}) as resp:
                reply = await resp.text()
                if resp.status == 200:
                    self.answered += 1
                else:
                    self.failures[f"HTTP {resp.status}: {reply.strip()[:80]}"] += 1
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self.failures[type(exc).__name__] += 1
