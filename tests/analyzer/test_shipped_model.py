"""The model gpubalance ships: it loads on this version's features, its report says what it
was trained on, and it judges scenarios it never saw as their truth does."""

from __future__ import annotations

import json

import pytest

from gpubalance.analyzer import evaluate, model, train
from gpubalance.analyzer.features import COLUMNS
from gpubalance.lab import generate

# shipped scenarios (none of them in the model's training data, which is generated families
# only) whose truth the shipped model must mostly agree with, state and cause both
UNSEEN = ("thermal-throttle", "host-bound", "worker-crash", "batch-delay")
AGREEMENT = 0.9


@pytest.fixture(scope="module")
def shipped() -> model.GpuStateClassifier:
    return model.load_shipped()


def test_it_reads_this_versions_feature_columns(shipped: model.GpuStateClassifier) -> None:
    # `make model` retrains it whenever the columns change; load() refuses a stale one
    assert tuple(shipped.feature_names_in_) == COLUMNS
    assert {label.split("/")[0] for label in shipped.classes_} == {
        "starved",
        "overloaded",
        "balanced",
    }


def test_its_report_says_it_saw_every_generated_family() -> None:
    report = json.loads(model.SHIPPED.with_suffix(".report.json").read_text())
    assert report["columns"] == list(COLUMNS)
    assert sorted(report["data"]["families"]) == sorted(generate.family_names("all"))
    assert report["held_out"], "the held-out scores it was trained with"


@pytest.mark.parametrize("name", UNSEEN)
def test_it_judges_a_scenario_it_never_saw(name: str, shipped: model.GpuStateClassifier) -> None:
    (example,) = [e for e in evaluate.shipped_examples() if e.name == name]
    dataset = train.build_dataset([example], workers=1)
    said = evaluate.verdict_labels(shipped, dataset.table)
    agree = sum(s == t for s, t in zip(said, dataset.labels, strict=True)) / len(said)
    assert agree >= AGREEMENT, (name, agree)
