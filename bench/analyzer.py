"""Analyzer benchmark: fleet diagnosis of 1,000 hosts x 8 GPUs from a real Prometheus.

Goal (issue 8, "Scale"): the fleet diagnosis of 1,000 hosts x 8 GPUs from Prometheus in at most
5 s, and at least 10,000 GPU-windows/s on one core.

The fleet: four 8-GPU lab scenarios (balanced; two GPUs overloaded by a skewed weighted round
robin while six starve; starved for want of demand; overloaded for want of capacity), each run
at the fast speed with a few seeds. Every exporter sample goes through the exporter's own
window figures and native exposition (``compute_window``, ``exposition.render``), and what a
Prometheus scraping every ``--scrape`` seconds would have stored is written as OpenMetrics
text, one lab run per host in turn, relabelled per host (``instance``, ``job``, GPU UUIDs).
``promtool tsdb create-blocks-from openmetrics`` backfills a TSDB from it, and a real
``prometheus`` serves that TSDB on 127.0.0.1 at a free port.

The diagnosis is what ``gpubalance diagnose --from URL --fleet`` does with a Prometheus
(:func:`diagnose`): the Prometheus source's range queries, their parsing and the frames, the
features, and the verdicts with the CLI's default classifier (the model gpubalance ships,
loaded from its file as each `gpubalance diagnose` process loads it; ``--classifier
baseline-queue`` for the queue + utilization rule), timed per stage, for the latest window
and for the source's default range, median of repeated runs, on one pinned core. The
verdicts are checked against the states the lab's ground truth planted. Results:
bench/RESULTS.md ("analyzer-scale") and bench/analyzer.png.

    python bench/analyzer.py [--hosts 1000] [--minutes 12] [--scrape 15] [--repeats 3]
                             [--keep DIR] [--classifier model|baseline-queue]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# one core means one thread: numpy's BLAS pool would otherwise start a thread per CPU
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
WINDOW_SECONDS = 30.0
EXPORTER_INTERVAL_SECONDS = 1.0  # the exporter's default sampling interval
EXPORTER_WINDOW_SECONDS = 30.0  # and its default --window, --trend-window
EXPORTER_TREND_SECONDS = 300.0
# the fleet's first window starts here: a multiple of the window, as the source aligns them
T0 = 1_750_000_020.0
GOAL_SECONDS = 5.0
GOAL_GPU_WINDOWS_PER_SECOND = 10_000.0
UUID_HEAD = re.compile(r'uuid="GPU-[0-9a-f]{8}')
STAGES = ("model", "query", "parse", "frames", "features", "verdicts")
# --classifier: the CLI's default, or the rule (nothing to load)
CLASSIFIER_NAMES = {
    "model": "the default, the model gpubalance ships, its file read (stage `model`) as each "
    "command reads it",
    "baseline-queue": "the queue + utilization rule (`--classifier baseline-queue`), nothing "
    "to read",
}
CLASSIFIERS = tuple(CLASSIFIER_NAMES)

sys.path.insert(0, str(BENCH))
from results import machine, progress, write_section  # noqa: E402


def _scenario(
    name: str, policy: str, rate: float, weights: Mapping[str, int] | None = None
) -> dict[str, Any]:
    return {
        "name": f"bench-analyzer-{name}",
        "description": f"bench/analyzer.py: 8x RTX 4090, an 8B chat model, {name}",
        "duration_seconds": 600.0,
        "seed": 1,
        "interval_seconds": EXPORTER_INTERVAL_SECONDS,
        "truth_window_seconds": WINDOW_SECONDS,
        "hardware": {"host": {"cores": 32}, "gpus": [{"card": "RTX 4090", "count": 8}]},
        "models": {
            "llama-3.1-8b": {
                "params_billions": 8.03,
                "bytes_per_param": 2,
                "kv_bytes_per_token": 131072,
            }
        },
        "workers": [
            {"gpu": "all", "model": "llama-3.1-8b", "max_batch_size": 16, "max_queue_delay_ms": 10}
        ],
        "router": {"policy": policy, **({"weights": dict(weights)} if weights else {})},
        "traffic": [
            {
                "name": "chat",
                "class": "interactive",
                "arrivals": {"kind": "poisson", "rate": rate},
                "prompt_tokens": {"kind": "lognormal", "median": 256, "p90": 600, "max": 4096},
                "output_tokens": {"kind": "lognormal", "median": 32, "p90": 64, "max": 512},
            }
        ],
    }


# host kinds, in the order hosts take them: most hosts balanced, as in a fleet that works
KINDS: dict[str, dict[str, Any]] = {
    "balanced": _scenario("balanced", "least_connections", 20.0),
    # w0 and w1 take 16 of every 22 requests
    "skewed": _scenario(
        "skewed",
        "weighted_round_robin",
        24.0,
        {"w0": 8, "w1": 8} | {f"w{i}": 1 for i in range(2, 8)},
    ),
    "idle": _scenario("idle", "least_connections", 1.0),
    "short": _scenario("short", "least_connections", 100.0),
}
HOST_KINDS = ("balanced", "skewed", "balanced", "idle", "balanced", "short", "skewed", "balanced")


@dataclass
class Run:
    """One lab run as the OpenMetrics series a Prometheus scraping its exporter holds."""

    kind: str
    seed: int
    # series (name, label text without host labels) -> "value timestamp" per scrape
    series: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    planted: dict[tuple[int, int], str] = field(default_factory=dict)  # (window, gpu) -> state


def simulate(kind: str, seed: int, seconds: float, scrape_seconds: float, offset: float) -> Run:
    """Run ``kind`` at the fast speed and scrape its exporter's exposition every
    ``scrape_seconds`` (the first scrape ``offset`` seconds into the run)."""
    from gpubalance.exporter.exposition.profiles import render
    from gpubalance.exporter.view import View
    from gpubalance.exporter.window import compute_window
    from gpubalance.lab import fast
    from gpubalance.lab.run import run
    from gpubalance.lab.scenario import Scenario, plan
    from gpubalance.telemetry import Sample

    lab_plan = plan(Scenario.model_validate({**KINDS[kind], "duration_seconds": seconds}))
    out = Run(kind, seed)
    history: deque[Sample] = deque(
        maxlen=int(EXPORTER_TREND_SECONDS / EXPORTER_INTERVAL_SECONDS) + 2
    )
    shift = T0 - fast.ORIGIN_SECONDS  # lab times to the fleet's
    next_scrape = [offset]
    count = [0]

    def scrape(at: float) -> None:
        window = compute_window(history, EXPORTER_WINDOW_SECONDS, EXPORTER_TREND_SECONDS)
        view = View(
            count[0],
            history[-1],
            window,
            count[0],
            0,
            EXPORTER_INTERVAL_SECONDS,
            EXPORTER_WINDOW_SECONDS,
            EXPORTER_TREND_SECONDS,
        )
        stamp = f"{T0 + at:.3f}"
        for line in render(view, "native").decode().splitlines():
            if not line or line.startswith("#"):
                continue
            sample, _, value = line.rpartition(" ")
            name, _, labels = sample.partition("{")
            out.series.setdefault((name, labels.rstrip("}")), []).append(f"{value} {stamp}")
        out.series.setdefault(("up", ""), []).append(f"1 {stamp}")

    def on_sample(sample: Sample) -> None:
        at = sample.timestamp_seconds + shift - T0
        # the scrapes that fell between the previous sample and this one saw the previous view
        while history and next_scrape[0] < at:
            scrape(next_scrape[0])
            next_scrape[0] += scrape_seconds
        history.append(sample)
        count[0] += 1

    with tempfile.TemporaryDirectory() as directory:
        run(lab_plan, "fast", seconds, seed, Path(directory), on_sample=on_sample)
        with (Path(directory) / "truth.csv").open(newline="") as stream:
            for row in csv.DictReader(stream):
                window = round(float(row["t_start"]) / WINDOW_SECONDS)
                out.planted[(window, int(row["gpu"]))] = row["state"]
    return out


def host_name(h: int) -> str:
    return f"gpu-host-{h:04d}:9400"


def runs_for(seeds: int, seconds: float, scrape_seconds: float) -> list[Run]:
    """The lab runs the hosts take in turn: each kind of :data:`HOST_KINDS` with ``seeds``
    seeds, each run scraped at its own offset (scrapes of a fleet do not line up)."""
    wanted = [(kind, seed) for seed in range(seeds) for kind in dict.fromkeys(HOST_KINDS)]
    runs = []
    with progress("lab runs", len(wanted)) as advance:
        for i, (kind, seed) in enumerate(wanted):
            offset = (1 + i * 7) % scrape_seconds or scrape_seconds
            runs.append(simulate(kind, seed, seconds, scrape_seconds, offset))
            advance()
    return runs


def run_of_host(h: int, runs: Sequence[Run]) -> Run:
    kind = HOST_KINDS[h % len(HOST_KINDS)]
    mine = [r for r in runs if r.kind == kind]
    return mine[(h // len(HOST_KINDS)) % len(mine)]


def write_openmetrics(path: Path, hosts: int, runs: Sequence[Run]) -> int:
    """The fleet's OpenMetrics text (each metric's series together, samples in time order);
    returns the number of samples written."""
    names = sorted({name for run in runs for name, _ in run.series})
    by_name: dict[int, dict[str, list[tuple[str, list[str]]]]] = {}
    for i, run in enumerate(runs):
        mine: dict[str, list[tuple[str, list[str]]]] = {}
        for (name, labels), points in run.series.items():
            mine.setdefault(name, []).append((labels, points))
        by_name[i] = mine
    index = {id(run): i for i, run in enumerate(runs)}
    host_runs = [index[id(run_of_host(h, runs))] for h in range(hosts)]
    written = 0
    with path.open("w") as stream, progress("OpenMetrics", len(names)) as advance:
        for name in names:
            for h in range(hosts):
                host = f'instance="{host_name(h)}",job="gpubalance"'
                # each host's GPUs have their own UUIDs: the first group names the host
                uuid = f'uuid="GPU-{h:08x}'
                for labels, points in by_name[host_runs[h]].get(name, ()):
                    text = f"{host},{labels}" if labels else host
                    text = UUID_HEAD.sub(uuid, text)
                    prefix = f"{name}{{{text}}} "
                    stream.write(prefix + ("\n" + prefix).join(points) + "\n")
                    written += len(points)
            advance()
        stream.write("# EOF\n")
    return written


def backfill(openmetrics: Path, tsdb: Path) -> None:
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(openmetrics), str(tsdb)],
        check=True,
        capture_output=True,
    )


@dataclass(frozen=True)
class Prometheus:
    url: str
    pid: int

    def cpu_seconds(self) -> float:
        """CPU time the Prometheus process has used (user + system)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def prometheus(tsdb: Path, deadline_seconds: float = 120.0) -> Iterator[Prometheus]:
    """A real Prometheus serving ``tsdb`` on 127.0.0.1, once it is ready."""
    from gpubalance.lab.live.ports import start_prometheus

    config = tsdb.parent / "prometheus.yml"
    config.write_text("scrape_configs: []\n")
    server = start_prometheus(
        config,
        tsdb,
        "--storage.tsdb.retention.time=100y",  # the fleet's time is long past
        timeout_seconds=deadline_seconds,
    )
    try:
        yield Prometheus(server.url, server.process.pid)
    finally:
        server.stop()


