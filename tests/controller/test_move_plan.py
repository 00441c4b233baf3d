"""next_step() is pure: HAProxy's servers, the GPU's worker and the intent give the next step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpubalance.controller.model import Observed, ObservedServer
from gpubalance.controller.move import (
    Act,
    Finished,
    IntentStore,
    MoveIntent,
    MoveLimits,
    Step,
    Undo,
    Wait,
    next_step,
)
from gpubalance.controller.supervisor import WorkerProcess

LIMITS = MoveLimits(drain_timeout_seconds=30, ready_timeout_seconds=60, stop_timeout_seconds=10)
T0 = 1000.0


def server(backend: str, name: str, admin: str = "ready", sessions: int = 0, port: int = 0):
    return ObservedServer(backend, name, admin, 100, 100, True, sessions, "127.0.0.1", port)  # type: ignore[arg-type]


def seen(at: float, *servers: ObservedServer) -> Observed:
    return Observed(at, {s.key: s for s in servers})


def worker(pool: str, *, ready: bool = True, port: int = 9001, started: float = T0):
    return WorkerProcess(1, pool, 4242, "127.0.0.1", port, started, ready)


def intent(*steps: tuple[str, str, float], recorded: bool = True) -> MoveIntent:
    move = MoveIntent("m", 1, "gpu1", "be_a", "be_b", "r", T0)
    for phase, action, at in steps:
        move = move.with_step(Step(phase, action, at, recorded=recorded))  # type: ignore[arg-type]
    return move


GPU0 = server("be_a", "gpu0")


def test_a_drain_waits_for_the_sessions_then_the_timeout_then_maint() -> None:
    move = intent(("move", "drain", T0))
    draining = server("be_a", "gpu1", "drain", sessions=3)
    step = next_step(move, seen(T0 + 5, GPU0, draining), {1: worker("be_a")}, LIMITS)
    assert step == Wait("be_a/gpu1 drains: 3 sessions left")
    late = next_step(move, seen(T0 + 31, GPU0, draining), {1: worker("be_a")}, LIMITS)
    assert isinstance(late, Act) and late.action == "maint"
    assert "3 sessions left after the 30 s drain timeout" in late.detail
    empty = replace(draining, sessions=0)
    now = next_step(move, seen(T0 + 1, GPU0, empty), {1: worker("be_a")}, LIMITS)
    assert isinstance(now, Act) and (now.action, now.detail) == ("maint", "no sessions left")


def test_the_last_serving_server_of_a_pool_is_not_drained() -> None:
    alone = seen(T0, server("be_a", "gpu1"), replace(GPU0, admin="maint"))
    step = next_step(intent(), alone, {1: worker("be_a")}, LIMITS)
    assert isinstance(step, Finished) and step.outcome == "refused"
    assert step.detail.startswith("last_ready_server")


def test_a_worker_is_stopped_once_then_killed_when_it_outlives_the_timeout() -> None:
    maint = server("be_a", "gpu1", "maint")
    old = {1: worker("be_a")}
    first = next_step(intent(("move", "maint", T0)), seen(T0, GPU0, maint), old, LIMITS)
    assert isinstance(first, Act) and first.action == "stop" and first.worker == old[1]
    # a stop a crash left unmarked may never have been sent: it is sent (again)
    unmarked = intent(("move", "stop", T0), recorded=False)
    again = next_step(unmarked, seen(T0 + 1, GPU0, maint), old, LIMITS)
    assert isinstance(again, Act) and again.action == "stop"
    stopping = intent(("move", "stop", T0))
    assert isinstance(next_step(stopping, seen(T0 + 9, GPU0, maint), old, LIMITS), Wait)
    kill = next_step(stopping, seen(T0 + 11, GPU0, maint), old, LIMITS)
    assert isinstance(kill, Act) and kill.action == "kill"
    killed = intent(("move", "stop", T0), ("move", "kill", T0 + 11))
    assert isinstance(next_step(killed, seen(T0 + 12, GPU0, maint), old, LIMITS), Wait)
    gone = next_step(killed, seen(T0 + 12, GPU0, maint), {}, LIMITS)
    assert isinstance(gone, Act) and (gone.action, gone.backend) == ("del_server", "be_a")


def test_a_start_left_unmarked_by_a_crash_is_carried_out_a_marked_one_undone() -> None:
    state = seen(T0, GPU0)
    unmarked = intent(("move", "start", T0), recorded=False)
    again = next_step(unmarked, state, {}, LIMITS)
    assert isinstance(again, Act) and (again.action, again.pool) == ("start", "be_b")
    undo = next_step(intent(("move", "start", T0)), state, {}, LIMITS)
    assert isinstance(undo, Undo) and "exited during start-up" in undo.detail
    # undoing, the GPU's way back is the old pool's worker; if that fails too, it is failed
    back = intent(("move", "start", T0), ("move", "undo", T0 + 1))
    assert back.destination == "be_a" and back.leaving == "be_b"
    start = next_step(back, state, {}, LIMITS)
    assert isinstance(start, Act) and (start.action, start.pool) == ("start", "be_a")
    lost = next_step(
        back.with_step(Step("undo", "start", T0 + 2, recorded=True)), state, {}, LIMITS
    )
    assert isinstance(lost, Finished) and lost.outcome == "failed"


def test_a_worker_not_ready_in_time_is_undone() -> None:
    loading = {1: worker("be_b", ready=False, started=T0)}
    move = intent(("move", "start", T0))
    assert next_step(move, seen(T0 + 59, GPU0), loading, LIMITS) == Wait(
        "the be_b worker of GPU 1 loads (pid 4242)"
    )
    late = next_step(move, seen(T0 + 61, GPU0), loading, LIMITS)
    assert isinstance(late, Undo) and "not ready within 60 s" in late.detail


def test_a_ready_worker_is_added_readdressed_readied_and_the_move_ends() -> None:
    ready = {1: worker("be_b", port=9001)}
    move = intent(("move", "start", T0))
    add = next_step(move, seen(T0, GPU0), ready, LIMITS)
    assert isinstance(add, Act) and (add.action, add.backend, add.detail) == (
        "add_server",
        "be_b",
        "127.0.0.1:9001",
    )
    elsewhere = server("be_b", "gpu1", "maint", port=8000)
    readdress = next_step(move, seen(T0, GPU0, elsewhere), ready, LIMITS)
    assert isinstance(readdress, Act) and readdress.action == "set_addr"
    added = replace(elsewhere, port=9001)
    assert next_step(move, seen(T0, GPU0, added), ready, LIMITS) == Act("ready", "be_b", "gpu1")
    done = next_step(move, seen(T0, GPU0, replace(added, admin="ready")), ready, LIMITS)
    assert isinstance(done, Finished) and done.outcome == "moved"


def test_a_server_joins_its_new_pool_at_the_weight_its_serving_peers_have() -> None:
    ready = {1: worker("be_b", port=9001)}
    move = intent(("move", "start", T0))
    peers = (replace(server("be_b", "gpu2"), weight=33), replace(server("be_b", "gpu3"), weight=33))
    add = next_step(move, seen(T0, GPU0, *peers), ready, LIMITS)
    assert isinstance(add, Act) and (add.action, add.weight) == ("add_server", 33)
    # a pool with none serving: the config's weight (the mover's default)
    drained = replace(peers[0], admin="drain")
    alone = next_step(move, seen(T0, GPU0, drained), ready, LIMITS)
    assert isinstance(alone, Act) and alone.weight is None


def test_the_intent_record_round_trips_and_a_broken_one_says_what_to_do(tmp_path: Path) -> None:
    store = IntentStore(tmp_path / "move.json")
    assert store.load() is None
    move = intent(("move", "begin", T0), ("move", "drain", T0 + 1), recorded=False)
    store.save(move)
    assert store.load() == move
    store.clear()
    assert store.load() is None
    (tmp_path / "move.json").write_text("{not json")
    with pytest.raises(ValueError, match="finish the move by hand"):
        store.load()
