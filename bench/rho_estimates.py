"""How close the analyzer's load estimates come to the ground truth's ρ, per window.

The ground truth calls a GPU overloaded at ρ ≥ 0.85 and starved below 0.30, ρ being the share
of the window its work needs at full batches. The telemetry does not show ρ; the features
estimate it three ways (`rho_fitted_ratio`: completions times the cost of a full batch from
the power law through the card's batch times against their sizes, at the batches it can
run; `offered_rho_estimate_ratio`: completions and queue growth over a capacity from the
GPU's or its card's best; `effective_utilization_ratio`: busy share times batch fill). This
runs generated variants of every family at the fast speed and reports, per estimate, where it
is known, its median ratio to the truth and its median absolute error, per family and per band
of the truth's ρ: a verdict near a threshold can be no better than these.

    python bench/rho_estimates.py --count 8 --seed 1 --jobs 2
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import progress, write_section  # noqa: E402

from gpubalance.analyzer import evaluate, train  # noqa: E402
from gpubalance.lab.truth import OVERLOADED_RHO, STARVED_RHO  # noqa: E402

FIGURE = Path(__file__).resolve().parent / "rho_estimates.png"
ESTIMATES = ("rho_fitted_ratio", "offered_rho_estimate_ratio", "effective_utilization_ratio")
BANDS = ((0.0, 0.3), (0.3, 0.6), (0.6, 0.85), (0.85, 1.2), (1.2, float("inf")))
# the truth's lines: starved below the first, overloaded from the second
LINES = (STARVED_RHO, OVERLOADED_RHO)
# the bytes each weight streams per decode step, as a run's models name them, widest first
WEIGHTS = {2.0: "16-bit weights", 1.0: "8-bit weights", 0.5: "4-bit weights"}
# (estimates per window in ESTIMATES order, truth rho) of one run
Pairs = tuple[np.ndarray, np.ndarray]


def _pairs(example: train.Example) -> Pairs:
    table, rows = train.truth_of_features(example)
    keep = [i for i, row in enumerate(rows) if row is not None]
    values = np.stack([table.column(name)[keep] for name in ESTIMATES], axis=1)
    return values, np.array([rows[i].rho for i in keep])


def _weights(example: train.Example) -> str:
    """What a run's models stream per weight: the one size they share, else "mixed"."""
    sizes = {float(m.get("bytes_per_param", 2.0)) for m in example.document["models"].values()}
    if len(sizes) != 1:
        return "mixed"
    (size,) = sizes
    return WEIGHTS.get(size, f"{size:g} bytes a weight")


def _row(label: str, values: np.ndarray, rho: np.ndarray) -> str:
    cells = [label, str(len(rho))]
    for k in range(len(ESTIMATES)):
        known = ~np.isnan(values[:, k])
        if not known.any():
            cells += ["0 %", "-", "-", "-"]
            continue
        estimate, truth = values[known, k], rho[known]
        positive = truth > 0.05  # a ratio to a near-zero truth says nothing
        ratio = np.median(estimate[positive] / truth[positive]) if positive.any() else np.nan
        side = np.mean(np.digitize(estimate, LINES) == np.digitize(truth, LINES))
        cells += [
            f"{known.mean():.0%}",
            "-" if np.isnan(ratio) else f"{ratio:.2f}",
            f"{np.median(np.abs(estimate - truth)):.3f}",
            f"{side:.0%}",
        ]
    return "| " + " | ".join(cells) + " |"


def _table(first: str, rows: Sequence[str]) -> list[str]:
    head = [first, "windows"]
    for name in ESTIMATES:
        head += [f"{name}: known", "median ratio", "median abs error", "same side"]
    return ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|", *rows]


