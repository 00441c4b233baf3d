"""Test helpers: parse an exposition, drive an exporter process, run the live lab with its
exporter. Importable from any test (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import pty
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gpubalance.lab import traffic
from gpubalance.lab.fakenvml import write_state
from gpubalance.lab.live.haproxy import HaproxyConfig, HaproxyProcess, Server, start_on_free_ports
from gpubalance.lab.live.run import LiveLab
from gpubalance.lab.scenario import Plan, Scenario, plan

LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")


@dataclass
class Metrics:
    """Parsed exposition: sample name + labels -> value, and family name -> type."""

    text: str
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        metrics = cls(text)
        # The parser renames a counter's samples to end in _total; keep names as written (the
        # DCGM profile's counters have no _total).
        written = {
            re.split(r"[{ ]", line, maxsplit=1)[0]
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                if name not in written and name.removesuffix("_total") in written:
                    name = name.removesuffix("_total")
                metrics.types[name] = family.type
                metrics.samples[(name, frozenset(sample.labels.items()))] = sample.value
        return metrics

    def find(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        wanted = set(labels.items())
        return [
            (dict(key_labels), value)
            for (sample_name, key_labels), value in self.samples.items()
            if sample_name == name and wanted <= key_labels
        ]

    def value(self, name: str, **labels: str) -> float:
        found = self.find(name, **labels)
        assert len(found) == 1, f"{name}{labels}: expected one sample, found {found}"
        return found[0][1]

    def has(self, name: str, **labels: str) -> bool:
        return bool(self.find(name, **labels))


@dataclass
class RunningExporter:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    state_path: Path

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + path, headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                body = response.read()
                if response.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                return response.status, body
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def metrics(self, names: str | None = None) -> Metrics:
        status, body = self.get("/metrics" + (f"?names={names}" if names else ""))
        assert status == 200, body
        return Metrics.parse(body.decode())

    def snapshot(self) -> dict[str, Any]:
        status, body = self.get("/api/v1/snapshot")
        assert status == 200, body
        return json.loads(body)

    def write(self, state: Mapping[str, object]) -> None:
        write_state(self.state_path, state)

    def wait_for(
        self, check: Callable[[Metrics], bool], timeout: float = 15.0, names: str | None = None
    ) -> Metrics:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"exporter died:\n{self.log()}"
            metrics = self.metrics(names)
            if check(metrics):
                return metrics
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout} s:\n{metrics.text}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def run_live(
    data: dict[str, Any] | Plan,
    fakenvml_dir: Path,
    probe: Callable[[LiveLab], Any] | None = None,
    window: float = 4.0,
    settle: float = 0.0,
    duration: float | None = None,
) -> tuple[LiveLab, list[Any], Any]:
    """Run the live lab in a thread; call ``probe(lab)`` once the exporter's window covers only
    the run from ``settle`` s after the traffic started on (never after a fixed sleep: a busy
    machine can delay a probe, never make it read a window that began before the traffic)."""
    the_plan = data if isinstance(data, Plan) else plan(Scenario.model_validate(data))
    duration = duration or the_plan.scenario.duration_seconds
    requests = traffic.generate(the_plan.scenario.traffic, duration, the_plan.scenario.seed)
    ready = threading.Event()
    started: list[float] = []  # time.time() when the traffic starts

    def on_ready(_: LiveLab) -> None:
        started.append(time.time())
        ready.set()

    lab = LiveLab(
        the_plan,
        requests,
        duration,
        start_exporter=True,
        exporter_args=(
            "--interval",
            "0.5",
            "--window",
            str(window),
            "--trend-window",
            str(2 * window),
        ),
        build_dir=fakenvml_dir,
        on_ready=on_ready,
    )
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["records"], _ = asyncio.run(lab.run())
        except BaseException as exc:  # handed to the test below
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    probed = None
    try:
        assert ready.wait(90), "the live lab did not start"
        if probe is not None:
            wait_for_window(lab, thread, started[0] + settle)
            probed = probe(lab)
    finally:
        thread.join(180)
    if "error" in result:
        raise result["error"]
    sent = [r for r in requests if r.arrival_seconds < duration]
    return lab, sent, (result["records"], probed)


def wait_for_window(lab: LiveLab, run: threading.Thread, since: float) -> None:
    """Until the exporter's window (its span back from its latest sample) starts at ``since``
    or later; fails if the run ends first."""
    assert lab.exporter is not None
    seen: object = "no answer"
    while run.is_alive():
        try:
            with urllib.request.urlopen(lab.exporter.url + "/api/v1/snapshot", timeout=10) as resp:
                snapshot = json.loads(resp.read())
        except OSError as exc:  # not listening yet on a busy machine
            seen = exc
        else:
            seen = window = snapshot["window"]
            if window["end_seconds"] - snapshot["window_seconds"] >= since:
                return
        time.sleep(0.2)
    raise AssertionError(f"the run ended before the exporter's window began at {since}: {seen}")


def scrape(lab: LiveLab) -> Metrics:
    assert lab.exporter is not None
    with urllib.request.urlopen(lab.exporter.url + "/metrics", timeout=10) as resp:
        return Metrics.parse(resp.read().decode())


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A port of 127.0.0.1 every connection to is refused while the block runs: bound by the
    test and not listening, so no other process can take it and answer (a port only chosen
    free can be)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


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


@dataclass(frozen=True)
class OnTerminal:
    """What a command wrote to a terminal on its stderr, and to a pipe on its stdout."""

    returncode: int
    shown: bytes  # stderr, as the terminal got it
    stdout: bytes


def run_on_terminal(command: list[str], timeout: float) -> OnTerminal:
    """Run ``command`` with its stderr on a pseudo-terminal (where progress bars are drawn)
    and its stdout on a pipe; read the terminal until the process closes it."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=secondary,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "100"},
    )
    os.close(secondary)
    shown = b""
    while True:  # until the process closes its end of the terminal
        try:
            chunk = os.read(primary, 4096)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    returncode = process.wait(timeout=timeout)
    os.close(primary)
    assert process.stdout is not None
    return OnTerminal(returncode, shown, process.stdout.read())


@contextlib.asynccontextmanager
async def haproxy_over(config: HaproxyConfig) -> AsyncIterator[HaproxyProcess]:
    """HAProxy started and stopped off the event loop, so the backends keep answering. Its
    ports are its ``config``'s, or others if a test beside this one took one first: ask the
    process's ``config`` where it listens."""
    process = await asyncio.to_thread(start_on_free_ports, config)
    try:
        yield process
    finally:
        await asyncio.to_thread(process.stop)