@dataclass
class Timed:
    """One diagnosis: its stage times (s), CPU time (the analyzer's and Prometheus'), and what
    it gave."""

    seconds: dict[str, float]
    cpu_seconds: dict[str, float]
    gpu_windows: int
    verdicts: Sequence[Any]
    fleet: Sequence[Any]
    # of the verdicts' CPU seconds, the classifier's predictions
    classifier_cpu_seconds: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def diagnose(server: Prometheus, start: float, end: float, classifier: str = "model") -> Timed:
    """``gpubalance diagnose --from URL --fleet`` on a Prometheus, stage by stage."""
    # the earlier diagnoses' verdicts, kept for the sanity check, out of the collector's
    # sight: a `gpubalance diagnose` process has none, and each collection the next diagnosis
    # triggers would scan them (10^6 objects after a 20-window range)
    gc.freeze()
    try:
        return _diagnose(server, start, end, classifier)
    finally:
        gc.unfreeze()


def _diagnose(server: Prometheus, start: float, end: float, classifier: str) -> Timed:
    from gpubalance.analyzer.features import FeatureBuilder
    from gpubalance.analyzer.sources import open_source
    from gpubalance.analyzer.verdict import Verdicts

    # the model's file read and rebuilt, as each `gpubalance diagnose` process does first
    began, cpu = time.perf_counter(), time.process_time()
    judge = _classifier(classifier)
    loaded, load_cpu = time.perf_counter() - began, time.process_time() - cpu
    began, cpu, served = time.perf_counter(), time.process_time(), server.cpu_seconds()
    source = open_source(server.url, timeout=120.0)
    frames = source.frames(start, end, WINDOW_SECONDS)
    fetched, fetch_cpu = time.perf_counter(), time.process_time()
    # the source's own split of its time: waiting on the queries, parsing, building frames
    seconds = dict(getattr(source, "last_timings", {}))
    seconds["query"] = seconds.get("query", 0.0) + (fetched - began) - sum(seconds.values())
    table = FeatureBuilder().transform(frames)
    featured, feature_cpu = time.perf_counter(), time.process_time()
    watched = _Stopwatch(_fitted(judge, table))
    diagnosis = Verdicts(watched).diagnose(table)
    seconds["features"] = featured - fetched
    seconds["verdicts"] = time.perf_counter() - featured
    seconds["model"] = loaded
    cpu_seconds = {
        "model": load_cpu,
        "source": fetch_cpu - cpu,
        "features": feature_cpu - fetch_cpu,
        "verdicts": time.process_time() - feature_cpu,
        "prometheus": server.cpu_seconds() - served,
    }
    return Timed(
        seconds, cpu_seconds, len(frames), diagnosis.verdicts, diagnosis.fleet, watched.seconds
    )


