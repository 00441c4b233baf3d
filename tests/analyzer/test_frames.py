"""Frames: samples cut into windows, one frame per GPU, every event counted once."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from gpubalance.analyzer.frames import (
    GpuFrame,
    frames_from_lab_rows,
    frames_from_samples,
    window_index,
)
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario, traffic
from gpubalance.lab.fast import ORIGIN_SECONDS, FastRun
from gpubalance.telemetry import Sample

WINDOW = 30.0


def _fast_run(name: str, seconds: float, out: Path) -> list[Sample]:
    samples: list[Sample] = []
    lab_run.run(scenario.load(name), "fast", seconds, 1, out, on_sample=samples.append)
    return samples


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Sample], Path]:
    out = tmp_path_factory.mktemp("skewed")
    return _fast_run("skewed-heterogeneous", 180, out), out


def test_window_index_puts_a_sample_in_the_period_it_closes() -> None:
    assert window_index(30.0, 0.0, WINDOW) == 0
    assert window_index(30.5, 0.0, WINDOW) == 1
    assert window_index(1.0, 0.0, WINDOW) == 0


def test_one_frame_per_gpu_per_window(skewed: tuple[list[Sample], Path]) -> None:
    samples, _ = skewed
    frames = list(
        frames_from_samples(
            samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
    )
    windows = sorted({f.t_start - ORIGIN_SECONDS for f in frames})
    assert windows[:6] == [0.0, 30.0, 60.0, 90.0, 120.0, 150.0]
    for start in windows[:6]:
        assert sorted(f.gpu for f in frames if f.t_start - ORIGIN_SECONDS == start) == [0, 1, 2, 3]
    first = [f for f in frames if f.t_start == ORIGIN_SECONDS]
    assert all(f.sample_count == f.expected_sample_count == 30 for f in first)
    assert all(f.serving_queues == 1 and f.feeder_processes == 1 for f in first)


def test_completions_are_counted_once_across_windows(skewed: tuple[list[Sample], Path]) -> None:
    samples, out = skewed
    frames = list(
        frames_from_samples(
            samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
    )
    end = samples[-1].timestamp_seconds - ORIGIN_SECONDS
    with (out / "requests.csv").open() as f:
        answered = [r for r in csv.DictReader(f) if r["outcome"] == "ok" and float(r["end"]) <= end]
    by_gpu: dict[int, float] = {}
    for frame in frames:
        assert frame.completions_per_second is not None
        # each window is differenced against the last sample before it: 30 s, the first 29 s
        elapsed = frame.seconds if frame.t_start > ORIGIN_SECONDS else frame.seconds - 1.0
        by_gpu[frame.gpu] = by_gpu.get(frame.gpu, 0.0) + frame.completions_per_second * elapsed
    # the first sample's own completions are its baseline: at most one second's worth
    expected = {g: sum(1 for r in answered if int(r["gpu"]) == g) for g in range(4)}
    for gpu, count in expected.items():
        assert count - 12 <= round(by_gpu[gpu]) <= count


def test_tokens_are_those_of_the_requests_answered(skewed: tuple[list[Sample], Path]) -> None:
    """The prompt and generated tokens a GPU's frames count, from its samples and from the
    run's frames.csv, are those of the requests it answered, each once."""
    samples, out = skewed
    plan = scenario.load("skewed-heterogeneous")
    sent = {r.id: r for r in traffic.generate(plan.scenario.traffic, 180, 1)}
    end = samples[-1].timestamp_seconds - ORIGIN_SECONDS
    with (out / "requests.csv").open() as f:
        answered = [r for r in csv.DictReader(f) if r["outcome"] == "ok" and float(r["end"]) <= end]
    expected = {
        (g, kind): sum(
            getattr(sent[int(r["id"])], f"{kind}_tokens") for r in answered if int(r["gpu"]) == g
        )
        for g in range(4)
        for kind in ("prompt", "output")
    }
    counted: dict[tuple[int, str], float] = {}
    for frame in frames_from_samples(
        samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
    ):
        elapsed = frame.seconds if frame.t_start > ORIGIN_SECONDS else frame.seconds - 1.0
        for kind, rate in (
            ("prompt", frame.prompt_tokens_per_second),
            ("output", frame.generation_tokens_per_second),
        ):
            assert rate is not None
            counted[(frame.gpu, kind)] = counted.get((frame.gpu, kind), 0.0) + rate * elapsed
    for key, tokens in expected.items():
        # the first sample's own requests are its baseline: at most a second's worth
        assert 0.9 * tokens <= round(counted[key]) <= tokens, key
    assert expected[(0, "prompt")] > 2 * expected[(1, "prompt")]  # the hot GPU answers more
    with (out / "frames.csv").open() as f:
        rows = list(csv.DictReader(f))
    from_csv = list(frames_from_lab_rows(rows, window_seconds=WINDOW, host="lab"))
    for key, tokens in expected.items():
        rate = "prompt" if key[1] == "prompt" else "generation"
        total = sum(
            getattr(f, f"{rate}_tokens_per_second") * f.seconds for f in from_csv if f.gpu == key[0]
        )
        assert round(total) == tokens, key
    # a frames.csv written before the columns: unknown
    old = [{k: v for k, v in r.items() if not k.endswith("_tokens")} for r in rows]
    assert all(
        f.prompt_tokens_per_second is None and f.generation_tokens_per_second is None
        for f in frames_from_lab_rows(old, window_seconds=WINDOW, host="lab")
    )


