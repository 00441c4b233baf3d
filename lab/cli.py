"""The GPU-free lab: a simulated multi-GPU RTX server with ground truth, at two speeds.

`gpubalance lab list` shows the shipped scenarios; `gpubalance lab run SCENARIO` runs one (fast:
discrete-event, hours in seconds; live: real time, fake NVML driver, real workers, real HAProxy)
and writes frames.csv, truth.csv and requests.csv; `gpubalance lab generate` writes many drawn
variants of the scenario families (training data); `gpubalance lab demo` runs the live lab with
the exporter and a live view; `gpubalance lab fakenvml build` compiles the fake driver.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpubalance.arguments import positive_int, seconds, seed

DEFAULT_BUILD = Path("build") / "fakenvml"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab_command", metavar="COMMAND", required=True)
    sub.add_parser("list", help="the shipped scenarios, one line each")
    run = sub.add_parser("run", help="run a scenario; write frames, truth and requests")
    run.add_argument(
        "scenario",
        metavar="SCENARIO_OR_FILE",
        help="a shipped scenario's name (see `lab list`) or a YAML file",
    )
    run.add_argument("--speed", choices=("fast", "live"), default="fast")
    run.add_argument(
        "--duration",
        type=seconds,
        metavar="SECONDS",
        help="simulated seconds (default: the scenario's duration_seconds)",
    )
    run.add_argument("--seed", type=seed, metavar="N", help="default: the scenario's seed")
    run.add_argument("--out", type=Path, required=True, metavar="DIR")
    run.add_argument(
        "--snapshots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write snapshots.jsonl, the exporter's /api/v1/snapshot schema (default: on): "
        "what `gpubalance diagnose --from DIR` reads; frames.csv, which it reads without them, "
        "has no host, process, clock-limit or pool series",
    )
    gen = sub.add_parser(
        "generate",
        help="write drawn scenario variants of a family (the analyzer's training data)",
        description="Write COUNT scenario files of a family (or of every family: --family all), "
        "each valid and warning-free, with a header comment naming the family, the seed and "
        "the drawn parameters. The same seed gives the same files. Families: "
        "lab/scenarios/README.md, 'Generated families'.",
    )
    gen.add_argument(
        "--family", required=True, metavar="FAMILY", help="a family's name, or all (each family)"
    )
    gen.add_argument(
        "--count", type=positive_int, default=10, metavar="N", help="variants per family"
    )
    gen.add_argument("--seed", type=seed, default=1, metavar="N")
    gen.add_argument("--out", type=Path, required=True, metavar="DIR")
    gen.add_argument(
        "--duration",
        type=seconds,
        metavar="SECONDS",
        help="every variant's duration_seconds (default: drawn, 300-900 s)",
    )
    fake = sub.add_parser("fakenvml", help="the fake NVML driver")
    fake_sub = fake.add_subparsers(dest="fakenvml_command", metavar="COMMAND", required=True)
    build = fake_sub.add_parser("build", help="compile libnvidia-ml.so.1 with gcc")
    build.add_argument("--out", type=Path, default=DEFAULT_BUILD, metavar="DIR")
    build.add_argument(
        "--hide",
        action="append",
        default=[],
        metavar="SYMBOL",
        help="leave an NVML symbol out (simulates an older driver); repeatable",
    )
    demo = sub.add_parser("demo", help="a skewed 4-GPU RTX box with the exporter and a live view")
    demo.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD, metavar="DIR")
    demo.add_argument(
        "--duration",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default: until Ctrl-C; 45 s when not a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    if args.lab_command == "list":
        from gpubalance.lab.scenario import shipped

        for name, description in shipped():
            print(f"{name:28} {description}")
        return 0
    if args.lab_command == "run":
        return _run(args)
    if args.lab_command == "generate":
        return _generate(args)
    if args.lab_command == "fakenvml":
        from gpubalance.lab.fakenvml import build_library

        try:
            path = build_library(args.out, hidden_symbols=args.hide)
        except (OSError, RuntimeError) as exc:
            print(f"gpubalance lab: {exc}", file=sys.stderr)
            return 1
        print(path)
        return 0
    if args.lab_command == "demo":
        from gpubalance.lab.demo import run_demo

        duration = args.duration
        if duration is None and not (
            sys.stdout.isatty() or os.environ.get("GPUBALANCE_DEMO_FOREVER")
        ):
            duration = 45.0
        return run_demo(args.build_dir, duration)
    raise AssertionError(args.lab_command)


def _run(args: argparse.Namespace) -> int:
    from gpubalance.config import ConfigError
    from gpubalance.lab import run as lab_run
    from gpubalance.lab import scenario

    try:
        plan = scenario.load(args.scenario)
    except ConfigError as exc:
        print(f"gpubalance lab: {exc}", file=sys.stderr)
        return 2
    duration = plan.scenario.duration_seconds if args.duration is None else args.duration
    seed = plan.scenario.seed if args.seed is None else args.seed
    for warning in plan.warnings(duration, seed):
        print(f"gpubalance lab: warning: {warning}", file=sys.stderr)
    problem = _make_directory(args.out)
    if problem is not None:
        print(f"gpubalance lab: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    with _progress(duration) as on_sample:
        summary = lab_run.run(
            plan,
            args.speed,
            duration,
            seed,
            args.out,
            snapshots=args.snapshots,
            on_sample=on_sample,
        )
    outcomes = ", ".join(f"{k} {v}" for k, v in summary.outcomes.items())
    print(
        f"{plan.scenario.name}: {summary.requests} requests ({outcomes}), "
        f"{summary.truth_rows} truth rows -> {summary.out}"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from gpubalance.lab import generate

    try:
        families = generate.family_names(args.family)
    except ValueError as exc:
        print(f"gpubalance lab: --family: {exc}", file=sys.stderr)
        return 2
    problem = _make_directory(args.out)
    if problem is not None:
        print(f"gpubalance lab: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    total = len(families) * args.count
    with _counting(total, "scenarios") as advance:
        for variant in generate.each(args.family, args.count, args.seed, args.duration):
            generate.write([variant], args.out)
            advance()
    print(f"{total} scenarios ({len(families)} families x {args.count}) -> {args.out}")
    return 0


def _make_directory(out: Path) -> str | None:
    """Create --out before anything runs; what stands in the way, or None."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            return f"{blocking} is not a directory"
        return f"cannot create the directory: {exc.strerror or exc}"
    return None


@contextlib.contextmanager
def _progress(duration: float) -> Iterator[Callable[[Any], None] | None]:
    """A bar over simulated time on a terminal; nothing in pipes and CI."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("simulated {task.completed:.0f}/{task.total:.0f} s"),
        BarColumn(),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("run", total=duration)
        start: list[float] = []

        def on_sample(sample: Any) -> None:
            if not start:
                start.append(sample.timestamp_seconds)
            bar.update(task, completed=sample.timestamp_seconds - start[0])

        yield on_sample


@contextlib.contextmanager
def _counting(total: int, what: str) -> Iterator[Callable[[], None]]:
    """A bar over ``total`` items on a terminal; nothing in pipes and CI."""
    if not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    # on stderr, the stream checked above: stdout stays the command's output
    with Progress(
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)
