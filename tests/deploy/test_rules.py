"""The Prometheus configuration and rules: valid for promtool, every series they name one that
gpubalance serves (or a rule records), every alert unit-tested by promtool before and after its
for:, none firing on a balanced lab run and the imbalance alert on a skewed one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_harness import (
    ALERTS,
    DURATION_SECONDS,
    LAB_FIXTURES,
    LAB_SERIES,
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


# -- lab runs --------------------------------------------------------------------------------

SKEWED_POOL = {"host": "skewed-heterogeneous", "pool": "llama-3.2-3b", "severity": "warning"}
IDLE = (
    "Pool llama-3.2-3b on skewed-heterogeneous: {} of its GPU-time over the last 10 minutes "
    "went unused while another GPU of the pool held half a batch or more of waiting requests."
)
# run -> alert -> eval time -> (labels, description) of what fires then; every other alert is
# checked quiet at every minute of the run, and these before their for: has passed
LAB_RUNS: dict[str, dict[str, dict[str, tuple[dict[str, str], str]]]] = {
    "balanced-4x4090": {},
    "skewed-heterogeneous": {
        "GPUBalancePoolImbalance": {
            "20m": (SKEWED_POOL, IDLE.format("67.8%")),
            "30m": (SKEWED_POOL, IDLE.format("68.01%")),
        }
    },
}


@needs("promtool", "prometheus")
@pytest.mark.parametrize("scenario", sorted(LAB_RUNS))
def test_on_lab_runs_only_the_alerts_of_their_trouble_fire(scenario: str, tmp_path: Path) -> None:
    """The series Prometheus would hold after scraping a lab run (the fixtures written by
    tests/deploy/lab_series.py): a balanced run fires nothing, a skewed one the imbalance."""
    fixture = yaml.safe_load((LAB_FIXTURES / f"{scenario}.yml").read_text())
    minutes = range(1, DURATION_SECONDS // 60 + 1)
    by_name = {rule["alert"]: rule for rule in alerts()}
    cases = []
    for name, rule in by_name.items():
        firing = LAB_RUNS[scenario].get(name, {})
        quiet_until = min((seconds(t) for t in firing), default=float("inf")) - seconds(
            rule.get("for", "0s")
        )
        cases += [
            {"eval_time": f"{m}m", "alertname": name, "exp_alerts": []}
            for m in minutes
            if m * 60 <= quiet_until
        ]
        cases += [
            {
                "eval_time": t,
                "alertname": name,
                "exp_alerts": [
                    {
                        "exp_labels": labels,
                        "exp_annotations": {**rule["annotations"], "description": description},
                    }
                ],
            }
            for t, (labels, description) in firing.items()
        ]
    test = {
        "rule_files": [str(RECORDING), str(ALERTS)],
        "evaluation_interval": fixture["interval"],
        "tests": [
            {
                "interval": fixture["interval"],
                "input_series": fixture["input_series"],
                "alert_rule_test": cases,
            }
        ],
    }
    path = tmp_path / f"{scenario}-test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    run("promtool", "test", "rules", path)


def test_the_lab_fixtures_are_what_their_command_writes(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(LAB_SERIES), *sorted(LAB_RUNS), "--out", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        check=True,
        capture_output=True,
        timeout=600,
    )
    for scenario in LAB_RUNS:
        fresh = (tmp_path / f"{scenario}.yml").read_text()
        assert fresh == (LAB_FIXTURES / f"{scenario}.yml").read_text(), (
            f"regenerate: PYTHONPATH=tests .venv/bin/python {LAB_SERIES.relative_to(ROOT)}"
        )
