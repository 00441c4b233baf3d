"""The Prometheus configuration and rules: valid for promtool, every series they name one that
gpubalance serves (or a rule records), every alert unit-tested by promtool before and after its
for:, and none firing on a balanced lab run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from deploy_harness import (
    ALERTS,
    BALANCED,
    BALANCED_SCRIPT,
    PROMETHEUS,
    PROMETHEUS_SERIES,
    RECORDING,
    ROOT,
    RULE_TESTS,
    alerts,
    needs,
    rules,
    run,
    series_named,
)

from gpubalance.metrics_reference import all_metrics


def test_series_named_reads_selectors_not_functions_labels_or_durations() -> None:
    expr = (
        'sum by (instance) (increase(a_total{outcome="applied"}[1h])) >= 20 '
        "and on (uuid) b:c:d > 0.5 unless time() - e_seconds > 30"
    )
    assert series_named(expr) == {"a_total", "b:c:d", "e_seconds"}


@needs("promtool", "prometheus")
def test_promtool_checks_the_config_and_its_rule_files() -> None:
    run("promtool", "check", "config", "prometheus.yml", cwd=PROMETHEUS)
    run("promtool", "check", "rules", RECORDING, ALERTS)


def test_every_series_the_rules_name_is_served_or_recorded() -> None:
    served = {name for metric in all_metrics() for name in metric.series()}
    recorded = {rule["record"] for rule in rules(RECORDING)}
    unknown = {
        (rule.get("alert") or rule["record"], name)
        for rule in rules(RECORDING) + rules(ALERTS)
        for name in series_named(rule["expr"])
        if name not in served | recorded | PROMETHEUS_SERIES
    }
    assert not unknown, f"rules name series nothing serves: {sorted(unknown)}"


# -- promtool unit tests ---------------------------------------------------------------------


def seconds(duration: str) -> float:
    """A Prometheus duration (1h5m30s) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", duration)
    assert "".join(n + u for n, u in parts) == duration, f"not a duration: {duration}"
    return sum(int(n) * units[u] for n, u in parts)


@needs("promtool", "prometheus")
def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    run("promtool", "test", "rules", *sorted(RULE_TESTS.glob("*.yml")))


def test_every_alert_has_a_unit_test_before_and_after_its_for() -> None:
    by_name = {rule["alert"]: rule for rule in alerts()}
    files = {path.stem for path in RULE_TESTS.glob("*.yml")}
    assert files == set(by_name), (
        f"alerts without a test: {sorted(set(by_name) - files)}; "
        f"tests without an alert: {sorted(files - set(by_name))}"
    )
    for name, rule in by_name.items():
        cases = [
            case
            for test in yaml.safe_load((RULE_TESTS / f"{name}.yml").read_text())["tests"]
            for case in test.get("alert_rule_test", [])
            if case["alertname"] == name
        ]
        quiet = [seconds(c["eval_time"]) for c in cases if not c.get("exp_alerts")]
        firing = [c for c in cases if c.get("exp_alerts")]
        assert quiet and firing, f"{name}: needs a case before its for: and one after"
        assert min(quiet) < min(seconds(c["eval_time"]) for c in firing), name
        for case in firing:
            for alert in case["exp_alerts"]:
                assert alert["exp_labels"]["severity"] == rule["labels"]["severity"], name
                assert alert["exp_annotations"] == {
                    "summary": rule["annotations"]["summary"],
                    "description": alert["exp_annotations"]["description"],
                    "runbook_url": rule["annotations"]["runbook_url"],
                }, f"{name}: every annotation, exactly"


# -- a balanced run --------------------------------------------------------------------------


@needs("promtool", "prometheus")
def test_no_alert_fires_on_a_balanced_lab_run(tmp_path: Path) -> None:
    """The series Prometheus would hold after scraping a balanced run (the fixture written by
    tests/deploy/balanced_series.py): no alert at any point of it."""
    fixture = yaml.safe_load(BALANCED.read_text())
    end = seconds(fixture["interval"]) * (len(_values(fixture)) - 1)
    times = [f"{int(t)}s" for t in range(60, int(end) + 1, 60)]
    assert len(times) >= 5, "the run is too short to outlast the alerts' for:"
    test = {
        "rule_files": [str(RECORDING), str(ALERTS)],
        "evaluation_interval": fixture["interval"],
        "tests": [
            {
                "interval": fixture["interval"],
                "input_series": fixture["input_series"],
                "alert_rule_test": [
                    {"eval_time": t, "alertname": rule["alert"], "exp_alerts": []}
                    for rule in alerts()
                    for t in times
                ],
            }
        ],
    }
    path = tmp_path / "balanced-test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    run("promtool", "test", "rules", path)


def _values(fixture: dict) -> list[str]:
    """The samples of the fixture's `up` series (every job is up at every scrape)."""
    up = next(s for s in fixture["input_series"] if s["series"].startswith("up{"))
    samples: list[str] = []
    for term in up["values"].split():
        value, _, count = term.partition("x")
        samples += [value] * (int(count) + 1 if count else 1)
    return samples


def test_the_balanced_fixture_is_what_its_command_writes(tmp_path: Path) -> None:
    out = tmp_path / "balanced.yml"
    subprocess.run(
        [sys.executable, str(BALANCED_SCRIPT), "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert out.read_text() == BALANCED.read_text(), (
        f"regenerate it: PYTHONPATH=tests .venv/bin/python {BALANCED_SCRIPT.relative_to(ROOT)}"
    )
