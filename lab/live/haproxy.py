"""HAProxy in front of worker processes: its configuration, its process and its runtime API.

The lab's live speed renders a config from plain dataclasses, runs `haproxy -db` in the
foreground (so the PID is ours to stop), and drives it through the runtime socket; the
controller later uses the same `RuntimeApi` on a production HAProxy. Nothing here imports the
rest of the lab, so the module can move out of it as is.

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
import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, get_args

APT_INSTALL = "sudo apt-get install haproxy"

Policy = Literal["round_robin", "least_connections", "random_of_2", "sticky", "pooled"]
POLICIES: tuple[str, ...] = get_args(Policy)

AdminState = Literal["ready", "drain", "maint"]
ADMIN_STATES: tuple[str, ...] = get_args(AdminState)

# The persistence cookie of `sticky` backends; a client that sends `SERVERID=<cookie>` is pinned
STICKY_COOKIE = "SERVERID"

STATS_FRONTEND = "stats"

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

# HAProxy names (proxies, servers, cookie values) and header values used in ACLs: anything
# wider would need quoting in the config and on the runtime CLI
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_HEADER = re.compile(r"[A-Za-z0-9-]+")
_PATH = re.compile(r"/[!-~]*")  # printable, no spaces: one token on the `option httpchk` line
_MAX_WEIGHT = 256
# sun_path is 108 bytes including the terminating NUL
_MAX_SOCKET_PATH = 107

# srv_admin_state bits (HAProxy include/haproxy/server-t.h, SRV_ADMF_*)
_ADMIN_MAINT = 0x01 | 0x02 | 0x04 | 0x20 | 0x40  # forced, inherited, config, DNS, hostname
_ADMIN_DRAIN = 0x08 | 0x10  # forced, inherited

_STAT_TYPES = {"0": "frontend", "1": "backend", "2": "server", "3": "listener"}


class HaproxyError(RuntimeError):
    """HAProxy rejected a config, failed to start, or refused a runtime command."""


class HaproxyNotFoundError(HaproxyError):
    """The haproxy binary is not installed."""


class RuntimeApiError(HaproxyError):
    """The runtime socket is unreachable or HAProxy answered a command with an error."""


def _check_name(kind: str, value: str) -> None:
    if not _NAME.fullmatch(value):
        raise ValueError(f"{kind} {value!r}: use only letters, digits and '_.:-'")


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

    def __post_init__(self) -> None:
        _check_name("server name", self.name)
        if not self.host or any(c.isspace() for c in self.host):
            raise ValueError(f"server {self.name}: host {self.host!r} is empty or has spaces")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"server {self.name}: port {self.port} is outside 1..65535")
        if not 0 <= self.weight <= _MAX_WEIGHT:
            raise ValueError(f"server {self.name}: weight {self.weight} is outside 0..256")
        if self.maxconn is not None and self.maxconn < 1:
            raise ValueError(f"server {self.name}: maxconn must be at least 1")
        if self.cookie is not None:
            _check_name(f"server {self.name} cookie", self.cookie)


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
    HAProxy's own 503; only servers with `maxconn` make requests wait.

    With `health_check_path`, HAProxy sends `GET <path>` to every server each
    `health_check_interval_seconds`: 3 failures in a row take a server out (status DOWN), 2
    successes bring it back (HAProxy's defaults). Without it a dead server keeps its share and
    its requests get HAProxy's 503.
    """

    name: str
    servers: tuple[Server, ...]
    policy: Policy = "round_robin"
    queue_timeout_seconds: float = 30.0
    health_check_path: str | None = None
    health_check_interval_seconds: float = 1.0

    def __post_init__(self) -> None:
        _check_name("backend name", self.name)
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
        if self.health_check_path is not None and not _PATH.fullmatch(self.health_check_path):
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
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _check_name("frontend name", self.name)
        if self.name == STATS_FRONTEND:
            raise ValueError(f"frontend name {STATS_FRONTEND!r} is reserved for the stats port")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"frontend {self.name}: port {self.port} is outside 1..65535")
        if not _HEADER.fullmatch(self.header):
            raise ValueError(f"frontend {self.name}: header {self.header!r} is not a header name")
        for value in self.routes:
            _check_name(f"frontend {self.name} {self.header} value", value)


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
            for target in (frontend.default_backend, *frontend.routes.values()):
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
        if backend.policy == "sticky":
            lines.append(f"    cookie {STICKY_COOKIE} indirect nocache")
        if backend.health_check_path is not None:
            lines.append(f"    option httpchk GET {backend.health_check_path}")
        for server in backend.servers:
            line = f"    server {server.name} {server.host}:{server.port} weight {server.weight}"
            if server.maxconn is not None:
                line += f" maxconn {server.maxconn}"
            if backend.policy == "sticky":
                line += f" cookie {backend.cookie_of(server)}"
            if backend.health_check_path is not None:
                line += f" check inter {_duration(backend.health_check_interval_seconds)}"
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


