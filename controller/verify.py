"""Verify after acting: a recommendation's changes that made its backend slower are undone.

Each pass reads, per backend, the requests in flight (HAProxy's `scur`, summed over the
servers) and the requests served so far (`stot`). Over a stretch of passes, Little's law
turns them into the backend's mean time in the system: the mean in flight over the
throughput. That is what a re-weighting or a drain is for, it needs no latency histogram
HAProxy does not have, and a change in demand moves both sides of it.

When a recommendation's last change has stood for `freeze_seconds`, its backend's time in the
system over that freeze is compared with the same length before its first change; more than
`undo_worse_ratio` times it, and the recommendation's servers go back to what they were
before it. Only the passes of this process count: the figures before a restart are not in the
audit log, so a change made before one is not verified.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from gpubalance.controller.model import Change, ChangeKind, Observed


@dataclass(frozen=True, slots=True)
class Load:
    """One backend at one pass."""

    at_seconds: float
    in_flight: int  # sum of the servers' scur
    served: int  # sum of the servers' stot


def loads(observed: Observed) -> dict[str, Load]:
    out: dict[str, Load] = {}
    for backend in observed.backends:
        pool = observed.pool(backend)
        out[backend] = Load(
            observed.at_seconds,
            sum(s.sessions for s in pool),
            sum(s.requests_total for s in pool),
        )
    return out


def time_in_system(history: Sequence[Load], start: float, end: float) -> float | None:
    """Mean seconds a request spent in the backend over [start, end] (Little's law); None
    with fewer than two passes there or nothing served."""
    inside = [h for h in history if start <= h.at_seconds <= end]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    seconds = last.at_seconds - first.at_seconds
    served = last.served - first.served
    if seconds <= 0 or served <= 0:
        return None
    in_flight = sum(h.in_flight for h in inside) / len(inside)
    return in_flight / (served / seconds)


@dataclass(slots=True)
class Watch:
    """A recommendation's changes on one backend, waiting to be verified."""

    recommendation_id: str
    backend: str
    first_at: float
    last_at: float
    # each server's value before the recommendation's first change of it: what an undo sets
    before: dict[tuple[str, ChangeKind], Change] = field(default_factory=dict)

    def add(self, change: Change, now: float) -> None:
        self.last_at = now
        self.before.setdefault((change.key, change.kind), change)

    def undo(self, observed: Observed) -> list[Change]:
        """The changes that put its servers back as they were, from their state now."""
        out = []
        for first in self.before.values():
            server = observed.servers.get(first.key)
            if server is None:
                continue  # gone from HAProxy: nothing to put back
            now = server.weight if first.kind == "set_weight" else server.admin
            if now != first.before:
                out.append(replace(first, value=first.before, before=now))
        return out


@dataclass(frozen=True, slots=True)
class Verdict:
    watch: Watch
    before_seconds: float
    after_seconds: float
    worse: bool

    @property
    def reason(self) -> str:
        verb = "undone" if self.worse else "kept"
        return (
            f"{verb}: {self.watch.backend}'s mean time in the system {self.after_seconds:.2f} s "
            f"over the freeze after it, {self.before_seconds:.2f} s before it"
        )


class Verifier:
    """The backends' loads over the last passes, and the recommendations to verify."""

    def __init__(self, freeze_seconds: float, worse_ratio: float) -> None:
        self.freeze_seconds = freeze_seconds
        self.worse_ratio = worse_ratio
        self.history: dict[str, deque[Load]] = {}
        self.watches: dict[str, Watch] = {}

    def observe(self, observed: Observed) -> None:
        # the stretch before the oldest watch's first change, however long its ramp took
        oldest = min((w.first_at for w in self.watches.values()), default=observed.at_seconds)
        horizon = oldest - self.freeze_seconds
        for backend, load in loads(observed).items():
            kept = self.history.setdefault(backend, deque())
            kept.append(load)
            while kept and kept[0].at_seconds < horizon:
                kept.popleft()

    def applied(self, change: Change, now: float) -> None:
        watch = self.watches.get(change.recommendation_id)
        if watch is None:
            watch = Watch(change.recommendation_id, change.backend, now, now)
            self.watches[change.recommendation_id] = watch
        watch.add(change, now)

    def due(self, now: float) -> list[Verdict]:
        """The watches whose freeze has passed, judged; those without figures are dropped."""
        out: list[Verdict] = []
        for rec_id, watch in list(self.watches.items()):
            if now - watch.last_at < self.freeze_seconds:
                continue
            del self.watches[rec_id]
            history = self.history.get(watch.backend, ())
            # the pass that acted saw the state before it: it closes the stretch before
            before = time_in_system(history, watch.first_at - self.freeze_seconds, watch.first_at)
            after = time_in_system(history, watch.last_at, watch.last_at + self.freeze_seconds)
            if before is None or after is None:
                continue
            out.append(Verdict(watch, before, after, after > before * self.worse_ratio))
        return out
