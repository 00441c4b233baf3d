"""plan() and guard() over hand-made and generated HAProxy states: no HAProxy needed.

The generated states check the reconcile property itself: a state that already shows what the
recommendations ask plans nothing, and applying each plan then planning again reaches that
state, every weight moving one way only (no oscillation), within a bounded number of passes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from gpubalance.controller.guard import guard
from gpubalance.controller.model import (
    Applied,
    Change,
    Observed,
    ObservedServer,
    Settings,
)
from gpubalance.controller.plan import plan, plan_moves
from gpubalance.diagnosis import ExpectedEffect, Recommendation

NOW = 1_800_000_000.0


def server(
    name: str,
    backend: str = "be",
    *,
    admin: str = "ready",
    weight: int = 100,
    up: bool = True,
    sessions: int = 0,
) -> ObservedServer:
    return ObservedServer(backend, name, admin, weight, 100, up, sessions)  # type: ignore[arg-type]


def observed(*servers: ObservedServer, at: float = NOW) -> Observed:
    return Observed(at_seconds=at, servers={s.key: s for s in servers})


def rec(
    rec_id: str,
    action: str,
    target: str,
    parameters: Mapping[str, object] | None = None,
    *,
    created: float = NOW - 5,
    expires: float = NOW + 600,
    observed: float | None = None,
    cost_rank: int = 0,
    host: str = "h1",
    expected: ExpectedEffect | None = None,
) -> Recommendation:
    return Recommendation(
        id=rec_id,
        action=action,  # type: ignore[arg-type]
        host=host,
        target=target,
        parameters=parameters or {},
        reason="test",
        evidence=(),
        confidence=0.9,
        created_seconds=created,
        expires_seconds=expires,
        expected=expected,
        cost_rank=cost_rank,
        observed_seconds=observed,
    )


def apply(state: Observed, changes: Sequence[Change]) -> Observed:
    """What HAProxy shows a pass after the changes: a drained server's sessions have finished."""
    servers = {
        k: replace(s, sessions=0) if s.admin == "drain" else s for k, s in state.servers.items()
    }
    for change in changes:
        s = servers[change.key]
        if change.kind == "set_weight":
            servers[change.key] = replace(s, weight=change.value)  # type: ignore[arg-type]
        else:
            servers[change.key] = replace(s, admin=change.value, sessions=0)  # type: ignore[arg-type]
    return Observed(state.at_seconds, servers, state.algorithms)


SETTINGS = Settings(max_weight_step=32)


def test_set_weights_steps_toward_the_target_by_the_bounded_step() -> None:
    state = observed(server("s1", weight=100), server("s2", weight=100))
    result = plan(
        state, [rec("r1", "set_weights", "be", {"weights": {"s1": 10, "s2": 200}})], (), SETTINGS
    )
    assert [(c.server, c.value, c.before) for c in result.changes] == [
        ("s1", 68, 100),
        ("s2", 132, 100),
    ]
    assert result.refusals == () and result.converged == ()


def test_converged_recommendations_plan_nothing_and_are_reported_met() -> None:
    state = observed(server("s1", weight=10), server("s2", admin="drain"))
    recs = [rec("r1", "set_weights", "be", {"weights": {"s1": 10}}), rec("r2", "drain", "be/s2")]
    result = plan(state, recs, (), SETTINGS)
    assert result.changes == () and result.refusals == ()
    assert result.converged == ("r1", "r2")


def test_a_situation_that_held_long_on_fresh_telemetry_is_not_stale() -> None:
    """A scale-in rests on many windows of low demand: it began long ago, and its newest
    window ended a moment ago."""
    recommendation = rec("r", "drain", "be/s1", created=NOW - 900, observed=NOW - 5)
    result = plan(observed(server("s1"), server("s2")), [recommendation], (), SETTINGS)
    assert result.refusals == ()
    assert [(c.key, c.kind) for c in result.changes] == [("be/s1", "set_state")]


@pytest.mark.parametrize(
    ("recommendation", "reason"),
    [
        (rec("r", "drain", "be/s1", expires=NOW - 1), "expired"),
        (rec("r", "drain", "be/s1", created=NOW - 301), "stale"),
        (rec("r", "drain", "be/s1", created=NOW - 900, observed=NOW - 301), "stale"),
        (rec("r", "drain", "be/nope"), "unknown_target"),
        (rec("r", "drain", "s1"), "unknown_target"),
        (rec("r", "set_weights", "other", {"weights": {"s1": 1}}), "unknown_target"),
        (rec("r", "set_weights", "be", {"weights": {"zz": 1}}), "unknown_target"),
        (rec("r", "set_weights", "be", {"weights": {"s1": 300}}), "bad_parameters"),
        (rec("r", "set_weights", "be", {"weights": {"s1": "9"}}), "bad_parameters"),
        (rec("r", "set_weights", "be", {"weights": {"s1": True}}), "bad_parameters"),
        (rec("r", "set_weights", "be", {}), "bad_parameters"),
        (rec("r", "move_worker", "gpu:2"), "unsupported_action"),
    ],
)
def test_bad_recommendations_are_rejected_with_the_reason(
    recommendation: Recommendation, reason: str
) -> None:
    result = plan(observed(server("s1"), server("s2")), [recommendation], (), SETTINGS)
    assert result.changes == ()
    [refusal] = result.refusals
    assert (refusal.recommendation_id, refusal.reason, refusal.ack) == ("r", reason, "rejected")
    assert refusal.detail


