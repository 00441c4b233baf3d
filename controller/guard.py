"""guard(): which planned changes may run now, and why the others may not.

Pure, like `plan`: it reads the changes, HAProxy's state, the changes already applied (from the
audit log after a restart) and how many passes saw each recommendation. In order, a change
waits while the controller is paused or its breaker is open, until its recommendation has been
seen in `dwell_cycles` passes (the loop counts a pass for each interval its evidence held),
while its server is frozen after another recommendation's change (`freeze_seconds`; one
recommendation's own steps, a weight ramp or drain-then-maint, continue), and once
`max_actions_per_hour` are spent. It is refused when it would leave a backend that serves with
no server serving (the last ready, up, weighted server). The breaker trips when a
change would make more than `breaker_share` of the managed servers changed within
`breaker_window_seconds`; a person re-arms it, and the changes before the re-arm no longer
count. A drain, maint, ready or move changes its server; a re-weighting keeps every server
serving and moves traffic, not capacity, so a server re-weighted within the period counts
only when its weight went to or from 0, or its share of its backend's weight fell by more than
`breaker_weight_share` since the period's first change (the weights before are in the
history), or rose by more than that above both its share then and an even split of the
backend (raising the starved servers of a skew to their even share is the fix, not the blast
radius); a pass's re-weightings of one backend are judged together, by the shares once all
of them are made, not half-way through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpubalance.controller.model import (
    Applied,
    Change,
    Observed,
    ObservedServer,
    Refusal,
    RefusalReason,
    Settings,
)
from gpubalance.diagnosis import AckStatus

HOUR_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class Guarded:
    allowed: tuple[Change, ...]
    refusals: tuple[Refusal, ...]
    tripped: str | None  # why the breaker tripped in this pass; None when it did not


def _after(server: ObservedServer, change: Change) -> ObservedServer:
    if change.kind == "set_weight":
        assert isinstance(change.value, int)
        return replace(server, weight=change.value)
    return replace(server, admin=change.value)


def guard(
    changes: Sequence[Change],
    observed: Observed,
    history: Sequence[Applied],
    seen_cycles: Mapping[str, int],
    settings: Settings,
    *,
    paused: bool,
    breaker_open: bool,
    rearmed_at_seconds: float = 0.0,
) -> Guarded:
    now = observed.at_seconds
    spent = sum(1 for a in history if now - a.at_seconds < HOUR_SECONDS)
    recent = [
        a
        for a in history
        if now - a.at_seconds < settings.breaker_window_seconds
        and a.at_seconds > rearmed_at_seconds
    ]
    last: dict[str, Applied] = {}
    for applied in sorted(history, key=lambda a: a.at_seconds):
        last[applied.key] = applied
    servers = dict(observed.servers)
    serving: dict[str, int] = {}  # per backend, as the changes allowed so far leave it
    for server in servers.values():
        serving[server.backend] = serving.get(server.backend, 0) + server.serving
    allowed: list[Change] = []
    refusals: list[Refusal] = []
    tripped: str | None = None
    changed = _changed(recent, servers, settings.breaker_weight_share)

    def wait(
        change: Change, reason: RefusalReason, detail: str, ack: AckStatus | None = None
    ) -> None:
        refusals.append(Refusal(change.recommendation_id, reason, detail, ack, change.key))

    for i, change in enumerate(changes):
        rec_id = change.recommendation_id
        before = last.get(change.key)
        if paused:
            wait(change, "paused", "the controller is paused (POST /api/v1/resume)")
        elif breaker_open or tripped is not None:
            wait(change, "breaker_open", "the breaker is open; a person re-arms it")
        elif seen_cycles.get(rec_id, 0) < settings.dwell_cycles:
            wait(
                change,
                "dwell",
                f"seen in {seen_cycles.get(rec_id, 0)} of {settings.dwell_cycles} passes",
            )
        elif (
            before is not None
            and before.recommendation_id != rec_id
            and now - before.at_seconds < settings.freeze_seconds
        ):
            wait(
                change,
                "frozen",
                f"{change.key} changed {now - before.at_seconds:.0f} s ago "
                f"(freeze {settings.freeze_seconds:.0f} s)",
            )
        elif spent >= settings.max_actions_per_hour:
            wait(change, "rate_limited", f"{spent} actions in the last hour")
        elif _empties_pool(servers[change.key], change, serving[change.backend]):
            wait(
                change,
                "last_ready_server",
                f"{change.action} of {change.key} would leave backend {change.backend} "
                "with no server taking requests",
                ack="rejected",
            )
        elif (
            len(grown := _changed_with(change, changes[i + 1 :], recent, servers, now, settings))
            > len(changed)
            and len(grown) / max(len(servers), 1) > settings.breaker_share
        ):
            tripped = (
                f"{len(grown)} of {len(servers)} servers changed within "
                f"{settings.breaker_window_seconds:.0f} s would exceed "
                f"{settings.breaker_share:.0%}; the breaker trips"
            )
            wait(change, "breaker_open", tripped)
        else:
            allowed.append(change)
            spent += 1
            recent.append(change.applied(now))
            after = _after(servers[change.key], change)
            serving[change.backend] += after.serving - servers[change.key].serving
            servers[change.key] = after
            changed = _changed(recent, servers, settings.breaker_weight_share)
    return Guarded(allowed=tuple(allowed), refusals=tuple(refusals), tripped=tripped)


def _changed_with(
    change: Change,
    ahead: Sequence[Change],
    recent: Sequence[Applied],
    servers: Mapping[str, ObservedServer],
    now: float,
    settings: Settings,
) -> set[str]:
    """The servers changed within the breaker's period were ``change`` applied too. A
    re-weighting is judged with the pass's other re-weightings of its backend still `ahead`:
    the backend's weights change together, and the shares half-way through a pass (one
    server's weight raised, its peers' not yet) are not a state HAProxy routes by for long."""
    batch = [change]
    if change.kind == "set_weight":
        batch += [c for c in ahead if c.kind == "set_weight" and c.backend == change.backend]
    after = dict(servers)
    for c in batch:
        after[c.key] = _after(after[c.key], c)
    return _changed(
        [*recent, *(c.applied(now) for c in batch)], after, settings.breaker_weight_share
    )


def _changed(
    recent: Sequence[Applied], servers: Mapping[str, ObservedServer], weight_share: float
) -> set[str]:
    """The servers (and moved GPUs) the breaker counts as changed within its period."""
    changed = {a.key for a in recent if a.action != "set_weight"}
    start: dict[str, int] = {}  # each re-weighted server's weight before the period's first
    for applied in sorted(recent, key=lambda a: a.at_seconds):
        if applied.action == "set_weight" and applied.key in servers:
            # a weight the history does not hold (an old audit log) counts the server as changed
            start.setdefault(applied.key, -1 if applied.before is None else applied.before)
    pools: dict[str, list[ObservedServer]] = {}
    for server in servers.values():
        pools.setdefault(server.backend, []).append(server)
    totals = {  # per backend: its weight now, before the period's first change; servers weighted
        backend: (
            sum(s.weight for s in pool),
            sum(max(start.get(s.key, s.weight), 0) for s in pool),
            sum(1 for s in pool if s.weight > 0),
        )
        for backend, pool in pools.items()
    }
    for key, first in start.items():
        total_now, total_then, weighted = totals[servers[key].backend]
        now_weight = servers[key].weight
        moved = False
        if total_now > 0 and total_then > 0:
            share_now, share_then = now_weight / total_now, first / total_then
            # traffic piled onto a server beyond what it held and beyond an even split of the
            # backend, or taken from it: a server brought up to an even share from a skew is
            # not the blast radius the breaker guards against
            even = 1 / max(weighted, 1)
            moved = (
                share_now - max(share_then, even) > weight_share
                or share_then - share_now > weight_share
            )
        if first < 0 or (first == 0) != (now_weight == 0) or moved:
            changed.add(key)
    return changed


def _empties_pool(server: ObservedServer, change: Change, serving: int) -> bool:
    # a backend with nothing serving already cannot lose capacity to this change
    return serving > 0 and serving - server.serving + _after(server, change).serving == 0
