"""The fast speed (lab/fast.py): conservation, determinism, batching, routing, trouble, telemetry.

Each test builds its own small scenario in code, seconds to minutes of simulated time.
"""

from __future__ import annotations

import copy
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gpubalance.exporter.window import compute_window
from gpubalance.lab import traffic
from gpubalance.lab.fast import ORIGIN_SECONDS, FastRun, RunResult
from gpubalance.lab.run import run
from gpubalance.lab.scenario import Scenario, plan
from gpubalance.lab.workload import Request
from gpubalance.telemetry import (
    GpuSample,
    HostSample,
    ProcessHostStats,
    Sample,
    ServingSample,
)

# a 1B model on RTX 4090s, short fixed requests: about 60 ms alone on the card
SHORT = {"kind": "fixed", "value": 16}
PROMPT = {"kind": "fixed", "value": 128}


def spec(
    *,
    rate: float = 10.0,
    duration: float = 60.0,
    gpus: int = 2,
    cores: int = 8,
    disk_mb_per_second: float = 2000.0,
    worker: dict[str, Any] | None = None,
    router: dict[str, Any] | None = None,
    events: list[dict[str, Any]] | None = None,
    prompt: dict[str, Any] | None = None,
    output: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "name": "test-fast",
        "description": "built by tests/lab/test_fast.py",
        "duration_seconds": duration,
        "hardware": {
            "host": {"cores": cores, "disk_mb_per_second": disk_mb_per_second},
            "gpus": [{"card": "RTX 4090", "count": gpus}],
        },
        "models": {"small": {"params_billions": 1.0}},
        "workers": [{"gpu": "all", "model": "small", "max_batch_size": 8, **(worker or {})}],
        "router": router or {},
        "traffic": [
            {
                "name": "chat",
                "class": "interactive",
                "arrivals": {"kind": "poisson", "rate": rate},
                "prompt_tokens": prompt or PROMPT,
                "output_tokens": output or SHORT,
            }
        ],
        "events": events or [],
    }


def simulate(data: dict[str, Any], seed: int = 1) -> tuple[FastRun, RunResult, list[Request]]:
    p = plan(Scenario.model_validate(data))
    duration = p.scenario.duration_seconds
    requests = traffic.generate(p.scenario.traffic, duration, seed)
    fast_run = FastRun(p, requests, seed, duration)
    return fast_run, fast_run.run(), requests


def frames_of(result: RunResult, gpu: int, after: float = 0.0) -> list[dict[str, Any]]:
    return [f for f in result.frames if f["gpu"] == gpu and f["t"] > after]  # type: ignore[operator]


def mean_utilization(result: RunResult, gpu: int, after: float = 0.0) -> float:
    return statistics.mean(f["utilization"] for f in frames_of(result, gpu, after))  # type: ignore[misc]


def assert_conserved(requests: Sequence[Request], result: RunResult) -> None:
    ids = [r.id for r in result.records]
    assert len(ids) == len(set(ids)), "a request has more than one record"
    assert set(ids) == {r.id for r in requests}, "a request has no record"
    assert {r.outcome for r in result.records} <= {"ok", "rejected", "oom", "failed"}
    for record in result.records:
        assert record.end_seconds is not None and record.end_seconds >= record.arrival_seconds
        if record.outcome == "ok":
            assert record.start_seconds is not None
            assert record.arrival_seconds <= record.start_seconds < record.end_seconds


# -- conservation and determinism --------------------------------------------------------------


def test_every_request_ends_with_exactly_one_record() -> None:
    # everything that can end a request at once: CPU and disk preprocessing, a crash with restart
    # while requests are in preprocessing and in running batches, a lost GPU, a KV region small
    # enough to fail allocations, mixed lengths so batches outlive their shorter requests
    data = spec(
        rate=40.0,
        duration=90.0,
        gpus=3,
        cores=4,
        worker={
            "kv_cache_gib": 0.5,
            "preprocess": {"cpu_ms": 60.0, "threads": 2},
            "io_mb_per_request": 2.0,
        },
        events=[
            {"at": 20.0, "worker_crash": {"worker": "w0", "restart_after_seconds": 5.0}},
            {"at": 40.0, "gpu_lost": {"gpu": 1}},
            {"at": 60.0, "worker_crash": {"worker": "w2"}},
        ],
        prompt={"kind": "lognormal", "median": 256, "p90": 1024, "max": 4096},
        output={"kind": "lognormal", "median": 48, "p90": 200, "max": 1024},
    )
    _, result, requests = simulate(data)
    assert_conserved(requests, result)
    outcomes = Counter(r.outcome for r in result.records)
    assert outcomes["ok"] > 0 and outcomes["failed"] > 0 and outcomes["oom"] > 0
    assert {r.end_seconds for r in result.records if r.outcome == "failed"} == {20.0, 40.0, 60.0}