def test_another_hosts_recommendations_are_left_alone() -> None:
    result = plan(
        observed(server("s1"), server("s2")),
        [rec("r", "drain", "be/s1", host="h2")],
        (),
        replace(SETTINGS, host="h1"),
    )
    assert result == type(result)()


def test_contradictory_recommendations_are_both_rejected_and_agreeing_ones_change_once() -> None:
    state = observed(server("s1"), server("s2"), server("s3"))
    recs = [
        rec("a", "set_weights", "be", {"weights": {"s1": 50, "s2": 90}}),
        rec("b", "set_weights", "be", {"weights": {"s1": 80}}),
        rec("c", "drain", "be/s3"),
        rec("d", "drain", "be/s3"),
    ]
    result = plan(state, recs, (), SETTINGS)
    assert {(r.recommendation_id, r.reason) for r in result.refusals} == {
        ("a", "contradictory"),
        ("b", "contradictory"),
    }
    assert [(c.key, c.value) for c in result.changes] == [("be/s3", "drain")]


def test_the_cheapest_rung_goes_first_within_a_backend() -> None:
    state = observed(server("s1"), server("s2"))
    recs = [
        rec("weights", "set_weights", "be", {"weights": {"s1": 80}}, cost_rank=0),
        rec("drain", "drain", "be/s2", cost_rank=1),
    ]
    first = plan(state, recs, (), SETTINGS)
    assert [c.recommendation_id for c in first.changes] == ["weights"]
    assert [(r.recommendation_id, r.reason, r.ack) for r in first.refusals] == [
        ("drain", "ladder", None)
    ]
    second = plan(apply(state, first.changes), recs, (), SETTINGS)
    assert [c.recommendation_id for c in second.changes] == ["drain"]


def test_remove_worker_drains_first_and_enters_maint_once_sessions_reach_zero() -> None:
    recs = [rec("r", "remove_worker", "be/s1")]
    first = plan(observed(server("s1", sessions=3), server("s2")), recs, (), SETTINGS)
    assert [(c.kind, c.value) for c in first.changes] == [("set_state", "drain")]

    draining = observed(server("s1", admin="drain", sessions=3), server("s2"))
    history = [Applied(NOW - 10, "be/s1", "r", "drain")]
    waits = plan(draining, recs, history, SETTINGS)
    assert waits.changes == ()
    assert [(r.reason, r.ack) for r in waits.refusals] == [("draining", None)]

    late = plan(replace(draining, at_seconds=NOW + 200), recs, history, SETTINGS)
    assert [(r.reason, r.ack) for r in late.refusals] == [("drain_timeout", "failed")]

    drained = observed(server("s1", admin="drain", sessions=0), server("s2"))
    last = plan(drained, recs, history, SETTINGS)
    assert [(c.kind, c.value) for c in last.changes] == [("set_state", "maint")]


def _random_state(rng: random.Random) -> Observed:
    servers = []
    for b in range(rng.randint(1, 3)):
        for s in range(rng.randint(1, 5)):
            servers.append(
                server(
                    f"s{s}",
                    f"be{b}",
                    admin=rng.choice(["ready", "ready", "drain", "maint"]),
                    weight=rng.randint(0, 256),
                    sessions=rng.choice([0, 0, 2]),
                )
            )
    return observed(*servers)


def _random_recommendations(rng: random.Random, state: Observed) -> list[Recommendation]:
    """At most one weight and one admin recommendation per server: none contradict."""
    recs = []
    for backend in sorted(state.backends):
        pool = state.pool(backend)
        chosen = rng.sample(pool, rng.randint(0, len(pool)))
        if chosen:
            weights = {s.server: rng.randint(0, 256) for s in chosen}
            recs.append(rec(f"w-{backend}", "set_weights", backend, {"weights": weights}))
        for s in rng.sample(pool, rng.randint(0, len(pool))):
            action = rng.choice(["drain", "remove_worker", "add_worker"])
            recs.append(rec(f"{action}-{s.key}", action, s.key, cost_rank=rng.randint(0, 2)))
    return recs


