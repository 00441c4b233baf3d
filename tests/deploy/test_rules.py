"""The Prometheus configuration and rules: valid for promtool, and every series they name is one
that gpubalance serves (or a rule records)."""

from __future__ import annotations

import re

from deploy_harness import ALERTS, PROMETHEUS, RECORDING, needs, rules, run

from gpubalance.metrics_reference import all_metrics

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
