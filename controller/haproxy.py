"""HAProxy's runtime API: the client the controller acts through, and its parsers.

One command per connection over the unix socket (`stats socket ... level admin` to change
weights and states and to add and delete servers; `level user` is enough to observe).
`show stat` and `show servers state` are parsed into plain rows; their column order changes
between versions, so each header names the fields. The lab's live speed drives its HAProxy
through this same client.

Verified against HAProxy 2.6 (Debian bookworm); see docs/reference/balancing.md §4.
"""

from __future__ import annotations

import csv
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

AdminState = Literal["ready", "drain", "maint"]
ADMIN_STATES: tuple[str, ...] = get_args(AdminState)

# HAProxy names (proxies, servers, cookie values): anything wider would need quoting in the
# config and on the runtime CLI
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
# a request header's name, as a config's `req.hdr(...)` takes it
HEADER_NAME = re.compile(r"[A-Za-z0-9-]+")
# a health check's path: printable, no spaces, one token on the `option httpchk` line
HTTP_PATH = re.compile(r"/[!-~]*")
MAX_WEIGHT = 256

# srv_admin_state bits (HAProxy include/haproxy/server-t.h, SRV_ADMF_*)
# (HAProxy's SRV_ADMF_MAINT: forced, inherited, DNS). Not 0x04, the config's `disabled`, nor
# 0x40, an FQDN set at runtime: both are remembered after `state ready` puts the server in
# service (`show servers state` reads 4 for a `disabled` server readied, and it serves)
_ADMIN_MAINT = 0x01 | 0x02 | 0x20
_ADMIN_DRAIN = 0x08 | 0x10  # forced, inherited

_STAT_TYPES = {"0": "frontend", "1": "backend", "2": "server", "3": "listener"}


class HaproxyError(RuntimeError):
    """HAProxy rejected a config, failed to start, or refused a runtime command."""


class RuntimeApiError(HaproxyError):
    """The runtime socket is unreachable or HAProxy answered a command with an error."""


def check_name(kind: str, value: str) -> None:
    """Refuse a name HAProxy would need quoted: it would split a runtime command."""
    if not _NAME.fullmatch(value):
        raise ValueError(f"{kind} {value!r}: use only letters, digits and '_.:-'")


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
    # requests refused by an `http-request deny` (a backend's own rules, or its frontend's)
    dreq: int | None = None
    # a BACKEND row's balance algorithm ("leastconn", "roundrobin", "random", ...)
    algo: str | None = None


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
                dreq=_int(row, "dreq"),
                algo=row.get("algo") or None,
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
        check_name("proxy name", proxy)
        return _parse_stat(self._show(f"show stat {proxy} -1 -1", "# "))

    def show_servers_state(self, backend: str | None = None) -> list[ServerState]:
        """Admin state and weights of every server, or of one backend's servers."""
        if backend is None:
            return _parse_servers_state(self._show("show servers state", "1\n"))
        check_name("backend name", backend)
        return _parse_servers_state(self._show(f"show servers state {backend}", "1\n"))

    def set_weight(self, backend: str, server: str, weight: int) -> None:
        """Set a server's weight, 0..256; 0 sends it no new requests."""
        if not 0 <= weight <= MAX_WEIGHT:
            raise ValueError(f"weight {weight} is outside HAProxy's 0..256")
        self._set(f"set server {_server_ref(backend, server)} weight {weight}")

    def set_state(self, backend: str, server: str, state: AdminState) -> None:
        """`ready` takes requests; `drain` takes only those its sticky cookie pins to it;
        `maint` takes none. Requests in flight finish either way."""
        if state not in ADMIN_STATES:
            raise ValueError(f"state {state!r} is not one of {', '.join(ADMIN_STATES)}")
        self._set(f"set server {_server_ref(backend, server)} state {state}")

    def add_server(self, backend: str, server: str, host: str, port: int, weight: int) -> None:
        """A server created at runtime, in `maint` (`set_state` readies it), health-checked
        as the backend checks (`option httpchk`, else a TCP connect)."""
        if not 0 <= weight <= MAX_WEIGHT:
            raise ValueError(f"weight {weight} is outside HAProxy's 0..256")
        _check_address(host, port)
        ref = _server_ref(backend, server)
        self._expect(
            f"add server {ref} {host}:{port} weight {weight} check", "New server registered."
        )
        # 2.6 starts a dynamic server's checks only when asked; a backend without
        # `option httpchk` checks the TCP connect
        self._expect(f"enable health {ref}", "")

    def del_server(self, backend: str, server: str) -> None:
        """Remove a server HAProxy shows in `maint` with no sessions left."""
        self._expect(f"del server {_server_ref(backend, server)}", "Server deleted.")

    def set_addr(self, backend: str, server: str, host: str, port: int) -> None:
        """Point a server at another address and port (a worker restarted elsewhere)."""
        _check_address(host, port)
        reply = self.command(f"set server {_server_ref(backend, server)} addr {host} port {port}")
        # HAProxy says what changed ("IP changed from ...", "port changed from ...", "no need
        # to change the addr"); an error names the command's problem instead
        if not any(word in reply for word in ("changed from", "no need to change")):
            raise RuntimeApiError(
                f"HAProxy refused set server {backend}/{server} addr: {reply.strip()}"
            )

    def _expect(self, line: str, answer: str) -> None:
        reply = self.command(line).strip()
        if reply != answer:
            raise RuntimeApiError(f"HAProxy refused {line!r}: {reply or 'no answer'}")


def _check_address(host: str, port: int) -> None:
    if not host or any(c.isspace() or c in ";#" for c in host):
        raise ValueError(f"address {host!r} is empty or holds spaces")
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is outside 1..65535")


def _server_ref(backend: str, server: str) -> str:
    check_name("backend name", backend)
    check_name("server name", server)
    return f"{backend}/{server}"