@pytest.mark.parametrize("seed", range(300))
def test_generated_states_converge_without_oscillating(seed: int) -> None:
    rng = random.Random(seed)
    state = _random_state(rng)
    recs = _random_recommendations(rng, state)
    # a ramp of 256 by the step, drain then maint, and three rungs of the ladder
    bound = 3 * (math.ceil(256 / SETTINGS.max_weight_step) + 2)
    direction: dict[str, int] = {}
    for _ in range(bound):
        result = plan(state, recs, (), SETTINGS)
        assert all(r.ack is None for r in result.refusals), result.refusals
        if not result.changes and not result.refusals:
            break
        for change in result.changes:
            if change.kind == "set_weight":
                sign = 1 if change.value > change.before else -1  # type: ignore[operator]
                assert direction.setdefault(change.key, sign) == sign, "weight reversed"
        state = apply(state, result.changes)
    else:
        pytest.fail(f"no convergence within {bound} passes")
    # converged: planning again gives nothing, and every recommendation is met
    again = plan(state, recs, (), SETTINGS)
    assert again.changes == () and again.refusals == ()
    assert set(again.converged) == {r.id for r in recs}


@pytest.mark.parametrize("seed", range(100))
def test_generated_converged_states_plan_nothing(seed: int) -> None:
    rng = random.Random(1000 + seed)
    state = _random_state(rng)
    recs = []
    for s in state.servers.values():
        recs.append(rec(f"w-{s.key}", "set_weights", s.backend, {"weights": {s.server: s.weight}}))
        if s.admin == "drain":
            recs.append(rec(f"d-{s.key}", "drain", s.key))
    result = plan(state, recs, (), SETTINGS)
    assert result.changes == () and result.refusals == ()
    assert set(result.converged) == {r.id for r in recs}


# guard


def change(key: str, value: object, rec_id: str = "r", kind: str = "set_state") -> Change:
    backend, name = key.split("/")
    return Change(kind, backend, name, value, "ready", rec_id)  # type: ignore[arg-type]


def run_guard(
    changes: Sequence[Change],
    state: Observed,
    history: Sequence[Applied] = (),
    *,
    seen: int = 5,
    settings: Settings = SETTINGS,
    paused: bool = False,
    breaker_open: bool = False,
) -> tuple[list[str], list[tuple[str, str | None]], bool]:
    seen_cycles = {c.recommendation_id: seen for c in changes}
    result = guard(
        changes, state, history, seen_cycles, settings, paused=paused, breaker_open=breaker_open
    )
    return (
        [c.key for c in result.allowed],
        [(r.reason, r.ack) for r in result.refusals],
        result.tripped is not None,
    )


FOUR = observed(*(server(f"s{i}") for i in range(4)))


def test_guard_passes_a_plain_change() -> None:
    assert run_guard([change("be/s0", "drain")], FOUR) == (["be/s0"], [], False)


def test_guard_waits_for_dwell_pause_and_breaker() -> None:
    assert run_guard([change("be/s0", "drain")], FOUR, seen=1)[1] == [("dwell", None)]
    assert run_guard([change("be/s0", "drain")], FOUR, paused=True)[1] == [("paused", None)]
    assert run_guard([change("be/s0", "drain")], FOUR, breaker_open=True)[1] == [
        ("breaker_open", None)
    ]


def test_guard_freezes_a_server_after_another_recommendations_change() -> None:
    history = [Applied(NOW - 30, "be/s0", "earlier", "set_weight")]
    assert run_guard([change("be/s0", "drain")], FOUR, history)[1] == [("frozen", None)]
    # the same recommendation's next step continues; after the freeze anything may
    assert run_guard([change("be/s0", "drain", "earlier")], FOUR, history)[0] == ["be/s0"]
    later = [Applied(NOW - 61, "be/s0", "earlier", "set_weight")]
    assert run_guard([change("be/s0", "drain")], FOUR, later)[0] == ["be/s0"]


def test_guard_limits_actions_per_hour() -> None:
    settings = replace(SETTINGS, max_actions_per_hour=3, breaker_share=1.0)
    history = [Applied(NOW - 3000, "be/s1", "x", "set_weight")] * 2
    allowed, refused, _ = run_guard(
        [change("be/s2", "drain"), change("be/s3", "drain")], FOUR, history, settings=settings
    )
    assert allowed == ["be/s2"] and refused == [("rate_limited", None)]
    old = [Applied(NOW - 3700, "be/s1", "x", "set_weight")] * 5
    assert run_guard([change("be/s2", "drain")], FOUR, old, settings=settings)[0] == ["be/s2"]


