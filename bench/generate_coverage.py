"""What the generated scenario families put in the ground truth: a family x (state, cause) table.

Runs COUNT variants of every family (`gpubalance.lab.generate`, seed SEED, durations as drawn
unless --duration fixes one) at the fast speed, end to end (`gpubalance.lab.run.run`: traffic,
truth, simulation, the output files), and counts the truth windows (one GPU, one window) of
each family by state and cause. The analyzer is scored with each family held out in turn, so
every cause must show in the truth of at least three families: the report says which do.
Writes lab/GENERATED.md (the table and the coverage) and lab/generated.png (a heatmap).

    python bench/generate_coverage.py [--count 5] [--seed 1] [--duration S] [--jobs 1]
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "lab" / "GENERATED.md"
FIGURE = ROOT / "lab" / "generated.png"
MIN_FAMILIES = 3

sys.path.insert(0, str(ROOT / "bench"))
from results import progress  # noqa: E402

from gpubalance.lab import generate  # noqa: E402
from gpubalance.lab import run as lab_run  # noqa: E402
from gpubalance.lab.truth import CAUSES  # noqa: E402

# every (state, cause) the rules can give, in the order of lab/scenarios/README.md
PAIRS = (
    ("balanced", "none"),
    ("starved", "worker_crash"),
    ("starved", "host_bound"),
    ("starved", "io_bound"),
    ("starved", "batch_delay"),
    ("starved", "routing_skew"),
    ("starved", "low_demand"),
    ("overloaded", "memory_pressure"),
    ("overloaded", "throttling"),
    ("overloaded", "class_interference"),
    ("overloaded", "capacity_shortage"),
    ("overloaded", "slow_card"),
    ("overloaded", "routing_skew"),
)


@dataclass(frozen=True)
class Result:
    family: str
    name: str
    duration_seconds: float
    windows: Counter[tuple[str, str]]
    outcomes: dict[str, int]
    wall_seconds: float


def run_one(variant: generate.Variant) -> Result:
    plan = generate.plan_of(variant.document, variant.name)
    duration = plan.scenario.duration_seconds
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpubalance-generated-") as out:
        summary = lab_run.run(plan, "fast", duration, plan.scenario.seed, Path(out))
        with (Path(out) / "truth.csv").open(newline="") as f:
            windows = Counter((row["state"], row["cause"]) for row in csv.DictReader(f))
    return Result(
        variant.family,
        variant.name,
        duration,
        windows,
        summary.outcomes,
        time.perf_counter() - start,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5, help="variants per family")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, help="fix every variant's duration (s)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (processes)")
    args = parser.parse_args()
    start = time.perf_counter()
    variants = generate.variants("all", args.count, args.seed, args.duration)
    results: list[Result] = []
    with progress("fast-speed runs", len(variants)) as advance:
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                for result in pool.map(run_one, variants):
                    results.append(result)
                    advance()
        else:
            for variant in variants:
                results.append(run_one(variant))
                advance()
    wall = time.perf_counter() - start
    table = {family: Counter[tuple[str, str]]() for family in generate.FAMILIES}
    for r in results:
        table[r.family].update(r.windows)
    REPORT.write_text(report(args, results, table, wall))
    plot(table, args)
    missing = [c for c in CAUSES if len(families_with(table, c)) < MIN_FAMILIES]
    print(f"{len(results)} runs, {wall:.0f} s; {REPORT.relative_to(ROOT)}, {FIGURE.name}")
    if missing:
        print(f"causes in fewer than {MIN_FAMILIES} families: {', '.join(missing)}")
        return 1
    return 0


def families_with(table: dict[str, Counter[tuple[str, str]]], cause: str) -> list[str]:
    return [
        f for f, counts in table.items() if any(c == cause for (_, c), n in counts.items() if n)
    ]


def report(
    args: argparse.Namespace,
    results: list[Result],
    table: dict[str, Counter[tuple[str, str]]],
    wall: float,
) -> str:
    durations = "as drawn (300-900 s)" if args.duration is None else f"{args.duration:g} s"
    outcomes: Counter[str] = Counter()
    for r in results:
        outcomes.update(r.outcomes)
    simulated = sum(r.duration_seconds for r in results) / 3600
    requests = sum(outcomes.values())
    command = f"python bench/generate_coverage.py --count {args.count} --seed {args.seed}"
    if args.duration is not None:
        command += f" --duration {args.duration:g}"
    runs = f"{len(results)} runs, {simulated:.1f} simulated hours, {requests:,} requests"
    kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(outcomes.items()))
    lines = [
        "# Generated scenario families: what their ground truth holds",
        "",
        f"Written by `{command}` (gpubalance {commit()}).",
        f"Each of the {len(table)} families of `gpubalance lab generate`",
        '(lab/scenarios/README.md, "Generated families") drew',
        f"{args.count} variant(s), durations {durations}, and each ran at the fast speed end to",
        f"end: {runs} ({kinds}), {wall:.0f} s of wall time.",
        "A cell counts truth windows: one GPU in one 30-s window, by state and cause.",
        "",
        "The analyzer is scored with each family held out in turn, so a cause must be learnable",
        f"from other families: every cause has to be in the truth of at least {MIN_FAMILIES}.",
        "",
        "![family x state and cause, truth windows](generated.png)",
        "",
        "## Coverage",
        "",
        "| cause | families | which |",
        "|---|---:|---|",
    ]
    for cause in CAUSES:
        found = families_with(table, cause)
        mark = "" if len(found) >= MIN_FAMILIES else " **(too few)**"
        lines.append(f"| `{cause}` | {len(found)}{mark} | {', '.join(found)} |")
    header = ["family", *(f"{s[:4]}. {c}" for s, c in PAIRS), "windows"]
    lines += [
        "",
        "## Truth windows by family",
        "",
        "Columns: `bala.` balanced, `star.` starved, `over.` overloaded.",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for family, counts in table.items():
        cells = [str(counts[p]) if counts[p] else "" for p in PAIRS]
        lines.append(f"| `{family}` | " + " | ".join(cells) + f" | {sum(counts.values())} |")
    totals = Counter[tuple[str, str]]()
    for counts in table.values():
        totals.update(counts)
    cells = [str(totals[p]) for p in PAIRS]
    lines.append("| all | " + " | ".join(cells) + f" | {sum(totals.values())} |")
    return "\n".join(lines) + "\n"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "(no git)"
    return out.stdout.strip()


def plot(table: dict[str, Counter[tuple[str, str]]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    families = list(table)
    counts = np.array([[table[f][p] for p in PAIRS] for f in families], dtype=float)
    # share of each family's windows, so a family with long runs does not drown the others
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.32 * len(families)))
    image = ax.imshow(
        shares, cmap="viridis", vmin=0, vmax=max(0.5, float(shares.max())), aspect="auto"
    )
    for i, j in zip(*np.nonzero(counts), strict=True):
        value = int(counts[i, j])
        text = f"{value / 1000:.1f}k" if value >= 1000 else str(value)
        ax.text(j, i, text, ha="center", va="center", fontsize=7, color=_ink(shares[i, j]))
    ax.set_xticks(
        range(len(PAIRS)), [f"{s} {c}" for s, c in PAIRS], fontsize=7, rotation=40, ha="right"
    )
    ax.set_yticks(range(len(families)), families, fontsize=8)
    ax.set_title(
        f"Truth windows by family, state and cause: {args.count} variant(s) per family, "
        f"seed {args.seed}\n(colour: share of the family's windows)",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, fraction=0.02, pad=0.01)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=100)


def _ink(share: float) -> str:
    return "black" if share > 0.3 or math.isnan(share) else "white"


if __name__ == "__main__":
    sys.exit(main())
