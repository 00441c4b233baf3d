"""An HTML report of a recorded run: one self-contained page of plots for people who would rather
look than read. Per GPU, timelines of utilization, queue and memory with its verdicts (and the
run's ground truth, when it recorded one) as colour bands and the controller's actions as
markers; per pool, idle-while-queued with the fleet verdicts; tables of the fleet figures.

The run is read where the analyzer reads it (`sources`: snapshots.jsonl, else frames.csv), and
judged as `gpubalance diagnose` judges it. The plots are PNG data URIs: the page needs nothing
but itself.
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpubalance import __version__
from gpubalance.arguments import seconds

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gpubalance.analyzer.frames import GpuFrame
    from gpubalance.analyzer.verdict import Classifier
    from gpubalance.diagnosis import FleetVerdict, Verdict

DEFAULT_WINDOW_SECONDS = 30.0
# the timelines' resolution: finer than the verdicts' windows, coarse enough to read
PLOT_WINDOW_SECONDS = 5.0
AUDIT_LOG = "gpubalance-controller-audit.jsonl"  # the controller's default --audit-log name
# Tableau 10, which colour-blind readers tell apart; unknown is grey, never a state's colour
STATE_COLOURS = {
    "starved": "#4e79a7",
    "overloaded": "#e15759",
    "balanced": "#59a14f",
    "unknown": "#bab0ac",
}
FLEET_COLOURS = {
    "imbalance": "#f28e2b",
    "capacity_shortage": "#e15759",
    "over_provisioning": "#76b7b2",
    "balanced": "#59a14f",
    "unknown": "#bab0ac",
}
# controller decisions that changed something, or tried to
ACTION_DECISIONS = {"applied", "dry_run", "failed"}
ACTION_COLOURS = {"applied": "#000000", "dry_run": "#9c755f", "failed": "#b07aa1"}


class ReportError(Exception):
    """The run cannot be reported; the message says which file and why."""


@dataclass(frozen=True, slots=True)
class Band:
    """A coloured stretch of a timeline: [start, end) seconds since the run's start."""

    start_seconds: float
    end_seconds: float
    label: str


@dataclass(frozen=True, slots=True)
class Action:
    """One controller decision from the audit log, seconds since the run's start."""

    at_seconds: float
    decision: str
    action: str
    target: str
    reason: str


@dataclass(slots=True)
class Run:
    """A recorded run, as the report needs it; times in seconds since the run's start."""

    directory: Path
    origin: float  # where second 0 is, in the frames' clock (Unix, or 0 for frames.csv)
    timeline: list[GpuFrame]  # short windows, for the plots
    verdicts: list[Verdict]
    fleet: list[FleetVerdict]
    truth: dict[int, list[Band]] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    classifier: str = "baseline-queue"


def configure(parser: argparse.ArgumentParser) -> None:
    from gpubalance.analyzer.baselines import CLASSIFIERS

    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        type=Path,
        metavar="DIR",
        help="a recorded run: a lab run directory (snapshots.jsonl, else frames.csv)",
    )
    parser.add_argument("--out", required=True, type=Path, metavar="FILE.html")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--classifier",
        choices=sorted(CLASSIFIERS),
        default="baseline-queue",
        help="the rule that judges the windows (default baseline-queue)",
    )
    which.add_argument("--model", type=Path, metavar="FILE", help="a trained model (skops)")
    parser.add_argument(
        "--window",
        type=seconds,
        default=DEFAULT_WINDOW_SECONDS,
        metavar="SECONDS",
        help=f"the verdicts' window (default {DEFAULT_WINDOW_SECONDS:.0f} s)",
    )
    parser.add_argument(
        "--audit-log",
        type=Path,
        metavar="FILE",
        help=f"the controller's audit log, for its actions (default DIR/{AUDIT_LOG} if present)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "gpubalance report: the plots need matplotlib: pip install 'gpubalance[report]'",
            file=sys.stderr,
        )
        return 2
    try:
        report = load_run(
            args.source,
            window_seconds=args.window,
            classifier=args.classifier,
            model=args.model,
            audit_log=args.audit_log,
        )
        page = render(report)
    except ReportError as exc:
        print(f"gpubalance report: {exc}", file=sys.stderr)
        return 2
    from gpubalance.analyzer.sources import lab_run_shortfall

    shortfall = lab_run_shortfall(args.source)
    if shortfall:
        print(f"gpubalance report: warning: {shortfall}", file=sys.stderr)
    try:
        args.out.write_text(page, encoding="utf-8")
    except OSError as exc:
        print(f"gpubalance report: --out {args.out}: cannot write: {exc.strerror}", file=sys.stderr)
        return 2
    print(
        f"{args.out}: {len(_gpus(report.timeline))} GPUs, {len(report.verdicts)} GPU-windows, "
        f"{len(report.actions)} controller actions"
    )
    return 0


