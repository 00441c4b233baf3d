"""Ports for the servers the lab, its tests and its benchmarks start side by side on one host.

A port is free when it is chosen (bound to port 0, then closed), but another process can bind it
before the server does: an outgoing connection's ephemeral port, or another test's server on a busy
host. A server that says so raises :class:`PortTakenError`, and :func:`on_a_free_port` starts it
again on another port, a few times. :func:`start_server` does that for a server process told its
address on the command line (Prometheus, Alertmanager) that says so in its log;
:func:`start_prometheus` for the real Prometheus the tests and benchmarks query.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil

log = logging.getLogger(__name__)

T = TypeVar("T")

# what a server's bind failure says: Go's "bind: address already in use", HAProxy's
# "cannot bind socket (Address already in use)", Python's "[Errno 98] Address already in use"
_PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)
START_TRIES = 3


class PortTakenError(RuntimeError):
    """A server found its port taken as it started."""


def free_port() -> int:
    """A port on 127.0.0.1 that no process holds now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def says_port_taken(text: str) -> bool:
    """Whether a server's own words (its log, its error) say its port was taken."""
    return _PORT_TAKEN.search(text) is not None


def on_a_free_port(
    start: Callable[[int], T], *, tries: int = START_TRIES, first: int | None = None
) -> T:
    """``start(port)`` on ``first`` or a free port; on another free port while it raises
    :class:`PortTakenError`, ``tries`` times in all."""
    port = free_port() if first is None else first
    for attempt in range(1, tries + 1):
        try:
            return start(port)
        except PortTakenError as exc:
            if attempt == tries:
                raise PortTakenError(f"{exc} (taken {tries} times in a row)") from exc
            log.info("%s; starting it on another port", exc)
            port = free_port()
    raise AssertionError("unreachable: the last try returns or raises")


@dataclass
class Server:
    """A server process started by :func:`start_server`, ready at ``url``."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def stop(self, timeout_seconds: float = 60.0) -> None:
        """Terminate it (kill it if it lingers) and wait; safe to call more than once."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    command: Callable[[str], Sequence[str]],
    log_path: Path,
    *,
    ready_path: str = "/-/ready",
    timeout_seconds: float = 60.0,
    tries: int = START_TRIES,
    first: int | None = None,
) -> Server:
    """Run ``command(address)`` ("127.0.0.1:PORT", on ``first`` or a free port) with its output
    in ``log_path``, and return once GET ``ready_path`` answers 200 and the process holds the
    port. One that exits saying its address is in use starts again on another port; one that
    exits for another reason, or is not ready within ``timeout_seconds``, raises RuntimeError
    with its log."""

    def start(port: int) -> Server:
        address = f"127.0.0.1:{port}"
        with log_path.open("wb") as out:
            process = subprocess.Popen(list(command(address)), stdout=out, stderr=subprocess.STDOUT)
        server = Server(process, f"http://{address}", log_path)
        try:
            _wait_ready(server, ready_path, timeout_seconds)
        except BaseException:
            server.stop()
            raise
        return server

    return on_a_free_port(start, tries=tries, first=first)


def start_prometheus(
    config: Path, tsdb: Path, *flags: str, timeout_seconds: float = 60.0, first: int | None = None
) -> Server:
    """A real Prometheus on ``config``, its TSDB in ``tsdb``, its log beside ``config``, ready;
    ``flags`` are more of its command-line flags."""
    return start_server(
        lambda address: [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tsdb}",
            f"--web.listen-address={address}",
            *flags,
        ],
        config.parent / "prometheus.log",
        timeout_seconds=timeout_seconds,
        first=first,
    )


def _wait_ready(server: Server, ready_path: str, timeout_seconds: float) -> None:
    deadline = time.monotonic() + timeout_seconds
    name = Path(server.process.args[0]).name  # type: ignore[index]
    while True:
        code = server.process.poll()
        if code is not None:
            said = server.log_path.read_text(errors="replace")
            if says_port_taken(said):
                raise PortTakenError(f"{name}: {server.url.removeprefix('http://')} was taken")
            raise RuntimeError(f"{name} exited with code {code} at start:\n{said}")
        try:
            with urllib.request.urlopen(server.url + ready_path, timeout=5) as response:
                # the answer may come from the process that took the port, before ours exits
                if response.status == 200 and _listens(server):
                    return
        except (urllib.error.URLError, OSError):  # not listening yet, or 503 while it loads
            pass
        if time.monotonic() > deadline:
            said = server.log_path.read_text(errors="replace")
            raise RuntimeError(f"{name} not ready within {timeout_seconds:.0f} s:\n{said}")
        time.sleep(0.1)


def _listens(server: Server) -> bool:
    """Whether the server's own process holds its port."""
    port = int(server.url.rpartition(":")[2])
    try:
        held = psutil.Process(server.process.pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in held)