def test_guard_never_drains_or_unweights_the_last_serving_server() -> None:
    two = observed(server("s0"), server("s1", admin="drain"), server("t0", "other"))
    assert run_guard([change("be/s0", "drain")], two)[1] == [("last_ready_server", "rejected")]
    assert run_guard([change("be/s0", "maint")], two)[1] == [("last_ready_server", "rejected")]
    zero = change("be/s0", 0, kind="set_weight")
    assert run_guard([zero], two)[1] == [("last_ready_server", "rejected")]
    # two servers: the first drain passes, the second would empty the pool
    pair = observed(server("s0"), server("s1"), server("t0", "other"), server("t1", "other"))
    settings = replace(SETTINGS, breaker_share=1.0)
    allowed, refused, _ = run_guard(
        [change("be/s0", "drain"), change("be/s1", "drain")], pair, settings=settings
    )
    assert allowed == ["be/s0"] and refused == [("last_ready_server", "rejected")]
    # a server that is down does not count as capacity
    down = observed(server("s0"), server("s1", up=False), server("t0", "other"))
    assert run_guard([change("be/s0", "drain")], down)[1] == [("last_ready_server", "rejected")]


def test_guard_trips_the_breaker_past_the_share_of_changed_servers() -> None:
    history = [Applied(NOW - 100, "be/s0", "x", "drain"), Applied(NOW - 90, "be/s1", "y", "drain")]
    allowed, refused, tripped = run_guard(
        [change("be/s2", "drain"), change("be/s3", "drain")], FOUR, history
    )
    assert allowed == [] and tripped
    assert refused == [("breaker_open", None), ("breaker_open", None)]
    # servers changed before the window do not count
    old = [replace(a, at_seconds=NOW - 400) for a in history]
    assert run_guard([change("be/s2", "drain")], FOUR, old) == (["be/s2"], [], False)
    # nor do those changed before a person re-armed it
    rearmed = guard(
        [change("be/s2", "drain"), change("be/s3", "drain")],
        FOUR,
        history,
        {"r": 5},
        SETTINGS,
        paused=False,
        breaker_open=False,
        rearmed_at_seconds=NOW - 80,
    )
    assert [c.key for c in rearmed.allowed] == ["be/s2", "be/s3"] and rearmed.tripped is None


def weight(key: str, value: int, before: int, rec_id: str = "r") -> Change:
    backend, name = key.split("/")
    return Change("set_weight", backend, name, value, before, rec_id)


def test_a_reweighting_that_keeps_every_server_serving_does_not_trip_the_breaker() -> None:
    # the default target: one server at 10 of 13, three at 1, each re-weighted in steps
    skewed = observed(server("s0", weight=10), *(server(f"s{i}", weight=1) for i in (1, 2, 3)))
    steps = [weight(f"be/s{i}", 33, 1) for i in (1, 2, 3)]
    allowed, refused, tripped = run_guard(steps, skewed)
    assert allowed == ["be/s1", "be/s2", "be/s3"] and refused == [] and not tripped
    # the next passes, with those steps in the history: s0's share fell from 77 % to 9 %
    history = [Applied(NOW - 60, c.key, "r", "set_weight", 1) for c in steps]
    ramped = observed(server("s0", weight=10), *(server(f"s{i}", weight=33) for i in (1, 2, 3)))
    more = [weight(f"be/s{i}", 65, 33) for i in (1, 2, 3)]
    assert run_guard(more, ramped, history)[0] == ["be/s1", "be/s2", "be/s3"]


def test_a_passs_reweighting_of_a_backend_is_judged_by_the_breaker_as_one() -> None:
    # the default target, all four to even weights at once: half-way through the pass (s0
    # and s1 at 33, s2 and s3 still at 1) s1 and s2 would each hold a quarter more of the
    # pool than before; once the pass is done only s0's share moved much (77 % to 25 %)
    skewed = observed(server("s0", weight=10), *(server(f"s{i}", weight=1) for i in (1, 2, 3)))
    even = [weight("be/s0", 33, 10), *(weight(f"be/s{i}", 33, 1) for i in (1, 2, 3))]
    assert run_guard(even, skewed) == (["be/s0", "be/s1", "be/s2", "be/s3"], [], False)
    # judged as one, the pass still counts what it does move: s0's share, which with three
    # servers of another backend drained within the window makes four of seven changed
    drained = [Applied(NOW - 60, f"other/s{i}", "x", "drain") for i in (7, 8, 9)]
    others = (server(f"s{i}", "other", admin="drain") for i in (7, 8, 9))
    seven = observed(*skewed.servers.values(), *others)
    allowed, _, tripped = run_guard(even, seven, drained)
    assert allowed == [] and tripped


