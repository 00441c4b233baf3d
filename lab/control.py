"""The closed loop at the fast speed: the real analyzer and the real controller on a lab run.

The run advances one analysis window at a time. At each window's end the analyzer's own
service (:class:`~gpubalance.analyzer.service.AnalyzerService`, with the classifier given and
the capacity model's `Recommender`) reads the run's telemetry samples as it reads an exporter's
history, and the controller's own loop (:class:`~gpubalance.controller.loop.Controller`: plan,
guard, audit) takes one pass through three lab parts in place of HAProxy and HTTP:

- :class:`LabBalancer`, the observer: the simulated router's servers as HAProxy's `show servers
  state` and `show stat` rows (a backend `be_<pool>` per pool, as the live lab names them; a
  server per worker, its weight, admin state, requests in flight, up unless crashed or lost);
- :class:`LabActuator`, the `Actuator`: a weight becomes the router's weight from that instant
  on, `drain` and `maint` stop new requests to the worker (those in flight finish), `ready`
  resumes them;
- :class:`ServiceClient`: the analyzer service's recommendations and acks, as the controller's
  HTTP client gives them.

Weights are HAProxy's whole numbers 0..256: the run starts with the scenario's weights rounded
(a worker it does not name weighs 1, as in HAProxy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpubalance.analyzer.frames import GpuFrame
from gpubalance.analyzer.recommend import Recommender
from gpubalance.analyzer.service import (
    AnalyzerService,
    ExpiredRecommendation,
    UnknownRecommendation,
)
from gpubalance.analyzer.sources import Recording
from gpubalance.analyzer.verdict import Classifier
from gpubalance.controller.actuator import ActuatorError
from gpubalance.controller.analyzer_client import AnalyzerError
from gpubalance.controller.audit import AuditLog
from gpubalance.controller.haproxy import MAX_WEIGHT, ServerStat, ServerState
from gpubalance.controller.loop import Controller, PassReport
from gpubalance.controller.metrics import Metrics
from gpubalance.controller.model import Change, Settings
from gpubalance.diagnosis import AckStatus, Recommendation
from gpubalance.lab.fast import ORIGIN_SECONDS, FastRun, WorkerState
from gpubalance.telemetry import Sample

# srv_admin_state bits as `show servers state` reports them (SRV_ADMF_FMAINT, SRV_ADMF_FDRAIN)
_ADMIN_BITS = {"ready": 0, "drain": 0x08, "maint": 0x01}
# windows of telemetry the analyzer reads each cycle (10 minutes at 30 s): more than an
# exporter's default 300 s of history, less than a Prometheus source can give; the capacity
# model fits on what they hold
HISTORY_WINDOWS = 20
# a pass runs just after a window's last sample (SimPy runs the events due at a time only
# once the clock moves past it)
_AFTER = 1e-6


def backend_of(worker: WorkerState) -> str:
    return f"be_{worker.plan.pool}"


def haproxy_weight(weight: float) -> int:
    """A lab weight as HAProxy holds it: a whole number 0..256, above 0 unless it is 0."""
    if weight <= 0:
        return 0
    return min(MAX_WEIGHT, max(1, round(weight)))


class LabBalancer:
    """HAProxy's runtime view of a fast-speed run: what the controller observes."""

    def __init__(self, run: FastRun) -> None:
        self.run = run
        self.socket_path = f"(the lab's simulated router, scenario {run.scenario.name})"
        self.initial = {w.name: haproxy_weight(run.router.weight(w.name)) for w in run.workers}

    def _status(self, worker: WorkerState) -> str:
        if not worker.up:
            return "DOWN"
        return {"drain": "DRAIN", "maint": "MAINT"}.get(self._admin(worker), "UP")

    def _admin(self, worker: WorkerState) -> str:
        return self.run.router.states.get(worker.name, "ready")

    def show_servers_state(self) -> list[ServerState]:
        return [
            ServerState(
                backend=backend_of(w),
                server=w.name,
                address="127.0.0.1",
                port=0,
                op_state=2 if w.up else 0,
                admin_state=_ADMIN_BITS[self._admin(w)],
                uweight=haproxy_weight(self.run.router.weight(w.name)),
                iweight=self.initial[w.name],
            )
            for w in self.run.workers
        ]

    def show_stat(self) -> list[ServerStat]:
        return [
            ServerStat(
                pxname=backend_of(w),
                svname=w.name,
                type="server",
                status=self._status(w),
                weight=haproxy_weight(self.run.router.weight(w.name)),
                uweight=haproxy_weight(self.run.router.weight(w.name)),
                scur=w.in_flight,
                smax=0,
                slim=None,
                stot=w.requests_done,
                qcur=None,
                qmax=None,
                rate=None,
                econ=None,
                eresp=None,
                hrsp_5xx=None,
                qtime_seconds=None,
                ttime_seconds=None,
            )
            for w in self.run.workers
        ]