def _classifier(name: str) -> Any:
    """The classifier ``--classifier`` names: the shipped model read from its file, or the
    rule."""
    from gpubalance.analyzer.baselines import QueueUtilization
    from gpubalance.analyzer.model import load_shipped

    return load_shipped() if name == "model" else QueueUtilization()


def _fitted(classifier: Any, table: Any) -> Any:
    """The rule learns nothing: fit only sets its classes (the model comes fitted)."""
    return classifier if hasattr(classifier, "classes_") else classifier.fit(table)


class _Stopwatch:
    """A classifier and the CPU seconds its predictions took (a share of the verdicts')."""

    def __init__(self, classifier: Any) -> None:
        self.classifier = classifier
        self.classes_ = classifier.classes_
        self.seconds = 0.0

    def predict_proba(self, table: Any) -> Any:
        return self._timed(self.classifier.predict_proba, table)

    def predict_likeliest_proba(self, table: Any) -> Any:
        from gpubalance.analyzer.verdict import asked_of

        # what the verdict step asks of the classifier itself, timed
        return self._timed(asked_of(self.classifier), table)

    def _timed(self, predict: Any, table: Any) -> Any:
        began = time.process_time()
        try:
            return predict(table)
        finally:
            self.seconds += time.process_time() - began


def service_cycle(
    server: Prometheus, start: float, end: float, classifier: str = "model"
) -> dict[str, float]:
    """What ``gpubalance analyzer`` pays per cycle over the lookback, in CPU seconds (median of
    3): the features rebuilt whole, and as the service builds them (the windows the last
    cycle had not made final on the history it kept: the one before the newest, made final
    now, and the newest); the recommendations over the lookback's verdicts; and the service's
    own cycle, source to verdicts, its first and the ones after it on the same lookback."""
    from gpubalance.analyzer.features import FeatureBuilder, FeatureStream
    from gpubalance.analyzer.recommend import Recommender
    from gpubalance.analyzer.service import AnalyzerService
    from gpubalance.analyzer.sources import open_source
    from gpubalance.analyzer.verdict import Verdicts

    frames = open_source(server.url, timeout=120.0).frames(start, end, WINDOW_SECONDS)
    newest = max(f.t_start for f in frames)
    earlier = [f for f in frames if f.t_start < newest]
    whole, cycle = [], []
    for _ in range(3):
        began = time.process_time()
        table = FeatureBuilder().transform(frames)
        whole.append(time.process_time() - began)
        stream = FeatureStream()
        stream.add(earlier)  # the cycle before
        began = time.process_time()
        stream.add(frames)
        cycle.append(time.process_time() - began)
    diagnosis = Verdicts(_fitted(_classifier(classifier), table)).diagnose(table)
    recommend, made = [], 0
    for _ in range(3):
        began = time.process_time()
        made = len(Recommender().recommend(diagnosis, table, end))
        recommend.append(time.process_time() - began)
    fixed = _Range(open_source(server.url, timeout=120.0), start, end)
    service = AnalyzerService(fixed, _fitted(_classifier(classifier), table), None, WINDOW_SECONDS)
    service_cycles = []
    for _ in range(4):
        began = time.process_time()
        service.cycle()
        service_cycles.append(time.process_time() - began)
    assert service.health().cycle_failures == {}
    return {
        "whole": _median(whole),
        "cycle": _median(cycle),
        "gpu_windows": len(frames),
        "recommend": _median(recommend),
        "recommendations": made,
        "service_first": service_cycles[0],
        "service_after": _median(service_cycles[1:]),
    }