def test_the_breaker_counts_a_reweighting_that_moves_much_of_a_pools_traffic() -> None:
    history = [Applied(NOW - 100, "be/s0", "x", "drain")]
    # s1 from a quarter of the pool's weight to 46 %: not yet counted (the drained s0 is)
    heavy = weight("be/s1", 256, 100)
    allowed, refused, tripped = run_guard([heavy], FOUR, history)
    assert allowed == ["be/s1"] and not tripped
    history += [
        Applied(NOW - 50, "be/s1", "r", "set_weight", 100),
        Applied(NOW - 50, "be/s3", "r", "set_weight", 100),
    ]
    after = observed(server("s0"), server("s1", weight=256), server("s2"), server("s3", weight=30))
    # s2 to 0 counts as a drain does, and puts s1 at 66 % of the weight, a third above an
    # even split of the three weighted servers: three of four changed would exceed half
    allowed, refused, tripped = run_guard([weight("be/s2", 0, 100, "z")], after, history)
    assert allowed == [] and tripped and refused == [("breaker_open", None)]
    # a small re-weighting of a server not yet counted does not trip it
    assert run_guard([weight("be/s2", 80, 100, "z")], after, history)[0] == ["be/s2"]


def test_raising_a_skews_starved_servers_to_an_even_share_does_not_trip_the_breaker() -> None:
    # three servers, one weighted 29 to the others' 1 (94 % of the traffic): one pass to
    # even weights raises two shares from 3 % to 33 % and cuts one from 94 % to 33 %; only
    # the cut counts, one of three
    skewed = observed(server("s0", weight=1), server("s1", weight=1), server("s2", weight=29))
    even = [weight("be/s0", 29, 1), weight("be/s1", 29, 1)]
    assert run_guard(even, skewed) == (["be/s0", "be/s1"], [], False)
    # the same rises past an even split count: s0 to 90 % of the pool with s2 cut
    piled = [weight("be/s0", 256, 1), weight("be/s2", 1, 29)]
    allowed, _, tripped = run_guard(piled, skewed)
    assert allowed == [] and tripped


def test_agent_weights_are_the_percentage_haproxy_rounds_back_to_the_weight() -> None:
    from gpubalance.controller.actuator import ActuatorError
    from gpubalance.controller.agent import weight_percent

    assert weight_percent(40, 100) == 40
    assert weight_percent(2, 3) == 67  # HAProxy: 3 * 67 // 100 == 2
    assert weight_percent(256, 128) == 200
    with pytest.raises(ActuatorError, match=r"steps of 3\.0"):
        weight_percent(5, 300)
    with pytest.raises(ActuatorError, match="configured weight, which is 0"):
        weight_percent(5, 0)


def test_the_analyzers_shares_become_weights_of_the_servers_its_workers_name() -> None:
    state = observed(server("w0"), server("w1"), server("w2"), server("w3"))
    shares = [
        {"gpu": g, "worker": f"w{g}", "weight": share}
        for g, share in enumerate((0.1, 0.3, 0.3, 0.3))
    ]
    wanted = [rec("r", "set_weights", "pool:llama", {"pool": "llama", "weights": shares})]
    settings = replace(SETTINGS, max_weight_step=256)
    result = plan(state, wanted, (), settings)
    assert result.refusals == ()
    # in proportion, the largest share 100
    assert {(c.server, c.value) for c in result.changes} == {("w0", 33)}
    assert plan(apply(state, result.changes), wanted, (), settings).converged == ("r",)


def test_the_analyzers_shares_are_reached_in_the_fewest_passes_of_the_step() -> None:
    # the default target at 10/1/1/1; even shares asked: 33 each is one pass of the step of
    # 32, where a largest weight of 100 would take four (the last three hardly moving traffic)
    skewed = observed(server("w0", weight=10), *(server(f"w{i}", weight=1) for i in (1, 2, 3)))
    even = [{"gpu": g, "worker": f"w{g}", "weight": 0.25} for g in range(4)]
    wanted = [rec("r", "set_weights", "pool:llama", {"pool": "llama", "weights": even})]
    result = plan(skewed, wanted, (), SETTINGS)
    assert {(c.server, c.value) for c in result.changes} == {(f"w{i}", 33) for i in range(4)}
    assert plan(apply(skewed, result.changes), wanted, (), SETTINGS).converged == ("r",)
    # shares within two points of what HAProxy routes by already are met: no change
    near = [
        {"gpu": g, "worker": f"w{g}", "weight": share}
        for g, share in enumerate((0.26, 0.25, 0.25, 0.24))
    ]
    again = [rec("r2", "set_weights", "pool:llama", {"pool": "llama", "weights": near})]
    assert plan(apply(skewed, result.changes), again, (), SETTINGS).converged == ("r2",)
    # a recommendation naming some of a backend's servers: the largest share 100, as the
    # others' weights are relative to it
    five = observed(*(server(f"w{i}", weight=10) for i in range(4)), server("w4", weight=100))
    part = plan(five, wanted, (), SETTINGS)
    assert {(c.server, c.value) for c in part.changes} == {(f"w{i}", 42) for i in range(4)}