class LabActuator:
    """Carries a `Change` out on the simulated router, from the run's current instant on."""

    name = "lab"

    def __init__(self, run: FastRun) -> None:
        self.run = run

    async def apply(self, change: Change) -> None:
        worker = self.run.by_name.get(change.server)
        if worker is None or backend_of(worker) != change.backend:
            raise ActuatorError(f"the lab has no server {change.key}")
        router = self.run.router
        if change.kind == "set_weight":
            assert isinstance(change.value, int)
            if not 0 <= change.value <= MAX_WEIGHT:
                raise ActuatorError(f"weight {change.value} of {change.key} is outside 0..256")
            router.weights[change.server] = float(change.value)
        elif change.value == "ready":
            router.states.pop(change.server, None)
        elif change.value in ("drain", "maint"):
            router.states[change.server] = str(change.value)
        else:
            raise ActuatorError(f"state {change.value!r} of {change.key} is not ready|drain|maint")


class RunSource:
    """The analyzer's source on a running lab: its telemetry samples so far, windows from the
    run's start, the last `history_windows` of them (as an exporter's or Prometheus' history)."""

    def __init__(self, run: FastRun, history_windows: int = HISTORY_WINDOWS) -> None:
        self.run = run
        self.history_windows = history_windows
        self.description = f"lab run {run.scenario.name} (fast speed)"

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[GpuFrame]:
        samples: list[Sample] = self.run.samples
        # whole windows only: the history starts at a window's start
        now = self.run.env.now
        first = max(0, math.floor(now / window_seconds) - self.history_windows) * window_seconds
        kept = tuple(s for s in samples if s.timestamp_seconds - ORIGIN_SECONDS > first)
        if not kept:
            return []
        interval = self.run.scenario.interval_seconds
        return Recording(kept[0].hostname, interval, kept, ORIGIN_SECONDS).frames(window_seconds)


class ServiceClient:
    """The controller's analyzer client over the analyzer service itself, without HTTP."""

    def __init__(self, service: AnalyzerService) -> None:
        self.service = service

    async def recommendations(self) -> list[Recommendation]:
        return list(self.service.recommendations().recommendations)

    async def ack(self, recommendation_id: str, status: AckStatus, reason: str, by: str) -> None:
        try:
            self.service.ack(recommendation_id, status, reason, by)
        except (UnknownRecommendation, ExpiredRecommendation) as exc:
            raise AnalyzerError(str(exc)) from exc


@dataclass(slots=True)
class ClosedLoop:
    """A run with the analyzer and the controller on it: :meth:`step` by step, or
    :meth:`run_to_end`."""

    run: FastRun
    service: AnalyzerService
    controller: Controller
    window_seconds: float
    reports: list[PassReport] = dataclasses.field(default_factory=list)
    # every recommendation the analyzer made over the run: id -> action
    recommended: dict[str, str] = dataclasses.field(default_factory=dict)

    def _next_window_end(self) -> float:
        now = self.run.env.now
        return (math.floor(now / self.window_seconds + 1e-9) + 1) * self.window_seconds

    def step(self) -> PassReport:
        """Run to the end of the next window; the analyzer's cycle, then one controller pass."""
        self.run.advance(self._next_window_end() + _AFTER)
        self.service.cycle()
        for recommendation in self.service.recommendations().recommendations:
            self.recommended[recommendation.id] = recommendation.action
        report = asyncio.run(self.controller.run_once())
        self.reports.append(report)
        return report

    def run_to_end(self) -> None:
        """A pass at the end of every whole window left (the run's :meth:`FastRun.finish`
        then answers what is in flight)."""
        while self._next_window_end() <= self.run.duration:
            self.step()


def closed_loop(
    run: FastRun,
    classifier: Classifier,
    settings: Settings,
    audit_path: Path,
    *,
    recommender: Recommender | None = None,
) -> ClosedLoop:
    """Analyzer and controller on ``run`` (started: :meth:`FastRun.start`), one pass per
    analysis window (the scenario's truth window, as `gpubalance.lab.apply` uses)."""
    window = run.scenario.truth_window_seconds

    def clock() -> float:  # both read the simulated time, in Unix seconds as the frames carry
        return ORIGIN_SECONDS + run.env.now

    service = AnalyzerService(
        RunSource(run),
        classifier,
        recommender or Recommender(),
        window_seconds=window,
        clock=clock,
    )
    controller = Controller(
        LabBalancer(run),  # type: ignore[arg-type]  # RuntimeApi's reads, on the lab
        LabActuator(run),
        ServiceClient(service),  # type: ignore[arg-type]  # AnalyzerClient's two calls
        AuditLog(audit_path),
        Metrics(),
        settings,
        clock=clock,
    )
    return ClosedLoop(run, service, controller, window)