class _Range:
    """A source read over one range whatever the service asks (the fleet's time is past)."""

    def __init__(self, source: Any, start: float, end: float) -> None:
        self.source, self.start, self.end = source, start, end
        self.description = source.description

    def frames(self, start: float | None, end: float | None, window_seconds: float) -> Any:
        return self.source.frames(self.start, self.end, window_seconds)


# the host CPU figures as the source read them before the exporter summed them over the CPUs:
# Prometheus summing a series per CPU and mode of every host
PER_CPU_MODES = "sum by (instance, mode) (increase(gpubalance_host_cpu_seconds_total[30s]))"


def query_costs(server: Prometheus, end: float) -> dict[str, float]:
    """Prometheus CPU seconds of each of the source's queries for the latest window, run one
    at a time (median of 3), and of the host CPU figures summed from the per-CPU series."""
    from gpubalance.analyzer.prometheus import PrometheusSource, _duration, _queries

    source = PrometheusSource(server.url, timeout=120.0)

    def select(metric: str, *matchers: str) -> str:
        return metric + "{" + ",".join(matchers) + "}" if matchers else metric

    queries = _queries(select, _duration(WINDOW_SECONDS), "instance")
    queries["per-CPU modes"] = PER_CPU_MODES
    costs: dict[str, list[float]] = {name: [] for name in queries}
    for _ in range(3):
        for name, query in queries.items():
            before = server.cpu_seconds()
            source.query_range(query, end, WINDOW_SECONDS, 1)
            costs[name].append(server.cpu_seconds() - before)
    return {name: _median(values) for name, values in costs.items()}