def test_capacity_shares_on_a_leastconn_backend_are_equal_weights() -> None:
    # three RTX 4090s serving 10 requests/s each and an RTX 3090 serving 4, weighted 8/2/2/1:
    # leastconn evens out requests in flight per unit of weight, and the 3090 holds each
    # request longer, so weights in proportion to capacity would count its slowness twice
    capacity = {0: 10.0, 1: 10.0, 2: 10.0, 3: 4.0}
    total = sum(capacity.values())
    shares = [{"gpu": g, "worker": f"w{g}", "weight": c / total} for g, c in capacity.items()]
    expected = ExpectedEffect({}, {}, None, None, capacity_per_second=capacity)
    wanted = [rec("r", "set_weights", "pool:llama", {"weights": shares}, expected=expected)]
    settings = replace(SETTINGS, max_weight_step=256)
    servers = [server(f"w{g}", weight=w) for g, w in enumerate((8, 2, 2, 1))]
    leastconn = replace(observed(*servers), algorithms={"be": "leastconn"})
    result = plan(leastconn, wanted, (), settings)
    after = apply(leastconn, result.changes)
    assert len({s.weight for s in after.servers.values()}) == 1
    assert plan(after, wanted, (), settings).converged == ("r",)
    # round robin sends each server its weight's share: weights in proportion to the shares
    roundrobin = replace(observed(*servers), algorithms={"be": "roundrobin"})
    after = apply(roundrobin, plan(roundrobin, wanted, (), settings).changes)
    assert {k: s.weight for k, s in after.servers.items()} == {
        "be/w0": 100,
        "be/w1": 100,
        "be/w2": 100,
        "be/w3": 40,
    }
    # no capacity for a GPU given a share: the shares as they are, on leastconn too
    bare = [rec("r", "set_weights", "pool:llama", {"weights": shares})]
    after = apply(leastconn, plan(leastconn, bare, (), settings).changes)
    assert after.servers["be/w3"].weight == 40


@pytest.mark.parametrize("seed", range(200))
def test_generated_shares_are_reached_one_way_and_then_met(seed: int) -> None:
    rng = random.Random(5000 + seed)
    n = rng.randint(1, 6)
    state = observed(*(server(f"w{i}", weight=rng.randint(1, 256)) for i in range(n)))
    shares = [rng.choice([0.0, *(rng.random() for _ in range(4))]) for _ in range(n)]
    if not any(shares):
        shares[0] = 1.0
    weights = [
        {"gpu": i, "worker": f"w{i}", "weight": v / sum(shares)} for i, v in enumerate(shares)
    ]
    wanted = [rec("r", "set_weights", "pool:p", {"pool": "p", "weights": weights})]
    direction: dict[str, int] = {}
    bound = math.ceil(256 / SETTINGS.max_weight_step) + 1
    for _ in range(bound):
        result = plan(state, wanted, (), SETTINGS)
        assert result.refusals == ()
        if not result.changes:
            break
        for c in result.changes:
            sign = 1 if c.value > c.before else -1  # type: ignore[operator]
            assert direction.setdefault(c.key, sign) == sign, "weight reversed"
        state = apply(state, result.changes)
    else:
        pytest.fail(f"no convergence within {bound} passes")
    assert plan(state, wanted, (), SETTINGS).converged == ("r",)
    total = sum(s.weight for s in state.servers.values())
    for i, v in enumerate(shares):
        # as close as the largest weight 100 would place them, or two points
        assert abs(state.servers[f"be/w{i}"].weight / total - v / sum(shares)) <= 0.02 + 0.01


def test_the_analyzers_drain_of_a_gpu_drains_the_servers_of_its_workers() -> None:
    state = observed(server("w0"), server("w1"), server("w2"))
    drain = rec("r", "drain", "gpu:2", {"gpu": 2, "workers": ["w2"]})
    result = plan(state, [drain], (), SETTINGS)
    assert [(c.backend, c.server, c.value) for c in result.changes] == [("be", "w2", "drain")]


@pytest.mark.parametrize(
    ("parameters", "found"),
    [
        ({"weights": [{"gpu": 0, "worker": None, "weight": 1.0}]}, "names no worker"),
        ({"weights": [{"gpu": 0, "worker": "w9", "weight": 1.0}]}, "'w9' is a server of no"),
        ({"weights": [{"gpu": 0, "worker": "w0", "weight": 1.5}]}, "not 0..1"),
    ],
)
def test_analyzer_weights_the_controller_cannot_place_are_refused(
    parameters: Mapping[str, object], found: str
) -> None:
    result = plan(
        observed(server("w0"), server("w1")),
        [rec("r", "set_weights", "pool:p", parameters)],
        (),
        SETTINGS,
    )
    assert result.changes == ()
    [refusal] = result.refusals
    assert found in refusal.detail, refusal.detail


# -- moves: plan_moves before the mover ---------------------------------------------------------

POOLS = (
    server("w0", "be_chat"),
    server("w1", "be_chat"),
    server("w2", "be_code"),
    server("w3", "be_code"),
)


