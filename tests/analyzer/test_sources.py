"""Sources: a lab run directory and an exporter's snapshot API give the analyzer's frames."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpubalance.analyzer.frames import frames_from_samples
from gpubalance.analyzer.sources import SourceError, lab_run_frames, read_snapshots
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario
from gpubalance.lab.fast import ORIGIN_SECONDS
from gpubalance.telemetry import Sample

WINDOW = 30.0


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    out = tmp_path_factory.mktemp("run")
    samples: list[Sample] = []
    plan = scenario.load("slow-card-round-robin")
    lab_run.run(plan, "fast", 150, 3, out, snapshots=True, on_sample=samples.append)
    return out, samples


def test_snapshots_give_the_frames_of_the_samples(recorded: tuple[Path, list[Sample]]) -> None:
    out, samples = recorded
    recording = read_snapshots(out / "snapshots.jsonl")
    assert recording.origin == ORIGIN_SECONDS
    assert recording.interval_seconds == 1.0
    direct = list(
        frames_from_samples(
            samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
    )
    assert lab_run_frames(out, WINDOW) == direct


def test_the_csv_alone_gives_the_same_picture(
    recorded: tuple[Path, list[Sample]], tmp_path: Path
) -> None:
    out, _ = recorded
    shutil.copy(out / "frames.csv", tmp_path / "frames.csv")
    from_csv = lab_run_frames(tmp_path, WINDOW)
    from_snapshots = lab_run_frames(out, WINDOW)
    assert [(f.gpu, f.t_start) for f in from_csv] == [
        (f.gpu, f.t_start - ORIGIN_SECONDS) for f in from_snapshots
    ]
    for a, b in zip(from_csv, from_snapshots, strict=True):
        assert a.utilization_mean_ratio == pytest.approx(b.utilization_mean_ratio, abs=0.02)
        assert a.queue_depth_mean == pytest.approx(b.queue_depth_mean, abs=0.01)
        assert a.completions_per_second == pytest.approx(b.completions_per_second, rel=0.1)
        assert a.host_cpu_busy_ratio is None  # the CSV has no host series: unknown, not 0


def test_a_directory_that_is_not_a_run_is_named(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="not a lab run directory"):
        lab_run_frames(tmp_path, WINDOW)
    (tmp_path / "snapshots.jsonl").write_text('{"schema": "x"}\n')
    with pytest.raises(SourceError, match=r"snapshots.jsonl:1: not a gpubalance snapshot"):
        lab_run_frames(tmp_path, WINDOW)


def test_a_csv_without_its_columns_is_named(tmp_path: Path) -> None:
    (tmp_path / "frames.csv").write_text("t,gpu\n1,0\n")
    with pytest.raises(SourceError, match="missing columns utilization, uuid"):
        lab_run_frames(tmp_path, WINDOW)