def agreement(
    timed: Timed, hosts: int, runs: Sequence[Run]
) -> tuple[int, Counter[str], Counter[str]]:
    """Verdicts whose state is the one the lab planted: (agreeing, planted states of the
    verdicts, disagreements by planted -> given)."""
    host_run = {host_name(h): run_of_host(h, runs) for h in range(hosts)}
    agree = 0
    planted_states: Counter[str] = Counter()
    wrong: Counter[str] = Counter()
    for verdict in timed.verdicts:
        window = round((verdict.t_start - T0) / WINDOW_SECONDS)
        planted = host_run[verdict.host].planted.get((window, verdict.gpu))
        if planted is None:
            continue
        planted_states[planted] += 1
        if planted == verdict.state:
            agree += 1
        else:
            wrong[f"{planted} -> {verdict.state}"] += 1
    return agree, planted_states, wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=12.0, help="of telemetry per host")
    parser.add_argument("--scrape", type=float, default=15.0, help="scrape interval, seconds")
    parser.add_argument("--seeds", type=int, default=3, help="lab runs per kind of host")
    parser.add_argument("--repeats", type=int, default=3, help="timed diagnoses (median)")
    parser.add_argument("--windows", type=int, default=20, help="windows of the long range")
    parser.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: last)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the TSDB in this folder")
    parser.add_argument(
        "--classifier",
        choices=CLASSIFIERS,
        default="model",
        help="the verdicts' classifier (default: the shipped model, as `gpubalance diagnose`)",
    )
    args = parser.parse_args()
    if not (shutil.which("promtool") and shutil.which("prometheus")):
        print("bench/analyzer.py needs promtool and prometheus: apt-get install prometheus")
        return 2
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    seconds = args.minutes * 60
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    runs = runs_for(args.seeds, seconds, args.scrape)
    context: dict[str, Any] = {"args": args, "cpu": cpu, "runs": len(runs)}
    context["simulated"] = time.perf_counter() - began
    with contextlib.ExitStack() as stack:
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        tsdb = work / "tsdb"
        built = work / "built.json"  # what building the kept TSDB took
        if not (args.keep and tsdb.is_dir() and built.is_file()):
            built.write_text(json.dumps(build_tsdb(work, args.hosts, runs)))
        else:
            context["kept"] = True  # a kept TSDB of the same fleet: reused
        context.update(json.loads(built.read_text()))
        context["tsdb_bytes"] = sum(f.stat().st_size for f in tsdb.rglob("*") if f.is_file())
        server = stack.enter_context(prometheus(tsdb))
        # the analyzer on one core, as the goal says; Prometheus where the kernel puts it
        os.sched_setaffinity(0, {cpu})
        end = T0 + seconds
        ranges = {
            "latest window": end - WINDOW_SECONDS,
            f"{args.windows} windows": end - args.windows * WINDOW_SECONDS,
        }
        results: dict[str, list[Timed]] = {name: [] for name in ranges}
        # warm: Prometheus' page cache, imports
        diagnose(server, end - WINDOW_SECONDS, end, args.classifier)
        with progress("diagnoses", args.repeats * len(ranges)) as advance:
            for _ in range(args.repeats):
                for name, start in ranges.items():
                    results[name].append(diagnose(server, start, end, args.classifier))
                    advance()
        context["cycle"] = service_cycle(
            server, end - args.windows * WINDOW_SECONDS, end, args.classifier
        )
        context["queries"] = query_costs(server, end)
    context["load"] = (load_before, os.getloadavg()[0])
    return 0 if report(context, results, runs) else 1


