"""Closed-loop benchmark: the five balancing policies on the scenarios of each imbalance family,
at the fast speed (`gpubalance bench loop`, `gpubalance.lab.loop_bench.run_policy`).

Each scenario runs under round_robin, leastconn, random2, controller (leastconn with the
analyzer and the controller acting every analysis window), oracle (one central queue per
pool) and, where GPUs serve two pools, static-best (leastconn on the best split of the GPUs
between the pools), with `--seeds` seeds from the scenario's own; the table holds the median
over the seeds of each figure. Then `--generated` variants of each family the issue's
Done-when names (`gpubalance lab generate`, at a seed the shipped model was not trained on),
each once at its own seed, under every policy but static-best: the shipped scenarios show each
failure once, the variants how the loop does across its family. Results: bench/RESULTS.md
(section "loop") and bench/loop.png.

    python bench/loop.py [--seeds 3] [--duration SECONDS] [--scenario NAME ...]
                         [--generated 4] [--breadth 1]

Last, `--breadth` variants of every generated family under leastconn and the controller
alone: the controller acts on leastconn, and must not make a working server worse.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

sys.path.insert(0, str(BENCH))
from results import machine, progress, write_section  # noqa: E402

from gpubalance.lab import generate, scenario  # noqa: E402
from gpubalance.lab.loop_bench import (  # noqa: E402
    ALL,
    POLICIES,
    STATIC_BEST,
    LoopResult,
    run_policy,
    splits,
    without_router_events,
)
from gpubalance.lab.scenario import Plan  # noqa: E402

# (family, shipped scenario): the shipped scenarios of each family the issue names
FAMILIES: tuple[tuple[str, str], ...] = (
    ("heterogeneous cards", "skewed-heterogeneous"),
    ("heterogeneous cards", "slow-card-round-robin"),
    ("skew: weights", "default-target"),
    ("skew: sticky sessions", "sticky-sessions-skew"),
    ("host-starved worker", "host-bound"),
    ("mixed interactive and batch", "mixed-interactive-batch"),
    ("memory pressure", "fragmented-memory"),
    ("Azure code trace replay", "overprovisioned-fleet"),
    ("pool-demand shift", "pool-demand-shift"),
    ("pool-demand shift", "pool-demand-peaks"),
)
# (family, generated family): drawn variants of the families the Done-when names, at a seed
# none of the shipped model's training runs used (`make model` trains on seed 1)
GENERATED: tuple[tuple[str, str], ...] = (
    ("heterogeneous cards", "slow-card"),
    ("skew: weights", "weighted-skew"),
    ("skew: sticky sessions", "sticky-skew"),
)
GENERATED_SEED = 77
# the controller acts on leastconn: beside it, on a variant of every generated family (those
# the Done-when names and the rest), it must help or leave things as they were, never make a
# working server worse; a ratio of its p99 to leastconn's beyond this is called out
BREADTH_POLICIES = ("leastconn", "controller")
WORSE_RATIO = 1.10
# the pool-demand scenarios' static splits, each under leastconn and the oracle: static-best is
# the best of the leastconn ones, what a controller that moves GPUs between the pools has to beat
SHIFTS = ("pool-demand-shift", "pool-demand-peaks")


def median(results: Sequence[LoopResult], figure: Callable[[LoopResult], float | None]) -> float:
    values = [v for v in (figure(r) for r in results) if v is not None]
    return statistics.median(values) if values else float("nan")


def p99(r: LoopResult, service_class: str = ALL) -> float | None:
    return r.latency[service_class].p99_seconds


def policies(plan: Plan) -> list[str]:
    """static-best where GPUs serve two pools or more."""
    pools = {w.pool for w in plan.workers}
    return [p for p in POLICIES if p != STATIC_BEST or len(pools) > 1]


def run_all(
    plans: dict[str, Plan],
    seeds: int,
    duration: float | None,
    what: str = "loop benchmark",
    only: Sequence[str] | None = None,
) -> dict[str, dict]:
    """Each plan under each policy (``only`` those), ``seeds`` runs each."""
    out: dict[str, dict[str, list[LoopResult]]] = {}
    chosen = {
        name: [p for p in policies(plan) if only is None or p in only]
        for name, plan in plans.items()
    }
    total = sum(len(c) for c in chosen.values()) * seeds
    with progress(what, total) as advance:
        for name, plan in plans.items():
            length = duration or plan.scenario.duration_seconds
            out[name] = {}
            for policy in chosen[name]:
                runs = []
                for k in range(seeds):
                    runs.append(run_policy(plan, policy, plan.scenario.seed + k, length))
                    advance()
                out[name][policy] = runs
    return out


def run_splits(name: str, seeds: int) -> dict[str, dict[str, list[LoopResult]]]:
    """Each static split of a pool-demand scenario's GPUs under leastconn and the oracle."""
    out: dict[str, dict[str, list[LoopResult]]] = {}
    found = sorted(splits(scenario.load(name)), key=lambda p: len(p.workers_in("chat")))
    with progress(f"static splits of {name}", len(found) * 2 * seeds) as advance:
        for plan in found:
            chat = len(plan.workers_in("chat"))
            key = f"{chat} chat + {len(plan.gpus) - chat} code"
            out[key] = {}
            for policy in ("leastconn", "oracle"):
                out[key][policy] = []
                for k in range(seeds):
                    seed = plan.scenario.seed + k
                    length = plan.scenario.duration_seconds
                    out[key][policy].append(run_policy(plan, policy, seed, length))
                    advance()
    return out


