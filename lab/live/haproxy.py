"""HAProxy in front of worker processes: its configuration and its process.

The lab's live speed renders a config from plain dataclasses, runs `haproxy -db` in the
foreground (so the PID is ours to stop), and drives it through the runtime socket with the
controller's client, `gpubalance.controller.haproxy.RuntimeApi`, the one the controller uses
on a production HAProxy.

Verified against HAProxy 2.6 (Debian bookworm); see docs/reference/balancing.md §4.

HAProxy runs one thread (`nbthread 1`). A server's `maxconn` is one counter shared by all
threads, but HAProxy 2.6 reads it and takes the slot in two steps (`assign_server_and_queue()`
in src/backend.c); two threads can both see the last free slot, so a `maxconn 1` server takes
two requests at once, or the loser waits in that server's own queue instead of the backend's.
HAProxy 3.x takes the slot with one compare-and-swap. One thread keeps the slot count exact and
carries far more requests than the lab sends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self, get_args

# the runtime client lives with the controller, which runs on real hosts; one copy, and the
# lab's callers keep importing its names from here
from gpubalance.controller.haproxy import (
    HEADER_NAME,
    HTTP_PATH,
    MAX_WEIGHT,
    HaproxyError,
    RuntimeApi,
    RuntimeApiError,
    check_name,
)
from gpubalance.controller.haproxy import ServerStat as ServerStat
from gpubalance.lab.live.ports import PortTakenError, free_port, on_a_free_port, says_port_taken

APT_INSTALL = "sudo apt-get install haproxy"

Policy = Literal["round_robin", "least_connections", "random_of_2", "sticky", "pooled"]
POLICIES: tuple[str, ...] = get_args(Policy)

# The persistence cookie of `sticky` backends; a client that sends `SERVERID=<cookie>` is pinned
STICKY_COOKIE = "SERVERID"

STATS_FRONTEND = "stats"

# what a pooled backend's 429 (its queue at max_queue) tells the client to wait
RETRY_AFTER_SECONDS = 1

_BALANCE: dict[str, str] = {
    "round_robin": "roundrobin",
    "least_connections": "leastconn",
    "random_of_2": "random(2)",
    # without a cookie a sticky backend falls back to plain round robin
    "sticky": "roundrobin",
    # a request takes the free slot of the least busy server, so slots fill evenly; with
    # every server at maxconn it waits in the backend queue
    "pooled": "leastconn",
}


# the backend the lab writes for a pool's workers is its name with this before it
BACKEND_PREFIX = "be_"


def pool_backend(pool: str) -> str:
    """The HAProxy backend of a lab pool's workers."""
    return BACKEND_PREFIX + pool


def backend_pool(backend: str) -> str:
    """The lab pool whose workers a :func:`pool_backend` backend holds."""
    return backend.removeprefix(BACKEND_PREFIX)


def stat_algorithm(policy: str) -> str:
    """The balance algorithm `show stat` reports (its `algo` column) for a backend of a lab
    router policy: weighted round robin is HAProxy's roundrobin with weights."""
    return _BALANCE.get(policy, "roundrobin").split("(")[0]


# sun_path is 108 bytes including the terminating NUL
_MAX_SOCKET_PATH = 107


class HaproxyPortTakenError(HaproxyError, PortTakenError):
    """A frontend's port was taken when HAProxy bound it: start it again on another."""


class HaproxyNotFoundError(HaproxyError):
    """The haproxy binary is not installed."""


def _duration(seconds: float) -> str:
    """Seconds as an HAProxy time, whole seconds when exact so the config stays readable."""
    ms = round(seconds * 1000)
    if ms < 1:
        raise ValueError(f"timeout {seconds!r} s is below HAProxy's 1 ms resolution")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


