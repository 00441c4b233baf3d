"""Ground truth (lab/truth.py): hand-computed loads, the decision order, trouble, routing shares.

Each test builds a small scenario in code with fixed token counts, so that every figure can be
worked out by hand from the service model: a request costs ``1 / requests_per_second`` of its
card at full batches, and ``rho`` is the window's requests times that cost over the window.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gpubalance.lab import output, traffic, truth
from gpubalance.lab.catalogue import CARDS
from gpubalance.lab.model.service import ServiceModel
from gpubalance.lab.routing import sticky_target
from gpubalance.lab.scenario import Plan, Scenario, plan
from gpubalance.lab.truth import TruthRow
from gpubalance.lab.workload import Request

PROMPT, OUTPUT, BATCH, WIDTH = 256, 64, 8, 30.0
SMALL = ServiceModel(CARDS["RTX 4090"], 1.0)


def spec(
    *,
    rate: float = 15.0,
    duration: float = 120.0,
    cards: tuple[str, ...] = ("RTX 4090",),
    cores: int = 16,
    disk_mb_per_second: float = 2000.0,
    worker: dict[str, Any] | None = None,
    router: dict[str, Any] | None = None,
    events: list[dict[str, Any]] | None = None,
    sessions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    source: dict[str, Any] = {
        "name": "chat",
        "class": "interactive",
        "arrivals": {"kind": "poisson", "rate": rate},
        "prompt_tokens": {"kind": "fixed", "value": PROMPT},
        "output_tokens": {"kind": "fixed", "value": OUTPUT},
    }
    if sessions:
        source["sessions"] = sessions
    return {
        "name": "test-truth",
        "description": "built by tests/lab/test_truth.py",
        "duration_seconds": duration,
        "truth_window_seconds": WIDTH,
        "hardware": {
            "host": {"cores": cores, "disk_mb_per_second": disk_mb_per_second},
            "gpus": [{"card": card} for card in cards],
        },
        "models": {"small": {"params_billions": 1.0}},
        "workers": [{"gpu": "all", "model": "small", "max_batch_size": BATCH, **(worker or {})}],
        "router": router or {},
        "traffic": [source],
        "events": events or [],
    }


def ground_truth(data: dict[str, Any], seed: int = 1) -> tuple[list[TruthRow], list[Request]]:
    p = build(data)
    requests = traffic.generate(p.scenario.traffic, p.scenario.duration_seconds, seed)
    return truth.compute(p, requests, p.scenario.duration_seconds), requests


def build(data: dict[str, Any]) -> Plan:
    return plan(Scenario.model_validate(data))


def arrived(requests: list[Request], row: TruthRow) -> int:
    return sum(row.t_start <= r.arrival_seconds < row.t_end for r in requests)


def rows_of(rows: list[TruthRow], gpu: int) -> list[TruthRow]:
    return [r for r in rows if r.gpu == gpu]


def cost(card: str = "RTX 4090", clock_ratio: float = 1.0) -> float:
    """GPU seconds one request takes at full batches."""
    model = ServiceModel(CARDS[card], 1.0)
    busy, _ = model.batch_timeline([PROMPT] * BATCH, [OUTPUT] * BATCH, clock_ratio)
    return busy / BATCH


# -- hand-computed loads ----------------------------------------------------------------------


def test_single_worker_rho_is_arrivals_times_cost_over_the_window(tmp_path: Path) -> None:
    rows, requests = ground_truth(spec(rate=15.0))
    assert [(r.t_start, r.t_end) for r in rows] == [(0, 30), (30, 60), (60, 90), (90, 120)]
    per_request = 1 / SMALL.requests_per_second(BATCH, PROMPT, OUTPUT)
    assert cost() == pytest.approx(per_request)
    for row in rows:
        expected = arrived(requests, row) * per_request / WIDTH
        assert row.rho == round(expected, 4)
        assert row.rho_unthrottled == row.rho and row.clock_ratio == 1.0
        assert (row.share_of_pool_work, row.capacity_share) == (1.0, 1.0)
        assert not (row.cpu_limited or row.io_limited)
        # a full batch of 320-token requests against the 4090's KV room
        assert 0 < row.memory_ratio < 0.1
        assert 0.3 < row.rho < 0.85 and (row.state, row.cause) == ("balanced", "none")
    # as truth_evidence.csv has it
    output.write_truth(tmp_path, rows)
    evidence = output.read_csv(tmp_path / "truth_evidence.csv")
    assert [float(e["rho"]) for e in evidence] == [r.rho for r in rows]
    assert output.read_csv(tmp_path / "truth.csv")[0] == {
        "t_start": "0",
        "t_end": "30",
        "gpu": "0",
        "state": "balanced",
        "cause": "none",
    }


def test_throttling_scales_prefill_by_r_and_decode_by_sqrt_r() -> None:
    data = spec(rate=20.0, events=[{"at": 30.0, "throttle": {"gpu": 0, "clock_ratio": 0.5}}])
    rows, requests = ground_truth(data)
    first, *throttled = rows
    assert first.clock_ratio == 1.0 and (first.state, first.cause) == ("balanced", "none")
    for row in throttled:
        n = arrived(requests, row)
        assert row.clock_ratio == 0.5
        assert row.rho == round(n * cost(clock_ratio=0.5) / WIDTH, 4)
        assert row.rho_unthrottled == round(n * cost() / WIDTH, 4)
        # the card would cope at full clocks: the throttle is the cause
        assert row.rho_unthrottled < truth.OVERLOADED_RHO <= row.rho
        assert (row.state, row.cause) == ("overloaded", "throttling")


def test_a_throttle_mid_window_counts_by_time() -> None:
    rows, _ = ground_truth(spec(events=[{"at": 40.0, "throttle": {"gpu": 0, "clock_ratio": 0.7}}]))
    assert [r.clock_ratio for r in rows] == [1.0, round((10 + 20 * 0.7) / 30, 4), 0.7, 0.7]


def test_windows_shorter_than_half_are_left_out() -> None:
    rows, _ = ground_truth(spec(duration=100.0))
    assert [(r.t_start, r.t_end) for r in rows] == [(0, 30), (30, 60), (60, 90)]
    rows, _ = ground_truth(spec(duration=110.0))
    assert rows[-1].t_end == 110.0


# -- the decision order -----------------------------------------------------------------------

FIGURES = truth._Figures(
    rho=0.5,
    rho_free=0.5,
    clock=1.0,
    cpu_limited=False,
    io_limited=False,
    memory=False,
    memory_ratio=0.0,
    batch_idle=0.0,
    interference=False,
    down=0.0,
)
VIEW = truth._View(
    share=0.5,
    capacity_share=0.5,
    slow=False,
    busy_peer=False,
    fair_rho=0.5,
    fair_rho_unthrottled=0.5,
)


@pytest.mark.parametrize(
    ("figures", "view", "policy", "expected"),
    [
        ({}, {}, "round_robin", ("balanced", "none")),
        # overloaded: memory first, even below the load threshold
        ({"memory": True, "clock": 0.5}, {}, "round_robin", ("overloaded", "memory_pressure")),
        (
            {"rho": 0.95, "memory": True, "clock": 0.5, "rho_free": 0.6},
            {"slow": True, "fair_rho": 0.95},
            "round_robin",
            ("overloaded", "memory_pressure"),
        ),
        # then a throttle that the card would cope without
        (
            {"rho": 0.95, "clock": 0.5, "rho_free": 0.6},
            {"slow": True, "fair_rho": 0.95},
            "round_robin",
            ("overloaded", "throttling"),
        ),
        # ... but a card overloaded even at full clocks is not throttling's fault
        (
            {"rho": 0.95, "clock": 0.5, "rho_free": 0.9},
            {"fair_rho": 0.6},
            "round_robin",
            ("overloaded", "routing_skew"),
        ),
        # a capacity-aware router gives the card more work at full clock: the fair split tells
        (
            {"rho": 0.9, "clock": 0.5, "rho_free": 0.6},
            {"fair_rho": 0.9, "fair_rho_unthrottled": 0.8},
            "least_connections",
            ("overloaded", "throttling"),
        ),
        (
            {"rho": 0.9, "clock": 0.5, "rho_free": 0.6},
            {"fair_rho": 0.9, "fair_rho_unthrottled": 0.85},
            "least_connections",
            ("overloaded", "capacity_shortage"),
        ),
        # class interference overloads a card below the load threshold
        (
            {"interference": True},
            {"slow": True, "fair_rho": 0.95},
            "round_robin",
            ("overloaded", "class_interference"),
        ),
        # no GPU that could take the work has room: too little capacity, before the slow card
        (
            {"rho": 0.9},
            {"slow": True, "fair_rho": 0.85},
            "round_robin",
            ("overloaded", "capacity_shortage"),
        ),
        ({"rho": 0.9}, {"slow": True}, "round_robin", ("overloaded", "slow_card")),
        # a capacity-aware router should have spared the slow card: the routing is at fault
        ({"rho": 0.9}, {"slow": True}, "least_connections", ("overloaded", "routing_skew")),
        (
            {"rho": 0.9, "interference": True},
            {},
            "round_robin",
            ("overloaded", "class_interference"),
        ),
        ({"rho": 0.9}, {}, "round_robin", ("overloaded", "routing_skew")),
        # starved: a down worker first, then host, disk, batching, routing, demand
        (
            {"rho": 0.1, "down": 0.5, "cpu_limited": True, "io_limited": True},
            {"busy_peer": True},
            "round_robin",
            ("starved", "worker_crash"),
        ),
        # down a third of the window, and fed while up (0.2 / (2/3) = 0.3)
        ({"rho": 0.2, "down": 1 / 3}, {}, "round_robin", ("starved", "worker_crash")),
        ({"rho": 0.1, "down": 1 / 3}, {}, "round_robin", ("starved", "low_demand")),
        (
            {"rho": 0.1, "down": 0.4, "cpu_limited": True, "io_limited": True},
            {"busy_peer": True},
            "round_robin",
            ("starved", "host_bound"),
        ),
        (
            {"rho": 0.1, "io_limited": True, "batch_idle": 0.9},
            {"busy_peer": True},
            "round_robin",
            ("starved", "io_bound"),
        ),
        (
            {"rho": 0.1, "batch_idle": 0.5},
            {"busy_peer": True},
            "round_robin",
            ("starved", "batch_delay"),
        ),
        (
            {"rho": 0.1, "batch_idle": 0.4},
            {"busy_peer": True, "fair_rho": 0.3},
            "round_robin",
            ("starved", "routing_skew"),
        ),
        # a busy peer, but a split by capacity would starve this GPU as well
        (
            {"rho": 0.1},
            {"busy_peer": True, "fair_rho": 0.29},
            "round_robin",
            ("starved", "low_demand"),
        ),
        ({"rho": 0.1}, {"fair_rho": 0.5}, "round_robin", ("starved", "low_demand")),
        # the thresholds themselves
        (
            {"rho": truth.OVERLOADED_RHO},
            {"fair_rho": 0.84},
            "round_robin",
            ("overloaded", "routing_skew"),
        ),
        ({"rho": truth.STARVED_RHO}, {}, "round_robin", ("balanced", "none")),
    ],
)
def test_decision_order(
    figures: dict[str, Any], view: dict[str, Any], policy: str, expected: tuple[str, str]
) -> None:
    v = dataclasses.replace(FIGURES, **figures)
    assert truth._classify(v, dataclasses.replace(VIEW, **view), policy) == expected


# -- each rule in a run that trips it, and in one that must not -----------------------------------
#
# The rules of lab/scenarios/README.md, "Decision, in this order", one by one. A GPU overloaded at
# its fair share of what the GPUs able to take its work can serve is short of capacity, not
# skewed: work that cannot go elsewhere (a peer is crashed, host- or disk-bound, or serves
# another model) says nothing against the router.

HOT = 0.95 / cost()  # requests per second that keep one RTX 4090 at rho 0.95


def worker(gpu: int, **keys: Any) -> dict[str, Any]:
    return {"gpu": gpu, "model": "small", "max_batch_size": BATCH, **keys}


def source(name: str, service_class: str, rate: float, prompt: int, output: int) -> dict[str, Any]:
    return {
        "name": name,
        "class": service_class,
        "arrivals": {"kind": "poisson", "rate": rate},
        "prompt_tokens": {"kind": "fixed", "value": prompt},
        "output_tokens": {"kind": "fixed", "value": output},
    }


def verdicts(rows: list[TruthRow], gpu: int) -> set[tuple[str, str]]:
    return {(r.state, r.cause) for r in rows_of(rows, gpu)}


def test_memory_pressure_needs_a_full_batch_near_the_kv_region_and_a_busy_worker() -> None:
    # a full batch of 8 requests of 320 tokens x 128 KiB: 320 MiB of a 358 MiB region
    busy, _ = ground_truth(spec(rate=20.0, worker={"kv_cache_gib": 0.35}))
    assert all(r.memory_ratio >= truth.MEMORY_RATIO for r in busy)
    assert all(r.rho < truth.OVERLOADED_RHO for r in busy)
    assert verdicts(busy, 0) == {("overloaded", "memory_pressure")}
    # the same region at half the traffic: batches that big rarely form
    quiet, _ = ground_truth(spec(rate=10.0, worker={"kv_cache_gib": 0.35}))
    assert all(r.memory_ratio >= truth.MEMORY_RATIO for r in quiet)
    assert all(truth.STARVED_RHO <= r.rho < truth.MEMORY_BUSY_RHO for r in quiet)
    assert verdicts(quiet, 0) == {("balanced", "none")}


def test_a_throttled_card_overloaded_even_at_full_clock_is_not_throttling() -> None:
    # (test_throttling_scales_prefill_by_r_and_decode_by_sqrt_r trips the rule)
    data = spec(rate=1.1 * HOT, events=[{"at": 0.0, "throttle": {"gpu": 0, "clock_ratio": 0.8}}])
    rows, _ = ground_truth(data)
    assert all(r.clock_ratio == 0.8 and r.rho_unthrottled >= truth.OVERLOADED_RHO for r in rows)
    assert verdicts(rows, 0) == {("overloaded", "capacity_shortage")}


@pytest.mark.parametrize(("load", "expected"), [(0.9, "throttling"), (1.2, "capacity_shortage")])
def test_a_throttle_behind_a_capacity_aware_router_is_the_cause_only_if_lifting_it_helps(
    load: float, expected: str
) -> None:
    # least connections already gives the throttled card less work; at full clock it would
    # get more. Both cards at rho ~0.9: lifting the throttle brings them to ~0.75; at ~1.2, to
    # ~1.0, still overloaded
    capacity = 1 / cost() + 1 / cost(clock_ratio=0.5)
    throttle = [{"at": 0.0, "throttle": {"gpu": 1, "clock_ratio": 0.5}}]
    data = spec(
        rate=load * capacity,
        cards=("RTX 4090", "RTX 4090"),
        router={"policy": "least_connections"},
        events=throttle,
    )
    rows, _ = ground_truth(data)
    for row in rows_of(rows, 1):
        assert row.rho_unthrottled < truth.OVERLOADED_RHO <= row.rho
    assert verdicts(rows, 1) == {("overloaded", expected)}
    assert verdicts(rows, 0) == {("overloaded", "capacity_shortage")}


def test_class_interference_is_costly_batch_jobs_in_the_queue_of_chat() -> None:
    jobs = source("jobs", "batch", 1.0, 4000, 256)  # each ~6x the cost of a chat request
    mixed = spec(rate=6.0)
    mixed["traffic"].append(jobs)
    rows, _ = ground_truth(mixed)
    assert all(r.rho < truth.OVERLOADED_RHO for r in rows)
    assert verdicts(rows, 0) == {("overloaded", "class_interference")}
    # the same requests with the jobs in a pool of their own, on a second card
    apart = spec(rate=6.0, cards=("RTX 4090", "RTX 4090"), router={"pools": {"batch": "jobs"}})
    apart["workers"] = [worker(0), worker(1, pool="jobs")]
    apart["traffic"].append(jobs)
    rows, _ = ground_truth(apart)
    assert verdicts(rows, 0) == verdicts(rows, 1) == {("starved", "low_demand")}


def other_gpu(case: str) -> tuple[dict[str, Any], tuple[str, str]]:
    """Two cards, GPU 0 at rho ~0.95 of its own share, and why GPU 1 cannot take any of it."""
    two = ("RTX 4090", "RTX 4090")
    if case == "overloaded as well":
        return spec(rate=2 * HOT, cards=two), ("overloaded", "capacity_shortage")
    if case == "host-bound":
        data = spec(rate=2 * HOT, cards=two)
        data["workers"] = [worker(0), worker(1, preprocess={"cpu_ms": 1000.0})]
        return data, ("starved", "host_bound")
    if case == "disk-bound":
        data = spec(rate=2 * HOT, cards=two, disk_mb_per_second=100.0)
        data["workers"] = [worker(0), worker(1, io_mb_per_request=20.0)]
        return data, ("starved", "io_bound")
    if case == "crashed":
        crash = [{"at": 0.0, "worker_crash": {"worker": "w1"}}]
        return spec(rate=HOT, cards=two, events=crash), ("starved", "worker_crash")
    if case == "a faster card, host-bound":
        rate = 2 * 0.95 / cost("RTX 4070 Ti")
        data = spec(rate=rate, cards=("RTX 4070 Ti", "RTX 4090"))
        data["workers"] = [worker(0), worker(1, preprocess={"cpu_ms": 1000.0})]
        return data, ("starved", "host_bound")
    if case == "serving another model":
        data = spec(rate=HOT, cards=two)
        data["models"]["other"] = {"params_billions": 1.0}
        data["workers"] = [worker(0), {**worker(1, pool="other"), "model": "other"}]
        return data, ("starved", "low_demand")
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "overloaded as well",
        "host-bound",
        "disk-bound",
        "crashed",
        "a faster card, host-bound",
        "serving another model",
    ],
)
def test_overloaded_at_its_share_with_no_gpu_to_take_the_work_is_capacity_shortage(
    case: str,
) -> None:
    data, other = other_gpu(case)
    rows, _ = ground_truth(data)
    assert all(r.fair_rho >= truth.OVERLOADED_RHO for r in rows_of(rows, 0))
    assert verdicts(rows, 0) == {("overloaded", "capacity_shortage")}
    assert verdicts(rows, 1) == {other}


def test_overloaded_with_an_idle_card_of_its_model_in_another_pool_is_routing_skew() -> None:
    # pools are the router's choice: the idle card could serve the work
    data, _ = other_gpu("serving another model")
    data["workers"][1]["model"] = "small"
    rows, _ = ground_truth(data)
    assert all(r.fair_rho < truth.OVERLOADED_RHO for r in rows_of(rows, 0))
    assert verdicts(rows, 0) == {("overloaded", "routing_skew")}
    # alone in its pool, the idle card has no busy peer
    assert verdicts(rows, 1) == {("starved", "low_demand")}


def test_a_weighted_default_target_is_routing_skew_on_both_sides() -> None:
    data = spec(
        rate=1.1 * HOT,
        cards=("RTX 4090", "RTX 4090"),
        router={"policy": "weighted_round_robin", "weights": {"w0": 10.0, "w1": 1.0}},
    )
    rows, _ = ground_truth(data)
    assert verdicts(rows, 0) == {("overloaded", "routing_skew")}
    # the work exists, went to the peer, and half of it would feed this GPU
    assert all(r.fair_rho >= truth.STARVED_RHO for r in rows_of(rows, 1))
    assert verdicts(rows, 1) == {("starved", "routing_skew")}


def test_a_slow_card_is_not_slow_card_when_it_gets_no_more_than_its_capacity_share() -> None:
    # (test_round_robin_overloads_the_slow_card trips the rule.) Weights that give the 4070 Ti
    # a little less than its capacity share overload both cards of the pool, while a third
    # card of the same model idles in another pool: the split between pools is at fault
    weight = cost("RTX 4070 Ti") / cost() * 1.1
    data = spec(
        rate=0.95 * (1 / cost() + 1 / cost("RTX 4070 Ti")),
        cards=("RTX 4090", "RTX 4070 Ti", "RTX 4090"),
        router={"policy": "weighted_round_robin", "weights": {"w0": weight, "w1": 1.0}},
    )
    data["workers"] = [worker(0), worker(1), worker(2, pool="spare")]
    rows, _ = ground_truth(data)
    for row in rows_of(rows, 1):
        assert row.share_of_pool_work < row.capacity_share
        assert row.fair_rho < truth.OVERLOADED_RHO
    assert verdicts(rows, 1) == {("overloaded", "routing_skew")}


def test_a_capacity_aware_router_keeps_the_slow_card_balanced() -> None:
    rows, _ = ground_truth(
        spec(rate=28.0, cards=("RTX 4090", "RTX 4070 Ti"), router={"policy": "least_connections"})
    )
    assert verdicts(rows, 0) == verdicts(rows, 1) == {("balanced", "none")}


def test_class_interference_names_a_mixed_queue_the_router_overloads() -> None:
    # over the threshold, after capacity shortage and the slow card: GPU 1 has room
    weights = {"policy": "weighted_round_robin", "weights": {"w0": 3.0, "w1": 1.0}}
    costly = spec(rate=12.0, cards=("RTX 4090", "RTX 4090"), router=weights)
    costly["traffic"].append(source("jobs", "batch", 2.5, 4000, 256))
    rows, _ = ground_truth(costly)
    assert all(r.rho >= truth.OVERLOADED_RHO > r.fair_rho for r in rows_of(rows, 0))
    assert verdicts(rows, 0) == {("overloaded", "class_interference")}
    # jobs as cheap as chat: the same weights only skew the work
    cheap = spec(rate=1.5 * HOT, cards=("RTX 4090", "RTX 4090"), router=weights)
    cheap["traffic"].append(source("jobs", "batch", 1.5, PROMPT, OUTPUT))
    rows, _ = ground_truth(cheap)
    assert verdicts(rows, 0) == {("overloaded", "routing_skew")}


def test_a_worker_down_part_of_a_window_is_the_cause_only_if_up_it_would_be_fed() -> None:
    # (test_worker_crash_starves_its_gpu_until_the_restart trips the rule at down >= 0.5.)
    # w1 is down 10 s of [60, 90), so it gets 0.4 of the requests instead of 0.5
    crash = [{"at": 70.0, "worker_crash": {"worker": "w1", "restart_after_seconds": 10.0}}]
    two = ("RTX 4090", "RTX 4090")
    fed, _ = ground_truth(spec(rate=20.0, cards=two, events=crash))
    window = rows_of(fed, 1)[2]
    assert window.down_share == round(1 / 3, 4)
    assert window.rho < truth.STARVED_RHO <= window.rho / (1 - 1 / 3)
    assert (window.state, window.cause) == ("starved", "worker_crash")
    trickle, _ = ground_truth(spec(rate=10.0, cards=two, events=crash))
    window = rows_of(trickle, 1)[2]
    assert window.rho / (1 - 1 / 3) < truth.STARVED_RHO
    assert (window.state, window.cause) == ("starved", "low_demand")


def test_enough_preprocessing_threads_are_not_host_bound() -> None:
    # (test_host_cpu_caps_the_load_that_reaches_the_gpu trips the rule with one thread)
    rows, _ = ground_truth(spec(rate=15.0, worker={"preprocess": {"cpu_ms": 200.0, "threads": 4}}))
    assert not any(r.cpu_limited for r in rows)
    assert verdicts(rows, 0) == {("balanced", "none")}


def test_a_disk_fast_enough_is_not_io_bound() -> None:
    # (test_disk_bandwidth_caps_the_load_that_reaches_the_gpu trips the rule at 100 MB/s)
    data = spec(rate=15.0, disk_mb_per_second=400.0, worker={"io_mb_per_request": 20.0})
    rows, _ = ground_truth(data)
    assert not any(r.io_limited for r in rows)
    assert verdicts(rows, 0) == {("balanced", "none")}


def test_batch_delay_is_a_gpu_idling_while_its_batch_fills() -> None:
    waits = spec(rate=5.0, worker={"max_batch_size": 32, "max_queue_delay_ms": 2000.0})
    rows, _ = ground_truth(waits)
    assert all(r.batch_idle_share >= truth.BATCH_IDLE_SHARE for r in rows)
    assert verdicts(rows, 0) == {("starved", "batch_delay")}
    rows, _ = ground_truth(spec(rate=5.0, worker={"max_batch_size": 32}))
    assert all(r.batch_idle_share == 0.0 for r in rows)
    assert verdicts(rows, 0) == {("starved", "low_demand")}


def test_a_peer_busy_with_its_own_throttle_does_not_make_starvation_routing_skew() -> None:
    # round robin, 4 requests/s each: GPU 1 at 8 % of its clock is busy, GPU 0 starved,
    # and a split by capacity would leave it starved too (test_a_weighted_default_target_...
    # trips the rule)
    throttle = [{"at": 0.0, "throttle": {"gpu": 1, "clock_ratio": 0.08}}]
    rows, _ = ground_truth(spec(rate=8.0, cards=("RTX 4090", "RTX 4090"), events=throttle))
    for row in rows_of(rows, 0):
        peer = next(r for r in rows_of(rows, 1) if r.t_start == row.t_start)
        assert peer.rho >= truth.BUSY_PEER_RHO
        assert row.fair_rho < truth.STARVED_RHO
    assert verdicts(rows, 0) == {("starved", "low_demand")}


def test_low_demand_is_a_lone_gpu_with_little_work() -> None:
    rows, _ = ground_truth(spec(rate=5.0))
    assert verdicts(rows, 0) == {("starved", "low_demand")}


# -- trouble ----------------------------------------------------------------------------------


def test_lost_gpu_has_no_rows_from_the_window_it_was_lost_in() -> None:
    data = spec(
        rate=20.0, cards=("RTX 4090", "RTX 4090"), events=[{"at": 45.0, "gpu_lost": {"gpu": 1}}]
    )
    rows, requests = ground_truth(data)
    assert [r.t_start for r in rows_of(rows, 1)] == [0.0]
    survivor = rows_of(rows, 0)
    assert [r.t_start for r in survivor] == [0.0, 30.0, 60.0, 90.0]
    # round robin over what is up: the lost GPU took its share for half of [30, 60)
    assert survivor[0].rho == round(arrived(requests, survivor[0]) / 2 * cost() / WIDTH, 4)
    assert survivor[1].rho == round(arrived(requests, survivor[1]) * 2 / 3 * cost() / WIDTH, 4)
    for row in survivor[2:]:
        assert row.rho == round(arrived(requests, row) * cost() / WIDTH, 4)
        assert row.share_of_pool_work == 1.0


def test_worker_crash_starves_its_gpu_until_the_restart() -> None:
    data = spec(
        rate=20.0,
        duration=150.0,
        cards=("RTX 4090", "RTX 4090"),
        events=[{"at": 30.0, "worker_crash": {"worker": "w1", "restart_after_seconds": 45.0}}],
    )
    rows, requests = ground_truth(data)
    crashed = rows_of(rows, 1)
    assert [(r.state, r.cause) for r in crashed] == [
        ("balanced", "none"),
        ("starved", "worker_crash"),  # down the whole window
        ("starved", "worker_crash"),  # up for the last 15 s of 30: down half the window
        ("balanced", "none"),
        ("balanced", "none"),
    ]
    assert crashed[1].rho == 0.0
    # [60, 90): up a third of the time the survivor is, so a third of the work
    assert crashed[2].rho == round(arrived(requests, crashed[2]) / 3 * cost() / WIDTH, 4)
    survivor = rows_of(rows, 0)
    assert survivor[1].rho == round(arrived(requests, survivor[1]) * cost() / WIDTH, 4)
    assert survivor[1].share_of_pool_work == 1.0 and crashed[1].share_of_pool_work == 0.0


def test_host_cpu_caps_the_load_that_reaches_the_gpu() -> None:
    # one preprocessing thread, 200 ms per request, 15 requests/s: a third gets through
    rows, requests = ground_truth(spec(rate=15.0, worker={"preprocess": {"cpu_ms": 200.0}}))
    for row in rows:
        n = arrived(requests, row)
        factor = WIDTH / (n * 0.2)
        assert row.cpu_limited and not row.io_limited
        assert row.rho == round(factor * n * cost() / WIDTH, 4)
        assert (row.state, row.cause) == ("starved", "host_bound")


def test_cores_shared_by_more_threads_than_there_are_cap_each_worker() -> None:
    # 2 workers with 4 threads each on 2 cores: a core each, 30 ms per request, 20 requests/s
    # each: 0.6 of a core needed, no cap; at 80 ms, 1.6 needed, capped at 1
    base = spec(rate=40.0, cores=2, cards=("RTX 4090", "RTX 4090"))
    fits = copy.deepcopy(base)
    fits["workers"][0]["preprocess"] = {"cpu_ms": 30.0, "threads": 4}
    capped = copy.deepcopy(base)
    capped["workers"][0]["preprocess"] = {"cpu_ms": 80.0, "threads": 4}
    rows_fit, _ = ground_truth(fits)
    rows_capped, requests = ground_truth(capped)
    assert not any(r.cpu_limited for r in rows_fit)
    for row in rows_capped:
        n = arrived(requests, row) / 2
        factor = WIDTH * 1.0 / (n * 0.08)
        assert row.cpu_limited
        assert row.rho == round(factor * n * cost() / WIDTH, 4)


def test_disk_bandwidth_caps_the_load_that_reaches_the_gpu() -> None:
    # 20 MB per request at 100 MB/s: 5 requests/s for the host, 15 arrive
    data = spec(rate=15.0, disk_mb_per_second=100.0, worker={"io_mb_per_request": 20.0})
    rows, requests = ground_truth(data)
    for row in rows:
        n = arrived(requests, row)
        factor = WIDTH / (n * 20.0 / 100.0)
        assert row.io_limited and not row.cpu_limited
        assert row.rho == round(factor * n * cost() / WIDTH, 4)
        assert (row.state, row.cause) == ("starved", "io_bound")


# -- routing shares -----------------------------------------------------------------------------

MIXED = ("RTX 4090", "RTX 3090", "RTX 4070 Ti")


@pytest.mark.parametrize("policy", ["least_connections", "random_of_2", "pooled"])
def test_capacity_aware_policies_share_work_by_capacity(policy: str) -> None:
    rows, _ = ground_truth(spec(rate=30.0, cards=MIXED, router={"policy": policy}))
    capacity = [1 / cost(card) for card in MIXED]
    for start in (0.0, 30.0, 60.0, 90.0):
        window = sorted((r for r in rows if r.t_start == start), key=lambda r: r.gpu)
        for row, c in zip(window, capacity, strict=True):
            assert row.share_of_pool_work == pytest.approx(c / sum(capacity), abs=1e-4)
            assert row.capacity_share == row.share_of_pool_work
        # shares by capacity leave every card about as busy
        assert max(r.rho for r in window) - min(r.rho for r in window) < 0.01


def test_least_connections_weights_send_a_server_its_weight_times_its_capacity_share() -> None:
    # HAProxy's leastconn evens out in flight per unit of weight: w0 weighted 3 holds three
    # times the requests of w1 on a like card, so it is sent three times the work (0.75 of a
    # load of 0.5 per card: rho 0.75), until that would put it past rho 1
    two = ("RTX 4090", "RTX 4090")
    weighted = {"policy": "least_connections", "weights": {"w0": 3.0, "w1": 1.0}}
    rows, _ = ground_truth(spec(rate=1.0 / cost(), cards=two, router=weighted))
    for hot, cold in zip(rows_of(rows, 0), rows_of(rows, 1), strict=True):
        assert hot.share_of_pool_work == pytest.approx(0.75, abs=1e-4)
        assert hot.capacity_share == pytest.approx(0.5, abs=1e-4)
        assert hot.rho == pytest.approx(3 * cold.rho, rel=1e-3)
    # more work: w0 is sent what keeps it at rho 1, w1 the rest
    rows, _ = ground_truth(spec(rate=1.6 / cost(), cards=two, router=weighted))
    for hot, cold in zip(rows_of(rows, 0), rows_of(rows, 1), strict=True):
        assert hot.rho == pytest.approx(1.0, abs=1e-3)
        assert hot.share_of_pool_work > 0.5 > cold.share_of_pool_work
        assert (hot.state, hot.cause) == ("overloaded", "routing_skew")
        assert (cold.state, cold.cause) == ("balanced", "none")


def test_least_connections_with_like_weights_or_too_much_work_shares_by_capacity() -> None:
    # equal weights: by capacity, as ever; past what the pool serves, every server is full
    # and the shares are by capacity whatever the weights
    full = 2.0 * (1 / cost() + 1 / cost("RTX 4070 Ti"))
    for rate, weights in ((28.0, {"w0": 1.0, "w1": 1.0}), (full, {"w0": 5.0, "w1": 1.0})):
        router = {"policy": "least_connections", "weights": weights}
        rows, _ = ground_truth(spec(rate=rate, cards=("RTX 4090", "RTX 4070 Ti"), router=router))
        for row in rows:
            assert row.share_of_pool_work == pytest.approx(row.capacity_share, abs=1e-4)


def test_round_robin_overloads_the_slow_card() -> None:
    rows, _ = ground_truth(spec(rate=28.0, cards=("RTX 4090", "RTX 4070 Ti")))
    for start in (0.0, 30.0, 60.0, 90.0):
        fast, slow = sorted((r for r in rows if r.t_start == start), key=lambda r: r.gpu)
        assert fast.share_of_pool_work == pytest.approx(0.5, abs=0.01)
        assert slow.capacity_share < 0.4
        assert (fast.state, fast.cause) == ("balanced", "none")
        assert (slow.state, slow.cause) == ("overloaded", "slow_card")


def test_weighted_round_robin_shares_follow_the_weights() -> None:
    data = spec(
        rate=20.0,
        cards=("RTX 4090", "RTX 4090"),
        router={"policy": "weighted_round_robin", "weights": {"w0": 3.0, "w1": 1.0}},
    )
    rows, _ = ground_truth(data)
    assert {r.share_of_pool_work for r in rows_of(rows, 0)} == {0.75}
    assert {r.share_of_pool_work for r in rows_of(rows, 1)} == {0.25}


def sticky_counts(requests: list[Request], row: TruthRow, names: list[str]) -> Counter[str]:
    return Counter(
        sticky_target(r.session, names)
        for r in requests
        if row.t_start <= r.arrival_seconds < row.t_end and r.session is not None
    )


def test_sticky_shares_follow_the_session_keys() -> None:
    names = ["w0", "w1", "w2"]
    data = spec(
        rate=20.0,
        cards=("RTX 4090",) * 3,
        router={"policy": "sticky"},
        sessions={"count": 12, "skew": 1.0},
    )
    rows, requests = ground_truth(data)
    for row in rows:
        counts = sticky_counts(requests, row, names)
        total = sum(counts.values())
        assert row.share_of_pool_work == round(counts[f"w{row.gpu}"] / total, 4)
        assert row.rho == round(counts[f"w{row.gpu}"] * cost() / WIDTH, 4)
    # hot sessions: the shares are far from even
    shares = [r.share_of_pool_work for r in rows if r.t_start == 0.0]
    assert max(shares) - min(shares) > 0.1


@pytest.mark.parametrize(
    "trouble",
    [
        {"events": [{"at": 0.0, "worker_crash": {"worker": "w0"}}]},
        # a weight of 0 takes a worker out of rotation, sticky or not (as the fast speed does)
        {"router": {"policy": "sticky", "weights": {"w0": 0.0}}},
    ],
)
def test_sticky_sessions_of_an_unavailable_worker_spread_over_the_others(
    trouble: dict[str, Any],
) -> None:
    names = ["w0", "w1", "w2"]
    data = spec(
        rate=20.0,
        cards=("RTX 4090",) * 3,
        router={"policy": "sticky"},
        sessions={"count": 12, "skew": 1.0},
    )
    data.update(trouble)
    rows, requests = ground_truth(data)
    assert not rows_of(rows, 0) or all(r.rho == 0.0 for r in rows_of(rows, 0))
    for row in rows_of(rows, 1) + rows_of(rows, 2):
        counts = sticky_counts(requests, row, names)
        mine = counts[f"w{row.gpu}"] + counts["w0"] / 2
        assert row.rho == round(mine * cost() / WIDTH, 4)


# -- a function of the plan and the requests ------------------------------------------------------


def test_truth_depends_only_on_plan_and_requests() -> None:
    data = spec(
        rate=20.0,
        cards=MIXED,
        router={"policy": "least_connections"},
        worker={"preprocess": {"cpu_ms": 40.0}},
        events=[{"at": 50.0, "throttle": {"gpu": 1, "clock_ratio": 0.6}}],
    )
    p = build(data)
    requests = traffic.generate(p.scenario.traffic, 120.0, 3)
    first = truth.compute(p, requests, 120.0)
    assert truth.compute(p, list(requests), 120.0) == first
    # the scenario's seed and anything the run does afterwards play no part
    reseeded = build({**data, "seed": 99})
    assert truth.compute(reseeded, [dataclasses.replace(r) for r in requests], 120.0) == first
    other = traffic.generate(p.scenario.traffic, 120.0, 4)
    assert truth.compute(p, other, 120.0) != first