def split_report(name: str, splits: dict[str, dict[str, list[LoopResult]]]) -> list[str]:
    if not splits:
        return []
    lines = [
        "",
        f"{name}, static splits of the four GPUs between the two pools (the shipped one is "
        "2 + 2): p99 per pool, s, median over the seeds. The static-best row above is, per "
        "seed, the leastconn split whose highest p99 of a class is lowest.",
        "",
        "| split | policy | p99 chat (interactive) | p99 code | p99 all |",
        "|---|---|---|---|---|",
    ]
    for key, by_policy in splits.items():
        for policy, runs in by_policy.items():
            lines.append(
                f"| {key} | {policy} | {_s(median(runs, lambda r: p99(r, 'interactive')))} "
                f"| {_s(median(runs, lambda r: p99(r, 'code')))} | {_s(median(runs, p99))} |"
            )
    return lines


def _tally(recommended: Sequence[dict[str, int]], refused: Sequence[dict[str, int]]) -> str:
    """Recommendations by action and refusals by reason, summed over the seeds."""
    asked: Counter[str] = sum((Counter(r) for r in recommended), Counter())
    no: Counter[str] = sum((Counter(r) for r in refused), Counter())
    text = ", ".join(f"{k} {v}" for k, v in sorted(asked.items()))
    if no:
        text += " (" + ", ".join(f"{k} {v}" for k, v in sorted(no.items())) + ")"
    return text