def plot(values: np.ndarray, rho: np.ndarray) -> None:
    """Each estimate against the truth's ρ, with the truth's thresholds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ESTIMATES), figsize=(15, 4.6), sharex=True, sharey=True)
    for k, (ax, name) in enumerate(zip(axes, ESTIMATES, strict=True)):
        known = ~np.isnan(values[:, k])
        ax.scatter(rho[known], values[known, k], s=3, alpha=0.25, linewidths=0)
        ax.plot([0, 2], [0, 2], color="black", linewidth=0.8)
        for line in (0.3, 0.85):
            ax.axvline(line, color="grey", linewidth=0.6, linestyle="--")
            ax.axhline(line, color="grey", linewidth=0.6, linestyle="--")
        ax.set(xlim=(0, 2), ylim=(0, 2), xlabel="truth ρ", title=f"{name} ({known.mean():.0%})")
    axes[0].set_ylabel("estimate")
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="all", help="all, or F1,F2,...")
    parser.add_argument("--count", type=int, default=8, help="variants per family")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-write", action="store_true", help="print, leave RESULTS.md")
    args = parser.parse_args()
    examples = evaluate.generated_examples(evaluate.family_list(args.family), args.count, args.seed)
    started = time.monotonic()
    by_family: dict[str, list[Pairs]] = defaultdict(list)
    by_weights: dict[str, list[Pairs]] = defaultdict(list)
    with (
        ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool,
        progress("fast-speed runs", len(examples)) as advance,
    ):
        for example, pairs in zip(examples, pool.map(_pairs, examples), strict=True):
            by_family[example.family].append(pairs)
            by_weights[_weights(example)].append(pairs)
            advance()
    values = np.vstack([v for runs in by_family.values() for v, _ in runs])
    rho = np.concatenate([r for runs in by_family.values() for _, r in runs])

    def grouped(groups: dict[str, list[Pairs]], label: str, order: Sequence[str]) -> list[str]:
        return [
            _row(
                label.format(key),
                np.vstack([v for v, _ in groups[key]]),
                np.concatenate([r for _, r in groups[key]]),
            )
            for key in order
            if key in groups
        ]

    family_rows = grouped(by_family, "`{}`", sorted(by_family))
    weight_rows = grouped(
        by_weights, "{}", [*WEIGHTS.values(), *sorted(set(by_weights) - set(WEIGHTS.values()))]
    )
    band_rows = [
        _row(f"{low:g}-{high:g}", values[mask], rho[mask])
        for low, high in BANDS
        if (mask := (rho >= low) & (rho < high)).any()
    ]
    command = " ".join(["python bench/rho_estimates.py", *sys.argv[1:]])
    body = "\n".join(
        [
            f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, {time.monotonic() - started:.0f} s wall: `{command}`: "
            f"{len(examples)} generated runs, {len(rho):,} GPU-windows with a truth.",
            "",
            "Per estimate: the share of windows it is known in, its median ratio to the "
            "truth's ρ (windows with ρ > 0.05), its median absolute error, and the share of "
            "the windows it is known in where it falls on the truth's side of both lines: "
            "the ground truth draws them at ρ 0.30 and 0.85.",
            "",
            *_table("truth ρ", [_row("all", values, rho), *band_rows]),
            "",
            *_table("family", family_rows),
            "",
            "By the weights the runs' models stream per decode step (a run of models of "
            "two sizes: mixed). `rho_fitted_ratio` prices a full batch along a power law "
            "whose exponent, where the batch sizes seen spread too little to tell, comes from "
            "the work's mix with a decode step costing as much as 150 prompt tokens: the "
            "ratio of 16-bit weights. Smaller weights make a step cheaper, the work less "
            "batchable than that prior has it, and the estimate reads low; the telemetry "
            "does not say how wide the weights are.",
            "",
            *_table("weights", weight_rows),
            "",
            f"![load estimates against the truth's rho]({FIGURE.name})",
        ]
    )
    print(body)
    if not args.no_write:
        plot(values, rho)
        write_section("rho-estimates", "Analyzer: load estimates against the truth's ρ", body)


if __name__ == "__main__":
    main()