def test_pooled_policy_conserves_requests() -> None:
    data = spec(rate=400.0, duration=20.0, router={"policy": "pooled", "queue_timeout_seconds": 1})
    _, result, requests = simulate(data)
    assert_conserved(requests, result)


def test_same_seed_writes_byte_identical_files(tmp_path: Path) -> None:
    # the whole path of `gpubalance lab run`: generation, truth, simulation, files
    p = plan(Scenario.model_validate(spec(rate=20.0, duration=40.0)))
    for out in ("a", "b"):
        run(p, "fast", 40.0, 3, tmp_path / out, snapshots=True)
    names = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert names == [
        "frames.csv",
        "requests.csv",
        "snapshots.jsonl",
        "truth.csv",
        "truth_evidence.csv",
    ]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_same_seed_same_records_and_frames() -> None:
    data = spec(
        rate=30.0,
        router={"policy": "random_of_2"},
        worker={"preprocess": {"cpu_ms": 5.0}},
        output={"kind": "lognormal", "median": 32, "p90": 128, "max": 512},
    )
    _, first, _ = simulate(data, seed=4)
    _, again, _ = simulate(data, seed=4)
    _, other, _ = simulate(data, seed=5)
    assert first.records == again.records
    assert first.frames == again.frames
    assert first.samples == again.samples
    assert first.records != other.records


# -- the batcher ------------------------------------------------------------------------------


def test_max_batch_size_is_never_exceeded() -> None:
    data = spec(rate=200.0, duration=20.0, worker={"max_batch_size": 4})
    _, result, _ = simulate(data)
    sizes = [r.batch_size for r in result.records if r.outcome == "ok"]
    assert max(sizes) == 4  # overloaded: batches are full, never fuller
    for frame in result.frames:
        assert frame["running"] <= 4 * 1  # one worker per GPU
        assert frame["batch_size_mean"] <= 4


def test_max_queue_delay_holds_batches_at_low_rate() -> None:
    # 0.5 request/s per worker: a batch of 8 never fills within 300 ms, so each waits it out
    data = spec(rate=1.0, duration=120.0, worker={"max_queue_delay_ms": 300.0})
    _, result, _ = simulate(data)
    last = result.samples[-1]
    for serving in last.serving:
        assert serving.batch_assembly_delay_seconds_count
        mean_delay = (
            serving.batch_assembly_delay_seconds_sum / serving.batch_assembly_delay_seconds_count
        )
        assert mean_delay == pytest.approx(0.3, abs=0.02)
    ok = [r for r in result.records if r.outcome == "ok"]
    # the wait shows in every request's start: nothing starts before its delay is up
    waits = [r.start_seconds - r.arrival_seconds for r in ok]
    assert statistics.median(waits) == pytest.approx(0.3, abs=0.02)
    # without the delay, the same traffic starts at once
    _, eager, _ = simulate(spec(rate=1.0, duration=120.0))
    waits = [r.start_seconds - r.arrival_seconds for r in eager.records if r.outcome == "ok"]
    assert statistics.median(waits) < 0.01


def test_busy_gpu_fills_batches_without_delay() -> None:
    _, light, _ = simulate(spec(rate=2.0, duration=60.0))
    _, busy, _ = simulate(spec(rate=400.0, duration=20.0))
    light_sizes = [r.batch_size for r in light.records if r.outcome == "ok"]
    busy_sizes = [r.batch_size for r in busy.records if r.outcome == "ok"]
    assert statistics.mean(light_sizes) < 1.5
    assert statistics.mean(busy_sizes) > 7.5


# -- routers --------------------------------------------------------------------------------------


