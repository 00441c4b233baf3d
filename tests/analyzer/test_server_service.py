"""The analyzer's cycle on a lab run directory that breaks and mends: errors counted by reason,
verdicts unknown while it is broken, judged again once it mends."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from gpubalance.analyzer.baselines import QueueUtilization
from gpubalance.analyzer.features import FeatureTable
from gpubalance.analyzer.service import AnalyzerService
from gpubalance.analyzer.sources import LabRunSource
from gpubalance.analyzer.verdict import Diagnosis
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("skewed")
    lab_run.run(scenario.load("skewed-heterogeneous"), "fast", 90, 1, out, snapshots=True)
    return out


def test_a_source_that_breaks_and_mends(recorded: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(recorded, run_dir)
    service = AnalyzerService(LabRunSource(run_dir), QueueUtilization())
    service.cycle()
    judged = service.diagnosis()
    assert judged.source.up and len(judged.gpus) == 4
    assert all(v.state != "unknown" for v in judged.gpus)

    (run_dir / "snapshots.jsonl").write_text("{not a snapshot\n")
    service.cycle()
    broken = service.diagnosis(history=1)
    assert broken.source.up is False and "not a gpubalance snapshot" in str(broken.source.error)
    assert [v.state for v in broken.gpus] == ["unknown"] * 4
    assert all(str(v.unknown_reason).startswith("source down: ") for v in broken.gpus)
    assert broken.history == judged.gpus  # what it said last is history now
    assert broken.source.last_success_seconds == judged.source.last_success_seconds

    for name in ("snapshots.jsonl", "frames.csv"):
        (run_dir / name).unlink()
    service.cycle()
    assert service.health().source_errors == {"bad_answer": 1, "no_data": 1}

    shutil.copy(recorded / "snapshots.jsonl", run_dir / "snapshots.jsonl")
    service.cycle()
    mended = service.diagnosis()
    assert mended.source.up is True and mended.source.error is None
    assert mended.gpus == judged.gpus
    health = service.health()
    assert health.cycles == 4 and health.cycle_seconds_total > 0


class WrongRecommender:
    """Gives what is not a Recommendation: a bug in a recommender, not in the service."""

    def recommend(self, diagnosis: Diagnosis, table: FeatureTable, now_seconds: float) -> tuple:
        return ({"action": "drain"},)


def test_a_recommender_that_gives_the_wrong_type_costs_its_recommendations(
    recorded: Path,
) -> None:
    service = AnalyzerService(LabRunSource(recorded), QueueUtilization(), WrongRecommender())
    service.cycle()
    assert len(service.diagnosis().gpus) == 4
    assert service.recommendations().recommendations == ()
    assert service.health().cycle_failures == {"recommend": 1}


class BreakingClassifier(QueueUtilization):
    """The queue rule until ``broken``: then what a model from another version might do."""

    broken = False

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        if self.broken:
            raise ValueError("X has 31 features, but the model is expecting 30 features")
        return super().predict_proba(table)


def test_a_diagnosis_that_fails_turns_the_gpus_unknown_with_the_reason(recorded: Path) -> None:
    classifier = BreakingClassifier()
    service = AnalyzerService(LabRunSource(recorded), classifier)
    service.cycle()
    judged = service.diagnosis()
    classifier.broken = True
    service.cycle()
    failed = service.diagnosis(history=1)
    assert failed.source.up is True  # the source was fine
    assert [v.state for v in failed.gpus] == ["unknown"] * 4
    assert all("diagnosis failed" in str(v.unknown_reason) for v in failed.gpus)
    assert "expecting 30 features" in str(failed.gpus[0].unknown_reason)
    assert failed.history == judged.gpus
    assert service.health().cycle_failures == {"diagnose": 1}


@pytest.fixture(scope="module")
def longer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("skewed-long")
    lab_run.run(scenario.load("skewed-heterogeneous"), "fast", 300, 1, out, snapshots=True)
    return out


class CountingClassifier(QueueUtilization):
    """The queue rule, counting the rows it is asked of in each call."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        self.asked.append(len(table.frames))
        return super().predict_proba(table)


def test_a_growing_run_is_judged_as_a_full_rebuild_judges_it(longer: Path, tmp_path: Path) -> None:
    # each cycle builds only the windows the last had not made final, and asks the classifier
    # of those alone; cut anywhere, mid-window too, the newest window of a cycle is whole only
    # in the next
    lines = (longer / "snapshots.jsonl").read_bytes().splitlines(keepends=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    counting = CountingClassifier()
    growing = AnalyzerService(LabRunSource(run_dir), counting)
    for cut in (40, 75, 76, 140, 205, len(lines), len(lines)):
        (run_dir / "snapshots.jsonl").write_bytes(b"".join(lines[:cut]))
        growing.cycle()
    assert growing.health().cycle_failures == {}
    fresh = AnalyzerService(LabRunSource(run_dir), QueueUtilization())
    fresh.cycle()
    # a cycle with nothing new asks of the newest window alone, which no cycle made final,
    # not of the 40 GPU-windows its table holds
    gpus = len(fresh.diagnosis().gpus)
    assert counting.asked[-1] == gpus < len(fresh.diagnosis(history=100).history)
    rebuilt, kept = fresh.diagnosis(history=100), growing.diagnosis(history=100)
    assert len(kept.history) > 30
    assert kept.gpus == rebuilt.gpus
    assert kept.history == rebuilt.history
    assert kept.fleet_history == rebuilt.fleet_history
