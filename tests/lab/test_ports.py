"""Servers started on a port another process took between its choice and their bind."""

from __future__ import annotations

import http.server
import shutil
import socket
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpubalance.lab.live.ports import (
    PortTakenError,
    on_a_free_port,
    says_port_taken,
    start_prometheus,
    start_server,
)


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ready, but not the server you started")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another server holds, answering 200 to every GET (/-/ready included)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _python_server(address: str) -> list[str]:
    """A Python HTTP server on ``address``: it exits with "Address already in use" if taken."""
    port = address.rpartition(":")[2]
    return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", port]


def _listening_port(pid: int) -> set[int]:
    held = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.port for c in held if c.status == psutil.CONN_LISTEN}


def test_a_server_whose_port_is_taken_starts_on_another(taken: int, tmp_path: Path) -> None:
    # the server holding the port answers /-/ready: that is no sign that ours is ready
    server = start_server(_python_server, tmp_path / "server.log", ready_path="/", first=taken)
    try:
        port = int(server.url.rpartition(":")[2])
        assert port != taken
        assert _listening_port(server.process.pid) == {port}
        with urllib.request.urlopen(server.url, timeout=10) as response:
            assert b"Directory listing" in response.read()
    finally:
        server.stop()
    assert server.process.poll() is not None


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="apt-get install prometheus")
def test_a_prometheus_whose_port_is_taken_starts_on_another(taken: int, tmp_path: Path) -> None:
    # seen in a fresh-clone `make test`: Prometheus exited with "bind: address already in use"
    (tmp_path / "prometheus.yml").write_text("scrape_configs: []\n")
    server = start_prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", first=taken)
    try:
        assert not server.url.endswith(f":{taken}")
        with urllib.request.urlopen(f"{server.url}/api/v1/status/buildinfo", timeout=10) as r:
            assert b'"version"' in r.read()
    finally:
        server.stop()


def test_a_port_taken_every_time_is_an_error() -> None:
    tried: list[int] = []

    def start(port: int) -> None:
        tried.append(port)
        raise PortTakenError(f"port {port}")

    with pytest.raises(PortTakenError, match=r"taken 3 times in a row"):
        on_a_free_port(start, tries=3)
    assert len(set(tried)) == 3


def test_a_server_that_fails_otherwise_is_not_started_again(tmp_path: Path) -> None:
    starts: list[str] = []

    def command(address: str) -> list[str]:
        starts.append(address)
        return [sys.executable, "-c", "import sys; print('no such flag: --bogus'); sys.exit(2)"]

    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2 at start.*no such flag"):
        start_server(command, tmp_path / "server.log")
    assert len(starts) == 1


def test_a_server_never_ready_is_stopped(tmp_path: Path) -> None:
    # listens, but answers every GET of a missing path with 404: never ready
    with pytest.raises(RuntimeError, match=r"not ready within 1 s"):
        start_server(
            _python_server, tmp_path / "server.log", ready_path="/nothing/here", timeout_seconds=1
        )
    assert not any(
        p.name().startswith("python") and "http.server" in " ".join(p.cmdline())
        for p in psutil.Process().children()
    )


@pytest.mark.parametrize(
    ("said", "taken"),
    [
        ('err="listen tcp 127.0.0.1:9090: bind: address already in use"', True),
        ("[ALERT] (1) : Starting frontend fe: cannot bind socket (Address already in use)", True),
        ("OSError: [Errno 98] Address already in use", True),
        ("Error loading config: parsing YAML file", False),
    ],
)
def test_a_taken_port_is_told_by_the_servers_own_words(said: str, taken: bool) -> None:
    assert says_port_taken(said) is taken


def test_a_chosen_port_is_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", on_a_free_port(lambda port: port)))
