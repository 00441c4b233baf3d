"""Deploy-test helpers: where the deploy files are, the rules as data, the tools the tests run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpubalance.lab.live import ports

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "rules" / "alerts.yml"
RECORDING = PROMETHEUS / "rules" / "recording.yml"
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
RUNBOOKS = ROOT / "docs" / "runbooks"
RULE_TESTS = ROOT / "tests" / "deploy" / "rules"  # one promtool test per alert
RECORDING_TEST = ROOT / "tests" / "deploy" / "recording" / "recording.yml"
LAB_FIXTURES = ROOT / "tests" / "deploy" / "fixtures"  # tests/deploy/lab_series.py writes them
LAB_SERIES = ROOT / "tests" / "deploy" / "lab_series.py"
DURATION_SECONDS = 1800  # of each lab run there


def needs(command: str, package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        shutil.which(command) is None,
        reason=f"{command} is missing: apt-get install {package} (make system-deps does it)",
    )


def run(*command: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a tool; a failure shows what it said."""
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


def rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return rules(ALERTS)


# what Prometheus serves itself, beside our series
PROMETHEUS_SERIES = {"up"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def series_named(expr: str) -> set[str]:
    """The series an expression selects: every name that is not a function, an aggregation, a
    keyword, a label or a duration."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group().lower() in KEYWORDS:
            continue
        names.add(match.group())
    return names


def series_read_by_rules() -> set[str]:
    """The series the rules select, recorded ones left out."""
    recorded = {rule["record"] for rule in rules(RECORDING)}
    return {
        name for rule in rules(RECORDING) + alerts() for name in series_named(rule["expr"])
    } - recorded


LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")


@dataclass
class Process:
    """A gpubalance process started by a test, and where it listens."""

    process: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return response.read().decode()

    def json(self, path: str, body: object | None = None) -> Any:
        """GET ``path``, or POST ``body`` to it as JSON; the answer's JSON."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else None

    def wait_for(self, path: str, check: Callable[[str], bool], timeout: float = 60.0) -> str:
        """The first answer ``check`` accepts, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"exited:\n{self.log.read_text()}"
            try:
                text = self.get(path)
            except urllib.error.HTTPError as error:  # 503 until the first sample or cycle
                text = f"HTTP {error.code}"
            except urllib.error.URLError as error:  # not listening yet
                text = str(error.reason)
            if check(text):
                return text
            assert time.monotonic() < deadline, f"{path} never as expected:\n{text}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start(
    args: list[str], log: Path, env: Mapping[str, str] | None = None, timeout: float = 60.0
) -> Process:
    """``python -m gpubalance ARGS`` listening on a free port: returns once it says where."""
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "gpubalance", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
        )
    process = Process(popen, log)
    deadline = time.monotonic() + timeout
    while not (match := LISTENING.search(log.read_text(errors="replace"))):
        assert popen.poll() is None, f"{args[0]} exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{args[0]} did not listen:\n{log.read_text()}"
        time.sleep(0.05)
    process.url = match.group(1)
    return process


@dataclass
class Scrapes:
    """/metrics of each process (exporter, analyzer, controller), and where each listens."""

    texts: dict[str, str]
    urls: dict[str, str]


def start_prometheus(directory: Path) -> Process:
    """A real Prometheus on ``directory``/prometheus.yml, its TSDB beside it; returns once
    it is ready."""
    server = ports.start_prometheus(directory / "prometheus.yml", directory / "tsdb")
    return Process(server.process, server.log_path, server.url)