def _s(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"  # NaN: no answered request


def _pct(value: float) -> str:
    return "-" if value != value else f"{value * 100:.1f}"


def report(results: dict[str, dict], families: dict[str, str], command: str, took: float) -> str:
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {machine()}, "
        f"{took:.0f} s wall: `{command}`.",
        "",
        "Each scenario's cards, workers, pools, traffic, events and server weights are the static "
        "baseline; the policy replaces its balance algorithm (`gpubalance bench loop`). "
        "`controller` is leastconn with the analyzer (the shipped model, capacity-model "
        "recommender) judging each 30 s window and the controller passing every 10 s, as "
        "`gpubalance run` deploys them, at the controller's default guardrails. "
        "Latency: arrival to answer of the answered requests, in seconds, per class where a "
        "scenario has two; "
        "IWQ: idle-while-queued over the run (the simulator's truth, below), %; spread: "
        "largest minus smallest GPU's mean "
        "utilization, %; failed: rejected, out of KV memory or lost to a crash; recommended: "
        "the analyzer's recommendations by action over the run (in brackets the controller's "
        "refusals by reason: `unsupported_action` is one it does not carry out); actions: "
        "applied by the controller (`set_weight`, `drain`, `maint`, `ready`, `move`: a GPU "
        "moved to another pool), max/freeze: the most actions one server (or GPU, for moves) "
        "took within one 60 s freeze, an action being a recommendation carried out on it (a "
        "removal's drain and maint, a re-weighting's steps, are one). Medians over the seeds, "
        "except recommended and refused: totals over the seeds.",
        "",
        "| family | scenario | policy | p50 | p99 | p99 by class | IWQ | spread | failed | "
        "recommended (refused) | actions | max/freeze |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_policy in results.items():
        for policy, runs in by_policy.items():
            classes = [c for c in runs[0].latency if c != ALL]
            by_class = (
                ", ".join(f"{c} {_s(median(runs, lambda r, c=c: p99(r, c)))}" for c in classes)
                if len(classes) > 1
                else ""
            )
            actions: dict[str, float] = {}
            for kind in sorted({k for r in runs for k in r.actions}):
                actions[kind] = statistics.median(r.actions.get(kind, 0) for r in runs)
            acted = ", ".join(f"{k} {v:g}" for k, v in actions.items())
            most = f"{median(runs, lambda r: r.max_actions_per_freeze):g}"
            asked = _tally([r.recommended for r in runs], [r.refused for r in runs])
            if policy != "controller":
                acted = most = asked = ""
            lines.append(
                f"| {families[name]} | {name} | {policy} "
                f"| {_s(median(runs, lambda r: r.latency[ALL].p50_seconds))} "
                f"| {_s(median(runs, p99))} | {by_class} "
                f"| {_pct(median(runs, lambda r: r.idle_while_queued_ratio))} "
                f"| {_pct(median(runs, lambda r: r.utilization_spread_ratio))} "
                f"| {median(runs, lambda r: r.failed):g} "
                f"| {asked} | {acted} | {most} |"
            )
    lines += [
        "",
        "p99 ratios (issue 9's Done-when: controller/oracle ≤ 1.25, round_robin/controller ≥ 3; "
        "settled: over the requests that arrived after the first two analysis windows):",
        "",
    ]
    lines += [
        "| scenario | controller / oracle | round_robin / controller | controller / leastconn "
        "| round_robin / oracle | controller / oracle, settled |"
    ]
    lines += ["|---|---|---|---|---|---|"]
    for name, by_policy in results.items():
        c = median(by_policy["controller"], p99)
        oracle = median(by_policy["oracle"], p99)
        rr = median(by_policy["round_robin"], p99)
        settled = median(by_policy["controller"], settled_p99) / median(
            by_policy["oracle"], settled_p99
        )
        lines.append(
            f"| {name} | {c / oracle:.2f} | {rr / c:.2f} "
            f"| {c / median(by_policy['leastconn'], p99):.2f} | {rr / oracle:.2f} "
            f"| {settled:.2f} |"
        )
    shifted = {name: by for name, by in results.items() if STATIC_BEST in by}
    if shifted:
        lines += [
            "",
            "Moving GPUs between pools (issue 9's Done-when: static-best / controller ≥ 2 for "
            "the p99 of every pool):",
            "",
            "| scenario | class | static-best p99 | controller p99 | static-best / controller |",
            "|---|---|---|---|---|",
        ]
        for name, by_policy in shifted.items():
            for c in [c for c in by_policy["controller"][0].latency if c != ALL]:
                best = median(by_policy[STATIC_BEST], lambda r, c=c: p99(r, c))
                ctl = median(by_policy["controller"], lambda r, c=c: p99(r, c))
                lines.append(f"| {name} | {c} | {_s(best)} | {_s(ctl)} | {best / ctl:.2f} |")
    lines += [
        "",
        "Reading it: the controller runs over leastconn, so its own effect is the column "
        "controller / leastconn. round_robin / oracle is the most any policy gains over round "
        "robin on that server (the oracle's one pooled queue is the bound), so where it is "
        "under 3 no controller can be 3x better than round robin there; "
        "where the analyzer recommends nothing the controller can carry out (see "
        "`recommended`), its row is leastconn's. sticky-sessions-skew's skew comes from its "
        "hash policy (`sticky`), which every policy here replaces, so its rows show no skew "
        "left to fix. Idle-while-queued is the run's truth from the simulator's timeline: "
        "the share of GPU-time in which a GPU runs no batch while a request of its pool waits "
        "in the pool's central queue or behind another GPU's running batch (a request waiting "
        "for its own idle GPU's batch to fill is batching, not balance; a GPU idle while its "
        "host can take no more work for it, every preprocessing thread busy or a request "
        "waiting for a core or the disk, waits for its host), counted while the GPU "
        "serves the pool: one the controller took out, or is moving between pools, idles for "
        "nobody; after a split, the GPUs kept for the other classes idle for no batch "
        "request. Behind the oracle's "
        "central queue it is low, not 0: the lab's oracle hands a request to the worker with "
        "the fewest in flight, which may still run a batch while another GPU frees up sooner "
        "(long outputs).",
    ]
    return "\n".join(lines)


def generated_plans(count: int) -> dict[str, tuple[str, Plan, str]]:
    """Variant name -> (family label, plan, setup in words) of the GENERATED families."""
    out: dict[str, tuple[str, Plan, str]] = {}
    for label, family in GENERATED:
        for v in generate.variants(family, count, GENERATED_SEED):
            drawn = v.drawn
            events = sum(1 for key in drawn if key.startswith("event"))
            setup = f"{drawn.get('gpus', '?')}; {drawn.get('policy', '?')}"
            if "weights" in drawn:
                setup += f" ({drawn['weights']})"
            setup += f"; {events} event(s)" if events else ""
            out[v.name] = (label, generate.plan_of(v.document, v.name), setup)
    return out


def breadth_plans(count: int) -> dict[str, tuple[str, Plan]]:
    """Variant name -> (family, plan): ``count`` variants of every generated family, without
    their `router` events (a person re-weighting mid-run), which the controller's run leaves
    out: leastconn's run is then the controller's without the controller."""
    out: dict[str, tuple[str, Plan]] = {}
    for family in generate.FAMILIES:
        for v in generate.variants(family, count, GENERATED_SEED):
            out[v.name] = (family, without_router_events(generate.plan_of(v.document, v.name)))
    return out


def breadth_report(results: dict[str, dict], meta: dict[str, tuple[str, Plan]]) -> str:
    lines = [
        f"Every generated family: `gpubalance lab generate --family F --count N --seed "
        f"{GENERATED_SEED}`, each variant once at its own seed and drawn duration, under "
        "leastconn and under the controller, which acts on leastconn: where the analyzer "
        "recommends nothing the controller can carry out, the two runs are the same run. p99 "
        "in seconds, per class where a variant has two (the class the controller served "
        f"worst against leastconn, then the best); ratios beyond {WORSE_RATIO:.2f} are marked. "
        "A variant's `router` events (a person changing the weights mid-run) are left out of "
        "both runs, as the controller's run leaves them out everywhere.",
        "",
        "| family | variant | leastconn p99 | controller p99 | controller / leastconn | "
        "worst class | best class | IWQ leastconn | IWQ controller | failed leastconn | "
        "failed controller | actions |",
        "|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]
    worse: list[str] = []
    same = better = 0
    for name, by_policy in results.items():
        family, _ = meta[name]
        lc, ctl = by_policy["leastconn"][0], by_policy["controller"][0]
        a, b = p99(lc) or math.nan, p99(ctl) or math.nan
        classes = sorted(
            (
                ((p99(ctl, c) or math.nan) / (p99(lc, c) or math.nan), c)
                for c in lc.latency
                if c != ALL and c in ctl.latency
            ),
            reverse=True,
        )
        worst = f"{classes[0][1]} {classes[0][0]:.2f}" if len(classes) > 1 else ""
        best = f"{classes[-1][1]} {classes[-1][0]:.2f}" if len(classes) > 1 else ""
        ratio = b / a
        mark = " ⚠" if ratio > WORSE_RATIO else ""
        if ratio > WORSE_RATIO:
            worse.append(name)
        elif ratio < 1 / WORSE_RATIO:
            better += 1
        else:
            same += 1
        acted = ", ".join(f"{k} {v}" for k, v in ctl.actions.items())
        lines.append(
            f"| {family} | {name} | {_s(a)} | {_s(b)} | {ratio:.2f}{mark} | {worst} | {best} "
            f"| {_pct(lc.idle_while_queued_ratio or 0.0)} "
            f"| {_pct(ctl.idle_while_queued_ratio or 0.0)} | {lc.failed} | {ctl.failed} "
            f"| {acted} |"
        )
    lines += [
        "",
        f"Of {len(results)} variants the controller's p99 is within {WORSE_RATIO:.2f}x "
        f"leastconn's on {same}, better on {better}, worse on {len(worse)}"
        + (f" ({', '.join(worse)})." if worse else "."),
    ]
    return "\n".join(lines)


def settled_p99(r: LoopResult) -> float | None:
    return r.settled[ALL].p99_seconds


def generated_report(results: dict[str, dict], meta: dict[str, tuple[str, Plan, str]]) -> str:
    policies_run = [p for p in POLICIES if p != STATIC_BEST]
    lines = [
        f"Generated variants: `gpubalance lab generate --family F --count N --seed "
        f"{GENERATED_SEED}` for the families the Done-when names, each run once at its own seed "
        "and drawn duration under every policy (the shipped model trained on other variants of "
        "these families, drawn at seed 1, not on these). p99 over the run, in seconds; "
        "settled: over the requests that arrived after the first two analysis windows (the "
        "variant is skewed from t = 0 and no controller acts before its first verdict; the "
        "backlog the start left still counts). IWQ in %.",
        "",
        "| family | variant | setup | "
        + " | ".join(policies_run)
        + " | controller settled | oracle settled | controller / oracle | settled | "
        "round_robin / controller | round_robin / oracle | IWQ controller | IWQ oracle | "
        "actions |",
        "|---|---|---|" + "---|" * (len(policies_run) + 9),
    ]
    summary: dict[str, list[tuple[float, float, float, float, float, float]]] = {}
    for name, by_policy in results.items():
        label, _, setup = meta[name]
        one = {p: runs[0] for p, runs in by_policy.items()}
        c, o, rr = (p99(one[k]) or math.nan for k in ("controller", "oracle", "round_robin"))
        cs, os_ = (settled_p99(one[k]) or math.nan for k in ("controller", "oracle"))
        iwq_c = one["controller"].idle_while_queued_ratio or 0.0
        iwq_o = one["oracle"].idle_while_queued_ratio or 0.0
        acted = ", ".join(f"{k} {v}" for k, v in one["controller"].actions.items())
        summary.setdefault(label, []).append((c / o, cs / os_, rr / c, rr / o, iwq_c, iwq_o))
        lines.append(
            f"| {label} | {name} | {setup} | "
            + " | ".join(_s(p99(one[p]) or math.nan) for p in policies_run)
            + f" | {_s(cs)} | {_s(os_)} | {c / o:.2f} | {cs / os_:.2f} | {rr / c:.2f} "
            f"| {rr / o:.2f} | {_pct(iwq_c)} | {_pct(iwq_o)} | {acted} |"
        )
    lines += [
        "",
        "Per family (issue 9's Done-when: controller / oracle ≤ 1.25, round robin / controller "
        "≥ 3, idle-while-queued ≤ 2 %; ≥ 3 over round robin is only open to a policy where "
        "round robin is ≥ 3x the oracle, and ≤ 2 % only where the oracle's own is):",
        "",
        "| family | variants | controller / oracle, median (max) | ≤ 1.25 | settled ≤ 1.25 "
        "| round robin ≥ 3x the oracle | of those, ≥ 3x the controller | IWQ ≤ 2 %: controller "
        "| oracle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rows in summary.items():
        ratios = [r[0] for r in rows]
        open_ = [r for r in rows if r[3] >= 3]
        lines.append(
            f"| {label} | {len(rows)} | {statistics.median(ratios):.2f} ({max(ratios):.2f}) "
            f"| {sum(r[0] <= 1.25 for r in rows)} | {sum(r[1] <= 1.25 for r in rows)} "
            f"| {len(open_)} | {sum(r[2] >= 3 for r in open_)} "
            f"| {sum(r[4] <= 0.02 for r in rows)} | {sum(r[5] <= 0.02 for r in rows)} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict], generated: dict[str, dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    if generated:
        fig, (ax, gx) = plt.subplots(2, 1, figsize=(11, 9))
        _plot_generated(gx, generated)
    else:
        fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        values = [median(results[n].get(policy, []), p99) for n in names]
        ax.bar([k + i * width for k in range(len(names))], values, width, label=policy)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))])
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("p99 latency, s (log)")
    ax.set_title("Closed loop at the fast speed: p99 latency by policy (median over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(BENCH / "loop.png", dpi=100)
    plt.close(fig)


def _plot_generated(ax: Any, generated: dict[str, dict]) -> None:
    """Each variant's p99 over the oracle's, per policy: the oracle's line is 1, the Done-when's
    bound for the controller 1.25."""
    names = list(generated)
    shown = [p for p in POLICIES if p not in (STATIC_BEST, "oracle")]
    width = 0.8 / len(shown)
    for i, policy in enumerate(shown):
        values = [
            (p99(generated[n][policy][0]) or math.nan)
            / (p99(generated[n]["oracle"][0]) or math.nan)
            for n in names
        ]
        ax.bar([k + i * width for k in range(len(names))], values, width, label=policy)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.25, color="black", linewidth=0.8, linestyle="--", label="1.25x the oracle")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))])
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("p99 / the oracle's p99 (log)")
    ax.set_title(
        f"Generated variants (seed {GENERATED_SEED}): p99 against the oracle's, one run each"
    )
    ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per scenario and policy")
    parser.add_argument("--duration", type=float, help="default: each scenario's own")
    parser.add_argument(
        "--scenario", nargs="+", metavar="NAME", help="default: one or two per family"
    )
    parser.add_argument(
        "--generated",
        type=int,
        default=4,
        metavar="N",
        help="variants per generated family the Done-when names (0: none)",
    )
    parser.add_argument(
        "--breadth",
        type=int,
        default=1,
        metavar="N",
        help="variants of every generated family under leastconn and the controller (0: none)",
    )
    args = parser.parse_args()
    families = dict((name, family) for family, name in FAMILIES)
    names = args.scenario or [name for _, name in FAMILIES]
    for name in names:
        families.setdefault(name, "")
    started = time.monotonic()
    results = run_all({name: scenario.load(name) for name in names}, args.seeds, args.duration)
    drawn = generated_plans(args.generated) if args.generated > 0 else {}
    generated = run_all(
        {name: plan for name, (_, plan, _) in drawn.items()}, 1, None, "generated variants"
    )
    wide = breadth_plans(args.breadth) if args.breadth > 0 else {}
    breadth = run_all(
        {name: plan for name, (_, plan) in wide.items()},
        1,
        None,
        "every family: leastconn and the controller",
        BREADTH_POLICIES,
    )
    split_runs = {
        name: run_splits(name, args.seeds)
        for name in SHIFTS
        if name in names and args.duration is None
    }
    took = time.monotonic() - started
    command = "python bench/loop.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            report(results, families, command.strip(), took),
            *(line for name, runs in split_runs.items() for line in split_report(name, runs)),
            *(["", generated_report(generated, drawn)] if generated else []),
            *(["", breadth_report(breadth, wide)] if breadth else []),
        ]
    )
    write_section(
        "loop",
        "Closed loop: balancing policies at the fast speed",
        text + "\n\n![p99 by policy](loop.png)\n",
    )
    plot(results, generated)
    print(text)


if __name__ == "__main__":
    main()
