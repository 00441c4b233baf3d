"""Deploy-test helpers: where the deploy files are, the rules as data, the tools the tests run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "rules" / "alerts.yml"
RECORDING = PROMETHEUS / "rules" / "recording.yml"
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
RUNBOOKS = ROOT / "docs" / "runbooks"
RULE_TESTS = ROOT / "tests" / "deploy" / "rules"
BALANCED = ROOT / "tests" / "deploy" / "fixtures" / "balanced.yml"
BALANCED_SCRIPT = ROOT / "tests" / "deploy" / "balanced_series.py"


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


@dataclass
class RunningAlertmanager:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def request(self, path: str, body: object | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else None