# -- reading the run ---------------------------------------------------------------------------


def load_run(
    directory: Path,
    window_seconds: float = DEFAULT_WINDOW_SECONDS,
    classifier: str = "baseline-queue",
    model: Path | None = None,
    audit_log: Path | None = None,
) -> Run:
    from gpubalance.analyzer.features import FeatureBuilder
    from gpubalance.analyzer.sources import SourceError, lab_run_frames, read_snapshots
    from gpubalance.analyzer.verdict import Verdicts

    if not directory.is_dir():
        raise ReportError(f"--from {directory}: not a directory")
    snapshots = directory / "snapshots.jsonl"
    try:
        if snapshots.is_file():
            recording = read_snapshots(snapshots)
            origin = recording.origin
            plot_window = max(PLOT_WINDOW_SECONDS, recording.interval_seconds)
            timeline = recording.frames(plot_window)
            frames = recording.frames(window_seconds)
        else:
            origin = 0.0  # frames.csv counts seconds from the start
            timeline = lab_run_frames(directory, PLOT_WINDOW_SECONDS)
            frames = lab_run_frames(directory, window_seconds)
    except SourceError as exc:
        raise ReportError(str(exc)) from None
    except ValueError as exc:  # a window shorter than the sampling interval
        raise ReportError(f"--window {window_seconds:g}: {exc}") from None
    if not frames:
        raise ReportError(f"{directory}: not one complete {window_seconds:g} s window to judge")
    judge, name = _classifier(classifier, model)
    table = FeatureBuilder().transform(frames)
    fit = getattr(judge, "fit", None)
    if fit is not None and not hasattr(judge, "classes_"):
        fit(table)  # the rules learn nothing; fit only sets their classes
    diagnosis = Verdicts(judge).diagnose(table)
    audit = audit_log if audit_log is not None else directory / AUDIT_LOG
    if audit_log is not None and not audit.is_file():
        raise ReportError(f"--audit-log {audit}: no such file")
    return Run(
        directory=directory,
        origin=origin,
        timeline=timeline,
        verdicts=list(diagnosis.verdicts),
        fleet=list(diagnosis.fleet),
        truth=read_truth(directory / "truth.csv"),
        actions=read_actions(audit, origin) if audit.is_file() else [],
        classifier=name,
    )


def _classifier(name: str, model: Path | None) -> tuple[Classifier, str]:
    from gpubalance.analyzer.baselines import CLASSIFIERS

    if model is None:
        return CLASSIFIERS[name](), name
    from gpubalance.analyzer import model as models

    if not model.is_file():
        raise ReportError(f"--model {model}: no such file")
    try:
        return models.load(model), f"model {model.name}"
    except models.ModelError as exc:
        raise ReportError(f"--model {exc}") from None


def read_truth(path: Path) -> dict[int, list[Band]]:
    """The lab's ground truth per GPU (truth.csv: t_start,t_end,gpu,state,cause), if recorded."""
    if not path.is_file():
        return {}
    truth: dict[int, list[Band]] = defaultdict(list)
    with path.open(newline="") as stream:
        rows = csv.DictReader(stream)
        try:
            for row in rows:
                truth[int(row["gpu"])].append(
                    Band(float(row["t_start"]), float(row["t_end"]), row["state"])
                )
        except (KeyError, ValueError, TypeError) as exc:
            raise ReportError(f"{path}: line {rows.line_num}: cannot read: {exc}") from None
    return dict(truth)


