"""Recommendations' predicted ρ against the realised one, over generated scenario families.

Each variant runs at the fast speed to the window nearest half its duration, is diagnosed with
the queue + utilization baseline, and every recommendation the lab can carry out is applied
(gpubalance.lab.apply.outcomes); the realised ρ is the ground truth's mean over the
recommendation's horizon. Prints the median |predicted - realised| over the GPUs predicted, overall,
per action and per how the capacity behind the prediction was measured, and over the
recommendations (each the mean over its GPUs); then what the error is made of
(``gpubalance.lab.apply.error_parts``).

    python bench/recommend_error.py --count 3 --seed 5 --at 0.33 0.5 0.67
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from gpubalance.analyzer.baselines import QueueUtilization
from gpubalance.lab import apply
from gpubalance.lab.generate import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="all")
    parser.add_argument("--count", type=int, default=3, help="variants per family")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--at",
        type=float,
        nargs="+",
        default=[0.5],
        metavar="FRACTION",
        help="when to recommend, as fractions of each run (whole windows)",
    )
    args = parser.parse_args()
    found: list[apply.Outcome] = []
    documents = generate(args.family, args.count, args.seed)
    for document in documents:
        duration = float(document["duration_seconds"])
        width = float(document.get("truth_window_seconds", 30.0))
        for fraction in args.at:
            at = max(width, width * round(duration * fraction / width))
            found += apply.outcomes(
                document,
                str(document["name"]),
                int(document["seed"]),
                QueueUtilization(),
                at_seconds=at,
            )
    errors = apply.rho_errors(found)
    groups: dict[str, list[float]] = defaultdict(list)
    for o in found:
        if o.rho_error is not None and not o.taken_out:
            groups[f"action {o.action}"].append(o.rho_error)
            groups[f"capacity {o.capacity_source}"].append(o.rho_error)
    # a recommendation's error: the mean over the GPUs it predicts
    per: dict[tuple[str, str, float], list[float]] = defaultdict(list)
    for o in found:
        if o.rho_error is not None and not o.taken_out:
            per[(o.scenario, o.recommendation_id, o.at_seconds)].append(o.rho_error)
    runs = len({o.scenario for o in found})
    print(f"{len(documents)} variants, {runs} with a recommendation the lab applies")
    print(f"{'':28} {'GPUs':>5} {'median |Δρ|':>12}")
    if errors:
        print(f"{'all':28} {len(errors):5d} {statistics.median(errors):12.3f}")
    for name, values in sorted(groups.items()):
        print(f"{name:28} {len(values):5d} {statistics.median(values):12.3f}")
    if per:
        means = [statistics.fmean(v) for v in per.values()]
        print(
            f"{len(per)} recommendations, median of their mean |Δρ|: {statistics.median(means):.3f}"
        )
    print()
    print("What the error is made of (median |Δρ| over the GPUs that have each figure):")
    print(f"{'':60} {'GPUs':>5} {'median |Δρ|':>12}")
    for label, values in apply.error_parts(found).items():
        if values:
            print(f"{label:60} {len(values):5d} {statistics.median(values):12.3f}")


if __name__ == "__main__":
    main()