def move(rec_id: str = "m", gpu: int = 2, **parameters: object) -> Recommendation:
    asked = {"gpu": gpu, "workers": [f"w{gpu}"], "to": "llama", "to_workers": ["w0", "w1"]}
    return rec(rec_id, "move_worker", f"gpu:{gpu}", {**asked, **parameters}, cost_rank=5)


def test_a_move_to_the_analyzers_pool_goes_to_the_backend_of_its_workers() -> None:
    passed, refused = plan_moves([move()], observed(*POOLS), [], [], Settings())
    assert refused == []
    assert [(r.id, r.parameters["to"]) for r in passed] == [("m", "be_chat")]
    # a backend named as such stays as it is
    passed, _ = plan_moves(
        [move(to="be_chat", to_workers=[])], observed(*POOLS), [], [], Settings()
    )
    assert passed[0].parameters["to"] == "be_chat"


def test_a_move_to_an_unknown_pool_or_an_expired_one_is_rejected() -> None:
    stray = move("stray", to="mistral", to_workers=["w9"])
    old = replace(move("old"), expires_seconds=NOW - 1)
    passed, refused = plan_moves([stray, old], observed(*POOLS), [], [], Settings())
    assert passed == []
    reasons = {r.recommendation_id: (r.reason, r.ack) for r in refused}
    assert reasons == {"stray": ("unknown_target", "rejected"), "old": ("expired", "rejected")}
    assert "'mistral': no such backend" in next(r.detail for r in refused if r.reason != "expired")


def test_a_moved_gpu_is_frozen_against_another_move_then_free() -> None:
    back = move("back", to="qwen", to_workers=["w3"])
    moved = [Applied(NOW - 30, "gpu:2", "m", "move")]
    passed, refused = plan_moves([back], observed(*POOLS), moved, [], Settings())
    assert passed == []
    assert [(r.reason, r.ack) for r in refused] == [("frozen", None)]
    # its own move is not frozen by itself, and after the freeze the way back is open
    assert plan_moves([move()], observed(*POOLS), moved, [], Settings())[0]
    later = observed(*POOLS, at=NOW + 31)
    assert plan_moves([back], later, moved, [], Settings())[0]


def test_a_move_waits_for_cheaper_changes_on_the_backend_it_leaves() -> None:
    weight = Change("set_weight", "be_code", "w3", 90, 100, "r", cost_rank=0)
    passed, refused = plan_moves([move()], observed(*POOLS), [], [weight], Settings())
    assert passed == [] and [(r.reason, r.ack) for r in refused] == [("ladder", None)]
    # the backend it joins, or another one, may change meanwhile
    joins = Change("set_weight", "be_chat", "w0", 90, 100, "r", cost_rank=0)
    elsewhere = Change("set_weight", "be_other", "x", 90, 100, "r", cost_rank=0)
    assert plan_moves([move()], observed(*POOLS), [], [joins, elsewhere], Settings())[0]


def _even_shares(workers: int) -> list[Recommendation]:
    shares = [{"gpu": g, "worker": f"w{g}", "weight": 1 / workers} for g in range(workers)]
    return [rec("r", "set_weights", "pool:llama", {"pool": "llama", "weights": shares})]


def test_a_share_for_a_server_it_took_out_itself_readies_it() -> None:
    # w2 went to maint by this controller's remove_worker; its weight was never changed, so
    # the analyzer's even shares are met by the weights alone, and without the ready the pool's
    # third GPU would stay out however busy the pool became
    state = observed(server("w0"), server("w1"), server("w2", admin="maint"))
    result = plan(state, _even_shares(3), (), SETTINGS, frozenset({"be/w2"}))
    assert [(c.kind, c.server, c.value, c.before) for c in result.changes] == [
        ("set_state", "w2", "ready", "maint")
    ]
    assert result.converged == ()
    assert plan(apply(state, result.changes), _even_shares(3), (), SETTINGS).converged == ("r",)


def test_a_share_for_a_server_someone_else_took_out_leaves_it_out() -> None:
    # the same state, but the maint is a person's (not in the controller's record), or the
    # server it took out is given no share: nothing readies it
    state = observed(server("w0"), server("w1"), server("w2", admin="maint"))
    assert plan(state, _even_shares(3), (), SETTINGS).changes == ()
    two = [{"gpu": g, "worker": f"w{g}", "weight": 0.5} for g in range(2)]
    without = [rec("r", "set_weights", "pool:llama", {"pool": "llama", "weights": two})]
    assert plan(state, without, (), SETTINGS, frozenset({"be/w2"})).changes == ()


def test_a_removal_and_a_share_for_the_same_server_are_contradictory() -> None:
    state = observed(server("w0"), server("w1"), server("w2", admin="maint"))
    recs = [*_even_shares(3), rec("x", "remove_worker", "be/w2", cost_rank=8)]
    result = plan(state, recs, (), SETTINGS, frozenset({"be/w2"}))
    assert result.changes == ()
    assert {(r.recommendation_id, r.reason) for r in result.refusals} == {
        ("r", "contradictory"),
        ("x", "contradictory"),
    }


