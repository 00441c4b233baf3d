"""The two rule baselines: a DCGM-style utilization alert and the queue + utilization rule."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
from sklearn.exceptions import NotFittedError

from gpubalance.analyzer.baselines import (
    LABELS,
    QueueUtilization,
    UtilizationThreshold,
    split_label,
)
from gpubalance.analyzer.features import COLUMNS, FeatureBuilder, FeatureTable
from gpubalance.analyzer.frames import GpuFrame, frames_from_samples
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario
from gpubalance.lab.fast import ORIGIN_SECONDS
from gpubalance.telemetry import Sample


def _run(name: str, seconds: float, out: Path) -> tuple[FeatureTable, dict[tuple[float, int], str]]:
    samples: list[Sample] = []
    lab_run.run(scenario.load(name), "fast", seconds, 1, out, on_sample=samples.append)
    frames = frames_from_samples(
        samples, window_seconds=30.0, interval_seconds=1.0, origin=ORIGIN_SECONDS
    )
    with (out / "truth.csv").open() as stream:
        truth = {
            (float(r["t_start"]), int(r["gpu"])): f"{r['state']}/{r['cause']}"
            for r in csv.DictReader(stream)
        }
    return FeatureBuilder().transform(frames), truth


@pytest.fixture(scope="module")
def steady(tmp_path_factory: pytest.TempPathFactory) -> tuple[FeatureTable, dict]:
    return _run("steady-4gpu-40rps", 300, tmp_path_factory.mktemp("steady"))


def _table(frames: tuple[GpuFrame, ...], rows: list[dict[str, float]]) -> FeatureTable:
    """A table of given feature values (NaN where a row says nothing) over real frames."""
    values = np.full((len(rows), len(COLUMNS)), math.nan)
    for i, row in enumerate(rows):
        for name, value in row.items():
            values[i, COLUMNS.index(name)] = value
    return FeatureTable(frames[: len(rows)], values)


def test_the_threshold_rule_reads_utilization_alone(steady: tuple[FeatureTable, dict]) -> None:
    table = _table(
        steady[0].frames,
        [
            {"utilization_ratio": 0.1, "queue_batches": 5.0},
            {"utilization_ratio": 0.5},
            {"utilization_ratio": 0.95, "queue_batches": 0.0},
            {"queue_batches": 5.0},
        ],
    )
    predicted = UtilizationThreshold().fit(table).predict(table).tolist()
    assert predicted == ["starved/low_demand", "balanced/none", "overloaded/none", "unknown/none"]


def test_the_queue_rule_needs_a_backlog_and_a_busy_gpu(steady: tuple[FeatureTable, dict]) -> None:
    busy = {"utilization_ratio": 0.97, "queue_batches": 2.0}
    rows = [
        busy,
        {**busy, "pool_busy_share": 1.0},
        {**busy, "clock_ratio": 0.5, "throttled_ratio": 1.0},
        {**busy, "allocation_failures_per_completion": 0.2},
        {"utilization_ratio": 0.97, "queue_batches": 0.2},  # busy, nothing waits
        {"utilization_ratio": 0.5, "queue_batches": 3.0},  # a backlog it does not serve
        {"utilization_ratio": 0.6, "queue_batches": 0.0, "idle_while_peer_queued": 0.8},
        {"utilization_ratio": 0.6, "queue_batches": 0.0, "idle_while_peer_queued": 0.2},
        {"utilization_ratio": 0.1, "queue_batches": 0.0},
        {"utilization_ratio": 0.1, "queue_batches": 0.0, "peer_queue_max_batches": 3.0},
        {"utilization_ratio": 0.1, "queue_batches": 0.0, "feeder_cpu_pinned": 1.0},
        {"utilization_ratio": 0.1, "queue_batches": 0.0, "host_io_pressure_ratio": 0.7},
        {"utilization_ratio": 0.97},  # no queue figures: busy, but nothing says why
        {"utilization_ratio": 0.1},  # no queue figures: idle says enough
    ]
    rows[6]["peer_queue_max_batches"] = 2.0
    table = _table(steady[0].frames, rows)
    assert QueueUtilization().fit(table).predict(table).tolist() == [
        "overloaded/routing_skew",
        "overloaded/capacity_shortage",
        "overloaded/throttling",
        "overloaded/memory_pressure",
        "balanced/none",
        "balanced/none",
        "starved/routing_skew",
        "balanced/none",
        "starved/low_demand",
        "starved/routing_skew",
        "starved/host_bound",
        "starved/io_bound",
        "unknown/none",
        "starved/low_demand",
    ]


@pytest.mark.parametrize("classifier", [UtilizationThreshold(), QueueUtilization()])
def test_probabilities_follow_classes_and_the_rule(
    classifier: UtilizationThreshold | QueueUtilization, steady: tuple[FeatureTable, dict]
) -> None:
    table = steady[0]
    classifier.fit(table)
    assert list(classifier.classes_) == sorted(classifier.classes_)
    assert set(classifier.classes_) <= set(LABELS)
    proba = classifier.predict_proba(table)
    assert proba.shape == (len(table.frames), len(classifier.classes_))
    assert np.allclose(proba.sum(axis=1), 1.0) and (proba >= 0).all()
    assert (classifier.classes_[proba.argmax(axis=1)] == classifier.predict(table)).all()


def test_confidence_grows_with_the_distance_from_the_threshold(
    steady: tuple[FeatureTable, dict],
) -> None:
    utilization = [0.90, 0.95, 1.0, 0.30, 0.15]
    table = _table(steady[0].frames, [{"utilization_ratio": u} for u in utilization])
    classifier = UtilizationThreshold().fit(table)
    best = classifier.predict_proba(table).max(axis=1)
    # at a threshold a coin toss; one scale (5 points) past it 73 %; three past it 95 %
    assert best == pytest.approx([0.5, 0.731, 0.881, 0.5, 0.953], abs=0.002)
    assert classifier.predict(table).tolist()[:1] == ["overloaded/none"]  # >= 90 % is over


def test_fit_checks_labels_and_returns_the_classifier(steady: tuple[FeatureTable, dict]) -> None:
    table = steady[0]
    rule = QueueUtilization()
    with pytest.raises(NotFittedError, match="call fit first"):
        rule.predict(table)
    assert rule.fit(table, ["balanced/none"] * len(table.frames)) is rule
    with pytest.raises(ValueError, match="not a verdict label: 'balanced/throttling'"):
        rule.fit(table, ["balanced/throttling"] * len(table.frames))
    with pytest.raises(ValueError, match="1 labels for"):
        rule.fit(table, ["balanced/none"])
    assert split_label("starved/host_bound") == ("starved", "host_bound")


def test_a_busy_healthy_server_fools_the_alert_not_the_queue_rule(
    steady: tuple[FeatureTable, dict],
) -> None:
    # NVML utilization is near 100 % at rho ~0.45: the server is balanced (the truth says so)
    table, truth = steady
    states = {truth[(f.t_start - ORIGIN_SECONDS, f.gpu)].split("/")[0] for f in table.frames}
    assert states == {"balanced"}
    alert = UtilizationThreshold().fit(table).predict(table)
    rule = QueueUtilization().fit(table).predict(table)
    assert np.mean(alert == "overloaded/none") >= 0.9
    assert np.mean(rule == "balanced/none") >= 0.9


def test_the_queue_rule_sees_routing_skew(tmp_path: Path) -> None:
    table, truth = _run("skewed-heterogeneous", 240, tmp_path)
    predicted = QueueUtilization().fit(table).predict(table).tolist()
    expected = [truth[(f.t_start - ORIGIN_SECONDS, f.gpu)] for f in table.frames]
    agree = sum(p == e for p, e in zip(predicted, expected, strict=True))
    assert agree / len(expected) >= 0.9
    assert {p for p, f in zip(predicted, table.frames, strict=True) if f.gpu == 0} == {
        "overloaded/routing_skew"
    }
