"""Write tests/deploy/fixtures/balanced.yml: promtool input series of a balanced lab run.

    PYTHONPATH=tests .venv/bin/python tests/deploy/balanced_series.py [--out FILE]

Runs ``balanced-4x4090`` at the fast speed (30 simulated minutes, seed 1, byte-identical for
the seed) and turns it into what Prometheus would hold after scraping every 15 s:

- the exporter: each snapshot of the run rendered by the exporter's own renderer, as
  ``/metrics`` would serve it at that moment;
- the analyzer: an ``AnalyzerService`` over the run's frames up to each scrape (its own
  classifier, persistence and recommender), as its ``/metrics`` serves the latest window;
- the controller, which a lab run has none of: its real metrics registry as a dry-run
  controller keeps it with nothing to do, a pass every 10 s and both sources up;
- ``up`` 1 for the three jobs.

Only the series the rules read are kept, so the fixture stays small. Times are seconds from the
run's start (promtool's evaluation starts at 0).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from deploy_harness import ROOT, series_read_by_rules
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpubalance.analyzer.baselines import CLASSIFIERS
from gpubalance.analyzer.frames import GpuFrame
from gpubalance.analyzer.recommend import Recommender
from gpubalance.analyzer.server import AnalyzerCollector
from gpubalance.analyzer.service import AnalyzerService
from gpubalance.analyzer.sources import open_source
from gpubalance.controller.metrics import SOURCES, Metrics
from gpubalance.exporter.exposition import render
from gpubalance.exporter.view import View
from gpubalance.snapshot import from_json

FIXTURE = ROOT / "tests" / "deploy" / "fixtures" / "balanced.yml"
SCENARIO, DURATION_SECONDS, SEED = "balanced-4x4090", 1800, 1
SCRAPE_SECONDS = 15
HOST = SCENARIO  # the lab's host name: the exporter's instance label
# job -> instance, as deploy/prometheus/prometheus.yml scrapes them
JOBS = {
    "gpubalance-exporter": HOST,
    "gpubalance-analyzer": "127.0.0.1:9451",
    "gpubalance-controller": "127.0.0.1:9470",
}
EXPORTER, ANALYZER, CONTROLLER = JOBS
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

    description = SCENARIO

    def __init__(self, frames: Sequence[GpuFrame]) -> None:
        self.all = frames
        self.now = 0.0

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[GpuFrame]:
        return [f for f in self.all if f.t_end <= self.now]


def record(run_dir: Path) -> dict[Key, dict[int, float]]:
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
    frames_source = _FramesUpTo(open_source(str(run_dir)).frames(None, None, 30.0))
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
        for job, instance in JOBS.items():
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
                keep(step, name, labels, value, EXPORTER, JOBS[EXPORTER])
        frames_source.now = t0 + t
        service.cycle()
        for family in AnalyzerCollector(service).collect():
            for s in family.samples:
                keep(step, s.name, dict(s.labels), s.value, ANALYZER, JOBS[ANALYZER])
        for _ in range(SCRAPE_SECONDS // 10 + (step % 2 if SCRAPE_SECONDS % 10 else 0)):
            controller.cycle_duration.observe(0.01)
        for name, labels, value in samples(generate_latest(controller.registry).decode()):
            keep(step, name, labels, value, CONTROLLER, JOBS[CONTROLLER])
    return series


def values(points: dict[int, float], steps: int) -> str:
    """promtool's notation: a value per step, ``_`` where the series is absent, runs of one
    value as ``VxN``."""
    out: list[str] = []
    run_value, run_length = None, 0
    cells = [points.get(step) for step in range(steps)]
    for cell in [*cells, object()]:
        if cell == run_value and run_length:
            run_length += 1
            continue
        if run_length:
            text = "_" if run_value is None else f"{run_value:.6g}"
            if run_length == 1:
                out.append(text)
            elif run_value is None:
                out.append(f"_x{run_length}")  # _xN: N missing samples
            else:
                out.append(f"{text}+0x{run_length - 1}")  # a+bxN: N + 1 samples
        run_value, run_length = cell, 1
    return " ".join(out)


def selector(key: Key) -> str:
    name, labels = key
    return name + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in labels) + "}"


def fixture_text(series: dict[Key, dict[int, float]]) -> str:
    steps = DURATION_SECONDS // SCRAPE_SECONDS + 1
    lines = [
        f"# promtool input series: {SCENARIO}, {DURATION_SECONDS} s at the fast speed, seed "
        f"{SEED}, scraped every {SCRAPE_SECONDS} s.",
        "# Written by tests/deploy/balanced_series.py; do not edit.",
        f"interval: {SCRAPE_SECONDS}s",
        "input_series:",
    ]
    for key in sorted(series):
        lines.append(f"  - series: '{selector(key)}'")
        lines.append(f"    values: '{values(series[key], steps)}'")
    return "\n".join(lines) + "\n"


def generate() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gpubalance",
                "lab",
                "run",
                SCENARIO,
                "--speed",
                "fast",
                "--duration",
                str(DURATION_SECONDS),
                "--seed",
                str(SEED),
                "--snapshots",
                "--out",
                str(run_dir),
            ],
            check=True,
            capture_output=True,
        )
        return fixture_text(record(run_dir))


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURE, help=f"default {FIXTURE}")
    out = parser.parse_args(argv).out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(generate())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