def test_pooled_never_exceeds_max_batch_in_flight_and_rejects_after_timeout() -> None:
    data = spec(
        rate=300.0,
        duration=20.0,
        worker={"max_batch_size": 4},
        router={"policy": "pooled", "queue_timeout_seconds": 2.0},
    )
    _, result, _ = simulate(data)
    assert max(f["in_flight"] for f in result.frames) <= 4
    rejected = [r for r in result.records if r.outcome == "rejected"]
    assert rejected, "an overloaded pool must turn requests away"
    for record in rejected:
        assert record.end_seconds - record.arrival_seconds == pytest.approx(2.0)
    ok = [r for r in result.records if r.outcome == "ok"]
    assert max(r.start_seconds - r.arrival_seconds for r in ok) <= 2.0 + 1e-9


def test_pooled_with_max_queue_turns_the_excess_away_at_once() -> None:
    router = {"policy": "pooled", "queue_timeout_seconds": 2.0, "max_queue": 6}
    data = spec(rate=300.0, duration=20.0, worker={"max_batch_size": 4}, router=router)
    _, result, requests = simulate(data)
    assert_conserved(requests, result)
    rejected = [r for r in result.records if r.outcome == "rejected"]
    at_once = [r for r in rejected if r.end_seconds == r.arrival_seconds]
    # the bound answers the overload at arrival (429), before any request waits 2 s for a slot
    assert at_once and len(at_once) == len(rejected)
    # never more than max_queue waiting: each request that got a slot found fewer ahead of it
    ok = sorted((r for r in result.records if r.start_seconds is not None), key=lambda r: r.id)
    waits = [r.start_seconds - r.arrival_seconds for r in ok]  # type: ignore[operator]
    assert max(waits) < 2.0
    # the same load unbounded: requests wait out the timeout instead
    data["router"] = {"policy": "pooled", "queue_timeout_seconds": 2.0}
    _, unbounded, _ = simulate(data)
    timed_out = [r for r in unbounded.records if r.outcome == "rejected"]
    assert timed_out and all(r.end_seconds > r.arrival_seconds for r in timed_out)


def test_max_queue_bounds_only_the_pooled_policy() -> None:
    data = spec(router={"policy": "least_connections", "max_queue": 4})
    with pytest.raises(ValueError, match="max_queue bounds the pooled policy's central queue"):
        Scenario.model_validate(data)


def test_pooled_restarted_worker_pulls_from_the_central_queue() -> None:
    # one worker, a crash and a restart; no arrivals after the restart to trigger a dispatch
    data = spec(
        rate=200.0,
        duration=12.0,
        gpus=1,
        router={"policy": "pooled", "queue_timeout_seconds": 30.0},
        events=[{"at": 5.0, "worker_crash": {"worker": "w0", "restart_after_seconds": 1.0}}],
    )
    _, result, requests = simulate(data)
    assert_conserved(requests, result)
    restarted = [r for r in result.records if r.outcome == "ok" and r.start_seconds >= 6.0]
    assert restarted and min(r.start_seconds for r in restarted) == pytest.approx(6.0)


def test_weight_zero_sends_nothing_until_the_weight_returns() -> None:
    data = spec(
        rate=20.0,
        duration=60.0,
        router={"policy": "weighted_round_robin", "weights": {"w0": 1.0, "w1": 0.0}},
        events=[{"at": 30.0, "router": {"weights": {"w1": 1.0}}}],
    )
    _, result, _ = simulate(data)
    to_w1 = [r for r in result.records if r.worker == "w1"]
    assert to_w1 and min(r.arrival_seconds for r in to_w1) >= 30.0
    after = Counter(r.worker for r in result.records if r.arrival_seconds >= 30.0)
    assert abs(after["w0"] - after["w1"]) <= 1


# -- trouble ----------------------------------------------------------------------------------


def test_throttle_raises_busy_share_at_light_load() -> None:
    data = spec(rate=10.0, duration=60.0)
    throttled = copy.deepcopy(data)
    throttled["events"] = [{"at": 0.0, "throttle": {"gpu": 0, "clock_ratio": 0.5}}]
    _, base, _ = simulate(data)
    _, slow, _ = simulate(throttled)
    assert mean_utilization(slow, 0) > 1.2 * mean_utilization(base, 0)
    assert mean_utilization(slow, 1) == pytest.approx(mean_utilization(base, 1))
    reasons = {f["throttle_reasons"] for f in frames_of(slow, 0)}
    assert "sw_thermal_slowdown" in reasons


