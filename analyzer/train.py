"""Training data from the lab, group k-fold by scenario family, and the model's report.

The lab's fast speed runs each scenario in-process; its samples go through the same frames and
features as a real host's, and its ground truth gives each GPU-window its label. Scores are
always computed with each family held out in turn (never a random split of windows: windows of
one run are near copies of each other), since the analyzer is judged on servers it was not
trained on.

This is the one analyzer module that imports the lab: training is done on the test stand, not
on the hosts the analyzer watches.
"""

from __future__ import annotations

import math
import os
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpubalance.analyzer.features import COLUMNS, FeatureBuilder, FeatureTable
from gpubalance.analyzer.frames import GpuFrame, frames_from_samples

WINDOW_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Example:
    """One lab run to learn from: a scenario document of a family, run for a duration."""

    family: str
    name: str
    document: Mapping[str, Any]  # a scenario, as its YAML file would hold it
    seed: int
    duration_seconds: float | None = None  # the scenario's own when None


@dataclass(frozen=True, slots=True)
class Dataset:
    """Feature rows with their ground-truth labels and the family each came from."""

    table: FeatureTable
    labels: tuple[str, ...]  # "state/cause"
    groups: tuple[str, ...]  # family
    runs: tuple[str, ...]  # example name
    rho: tuple[float, ...] = ()  # the truth's ρ per row, where the rows came from a run

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, mask: np.ndarray) -> Dataset:
        index = np.flatnonzero(mask)
        return Dataset(
            self.table.take(index),
            tuple(self.labels[i] for i in index),
            tuple(self.groups[i] for i in index),
            tuple(self.runs[i] for i in index),
            tuple(self.rho[i] for i in index) if self.rho else (),
        )


def truth_of_frames(example: Example) -> tuple[list[GpuFrame], list[Any]]:
    """Run ``example`` at the lab's fast speed: its frames, and each frame's ground-truth row
    (``gpubalance.lab.truth.TruthRow``; None where the truth has none)."""
    # imported here: only training runs the lab
    from gpubalance.config import validate
    from gpubalance.lab import traffic, truth
    from gpubalance.lab.fast import ORIGIN_SECONDS, simulate
    from gpubalance.lab.scenario import Scenario, plan

    scenario = validate(Scenario, dict(example.document), source=example.name)
    resolved = plan(scenario, example.name)
    duration = example.duration_seconds or scenario.duration_seconds
    requests = traffic.generate(scenario.traffic, duration, example.seed)
    rows = {(round(r.t_start, 6), r.gpu): r for r in truth.compute(resolved, requests, duration)}
    samples: list[Any] = []
    simulate(resolved, requests, example.seed, duration, samples.append)
    frames = list(
        frames_from_samples(
            samples,
            window_seconds=scenario.truth_window_seconds,
            interval_seconds=scenario.interval_seconds,
            origin=ORIGIN_SECONDS,
        )
    )
    return frames, [rows.get((round(f.t_start - ORIGIN_SECONDS, 6), f.gpu)) for f in frames]


def _label(row: Any) -> str:
    return f"{row.state}/{row.cause}" if row is not None else ""


def _labelled_rows(example: Example) -> tuple[list[GpuFrame], list[str]]:
    frames, rows = truth_of_frames(example)
    return frames, [_label(r) for r in rows]


def truth_of_features(example: Example) -> tuple[FeatureTable, list[Any]]:
    """:func:`truth_of_frames` through the features: the table, and each of its rows' truth
    row (the table orders its rows pool by pool, not as the frames came)."""
    frames, rows = truth_of_frames(example)
    table = FeatureBuilder().transform(frames)
    by_key = {(f.t_start, f.gpu): row for f, row in zip(frames, rows, strict=True)}
    return table, [by_key[(f.t_start, f.gpu)] for f in table.frames]


def _featurize(example: Example) -> tuple[FeatureTable, list[str], list[float]]:
    table, rows = truth_of_features(example)
    return table, [_label(r) for r in rows], [math.nan if r is None else r.rho for r in rows]


