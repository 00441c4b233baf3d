"""Deploy-test helpers: where the deploy files are, the rules as data, the tools the tests run."""

from __future__ import annotations

import shutil
import subprocess
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