@dataclass(frozen=True, slots=True)
class Server:
    """One worker behind a backend."""

    name: str
    host: str
    port: int
    weight: int = 100  # 0..256; relative share under round robin, 0 takes no new requests
    maxconn: int | None = None  # requests in flight at once; more wait in the backend queue
    cookie: str | None = None  # sticky cookie value; sticky backends default it to the name
    disabled: bool = False  # starts in maint (`disabled`) until the runtime API readies it

    def __post_init__(self) -> None:
        check_name("server name", self.name)
        if not self.host or any(c.isspace() for c in self.host):
            raise ValueError(f"server {self.name}: host {self.host!r} is empty or has spaces")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"server {self.name}: port {self.port} is outside 1..65535")
        if not 0 <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"server {self.name}: weight {self.weight} is outside 0..256")
        if self.maxconn is not None and self.maxconn < 1:
            raise ValueError(f"server {self.name}: maxconn must be at least 1")
        if self.cookie is not None:
            check_name(f"server {self.name} cookie", self.cookie)


@dataclass(frozen=True, slots=True)
class Backend:
    """A pool of servers and the policy that picks one per request.

    - `round_robin`: in turn, in proportion to the weights (weighted round robin);
    - `least_connections`: the server with the fewest requests in flight per unit of weight;
    - `random_of_2`: the less busy of two servers drawn at random (power of two choices);
    - `sticky`: the server named by the client's `SERVERID` cookie (`Backend.cookie_of`), round
      robin for requests without one; HAProxy sets no cookie, the client owns the assignment;
    - `pooled`: one central queue: each server takes at most `maxconn` requests (its
      concurrency), the rest wait in the backend queue for the first free slot. Classes that
      share workers share one backend (`Frontend.routes` maps each class to it), so they share
      the workers' slots and one queue, first come first served; `HaproxyConfig` refuses a
      worker with `maxconn` in two backends, where HAProxy would count its slots twice.

    Under any policy a request that waits in a queue longer than `queue_timeout_seconds` gets
    HAProxy's own 503; only servers with `maxconn` make requests wait. With `max_queue` (pooled),
    a request that finds that many waiting is answered 429 at once, with `Retry-After` (an
    `http-request deny`, counted in the backend's `dreq`), as `gpubalance deploy haproxy`'s
    admission control does.

    With `health_check_path`, HAProxy sends `GET <path>` to every server each
    `health_check_interval_seconds`: 3 failures in a row take a server out (status DOWN), 2
    successes bring it back (HAProxy's defaults). A check fails when no answer comes within
    the interval, or within `health_check_timeout_seconds` once the connection is made when
    that is set (`timeout check`): a short interval finds a dead server soon (its port refuses
    at once), a longer timeout keeps a busy one that answers slowly. Without a path a dead
    server keeps its share and its requests get HAProxy's 503.
    """

    name: str
    servers: tuple[Server, ...]
    policy: Policy = "round_robin"
    queue_timeout_seconds: float = 30.0
    health_check_path: str | None = None
    health_check_interval_seconds: float = 1.0
    health_check_timeout_seconds: float | None = None
    max_queue: int | None = None

    def __post_init__(self) -> None:
        check_name("backend name", self.name)
        if self.policy not in POLICIES:
            raise ValueError(
                f"backend {self.name}: policy {self.policy!r} is not one of {', '.join(POLICIES)}"
            )
        if not self.servers:
            raise ValueError(f"backend {self.name}: give it at least one server")
        names = [server.name for server in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"backend {self.name}: server names repeat: {names}")
        _duration(self.queue_timeout_seconds)
        _duration(self.health_check_interval_seconds)
        if self.health_check_timeout_seconds is not None:
            _duration(self.health_check_timeout_seconds)
        if self.health_check_path is not None and not HTTP_PATH.fullmatch(self.health_check_path):
            raise ValueError(
                f"backend {self.name}: health_check_path {self.health_check_path!r} must start "
                "with '/' and hold no spaces"
            )
        if self.policy == "pooled":
            missing = [server.name for server in self.servers if server.maxconn is None]
            if missing:
                raise ValueError(
                    f"backend {self.name}: pooled needs maxconn (the worker's concurrency) "
                    f"on every server; missing on {', '.join(missing)}"
                )
        if self.max_queue is not None and (self.policy != "pooled" or self.max_queue < 1):
            raise ValueError(
                f"backend {self.name}: max_queue {self.max_queue} bounds a pooled backend's "
                "queue: 1 or more, with policy pooled"
            )
        if self.policy == "sticky":
            cookies = [self.cookie_of(server) for server in self.servers]
            if len(set(cookies)) != len(cookies):
                raise ValueError(f"backend {self.name}: sticky cookie values repeat: {cookies}")

    def cookie_of(self, server: Server) -> str:
        """The `SERVERID` value that pins a request to `server` in a sticky backend."""
        return server.cookie if server.cookie is not None else server.name


