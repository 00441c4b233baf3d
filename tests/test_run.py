"""`gpubalance run`: the exporter, the analyzer and the controller of one host in one command.

The live tests run the real command over the fake NVML driver and a real HAProxy (echo servers
behind it), and judge it by what its parts serve and by the processes it leaves.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from controller_harness import (
    Backends,
    handing,
    haproxy_over,
    held_listener,
    kill_groups,
    marked_processes,
    needs_haproxy,
    port_of,
)

from gpubalance.cli import main
from gpubalance.lab.fakenvml import LIBRARY_NAME, write_state

STARTED = re.compile(
    r"gpubalance run: exporter (\S+) \(pid (\d+)\), analyzer (\S+) \(pid (\d+)\), "
    r"controller (\S+) \(pid (\d+)\); (.*)"
)
DEADLINE_SECONDS = 60.0
# the environment variable each `gpubalance run` a test starts passes to its parts
STACK_MARK = "GPUBALANCE_TEST_STACK"


def with_haproxy(test):  # type: ignore[no-untyped-def]
    for mark in needs_haproxy:
        test = mark(test)
    return test


def test_without_a_haproxy_socket_it_exits_2_saying_what_to_give(capsys) -> None:
    assert main(["run"]) == 2
    assert capsys.readouterr().err == (
        "gpubalance run: no HAProxy runtime socket: give --haproxy-socket PATH (the controller "
        "reads and sets HAProxy's servers through it; `stats socket PATH level admin` in "
        "haproxy.cfg)\n"
    )


def test_paused_without_a_token_file_it_exits_2_before_anything_starts(capsys) -> None:
    assert main(["run", "--haproxy-socket", "/run/haproxy.sock", "--paused"]) == 2
    assert capsys.readouterr().err == (
        "gpubalance run: --paused needs --token-file: a person resumes the controller with POST "
        "/api/v1/resume and that token\n"
    )


def test_a_taken_port_exits_2_naming_the_address_and_its_flag(capsys, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(
            [
                "run",
                "--haproxy-socket",
                str(tmp_path / "haproxy.sock"),
                "--exporter-listen",
                "127.0.0.1:0",
                "--analyzer-listen",
                f"127.0.0.1:{port}",
            ]
        )
    assert code == 2
    assert capsys.readouterr().err == (
        f"gpubalance run: cannot listen on 127.0.0.1:{port} (--analyzer-listen): "
        "address already in use\n"
    )


@pytest.mark.live
def test_a_part_handed_its_listening_socket_serves_on_it(tmp_path: Path) -> None:
    """`gpubalance run` binds each part's port and hands the socket down, so that no other
    process can take a port it chose (port 0 made a free one) before the part serves. Here the
    test holds the port too: a part that bound it anew would fail with "address in use"."""
    with held_listener() as sock:
        port = port_of(sock)
        part = subprocess.Popen(
            [
                *(sys.executable, "-m", "gpubalance", "analyzer"),
                *("--source", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{port}"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            **handing(sock),
        )
        try:
            # the request waits in the socket's backlog until the analyzer, still starting
            # (seconds on a busy host), accepts it: it may wait as long as the test does
            url = f"http://127.0.0.1:{port}"
            _eventually(
                lambda: part.poll() is not None or "source_up" in _health(url, DEADLINE_SECONDS),
                "the analyzer never answered on the socket it was handed",
            )
            assert part.poll() is None, part.communicate()[1]
        finally:
            part.terminate()
            _, err = part.communicate(timeout=DEADLINE_SECONDS)
    assert f"listening on http://127.0.0.1:{port}" in err, err


def test_a_bad_config_file_exits_2_with_the_line_and_key(capsys, tmp_path: Path) -> None:
    config = tmp_path / "gpubalance.yaml"
    config.write_text("exporter:\n  interval: fast\n")
    assert main(["run", "--config", str(config), "--haproxy-socket", "/run/haproxy.sock"]) == 2
    assert capsys.readouterr().err == (
        f"gpubalance run: {config}:2: exporter.interval: expected a number, got 'fast'\n"
    )


# -- live --------------------------------------------------------------------------------------


@pytest.fixture
def haproxy_socket(tmp_path: Path) -> Iterator[Path]:
    """A real HAProxy over two echo servers, in a thread of its own; its runtime socket."""
    ready = threading.Event()
    done = asyncio.Event()
    socket_path: list[Path] = []
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        async with Backends(["s1", "s2"]) as backends:
            config = backends.config(tmp_path / "haproxy")
            async with haproxy_over(config):
                socket_path.append(config.socket_path)
                ready.set()
                await done.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "HAProxy did not start"
    yield socket_path[0]
    loop.call_soon_threadsafe(done.set)
    thread.join(30)


class RunningStack:
    """`gpubalance run` as a user starts it, its log read as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        # what its parts inherit, by which close() finds them (not by pids: those are reused)
        self.mark = f"{os.getpid()}-{uuid.uuid4().hex}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpubalance", "run", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, STACK_MARK: self.mark},
            cwd=cwd,
            start_new_session=True,  # a process group of its own, as a shell's job has
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_started(self) -> re.Match[str]:
        deadline = time.monotonic() + DEADLINE_SECONDS
        while not (match := STARTED.search(self.log)):
            assert self.process.poll() is None, f"it exited {self.process.returncode}:\n{self.log}"
            assert time.monotonic() < deadline, f"it did not start:\n{self.log}"
            time.sleep(0.05)
        return match

    def finish(self) -> int:
        code = self.process.wait(timeout=DEADLINE_SECONDS)
        self._reader.join(10)
        return code

    def close(self) -> None:
        """After a failed assertion too: SIGTERM it, which stops its parts; then SIGKILL any
        part still there. Each part has a process group of its own, so killing this process
        alone would leave them running for the rest of the suite. The parts are found by the
        mark they inherited: the pids the log names may be another test's processes by now."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=DEADLINE_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
        kill_groups(marked_processes(STACK_MARK, self.mark))


def _get(url: str, timeout_seconds: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_seconds) as resp:
        return resp.read()


def _gpus(exporter: str) -> int | None:
    """How many GPUs the exporter's latest sample holds; None before its first (503)."""
    try:
        return len(json.loads(_get(exporter + "/api/v1/snapshot"))["sample"]["gpus"])
    except urllib.error.HTTPError:
        return None