def build_tsdb(work: Path, hosts: int, runs: Sequence[Run]) -> dict[str, Any]:
    """The fleet's OpenMetrics text backfilled into ``work/tsdb``; what it took."""
    openmetrics = work / "fleet.om"
    began = time.perf_counter()
    samples = write_openmetrics(openmetrics, hosts, runs)
    written = time.perf_counter() - began
    size = openmetrics.stat().st_size
    began = time.perf_counter()
    backfill(openmetrics, work / "tsdb")
    backfilled = time.perf_counter() - began
    openmetrics.unlink()
    return {"samples": samples, "om_bytes": size, "written": written, "backfilled": backfilled}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def report(
    context: Mapping[str, Any], results: Mapping[str, list[Timed]], runs: Sequence[Run]
) -> bool:
    args = context["args"]
    latest, long = results.values()
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {machine()}, load "
        f"average {context['load'][0]:.1f} before and {context['load'][1]:.1f} after "
        f"({_sharing(context['load'][0])}); the analyzer pinned to CPU {context['cpu']} "
        "(`sched_setaffinity`, `OMP_NUM_THREADS=1`), Prometheus "
        f"{_prometheus_version()} on any CPU; `python bench/analyzer.py --hosts {args.hosts} "
        f"--minutes {args.minutes:g} --scrape {args.scrape:g} --seeds {args.seeds} --repeats "
        f"{args.repeats} --windows {args.windows}"
        + (f" --classifier {args.classifier}`." if args.classifier != "model" else "`."),
        "",
        f"The fleet: {args.hosts} hosts x 8 RTX 4090 (exporter's native names and labels, "
        f"rendered by the exporter's own exposition over {context['runs']} fast-speed lab runs, "
        f"relabelled per host), {args.minutes:g} minutes scraped every {args.scrape:g} s. Hosts "
        "in turn: balanced (least connections, 20 requests/s), skewed (weighted round robin, "
        "two GPUs get 16 of every 22 of 24 requests/s: 2 overloaded, 6 starved), idle "
        "(1 request/s: all starved), short (100 requests/s: all overloaded).",
    ]
    lines[-1] += (
        f" OpenMetrics: {context['samples'] / 1e6:.1f} million samples, "
        f"{context['om_bytes'] / 1e9:.2f} GB, written in {context['written']:.0f} s; "
        f"`promtool tsdb create-blocks-from openmetrics` {context['backfilled']:.0f} s"
        + (" (an earlier run's, kept with `--keep`); " if context.get("kept") else "; ")
    )
    lines[-1] += (
        f"TSDB {context['tsdb_bytes'] / 2**20:.0f} MiB; lab runs {context['simulated']:.0f} s."
    )
    lines += [
        "",
        "Fleet diagnosis: what `gpubalance diagnose --from PROMETHEUS --fleet` does "
        f"(its classifier: {CLASSIFIER_NAMES[args.classifier]}; `open_source`, the source's "
        "range queries, their parsing, frames, features, verdicts), median of "
        f"{args.repeats} runs, wall seconds per stage; CPU seconds of the analyzer's process "
        "and of Prometheus beside.",
        "",
        "| range | GPU-windows | " + " | ".join(STAGES) + " | **total** "
        "| analyzer CPU | Prometheus CPU |",
        "|---|---:|" + "---:|" * len(STAGES) + "---:|---:|---:|",
    ]
    for name, timed in results.items():
        stage = {s: _median([t.seconds[s] for t in timed]) for s in STAGES}
        analyzer_cpu = _median(
            [sum(v for k, v in t.cpu_seconds.items() if k != "prometheus") for t in timed]
        )
        lines.append(
            f"| {name} | {timed[0].gpu_windows} | "
            + " | ".join(f"{stage[s]:.2f}" for s in STAGES)
            + f" | **{_median([t.total for t in timed]):.2f}** | {analyzer_cpu:.2f} | "
            f"{_median([t.cpu_seconds['prometheus'] for t in timed]):.2f} |"
        )
    rates = _rates(long)
    lines += [
        "",
        f"Throughput on one core, GPU-windows per second over the {args.windows}-window range "
        "(per stage: GPU-windows over its median wall seconds; CPU: over the analyzer's CPU "
        "seconds in it):",
        "",
        "| stage | GPU-windows/s (wall) | GPU-windows/s (CPU) |",
        "|---|---:|---:|",
    ]
    for name, (wall, cpu) in rates.items():
        lines.append(f"| {name} | {wall:,.0f} | {cpu:,.0f} |")
    agree, planted, wrong = agreement(long[0], args.hosts, runs)
    judged = sum(planted.values())
    total = _median([t.total for t in latest])
    classify, classify_cpu = rates["features + verdicts"]
    met = total <= GOAL_SECONDS and classify >= GOAL_GPU_WINDOWS_PER_SECOND
    lines += [
        "",
        f"Sanity: over the {args.windows}-window range, {agree} of {judged} verdicts "
        f"({agree / max(1, judged):.1%}) have the state the lab's ground truth planted "
        f"(planted: {dict(sorted(planted.items()))}); disagreements "
        + (", ".join(f"{k} {v}" for k, v in wrong.most_common(4)) or "none")
        + ". Fleet verdicts: "
        + ", ".join(f"{k} {v}" for k, v in Counter(f.kind for f in long[0].fleet).most_common())
        + ".",
        "",
        f"Goals (issue 8): fleet diagnosis of {args.hosts} hosts x 8 GPUs, latest window, at most "
        f"{GOAL_SECONDS:.0f} s: measured {total:.1f} s; at least "
        f"{GOAL_GPU_WINDOWS_PER_SECOND:,.0f} GPU-windows/s on one core (features + verdicts): "
        f"measured {classify:,.0f} per wall second, {classify_cpu:,.0f} per CPU second of the "
        "core. "
        + " ".join(
            f"{goal} {'met' if ok else 'not met'}."
            for goal, ok in (
                ("Latency:", total <= GOAL_SECONDS),
                ("Throughput in wall time:", classify >= GOAL_GPU_WINDOWS_PER_SECOND),
                ("Throughput per CPU second:", classify_cpu >= GOAL_GPU_WINDOWS_PER_SECOND),
            )
        ),
        "",
        _where_the_time_goes(context, latest, long),
        "",
        "![fleet diagnosis stages and throughput](analyzer.png)",
    ]
    write_section("analyzer-scale", "Analyzer: fleet diagnosis from Prometheus", "\n".join(lines))
    plot(results, rates)
    print("\n".join(lines))
    return met