@dataclass(frozen=True, slots=True)
class Frontend:
    """A listening port that routes by one request header, e.g. `X-Class: batch` → `be_batch`."""

    name: str
    port: int
    default_backend: str
    routes: Mapping[str, str] = field(default_factory=dict)  # header value → backend name
    header: str = "X-Class"
    # header value → backend, taken before `routes` while the backend has a usable server
    # (`nbsrv`): a pool's batch backend, whose servers a controller's split readies
    routes_while_up: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        check_name("frontend name", self.name)
        if self.name == STATS_FRONTEND:
            raise ValueError(f"frontend name {STATS_FRONTEND!r} is reserved for the stats port")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"frontend {self.name}: port {self.port} is outside 1..65535")
        if not HEADER_NAME.fullmatch(self.header):
            raise ValueError(f"frontend {self.name}: header {self.header!r} is not a header name")
        for value in (*self.routes, *self.routes_while_up):
            check_name(f"frontend {self.name} {self.header} value", value)


@dataclass(frozen=True, slots=True)
class HaproxyConfig:
    """Everything `render` turns into a config file.

    The runtime socket lives in `run_dir` (admin level: it can change weights and states);
    `stats_port`, when set, serves Prometheus metrics on /metrics and the stats page on /stats.
    """

    frontends: tuple[Frontend, ...]
    backends: tuple[Backend, ...]
    run_dir: Path
    stats_port: int | None = None
    stats_host: str = "127.0.0.1"
    maxconn: int = 4096  # whole process; the load generator may hold thousands of connections
    connect_timeout_seconds: float = 5.0
    client_timeout_seconds: float = 120.0
    server_timeout_seconds: float = 120.0

    def __post_init__(self) -> None:
        if not self.frontends:
            raise ValueError("give HAProxy at least one frontend")
        for kind, names in (
            ("frontend", [f.name for f in self.frontends]),
            ("backend", [b.name for b in self.backends]),
        ):
            if len(set(names)) != len(names):
                raise ValueError(f"{kind} names repeat: {names}")
        known = {backend.name for backend in self.backends}
        for frontend in self.frontends:
            targets = (*frontend.routes.values(), *frontend.routes_while_up.values())
            for target in (frontend.default_backend, *targets):
                if target not in known:
                    raise ValueError(
                        f"frontend {frontend.name} routes to backend {target!r}, "
                        f"which is not among {sorted(known)}"
                    )
        _check_slots_shared(self.backends)
        ports = [f.port for f in self.frontends]
        if self.stats_port is not None:
            ports.append(self.stats_port)
        if len(set(ports)) != len(ports):
            raise ValueError(f"listening ports repeat: {ports}")
        if len(os.fsencode(self.socket_path)) > _MAX_SOCKET_PATH:
            raise ValueError(
                f"runtime socket path {self.socket_path} is longer than {_MAX_SOCKET_PATH} "
                "bytes, the limit of a unix socket; choose a shorter run_dir"
            )
        for seconds in (
            self.connect_timeout_seconds,
            self.client_timeout_seconds,
            self.server_timeout_seconds,
        ):
            _duration(seconds)

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "haproxy.sock"


def _check_slots_shared(backends: tuple[Backend, ...]) -> None:
    """A worker's `maxconn` is its concurrency, whatever backend a request came through.

    HAProxy counts `maxconn` per server line, and a worker listed in two backends is two server
    lines: it would take `maxconn` requests from each.
    """
    seen: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for backend in backends:
        for server in backend.servers:
            if server.maxconn is not None:
                seen.setdefault((server.host, server.port), []).append(
                    (backend.name, server.maxconn)
                )
    for (host, port), uses in seen.items():
        if len(uses) > 1:
            raise ValueError(
                f"worker {host}:{port} has maxconn in backends "
                f"{', '.join(name for name, _ in uses)}: HAProxy counts maxconn per backend, so "
                f"it would take up to {sum(n for _, n in uses)} requests at once; route those "
                "classes to one backend (Frontend.routes) so they share its slots"
            )