def test_throttle_lowers_throughput_when_saturated() -> None:
    data = spec(rate=400.0, duration=20.0, gpus=1)
    throttled = copy.deepcopy(data)
    throttled["events"] = [{"at": 0.0, "throttle": {"gpu": 0, "clock_ratio": 0.5}}]
    _, base, _ = simulate(data)
    _, slow, _ = simulate(throttled)
    done = sum(f["requests_completed"] for f in base.frames)
    done_slow = sum(f["requests_completed"] for f in slow.frames)
    assert done_slow < 0.8 * done


def test_gpu_lost_fails_in_flight_and_shows_lost_afterwards() -> None:
    data = spec(rate=60.0, duration=40.0, events=[{"at": 20.0, "gpu_lost": {"gpu": 0}}])
    _, result, requests = simulate(data)
    assert_conserved(requests, result)
    failed = [r for r in result.records if r.outcome == "failed"]
    assert failed and all(r.gpu == 0 and r.end_seconds == 20.0 for r in failed)
    assert not [
        r for r in result.records if r.gpu == 0 and r.outcome == "ok" and r.end_seconds > 20
    ]
    # the rest goes to the other GPU
    assert all(r.gpu == 1 for r in result.records if r.arrival_seconds > 20.0)
    for sample in result.samples:
        gpu0 = sample.gpus[0]
        assert gpu0.lost == (sample.timestamp_seconds - ORIGIN_SECONDS >= 20.0)
        if gpu0.lost:
            assert gpu0.utilization_ratio is None and gpu0.memory_used_bytes is None
    assert all(f["lost"] == (f["t"] >= 20.0) for f in frames_of(result, 0))


def test_worker_crash_fails_its_queue_and_restart_resumes() -> None:
    data = spec(
        rate=60.0,
        duration=60.0,
        events=[{"at": 20.0, "worker_crash": {"worker": "w0", "restart_after_seconds": 10.0}}],
    )
    _, result, requests = simulate(data)
    assert_conserved(requests, result)
    mine = [r for r in result.records if r.worker == "w0"]
    failed = [r for r in mine if r.outcome == "failed"]
    assert failed and all(r.end_seconds == 20.0 for r in failed)
    assert not [
        r for r in mine if r.outcome == "ok" and r.end_seconds > 20.0 and r.start_seconds < 30.0
    ]
    assert [r for r in mine if r.outcome == "ok" and r.start_seconds >= 30.0], "no restart"
    for sample in result.samples:
        t = sample.timestamp_seconds - ORIGIN_SECONDS
        w0 = next(s for s in sample.serving if s.worker == "w0")
        assert w0.up == (not 20.0 <= t < 30.0)


def test_host_bound_gpu_idles_while_requests_queue_for_cpu() -> None:
    # 200 ms of CPU per request on 2 cores: 10 requests/s at most, 40 arrive
    data = spec(
        rate=40.0, duration=60.0, cores=2, worker={"preprocess": {"cpu_ms": 200.0, "threads": 4}}
    )
    _, result, _ = simulate(data)
    _, base, _ = simulate(spec(rate=40.0, duration=60.0, cores=2))
    late = [s for s in result.samples if s.timestamp_seconds - ORIGIN_SECONDS > 10]
    for gpu in (0, 1):
        assert mean_utilization(result, gpu, after=10) < 0.5
        assert mean_utilization(result, gpu, after=10) < 0.7 * mean_utilization(base, gpu, after=10)
    # requests pile up before the GPU: in flight, not in the batcher's queue
    last = frames_of(result, 0)[-1]
    assert last["in_flight"] > 100 and last["queue_depth"] < 8
    cpu_some = [s.host.pressure[0].some_avg10_ratio for s in late]
    assert statistics.mean(cpu_some) > 0.9
    assert all(s.host.pressure[0].some_avg10_ratio == 0.0 for s in base.samples)
    # every core busy: the CPU counters say so too
    window = compute_window(late, 30.0, 300.0)
    assert window.host is not None and min(window.host.cpu_busy_ratio) > 0.9
    assert max(f["worker_cpu_cores"] for f in frames_of(result, 0, after=10)) == pytest.approx(1.0)


