"""Carries out worker moves for the reconcile loop: admits one, then one step per pass.

Each pass the loop hands over what it observed; `Mover.run` reads the intent record, asks
`move.next_step` what to do, and does it: the HAProxy steps through the runtime API, the
worker steps through the supervisor. A step is written to the intent before it is carried out
and marked once the audit log has it (see move.py). With no move in flight it admits the first
asked-for move that passes the guards: a `move_worker` recommendation seen in `dwell_cycles`
passes, or one a person approved (POST /api/v1/moves); never while paused, with the breaker
open or the hour's actions spent, and in dry-run only recorded.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from opentelemetry import trace

from gpubalance.controller import tracing
from gpubalance.controller.actuator import ActuatorError
from gpubalance.controller.audit import AuditLog
from gpubalance.controller.guard import HOUR_SECONDS
from gpubalance.controller.metrics import Metrics
from gpubalance.controller.model import Applied, Observed, Refusal, RefusalReason, Settings
from gpubalance.controller.move import (
    Act,
    Finished,
    IntentStore,
    MoveIntent,
    MoveLimits,
    MoveRequest,
    Step,
    Undo,
    Wait,
    admit,
    next_step,
    request_of,
)
from gpubalance.controller.runtime_actuator import RuntimeApiActuator
from gpubalance.controller.supervisor import (
    SupervisorError,
    WorkerProcess,
    WorkersConfig,
    WorkerSupervisor,
)
from gpubalance.diagnosis import AckStatus, Recommendation

log = logging.getLogger("gpubalance.controller")

INTENT_FILE = "move-intent.json"
APPROVED = "approved-"  # the id of a move a person approved: no analyzer to acknowledge it to
_ACK_OF: Mapping[str, AckStatus] = {
    "moved": "applied",
    "undone": "failed",
    "failed": "failed",
    "refused": "rejected",
}
# the ends of a move that changed the pools' GPUs on the way (a refused one changed none)
_RESHAPED = frozenset({"moved", "undone", "failed"})


@dataclass(slots=True)
class MovePass:
    """What the mover did in one pass, for the loop to record, ack and report."""

    refusals: list[Refusal] = field(default_factory=list)
    acks: list[tuple[str, AckStatus, str]] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    history: list[Applied] = field(default_factory=list)
    waiting: str | None = None


class Mover:
    def __init__(
        self,
        supervisor: WorkerSupervisor,  # which backend runs the workers: worker_backends
        haproxy: RuntimeApiActuator,
        audit: AuditLog,
        metrics: Metrics,
        settings: Settings,
        session: aiohttp.ClientSession,
        tracer: trace.Tracer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.supervisor = supervisor
        self.clock = clock  # a person's approval's time; a pass's steps go by what it observed
        self.tracer = tracer or trace.NoOpTracer()
        self.haproxy = haproxy
        self.audit = audit
        self.metrics = metrics
        self.settings = settings
        self.session = session
        self.store = IntentStore(self.config.state_dir / INTENT_FILE)
        self.limits = MoveLimits(
            settings.drain_timeout_seconds,
            self.config.ready_timeout_seconds,
            self.config.stop_timeout_seconds,
        )
        self.approved: list[MoveRequest] = []  # by a person, admitted at the next pass
        self._approvals = 0
        self._said: set[str] = set()  # recommendations whose dry run is recorded
        # backend -> (when, GPU) of the last move into or out of it that ended, from the
        # audit log: what a restarted controller knows of it as well
        self._reshaped: dict[str, tuple[float, int]] = {}
        for entry in audit.entries():
            if entry.get("action") == "move" and entry.get("decision") in _RESHAPED:
                self._note_reshaped(entry)
        metrics.moves_in_flight.set(0 if self.store.load() is None else 1)

    @property
    def config(self) -> WorkersConfig:
        return self.supervisor.config

    def approve(self, gpu: int, to: str) -> str:
        self._approvals += 1
        now = self.clock()
        request_id = f"{APPROVED}{int(now)}-{self._approvals}"
        self.approved.append(MoveRequest(request_id, gpu, to, f"gpu:{gpu}"))
        self.audit.record(now, "approved", recommendation=request_id, target=f"gpu:{gpu}", after=to)
        return request_id

    def in_flight(self) -> dict[str, Any] | None:
        intent = self.store.load()
        if intent is None:
            return None
        last = intent.last
        return {
            "id": intent.id,
            "gpu": intent.gpu,
            "from": intent.source,
            "to": intent.target,
            "phase": intent.phase,
            "last_step": None if last is None else last.action,
        }

    def moving_servers(self) -> frozenset[str]:
        """The HAProxy server name of the GPU in flight, which other changes leave alone."""
        intent = self.store.load()
        return frozenset() if intent is None else frozenset({intent.server})

    async def observe(self) -> dict[int, WorkerProcess]:
        return await self.supervisor.observe(self.session)

    async def run(
        self,
        observed: Observed,
        workers: Mapping[int, WorkerProcess],
        recommendations: Sequence[Recommendation],
        seen_cycles: Mapping[str, int],
        history: Sequence[Applied],
        *,
        paused: bool,
        breaker_open: bool,
    ) -> MovePass:
        done = MovePass()
        intent = self.store.load()
        if intent is None:
            self._admit(
                observed, workers, recommendations, seen_cycles, history, done, paused, breaker_open
            )
        elif paused or breaker_open:
            done.waiting = "paused" if paused else "the breaker is open"
        else:
            await self._advance(intent, observed, workers, done)
        self.metrics.moves_in_flight.set(0 if self.store.load() is None else 1)
        return done

    # admission

    def _admit(
        self,
        observed: Observed,
        workers: Mapping[int, WorkerProcess],
        recommendations: Sequence[Recommendation],
        seen_cycles: Mapping[str, int],
        history: Sequence[Applied],
        done: MovePass,
        paused: bool,
        breaker_open: bool,
    ) -> None:
        now = observed.at_seconds
        requests: list[tuple[MoveRequest, bool]] = [(r, True) for r in self.approved]
        for rec in recommendations:
            parsed = request_of(rec.id, rec.target, rec.parameters)
            if isinstance(parsed, str):
                done.refusals.append(
                    Refusal(rec.id, "bad_parameters", parsed, "rejected", rec.target)
                )
            else:
                requests.append((parsed, False))
        spent = sum(1 for a in history if now - a.at_seconds < HOUR_SECONDS)
        started: MoveIntent | None = None
        for request, approved in requests:
            seen = seen_cycles.get(request.recommendation_id, 0)
            held: tuple[RefusalReason, str] | None = None
            if paused:
                held = ("paused", "the controller is paused (POST /api/v1/resume)")
            elif breaker_open:
                held = ("breaker_open", "the breaker is open; a person re-arms it")
            elif not approved and seen < self.settings.dwell_cycles:
                held = ("dwell", f"seen in {seen} of {self.settings.dwell_cycles} passes")
            if held is not None:
                done.refusals.append(
                    Refusal(request.recommendation_id, *held, None, request.target)
                )
                continue
            move_id = f"move-{int(now * 1000)}-gpu{request.gpu}"
            admission = admit(
                request,
                observed,
                workers,
                started,
                self.config.gpus,
                self.config.server_of(request.gpu),
                move_id,
            )
            if admission.met:
                if approved:
                    self.approved.remove(request)
                else:
                    reason = f"GPU {request.gpu} serves {request.to}"
                    done.acks.append((request.recommendation_id, "applied", reason))
                continue
            if admission.refusal is not None:
                done.refusals.append(admission.refusal)
                if approved and admission.refusal.ack is not None:
                    self.approved.remove(request)
                continue
            assert admission.intent is not None
            changed = self._changed_shape(admission.intent, now)
            if changed is not None and not approved:
                done.refusals.append(
                    Refusal(request.recommendation_id, "frozen", changed, None, request.target)
                )
                continue
            if spent >= self.settings.max_actions_per_hour:
                detail = f"{spent} actions in the last hour"
                done.refusals.append(
                    Refusal(request.recommendation_id, "rate_limited", detail, None, request.target)
                )
                continue
            if not self.settings.act:
                if approved:
                    self.approved.remove(request)
                if request.recommendation_id not in self._said:
                    self._said.add(request.recommendation_id)
                    self.metrics.actions.labels("move", "dry_run").inc()
                    self._record_move(admission.intent, "dry_run", "dry-run: start with --act")
                continue
            if approved:
                self.approved.remove(request)
            started = admission.intent
            self.store.save(started)
            self._record_move(started, "applied", "admitted")
            self.store.save(started.recorded())
            done.history.append(
                Applied(now, f"gpu:{started.gpu}", started.recommendation_id, "move")
            )
            done.applied.append(f"move GPU {started.gpu} {started.source} -> {started.target}")

    def _note_reshaped(self, entry: Mapping[str, Any]) -> None:
        gpu = str(entry.get("target", "")).removeprefix("gpu:")
        for backend in (entry.get("before"), entry.get("after")):
            if isinstance(backend, str) and gpu.isdigit():
                self._reshaped[backend] = (float(entry["at_seconds"]), int(gpu))

    def _changed_shape(self, intent: MoveIntent, now: float) -> str | None:
        """Why the move must wait: a pool it leaves or joins changed its GPUs within the
        freeze. The recommendation was made on windows of the pool's old shape (a move's own
        last window still shows it), so a second move on it stacks on the first unseen."""
        for backend in (intent.source, intent.target):
            when, gpu = self._reshaped.get(backend, (-math.inf, -1))
            if now - when < self.settings.freeze_seconds:
                return (
                    f"{backend} changed its GPUs {now - when:.0f} s ago (GPU {gpu} moved; "
                    f"freeze {self.settings.freeze_seconds:.0f} s): a move waits for its new shape"
                )
        return None

    def _record_move(self, intent: MoveIntent, decision: str, reason: str) -> None:
        self.audit.record(
            intent.created_seconds,
            decision,
            recommendation=intent.recommendation_id,
            target=f"gpu:{intent.gpu}",
            action="move",
            move=intent.id,
            before=intent.source,
            after=intent.target,
            reason=reason,
        )

    # one step of the move in flight

    async def _advance(
        self,
        intent: MoveIntent,
        observed: Observed,
        workers: Mapping[int, WorkerProcess],
        done: MovePass,
    ) -> None:
        now = observed.at_seconds
        last = intent.last
        redo = False
        if last is not None and not last.recorded and self._audited(intent, last):
            # killed after the audit line and before the intent's mark: only the mark is missing
            intent = intent.recorded()
            self.store.save(intent)
            last = intent.last
        if last is not None and last.action == "finish" and last.recorded:
            self.store.clear()  # the end is recorded: only the record was left to remove
            return
        decision = next_step(intent, observed, workers, self.limits)
        if last is not None and not last.recorded:
            if last.action == "begin":
                self._record_move(intent, "applied", "admitted (recorded after a restart)")
                intent = intent.recorded()
                self.store.save(intent)
            else:
                redo = _asks(decision, last, intent)
                if not redo:
                    # it was carried out before the controller stopped: what is observed shows it
                    self._record_step(intent, last, "step", "carried out before a restart")
                    intent = intent.recorded()
                    self.store.save(intent)
        if isinstance(decision, Wait):
            done.waiting = decision.detail
            return
        if isinstance(decision, Undo | Finished) and decision.exited_gpu is not None:
            decision = replace(
                decision, detail=decision.detail + self.supervisor.last_words(decision.exited_gpu)
            )
        if isinstance(decision, Undo):
            await self._carry(intent, Step(intent.phase, "undo", now, decision.detail), redo, done)
            return
        if isinstance(decision, Finished):
            step = Step(intent.phase, "finish", now, decision.detail)
            if not redo:
                self.store.save(intent.with_step(step))
            self._finish(intent, decision, done, now)
            return
        step = Step(intent.phase, decision.action, now, _detail(decision))
        await self._carry(intent, step, redo, done, decision)

    async def _carry(
        self,
        intent: MoveIntent,
        step: Step,
        redo: bool,
        done: MovePass,
        act: Act | None = None,
    ) -> None:
        if redo:
            assert intent.last is not None
            step = intent.last
        else:
            intent = intent.with_step(step)
            self.store.save(intent)  # before the step: a restart finds what was under way
        try:
            if act is not None:
                fields = {"move": intent.id, "gpu": intent.gpu, "phase": step.phase}
                with self.tracer.start_as_current_span(
                    f"controller move {act.action}",
                    attributes=tracing.attributes({**fields, "detail": step.detail}),
                ):
                    await self._execute(intent, act)
        except (ActuatorError, SupervisorError, ValueError) as exc:
            self.metrics.actions.labels(step.action, "failed").inc()
            self._record_step(intent, step, "failed", str(exc))
            log.error("move %s: %s failed: %s", intent.id, step.action, exc)
            if step.action == "start":
                # nothing started: recorded as issued, so the next pass undoes the move
                self.store.save(intent.recorded())
            return
        self._record_step(intent, step, "step", step.detail)
        self.store.save(intent.recorded())
        done.applied.append(f"move {intent.id}: {step.phase} {step.action} {step.detail}".strip())
        log.info("move %s: %s %s", intent.id, step.action, step.detail)

    async def _execute(self, intent: MoveIntent, act: Act) -> None:
        if act.action in ("drain", "maint", "ready"):
            await self.haproxy.set_state(act.backend, act.server, act.action)  # type: ignore[arg-type]
        elif act.action == "del_server":
            await self.haproxy.del_server(act.backend, act.server)
        elif act.action in ("add_server", "set_addr"):
            assert act.worker is not None
            if act.action == "add_server":
                weight = self.config.weight if act.weight is None else act.weight
                await self.haproxy.add_server(
                    act.backend, act.server, act.worker.host, act.worker.port, weight
                )
            else:
                await self.haproxy.set_addr(
                    act.backend, act.server, act.worker.host, act.worker.port
                )
        elif act.action in ("stop", "kill"):
            assert act.worker is not None
            self.supervisor.signal(
                act.worker, signal.SIGTERM if act.action == "stop" else signal.SIGKILL
            )
        elif act.action == "start":
            self.supervisor.start(intent.gpu, act.pool)

    def _finish(self, intent: MoveIntent, finished: Finished, done: MovePass, now: float) -> None:
        outcome = finished.outcome
        self.metrics.actions.labels("move", "applied" if outcome == "moved" else "failed").inc()
        self.audit.record(
            now,
            outcome,
            recommendation=intent.recommendation_id,
            target=f"gpu:{intent.gpu}",
            action="move",
            move=intent.id,
            before=intent.source,
            after=intent.target,
            reason=finished.detail,
        )
        if outcome in _RESHAPED:
            self._note_reshaped(
                {"at_seconds": now, "target": f"gpu:{intent.gpu}"}
                | {"before": intent.source, "after": intent.target}
            )
        self.store.clear()
        if _from_analyzer(intent.recommendation_id):
            done.acks.append((intent.recommendation_id, _ACK_OF[outcome], finished.detail))
        done.applied.append(f"move {intent.id}: {outcome}")
        log.info("move %s %s: %s", intent.id, outcome, finished.detail)

    def _audited(self, intent: MoveIntent, step: Step) -> bool:
        """Whether the audit log has `step` of this move (read only after a restart)."""

        def has(entry: dict[str, Any]) -> bool:
            if step.action == "begin":
                return entry.get("decision") == "applied" and entry.get("action") == "move"
            if step.action == "finish":
                return entry.get("decision") in _ACK_OF and entry.get("action") == "move"
            return (
                entry.get("decision") == "step"
                and entry.get("action") == step.action
                and entry.get("phase") == step.phase
            )

        return any(e.get("move") == intent.id and has(e) for e in self.audit.entries())

    def _record_step(self, intent: MoveIntent, step: Step, decision: str, reason: str) -> None:
        self.audit.record(
            step.at_seconds,
            decision,
            recommendation=intent.recommendation_id,
            target=f"gpu:{intent.gpu}",
            action=step.action,
            move=intent.id,
            phase=step.phase,
            reason=reason,
        )


def _asks(decision: object, last: Step, intent: MoveIntent) -> bool:
    """Whether the next step is the one left unmarked: then it never happened."""
    if isinstance(decision, Act):
        return decision.action == last.action and last.phase == intent.phase
    if isinstance(decision, Finished):
        return last.action == "finish"
    return False


def _from_analyzer(recommendation_id: str) -> bool:
    return not recommendation_id.startswith(APPROVED)


def _detail(act: Act) -> str:
    where = f"{act.backend}/{act.server}" if act.backend else ""
    return " ".join(part for part in (where, act.detail) if part)