def render(config: HaproxyConfig) -> str:
    """The HAProxy config text: the same config always gives the same text."""
    lines = [
        "# Generated by gpubalance.lab.live.haproxy; change the HaproxyConfig, not this file.",
        "global",
        f"    stats socket {config.socket_path} mode 600 level admin",
        f"    maxconn {config.maxconn}",
        # a server's maxconn holds exactly with one thread only (see the module docstring)
        "    nbthread 1",
        "",
        "defaults",
        "    mode http",
        # a connection refused by a dead server is retried on another one: a crashed worker
        # costs the requests it held, not the ones sent after
        "    option redispatch",
        "    retries 2",
        f"    timeout connect {_duration(config.connect_timeout_seconds)}",
        f"    timeout client {_duration(config.client_timeout_seconds)}",
        f"    timeout server {_duration(config.server_timeout_seconds)}",
    ]
    for frontend in config.frontends:
        lines += ["", f"frontend {frontend.name}", f"    bind {frontend.host}:{frontend.port}"]
        lines += [
            f"    use_backend {backend} if {{ req.hdr({frontend.header}) -m str {value} }} "
            f"{{ nbsrv({backend}) gt 0 }}"
            for value, backend in frontend.routes_while_up.items()
        ]
        lines += [
            f"    use_backend {backend} if {{ req.hdr({frontend.header}) -m str {value} }}"
            for value, backend in frontend.routes.items()
        ]
        lines.append(f"    default_backend {frontend.default_backend}")
    for backend in config.backends:
        lines += [
            "",
            f"backend {backend.name}",
            f"    balance {_BALANCE[backend.policy]}",
            f"    timeout queue {_duration(backend.queue_timeout_seconds)}",
        ]
        if backend.max_queue is not None:
            lines.append(
                f"    http-request deny deny_status 429 hdr Retry-After {RETRY_AFTER_SECONDS} "
                f"if {{ queue ge {backend.max_queue} }}"
            )
        if backend.policy == "sticky":
            lines.append(f"    cookie {STICKY_COOKIE} indirect nocache")
        if backend.health_check_path is not None:
            lines.append(f"    option httpchk GET {backend.health_check_path}")
            if backend.health_check_timeout_seconds is not None:
                lines.append(f"    timeout check {_duration(backend.health_check_timeout_seconds)}")
        for server in backend.servers:
            line = f"    server {server.name} {server.host}:{server.port} weight {server.weight}"
            if server.maxconn is not None:
                line += f" maxconn {server.maxconn}"
            if backend.policy == "sticky":
                line += f" cookie {backend.cookie_of(server)}"
            if backend.health_check_path is not None:
                line += f" check inter {_duration(backend.health_check_interval_seconds)}"
            if server.disabled:
                line += " disabled"
            lines.append(line)
    if config.stats_port is not None:
        lines += [
            "",
            f"frontend {STATS_FRONTEND}",
            f"    bind {config.stats_host}:{config.stats_port}",
            "    http-request use-service prometheus-exporter if { path /metrics }",
            "    stats enable",
            "    stats uri /stats",
        ]
    return "\n".join(lines) + "\n"


