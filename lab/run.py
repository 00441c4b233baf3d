"""One lab run: a scenario, a seed and a speed in; frames, ground truth and requests out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpubalance.lab import output, traffic, truth
from gpubalance.lab.scenario import Plan
from gpubalance.lab.workload import RequestRecord
from gpubalance.telemetry import Sample

SNAPSHOT_WINDOW_SECONDS = 30.0
SNAPSHOT_TREND_SECONDS = 300.0


@dataclass(frozen=True)
class Summary:
    requests: int
    outcomes: dict[str, int]
    truth_rows: int
    out: Path


def run(
    plan: Plan,
    speed: str,
    duration_seconds: float,
    seed: int,
    out: Path,
    *,
    snapshots: bool = False,
    on_sample: Callable[[Sample], None] | None = None,
    live_options: dict[str, object] | None = None,
) -> Summary:
    out.mkdir(parents=True, exist_ok=True)
    requests = traffic.generate(plan.scenario.traffic, duration_seconds, seed)
    rows = truth.compute(plan, requests, duration_seconds)
    with contextlib.ExitStack() as stack:
        callbacks: list[Callable[[Sample], None]] = [on_sample] if on_sample else []
        if snapshots:
            stream = stack.enter_context((out / "snapshots.jsonl").open("wb"))
            callbacks.append(
                output.SnapshotWriter(
                    stream,
                    plan.scenario.interval_seconds,
                    SNAPSHOT_WINDOW_SECONDS,
                    SNAPSHOT_TREND_SECONDS,
                )
            )

        def each(sample: Sample) -> None:
            for callback in callbacks:
                callback(sample)

        if speed == "fast":
            from gpubalance.lab.fast import simulate

            result = simulate(plan, requests, seed, duration_seconds, each)
            records: list[RequestRecord] = result.records
            frames = result.frames
        elif speed == "live":
            from gpubalance.lab.live.run import run_live

            records, frames = run_live(
                plan, requests, seed, duration_seconds, out, each, **(live_options or {})
            )
        else:
            raise ValueError(f"speed must be fast or live, got {speed!r}")
    output.write_frames(out / "frames.csv", frames)
    output.write_truth(out, rows)
    output.write_requests(out / "requests.csv", records)
    outcomes: dict[str, int] = {}
    for record in records:
        outcomes[record.outcome] = outcomes.get(record.outcome, 0) + 1
    return Summary(len(requests), dict(sorted(outcomes.items())), len(rows), out)
