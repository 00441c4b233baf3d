"""Diagnose a server: each GPU starved, overloaded or balanced, why, and what shows it.

`gpubalance diagnose --from SOURCE` reads a lab run directory (its snapshots.jsonl, else its
frames.csv) or an exporter's base URL (its /api/v1/snapshot history), cuts it into windows and
prints, per GPU, its verdict now with cause, confidence and evidence, a timeline of its states,
and per pool the fleet verdict with the idle-while-queued ratio, then the current
recommendations. `--format json` prints one object per GPU and window instead (`--fleet`: one
per pool and window; `--recommend`: the recommendations).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpubalance.arguments import seconds

if TYPE_CHECKING:
    from gpubalance.analyzer.features import FeatureTable
    from gpubalance.analyzer.frames import GpuFrame
    from gpubalance.analyzer.verdict import Classifier, Diagnosis
    from gpubalance.diagnosis import Recommendation

DEFAULT_WINDOW_SECONDS = 30.0
TIMELINE_WINDOWS = 40
PIPE_WIDTH = 120  # the table's timeline shows at most the last this many windows
STYLES = {
    "overloaded": "bold red",
    "starved": "bold yellow",
    "balanced": "green",
    "unknown": "magenta",
}
MARKS = {"overloaded": "O", "starved": "S", "balanced": ".", "unknown": "?"}


class DiagnoseError(Exception):
    """A source, window or classifier that cannot be used: exit code 2 with the message."""


class NothingYet(Exception):
    """A readable source without a whole window yet (an exporter just started): exit code 1."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="DIR_OR_URL",
        help="a lab run directory (`gpubalance lab run ... --out DIR`) or an exporter's base "
        "URL (http://HOST:9450)",
    )
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument(
        "--window",
        type=seconds,
        default=DEFAULT_WINDOW_SECONDS,
        metavar="SECONDS",
        help=f"analysis window (default {DEFAULT_WINDOW_SECONDS:.0f} s, the lab's truth window)",
    )
    parser.add_argument(
        "--classifier",
        nargs="+",
        default=["model"],
        metavar=("NAME", "FILE"),
        help="model (the default: the model gpubalance ships, trained on the lab's generated "
        "families), `model FILE` (one `gpubalance analyzer train` wrote), baseline-queue "
        "(queue + utilization rule) or baseline-threshold (utilization < 30 %% starved, "
        "> 90 %% overloaded, what a DCGM alert says)",
    )
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="with --format json: print the fleet verdicts (per pool and window) instead",
    )
    parser.add_argument(
        "--recommend",
        action="store_true",
        help="with --format json: print the current recommendations instead (the table "
        "always shows them)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        if (args.fleet or args.recommend) and args.format != "json":
            flag = "--fleet" if args.fleet else "--recommend"
            raise DiagnoseError(f"{flag} goes with --format json (the table shows it)")
        if args.fleet and args.recommend:
            raise DiagnoseError("--fleet or --recommend, not both")
        classifier_name = " ".join(args.classifier)
        classifier = _classifier(args.classifier)
        table, diagnosis = _diagnose(args.source, args.window, classifier)
    except DiagnoseError as exc:
        print(f"gpubalance diagnose: {exc}", file=sys.stderr)
        return 2
    except NothingYet as exc:
        print(f"gpubalance diagnose: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        if args.recommend:
            rows = [_plain(r) for r in _recommendations(table, diagnosis)]
        else:
            rows = _fleet_rows(diagnosis) if args.fleet else _verdict_rows(diagnosis)
        # one row per line: readable with grep, loadable as one JSON document
        sys.stdout.write("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
        return 0
    _print_table(args.source, args.window, classifier_name, table, diagnosis)
    return 0


def _classifier(spec: Sequence[str]) -> Classifier:
    from gpubalance.analyzer.baselines import CLASSIFIERS

    name, files = spec[0], spec[1:]
    if name in CLASSIFIERS:
        if files:
            raise DiagnoseError(f"--classifier {name} takes no file, got {' '.join(files)}")
        return CLASSIFIERS[name]()
    if name == "model":
        if len(files) > 1:
            raise DiagnoseError("--classifier model takes one FILE (a trained model) or none")
        return _load_model(Path(files[0]) if files else None)
    known = ", ".join(["model [FILE]", *CLASSIFIERS])
    raise DiagnoseError(f"--classifier {name}: unknown; one of {known}")


def _load_model(path: Path | None) -> Classifier:
    """The learned model, as `gpubalance analyzer train` wrote it (skops); None: the one
    gpubalance ships."""
    from gpubalance.analyzer import model

    try:
        return model.load(path) if path is not None else model.load_shipped()
    except model.ModelError as exc:
        raise DiagnoseError(f"--classifier model {exc}") from None


def _frames(source: str, window_seconds: float) -> tuple[list[GpuFrame], str | None]:
    """The frames of a source: a lab run directory, an exporter or a Prometheus API (Thanos,
    Mimir), whichever answers (``sources.open_source``); and what its recording cannot show
    (a lab run without snapshots), None when nothing is missing."""
    from gpubalance.analyzer import sources

    try:
        found = sources.open_source(source)
        frames = found.frames(None, None, window_seconds)
    except sources.SourceError as exc:
        raise DiagnoseError(str(exc)) from None
    except ValueError as exc:  # a window shorter than the source's sampling interval
        raise DiagnoseError(f"--window {window_seconds:g}: {exc}") from None
    if isinstance(found, sources.LabRunSource):
        return frames, sources.lab_run_shortfall(found.directory)
    return frames, None


def _diagnose(
    source: str, window_seconds: float, classifier: Classifier
) -> tuple[FeatureTable, Diagnosis]:
    from gpubalance.analyzer.features import FeatureBuilder
    from gpubalance.analyzer.verdict import Verdicts

    with _status(f"reading {source}"):
        frames, shortfall = _frames(source, window_seconds)
    if shortfall:
        print(f"gpubalance diagnose: warning: {shortfall}", file=sys.stderr)
    with _status(f"judging {source}"):
        if not frames:
            raise NothingYet(
                f"--from {source}: not one complete {window_seconds:g} s window to judge"
            )
        table = FeatureBuilder().transform(frames)
        fit = getattr(classifier, "fit", None)
        if fit is not None and not hasattr(classifier, "classes_"):
            fit(table)  # the rules learn nothing; fit only sets their classes
        return table, Verdicts(classifier).diagnose(table)


def _status(text: str) -> AbstractContextManager[Any]:
    """A spinner on a terminal's stderr while the source is read; nothing in pipes."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(text)


def _recommendations(table: FeatureTable, diagnosis: Diagnosis) -> tuple[Recommendation, ...]:
    """What the recommender says at the end of the source's last window."""
    from gpubalance.analyzer.recommend import Recommender

    now = max((f.t_end for f in table.frames), default=0.0)
    return Recommender().recommend(diagnosis, table, now)


def _plain(value: object) -> Any:
    """A recommendation (or any of its parts) as JSON-ready values; GPU keys as strings."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _verdict_rows(diagnosis: Diagnosis) -> list[dict[str, object]]:
    return [
        {
            "t_start": v.t_start,
            "t_end": v.t_end,
            "host": v.host,
            "gpu": v.gpu,
            "uuid": v.uuid,
            "pool": v.pool,
            "state": v.state,
            "cause": v.cause,
            "confidence": v.confidence,
            "evidence": list(v.evidence),
            "unknown_reason": v.unknown_reason,
        }
        for v in diagnosis.verdicts
    ]


def _fleet_rows(diagnosis: Diagnosis) -> list[dict[str, object]]:
    return [
        {
            "t_start": f.t_start,
            "t_end": f.t_end,
            "host": f.host,
            "pool": f.pool,
            "kind": f.kind,
            "gpus": list(f.gpus),
            "idle_while_queued_ratio": f.idle_while_queued_ratio,
            "evidence": list(f.evidence),
        }
        for f in diagnosis.fleet
    ]


def _print_table(
    source: str,
    window_seconds: float,
    classifier_name: str,
    table: FeatureTable,
    diagnosis: Diagnosis,
) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from gpubalance.analyzer.verdict import idle_while_queued_ratio

    # colours on a terminal only; in a pipe rich writes plain text, at a width that keeps
    # the evidence readable unless COLUMNS says otherwise
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    by_gpu: dict[tuple[str, int], list[Any]] = {}
    for verdict in diagnosis.verdicts:
        by_gpu.setdefault((verdict.host, verdict.gpu), []).append(verdict)
    windows = sorted({v.t_start for v in diagnosis.verdicts})
    cards = {
        (f.host, f.gpu): (f.card or "").removeprefix("NVIDIA ").removeprefix("GeForce ")
        for f in table.frames
    }
    shown = windows[-TIMELINE_WINDOWS:]
    hosts = {host for host, _ in by_gpu}
    first, last = windows[0], windows[-1] + window_seconds
    grid = Table(
        title=Text(
            f"{source}: {len(windows)} windows of {window_seconds:g} s, "
            f"{_clock(first)} to {_clock(last)}",
            style="italic",
        ),
        caption=f"classifier: {classifier_name}; timeline oldest to newest, "
        + ", ".join(f"{mark} {state}" for state, mark in MARKS.items())
        + (f"; last {len(shown)} windows" if len(shown) < len(windows) else ""),
        title_justify="left",
        caption_justify="left",
    )
    if len(hosts) > 1:
        grid.add_column("host")
    for name in ("GPU", "card", "state", "cause", "conf"):
        grid.add_column(name, no_wrap=True, justify="right" if name == "conf" else "left")
    grid.add_column("evidence (now)", ratio=1)
    grid.add_column("timeline", no_wrap=True)
    for (host, gpu), verdicts in sorted(by_gpu.items()):
        now = verdicts[-1]
        at = {v.t_start: v.state for v in verdicts}
        timeline = Text()
        for t in shown:
            state = at.get(t)
            timeline.append(MARKS[state] if state else " ", style=STYLES.get(state or "", ""))
        # Text, not str: a cell's text is the telemetry's, never rich markup
        cells = [
            Text(str(gpu)),
            Text(cards.get((host, gpu), "")),
            Text(now.state, style=STYLES[now.state]),
            Text(now.cause if now.state != "unknown" else "-"),
            Text(f"{now.confidence:.2f}"),
            # a figure and its unit stay on one line
            Text(
                (now.unknown_reason or (now.evidence[0] if now.evidence else "")).replace(
                    " %", "\u00a0%"
                )
            ),
            timeline,
        ]
        grid.add_row(*([Text(host)] if len(hosts) > 1 else []), *cells)
    console.print(grid)
    pools: dict[tuple[str, str], list[Any]] = {}
    for fleet in diagnosis.fleet:
        pools.setdefault((fleet.host, fleet.pool), []).append(fleet)
    for (host, pool), fleets in sorted(pools.items()):
        now = fleets[-1]
        name = f"pool {pool or '(unnamed)'} on {host}"
        line = Text(f"{name}: ")
        line.append(now.kind.replace("_", " "), style=_FLEET_STYLES.get(now.kind, ""))
        ratio_now = now.idle_while_queued_ratio
        ratio_run = idle_while_queued_ratio(table, host, pool)
        line.append(
            f"; idle while queued {_percent(ratio_now)} now, {_percent(ratio_run)} over the run"
        )
        kinds = ", ".join(
            f"{kind.replace('_', ' ')} {count}"
            for kind, count in Counter(f.kind for f in fleets).items()
        )
        line.append(f" ({kinds} windows)")
        console.print(line)
        for sentence in now.evidence:
            if not sentence.startswith("idle while queued"):  # the line above says it
                console.print(f"  {sentence}", markup=False)
    _print_recommendations(console, _recommendations(table, diagnosis))


def _print_recommendations(console: Any, found: Sequence[Recommendation]) -> None:
    from rich.text import Text

    if not found:
        console.print("recommendations: none")
        return
    console.print("recommendations, cheapest first:")
    for r in found:
        line = Text(f"  {r.action} {r.target}", style="bold")
        line.append(f" (confidence {r.confidence:.2f}, id {r.id}): {r.reason}", style="")
        console.print(line)
        if r.expected is not None:
            before = ", ".join(f"{g} {v:.2f}" for g, v in sorted(r.expected.rho_before.items()))
            after = ", ".join(f"{g} {v:.2f}" for g, v in sorted(r.expected.rho_after.items()))
            console.print(f"    ρ by GPU now {before or 'n/a'}; after {after}", markup=False)


_FLEET_STYLES = {
    "imbalance": "bold red",
    "capacity_shortage": "bold red",
    "over_provisioning": "bold yellow",
    "balanced": "green",
    "unknown": "magenta",
}


def _percent(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio * 100:.0f} %"


def _clock(t: float) -> str:
    """Unix times as UTC clock times; a lab CSV's seconds since the start as such."""
    import datetime

    if t < 10**8:  # a frames.csv counts from the run's start
        return f"{t:.0f} s"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