# a load average before the run at or above which other work shared the machine
BUSY_LOAD = 1.0


def _sharing(load_before: float) -> str:
    if load_before >= BUSY_LOAD:
        return "other work shared the machine"
    return "nothing else ran; the load after is the benchmark's own Prometheus and analyzer"


def _where_the_time_goes(
    context: Mapping[str, Any], latest: Sequence[Timed], long: Sequence[Timed]
) -> str:
    from gpubalance.analyzer.prometheus import SERVING_QUERIES

    cpu = {k: _median([t.cpu_seconds[k] for t in latest]) for k in latest[0].cpu_seconds}
    long_cpu = {k: _median([t.cpu_seconds[k] for t in long]) for k in long[0].cpu_seconds}
    analyzer = cpu["model"] + cpu["source"] + cpu["features"] + cpu["verdicts"]
    costs = dict(context["queries"])
    per_cpu = costs.pop("per-CPU modes")
    families = {
        "host CPU seconds (the exporter's sum over CPUs, a series per mode of every host)": costs[
            "cpu"
        ],
        "throttle reasons": sum(v for k, v in costs.items() if k.startswith("reasons_")),
        "serving queues": sum(v for k, v in costs.items() if k in SERVING_QUERIES),
    }
    families["the GPUs' own and the rest"] = sum(costs.values()) - sum(families.values())
    exporter_sum = families[next(iter(families))]
    cycle = context["cycle"]
    return (
        f"Where the time goes (latest window, CPU seconds): Prometheus {cpu['prometheus']:.2f} "
        f"and the analyzer {analyzer:.2f} (the classifier's file read {cpu['model']:.2f}, "
        f"source: parse and frames {cpu['source']:.2f}, "
        f"features {cpu['features']:.2f}, verdicts {cpu['verdicts']:.2f}). The wall times are "
        "those CPU seconds on two cores that Prometheus and the analyzer share"
        + (" with the machine's other load" if context["load"][0] >= BUSY_LOAD else "")
        + f", and the source's range queries ({len(costs)} at most) in flight 16 at a time share "
        "Prometheus' cores. Prometheus' "
        "cost follows the series a query selects, not the number of queries: run one at a time, "
        "the queries cost "
        + ", ".join(f"{name} {value:.2f}" for name, value in families.items())
        + f"; the same host CPU figures summed by Prometheus from the per-CPU series (a series "
        f"per CPU and mode of every host, as the source read them before: `{PER_CPU_MODES}`) "
        f"cost {per_cpu:.2f} against {exporter_sum:.2f}"
        + f". Over the {context['args'].windows}-window range the analyzer's CPU seconds are "
        f"source {long_cpu['source']:.2f}, features {long_cpu['features']:.2f} and verdicts "
        f"{long_cpu['verdicts']:.2f}, of which the classifier's predictions "
        f"{_median([t.classifier_cpu_seconds for t in long]):.2f}. In the "
        f"service (`gpubalance analyzer`) a cycle's features over the {context['args'].windows}"
        f"-window lookback ({cycle['gpu_windows']} GPU-windows) cost {cycle['cycle']:.2f} CPU "
        f"seconds built as it builds them (the windows the last cycle had not made final, on the "
        f"history it kept) against {cycle['whole']:.2f} rebuilt whole; its recommendations "
        f"over that lookback's verdicts ({cycle['recommendations']} made) cost "
        f"{cycle['recommend']:.2f}. Its cycle from the source's range queries to the verdicts "
        f"(recommendations aside) cost {cycle['service_first']:.2f} CPU seconds the first time "
        f"and {cycle['service_after']:.2f} each time after (median of 3), the classifier "
        "asked only of the windows the cycle before had not made final."
    )