def test_io_bound_gpu_idles_while_requests_queue_for_disk() -> None:
    # 20 MB per request at 100 MB/s: 5 requests/s for the whole host, 40 arrive
    data = spec(
        rate=40.0, duration=60.0, disk_mb_per_second=100.0, worker={"io_mb_per_request": 20.0}
    )
    _, result, _ = simulate(data)
    late = [s for s in result.samples if s.timestamp_seconds - ORIGIN_SECONDS > 10]
    for gpu in (0, 1):
        assert mean_utilization(result, gpu, after=10) < 0.3
    io = [s.host.pressure[1] for s in late]
    assert statistics.mean(p.some_avg10_ratio for p in io) > 0.9
    disk = late[-1].host.disks[0]
    assert disk.read_bytes_total == disk.reads_total * 20 * 1024 * 1024
    window = compute_window(late, 30.0, 300.0)
    assert window.host is not None
    disk = window.host.disks[0]
    assert disk.busy_ratio == pytest.approx(1.0, abs=0.01)
    assert disk.read_bytes_per_second == pytest.approx(100.0 * 1024 * 1024, rel=0.05)


def test_small_kv_region_produces_oom_and_allocation_failures() -> None:
    # half a GiB of KV per worker (256 blocks of 2 MiB) and requests of 8 to 260 blocks: some
    # batches do not fit
    data = spec(
        rate=20.0,
        duration=60.0,
        worker={"kv_cache_gib": 0.5},
        prompt={"kind": "lognormal", "median": 600, "p90": 2400, "max": 4096},
        output={"kind": "lognormal", "median": 48, "p90": 200, "max": 512},
    )
    sim, result, _ = simulate(data)
    oom = [r for r in result.records if r.outcome == "oom"]
    assert oom
    failures = sum(w.kv.failures_total for w in sim.workers)
    assert failures == len(oom)
    # the last sample counts those before the end; the drain after it may add more
    counted = [r for r in oom if r.end_seconds <= 60.0]
    last = result.samples[-1]
    assert sum(s.allocation_failures_total for s in last.serving) == len(counted)
    assert max(s.kv_cache_usage_ratio for smp in result.samples for s in smp.serving) > 0.5
    assert sum(frames_of(result, g)[-1]["allocation_failures_total"] for g in (0, 1)) == len(
        counted
    )
    # the rest of the batch goes on: an oom costs the request, not the worker
    assert Counter(r.outcome for r in result.records)["ok"] > len(oom)


# -- telemetry --------------------------------------------------------------------------------


def test_samples_have_the_exporter_types_and_window_works() -> None:
    data = spec(rate=20.0, duration=40.0, worker={"preprocess": {"cpu_ms": 10.0}})
    _, result, _ = simulate(data)
    assert len(result.samples) == 40
    assert [s.timestamp_seconds for s in result.samples] == [
        ORIGIN_SECONDS + k for k in range(1, 41)
    ]
    for sample in result.samples:
        assert isinstance(sample, Sample) and sample.nvml.up
        assert all(isinstance(g, GpuSample) for g in sample.gpus)
        assert isinstance(sample.host, HostSample)
        assert all(isinstance(p, ProcessHostStats) for p in sample.processes.values())
        assert all(isinstance(s, ServingSample) for s in sample.serving)
        assert [g.index for g in sample.gpus] == [0, 1]
        assert [s.worker for s in sample.serving] == ["w0", "w1"]
        for gpu in sample.gpus:
            assert 0.0 <= gpu.utilization_ratio <= 1.0
            assert 0 < gpu.memory_used_bytes < gpu.memory_total_bytes
            assert gpu.power_watts <= gpu.power_limit_watts
            assert [p.pid for p in gpu.processes] == [30000 + gpu.index]
    window = compute_window(result.samples[-30:], 30.0, 300.0)
    assert [g.index for g in window.gpus] == [0, 1]
    for gpu in window.gpus:
        expected = statistics.mean(f["utilization"] for f in frames_of(result, gpu.index, 10.0))
        assert gpu.utilization_ratio == pytest.approx(expected, abs=0.05)
    completed = sum(f["requests_completed"] for f in result.frames if f["t"] > 10.0)
    served = sum(s.requests_per_second for s in window.serving) * window.seconds
    assert served == pytest.approx(completed, rel=0.05)
    assert len(window.host.cpu_busy_ratio) == 8
    assert set(window.processes) == {30000, 30001}


