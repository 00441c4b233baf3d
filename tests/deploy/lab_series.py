"""Write tests/deploy/fixtures/SCENARIO.yml: promtool input series of a lab run.

    PYTHONPATH=tests .venv/bin/python tests/deploy/lab_series.py [SCENARIO ...] [--out DIR]

Runs each scenario (default: the ones the tests read) at the fast speed (30 simulated minutes,
seed 1, byte-identical for the seed) and turns it into what Prometheus would hold after
scraping every 15 s:

- the exporter: each snapshot of the run rendered by the exporter's own renderer, as
  ``/metrics`` would serve it at that moment;
- the analyzer: an ``AnalyzerService`` over the run's frames up to each scrape (its own
  classifier, persistence and recommender), as its ``/metrics`` serves the latest window;
- the controller, which a lab run has none of: its real metrics registry as a dry-run
  controller keeps it with nothing to do, a pass every 10 s and both sources up;
- ``up`` 1 for the three jobs.

Only the series the rules read are kept, so the fixture stays small. A series that leaves the
scrape gets the staleness marker Prometheus writes then. Times are seconds from the run's start
(promtool's evaluation starts at 0).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from deploy_harness import DURATION_SECONDS, LAB_FIXTURES, series_read_by_rules
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpubalance.analyzer.baselines import CLASSIFIERS
from gpubalance.analyzer.frames import GpuFrame
from gpubalance.analyzer.recommend import Recommender
from gpubalance.analyzer.server import AnalyzerCollector
from gpubalance.analyzer.service import AnalyzerService
from gpubalance.analyzer.sources import open_source
from gpubalance.controller.metrics import SOURCES, Metrics
from gpubalance.exporter.exposition.profiles import render
from gpubalance.exporter.view import View
from gpubalance.snapshot import from_json

# a balanced run (no alert may fire), an imbalanced one, a throttled card and a lost one
SCENARIOS = ("balanced-4x4090", "skewed-heterogeneous", "thermal-throttle", "gpu-lost")
SEED = 1
SCRAPE_SECONDS = 15
EXPORTER, ANALYZER, CONTROLLER = (
    "gpubalance-exporter",
    "gpubalance-analyzer",
    "gpubalance-controller",
)
# which sample values are times (rebased to the run's start)
TIMESTAMPS = {
    "gpubalance_exporter_last_sample_timestamp_seconds",
    "gpubalance_analyzer_last_success_timestamp_seconds",
    "gpubalance_serving_source_last_success_timestamp_seconds",
}

Key = tuple[str, tuple[tuple[str, str], ...]]


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, dict(sample.labels), sample.value


class _FramesUpTo:
    """The run's frames whose window ended by ``now``: what a live source held then."""

    def __init__(self, frames: Sequence[GpuFrame], description: str) -> None:
        self.all = frames
        self.description = description
        self.now = 0.0

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[GpuFrame]:
        return [f for f in self.all if f.t_end <= self.now]


