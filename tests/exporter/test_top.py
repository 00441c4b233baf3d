"""`gpubalance top`: its flags, a URL it cannot read (in a pipe and on a terminal), its table."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
from rich.console import Console

from gpubalance.exporter.top import render
from gpubalance.snapshot import SCHEMA, Snapshot
from gpubalance.telemetry import GpuSample, GpuWindow, NvmlStatus, Sample, Window

GIB = 1024**3


def top(*args: str) -> subprocess.CompletedProcess[str]:
    """`gpubalance top` with its output in a pipe, as a script would run it."""
    return subprocess.run(
        [sys.executable, "-m", "gpubalance", "top", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def dead_url() -> str:
    # a port that was free a moment ago: nothing listens on it
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--refresh", "-1"), ("--refresh", "0"), ("--duration", "-5"), ("--refresh", "nan")],
)
def test_a_refresh_or_duration_that_is_not_positive_is_rejected(flag: str, value: str) -> None:
    result = top("--url", dead_url(), flag, value, "--duration", "2")
    assert result.returncode == 2, result.stderr
    assert f"argument {flag}: must be a positive number of seconds, got {value}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_url_without_a_scheme_is_rejected() -> None:
    result = top("--url", "127.0.0.1:9450")
    assert result.returncode == 2
    assert "argument --url: expected an http:// or https:// URL" in result.stderr


def test_a_dead_url_in_a_pipe_says_so_and_exits_non_zero() -> None:
    url = dead_url()
    result = top("--url", url, "--duration", "5")
    assert result.returncode == 1
    assert f"gpubalance top: cannot reach {url}: " in result.stderr
    assert "Connection refused" in result.stderr


def test_on_a_terminal_a_dead_url_is_shown_and_retried_until_it_answers(start_exporter) -> None:
    url = dead_url()
    main, child = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "gpubalance", "top", "--url", url, "--refresh", "0.2"],
        stdin=child,
        stdout=child,
        stderr=child,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "200", "LINES": "50"},
        # as on a terminal, Ctrl-C interrupts: a suite started in the background by a shell
        # inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(child)
    screen = b""

    def read_until(text: bytes) -> None:
        nonlocal screen
        deadline = time.monotonic() + 30
        while text not in screen:
            assert process.poll() is None, screen.decode(errors="replace")
            assert time.monotonic() < deadline, screen.decode(errors="replace")
            if select.select([main], [], [], 0.2)[0]:
                screen += os.read(main, 65536)

    try:
        read_until(f"cannot reach {url}".encode())
        port = url.rsplit(":", 1)[1]
        start_exporter({"device_count": 1}, "--listen", f"127.0.0.1:{port}")
        read_until(b"RTX")  # the exporter came up: its GPU is on screen
        process.send_signal(signal.SIGINT)
        # keep reading the terminal while top stops: its last frame must not block on a full
        # pty buffer, as it would on a terminal nobody reads
        deadline = time.monotonic() + 30
        while process.poll() is None and time.monotonic() < deadline:
            if select.select([main], [], [], 0.2)[0]:
                try:
                    screen += os.read(main, 65536)
                except OSError:  # the child closed its side
                    break
        assert process.wait(timeout=5) == 0  # the last read succeeded
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(main)


def snapshot_with_time_to_full(seconds: float) -> Snapshot:
    gpu = GpuSample(
        index=0,
        uuid="GPU-a",
        name="NVIDIA GeForce RTX 4090",
        memory_used_bytes=20 * GIB,
        memory_total_bytes=24 * GIB,
        memory_free_bytes=4 * GIB,
    )
    trend = GpuWindow(
        index=0,
        uuid="GPU-a",
        utilization_ratio=0.5,
        utilization_source="rates",
        utilization_sample_count=30,
        memory_used_slope_bytes_per_second=4 * GIB / seconds,
        memory_time_to_full_seconds=seconds,
        throttled_ratio=0.0,
    )
    sample = Sample(
        timestamp_seconds=1000.0,
        duration_seconds=0.01,
        hostname="h",
        nvml=NvmlStatus(up=True),
        gpus=(gpu,),
    )
    return Snapshot(SCHEMA, 1.0, 30.0, 300.0, sample, Window(970.0, 1000.0, gpus=(trend,)))


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(45, "full in 45 s"), (720, "full in 12 min"), (5400, "full in 1.5 h"), (3 * 86400, "3 d")],
)
def test_time_to_full_in_the_unit_that_fits(seconds: float, shown: str) -> None:
    console = Console(record=True, width=250)
    console.print(render(snapshot_with_time_to_full(seconds)))
    assert shown in console.export_text()


def test_a_stale_gpu_shows_the_call_it_is_stuck_in() -> None:
    fresh = GpuSample(index=0, uuid="GPU-a", name="NVIDIA GeForce RTX 4090")
    stuck = GpuSample(
        index=1,
        uuid="GPU-b",
        name="NVIDIA GeForce RTX 4090",
        stale=True,
        stale_call="nvmlDeviceGetPowerUsage",
    )
    sample = Sample(
        timestamp_seconds=1000.0,
        duration_seconds=0.01,
        hostname="h",
        nvml=NvmlStatus(up=True),
        gpus=(fresh, stuck),
    )
    console = Console(record=True, width=250)
    console.print(render(Snapshot(SCHEMA, 1.0, 30.0, 300.0, sample, Window(970.0, 1000.0))))
    lines = [line for line in console.export_text().splitlines() if "│ 1 " in line]
    assert len(lines) == 1 and "STALE in nvmlDeviceGetPowerUsage" in lines[0]
