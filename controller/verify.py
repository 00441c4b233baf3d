"""Verify after acting: a recommendation's changes that made its backend slower are undone.

Each pass reads, per backend, the requests in flight (HAProxy's `scur`, summed over the
servers) and the requests served so far (`stot`). Over a stretch of passes, Little's law
turns them into the backend's mean time in the system: the mean in flight over the
throughput. That is what a re-weighting or a drain is for, it needs no latency histogram
HAProxy does not have, and a change in demand moves both sides of it.

When a recommendation's last change has stood for `freeze_seconds`, its backend's time in the
system over that freeze is compared with the same length before its first change; more than
`undo_worse_ratio` times it, and by more than the readings' noise allows (`NOISE_Z` standard
errors of the difference), and the recommendation's servers go back to what they were before
it. The noise is real: a pass reads `scur` once, and at a few requests in flight six readings
of a minute leave the mean uncertain by a quarter or more, so a ratio alone undoes good
changes by chance. The figure before is taken as the first change is made and written with it
to the audit log (`verify_before_seconds`, `verify_before_error_seconds`), so a restarted
controller still verifies a change made before it (`Verifier.resume`), over the passes it
sees of the freeze after it.

A recommendation that puts a server back in rotation (`ready`, from drain or maint) is kept
whatever its backend's time in the system did: a server returned adds capacity, and the
controller returns one it took out when the analyzer sees its pool needs it, that is, when
demand has risen, so the freeze after is slower than the one before for the demand's sake,
and an undo would leave the pool short when it needs the server most (seen on a lab day whose
demand ebbs and comes back). A person's drain or maint the controller never readies.

A split (controller/plan.py) readies its batch side in a pool's batch backend, which had no
traffic before it: it is judged by the shared backend it was split from (the interactive
requests it is for), and that readying is no capacity returned.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpubalance.controller.model import Change, ChangeKind, Observed
from gpubalance.controller.plan import split_from


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


# a change is worse only when its backend got slower by more than this many standard errors of
# the difference (about 2.5 % of unchanged backends, by chance, go past it)
NOISE_Z = 2.0


@dataclass(frozen=True, slots=True)
class TimeInSystem:
    """A backend's mean time in the system over a stretch of passes, and its standard error:
    the in-flight readings' spread over the square root of their count, over the throughput
    (the served counter is exact; the readings are what is uncertain)."""

    seconds: float
    error_seconds: float


def time_in_system(history: Sequence[Load], start: float, end: float) -> TimeInSystem | None:
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
    readings = [h.in_flight for h in inside]
    throughput = served / seconds
    error = statistics.stdev(readings) / math.sqrt(len(readings))
    return TimeInSystem(statistics.fmean(readings) / throughput, error / throughput)


@dataclass(slots=True)
class Watch:
    """A recommendation's changes on one backend, waiting to be verified."""

    recommendation_id: str
    backend: str
    first_at: float
    last_at: float
    # the backend's mean time in the system over the freeze before the first change
    before: TimeInSystem | None = None
    # each server's value before the recommendation's first change of it: what an undo sets
    firsts: dict[tuple[str, ChangeKind], Change] = field(default_factory=dict)

    def add(self, change: Change, now: float) -> None:
        self.last_at = now
        self.firsts.setdefault((change.key, change.kind), change)

    @property
    def returned(self) -> list[str]:
        """The servers it put back in rotation (a split readying its batch side in the batch
        backend returns none: the same servers leave the shared one)."""
        return sorted(
            c.key
            for c in self.firsts.values()
            if c.kind == "set_state"
            and c.value == "ready"
            and c.before != "ready"
            and split_from(c.backend) is None
        )

    def undo(self, observed: Observed) -> list[Change]:
        """The changes that put its servers back as they were, from their state now."""
        out = []
        for first in self.firsts.values():
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
    before: TimeInSystem
    after: TimeInSystem
    worse: bool
    backend: str  # whose time in the system judged it (Verifier.judged_on)

    @property
    def reason(self) -> str:
        verb = "undone" if self.worse else "kept"
        text = (
            f"{verb}: {self.backend}'s mean time in the system {_text(self.after)} over "
            f"the freeze after it, {_text(self.before)} before it"
        )
        if self.watch.returned:
            text += f"; it returned {', '.join(self.watch.returned)} to rotation (more capacity)"
        return text


