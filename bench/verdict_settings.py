"""The verdict step's settings (persistence, enter and leave confidence), judged on held-out
families: what each setting trades between per-window scores, detection delay and false alarms.

The evaluation's generated families and its balanced soak are run once and its held-out folds
fitted once (as `make eval` does, at its counts); every held-out run is then
judged through the verdict step at each setting of a grid, by the fold that held its family out.
Figures as analyzer/EVALUATION.md defines them. Nothing here is fitted to lab/scenarios/.
Table in bench/RESULTS.md, plot in bench/verdict_settings.png.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import machine, progress, write_section

from gpubalance.analyzer import evaluate, train
from gpubalance.analyzer.features import FeatureTable
from gpubalance.analyzer.model import GpuStateClassifier
from gpubalance.analyzer.verdict import Verdicts

PERSISTENCE = (1, 2, 3)
ENTER = (0.5, 0.6, 0.7, 0.8)
LEAVE = (0.3, 0.4, 0.5)
# Verdicts' defaults: the row the others are read against
DEFAULT = tuple(
    inspect.signature(Verdicts).parameters[name].default
    for name in ("persistence_windows", "enter_confidence", "leave_confidence")
)
PLOT = Path(__file__).resolve().parent / "verdict_settings.png"


class _Answered:
    """A fitted model's probabilities for one run's table, computed once and given back for
    every setting (the verdict step asks nothing else of its classifier)."""

    def __init__(self, model: GpuStateClassifier, table: FeatureTable) -> None:
        self.classes_ = model.classes_
        self._proba = model.predict_proba(table)

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        return self._proba


def _name(setting: tuple[int, float, float]) -> str:
    persistence, enter, leave = setting
    return f"p{persistence} e{enter:.1f} l{leave:.1f}"


def _settings() -> list[tuple[int, float, float]]:
    return [s for s in itertools.product(PERSISTENCE, ENTER, LEAVE) if s[2] <= s[1]]


def _labels(
    answered: _Answered, table: FeatureTable, setting: tuple[int, float, float]
) -> tuple[str, ...]:
    persistence, enter, leave = setting
    return evaluate.verdict_labels(
        answered,
        table,
        persistence_windows=persistence,
        enter_confidence=enter,
        leave_confidence=leave,
    )


def judge_all(
    families: Sequence[str],
    count: int,
    train_count: int,
    soak_gpu_hours: float,
    seed: int,
    jobs: int,
) -> tuple[list[evaluate.RunVerdicts], list[evaluate.RunVerdicts]]:
    """Every held-out run and soak run, each said at every setting."""
    examples = evaluate.generated_examples(families, train_count, seed)
    judged = {e.name for e in evaluate.generated_examples(families, count, seed)}
    with progress("running generated scenarios", len(examples)) as advance:
        dataset = train.build_dataset(examples, workers=jobs, progress=lambda n: advance())
    held = sorted(set(dataset.groups))
    with progress("held-out folds", len(held) + 1) as advance:
        models = evaluate._fit_folds(
            dataset,
            held,
            functools.partial(GpuStateClassifier, random_state=seed),
            jobs,
            lambda n: advance(),
        )
    soak_list = evaluate.soak_examples(count, seed, soak_gpu_hours)
    with progress("running balanced soak", len(soak_list)) as advance:
        soak_data = train.build_dataset(soak_list, workers=jobs, progress=lambda n: advance())
    by_name = {e.name: e for e in examples}
    runs = np.asarray(dataset.runs)
    todo = [
        (by_name[r], dataset.subset(runs == r), models[by_name[r].family]) for r in sorted(judged)
    ]
    judge = models.get(evaluate.SOAK_FAMILY, models[None])
    soak_names = np.asarray(soak_data.runs)
    soak_todo = [(e, soak_data.subset(soak_names == e.name), judge) for e in soak_list]
    settings = _settings()
    said: list[list[evaluate.RunVerdicts]] = [[], []]
    with progress("verdicts at each setting", len(todo) + len(soak_todo)) as advance:
        for out, work in ((said[0], todo), (said[1], soak_todo)):
            for example, part, model in work:
                if not len(part):
                    continue
                # the evaluation's own record of the run; its judges replaced by the settings
                base = evaluate._judge(example, part, model)
                answered = _Answered(model, part.table)
                labels = {_name(s): _labels(answered, part.table, s) for s in settings}
                # the defaults must say what the evaluation's own verdicts say
                assert labels[_name(DEFAULT)] == base.said[evaluate.OURS], example.name
                out.append(replace(base, said=labels))
                advance()
    return said[0], said[1]


def table(
    runs: Sequence[evaluate.RunVerdicts], soak: Sequence[evaluate.RunVerdicts]
) -> list[dict[str, float | str | None]]:
    rows = []
    for setting in _settings():
        figures = evaluate.summary(runs, _name(setting), soak)
        rows.append(
            {
                "setting": _name(setting),
                "persistence": setting[0],
                "enter": setting[1],
                "leave": setting[2],
                "macro_f1": figures["state_macro_f1"],
                "cause": figures["cause_accuracy"],
                "median_delay": figures["median_delay_windows"],
                "missed": figures["missed"],
                "events": figures["events"],
                "false_alarms": figures["false_alarms"],
                "per_day": figures["false_alarms_per_gpu_day"],
            }
        )
    return rows


def _f(value: float | str | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return "missed" if value == float("inf") else f"{value:.{digits}f}"


def markdown(rows: Sequence[dict], command: str, wall: float) -> str:  # type: ignore[type-arg]
    lines = [
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine()}, {wall:.0f} s wall: "
        f"`{command}`.",
        "",
        "Every held-out run judged through the verdict step at each setting, by the fold that "
        "held its family out (state macro-F1, cause accuracy, median delay in windows, false "
        "alarms per GPU-day of balanced truth: as analyzer/EVALUATION.md defines them). `p` "
        "persistence windows, `e` enter confidence, `l` leave confidence; **bold**: the "
        "verdict step's defaults.",
        "",
        "| setting | state macro-F1 | cause accuracy | median delay | missed / events "
        "| false alarms | per GPU-day |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = row["setting"]
        shown = f"**{name}**" if name == _name(DEFAULT) else name
        lines.append(
            f"| {shown} | {_f(row['macro_f1'])} | {_f(row['cause'])} | "
            f"{_f(row['median_delay'], 1)} | {row['missed']} / {row['events']} | "
            f"{row['false_alarms']} | {_f(row['per_day'])} |"
        )
    lines += ["", f"![macro-F1 against false alarms per setting]({PLOT.name})"]
    return "\n".join(lines)


def plot(rows: Sequence[dict]) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for persistence, marker in zip(PERSISTENCE, "osD", strict=True):
        mine = [r for r in rows if r["persistence"] == persistence]
        ax.scatter(
            [r["per_day"] for r in mine],
            [r["macro_f1"] for r in mine],
            marker=marker,
            label=f"persistence {persistence}",
        )
    default = next(r for r in rows if r["setting"] == _name(DEFAULT))
    ax.annotate("default", (default["per_day"], default["macro_f1"]))
    ax.set_xlabel("false alarms per GPU-day (held-out balanced runs and soak)")
    ax.set_ylabel("state macro-F1 (held-out families)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", type=evaluate.family_list, default="all", metavar="all|F,...")
    # the defaults are `make eval`'s: its verdicts are this table's row at the step's defaults
    parser.add_argument("--count", type=int, default=8, help="judged variants per family")
    parser.add_argument("--train-count", type=int, default=32, help="training variants per family")
    parser.add_argument("--soak-gpu-hours", type=float, default=evaluate.SOAK_GPU_HOURS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    args = parser.parse_args()
    started = time.perf_counter()
    runs, soak = judge_all(
        args.families, args.count, args.train_count, args.soak_gpu_hours, args.seed, args.jobs
    )
    rows = table(runs, soak)
    command = "python bench/verdict_settings.py " + " ".join(sys.argv[1:])
    body = markdown(rows, command.strip(), time.perf_counter() - started)
    plot(rows)
    write_section("verdict-settings", "Verdict step settings on held-out families", body)
    print(body)


if __name__ == "__main__":
    main()
