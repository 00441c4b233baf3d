"""Features: a GPU against its peers and its own past, in units that carry across servers."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from gpubalance.analyzer.features import (
    COLUMNS,
    FeatureBuilder,
    FeatureTable,
    batch_time_fit,
)
from gpubalance.analyzer.frames import frames_from_samples
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario
from gpubalance.lab.fast import ORIGIN_SECONDS
from gpubalance.telemetry import Sample


def _table(name: str, seconds: float, out: Path) -> FeatureTable:
    samples: list[Sample] = []
    lab_run.run(scenario.load(name), "fast", seconds, 1, out, on_sample=samples.append)
    frames = frames_from_samples(
        samples, window_seconds=30.0, interval_seconds=1.0, origin=ORIGIN_SECONDS
    )
    return FeatureBuilder().transform(frames)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> FeatureTable:
    return _table("skewed-heterogeneous", 240, tmp_path_factory.mktemp("skewed"))


def test_one_row_per_frame_with_every_column(skewed: FeatureTable) -> None:
    assert skewed.values.shape == (len(skewed.frames), len(COLUMNS))
    assert len(set(COLUMNS)) == len(COLUMNS)
    assert skewed.values.dtype == np.float64


def test_the_default_target_stands_out_from_its_peers(skewed: FeatureTable) -> None:
    late = [i for i, f in enumerate(skewed.frames) if f.t_start >= ORIGIN_SECONDS + 90]
    hot = [i for i in late if skewed.frames[i].gpu == 0]
    cold = [i for i in late if skewed.frames[i].gpu != 0]
    queue_z = skewed.column("queue_peer_z")
    assert min(queue_z[hot]) > 3 > max(queue_z[cold])
    idle = skewed.column("idle_while_peer_queued")
    assert max(idle[hot]) == 0.0  # the hot GPU has no queued peer
    assert min(idle[cold]) > 0.3  # the cold ones idle while GPU 0 queues
    share = skewed.column("throughput_share_vs_equal_ratio")
    assert min(share[hot]) > 1.5 > max(share[cold])


def test_a_lost_gpu_has_no_measured_features(tmp_path: Path) -> None:
    table = _table("gpu-lost", 240, tmp_path)
    rows = [
        table.row(i)
        for i, f in enumerate(table.frames)
        if f.gpu == 2 and f.t_start >= ORIGIN_SECONDS + 180
    ]
    assert rows
    for row in rows:
        assert math.isnan(row["utilization_ratio"]) and math.isnan(row["queue_batches"])
        assert row["coverage_ratio"] == 0.0


def test_a_throttled_card_reads_its_clock(tmp_path: Path) -> None:
    table = _table("thermal-throttle", 240, tmp_path)
    clock = table.column("clock_ratio")
    throttled = [
        i for i, f in enumerate(table.frames) if f.gpu == 1 and f.t_start >= ORIGIN_SECONDS + 150
    ]
    others = [
        i for i, f in enumerate(table.frames) if f.gpu != 1 and f.t_start >= ORIGIN_SECONDS + 150
    ]
    assert max(clock[throttled]) < 0.6 < min(clock[others])


def test_a_crashed_worker_keeps_its_pool(tmp_path: Path) -> None:
    # while w1 is down its GPU names no serving queue; it is still one of the pool's GPUs,
    # measured against the three that absorb its work
    table = _table("worker-crash", 240, tmp_path)
    down = [
        i
        for i, f in enumerate(table.frames)
        if f.gpu == 1 and ORIGIN_SECONDS + 150 <= f.t_start < ORIGIN_SECONDS + 210
    ]
    assert down and all(table.frames[i].serving_queues == 0 for i in down)
    assert set(table.column("peer_count")[down]) == {3.0}
    assert min(table.column("windows_without_serving")[down]) >= 1
    assert min(table.column("peer_rho_estimate_max")[down]) > 0.1


def test_rho_and_capacity_follow_the_load_and_the_card(tmp_path: Path) -> None:
    # round robin gives the 4070 Ti as many requests as each 4090: its capacity is the
    # smallest and its rho the highest
    table = _table("slow-card-round-robin", 300, tmp_path)
    late = [i for i, f in enumerate(table.frames) if f.t_start >= ORIGIN_SECONDS + 120]
    slow = [i for i in late if table.frames[i].gpu == 3]
    fast = [i for i in late if table.frames[i].gpu != 3]
    capacity = table.column("capacity_vs_peers_best_ratio")
    assert max(capacity[slow]) < 0.8 < min(capacity[fast])
    rho = table.column("rho_estimate_ratio")
    assert min(rho[slow]) > 0.85 > max(rho[fast])
    share = table.column("work_share_vs_capacity_share_ratio")
    assert min(share[slow]) > 1.1 > max(share[fast])
    assert set(table.column("peer_card_differs_share")[slow]) == {1.0}


def test_classes_sharing_one_queue_are_told_apart(tmp_path: Path) -> None:
    # chat waits behind 3k-token summarisation jobs in one queue: the lab reports each class's
    # requests apart, and a job takes well over the chat's time, queue wait included
    shared = _table("mixed-interactive-batch", 240, tmp_path / "shared")
    late = [i for i, f in enumerate(shared.frames) if f.t_start >= ORIGIN_SECONDS + 60]
    assert set(shared.column("service_class_count")[late]) == {2.0}
    assert float(np.median(shared.column("class_duration_ratio")[late])) > 1.5
    split = _table("separate-pools", 240, tmp_path / "split")
    assert set(split.column("service_class_count")) == {1.0}
    assert np.isnan(split.column("class_duration_ratio")).all()


def test_kv_cache_usage_shows_memory_pressure(tmp_path: Path) -> None:
    # 13B INT8 with 800 KiB/token of KV: the cache runs far fuller than on a healthy server
    tight = _table("fragmented-memory", 180, tmp_path / "tight")
    healthy = _table("balanced-4x4090", 180, tmp_path / "healthy")
    usage = tight.column("kv_cache_usage_ratio")
    assert (
        float(np.nanmedian(usage)) > 0.1 > float(np.nanmax(healthy.column("kv_cache_usage_ratio")))
    )


def test_the_batch_time_prior_follows_the_works_tokens() -> None:
    """Batches of one size say nothing of how their time grows: the exponent is the prior,
    the prefill's share s of one request's time (P / (P + 150 G)) plus 0.4 of the rest where
    the servers count tokens, 0.5 where they do not; sizes that spread decide over it."""
    one_size = np.array([[[4.0, 0.5]] * 5])
    assert batch_time_fit(one_size).exponent[0] == 0.5
    share = 2000 / (2000 + 150 * 10)
    prefill = batch_time_fit(one_size, np.array([2000.0]), np.array([10.0]))
    assert prefill.exponent[0] == pytest.approx(share + (1 - share) * 0.4)  # 0.74
    assert prefill.measured[0] == 0.0
    decode = batch_time_fit(one_size, np.array([100.0]), np.array([200.0]))
    assert decode.exponent[0] == pytest.approx(0.4, abs=0.01)
    unknown = batch_time_fit(one_size, np.array([math.nan]), np.array([10.0]))
    assert unknown.exponent[0] == 0.5
    # batch time growing as the batch (prefill-bound) across sizes 1 to 16: the sizes' spread
    # (the sum of squares of ln b about its mean) weighs against the prior's 2
    sizes = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    linear = np.array([[[b, 0.1 * b] for b in sizes]])
    spread = float(((np.log(sizes) - np.log(sizes).mean()) ** 2).sum())  # 4.80
    fit = batch_time_fit(linear, np.array([100.0]), np.array([200.0]))
    assert fit.exponent[0] == pytest.approx((spread + 2 * decode.exponent[0]) / (spread + 2))
    assert fit.measured[0] == pytest.approx(spread / (spread + 2))  # 0.71