def _text(t: TimeInSystem) -> str:
    return f"{t.seconds:.2f} s (± {t.error_seconds:.2f})"


def worse(before: TimeInSystem, after: TimeInSystem, ratio: float) -> bool:
    """Slower by more than ``ratio`` times, and by more than the readings' noise."""
    noise = NOISE_Z * math.hypot(before.error_seconds, after.error_seconds)
    return after.seconds > before.seconds * ratio and after.seconds - before.seconds > noise


# how far back a restarted controller looks for changes to verify, in freezes: a recommendation
# re-weighted in bounded steps takes several passes before its last change starts the freeze
HORIZON_FREEZES = 10


def _change_of(entry: Mapping[str, Any]) -> Change | None:
    """The change an audit `applied` line records (None for a move or a line without one)."""
    action, target = entry.get("action"), entry.get("target")
    if action not in ("set_weight", "drain", "ready", "maint") or not isinstance(target, str):
        return None
    backend, _, server = target.partition("/")
    before, after = entry.get("before"), entry.get("after")
    if not server or before is None or after is None:
        return None
    kind: ChangeKind = "set_weight" if action == "set_weight" else "set_state"
    return Change(kind, backend, server, after, before, str(entry["recommendation"]))


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

    def applied(self, change: Change, now: float) -> TimeInSystem | None:
        """Watch the change; for a recommendation's first, the figure it will be judged
        against (for the audit log), else None."""
        watch = self.watches.get(change.recommendation_id)
        first = watch is None
        if watch is None:
            # the pass that acted saw the state before it: it closes the stretch before
            history = self.history.get(self.judged_on(change.backend), ())
            before = time_in_system(history, now - self.freeze_seconds, now)
            watch = Watch(change.recommendation_id, change.backend, now, now, before)
            self.watches[change.recommendation_id] = watch
        watch.add(change, now)
        return watch.before if first else None

    def judged_on(self, backend: str) -> str:
        """The backend whose time in the system judges a change of ``backend``: itself, or
        for a pool's batch backend the shared one it was split from, whose interactive
        requests a split is for (the batch backend had no traffic before it); the passes
        observed say whether that one exists."""
        shared = split_from(backend)
        return shared if shared is not None and shared in self.history else backend

    def resume(self, entries: Iterable[Mapping[str, Any]], now: float) -> None:
        """The watches of the audit log's changes not yet verified: its `applied` lines of
        set_weight and admin changes within the freeze (and a ramp's length) before now."""
        found: dict[str, Watch] = {}
        for e in entries:
            rec_id, decision = e.get("recommendation"), e.get("decision")
            if not isinstance(rec_id, str):
                continue
            if decision in ("verified", "undone"):
                found.pop(rec_id, None)
                continue
            change = _change_of(e) if decision == "applied" else None
            if (
                change is None
                or now - float(e["at_seconds"]) > HORIZON_FREEZES * self.freeze_seconds
            ):
                continue
            at = float(e["at_seconds"])
            watch = found.get(rec_id)
            if watch is None:
                before, error = e.get("verify_before_seconds"), e.get("verify_before_error_seconds")
                figure = None
                if isinstance(before, int | float):
                    # a line from before the error was logged: judged on the ratio alone
                    noise = float(error) if isinstance(error, int | float) else 0.0
                    figure = TimeInSystem(float(before), noise)
                watch = found[rec_id] = Watch(rec_id, change.backend, at, at, figure)
            watch.add(change, at)
        self.watches.update(found)

    def due(self, now: float) -> list[Verdict]:
        """The watches whose freeze has passed, judged; those without figures are dropped."""
        out: list[Verdict] = []
        for rec_id, watch in list(self.watches.items()):
            if now - watch.last_at < self.freeze_seconds:
                continue
            del self.watches[rec_id]
            judged = self.judged_on(watch.backend)
            history = self.history.get(judged, ())
            before = watch.before
            after = time_in_system(history, watch.last_at, watch.last_at + self.freeze_seconds)
            if before is None or after is None:
                continue
            slower = worse(before, after, self.worse_ratio)
            out.append(Verdict(watch, before, after, slower and not watch.returned, judged))
        return out