def test_the_slow_class_work_share_is_the_batch_class_share_of_the_serving(
    tmp_path: Path,
) -> None:
    """Where one queue serves interactive and batch requests, the share of the time spent
    serving (a request's duration less its wait for a batch) that went to the batch class is
    what each GPU's requests say: the frames' shares, weighed by utilization, within 0.1."""
    samples = _fast_run("mixed-interactive-batch", 240, tmp_path)
    frames = list(
        frames_from_samples(
            samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
    )
    with (tmp_path / "requests.csv").open() as f:
        answered = [r for r in csv.DictReader(f) if r["outcome"] == "ok" and float(r["end"]) <= 240]
    for gpu in range(4):
        served: dict[str, float] = {}
        for r in (r for r in answered if int(r["gpu"]) == gpu):
            served[r["class"]] = served.get(r["class"], 0.0) + float(r["end"]) - float(r["start"])
        shares = [
            (f.slow_class_work_share, f.utilization_mean_ratio or 0.0)
            for f in frames
            if f.gpu == gpu and f.slow_class_work_share is not None
        ]
        assert len(shares) >= 5, gpu
        measured = sum(s * u for s, u in shares) / sum(u for _, u in shares)
        assert measured == pytest.approx(served["batch"] / sum(served.values()), abs=0.1), gpu
    # one class only: no share
    skewed = _fast_run("skewed-heterogeneous", 60, tmp_path / "one")
    one = frames_from_samples(
        skewed, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
    )
    assert all(f.slow_class_work_share is None for f in one)


def test_a_class_whose_queue_is_listed_but_gets_no_request_is_not_served() -> None:
    """The lab's workers list a queue per class of their pool, as a server with class queues
    does; once a split sends the batch class to GPU 3 alone, the others serve interactive
    requests only, and their frames say so (GPU 3's: batch only, now and then none)."""
    plan = scenario.load("mixed-interactive-batch")
    requests = traffic.generate(plan.scenario.traffic, 180, 1)
    run = FastRun(plan, requests, 1, 180)
    run.start()
    run.set_batch_state("w3", "ready")  # the batch class's own backend
    run.set_server_state("w3", "maint")  # out of the shared one
    run.finish()
    records = [r for r in run.records if r.outcome == "ok"]
    assert {r.gpu for r in records if r.service_class == "batch"} == {3}
    assert {r.gpu for r in records if r.service_class == "interactive"} == {0, 1, 2}
    frames = list(
        frames_from_samples(
            run.samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
    )
    assert {f.service_classes for f in frames if f.gpu != 3} == {("interactive",)}
    assert {f.service_classes for f in frames if f.gpu == 3} <= {("batch",), ()}
    assert ("batch",) in {f.service_classes for f in frames if f.gpu == 3}


def test_the_skewed_server_shows_its_skew(skewed: tuple[list[Sample], Path]) -> None:
    samples, _ = skewed
    frames = [
        f
        for f in frames_from_samples(
            samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
        if f.t_start >= ORIGIN_SECONDS + 60
    ]
    hot = [f for f in frames if f.gpu == 0]
    cold = [f for f in frames if f.gpu != 0]
    assert min(f.queue_depth_mean or 0 for f in hot) > 3 * max(
        f.queue_depth_mean or 0 for f in cold
    )
    assert min(f.completions_per_second or 0 for f in hot) > max(
        f.completions_per_second or 0 for f in cold
    )


def test_a_run_directorys_frames_csv_gives_the_kv_usage_its_samples_give(
    skewed: tuple[list[Sample], Path],
) -> None:
    samples, out = skewed
    from_samples = {
        (f.t_start - ORIGIN_SECONDS, f.gpu): f.kv_cache_usage_ratio
        for f in frames_from_samples(
            samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
    }
    with (out / "frames.csv").open() as f:
        rows = list(csv.DictReader(f))
    from_csv = {
        (f.t_start, f.gpu): f.kv_cache_usage_ratio
        for f in frames_from_lab_rows(rows, window_seconds=WINDOW, host="lab")
    }
    common = sorted(set(from_samples) & set(from_csv))
    assert len(common) >= 20
    for key in common:
        assert from_csv[key] == pytest.approx(from_samples[key], abs=1e-6), key
    # the hot GPU's KV holds more than its idle peers'
    assert from_csv[(60.0, 0)] > max(from_csv[(60.0, g)] for g in (1, 2, 3))
    # a frames.csv written before the column: unknown, not empty
    old = [{k: v for k, v in r.items() if k != "kv_cache_usage_ratio"} for r in rows]
    frames = frames_from_lab_rows(old, window_seconds=WINDOW, host="lab")
    assert all(f.kv_cache_usage_ratio is None for f in frames)


def test_a_gap_is_not_a_baseline(skewed: tuple[list[Sample], Path]) -> None:
    samples, _ = skewed
    # drop a whole window: the next window's counters start from its own first sample
    kept = [s for s in samples if not 30 < s.timestamp_seconds - ORIGIN_SECONDS <= 60]
    frames = list(
        frames_from_samples(
            kept, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
    )
    assert not [f for f in frames if f.t_start == ORIGIN_SECONDS + 30]
    after = [f for f in frames if f.t_start == ORIGIN_SECONDS + 60]
    full = [
        f
        for f in frames_from_samples(
            samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
        if f.t_start == ORIGIN_SECONDS + 60
    ]
    for gap, whole in zip(after, full, strict=True):
        assert gap.completions_per_second is not None and whole.completions_per_second is not None
        assert gap.completions_per_second == pytest.approx(whole.completions_per_second, rel=0.3)


def test_partial_coverage_and_a_lost_gpu(tmp_path: Path) -> None:
    samples = _fast_run("gpu-lost", 240, tmp_path)
    # every other sample of the second window is missing
    kept = [
        s
        for s in samples
        if not (30 < s.timestamp_seconds - ORIGIN_SECONDS <= 60 and int(s.timestamp_seconds) % 2)
    ]
    frames = list(
        frames_from_samples(
            kept, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
        )
    )
    second = [f for f in frames if f.t_start == ORIGIN_SECONDS + 30]
    assert all(f.coverage_ratio == pytest.approx(0.5, abs=0.05) for f in second)
    gpu2 = {f.t_start - ORIGIN_SECONDS: f for f in frames if f.gpu == 2}
    assert not gpu2[90.0].lost and gpu2[150.0].lost and gpu2[210.0].lost
    assert gpu2[210.0].sample_count == 0
    assert gpu2[210.0].utilization_mean_ratio is None  # lost is not idle


def test_samples_out_of_order_are_refused(skewed: tuple[list[Sample], Path]) -> None:
    samples, _ = skewed
    shuffled = [*samples[40:70], *samples[:10]]
    with pytest.raises(ValueError, match="out of order"):
        list(
            frames_from_samples(
                shuffled, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
            )
        )


def test_unknown_is_none_not_zero() -> None:
    names = {f.name: f.type for f in dataclasses.fields(GpuFrame)}
    # every measured figure can say "the telemetry does not tell"
    for name in ("utilization_mean_ratio", "queue_depth_mean", "feeder_cpu_cores_max"):
        assert "None" in str(names[name])


def test_the_batch_limit_reaches_the_frames_from_samples_and_from_frames_csv(
    skewed: tuple[list[Sample], Path],
) -> None:
    samples, out = skewed
    limits = {w.gpu: float(w.max_batch_size) for w in scenario.load("skewed-heterogeneous").workers}
    assert limits == {0: 8.0, 1: 8.0, 2: 8.0, 3: 8.0}
    from_samples = frames_from_samples(
        samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
    )
    with (out / "frames.csv").open() as f:
        rows = list(csv.DictReader(f))
    from_csv = frames_from_lab_rows(rows, window_seconds=WINDOW, host="lab")
    for frames in (list(from_samples), from_csv):
        assert frames and all(f.max_batch_size == limits[f.gpu] for f in frames)
    # a frames.csv written before the column: unknown
    old = [{k: v for k, v in r.items() if k != "max_batch_size"} for r in rows]
    assert all(
        f.max_batch_size is None
        for f in frames_from_lab_rows(old, window_seconds=WINDOW, host="lab")
    )