def _health(url: str, timeout_seconds: float = 5.0) -> dict[str, object]:
    """The analyzer's /healthz body, also while it answers 503 (starting, before its first
    cycle)."""
    try:
        return json.loads(_get(url + "/healthz", timeout_seconds))
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def _eventually(check, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0): gone is "no longer running"
    status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return status in ("Z", "X")


@pytest.fixture
def stack_args(fakenvml_dir: Path, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Flags and environment of a stack on the fake driver with two GPUs, on free ports."""
    state = tmp_path / "nvml.state"
    write_state(state, {"device_count": 2})
    config = tmp_path / "gpubalance.yaml"
    config.write_text(
        "exporter:\n"
        f"  nvml_library: {fakenvml_dir / LIBRARY_NAME}\n"
        "  serving: {otlp: {enabled: false}}\n"
    )
    argv = [
        "--config",
        str(config),
        "--audit-log",
        str(tmp_path / "audit.jsonl"),
        "--exporter-listen",
        "127.0.0.1:0",
        "--analyzer-listen",
        "127.0.0.1:0",
        "--controller-listen",
        "127.0.0.1:0",
        "--analyzer-args",
        "--window 2 --interval 0.5",
        "--controller-args",
        "--interval 0.5",
    ]
    return argv, {**os.environ, "FAKE_NVML_STATE": str(state)}


def _source_up(controller: str, source: str) -> bool:
    text = _get(controller + "/metrics").decode()
    return f'gpubalance_controller_source_up{{source="{source}"}} 1.0' in text


@pytest.mark.live
@with_haproxy
def test_one_command_runs_the_three_parts_each_reading_the_next_and_stops_clean_on_ctrl_c(
    stack_args, haproxy_socket: Path, tmp_path: Path
) -> None:
    argv, env = stack_args
    stack = RunningStack([*argv, "--haproxy-socket", str(haproxy_socket)], env, tmp_path)
    try:
        started = stack.wait_started()
        exporter, analyzer, controller = started.group(1, 3, 5)
        pids = [int(p) for p in started.group(2, 4, 6)]
        assert started.group(7) == "dry-run", "the controller acts only with --act"
        for url in (exporter, analyzer, controller):
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
        # the exporter reads the fake driver's two GPUs
        _eventually(lambda: _gpus(exporter) == 2, "the exporter never read the two GPUs")
        # the analyzer reads the exporter; the controller reads the analyzer and HAProxy
        _eventually(
            lambda: _health(analyzer)["source_up"] is True, "the analyzer never read the exporter"
        )
        _eventually(lambda: _source_up(controller, "haproxy"), "the controller never read HAProxy")
        _eventually(lambda: _source_up(controller, "analyzer"), "the controller never read it")
        # a terminal's Ctrl-C: SIGINT to the whole foreground process group (SIGTERM, what
        # systemd sends, takes the same path; the demo's test stops it with that)
        os.killpg(stack.process.pid, signal.SIGINT)
        assert stack.finish() == 0, stack.log
    finally:
        stack.close()
    assert all(_gone(pid) for pid in pids), stack.log
    assert stack.log.rstrip().endswith("gpubalance run: stopped"), stack.log


@pytest.mark.live
@with_haproxy
def test_a_part_that_dies_is_named_and_the_others_are_stopped(
    stack_args, haproxy_socket: Path, tmp_path: Path
) -> None:
    argv, env = stack_args
    stack = RunningStack([*argv, "--haproxy-socket", str(haproxy_socket), "--act"], env, tmp_path)
    try:
        started = stack.wait_started()
        assert started.group(7) == "the controller acts"
        pids = [int(p) for p in started.group(2, 4, 6)]
        os.kill(pids[1], signal.SIGKILL)
        assert stack.finish() == 1, stack.log
    finally:
        stack.close()
    assert (
        f"gpubalance run: the analyzer (pid {pids[1]}) exited with signal SIGKILL; "
        "stopping the others" in stack.log
    )
    assert all(_gone(pid) for pid in pids), stack.log


@pytest.mark.live
def test_a_part_that_refuses_its_input_at_start_exits_2_and_leaves_nothing_running(
    stack_args, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.skops"
    log = _refused(stack_args, tmp_path, "--analyzer-args", f"--model {missing}")
    assert f"gpubalance analyzer: --model {missing}: no such file" in log
    assert "gpubalance run: the analyzer exited at start with status 2; stopping the others" in log
    started = re.findall(r"gpubalance run: starting the (\w+) \(pid (\d+)\)", log)
    assert [name for name, _ in started] == ["exporter", "analyzer", "controller"], log
    assert all(_gone(int(pid)) for _, pid in started), log


@pytest.mark.live
def test_every_part_that_refuses_its_input_at_start_is_named(stack_args, tmp_path: Path) -> None:
    missing = tmp_path / "missing.skops"
    log = _refused(
        stack_args,
        tmp_path,
        *("--analyzer-args", f"--model {missing}", "--controller-args", "--interval soon"),
    )
    for part in ("analyzer", "controller"):
        assert f"gpubalance run: the {part} exited at start with status 2" in log, log
    assert "the exporter exited" not in log, log


def _refused(stack_args: tuple[list[str], dict[str, str]], tmp_path: Path, *flags: str) -> str:
    """The log of a stack given ``flags`` that some part refuses at start: it exits 2."""
    argv, env = stack_args
    socket_path = str(tmp_path / "haproxy.sock")
    stack = RunningStack([*argv, "--haproxy-socket", socket_path, *flags], env, tmp_path)
    try:
        assert stack.finish() == 2, stack.log
    finally:
        stack.close()
    return stack.log
