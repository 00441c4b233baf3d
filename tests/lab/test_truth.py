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

BASE: dict[str, float] = {
    "rho": 0.5,
    "rho_free": 0.5,
    "clock": 1.0,
    "cpu": False,
    "io": False,
    "memory": False,
    "interference": False,
    "batch_idle": 0.0,
    "down": 0.0,
}


@pytest.mark.parametrize(
    ("changes", "peers", "slow", "busy_peer", "policy", "expected"),
    [
        ({}, [0.5], False, False, "round_robin", ("balanced", "none")),
        # overloaded: memory first, even below the load threshold
        (
            {"rho": 0.5, "memory": True, "clock": 0.5},
            [0.5],
            False,
            False,
            "round_robin",
            ("overloaded", "memory_pressure"),
        ),
        (
            {"rho": 0.95, "memory": True, "clock": 0.5, "rho_free": 0.6},
            [0.95],
            True,
            False,
            "round_robin",
            ("overloaded", "memory_pressure"),
        ),
        # then a throttle that the card would cope without
        (
            {"rho": 0.95, "clock": 0.5, "rho_free": 0.6},
            [0.95, 0.9],
            True,
            False,
            "round_robin",
            ("overloaded", "throttling"),
        ),
        # ... but a card overloaded even at full clocks is not throttling's fault
        (
            {"rho": 0.95, "clock": 0.5, "rho_free": 0.9},
            [0.95, 0.2],
            False,
            False,
            "round_robin",
            ("overloaded", "routing_skew"),
        ),
        # class interference overloads a card below the load threshold
        (
            {"rho": 0.5, "interference": True},
            [0.5, 0.95],
            True,
            False,
            "round_robin",
            ("overloaded", "class_interference"),
        ),
        # every card overloaded: too little capacity, before blaming the slow card
        (
            {"rho": 0.9},
            [0.9, 0.86],
            True,
            False,
            "round_robin",
            ("overloaded", "capacity_shortage"),
        ),
        ({"rho": 0.9}, [0.9, 0.5], True, False, "round_robin", ("overloaded", "slow_card")),
        # a capacity-aware router should have spared the slow card: the routing is at fault
        (
            {"rho": 0.9},
            [0.9, 0.5],
            True,
            False,
            "least_connections",
            ("overloaded", "routing_skew"),
        ),
        (
            {"rho": 0.9, "interference": True},
            [0.9, 0.5],
            False,
            False,
            "round_robin",
            ("overloaded", "class_interference"),
        ),
        ({"rho": 0.9}, [0.9, 0.5], False, False, "round_robin", ("overloaded", "routing_skew")),
        # starved: a down worker first, then host, disk, batching, routing, demand
        (
            {"rho": 0.1, "down": 0.5, "cpu": True, "io": True},
            [0.1, 0.9],
            False,
            True,
            "round_robin",
            ("starved", "worker_crash"),
        ),
        (
            {"rho": 0.1, "down": 0.4, "cpu": True, "io": True},
            [0.1],
            False,
            True,
            "round_robin",
            ("starved", "host_bound"),
        ),
        (
            {"rho": 0.1, "io": True, "batch_idle": 0.9},
            [0.1],
            False,
            True,
            "round_robin",
            ("starved", "io_bound"),
        ),
        (
            {"rho": 0.1, "batch_idle": 0.5},
            [0.1],
            False,
            True,
            "round_robin",
            ("starved", "batch_delay"),
        ),
        (
            {"rho": 0.1, "batch_idle": 0.4},
            [0.1],
            False,
            True,
            "round_robin",
            ("starved", "routing_skew"),
        ),
        ({"rho": 0.1}, [0.1], False, False, "round_robin", ("starved", "low_demand")),
        # the thresholds themselves
        (
            {"rho": truth.OVERLOADED_RHO},
            [0.85, 0.1],
            False,
            False,
            "round_robin",
            ("overloaded", "routing_skew"),
        ),
        ({"rho": truth.STARVED_RHO}, [0.3], False, False, "round_robin", ("balanced", "none")),
    ],
)
def test_decision_order(
    changes: dict[str, float],
    peers: list[float],
    slow: bool,
    busy_peer: bool,
    policy: str,
    expected: tuple[str, str],
) -> None:
    v = {**BASE, **changes}
    assert truth._classify(v, peers, 0.5, 0.5, slow, busy_peer, policy) == expected


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
