"""Held-out accuracy: each generated family held out in turn, on the model and on the verdicts.

Draws COUNT variants of every family (`gpubalance.lab.generate`, seed SEED), runs each at the
lab's fast speed in-process, labels its windows from the lab's truth, and scores with group
k-fold by family (`gpubalance.analyzer.train.cross_validate`): the raw model's labels, and the
verdicts (`Verdicts` over the held-out model: rules, persistence and hysteresis included; an
`unknown` verdict counts as wrong). Prints state macro-F1 and cause accuracy overall and per
family, and the confusion matrix of the verdicts.

The lab's frames and labels of each run are cached under CACHE (keyed by the scenario and the
lab's source), so a second run only recomputes the features and the model. JOBS processes run
the lab and then the held-out fits (one family each at a time).

    python bench/accuracy.py [--count 3] [--seed 1] [--jobs 1] [--cache DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import numpy as np  # noqa: E402
from results import progress  # noqa: E402

from gpubalance.analyzer import train  # noqa: E402
from gpubalance.analyzer.features import COLUMNS, FeatureBuilder, FeatureTable  # noqa: E402
from gpubalance.analyzer.model import GpuStateClassifier  # noqa: E402
from gpubalance.analyzer.verdict import Verdicts  # noqa: E402
from gpubalance.lab import generate  # noqa: E402

LAB_SOURCES = ("fast.py", "truth.py", "workload.py", "routing.py", "traffic.py", "scenario.py")


def _lab_key() -> str:
    digest = hashlib.sha256()
    lab = ROOT / "lab"
    for path in [lab / name for name in LAB_SOURCES] + sorted((lab / "model").glob("*.py")):
        digest.update(path.read_bytes())
    digest.update((ROOT / "analyzer" / "frames.py").read_bytes())
    return digest.hexdigest()[:16]


def _rows(example: train.Example, cache: Path, lab_key: str) -> tuple[list[Any], list[str]]:
    """The frames and truth labels of one run, from the cache when it holds them.

    The cache holds only what this script wrote itself (pickle: it is never shared)."""
    text = json.dumps(example.document, sort_keys=True, default=str)
    key = hashlib.sha256((lab_key + text).encode()).hexdigest()[:24]
    path = cache / f"{example.name}-{key}.pickle"
    if path.exists():
        with path.open("rb") as f:
            return pickle.load(f)  # our own cache file, never shared
    rows = train._labelled_rows(example)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        pickle.dump(rows, f)
    tmp.replace(path)
    return rows


def _one(args: tuple[train.Example, Path, str]) -> tuple[list[Any], list[str]]:
    return _rows(*args)


def dataset(count: int, seed: int, cache: Path, jobs: int) -> train.Dataset:
    examples = [
        train.Example(v.family, v.name, v.document, int(v.document["seed"]))
        for v in generate.variants("all", count, seed)
    ]
    lab_key = _lab_key()
    jobs_args = [(e, cache, lab_key) for e in examples]
    with progress("lab runs", len(examples)) as advance:
        if jobs > 1:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(jobs) as pool:
                results = []
                for r in pool.map(_one, jobs_args):
                    results.append(r)
                    advance()
        else:
            results = []
            for a in jobs_args:
                results.append(_one(a))
                advance()
    builder = FeatureBuilder()
    frames: list[Any] = []
    values: list[np.ndarray] = []
    labels: list[str] = []
    groups: list[str] = []
    runs: list[str] = []
    started = time.perf_counter()
    rows_built = 0
    for example, (run_frames, run_labels) in zip(examples, results, strict=True):
        table = builder.transform(run_frames)
        rows_built += len(table.frames)
        by_key = {(f.t_start, f.gpu): lab for f, lab in zip(run_frames, run_labels, strict=True)}
        keep = [i for i, f in enumerate(table.frames) if by_key[(f.t_start, f.gpu)]]
        frames += [table.frames[i] for i in keep]
        values.append(table.values[keep])
        labels += [by_key[(table.frames[i].t_start, table.frames[i].gpu)] for i in keep]
        groups += [example.family] * len(keep)
        runs += [example.name] * len(keep)
    elapsed = time.perf_counter() - started
    print(f"features: {rows_built:,} rows in {elapsed:.1f} s ({rows_built / elapsed:,.0f} rows/s)")
    matrix = np.vstack(values) if values else np.zeros((0, len(COLUMNS)))
    table = FeatureTable(tuple(frames), matrix)
    return train.Dataset(table, tuple(labels), tuple(groups), tuple(runs))


def verdict_labels(
    model: Any, data: train.Dataset, options: dict[str, Any] | None = None
) -> list[str]:
    """Each row's verdict as "state/cause", one run at a time (persistence runs per GPU)."""
    out = [""] * len(data)
    runs = np.asarray(data.runs)
    for run in sorted(set(data.runs)):
        index = np.flatnonzero(runs == run)
        part = data.subset(runs == run)
        diagnosis = Verdicts(model, **(options or {})).diagnose(part.table)
        by_key = {(v.host, v.gpu, v.t_start): f"{v.state}/{v.cause}" for v in diagnosis.verdicts}
        for i, frame in zip(index, part.table.frames, strict=True):
            out[i] = by_key.get((frame.host, frame.gpu, frame.t_start), "unknown/none")
    return out


# the dataset the held-out fits read: set before the fold processes fork, so that each reads
# it from memory instead of a pickled copy
_DATA: train.Dataset | None = None