def _rates(timed: Sequence[Timed]) -> dict[str, tuple[float, float]]:
    """Per stage, GPU-windows per wall second and per CPU second."""
    n = timed[0].gpu_windows

    def wall(*stages: str) -> float:
        return n / _median([sum(t.seconds[s] for s in stages) for t in timed])

    def cpu(*stages: str) -> float:
        return n / _median([sum(t.cpu_seconds[s] for s in stages) for t in timed])

    return {
        "source (query, parse, frames)": (wall("query", "parse", "frames"), cpu("source")),
        "features": (wall("features"), cpu("features")),
        "verdicts": (wall("verdicts"), cpu("verdicts")),
        "features + verdicts": (wall("features", "verdicts"), cpu("features", "verdicts")),
    }


def _prometheus_version() -> str:
    answer = subprocess.run(["prometheus", "--version"], capture_output=True, text=True)
    words = (answer.stdout or answer.stderr).split()
    return words[2] if len(words) > 2 else "(unknown version)"


def plot(results: Mapping[str, list[Timed]], rates: Mapping[str, tuple[float, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (stages, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    left = [0.0] * len(names)
    for stage in STAGES:
        widths = [_median([t.seconds[stage] for t in results[n]]) for n in names]
        stages.barh(names, widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    stages.axvline(GOAL_SECONDS, color="black", linestyle="--", label=f"goal {GOAL_SECONDS:g} s")
    stages.set_xlabel("wall seconds (median)")
    stages.set_title("fleet diagnosis from Prometheus")
    stages.legend(fontsize=8)
    labels = list(rates)
    throughput.barh(labels, [rates[k][0] for k in labels], label="wall")
    throughput.barh(labels, [rates[k][1] for k in labels], height=0.3, label="CPU")
    throughput.axvline(GOAL_GPU_WINDOWS_PER_SECOND, color="black", linestyle="--", label="goal")
    throughput.set_xscale("log")
    throughput.set_xlabel("GPU-windows per second, one core")
    throughput.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(BENCH / "analyzer.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