class HaproxyProcess:
    """`haproxy -db` on a rendered config, as a context manager.

    `start` writes `haproxy.cfg` into the run directory, starts HAProxy in the foreground with
    its output in `haproxy.log`, and returns once the runtime socket answers and every frontend
    port accepts. `stop` soft-stops (SIGUSR1: finish requests in flight), then SIGTERM, then
    SIGKILL.
    """

    def __init__(
        self,
        config: HaproxyConfig,
        *,
        binary: str | None = None,
        start_timeout_seconds: float = 15.0,
        stop_timeout_seconds: float = 10.0,
    ) -> None:
        self.config = config
        self.binary = binary
        self.start_timeout_seconds = start_timeout_seconds
        self.stop_timeout_seconds = stop_timeout_seconds
        self.config_path = config.run_dir / "haproxy.cfg"
        self.log_path = config.run_dir / "haproxy.log"
        self.api = RuntimeApi(config.socket_path)
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
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(render(self.config))
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
        ports = [(f.host, f.port) for f in self.config.frontends]
        while True:
            code = self._process.poll()
            if code is not None:
                raise HaproxyError(
                    f"HAProxy exited with code {code} at start; from {self.log_path}:\n"
                    f"{self._log_tail()}"
                )
            if self._answers() and all(_accepts(host, port) for host, port in ports):
                return
            if time.monotonic() > deadline:
                raise HaproxyError(
                    f"HAProxy did not become ready within {self.start_timeout_seconds} s "
                    f"(runtime socket {self.config.socket_path}, ports {ports}); "
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

    def __enter__(self) -> HaproxyProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


@dataclass(frozen=True, slots=True)
class ServerStat:
    """One row of `show stat`: a server, or a proxy's FRONTEND / BACKEND summary (`type`).

    Field names are HAProxy's CSV columns; None where HAProxy leaves the column empty for this
    kind of row (a frontend has no queue). The BACKEND row's `qcur` is the central queue of a
    pooled backend.
    """

    pxname: str  # proxy (backend or frontend) name
    svname: str  # server name, or "FRONTEND" / "BACKEND"
    type: str  # "frontend" | "backend" | "server" | "listener"
    status: str  # "UP", "DOWN", "DRAIN", "MAINT", "no check" (up, unchecked), "OPEN", ...
    weight: int | None  # effective weight (backend: sum over its servers)
    uweight: int | None  # weight as configured or set at runtime
    scur: int  # sessions now; on a server, its requests in flight
    smax: int  # most requests in flight at once
    slim: int | None  # maxconn
    stot: int  # requests served in total
    qcur: int | None  # requests waiting in the queue now
    qmax: int | None  # longest queue seen
    rate: int | None  # new sessions over the last second
    econ: int | None  # failed connections to the server
    eresp: int | None  # failed responses
    hrsp_5xx: int | None  # responses with a 5xx status (HAProxy's own 503 included)
    qtime_seconds: float | None  # mean queue wait over the last 1024 requests
    ttime_seconds: float | None  # mean total time over the last 1024 requests


@dataclass(frozen=True, slots=True)
class ServerState:
    """One row of `show servers state`: what the runtime API has done to a server."""

    backend: str
    server: str
    address: str
    port: int
    op_state: int  # 0 stopped, 1 starting, 2 running, 3 stopping
    admin_state: int  # SRV_ADMF_* bit field: maintenance and drain flags
    uweight: int  # weight now
    iweight: int  # weight in the config

    @property
    def admin(self) -> AdminState:
        """The admin state as `set_state` names it."""
        if self.admin_state & _ADMIN_MAINT:
            return "maint"
        if self.admin_state & _ADMIN_DRAIN:
            return "drain"
        return "ready"


def _int(row: Mapping[str, str], column: str) -> int | None:
    value = row.get(column, "")
    return int(value) if value else None


def _seconds(row: Mapping[str, str], column: str) -> float | None:
    value = _int(row, column)
    return None if value is None else value / 1000


def _parse_stat(text: str) -> list[ServerStat]:
    lines = text.strip("\n").splitlines()
    # the column order changes between versions, so the header names the fields
    header = lines[0].removeprefix("# ").split(",")
    stats = []
    for row in csv.DictReader(lines[1:], fieldnames=header):
        stats.append(
            ServerStat(
                pxname=row["pxname"],
                svname=row["svname"],
                type=_STAT_TYPES.get(row["type"], row["type"]),
                status=row["status"],
                weight=_int(row, "weight"),
                uweight=_int(row, "uweight"),
                scur=_int(row, "scur") or 0,
                smax=_int(row, "smax") or 0,
                slim=_int(row, "slim"),
                stot=_int(row, "stot") or 0,
                qcur=_int(row, "qcur"),
                qmax=_int(row, "qmax"),
                rate=_int(row, "rate"),
                econ=_int(row, "econ"),
                eresp=_int(row, "eresp"),
                hrsp_5xx=_int(row, "hrsp_5xx"),
                qtime_seconds=_seconds(row, "qtime"),
                ttime_seconds=_seconds(row, "ttime"),
            )
        )
    return stats


def _parse_servers_state(text: str) -> list[ServerState]:
    lines = text.strip("\n").splitlines()
    if lines[0] != "1":
        raise RuntimeApiError(
            f"`show servers state` answered format {lines[0]!r}; this client reads format 1 "
            "(HAProxy 1.6 to 2.x)"
        )
    header = lines[1].removeprefix("# ").split()
    states = []
    for line in lines[2:]:
        row = dict(zip(header, line.split(), strict=False))
        states.append(
            ServerState(
                backend=row["be_name"],
                server=row["srv_name"],
                address=row["srv_addr"],
                port=int(row["srv_port"]),
                op_state=int(row["srv_op_state"]),
                admin_state=int(row["srv_admin_state"]),
                uweight=int(row["srv_uweight"]),
                iweight=int(row["srv_iweight"]),
            )
        )
    return states


class RuntimeApi:
    """HAProxy's runtime API over its unix socket, one command per connection.

    Calls block for at most `timeout_seconds`; HAProxy answers in microseconds, so async
    callers can run them in place or through `asyncio.to_thread`.
    """

    def __init__(self, socket_path: str | Path, *, timeout_seconds: float = 5.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_seconds = timeout_seconds

    def command(self, line: str) -> str:
        """Send one command and return HAProxy's whole reply."""
        # ';' chains commands and a newline ends one: either would run something unasked
        if any(c in line for c in ";\n\r"):
            raise ValueError(f"one runtime command at a time, without ';' or newlines: {line!r}")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout_seconds)
                sock.connect(str(self.socket_path))
                sock.sendall(line.encode() + b"\n")
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
        except TimeoutError as exc:
            raise RuntimeApiError(
                f"HAProxy did not answer {line!r} within {self.timeout_seconds} s "
                f"on {self.socket_path}"
            ) from exc
        except OSError as exc:
            raise RuntimeApiError(
                f"cannot reach HAProxy's runtime socket {self.socket_path}: {exc}; is HAProxy "
                f"running with `stats socket {self.socket_path} level admin` in its config?"
            ) from exc
        return b"".join(chunks).decode(errors="replace")

    def _show(self, line: str, first: str) -> str:
        reply = self.command(line)
        if not reply.startswith(first):
            raise RuntimeApiError(f"HAProxy refused {line!r}: {reply.strip()}")
        return reply

    def _set(self, line: str) -> None:
        # HAProxy answers a successful `set` with an empty line, anything else is its error
        reply = self.command(line).strip()
        if reply:
            raise RuntimeApiError(f"HAProxy refused {line!r}: {reply}")

    def show_stat(self, proxy: str | None = None) -> list[ServerStat]:
        """Every row of `show stat`, or only those of one frontend or backend."""
        if proxy is None:
            return _parse_stat(self._show("show stat", "# "))
        _check_name("proxy name", proxy)
        return _parse_stat(self._show(f"show stat {proxy} -1 -1", "# "))

    def show_servers_state(self, backend: str | None = None) -> list[ServerState]:
        """Admin state and weights of every server, or of one backend's servers."""
        if backend is None:
            return _parse_servers_state(self._show("show servers state", "1\n"))
        _check_name("backend name", backend)
        return _parse_servers_state(self._show(f"show servers state {backend}", "1\n"))

    def set_weight(self, backend: str, server: str, weight: int) -> None:
        """Set a server's weight, 0..256; 0 sends it no new requests."""
        if not 0 <= weight <= _MAX_WEIGHT:
            raise ValueError(f"weight {weight} is outside HAProxy's 0..256")
        self._set(f"set server {_server_ref(backend, server)} weight {weight}")

    def set_state(self, backend: str, server: str, state: AdminState) -> None:
        """`ready` takes requests; `drain` takes only those its sticky cookie pins to it;
        `maint` takes none. Requests in flight finish either way."""
        if state not in ADMIN_STATES:
            raise ValueError(f"state {state!r} is not one of {', '.join(ADMIN_STATES)}")
        self._set(f"set server {_server_ref(backend, server)} state {state}")


def _server_ref(backend: str, server: str) -> str:
    _check_name("backend name", backend)
    _check_name("server name", server)
    return f"{backend}/{server}"
