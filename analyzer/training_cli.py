"""Train the analyzer's model, evaluate it, check it on real telemetry.

`gpubalance analyzer train` draws variants of the lab's scenario families, runs them at the
fast speed, scores the model with each family held out in turn, fits it on every run and saves
it (skops) with its report beside it (FILE.report.json). The same seed gives the same model.

`gpubalance analyzer evaluate` (what `make eval` runs) writes analyzer/EVALUATION.md and its
plots: held-out verdict scores, detection delay, false alarms, the baselines beside ours.

`gpubalance analyzer check-gentd DIR` judges the pods of the Alibaba GenTD26 telemetry (the
folder of its archives, never copied into the repository) and compares the verdicts with the
pods' own request counts and queue times.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from gpubalance.arguments import hours, positive_int, seconds, seed

DEFAULT_COUNT = 8
DEFAULT_REPORT = Path("analyzer") / "EVALUATION.md"


def _families(text: str) -> list[str]:
    from gpubalance.analyzer.evaluate import family_list

    try:
        return family_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _data_options(parser: argparse.ArgumentParser, count: int) -> None:
    parser.add_argument(
        "--families",
        type=_families,
        default="all",
        metavar="all|F,...",
        help="scenario families to draw (lab/scenarios/README.md, 'Generated families')",
    )
    parser.add_argument(
        "--count", type=positive_int, default=count, metavar="N", help="variants per family"
    )
    parser.add_argument("--seed", type=seed, default=1, metavar="S", help="generator seed")
    parser.add_argument(
        "--duration",
        type=seconds,
        metavar="SECONDS",
        help="every variant's duration (default: as drawn, 300-900 s)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="processes running scenarios (and, for evaluate, fitting folds)",
    )


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The train, evaluate and check-gentd subcommands of `gpubalance analyzer`."""
    train = sub.add_parser(
        "train",
        help="train the model on generated lab runs; save it with its report",
        description="Draw COUNT variants of each family, run them at the fast speed, score "
        "the model with each family held out in turn, fit it on every run and save it with "
        "skops; its report (data, parameters, versions, commit, held-out scores, confusion "
        "matrix) goes beside it as FILE.report.json. The same seed gives the same model.",
    )
    _data_options(train, DEFAULT_COUNT)
    train.add_argument("--out", type=Path, default=Path("model.skops"), metavar="FILE.skops")
    train.set_defaults(_run=_train)
    evaluate = sub.add_parser(
        "evaluate",
        help="write analyzer/EVALUATION.md: held-out verdict scores beside the baselines",
        description="Run generated variants of every family and the shipped scenarios at the "
        "fast speed; judge each held-out family with the model fitted on the others, through "
        "the verdict step; write the report and its plots (`make eval`).",
    )
    _data_options(evaluate, DEFAULT_COUNT)
    evaluate.add_argument("--out", type=Path, default=DEFAULT_REPORT, metavar="FILE.md")
    evaluate.add_argument(
        "--train-count",
        type=positive_int,
        metavar="N",
        help="variants per family that train the folds and the model, --count or more "
        "(default: --count); the first --count of each are judged",
    )
    evaluate.add_argument(
        "--model-out",
        type=Path,
        metavar="FILE.skops",
        help="also save the model fitted on every generated run (check-gentd can use it)",
    )
    evaluate.add_argument(
        "--no-shipped", action="store_true", help="leave the shipped scenarios out"
    )
    evaluate.add_argument(
        "--no-recommendations",
        action="store_true",
        help="leave the recommendation prediction error out",
    )
    evaluate.add_argument(
        "--soak-hours",
        type=hours,
        metavar="H",
        help="balanced GPU-hours to run beyond the held-out ones for the false-alarm figure "
        "(0: none; default: 72, where none raised bounds the rate below 1 per GPU-day)",
    )
    evaluate.set_defaults(_run=_evaluate)
    gentd = sub.add_parser(
        "check-gentd",
        help="judge the pods of the Alibaba GenTD26 telemetry; check against their requests",
        description="Judge every pod of the Alibaba GenTD26 trace from its GPU utilisation "
        "and memory, and compare the verdicts with the pods' own request counts and queueing "
        "times (which the analyzer does not read). Prints aggregate figures; --report writes "
        "them into a report's GenTD26 section. The trace is read where it lies.",
    )
    gentd.add_argument(
        "folder",
        type=Path,
        metavar="DIR",
        help="the folder of GenTD26's archives (pod_gpu_duty_cycle_anon.tar.gz, ...) or CSVs",
    )
    gentd.add_argument(
        "--model",
        type=Path,
        metavar="FILE.skops",
        help="a trained model (`gpubalance analyzer train`) judged beside the rule baselines",
    )
    gentd.add_argument(
        "--window",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="analysis window (default five of the trace's 57-s samples: 285 s)",
    )
    gentd.add_argument(
        "--report", type=Path, metavar="FILE.md", help="write the figures into this report"
    )
    gentd.set_defaults(_run=_check_gentd)


Advance = Callable[[int], None]