def find_haproxy() -> str:
    """Path of the haproxy binary; /usr/sbin is searched too, as it is off a user's PATH."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise HaproxyNotFoundError(f"haproxy is not installed; install it with: {APT_INSTALL}")
    return found


def check(path: str | Path, *, binary: str | None = None) -> None:
    """Run `haproxy -c` on a config file; raise with HAProxy's own message when it is invalid."""
    result = subprocess.run(
        [binary or find_haproxy(), "-c", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if result.returncode != 0:
        raise HaproxyError(f"HAProxy rejects {path}:\n{(result.stdout + result.stderr).strip()}")


class HaproxyRun:
    """`haproxy -db` on a config's text, as a context manager.

    `start` writes `haproxy.cfg` (``text``) into ``run_dir``, starts HAProxy in the foreground
    with its output in `haproxy.log`, and returns once its runtime socket (``socket_path``, the
    config's `stats socket`) answers and every frontend port (``ports``) accepts. `stop`
    soft-stops (SIGUSR1: finish requests in flight), then SIGTERM, then SIGKILL.
    """

    def __init__(
        self,
        text: str,
        run_dir: Path,
        socket_path: Path,
        ports: Sequence[tuple[str, int]],
        *,
        binary: str | None = None,
        start_timeout_seconds: float = 15.0,
        stop_timeout_seconds: float = 10.0,
    ) -> None:
        self.text = text
        self.run_dir = run_dir
        self.socket_path = socket_path
        self.ports = tuple(ports)
        self.binary = binary
        self.start_timeout_seconds = start_timeout_seconds
        self.stop_timeout_seconds = stop_timeout_seconds
        self.config_path = run_dir / "haproxy.cfg"
        self.log_path = run_dir / "haproxy.log"
        self.api = RuntimeApi(socket_path)
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise HaproxyError("HAProxy is not running; call start() first")
        return self._process.pid

    def start(self) -> None:
        if self._process is not None:
            raise HaproxyError(f"HAProxy already runs as PID {self._process.pid}; stop() it first")
        binary = self.binary or find_haproxy()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.text)
        self._log = self.log_path.open("wb")
        # own session: a Ctrl-C aimed at the lab reaches HAProxy through stop(), not directly
        self._process = subprocess.Popen(
            [binary, "-db", "-f", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout_seconds
        ports = self.ports
        while True:
            code = self._process.poll()
            if code is not None:
                said = self._log_tail()
                kind = HaproxyPortTakenError if says_port_taken(said) else HaproxyError
                raise kind(
                    f"HAProxy exited with code {code} at start; from {self.log_path}:\n{said}"
                )
            if self._answers() and all(_accepts(host, port) for host, port in ports):
                return
            if time.monotonic() > deadline:
                raise HaproxyError(
                    f"HAProxy did not become ready within {self.start_timeout_seconds} s "
                    f"(runtime socket {self.socket_path}, ports {ports}); "
                    f"from {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.02)

    def _answers(self) -> bool:
        """The runtime socket is up and belongs to our process, not to an earlier run."""
        try:
            info = self.api.command("show info")
        except RuntimeApiError:
            return False
        return f"\nPid: {self.pid}\n" in info

    def _log_tail(self, lines: int = 30) -> str:
        assert self._log is not None
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Stop HAProxy if it runs; safe to call more than once."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            for sig, wait_seconds in (
                (signal.SIGUSR1, self.stop_timeout_seconds),
                (signal.SIGTERM, 5.0),
                (signal.SIGKILL, None),
            ):
                process.send_signal(sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(wait_seconds)
                    break
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class HaproxyProcess(HaproxyRun):
    """:class:`HaproxyRun` on the config :func:`render` writes of ``config``."""

    def __init__(
        self,
        config: HaproxyConfig,
        *,
        binary: str | None = None,
        start_timeout_seconds: float = 15.0,
        stop_timeout_seconds: float = 10.0,
    ) -> None:
        super().__init__(
            render(config),
            config.run_dir,
            config.socket_path,
            [(f.host, f.port) for f in config.frontends],
            binary=binary,
            start_timeout_seconds=start_timeout_seconds,
            stop_timeout_seconds=stop_timeout_seconds,
        )
        self.config = config


def start_on_free_ports(config: HaproxyConfig) -> HaproxyProcess:
    """HAProxy started on ``config``. Its ports were free when chosen, but another process can
    bind one before HAProxy does (tests side by side): then it starts again with every port
    chosen anew; the one it runs with is the returned process's ``config``."""

    def start(port: int) -> HaproxyProcess:
        nonlocal config
        if port != config.frontends[0].port:  # a later try
            others = [replace(f, port=free_port()) for f in config.frontends[1:]]
            config = replace(
                config,
                frontends=(replace(config.frontends[0], port=port), *others),
                stats_port=None if config.stats_port is None else free_port(),
            )
        process = HaproxyProcess(config)
        process.start()
        return process

    return on_a_free_port(start, first=config.frontends[0].port)


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False