def record(run_dir: Path, scenario: str) -> dict[Key, dict[int, float]]:
    # job -> instance, as deploy/prometheus/prometheus.yml scrapes them; the lab's host name is
    # the scenario's
    jobs = {EXPORTER: scenario, ANALYZER: "127.0.0.1:9451", CONTROLLER: "127.0.0.1:9470"}
    wanted = series_read_by_rules()
    series: dict[Key, dict[int, float]] = {}
    snapshots = [
        from_json(line)
        for line in (run_dir / "snapshots.jsonl").read_text().split("\n")
        if line.strip()
    ]
    t0 = snapshots[0].sample.timestamp_seconds - snapshots[0].interval_seconds

    def keep(
        step: int, name: str, labels: dict[str, str], value: float, job: str, instance: str
    ) -> None:
        if name not in wanted:
            return
        if name in TIMESTAMPS:
            value -= t0
        key = (name, tuple(sorted({**labels, "job": job, "instance": instance}.items())))
        series.setdefault(key, {})[step] = value

    by_time = {round(s.sample.timestamp_seconds - t0): s for s in snapshots}
    frames_source = _FramesUpTo(open_source(str(run_dir)).frames(None, None, 30.0), scenario)
    service = AnalyzerService(
        frames_source,
        CLASSIFIERS["baseline-queue"](),
        Recommender(),
        clock=lambda: frames_source.now,
    )
    controller = Metrics()
    controller.dry_run.set(1)
    for source in SOURCES:
        controller.source_up.labels(source).set(1)
    for step in range(DURATION_SECONDS // SCRAPE_SECONDS + 1):
        t = step * SCRAPE_SECONDS
        for job, instance in jobs.items():
            keep(step, "up", {}, 1.0, job, instance)
        snapshot = by_time.get(t)
        if snapshot is not None:
            view = View(
                step,
                snapshot.sample,
                snapshot.window,
                t,
                0,
                snapshot.interval_seconds,
                snapshot.window_seconds,
                snapshot.trend_window_seconds,
            )
            for name, labels, value in samples(render(view, "native").decode()):
                keep(step, name, labels, value, EXPORTER, jobs[EXPORTER])
        frames_source.now = t0 + t
        service.cycle()
        for family in AnalyzerCollector(service).collect():
            for s in family.samples:
                keep(step, s.name, dict(s.labels), s.value, ANALYZER, jobs[ANALYZER])
        for _ in range(SCRAPE_SECONDS // 10 + (step % 2 if SCRAPE_SECONDS % 10 else 0)):
            controller.cycle_duration.observe(0.01)
        for name, labels, value in samples(generate_latest(controller.registry).decode()):
            keep(step, name, labels, value, CONTROLLER, jobs[CONTROLLER])
    return series


def values(points: dict[int, float], steps: int) -> str:
    """promtool's notation, a value per step: ``stale`` where the series left the scrape (the
    staleness marker Prometheus writes then, so that it vanishes at once rather than five
    minutes later), ``_`` where there is no sample, runs of one value as ``V+0xN``."""
    cells: list[float | str | None] = []
    for step in range(steps):
        value = points.get(step)
        seen_before = step > 0 and points.get(step - 1) is not None
        cells.append("stale" if value is None and seen_before else value)
    out: list[str] = []
    run_value: object = None
    run_length = 0
    for cell in [*cells, object()]:
        if cell == run_value and run_length:
            run_length += 1
            continue
        if run_length:
            out.append(_run(run_value, run_length))
        run_value, run_length = cell, 1
    return " ".join(out)


def _run(value: object, length: int) -> str:
    if value is None:
        return "_" if length == 1 else f"_x{length}"  # _xN: N missing samples
    if value == "stale":
        return " ".join(["stale"] * length)
    text = f"{value:.6g}"
    return text if length == 1 else f"{text}+0x{length - 1}"  # a+bxN: N + 1 samples


def selector(key: Key) -> str:
    name, labels = key
    return name + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in labels) + "}"


def fixture_text(series: dict[Key, dict[int, float]], scenario: str) -> str:
    steps = DURATION_SECONDS // SCRAPE_SECONDS + 1
    lines = [
        f"# promtool input series: {scenario}, {DURATION_SECONDS} s at the fast speed, seed "
        f"{SEED}, scraped every {SCRAPE_SECONDS} s.",
        "# Written by tests/deploy/lab_series.py; do not edit.",
        f"interval: {SCRAPE_SECONDS}s",
        "input_series:",
    ]
    for key in sorted(series):
        lines.append(f"  - series: '{selector(key)}'")
        lines.append(f"    values: '{values(series[key], steps)}'")
    return "\n".join(lines) + "\n"


def generate(scenario: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / scenario  # the lab names the host after the run's directory
        subprocess.run(
            [
                *(sys.executable, "-m", "gpubalance", "lab", "run", scenario, "--speed", "fast"),
                *("--duration", str(DURATION_SECONDS), "--seed", str(SEED), "--snapshots"),
                *("--out", str(run_dir)),
            ],
            check=True,
            capture_output=True,
        )
        return fixture_text(record(run_dir, scenario), scenario)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="*", default=SCENARIOS, metavar="SCENARIO")
    parser.add_argument("--out", type=Path, default=LAB_FIXTURES, help=f"default {LAB_FIXTURES}")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for scenario in args.scenarios:
        path = args.out / f"{scenario}.yml"
        path.write_text(generate(scenario))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