def _shared_and_batch(batch_ready: Sequence[str] = ()) -> Observed:
    names = ["w0", "w1", "w2", "w3"]
    return observed(
        *(server(n, "be") for n in names),
        *(server(n, "be_batch", admin="ready" if n in batch_ready else "maint") for n in names),
    )


SPLIT = {"batch_workers": ["w3"], "interactive_workers": ["w0", "w1", "w2"]}


def test_a_split_readies_the_batch_side_in_its_backend_then_takes_it_out_of_the_shared_one() -> (
    None
):
    recs = [rec("s", "split_pools", "pool:m", SPLIT, cost_rank=4)]
    state = _shared_and_batch()
    steps = []
    for _ in range(5):
        result = plan(state, recs, (), SETTINGS)
        if result.converged:
            break
        steps.append([(c.key, c.value) for c in result.changes])
        state = apply(state, result.changes)
    assert steps == [
        [("be_batch/w3", "ready")],
        [("be/w3", "drain")],
        [("be/w3", "maint")],
    ]
    assert result.converged == ("s",) and result.changes == ()

    # the pool's next re-weighting gives w3 a share: it stays out of the shared backend
    shares = [{"gpu": g, "worker": f"w{g}", "weight": 0.25} for g in range(4)]
    reweigh = rec("r", "set_weights", "pool:m", {"weights": shares}, cost_rank=1)
    taken_out = frozenset({"be/w3"})
    later = plan(state, [reweigh], (), SETTINGS, taken_out)
    assert not [c for c in later.changes if c.kind == "set_state"]
    # without the split, a share readies a server the controller took out, as before
    unsplit = replace(
        state,
        servers={
            **state.servers,
            "be_batch/w3": replace(state.servers["be_batch/w3"], admin="maint"),
        },
    )
    back = plan(unsplit, [reweigh], (), SETTINGS, taken_out)
    assert [(c.key, c.value) for c in back.changes if c.kind == "set_state"] == [("be/w3", "ready")]


def test_a_gpu_back_from_its_loss_is_readied_where_its_drain_took_it_out_and_no_further() -> None:
    """After a split, w3 is ready in the batch backend and in maint in the shared one: the
    drain for its GPU's loss takes it out of the first and leaves the second, and its return
    readies the first alone."""
    state = replace(
        _shared_and_batch(["w3"]),
        servers={
            **_shared_and_batch(["w3"]).servers,
            "be/w3": server("w3", "be", admin="maint"),
        },
    )
    gpu = {"gpu": 3, "workers": ["w3"]}
    drained = plan(state, [rec("d", "drain", "gpu:3", gpu, cost_rank=2)], (), SETTINGS)
    assert [(c.key, c.value) for c in drained.changes] == [("be_batch/w3", "drain")]
    state = apply(state, drained.changes)
    back = [rec("a", "add_worker", "gpu:3", gpu, cost_rank=6)]
    returned = plan(state, back, (), SETTINGS, frozenset({"be_batch/w3"}))
    assert [(c.key, c.value) for c in returned.changes] == [("be_batch/w3", "ready")]
    state = apply(state, returned.changes)
    assert plan(state, back, (), SETTINGS).converged == ("a",)
    assert state.servers["be/w3"].admin == "maint"
    # without a split: the drained server is readied
    plain = observed(server("w0"), server("w1", admin="drain"))
    readied = plan(
        plain, [rec("a", "add_worker", "gpu:1", {"gpu": 1, "workers": ["w1"]})], (), SETTINGS
    )
    assert [(c.key, c.value) for c in readied.changes] == [("be/w1", "ready")]


@pytest.mark.parametrize(
    ("state", "parameters", "reason", "found"),
    [
        (
            observed(*(server(f"w{i}") for i in range(4))),
            SPLIT,
            "unknown_target",
            "use_backend be_batch if { req.hdr(X-Class) -m str batch } { nbsrv(be_batch) gt 0 }",
        ),
        (_shared_and_batch(), {"batch_workers": ["w3"]}, "unknown_target", "names no worker"),
        (
            _shared_and_batch(),
            {"batch_workers": ["w3"], "interactive_workers": ["w2", "w3"]},
            "bad_parameters",
            "on both sides",
        ),
        (_shared_and_batch(["w2"]), SPLIT, "already_split", "from w2 already, not w3"),
    ],
)
def test_a_split_the_controller_cannot_make_is_refused_with_the_reason(
    state: Observed, parameters: Mapping[str, object], reason: str, found: str
) -> None:
    result = plan(state, [rec("s", "split_pools", "pool:m", parameters)], (), SETTINGS)
    [refusal] = result.refusals
    assert result.changes == () and (refusal.reason, refusal.ack) == (reason, "rejected")
    assert found in refusal.detail
