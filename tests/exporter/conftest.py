"""Fixtures that run the real exporter process on the fake NVML driver."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from harness import RunningExporter

from gpubalance.lab.fakenvml import write_state

LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")

ExporterFactory = Callable[..., RunningExporter]


@pytest.fixture
def start_exporter(
    fakenvml_env: Callable[[str | Path], dict[str, str]], tmp_path: Path
) -> Iterator[ExporterFactory]:
    """start_exporter(state, *flags, env=None, wait=True): the exporter as a subprocess."""
    running: list[RunningExporter] = []

    def start(
        state: Mapping[str, object] | None,
        *flags: str,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
    ) -> RunningExporter:
        n = len(running)
        state_path = tmp_path / f"nvml-{n}.state"
        if state is not None:
            write_state(state_path, state)
        log_path = tmp_path / f"exporter-{n}.log"
        environment = {**fakenvml_env(state_path), **(env or {})}
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpubalance",
                    "exporter",
                    "--listen",
                    "127.0.0.1:0",
                    "--otlp-listen",  # never OTLP's fixed 4318: tests run side by side
                    "127.0.0.1:0",
                    "--interval",
                    "0.2",
                    "--window",
                    "1",
                    "--trend-window",
                    "5",
                    *flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
            )
        exporter = RunningExporter(process, "", log_path, state_path)
        running.append(exporter)
        deadline = time.monotonic() + 30
        while not (match := LISTENING.search(exporter.log())):
            assert process.poll() is None, f"exporter exited early:\n{exporter.log()}"
            assert time.monotonic() < deadline, f"exporter did not listen:\n{exporter.log()}"
            time.sleep(0.05)
        exporter.url = match.group(1)
        if wait:
            while exporter.get("/healthz")[0] != 200:
                assert time.monotonic() < deadline, f"no sample:\n{exporter.log()}"
                time.sleep(0.05)
        return exporter

    yield start
    for exporter in running:
        exporter.stop()
