"""The reconcile loop: observe -> plan -> guard -> act -> record, every `interval_seconds`.

Level-triggered: each pass reads HAProxy's servers and the analyzer's recommendations afresh
and plans from them alone, so a pass that finds HAProxy already as asked does nothing, and a
restarted controller picks up where HAProxy is. What HAProxy cannot show, the changes this
controller made (rate limit, freezes, breaker) and a person's pause, comes back from the audit
log. A recommendation the controller has acknowledged (the analyzer lists its acks) is
finished.

An unreachable HAProxy socket or analyzer means no action in that pass, `source_up` 0, and the
next pass after a doubling back-off (up to `MAX_BACKOFF_SECONDS`).

With a `Mover` (a worker supervisor configured), each pass also observes the workers, and
moves a GPU's worker between pools one step per pass (mover.py); `move_worker`
recommendations go to it, and the other changes leave the server in flight alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from gpubalance.controller import tracing
from gpubalance.controller.actuator import Actuator, ActuatorError
from gpubalance.controller.analyzer_client import AnalyzerClient, AnalyzerError
from gpubalance.controller.audit import AuditLog
from gpubalance.controller.backpressure import backend_counts
from gpubalance.controller.guard import HOUR_SECONDS, guard
from gpubalance.controller.haproxy import RuntimeApi, RuntimeApiError
from gpubalance.controller.metrics import Metrics
from gpubalance.controller.model import (
    Applied,
    Change,
    Observed,
    Refusal,
    Settings,
    observed_from,
)
from gpubalance.controller.plan import plan, plan_moves
from gpubalance.controller.verify import Verdict, Verifier
from gpubalance.diagnosis import AckStatus

if TYPE_CHECKING:
    from gpubalance.controller.mover import Mover

log = logging.getLogger("gpubalance.controller")

MAX_BACKOFF_SECONDS = 300.0
IDENTITY = "gpubalance-controller"


@dataclass(slots=True)
class PassReport:
    """What one pass saw and did, for `GET /api/v1/status` and the tests."""

    at_seconds: float
    ok: bool
    error: str | None = None
    servers: int = 0
    recommendations: int = 0
    planned: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    met: list[str] = field(default_factory=list)
    moving: str | None = None  # what the move in flight waits for


class Controller:
    def __init__(
        self,
        api: RuntimeApi,
        actuator: Actuator,
        analyzer: AnalyzerClient,
        audit: AuditLog,
        metrics: Metrics,
        settings: Settings,
        *,
        identity: str = IDENTITY,
        clock: Callable[[], float] = time.time,
        mover: Mover | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.api = api
        self.actuator = actuator
        self.analyzer = analyzer
        self.audit = audit
        self.metrics = metrics
        self.settings = settings
        self.identity = identity
        self.clock = clock
        self.mover = mover
        self.tracer = tracer or trace.NoOpTracer()
        self.history: list[Applied] = audit.applied_since(clock() - self._horizon)
        self.breaker_open = audit.breaker_open()
        self.rearmed_at = audit.last_rearm()
        self.paused = audit.paused()
        self.failures = 0  # passes failed in a row: the back-off
        self.last: PassReport | None = None
        self.passes = 0
        self._seen: dict[str, int] = {}
        self._acked: set[str] = set()
        # (recommendation, target, decision, reason): a waiting decision is logged once
        self._said: set[tuple[str, str, str, str]] = set()
        self.verifier = Verifier(settings.freeze_seconds, settings.undo_worse_ratio)
        self.verifier.resume(audit.entries(), clock())
        metrics.dry_run.set(0 if settings.act else 1)
        metrics.breaker_tripped.set(1 if self.breaker_open else 0)
        metrics.paused.set(1 if self.paused else 0)

    @property
    def _horizon(self) -> float:
        return max(HOUR_SECONDS, self.settings.breaker_window_seconds, self.settings.freeze_seconds)

    def next_delay(self) -> float:
        if self.failures == 0:
            return self.settings.interval_seconds
        return min(self.settings.interval_seconds * 2**self.failures, MAX_BACKOFF_SECONDS)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.run_once()
            except Exception:
                # a bug or an answer nobody foresaw costs this pass, not the process
                log.exception("pass failed; retrying with back-off")
                self.failures += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.next_delay())

    async def run_once(self) -> PassReport:
        started = time.monotonic()
        # a span per pass: its audit lines are its events, its changes its child spans
        with self.tracer.start_as_current_span("controller pass") as span:
            try:
                report = await self._pass()
            finally:
                self.metrics.cycle_duration.observe(time.monotonic() - started)
            span.set_attributes(
                tracing.attributes(
                    {
                        "dry_run": not self.settings.act,
                        "servers": report.servers,
                        "recommendations": report.recommendations,
                        "planned": len(report.planned),
                        "applied": len(report.applied),
                        "refused": len(report.refused),
                        "met": len(report.met),
                        "moving": report.moving,
                    },
                    "gpubalance.pass.",
                )
            )
            if not report.ok:
                span.set_status(trace.StatusCode.ERROR, report.error)
        self.failures = 0 if report.ok else self.failures + 1
        self.passes += 1
        self.last = report
        return report

    def _source_failed(self, source: str, now: float, exc: Exception) -> PassReport:
        self.metrics.source_up.labels(source).set(0)
        self.metrics.source_errors.labels(source).inc()
        log.warning("%s; no action this pass, retrying with back-off", exc)
        return PassReport(at_seconds=now, ok=False, error=str(exc))

    async def _pass(self) -> PassReport:
        now = self.clock()
        # observe
        try:
            states = await asyncio.to_thread(self.api.show_servers_state)
            stats = await asyncio.to_thread(self.api.show_stat)
        except RuntimeApiError as exc:
            return self._source_failed("haproxy", now, exc)
        except (KeyError, ValueError, IndexError) as exc:
            unreadable = RuntimeApiError(
                f"HAProxy's answer on {self.api.socket_path} is not `show stat` / `show servers "
                f"state` as this client reads them: {exc!r}"
            )
            return self._source_failed("haproxy", now, unreadable)
        self.metrics.source_up.labels("haproxy").set(1)
        self.metrics.backends(backend_counts(stats, self.settings.backends))
        try:
            recommendations = await self.analyzer.recommendations()
        except AnalyzerError as exc:
            return self._source_failed("analyzer", now, exc)
        self.metrics.source_up.labels("analyzer").set(1)
        observed = observed_from(states, stats, now, self.settings.backends)
        self.metrics.servers(observed)
        self.verifier.observe(observed)
        self._returned(observed, now)
        # what the analyzer no longer lists cannot come back to be logged or acked
        listed = {r.id for r in recommendations}
        if self.mover is not None:
            # a person's approved move waits in the mover, not in the analyzer's list
            listed |= {m.recommendation_id for m in self.mover.approved}
        # one it acked that the analyzer lists without that ack asks anew (the analyzer drops
        # the acks of a recommendation that changed what it asks): planned again, and its
        # decisions logged again
        asks_anew = {
            r.id
            for r in recommendations
            if r.id in self._acked and not any(a.by == self.identity for a in r.acks)
        }
        self._acked = {i for i in self._acked if i in listed and i not in asks_anew}
        self._said = {said for said in self._said if said[0] in listed and said[0] not in asks_anew}
        open_recs = [
            r
            for r in recommendations
            if r.id not in self._acked and not any(a.by == self.identity for a in r.acks)
        ]
        # dwell: the passes that saw it, or as many intervals as its evidence has held (the
        # analyzer dates it from the first of the windows that agree on it): a situation that
        # already held that long needs no second wait, also after a restart
        self._seen = {
            r.id: max(
                self._seen.get(r.id, 0) + 1,
                math.floor((now - r.created_seconds) / self.settings.interval_seconds + 1e-9),
            )
            for r in open_recs
        }
        self.history = [a for a in self.history if now - a.at_seconds < self._horizon]
        # with a mover, moves are its own; without one, plan refuses them as unsupported
        moving = self.mover is not None
        moves = [r for r in open_recs if moving and r.action == "move_worker"]
        others = [r for r in open_recs if not (moving and r.action == "move_worker")]
        workers = await self.mover.observe() if self.mover is not None else {}

        # plan, guard
        # servers it took out of rotation itself, as its log says: a share for one readies it
        planned = plan(observed, others, self.history, self.settings, self.audit.taken_out())
        moves, waiting_moves = plan_moves(
            moves, observed, self.history, planned.changes, self.settings
        )
        changes, held = self._hold_moving(planned.changes)
        guarded = guard(
            changes,
            observed,
            self.history,
            self._seen,
            self.settings,
            paused=self.paused,
            breaker_open=self.breaker_open,
            rearmed_at_seconds=self.rearmed_at,
        )
        report = PassReport(
            at_seconds=now,
            ok=True,
            servers=len(observed.servers),
            recommendations=len(open_recs),
            planned=[_describe(c) for c in planned.changes],
        )
        if guarded.tripped is not None:
            self.breaker_open = True
            self.metrics.breaker_tripped.set(1)
            self.audit.record(now, "breaker_tripped", reason=guarded.tripped)
            log.error("blast-radius breaker tripped; no action until POST /api/v1/rearm")

        # record refusals and met recommendations, act
        for refusal in (*planned.refusals, *waiting_moves, *held, *guarded.refusals):
            await self._refuse(refusal, now)
            report.refused.append(f"{refusal.recommendation_id}: {refusal.reason}")
        for rec_id in planned.converged:
            report.met.append(rec_id)
            if self._first("met", rec_id, "", ""):
                self.audit.record(now, "met", recommendation=rec_id, dry_run=not self.settings.act)
            if self.settings.act:
                await self._ack(rec_id, "applied", "HAProxy shows what it asks for")
        for change in guarded.allowed:
            if await self._act(change, now):
                report.applied.append(_describe(change))
        if self.settings.act and not (self.paused or self.breaker_open):
            for verdict in self.verifier.due(now):
                report.applied += await self._verified(verdict, observed, now)
        if self.mover is not None:
            moved = await self.mover.run(
                observed,
                workers,
                moves,
                self._seen,
                self.history,
                paused=self.paused,
                breaker_open=self.breaker_open,
            )
            for refusal in moved.refusals:
                await self._refuse(refusal, now)
                report.refused.append(f"{refusal.recommendation_id}: {refusal.reason}")
            if self.settings.act:
                for rec_id, status, reason in moved.acks:
                    await self._ack(rec_id, status, reason)
            self.history += moved.history
            report.applied += moved.applied
            report.moving = moved.waiting
        return report

    def _returned(self, observed: Observed, now: float) -> None:
        """Forget the servers it took out that HAProxy shows ready again: someone readied
        them, and a later drain or maint of theirs is theirs to undo."""
        for key in sorted(self.audit.taken_out()):
            server = observed.servers.get(key)
            if server is not None and server.admin == "ready":
                self.audit.record(
                    now,
                    "returned",
                    target=key,
                    action="ready",
                    reason="HAProxy shows it ready, readied outside this controller: no longer "
                    "counted as taken out by it",
                )
                log.info("%s was readied outside the controller", key)

    def _hold_moving(self, changes: tuple[Change, ...]) -> tuple[tuple[Change, ...], list[Refusal]]:
        """The changes to servers other than the one moving, and a wait for each of the rest."""
        moving = self.mover.moving_servers() if self.mover is not None else frozenset()
        held = [
            Refusal(
                c.recommendation_id, "moving", f"{c.key} is moving to another pool", None, c.key
            )
            for c in changes
            if c.server in moving
        ]
        return tuple(c for c in changes if c.server not in moving), held

    def approve_move(self, gpu: int, to: str) -> str:
        """A person's approved move (POST /api/v1/moves): admitted at the next pass."""
        if self.mover is None:
            raise ValueError("moves need a worker supervisor: set controller.workers in --config")
        return self.mover.approve(gpu, to)

    def _first(self, decision: str, rec_id: str, target: str, reason: str) -> bool:
        key = (rec_id, target, decision, reason)
        if key in self._said:
            return False
        self._said.add(key)
        return True

    async def _refuse(self, refusal: Refusal, now: float) -> None:
        decision = "waiting" if refusal.ack is None else refusal.ack
        if self._first(decision, refusal.recommendation_id, refusal.target, refusal.reason):
            self.metrics.refusals.labels(refusal.reason).inc()
            self.audit.record(
                now,
                decision,
                recommendation=refusal.recommendation_id,
                target=refusal.target,
                reason=f"{refusal.reason}: {refusal.detail}",
            )
            log.info("%s %s: %s", refusal.recommendation_id, decision, refusal.detail)
        if refusal.ack is not None:
            await self._ack(
                refusal.recommendation_id, refusal.ack, f"{refusal.reason}: {refusal.detail}"
            )

    async def _ack(self, rec_id: str, status: AckStatus, reason: str) -> None:
        if rec_id in self._acked:
            return
        try:
            await self.analyzer.ack(rec_id, status, reason, self.identity)
        except AnalyzerError as exc:
            # the refusal or the met state is derived again next pass, and acked then
            self.metrics.source_errors.labels("analyzer").inc()
            log.warning("ack of %s not delivered: %s", rec_id, exc)
            return
        self._acked.add(rec_id)

    async def _act(self, change: Change, now: float) -> bool:
        fields: dict[str, Any] = {
            "recommendation": change.recommendation_id,
            "target": change.key,
            "action": change.action,
            "before": change.before,
            "after": change.value,
        }
        if not self.settings.act:
            if self._first("dry_run", change.recommendation_id, change.key, str(change.value)):
                self.metrics.actions.labels(change.action, "dry_run").inc()
                self.audit.record(
                    now, "dry_run", reason="dry-run: start with --act to act", **fields
                )
            return False
        try:
            await self._apply(change, fields)
        except ActuatorError as exc:
            self.metrics.actions.labels(change.action, "failed").inc()
            self.audit.record(now, "failed", reason=str(exc), **fields)
            log.error("%s failed: %s", _describe(change), exc)
            return False
        self.history.append(change.applied(now))
        self.metrics.actions.labels(change.action, "applied").inc()
        # a recommendation's first change carries what it is verified against, for a restart
        before = self.verifier.applied(change, now)
        if before is not None:
            fields["verify_before_seconds"] = round(before.seconds, 6)
            fields["verify_before_error_seconds"] = round(before.error_seconds, 6)
        self.audit.record(now, "applied", reason=self.actuator.name, **fields)
        log.info("%s (%s)", _describe(change), change.recommendation_id)
        return True

    async def _apply(self, change: Change, fields: dict[str, Any]) -> None:
        """The actuator's call, as a span of its own (an error it raises marks the span)."""
        with self.tracer.start_as_current_span(
            f"controller {change.action}",
            attributes=tracing.attributes({**fields, "actuator": self.actuator.name}),
        ):
            await self.actuator.apply(change)

    async def _verified(self, verdict: Verdict, observed: Observed, now: float) -> list[str]:
        """Record a recommendation's verification; undo it when it made its backend worse."""
        rec_id = verdict.watch.recommendation_id
        self.metrics.verifications.labels("undone" if verdict.worse else "kept").inc()
        if not verdict.worse:
            self.audit.record(now, "verified", recommendation=rec_id, reason=verdict.reason)
            return []
        undone = []
        for change in verdict.watch.undo(observed):
            fields = {"target": change.key, "action": change.action}
            try:
                await self._apply(change, {"recommendation": rec_id, "undo": True, **fields})
            except ActuatorError as exc:
                self.metrics.actions.labels(change.action, "failed").inc()
                self.audit.record(now, "failed", recommendation=rec_id, reason=str(exc), **fields)
                log.error("undo %s failed: %s", _describe(change), exc)
                continue
            self.history.append(change.applied(now))
            self.metrics.actions.labels(change.action, "undone").inc()
            self.audit.record(
                now,
                "undone",
                recommendation=rec_id,
                before=change.before,
                after=change.value,
                reason=verdict.reason,
                **fields,
            )
            log.warning("%s: %s (%s)", rec_id, verdict.reason, _describe(change))
            undone.append(f"undo: {_describe(change)}")
        # acked, it is finished: the same recommendation is not carried out again
        self._acked.discard(rec_id)
        await self._ack(rec_id, "failed", verdict.reason)
        return undone

    # a person's controls (the HTTP server checks the token)

    def pause(self) -> None:
        self.paused = True
        self.metrics.paused.set(1)
        self.audit.record(self.clock(), "paused")

    def resume(self) -> None:
        self.paused = False
        self.metrics.paused.set(0)
        self.audit.record(self.clock(), "resumed")

    def rearm(self) -> None:
        self.breaker_open = False
        self.rearmed_at = self.clock()
        self.metrics.breaker_tripped.set(0)
        self.audit.record(self.rearmed_at, "rearmed")

    def status(self) -> dict[str, Any]:
        last = self.last
        return {
            "mode": "act" if self.settings.act else "dry_run",
            "actuator": self.actuator.name,
            "paused": self.paused,
            "breaker_open": self.breaker_open,
            "passes": self.passes,
            "failures_in_a_row": self.failures,
            "next_pass_in_seconds": self.next_delay(),
            "applied_last_hour": sum(
                1 for a in self.history if self.clock() - a.at_seconds < HOUR_SECONDS
            ),
            "last_pass": None if last is None else asdict(last),
            "move": None if self.mover is None else self.mover.in_flight(),
        }


def _describe(change: Change) -> str:
    if change.kind == "set_weight":
        return f"set server {change.key} weight {change.value} (was {change.before})"
    return f"set server {change.key} state {change.value} (was {change.before})"