def build_dataset(
    examples: Sequence[Example],
    *,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Dataset:
    """Run every example at the lab's fast speed and keep the GPU-windows that have a truth.

    Windows without a truth row (a lost GPU, a last window cut short) are left out.
    """
    workers = workers or min(len(examples), os.cpu_count() or 1) or 1
    tables: list[FeatureTable] = []
    labels: list[str] = []
    groups: list[str] = []
    runs: list[str] = []
    rho: list[float] = []
    results: Iterable[tuple[FeatureTable, list[str], list[float]]]
    if workers > 1:
        pool = ProcessPoolExecutor(max_workers=workers)
        results = pool.map(_featurize, examples)
    else:
        pool = None
        results = map(_featurize, examples)
    try:
        for example, (table, row_labels, row_rho) in zip(examples, results, strict=True):
            keep = np.array([bool(label) for label in row_labels], dtype=bool)
            index = np.flatnonzero(keep)
            tables.append(table.take(index))
            labels += [row_labels[i] for i in index]
            groups += [example.family] * len(index)
            runs += [example.name] * len(index)
            rho += [row_rho[i] for i in index]
            if progress is not None:
                progress(1)
    finally:
        if pool is not None:
            pool.shutdown()
    frames = tuple(f for t in tables for f in t.frames)
    values = np.vstack([t.values for t in tables]) if tables else np.zeros((0, len(COLUMNS)))
    table = FeatureTable(frames, values)
    return Dataset(table, tuple(labels), tuple(groups), tuple(runs), tuple(rho))


def state_of(label: str) -> str:
    return label.split("/", 1)[0]


def scores(truth: Sequence[str], predicted: Sequence[str]) -> dict[str, Any]:
    """State macro-F1 (starved, overloaded, balanced), cause accuracy, per-class precision/recall.

    Cause accuracy counts, among the windows that are truly starved or overloaded, those whose
    predicted state and cause are both right.
    """
    from sklearn.metrics import f1_score, precision_recall_fscore_support

    states = ["starved", "overloaded", "balanced"]
    t_state = [state_of(x) for x in truth]
    p_state = [state_of(x) for x in predicted]
    present = [s for s in states if s in t_state or s in p_state]
    precision, recall, f1, support = precision_recall_fscore_support(
        t_state, p_state, labels=present, zero_division=0
    )
    flagged = [i for i, x in enumerate(t_state) if x != "balanced"]
    cause = sum(1 for i in flagged if truth[i] == predicted[i]) / len(flagged) if flagged else None
    return {
        "windows": len(truth),
        "state_macro_f1": float(
            f1_score(t_state, p_state, labels=present, average="macro", zero_division=0)
        ),
        "cause_accuracy": cause,
        "per_state": {
            s: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(n)}
            for s, p, r, f, n in zip(present, precision, recall, f1, support, strict=True)
        },
    }


def cross_validate(
    dataset: Dataset,
    make: Callable[[], Any],
    *,
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Hold out each family in turn; return every window's held-out prediction and the scores."""
    groups = np.asarray(dataset.groups)
    models: dict[str, Any] = {}
    for family in sorted(set(dataset.groups)):
        train = dataset.subset(groups != family)
        models[family] = make().fit(train.table, train.labels)
        if progress is not None:
            progress(1)
    return held_out_scores(dataset, models)


def held_out_scores(
    dataset: Dataset, models: Mapping[str, Any]
) -> tuple[np.ndarray, dict[str, Any]]:
    """Every window's prediction by the model of its family (one fitted without it), and the
    scores: overall, per family and the confusion matrix."""
    groups = np.asarray(dataset.groups)
    predicted = np.empty(len(dataset), dtype=object)
    per_family: dict[str, Any] = {}
    labels = np.asarray(dataset.labels)
    for family in sorted(set(dataset.groups)):
        held = groups == family
        predicted[held] = models[family].predict(dataset.subset(held).table)
        per_family[family] = scores(list(labels[held]), list(predicted[held]))
    overall = scores(list(labels), list(predicted))
    overall["per_family"] = per_family
    overall["confusion"] = confusion(list(labels), list(predicted))
    return predicted, overall


def confusion(truth: Sequence[str], predicted: Sequence[str]) -> dict[str, Any]:
    classes = sorted(set(truth) | set(predicted))
    counts = Counter(zip(truth, predicted, strict=True))
    return {
        "labels": classes,
        "matrix": [[counts[(t, p)] for p in classes] for t in classes],
    }


def commit() -> str | None:
    """The source commit the model was trained from, when run in a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def versions() -> dict[str, str]:
    import sklearn
    import skops

    from gpubalance import __version__

    return {
        "gpubalance": __version__,
        "scikit-learn": sklearn.__version__,
        "skops": skops.__version__,
        "numpy": np.__version__,
    }


def describe(dataset: Dataset) -> dict[str, Any]:
    return {
        "windows": len(dataset),
        "runs": len(set(dataset.runs)),
        "families": dict(sorted(Counter(dataset.groups).items())),
        "labels": dict(sorted(Counter(dataset.labels).items())),
        "window_seconds": WINDOW_SECONDS,
    }
