"""`make demo`: the live lab on a skewed, heterogeneous RTX server, the exporter reading it
through the fake NVML driver and the lab's procfs tree, the analyzer judging the exporter's
history, and the live terminal view of both.

The scenario (lab/scenarios/skewed-heterogeneous.yaml: 3x RTX 4090 + RTX 3090, one card the
default target of a weighted round robin) shows what gpubalance is for: one card hot, the others
idling, the slow card's tail latency.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from gpubalance.lab import scenario, traffic
from gpubalance.lab.live.run import LiveLab

DEMO_SCENARIO = "skewed-heterogeneous"
FOREVER_SECONDS = 24 * 3600.0  # on a terminal the demo runs until Ctrl-C
# short windows, so that a 20 s demo in a pipe shows verdicts: 5 exporter samples each
ANALYZER_ARGS = ("--window", "5", "--interval", "1", "--listen", "127.0.0.1:0")
LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.1)


def start_analyzer(
    exporter_url: str, log_path: Path, timeout: float = 60.0
) -> tuple[subprocess.Popen[bytes], str]:
    """`gpubalance analyzer` on the exporter, on a free loopback port: the process and its URL."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpubalance",
                "analyzer",
                "--source",
                exporter_url,
                *ANALYZER_ARGS,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + timeout
    while not (match := LISTENING.search(log_path.read_text(errors="replace"))):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(
                f"the analyzer did not start; its log, {log_path}:\n"
                + log_path.read_text(errors="replace")
            )
        time.sleep(0.05)
    return process, match.group(1)


def run_demo(build_dir: Path, duration: float | None) -> int:
    from gpubalance.exporter.top import watch

    plan = scenario.load(DEMO_SCENARIO)
    horizon = (duration or FOREVER_SECONDS) + 30.0
    requests = traffic.generate(plan.scenario.traffic, horizon, plan.scenario.seed)
    ready = threading.Event()
    lab = LiveLab(
        plan,
        requests,
        horizon,
        start_exporter=True,
        build_dir=build_dir,
        exporter_args=("--window", "10", "--trend-window", "60", "--log-level", "warning"),
        on_ready=lambda _: ready.set(),
        keep_files=True,  # the demo names its run directory: it is there to be looked at
    )
    shown = False
    failure: list[BaseException] = []
    analyzer: subprocess.Popen[bytes] | None = None

    def serve() -> None:
        try:
            asyncio.run(lab.run())
        except BaseException as exc:  # shown to the user below
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=serve, name="live-lab", daemon=True)
    thread.start()
    try:
        ready.wait()
        if failure:
            raise failure[0]
        assert lab.exporter is not None
        wait_http(lab.exporter.url + "/healthz")
        analyzer, analyzer_url = start_analyzer(lab.exporter.url, lab.run_dir / "analyzer.log")
        print(f"{plan.scenario.name}: {plan.scenario.description}")
        print(
            f"exporter: {lab.exporter.url}/metrics   analyzer: {analyzer_url}/api/v1/diagnosis"
            f"   HAProxy frontend: http://127.0.0.1:{lab.frontend_port}   lab files: {lab.run_dir}"
        )
        shown = True
        return watch(lab.exporter.url, refresh=1.0, duration=duration, analyzer=analyzer_url)
    finally:
        if analyzer is not None:
            analyzer.terminate()  # SIGTERM: it stops listening and cycling, then exits
            try:
                analyzer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                analyzer.kill()
                analyzer.wait()
        lab.halt()
        thread.join(timeout=60)
        if shown:
            print(f"lab files kept in {lab.run_dir}; remove them with: rm -r {lab.run_dir}")
        else:
            shutil.rmtree(lab.run_dir, ignore_errors=True)