@contextlib.contextmanager
def _stages() -> Iterator[Callable[[str, int], Advance] | None]:
    """A bar per stage of long work on a terminal; nothing in pipes and CI."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as bar:

        def stage(what: str, total: int) -> Advance:
            task = bar.add_task(what, total=total)
            return lambda n: bar.advance(task, n)

        yield stage


def _settings(args: argparse.Namespace) -> dict[str, object]:
    return {
        "families_drawn": args.families,
        "variants_per_family": args.count,
        "generator_seed": args.seed,
        "duration_seconds": args.duration,
    }


def _train(args: argparse.Namespace) -> int:
    from gpubalance.analyzer import evaluate, model

    if args.out.exists() and args.out.is_dir():
        print(f"gpubalance analyzer train: --out {args.out} is a directory", file=sys.stderr)
        return 2
    examples = evaluate.generated_examples(args.families, args.count, args.seed, args.duration)
    try:
        with _stages() as stage:
            classifier, report = evaluate.train_model(
                examples, seed=args.seed, settings=_settings(args), workers=args.jobs, stage=stage
            )
    except ValueError as exc:
        print(f"gpubalance analyzer train: {_too_little(exc)}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out, classifier, report)
    held = report["held_out"]
    cause = held["cause_accuracy"]
    print(
        f"{report['data']['windows']} GPU-windows of {report['data']['runs']} runs; held out "
        f"by family: state macro-F1 {held['state_macro_f1']:.2f}, cause accuracy "
        f"{'-' if cause is None else f'{cause:.2f}'} -> {args.out} "
        f"(report {args.out.with_suffix('.report.json')})"
    )
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from gpubalance.analyzer import evaluate

    try:
        with _stages() as stage:
            result = evaluate.evaluate(
                args.families,
                args.count,
                args.seed,
                duration_seconds=args.duration,
                shipped=not args.no_shipped,
                recommendations=not args.no_recommendations,
                soak_gpu_hours=(
                    evaluate.SOAK_GPU_HOURS if args.soak_hours is None else args.soak_hours
                ),
                jobs=args.jobs,
                stage=stage,
                train_count=args.train_count,
            )
    except ValueError as exc:
        print(f"gpubalance analyzer evaluate: {_too_little(exc)}", file=sys.stderr)
        return 1
    evaluate.write_report(result, args.out, _command(args))
    if args.model_out is not None and result.model is not None:
        from gpubalance.analyzer import model

        args.model_out.parent.mkdir(parents=True, exist_ok=True)
        model.save(args.model_out, result.model, {"data": dict(result.data)})
    ours = evaluate.summary(result.generated, evaluate.OURS, result.soak)
    print(
        f"held out: state macro-F1 {ours['state_macro_f1']:.2f}, cause accuracy "
        f"{_f(ours['cause_accuracy'])}, median delay {_f(ours['median_delay_windows'])} "
        f"windows, false alarms {_f(ours['false_alarms_per_gpu_day'])} per GPU-day -> {args.out}"
    )
    return 0


def _check_gentd(args: argparse.Namespace) -> int:
    from gpubalance.analyzer import evaluate, gentd, model
    from gpubalance.analyzer.baselines import QueueUtilization, UtilizationThreshold
    from gpubalance.analyzer.features import FeatureBuilder
    from gpubalance.analyzer.verdict import Classifier

    classifiers: dict[str, Classifier] = {}
    window = gentd.WINDOW_SECONDS if args.window is None else args.window
    try:
        if args.model is not None:
            classifiers[evaluate.OURS] = model.load(args.model)
        trace = gentd.read(args.folder, window)
    except (model.ModelError, gentd.GentdError, OSError) as exc:
        print(f"gpubalance analyzer check-gentd: {exc}", file=sys.stderr)
        return 2
    nothing = FeatureBuilder().transform([])  # the rules learn nothing; fit only checks
    classifiers[evaluate.QUEUE] = QueueUtilization().fit(nothing)
    classifiers[evaluate.THRESHOLD] = UtilizationThreshold().fit(nothing)
    figures = gentd.check(trace, classifiers)
    words = ["gpubalance", "analyzer", "check-gentd", "GENTD_DIR"]
    if args.model is not None:
        words += ["--model", str(args.model)]
    if args.window is not None:
        words += ["--window", f"{args.window:g}"]
    text = gentd.report_markdown(figures, shlex.join(words).replace("'GENTD_DIR'", "GENTD_DIR"))
    if args.report is not None:
        evaluate.replace_section(args.report, evaluate.GENTD_KEY, text, evaluate.REPORT_HEADER)
    sys.stdout.write(text)
    return 0


def _too_little(exc: ValueError) -> str:
    # the trees refuse a fold of a handful of windows with a message about array shapes
    return (
        f"the model could not be fitted ({exc}); a fold may hold too few GPU-windows: "
        "raise --count or --duration"
    )


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this evaluation."""
    from gpubalance.lab.generate import family_names

    words = ["gpubalance", "analyzer", "evaluate", "--count", str(args.count)]
    if args.train_count is not None:
        words += ["--train-count", str(args.train_count)]
    words += ["--seed", str(args.seed)]
    if args.families != family_names("all"):
        words += ["--families", ",".join(args.families)]
    if args.duration is not None:
        words += ["--duration", f"{args.duration:g}"]
    words += ["--jobs", str(args.jobs)]
    return shlex.join(words)


def _f(value: float | None) -> str:
    if value is None:
        return "-"
    return "missed" if value == float("inf") else f"{value:.2f}"
