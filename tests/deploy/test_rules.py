"""The Prometheus configuration and rules: valid for promtool, every series they name one that
gpubalance serves (or a rule records), all of them evaluated by a real Prometheus scraping the
three processes, every alert unit-tested by promtool before and after its for:, and on lab runs
just the alerts of their trouble firing (none on a balanced one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
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
    RECORDING_TEST,
    ROOT,
    RULE_TESTS,
    Scrapes,
    alerts,
    needs,
    rules,
    run,
    series_named,
    start_prometheus,
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


@needs("prometheus", "prometheus")
def test_a_real_prometheus_scrapes_the_three_jobs_and_evaluates_every_rule(
    scrapes: Scrapes, tmp_path: Path
) -> None:
    """deploy/prometheus/prometheus.yml with its targets pointed at an exporter on the fake
    driver, an analyzer and a controller: every target up, the exporter's instance its host
    name, every rule evaluated without error and the recording rules giving series."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RECORDING), str(ALERTS)]
    del config["alerting"]  # no Alertmanager here
    for job in config["scrape_configs"]:
        url = scrapes.urls[job["job_name"].removeprefix("gpubalance-")]
        job["static_configs"] = [{"targets": [url.removeprefix("http://")]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = start_prometheus(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            targets = prometheus.json("/api/v1/targets")["data"]["activeTargets"]
            groups = prometheus.json("/api/v1/rules")["data"]["groups"]
            evaluated = [r for g in groups for r in g["rules"] if r["lastEvaluation"] > "2000"]
            recorded = {
                r["name"]
                for r in evaluated
                if r["type"] == "recording"
                and prometheus.json(f"/api/v1/query?query={r['name']}")["data"]["result"]
            }
            if (
                len(targets) == 3
                and all(t["health"] == "up" for t in targets)
                and len(evaluated) == len(rules(RECORDING)) + len(alerts())
                and recorded == {rule["record"] for rule in rules(RECORDING)}
            ):
                break
            assert time.monotonic() < deadline, (
                f"targets {[(t['labels'], t['health'], t['lastError']) for t in targets]}; "
                f"{len(evaluated)} rules evaluated; recorded {sorted(recorded)}"
            )
            time.sleep(0.5)
    finally:
        prometheus.stop()
    errors = [(r["name"], r["lastError"]) for r in evaluated if r["health"] != "ok"]
    assert not errors, errors
    exporter = next(t for t in targets if t["labels"]["job"] == "gpubalance-exporter")
    assert exporter["labels"]["instance"] == "127.0.0.1", "the port is not dropped"


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


@needs("promtool", "prometheus")
def test_promtool_unit_test_of_the_recording_rules_passes() -> None:
    run("promtool", "test", "rules", RECORDING_TEST)


def test_every_recording_rule_has_an_expected_value() -> None:
    tested = {
        case["expr"]
        for test in yaml.safe_load(RECORDING_TEST.read_text())["tests"]
        for case in test.get("promql_expr_test", [])
    }
    assert tested == {rule["record"] for rule in rules(RECORDING)}


# -- lab runs --------------------------------------------------------------------------------

Firing = tuple[dict[str, str], str]  # labels, description
# the last minute it is quiet (its trouble starts, then its for: runs), and what fires when
Expected = tuple[int, dict[str, Firing]]
IDLE = (
    "Pool {pool} on {host}: {value} of its GPU-time over the last 10 minutes went unused while "
    "another GPU of the pool held half a batch or more of waiting requests."
)
ANALYZER = {"instance": "127.0.0.1:9451", "job": "gpubalance-analyzer"}
THROTTLED_GPU = {"gpu": "1", "uuid": "GPU-00000001-2684-4c2d-9e3f-000000000001"}
LOST_GPU = {"gpu": "2", "uuid": "GPU-00000002-2204-4c2d-9e3f-000000000002"}


def imbalance(quiet: int, host: str, pool: str, values: tuple[str, str]) -> Expected:
    labels = {"host": host, "pool": pool, "severity": "warning"}
    return quiet, {
        t: (labels, IDLE.format(pool=pool, host=host, value=value))
        for t, value in zip(("20m", "30m"), values, strict=True)
    }


def both_times(quiet: int, labels: dict[str, str], description: str) -> Expected:
    return quiet, {t: (labels, description) for t in ("20m", "30m")}


# run -> alert -> what is expected of it; every other alert is checked quiet at every minute
LAB_RUNS: dict[str, dict[str, Expected]] = {
    "balanced-4x4090": {},
    "skewed-heterogeneous": {
        "GPUBalancePoolImbalance": imbalance(
            10, "skewed-heterogeneous", "llama-3.2-3b", ("67.8%", "68.01%")
        ),
    },
    "thermal-throttle": {
        "GPUBalancePoolImbalance": imbalance(
            13, "thermal-throttle", "llama-3.1-8b", ("44.85%", "46.5%")
        ),
        "GPUBalanceGpuThrottled": both_times(
            8,
            {
                **THROTTLED_GPU,
                "instance": "thermal-throttle",
                "job": "gpubalance-exporter",
                "reason": "hw_thermal_slowdown",
                "severity": "warning",
            },
            f"GPU 1 ({THROTTLED_GPU['uuid']}) on thermal-throttle has been slowed by "
            "hw_thermal_slowdown in 100% of the last 10 minutes.",
        ),
        "GPUBalanceGpuOverloadedQueueGrowing": both_times(
            13,
            {
                **THROTTLED_GPU,
                **ANALYZER,
                "cause": "throttling",
                "host": "thermal-throttle",
                "state": "overloaded",
                "severity": "critical",
            },
            f"GPU 1 ({THROTTLED_GPU['uuid']}) on thermal-throttle has been overloaded for 10 "
            "minutes, cause throttling, and its queue is still growing.",
        ),
    },
    "gpu-lost": {
        "GPUBalanceGpuLost": both_times(
            3,
            {
                **LOST_GPU,
                "instance": "gpu-lost",
                "job": "gpubalance-exporter",
                "severity": "critical",
            },
            f"GPU 2 ({LOST_GPU['uuid']}) on gpu-lost has been lost or gone for a minute (or NVML "
            "is down on the host); its readings are absent.",
        ),
        "GPUBalanceAnalyzerUnknown": both_times(
            12,
            {
                **LOST_GPU,
                **ANALYZER,
                "cause": "none",
                "host": "gpu-lost",
                "state": "unknown",
                "severity": "warning",
            },
            f"The analyzer has had no verdict for GPU 2 ({LOST_GPU['uuid']}) on gpu-lost for 10 "
            "minutes; /api/v1/diagnosis gives the reason.",
        ),
    },
}


@needs("promtool", "prometheus")
@pytest.mark.parametrize("scenario", sorted(LAB_RUNS))
def test_on_lab_runs_just_the_alerts_of_their_trouble_fire(scenario: str, tmp_path: Path) -> None:
    """The series Prometheus would hold after scraping a lab run (the fixtures written by
    tests/deploy/lab_series.py): a balanced run fires nothing, a skewed one the imbalance, a
    throttled card and a lost one their own alerts and what follows from them."""
    fixture = yaml.safe_load((LAB_FIXTURES / f"{scenario}.yml").read_text())
    minutes = range(1, DURATION_SECONDS // 60 + 1)
    by_name = {rule["alert"]: rule for rule in alerts()}
    cases = []
    for name, rule in by_name.items():
        quiet, firing = LAB_RUNS[scenario].get(name, (minutes[-1], {}))
        cases += [
            {"eval_time": f"{m}m", "alertname": name, "exp_alerts": []}
            for m in minutes
            if m <= quiet
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


# regenerating a fixture runs its scenario for 30 simulated minutes (15 s on 2 cores): the
# balanced run, on which no alert may fire, stands for the one code path that writes all four
REGENERATED = "balanced-4x4090"


def test_the_lab_fixtures_are_what_their_command_writes(tmp_path: Path) -> None:
    assert REGENERATED in LAB_RUNS
    subprocess.run(
        [sys.executable, str(LAB_SERIES), REGENERATED, "--out", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        check=True,
        capture_output=True,
        timeout=600,
    )
    fresh = (tmp_path / f"{REGENERATED}.yml").read_text()
    assert fresh == (LAB_FIXTURES / f"{REGENERATED}.yml").read_text(), (
        f"regenerate: PYTHONPATH=tests .venv/bin/python {LAB_SERIES.relative_to(ROOT)}"
    )