def _fold(
    args: tuple[str, int, list[dict[str, Any]]],
) -> tuple[str, list[str], list[str], list[list[str]]]:
    """One family held out: the raw model's labels and the verdicts of the same fit."""
    family, max_iter, settings = args
    data = _DATA
    assert data is not None
    held = np.asarray(data.groups) == family
    fitting = data.subset(~held)
    model = GpuStateClassifier(max_iter=max_iter).fit(fitting.table, fitting.labels)
    test = data.subset(held)
    raw = [str(label) for label in model.predict(test.table)]
    verdicts = verdict_labels(model, test)
    others = [verdict_labels(model, test, options) for options in settings]
    return family, raw, verdicts, others


def held_out(
    data: train.Dataset,
    max_iter: int = 300,
    settings: list[dict[str, Any]] | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """What `train.cross_validate` does (one family held out per fit), on the raw model's
    labels and on the verdicts of the same fit; ``jobs`` families at a time."""
    global _DATA
    groups = np.asarray(data.groups)
    labels = list(data.labels)
    raw = [""] * len(data)
    verdicts = [""] * len(data)
    others = [[""] * len(data) for _ in settings or []]
    families = sorted(set(data.groups))
    _DATA = data
    folds = [(family, max_iter, list(settings or [])) for family in families]
    with progress("held-out families", len(families)) as advance:
        if jobs > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(jobs, mp_context=context) as pool:
                results = list(_advancing(pool.map(_fold, folds), advance))
        else:
            results = list(_advancing(map(_fold, folds), advance))
    _DATA = None
    for family, fold_raw, fold_verdicts, fold_others in results:
        index = np.flatnonzero(groups == family)
        for j, i in enumerate(index):
            raw[i] = fold_raw[j]
            verdicts[i] = fold_verdicts[j]
            for k, other in enumerate(fold_others):
                others[k][i] = other[j]

    def part(predicted: list[str], family: str) -> dict[str, Any]:
        index = np.flatnonzero(groups == family)
        return train.scores([labels[i] for i in index], [predicted[i] for i in index])

    return {
        "raw": train.scores(labels, raw),
        "verdicts": train.scores(labels, verdicts),
        "per_family": {f: {"raw": part(raw, f), "verdicts": part(verdicts, f)} for f in families},
        "confusion": train.confusion(labels, verdicts),
        "settings": [
            {"options": o, **train.scores(labels, v)}
            for o, v in zip(settings or [], others, strict=True)
        ],
        "raw_confusion": train.confusion(labels, raw),
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _advancing(results: Any, advance: Any) -> Any:
    for result in results:
        advance()
        yield result


def print_report(data: train.Dataset, result: dict[str, Any]) -> None:
    print(f"{len(data):,} windows, {len(set(data.runs))} runs, {len(set(data.groups))} families")
    causes: dict[str, set[str]] = {}
    for label, family in zip(data.labels, data.groups, strict=True):
        causes.setdefault(label, set()).add(family)
    print("\nfamilies teaching each label:")
    for label, fams in sorted(causes.items()):
        print(f"  {label:32s} {len(fams):2d}  {Counter(data.labels)[label]:6d} windows")
    print(f"\n{'family':18s} {'windows':>7s}  raw F1  cause   verd F1  cause")
    for family, s in result["per_family"].items():
        r, v = s["raw"], s["verdicts"]
        print(
            f"{family:18s} {r['windows']:7d}  {_fmt(r['state_macro_f1'])}  "
            f"{_fmt(r['cause_accuracy'])}   {_fmt(v['state_macro_f1'])}  "
            f"{_fmt(v['cause_accuracy'])}"
        )
    r, v = result["raw"], result["verdicts"]
    print(
        f"{'ALL':18s} {r['windows']:7d}  {_fmt(r['state_macro_f1'])}  "
        f"{_fmt(r['cause_accuracy'])}   {_fmt(v['state_macro_f1'])}  {_fmt(v['cause_accuracy'])}"
    )
    for other in result["settings"]:
        print(
            f"verdicts with {other['options']}: state macro-F1 {_fmt(other['state_macro_f1'])}, "
            f"cause accuracy {_fmt(other['cause_accuracy'])}"
        )
    print("\nverdict confusion (rows truth, columns verdict; share of the row's windows, %):")
    labels = result["confusion"]["labels"]
    short = [x.replace("starved/", "s/").replace("overloaded/", "o/")[:9] for x in labels]
    print(" " * 30 + " ".join(f"{s:>9s}" for s in short) + "        n")
    for label, row in zip(labels, result["confusion"]["matrix"], strict=True):
        n = sum(row)
        if not n:
            continue
        cells = " ".join(f"{100 * c / n:9.0f}" if c else f"{'.':>9s}" for c in row)
        print(f"{label:30s}{cells} {n:8d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/gpubalance-accuracy-cache"))
    parser.add_argument("--max-iter", type=int, default=300, help="boosting rounds per fit")
    parser.add_argument(
        "--verdicts",
        action="append",
        default=[],
        metavar="K:ENTER:LEAVE",
        help="also score verdicts with these persistence windows and confidences",
    )
    parser.add_argument("--json", type=Path, help="also write the scores here")
    args = parser.parse_args()
    data = dataset(args.count, args.seed, args.cache, args.jobs)
    started = time.perf_counter()
    settings = [
        dict(zip(("persistence_windows", "enter_confidence", "leave_confidence"), v, strict=True))
        for v in ((int(a), float(b), float(c)) for a, b, c in (x.split(":") for x in args.verdicts))
    ]
    result = held_out(data, args.max_iter, settings, args.jobs)
    print(f"held-out fits: {time.perf_counter() - started:.0f} s")
    print_report(data, result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