# -- worker moves ------------------------------------------------------------------------------


def two_pools(duration: float = 60.0) -> dict[str, Any]:
    """GPUs 0-1 serve pool a (model small), GPUs 2-3 pool b (model other), 5 requests/s each."""
    data = spec(gpus=4, duration=duration, output={"kind": "fixed", "value": 128})
    data["models"]["other"] = {"params_billions": 2.0}
    data["workers"] = [
        {"gpu": [0, 1], "model": "small", "max_batch_size": 8, "pool": "a"},
        {"gpu": [2, 3], "model": "other", "max_batch_size": 8, "pool": "b"},
    ]
    data["router"] = {"pools": {"interactive": "a", "batch": "b"}}
    second = copy.deepcopy(data["traffic"][0])
    data["traffic"][0]["arrivals"]["rate"] = 5.0
    second.update(name="jobs", arrivals={"kind": "poisson", "rate": 5.0})
    data["traffic"].append({**second, "class": "batch"})
    return data


def test_a_moved_gpu_finishes_its_requests_loads_the_other_model_then_serves_another_pool() -> None:
    p = plan(Scenario.model_validate(two_pools()))
    requests = traffic.generate(p.scenario.traffic, 60.0, 1)
    fast = FastRun(p, requests, 1, 60.0)
    fast.start()
    fast.advance(20.0)
    w2 = fast.worker_on(2)
    assert w2.in_flight > 0  # requests in flight when the move begins, which must finish
    held = set(w2.current) | set(w2.preparing) | {r.id for r, _ in w2.queue}
    fast.stop_worker("w2")
    assert w2.process == "stopping"
    fast.advance(25.0)
    assert w2.process == "stopped" and w2.in_flight == 0
    fast.remove_server("w2")
    assert w2 not in fast.pools["b"]
    stopped_at = max(r.end_seconds for r in fast.records if r.worker == "w2")
    new = fast.start_worker(2, "a")
    load = fast.load_seconds(new.plan)
    assert new.plan.model_name == "small" and new.plan.pool == "a" and new.name == "w2"
    assert load > 5.0
    fast.add_server("w2")  # added at once: still it serves nothing while it loads
    fast.advance(25.0 + load - 0.5)
    assert new.process == "loading" and new.requests_done == 0 and new.in_flight == 0
    fast.advance(45.0)
    assert new.process == "running" and new.requests_done > 0
    result = fast.finish()
    assert_conserved(requests, result)
    by_id = {r.id: r for r in result.records}
    # what w2 held when it was stopped was answered, none failed
    assert all(by_id[i].outcome == "ok" and by_id[i].worker == "w2" for i in held)
    served = [r for r in result.records if r.worker == "w2" and r.start_seconds is not None]
    assert {r.service_class for r in served if r.start_seconds > 25.0 + load} == {"interactive"}
    assert not [r for r in served if stopped_at < r.start_seconds < 25.0 + load]
    assert {r.outcome for r in result.records} == {"ok"}
    # the telemetry shows GPU 2 serving pool a's model after the load, and no serving
    # series of it while it had no process
    queues = {
        (s.timestamp_seconds - ORIGIN_SECONDS, x.queue)
        for s in result.samples
        for x in s.serving
        if x.gpu_index == 2
    }
    assert {q for t, q in queues if t > 27.0 + load} == {"small"}
    assert not {q for t, q in queues if stopped_at + 1 < t < 25.0 + load}


def test_a_worker_is_started_only_on_a_gpu_whose_worker_has_stopped() -> None:
    p = plan(Scenario.model_validate(two_pools()))
    fast = FastRun(p, [], 1, 60.0)
    fast.start()
    with pytest.raises(ValueError, match="w2 is running, not stopped"):
        fast.start_worker(2, "a")
    fast.stop_worker("w2")
    with pytest.raises(ValueError, match="pool 'c' is not among"):
        fast.start_worker(2, "c")