def read_actions(path: Path, origin: float) -> list[Action]:
    """The controller's decisions that changed HAProxy or tried to, from its audit log."""
    actions = []
    with path.open(encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                if entry["decision"] not in ACTION_DECISIONS:
                    continue
                actions.append(
                    Action(
                        at_seconds=float(entry["at_seconds"]) - origin,
                        decision=str(entry["decision"]),
                        action=str(entry.get("action") or ""),
                        target=str(entry.get("target") or ""),
                        reason=str(entry.get("reason") or ""),
                    )
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ReportError(f"{path}:{number}: not a controller audit line: {exc}") from None
    return actions


# -- figures -----------------------------------------------------------------------------------


def _gpus(frames: Iterable[GpuFrame]) -> list[tuple[str, int]]:
    return sorted({(f.host, f.gpu) for f in frames})


def _bands(verdicts: Iterable[Verdict], origin: float) -> list[Band]:
    return [Band(v.t_start - origin, v.t_end - origin, v.state) for v in verdicts]


def _draw_bands(axes: Axes, bands: Sequence[Band], colours: dict[str, str], label: str) -> None:
    for band in bands:
        axes.axvspan(
            band.start_seconds, band.end_seconds, color=colours.get(band.label, "#ffffff"), lw=0
        )
    axes.set_yticks([])
    axes.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)


def _targets_gpu(action: Action, workers: set[str]) -> bool:
    """An action aimed at one of the GPU's workers (HAProxy server `backend/worker`)."""
    server = action.target.rpartition("/")[2]
    return bool(server) and server in workers


def _pyplot() -> Any:
    """matplotlib's pyplot on its file backend: the report draws without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(figure: Any) -> str:
    plt = _pyplot()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def gpu_figure(report: Run, host: str, gpu: int) -> str:
    """Utilization, queue and memory of one GPU over the run, its verdicts and truth as bands."""
    from matplotlib.patches import Patch

    plt = _pyplot()

    frames = [f for f in report.timeline if (f.host, f.gpu) == (host, gpu)]
    t = [(f.t_start + f.t_end) / 2 - report.origin for f in frames]
    strips = [("verdict", _bands(_of(report.verdicts, host, gpu), report.origin))]
    if gpu in report.truth:
        strips.append(("truth", report.truth[gpu]))
    heights = [2.2, 1.4, 1.4] + [0.3] * len(strips)
    figure, axes = plt.subplots(
        len(heights),
        1,
        figsize=(11, 0.8 * sum(heights) + 0.6),
        sharex=True,
        gridspec_kw={"height_ratios": heights, "hspace": 0.15},
    )
    utilization, queue, memory, *bands = axes
    utilization.plot(t, [_pct(f.utilization_mean_ratio) for f in frames], color="#2f4b7c", lw=1.4)
    utilization.set_ylim(0, 105)
    utilization.set_ylabel("utilization %")
    queue.plot(t, [_none(f.queue_depth_mean) for f in frames], color="#f28e2b", lw=1.4)
    queue.set_ylabel("queue depth")
    queue.set_ylim(bottom=0)
    memory.plot(t, [_gib(f.memory_used_bytes) for f in frames], color="#76b7b2", lw=1.4)
    total = next((f.memory_total_bytes for f in frames if f.memory_total_bytes), None)
    if total:
        memory.axhline(total / 2**30, color="#bab0ac", lw=0.8, ls="--")
        memory.set_ylim(0, total / 2**30 * 1.05)
    memory.set_ylabel("memory GiB")
    for axis in (utilization, queue, memory):
        axis.grid(True, color="#eeeeee")
    for axis, (label, strip) in zip(bands, strips, strict=True):
        _draw_bands(axis, strip, STATE_COLOURS, label)
    workers = {w for f in frames for w in f.workers}
    for action in report.actions:
        if _targets_gpu(action, workers):
            for axis in (utilization, queue, memory):
                axis.axvline(action.at_seconds, color=ACTION_COLOURS[action.decision], lw=1.2)
            utilization.plot(
                [action.at_seconds],
                [102],
                marker="v",
                ms=8,
                color=ACTION_COLOURS[action.decision],
                clip_on=False,
            )
    axes[-1].set_xlabel("seconds since the start of the run")
    axes[-1].set_xlim(0, max((b.end_seconds for _, s in strips for b in s), default=t[-1]))
    legend = [Patch(color=c, label=s) for s, c in STATE_COLOURS.items()]
    utilization.legend(
        handles=legend,
        loc="upper right",
        ncol=4,
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(1, 1.25),
    )
    utilization.set_title(f"{host} GPU {gpu}", loc="left", fontsize=11)
    return _png(figure)


def fleet_figure(report: Run) -> str:
    """Idle-while-queued per pool over the run, with the fleet verdicts as bands."""
    from matplotlib.patches import Patch

    plt = _pyplot()

    pools = sorted({(f.host, f.pool) for f in report.fleet})
    figure, axes = plt.subplots(
        1 + len(pools),
        1,
        figsize=(11, 2.6 + 0.45 * len(pools)),
        sharex=True,
        gridspec_kw={"height_ratios": [4] + [0.5] * len(pools), "hspace": 0.15},
    )
    ratio, *strips = axes
    # line colours apart from the verdicts' band colours
    palette = ["#2f4b7c", "#b07aa1", "#edc948", "#9c755f", "#ff9da7", "#000000"]
    for i, (host, pool) in enumerate(pools):
        verdicts = [f for f in report.fleet if (f.host, f.pool) == (host, pool)]
        # each window's value held to its end: the last one too
        ratio.step(
            [f.t_start - report.origin for f in verdicts] + [verdicts[-1].t_end - report.origin],
            [_pct(f.idle_while_queued_ratio) for f in [*verdicts, verdicts[-1]]],
            where="post",
            color=palette[i % len(palette)],
            lw=1.6,
            label=f"{host} {pool or '-'}",
        )
        _draw_bands(
            strips[i],
            [Band(f.t_start - report.origin, f.t_end - report.origin, f.kind) for f in verdicts],
            FLEET_COLOURS,
            pool or "(pool)",
        )
    for action in report.actions:
        ratio.axvline(action.at_seconds, color=ACTION_COLOURS[action.decision], lw=1, ls=":")
    ratio.set_ylim(0, 100)
    ratio.set_ylabel("idle while queued %")
    ratio.grid(True, color="#eeeeee")
    handles = ratio.get_legend_handles_labels()[0] + [
        Patch(color=c, label=k) for k, c in FLEET_COLOURS.items()
    ]
    ratio.legend(handles=handles, loc="upper right", ncol=3, fontsize=8, frameon=False)
    ratio.set_title("fleet: idle while queued per pool", loc="left", fontsize=11)
    axes[-1].set_xlabel("seconds since the start of the run")
    return _png(figure)


def _of(verdicts: Iterable[Verdict], host: str, gpu: int) -> list[Verdict]:
    return [v for v in verdicts if (v.host, v.gpu) == (host, gpu)]


def _pct(ratio: float | None) -> float:
    return float("nan") if ratio is None else ratio * 100


def _none(value: float | None) -> float:
    return float("nan") if value is None else value


def _gib(value: int | None) -> float:
    return float("nan") if value is None else value / 2**30


# -- the page ----------------------------------------------------------------------------------


def fleet_rows(report: Run) -> list[dict[str, str]]:
    """Per pool: windows by fleet verdict and idle-while-queued over the run (window-weighted)."""
    rows = []
    for host, pool in sorted({(f.host, f.pool) for f in report.fleet}):
        verdicts = [f for f in report.fleet if (f.host, f.pool) == (host, pool)]
        weighted = judged_seconds = 0.0
        for f in verdicts:
            if f.idle_while_queued_ratio is not None:
                weighted += f.idle_while_queued_ratio * (f.t_end - f.t_start)
                judged_seconds += f.t_end - f.t_start
        mean = weighted / judged_seconds if judged_seconds else None
        kinds = Counter(f.kind for f in verdicts)
        rows.append(
            {
                "pool": f"{host} {pool or '(none)'}",
                "GPUs": ", ".join(str(g) for g in sorted({g for f in verdicts for g in f.gpus})),
                "idle while queued": "-" if mean is None else f"{mean:.0%}",
                "windows by verdict": ", ".join(f"{k} {n}" for k, n in kinds.most_common()),
            }
        )
    return rows


def gpu_rows(report: Run) -> list[dict[str, str]]:
    """Per GPU: windows by state, the verdict now, and agreement with the truth if recorded."""
    rows = []
    for host, gpu in _gpus(report.timeline):
        verdicts = _of(report.verdicts, host, gpu)
        if not verdicts:
            continue
        last = verdicts[-1]
        row = {
            "GPU": f"{host} {gpu}",
            "card": next(
                (f.card or "" for f in report.timeline if (f.host, f.gpu) == (host, gpu)), ""
            ),
            "now": f"{last.state} ({last.cause})" if last.cause != "none" else last.state,
            "windows by state": ", ".join(
                f"{s} {n}" for s, n in Counter(v.state for v in verdicts).most_common()
            ),
        }
        if report.truth:
            row["agrees with truth"] = _agreement(
                verdicts, report.truth.get(gpu, []), report.origin
            )
        rows.append(row)
    return rows


def _agreement(verdicts: Sequence[Verdict], truth: Sequence[Band], origin: float) -> str:
    """The share of windows whose state is the truth's at the window's middle."""
    judged = agreed = 0
    for verdict in verdicts:
        middle = (verdict.t_start + verdict.t_end) / 2 - origin
        state = next((b.label for b in truth if b.start_seconds <= middle < b.end_seconds), None)
        if state is None:
            continue
        judged += 1
        agreed += state == verdict.state
    return f"{agreed / judged:.0%} of {judged}" if judged else "-"


def _table(rows: Sequence[dict[str, str]]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row.values()) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1140px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.meta { color: #666; } img { max-width: 100%; display: block; margin: 8px 0; }
table { border-collapse: collapse; margin: 8px 0; } td, th { padding: 3px 10px; text-align: left; }
th { border-bottom: 1px solid #999; } tr:nth-child(even) td { background: #f6f6f6; }
.evidence { color: #444; font-size: 13px; margin: 0 0 0 18px; }
"""


def render(report: Run) -> str:
    """The whole page."""
    gpus = _gpus(report.timeline)
    span = max((v.t_end for v in report.verdicts), default=report.origin) - report.origin
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gpubalance report: {html.escape(report.directory.name)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>gpubalance report: {html.escape(report.directory.name)}</h1>",
        f'<p class="meta">{len(gpus)} GPUs over {span:.0f} s, {len(report.verdicts)} GPU-windows '
        f"judged by {html.escape(report.classifier)}; "
        f"{'ground truth from truth.csv' if report.truth else 'no ground truth recorded'}; "
        f"{len(report.actions)} controller actions. gpubalance {__version__}.</p>",
        "<h2>Fleet</h2>",
        _table(fleet_rows(report)),
        f'<img alt="idle while queued per pool" src="{fleet_figure(report)}">',
        _table(gpu_rows(report)),
    ]
    for host, gpu in gpus:
        verdicts = _of(report.verdicts, host, gpu)
        parts.append(f"<h2>{html.escape(host)} GPU {gpu}</h2>")
        parts.append(
            f'<img alt="GPU {gpu}: utilization, queue, memory, verdicts" '
            f'src="{gpu_figure(report, host, gpu)}">'
        )
        if verdicts:
            last = verdicts[-1]
            reason = last.unknown_reason or "; ".join(last.evidence)
            parts.append(
                f'<p class="evidence">now {html.escape(last.state)}: {html.escape(reason)}</p>'
            )
    if report.actions:
        parts.append("<h2>Controller actions</h2>")
        parts.append(
            _table(
                [
                    {
                        "at s": f"{a.at_seconds:.0f}",
                        "decision": a.decision,
                        "action": a.action,
                        "target": a.target,
                        "reason": a.reason,
                    }
                    for a in report.actions
                ]
            )
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
