"""The verdict step gives the verdicts it gave when it judged a row at a time.

Verdicts works over the rows of a window in numpy; tests/analyzer/verdict_reference.py is the
step as it was (a row at a time in Python), frozen. Both judge the same feature tables, every
verdict and fleet verdict compared field for field, evidence word for word: every generated lab
family as hosts of one fleet, and the same fleet with readings missing or NaN, frames dropped,
GPUs lost, stale or out of samples, queues gone, hosts reporting from a later window; by the
two baselines and by a seeded classifier whose answers wander over every label (NaN among
them), so persistence, hysteresis and the causes' rules meet every case.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import random
from collections.abc import Sequence

import numpy as np
import pytest
from analyzer_harness import frozen, generated_fleet

from gpubalance.analyzer.baselines import LABELS, QueueUtilization, UtilizationThreshold
from gpubalance.analyzer.features import FeatureBuilder, FeatureTable
from gpubalance.analyzer.frames import GpuFrame
from gpubalance.analyzer.verdict import Diagnosis, Verdicts

# windows enough for persistence to hold, change and hold back several times per GPU
DURATION_SECONDS = 240.0
OPTIONAL = tuple(f.name for f in dataclasses.fields(GpuFrame) if "None" in str(f.type))
FIGURES = tuple(
    f.name for f in dataclasses.fields(GpuFrame) if "float" in str(f.type) and "None" in str(f.type)
)


@pytest.fixture(scope="module")
def fleet() -> list[GpuFrame]:
    """Every family's first variant as a host of its own, its GPUs' UUIDs its own."""
    return generated_fleet(DURATION_SECONDS)


def _damaged(frames: Sequence[GpuFrame], seed: int) -> list[GpuFrame]:
    """What real telemetry does: readings missing or NaN, frames dropped, GPUs lost, stale or
    without samples, queues gone for a while, a host that starts reporting late."""
    rng = random.Random(seed)
    late = {f.host for f in frames if rng.random() < 0.002}
    first = min(f.t_start for f in frames)
    out = []
    for frame in frames:
        if rng.random() < 0.05 or (frame.host in late and frame.t_start < first + 90):
            continue
        changes: dict[str, object] = {name: None for name in OPTIONAL if rng.random() < 0.08}
        changes |= {name: math.nan for name in FIGURES if rng.random() < 0.02}
        if rng.random() < 0.01:
            changes["completions_per_second"] = math.inf
        if rng.random() < 0.03:
            changes["lost"] = True
        if rng.random() < 0.03:
            changes["sample_count"] = 0
        if rng.random() < 0.03:
            changes["sample_count"] = frame.expected_sample_count // 3
            changes["stale_sample_count"] = frame.expected_sample_count // 2
            changes["stale_call"] = rng.choice(["nvmlDeviceGetPowerUsage", "nvmlInit", None])
        if rng.random() < 0.06:
            changes["queue_names"] = ()
            changes["serving_queues"] = 0
        if rng.random() < 0.05:
            changes["throttle_reasons"] = frozenset({"hw_thermal_slowdown"})
        if rng.random() < 0.05:
            changes["allocation_failures"] = 3.0
        out.append(dataclasses.replace(frame, **changes))
    return out


class Wandering:
    """Probabilities over every label that drift from window to window (seeded): states held,
    left, leaned towards and changed; a few rows NaN."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def fit(self, table: FeatureTable) -> Wandering:
        self.classes_ = np.array(LABELS)
        return self

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        favourite: dict[tuple[str, str], int] = {}
        rows = []
        for frame in table.frames:
            key = (frame.host, frame.uuid)
            if key not in favourite or rng.random() < 0.3:
                favourite[key] = int(rng.integers(len(LABELS)))
            row = rng.dirichlet(np.full(len(LABELS), 0.3))
            row[favourite[key]] += rng.choice([0.2, 1.0, 3.0])
            rows.append(row / row.sum())
        out = np.array(rows).reshape(len(table.frames), len(LABELS))
        out[rng.random(len(out)) < 0.01] = np.nan
        return out


def _assert_same(new: Diagnosis, old: object) -> None:
    # repr: NaN confidences compare equal as text, and a difference shows the verdict
    assert len(new.verdicts) == len(old.verdicts)  # type: ignore[attr-defined]
    for mine, theirs in zip(new.verdicts, old.verdicts, strict=True):  # type: ignore[attr-defined]
        assert repr(mine) == repr(theirs)
    assert [repr(f) for f in new.fleet] == [repr(f) for f in old.fleet]  # type: ignore[attr-defined]


def _judge_both(frames: list[GpuFrame], classifier: object, **options: object) -> Diagnosis:
    table = FeatureBuilder().transform(frames)
    fitted = classifier.fit(table)  # type: ignore[attr-defined]
    new = Verdicts(fitted, **options).diagnose(table)  # type: ignore[arg-type]
    # the reference at the same settings: Verdicts' defaults may have moved since it froze
    settings = {
        name: p.default
        for name, p in inspect.signature(Verdicts).parameters.items()
        if p.default is not inspect.Parameter.empty
    } | options
    reference = frozen("verdict_reference").Verdicts(fitted, **settings)
    _assert_same(new, reference.diagnose(table))
    return new


CLASSIFIERS = {
    "queue": lambda: QueueUtilization(),
    "threshold": lambda: UtilizationThreshold(),
    "wandering": lambda: Wandering(7),
}


@pytest.mark.parametrize("name", sorted(CLASSIFIERS))
def test_a_fleet_of_every_family_gets_the_same_verdicts(fleet: list[GpuFrame], name: str) -> None:
    diagnosis = _judge_both(fleet, CLASSIFIERS[name]())
    assert len({v.state for v in diagnosis.verdicts}) >= 3


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", sorted(CLASSIFIERS))
def test_damaged_telemetry_gets_the_same_verdicts(
    fleet: list[GpuFrame], name: str, seed: int
) -> None:
    diagnosis = _judge_both(_damaged(fleet, seed), CLASSIFIERS[name]())
    assert "unknown" in {v.state for v in diagnosis.verdicts}


@pytest.mark.parametrize(
    "options",
    [
        {"persistence_windows": 1},
        {"persistence_windows": 3, "enter_confidence": 0.45, "leave_confidence": 0.45},
        {"min_coverage_ratio": 0.9, "enter_confidence": 0.9, "leave_confidence": 0.1},
        {"abandon_confidence": 0.0},
        {"abandon_confidence": 0.3, "enter_confidence": 0.9},
    ],
)
def test_other_settings_get_the_same_verdicts(
    fleet: list[GpuFrame], options: dict[str, object]
) -> None:
    _judge_both(_damaged(fleet, 3), Wandering(11), **options)


def test_one_gpu_and_no_rows_get_the_same_verdicts(fleet: list[GpuFrame]) -> None:
    one = [f for f in fleet if (f.host, f.gpu) == ("host-01", 0)]
    _judge_both(one, Wandering(5))
    _judge_both([], QueueUtilization())
