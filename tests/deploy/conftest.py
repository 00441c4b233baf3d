"""Fixtures of the deploy tests: a real Alertmanager on the example configuration."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_harness import ALERTMANAGER, RunningAlertmanager

ALERTMANAGER_BINARY = "prometheus-alertmanager"  # Debian's name for the alertmanager binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[RunningAlertmanager]:
    """deploy/alertmanager/alertmanager.yml in a real Alertmanager, alone (no cluster)."""
    if shutil.which(ALERTMANAGER_BINARY) is None:
        pytest.skip("alertmanager is missing: apt-get install prometheus-alertmanager")
    url = f"http://127.0.0.1:{_free_port()}"
    log = tmp_path / "alertmanager.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                ALERTMANAGER_BINARY,
                f"--config.file={ALERTMANAGER}",
                f"--storage.path={tmp_path / 'data'}",
                f"--web.listen-address={url.removeprefix('http://')}",
                "--cluster.listen-address=",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    running = RunningAlertmanager(url, process, log)
    deadline = time.monotonic() + 30
    while True:
        assert process.poll() is None, f"alertmanager exited:\n{log.read_text()}"
        try:
            urllib.request.urlopen(url + "/-/ready", timeout=2).close()
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline, f"alertmanager not ready:\n{log.read_text()}"
            time.sleep(0.1)
    yield running
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
