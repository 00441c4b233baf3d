"""The lab's building blocks: service times, the KV allocator, GPU sensor physics, routers."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from gpubalance.lab.catalogue import CARDS
from gpubalance.lab.model.gpu import (
    AMBIENT_CELSIUS,
    IDLE_MEMORY_CLOCK_MHZ,
    IDLE_SM_CLOCK_MHZ,
    THERMAL_SLOWDOWN_CELSIUS,
    GpuPhysics,
    Reading,
)
from gpubalance.lab.model.memory import (
    BLOCK_BYTES,
    MIN_SEGMENT_BLOCKS,
    AllocationFailed,
    KvRegion,
)
from gpubalance.lab.model.service import ServiceModel, reference_shape
from gpubalance.lab.routing import Router, sticky_target

RTX4090 = CARDS["RTX 4090"]


def model(params_billions: float = 7.0, card: str = "RTX 4090") -> ServiceModel:
    return ServiceModel(CARDS[card], params_billions)


# -- service times -------------------------------------------------------------------------------


def test_prefill_grows_with_prompt_and_batch() -> None:
    m = model()
    by_prompt = [m.prefill_seconds(1, p) for p in (16, 128, 512, 2048, 8192, 32768)]
    assert by_prompt == sorted(by_prompt) and len(set(by_prompt)) == len(by_prompt)
    # up to the largest batch a scenario may ask for, beyond the measured 64
    by_batch = [m.prefill_seconds(b, 512) for b in (1, 2, 4, 8, 16, 32, 48, 64, 128, 1024)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == len(by_batch)


def test_decode_step_grows_slowly_with_batch() -> None:
    m = model()
    steps = [m.token_seconds(b, 512) for b in (1, 2, 4, 8, 16, 32, 64, 256)]
    assert steps == sorted(steps)
    # bound by reading the weights once per step: 32 requests cost far less than 32 times one
    assert steps[5] / steps[0] < 1.5


def test_half_the_bandwidth_decodes_twice_as_slow() -> None:
    half = dataclasses.replace(RTX4090, memory_bandwidth_gbps=RTX4090.memory_bandwidth_gbps / 2)
    fast, slow = ServiceModel(RTX4090, 7.0), ServiceModel(half, 7.0)
    for batch, context in ((1, 100), (8, 512), (32, 3000)):
        assert slow.token_seconds(batch, context) == pytest.approx(
            2 * fast.token_seconds(batch, context)
        )
    # prefill is bound by tensor throughput, which the card keeps
    assert slow.prefill_seconds(8, 512) == pytest.approx(fast.prefill_seconds(8, 512))


def test_bigger_model_is_proportionally_slower() -> None:
    assert model(14.0).prefill_seconds(4, 512) == pytest.approx(
        2 * model(7.0).prefill_seconds(4, 512)
    )
    assert model(14.0).token_seconds(4, 512) == pytest.approx(2 * model(7.0).token_seconds(4, 512))


@pytest.mark.parametrize("ratio", [0.9, 0.5, 0.25])
def test_throttling_slows_prefill_by_r_and_decode_by_sqrt_r(ratio: float) -> None:
    m = model()
    prompts, outputs = [300, 500, 700], [20, 60, 100]
    full, _ = m.batch_timeline(prompts, outputs)
    prefill = m.prefill_seconds(3, 500)
    decode = full - prefill
    throttled, _ = m.batch_timeline(prompts, outputs, clock_ratio=ratio)
    assert throttled == pytest.approx(prefill / ratio + decode / math.sqrt(ratio))


def test_batch_timeline_finishes_in_output_order_and_last_is_busy() -> None:
    m = model()
    outputs = [50, 5, 200, 80, 5]
    busy, finish = m.batch_timeline([256] * 5, outputs)
    order = sorted(range(5), key=lambda i: outputs[i])
    assert [finish[i] for i in order] == sorted(finish)
    assert finish[1] == finish[4]  # same length, same step
    assert max(finish) == busy == finish[2]
    assert min(finish) > m.prefill_seconds(5, 256)  # nobody is done before the prefill


def test_request_cost_is_one_over_throughput_for_identical_requests() -> None:
    for params, card, batch, prompt, output in (
        (7.0, "RTX 4090", 8, 512, 128),
        (1.0, "RTX 3090", 16, 200, 40),
        (13.0, "RTX 6000 Ada", 4, 2000, 300),
    ):
        m = model(params, card)
        prefill, decode = m.request_cost_seconds(batch, np.full(5, prompt), np.full(5, output))
        total = prefill + decode
        assert np.allclose(total, 1 / m.requests_per_second(batch, prompt, output), rtol=1e-12)


def test_curve_many_equals_scalar_calls() -> None:
    shape = reference_shape()
    # below, between, on and beyond the measured points
    x = np.array([0.5, 1.0, 3.0, 50.0, 128.0, 700.0, 8192.0, 20000.0, 1e6])
    for curve in (
        shape.prefill_by_prompt,
        shape.prefill_by_batch,
        shape.token_by_batch,
        shape.token_by_context,
    ):
        assert np.allclose(curve.many(x), [curve(v) for v in x], rtol=1e-12)


# -- KV allocator ----------------------------------------------------------------------------------


def holes(kv: KvRegion) -> list[list[tuple[int, int]]]:
    return [segment.holes for segment in kv.segments]


def test_allocate_free_round_trip_keeps_the_segment_reserved() -> None:
    kv = KvRegion(40 * BLOCK_BYTES)
    a = kv.allocate(3 * BLOCK_BYTES)
    b = kv.allocate(BLOCK_BYTES + 1)  # rounds up to whole blocks
    # the first allocation reserves a minimum-size segment; the second fits in it
    assert (a.segment, a.start_block, a.blocks) == (0, 0, 3)
    assert (b.segment, b.start_block, b.blocks) == (0, 3, 2)
    assert kv.used_bytes == 5 * BLOCK_BYTES
    assert kv.reserved_bytes == MIN_SEGMENT_BLOCKS * BLOCK_BYTES
    kv.free(a)
    kv.free(b)
    assert kv.used_bytes == 0
    assert holes(kv) == [[(0, MIN_SEGMENT_BLOCKS)]]
    # a caching allocator keeps what it reserved: NVML still sees it used
    assert kv.reserved_bytes == MIN_SEGMENT_BLOCKS * BLOCK_BYTES


def test_free_coalesces_with_both_neighbours_within_its_segment() -> None:
    kv = KvRegion(40 * BLOCK_BYTES)
    a, b, c = (kv.allocate(2 * BLOCK_BYTES) for _ in range(3))
    kv.free(a)
    kv.free(c)
    assert holes(kv) == [[(0, 2), (4, MIN_SEGMENT_BLOCKS - 4)]]
    kv.free(b)  # the hole before and the hole after become one with it
    assert holes(kv) == [[(0, MIN_SEGMENT_BLOCKS)]]


def test_best_fit_takes_the_smallest_hole_that_fits() -> None:
    kv = KvRegion(40 * BLOCK_BYTES)
    blocks = [kv.allocate(BLOCK_BYTES) for _ in range(MIN_SEGMENT_BLOCKS)]
    kv.free(blocks[1])
    kv.free(blocks[5])
    kv.free(blocks[6])
    assert kv.allocate(BLOCK_BYTES).start_block == 1  # the 1-block hole, not the 2-block one
    assert kv.allocate(2 * BLOCK_BYTES).start_block == 5


def test_large_requests_get_a_segment_of_their_own() -> None:
    kv = KvRegion(100 * BLOCK_BYTES)
    big = kv.allocate(30 * BLOCK_BYTES)
    assert (big.segment, big.blocks) == (0, 30)
    assert kv.reserved_bytes == 30 * BLOCK_BYTES


def test_fragmented_failure_when_free_memory_suffices_but_no_hole_does() -> None:
    # segments cut for small requests cannot serve a larger one once the device is reserved
    kv = KvRegion(40 * BLOCK_BYTES)
    small = [kv.allocate(12 * BLOCK_BYTES) for _ in range(3)]
    last = kv.allocate(4 * BLOCK_BYTES)  # the rest of the device, a 4-block segment
    assert kv.reserved_bytes == 40 * BLOCK_BYTES
    for allocation in small:
        kv.free(allocation)
    assert kv.free_bytes == 36 * BLOCK_BYTES and kv.largest_hole_bytes == 12 * BLOCK_BYTES
    with pytest.raises(AllocationFailed) as failed:
        kv.allocate(20 * BLOCK_BYTES)
    assert failed.value.fragmented
    assert "fragmented" in str(failed.value)
    with pytest.raises(AllocationFailed) as failed:
        kv.allocate(37 * BLOCK_BYTES)  # more than is free at all
    assert not failed.value.fragmented
    assert "out of memory" in str(failed.value)
    assert (kv.failures_total, kv.fragmented_failures_total) == (2, 1)
    assert kv.used_bytes == 4 * BLOCK_BYTES  # failures leave the region as it was
    kv.free(last)
    assert kv.allocate(12 * BLOCK_BYTES).blocks == 12  # a hole of that size still serves


# -- GPU sensor physics ----------------------------------------------------------------------------


def settle(
    gpu: GpuPhysics,
    busy: float,
    seconds: int = 600,
    clock_ratio: float = 1.0,
    reason: str | None = None,
) -> Reading:
    reading = None
    for _ in range(seconds):
        reading = gpu.step(1.0, busy, clock_ratio, reason)
    assert reading is not None
    return reading


def test_idle_gpu_reports_gpu_idle_and_idle_clocks() -> None:
    reading = settle(GpuPhysics(RTX4090, RTX4090.power_limit_watts), 0.0)
    assert reading.throttle_reasons == frozenset({"gpu_idle"})
    assert reading.sm_clock_mhz == IDLE_SM_CLOCK_MHZ
    assert reading.memory_clock_mhz == IDLE_MEMORY_CLOCK_MHZ
    assert reading.power_watts < 0.1 * RTX4090.power_limit_watts
    assert reading.temperature_celsius < 40


def test_busy_at_full_power_settles_near_the_steady_temperature() -> None:
    gpu = GpuPhysics(RTX4090, RTX4090.power_limit_watts)
    reading = settle(gpu, 1.0)
    expected = AMBIENT_CELSIUS + reading.power_watts * gpu._resistance
    assert reading.temperature_celsius == pytest.approx(expected, abs=0.1)
    assert 65 < reading.temperature_celsius < THERMAL_SLOWDOWN_CELSIUS
    assert reading.throttle_reasons == frozenset()
    assert reading.sm_clock_mhz == RTX4090.boost_clock_mhz
    assert reading.power_watts <= RTX4090.power_limit_watts


def test_power_limit_caps_power() -> None:
    reading = settle(GpuPhysics(RTX4090, 250.0), 1.0, seconds=5)
    assert reading.power_watts == pytest.approx(250.0)


def test_thermal_throttle_pins_temperature_above_slowdown_and_reports_reason() -> None:
    reading = settle(
        GpuPhysics(RTX4090, RTX4090.power_limit_watts),
        1.0,
        clock_ratio=0.6,
        reason="sw_thermal_slowdown",
    )
    assert reading.temperature_celsius > THERMAL_SLOWDOWN_CELSIUS
    assert reading.throttle_reasons == frozenset({"sw_thermal_slowdown"})
    assert reading.sm_clock_mhz == pytest.approx(0.6 * RTX4090.boost_clock_mhz)
    assert reading.fan_speed_ratio == pytest.approx(1.0)  # fans flat out


def test_energy_integrates_power() -> None:
    gpu = GpuPhysics(RTX4090, RTX4090.power_limit_watts)
    total = 0.0
    for k in range(100):
        reading = gpu.step(0.5, (k % 10) / 10)
        total += reading.power_watts * 0.5
    assert reading.energy_joules_total == pytest.approx(total)


# -- routers -----------------------------------------------------------------------------------


@dataclass
class Worker:
    name: str
    in_flight: int = 0


def workers(*names: str) -> list[Worker]:
    return [Worker(n) for n in names]


def test_round_robin_cycles() -> None:
    pool = workers("a", "b", "c")
    router = Router("round_robin", {}, seed=1)
    assert [router.pick(pool, pool, None).name for _ in range(7)] == list("abcabca")


def test_smooth_weighted_round_robin_gives_3_to_1_without_long_runs() -> None:
    pool = workers("a", "b")
    router = Router("weighted_round_robin", {"a": 3.0, "b": 1.0}, seed=1)
    picks = "".join(router.pick(pool, pool, None).name for _ in range(400))
    assert Counter(picks) == {"a": 300, "b": 100}
    assert "aaaa" not in picks and "bb" not in picks  # spread, not 3 a's then 1 b in blocks


def test_least_connections_picks_the_least_loaded() -> None:
    pool = [Worker("a", 3), Worker("b", 1), Worker("c", 2)]
    router = Router("least_connections", {}, seed=1)
    assert router.pick(pool, pool, None).name == "b"
    pool[1].in_flight = 5
    assert router.pick(pool, pool, None).name == "c"
    # ties take turns
    pool = [Worker("a", 1), Worker("b", 0), Worker("c", 0)]
    assert [router.pick(pool, pool, None).name for _ in range(4)] == list("bcbc")


def test_random_of_2_never_picks_the_more_loaded_of_its_pair() -> None:
    pool = [Worker(f"w{k}", k) for k in range(6)]  # loads 0..5, all different
    router = Router("random_of_2", {}, seed=3)
    picks = [router.pick(pool, pool, None) for _ in range(3000)]
    # the most loaded can never win a pair; the least loaded wins every pair it is in
    counts = Counter(p.name for p in picks)
    assert "w5" not in counts
    assert counts["w0"] == pytest.approx(3000 * 2 / 6, rel=0.1)  # in 2 of 6 picks of a pair
    assert counts["w0"] > counts["w1"] > counts["w2"] > counts["w3"] > counts["w4"] > 0


def test_random_of_2_is_deterministic_per_seed() -> None:
    pool = [Worker(f"w{k}", k % 3) for k in range(5)]

    def run(seed: int) -> list[str]:
        router = Router("random_of_2", {}, seed=seed)
        return [router.pick(pool, pool, None).name for _ in range(200)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_random_of_2_with_one_worker_up() -> None:
    pool = workers("a", "b")
    assert Router("random_of_2", {}, seed=1).pick(pool, pool[1:], None).name == "b"


def test_sticky_target_is_crc32_over_the_pool_in_order() -> None:
    names = ["w0", "w1", "w2"]
    for session in ("chat/s0", "chat/s1", "batch/s17", ""):
        assert sticky_target(session, names) == names[zlib.crc32(session.encode()) % 3]
    assert sticky_target("chat/s0", ["only"]) == "only"


def test_sticky_is_stable_and_falls_back_when_the_target_is_down() -> None:
    pool = workers("w0", "w1", "w2")
    router = Router("sticky", {}, seed=1)
    sessions = [f"chat/s{k}" for k in range(30)]
    first = {s: router.pick(pool, pool, s).name for s in sessions}
    assert first == {s: sticky_target(s, ["w0", "w1", "w2"]) for s in sessions}
    assert {s: router.pick(pool, pool, s).name for s in sessions} == first
    assert len(set(first.values())) == 3
    # w1 down: its sessions go elsewhere, the others stay where they were
    up = [pool[0], pool[2]]
    moved = {s: router.pick(pool, up, s).name for s in sessions}
    for s in sessions:
        if first[s] == "w1":
            assert moved[s] in ("w0", "w2")
        else:
            assert moved[s] == first[s]
    # no session key: round robin
    assert [router.pick(pool, pool, None).name for _ in range(3)] == ["w0", "w1", "w2"]
