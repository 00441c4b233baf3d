"""The closed loop at the fast speed: the real analyzer and the real controller on a lab run.

The run advances one analysis window at a time. At each window's end the analyzer's own
service (:class:`~gpubalance.analyzer.service.AnalyzerService`, with the classifier given and
the capacity model's `Recommender`) reads the run's telemetry samples as it reads an exporter's
history, and the controller's own loop (:class:`~gpubalance.controller.loop.Controller`: plan,
guard, audit) takes a pass, and one every controller interval until the next window's end (as
`gpubalance run` deploys them: windows of 30 s, a pass every 10 s), through three lab parts in
place of HAProxy and HTTP:

- :class:`LabBalancer`, the observer: the simulated router's servers as HAProxy's `show servers
  state` and `show stat` rows (a backend `be_<pool>` per pool, as the live lab names them; a
  server per worker, its weight, admin state, requests in flight, up unless crashed or lost;
  and where a pool serves the batch class beside another, its batch backend `be_<pool>_batch`,
  the same workers in maint, which the batch class goes to while one is ready, as the live
  lab's HAProxy routes it);
- :class:`LabActuator`, the `Actuator`: a weight becomes the router's weight from that instant
  on, `drain` and `maint` stop new requests to the worker through that backend (those in
  flight finish), `ready` resumes them;
- :class:`ServiceClient`: the analyzer service's recommendations and acks, as the controller's
  HTTP client gives them.

Weights are HAProxy's whole numbers 0..256: the run starts with the scenario's weights rounded
(a worker it does not name weighs 1, as in HAProxy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import signal
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
from gpubalance.controller.haproxy import MAX_WEIGHT, AdminState, ServerStat, ServerState
from gpubalance.controller.loop import Controller, PassReport
from gpubalance.controller.metrics import Metrics
from gpubalance.controller.model import Change, Settings
from gpubalance.controller.mover import Mover
from gpubalance.controller.plan import batch_backend
from gpubalance.controller.supervisor import SupervisorError, WorkerProcess, WorkersConfig
from gpubalance.diagnosis import AckStatus, Recommendation
from gpubalance.lab.fast import ORIGIN_SECONDS, FastRun, WorkerState
from gpubalance.lab.live.haproxy import backend_pool, pool_backend, stat_algorithm
from gpubalance.telemetry import Sample

# srv_admin_state bits as `show servers state` reports them (SRV_ADMF_FMAINT, SRV_ADMF_FDRAIN)
_ADMIN_BITS = {"ready": 0, "drain": 0x08, "maint": 0x01}
# windows of telemetry the analyzer reads each cycle (10 minutes at 30 s): more than an
# exporter's default 300 s of history, less than a Prometheus source can give; the capacity
# model fits on what they hold
HISTORY_WINDOWS = 20
# while a move is in flight, the controller passes this often (simulated seconds): one step
# of the move each, from drain to ready, as a live controller would at a short interval
MOVE_STEP_SECONDS = 2.0
# a pass runs just after a window's last sample (SimPy runs the events due at a time only
# once the clock moves past it)
_AFTER = 1e-6


def backend_of(worker: WorkerState) -> str:
    return pool_backend(worker.plan.pool)


def batch_backend_of(worker: WorkerState) -> str:
    return batch_backend(backend_of(worker))


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

    def _servers(self) -> list[_Server]:
        """The workers whose server is in a pool now (a move takes it out, then adds it), in
        their pool's backend, and in its batch backend where the pool has one."""
        run = self.run
        out = []
        for w in run.workers:
            if w not in run.pools[w.plan.pool]:
                continue
            via_batch = run.held_via_batch(w) if w.plan.pool == run.split_pool else 0
            done_via_batch = run.batch_done.get(w.name, 0)
            admin = run.router.states.get(w.name, "ready")
            served = w.requests_done - done_via_batch
            out.append(_Server(backend_of(w), w, admin, w.in_flight - via_batch, served))
            if w.plan.pool == run.split_pool:
                admin = run.batch_states.get(w.name, "maint")
                out.append(_Server(batch_backend_of(w), w, admin, via_batch, done_via_batch))
        return out

    def show_servers_state(self) -> list[ServerState]:
        return [
            ServerState(
                backend=s.backend,
                server=s.worker.name,
                address="127.0.0.1",
                port=0,
                op_state=2 if s.worker.up else 0,
                admin_state=_ADMIN_BITS[s.admin],
                uweight=haproxy_weight(self.run.router.weight(s.worker.name)),
                iweight=self.initial[s.worker.name],
            )
            for s in self._servers()
        ]

    def show_stat(self) -> list[ServerStat]:
        servers = self._servers()
        rows = [
            _stat_row(
                s.backend,
                s.worker.name,
                s.status,
                [s.worker],
                self.run,
                uweight=haproxy_weight(self.run.router.weight(s.worker.name)),
                scur=s.sessions,
                stot=s.served,
            )
            for s in servers
        ]
        # each backend's BACKEND row, with the balance algorithm as HAProxy's row names it
        names = [pool_backend(pool) for pool in self.run.pools]
        if self.run.split_pool is not None:
            names.append(batch_backend(pool_backend(self.run.split_pool)))
        for backend in sorted(names):
            mine = [s for s in servers if s.backend == backend]
            rows.append(
                _stat_row(
                    backend,
                    "BACKEND",
                    "UP" if any(s.worker.up for s in mine) else "DOWN",
                    [s.worker for s in mine],
                    self.run,
                    algo=stat_algorithm(self.run.router.policy),
                    scur=sum(s.sessions for s in mine),
                    stot=sum(s.served for s in mine),
                )
            )
        return rows


@dataclass(frozen=True, slots=True)
class _Server:
    """A worker as one backend's server."""

    backend: str
    worker: WorkerState
    admin: str
    sessions: int  # the requests it holds that came through this backend
    served: int  # its requests answered that came through this backend

    @property
    def status(self) -> str:
        if not self.worker.up:
            return "DOWN"
        return {"drain": "DRAIN", "maint": "MAINT"}.get(self.admin, "UP")


def _stat_row(
    pxname: str,
    svname: str,
    status: str,
    workers: Sequence[WorkerState],
    run: FastRun,
    **known: object,
) -> ServerStat:
    """A `show stat` row over ``workers`` (one for a server's, a pool's for its BACKEND): the
    columns the simulated router knows, ``known`` ones besides, the rest empty."""
    row = ServerStat(
        pxname=pxname,
        svname=svname,
        type="backend" if svname == "BACKEND" else "server",
        status=status,
        weight=sum(haproxy_weight(run.router.weight(w.name)) for w in workers),
        uweight=None,
        scur=sum(w.in_flight for w in workers),
        smax=0,
        slim=None,
        stot=sum(w.requests_done for w in workers),
        qcur=None,
        qmax=None,
        rate=None,
        econ=None,
        eresp=None,
        hrsp_5xx=None,
        qtime_seconds=None,
        ttime_seconds=None,
    )
    return dataclasses.replace(row, **known)  # type: ignore[arg-type]


class LabActuator:
    """Carries a `Change` out on the simulated router, from the run's current instant on."""

    name = "lab"

    def __init__(self, run: FastRun) -> None:
        self.run = run

    def _server(self, backend: str, server: str) -> WorkerState:
        worker = self.run.by_name.get(server)
        split = worker is not None and worker.plan.pool == self.run.split_pool
        if (
            worker is None
            or backend not in (backend_of(worker), *([batch_backend_of(worker)] if split else []))
            or worker not in self.run.pools[worker.plan.pool]
        ):
            raise ActuatorError(f"the lab has no server {backend}/{server}")
        return worker

    async def apply(self, change: Change) -> None:
        self._server(change.backend, change.server)
        router = self.run.router
        if change.kind == "set_weight":
            # one weight per worker: the controller weighs a worker's servers in its pool's
            # backend and its batch backend alike (the same share)
            assert isinstance(change.value, int)
            if not 0 <= change.value <= MAX_WEIGHT:
                raise ActuatorError(f"weight {change.value} of {change.key} is outside 0..256")
            router.weights[change.server] = float(change.value)
        else:
            await self.set_state(change.backend, change.server, change.value)  # type: ignore[arg-type]

    # the runtime API's server commands, as the mover issues them (RuntimeApiActuator's)

    async def set_state(self, backend: str, server: str, state: AdminState) -> None:
        worker = self._server(backend, server)
        if state not in ("ready", "drain", "maint"):
            raise ActuatorError(f"state {state!r} of {backend}/{server} is not ready|drain|maint")
        if backend == batch_backend_of(worker):
            self.run.set_batch_state(server, str(state))
        elif state == "ready":
            self.run.set_server_state(server, None)
        else:
            self.run.set_server_state(server, str(state))

    async def add_server(
        self, backend: str, server: str, host: str, port: int, weight: int
    ) -> None:
        """As HAProxy's `add server`: in maint until `ready`."""
        worker = self.run.by_name.get(server)
        if worker is None or backend_of(worker) != backend:
            raise ActuatorError(f"no worker {server} of backend {backend} runs in the lab")
        if worker in self.run.pools[worker.plan.pool]:
            raise ActuatorError(f"backend {backend} has a server {server} already")
        self.run.set_server_state(server, "maint")
        self.run.router.weights[server] = float(weight)
        self.run.add_server(server)

    async def del_server(self, backend: str, server: str) -> None:
        self._server(backend, server)
        self.run.remove_server(server)

    async def set_addr(self, backend: str, server: str, host: str, port: int) -> None:
        self._server(backend, server)  # the lab's servers have no address to change


class LabSupervisor:
    """The worker supervisor's part on a fast-speed run: the GPUs' worker processes as the
    supervisor observes them (`WorkerProcess`, its pool the backend it serves), started and
    stopped in the simulation. A worker is ready once its model has loaded."""

    def __init__(self, run: FastRun, state_dir: Path) -> None:
        self.run = run
        gpus = tuple(g.plan.index for g in run.gpus)
        for gpu in gpus:
            if run.worker_on(gpu).name != f"w{gpu}":
                raise ValueError(f"moves need the lab's worker names w<gpu>; GPU {gpu} has another")
        weights = sorted(haproxy_weight(run.router.weight(w.name)) for w in run.workers)
        self.config = WorkersConfig(
            command=("lab-worker", "{port}"),  # never run: the simulation starts workers
            gpus=gpus,
            server_name="w{gpu}",
            # a move's load and its first health check, and a SIGTERM, in simulated time
            ready_timeout_seconds=max(run.load_seconds(w) for w in run.plan.workers) * 3,
            # a server added to a pool none of whose servers serve (the mover gives one its
            # serving peers' weight otherwise)
            weight=weights[len(weights) // 2],
            state_dir=state_dir,
        )

    def _process(self, worker: WorkerState) -> WorkerProcess:
        return WorkerProcess(
            gpu=worker.plan.gpu,
            pool=backend_of(worker),
            pid=worker.pid,
            host="127.0.0.1",
            port=0,
            started_seconds=ORIGIN_SECONDS + worker.started_seconds,
            ready=worker.process in ("running", "stopping"),
        )

    async def observe(self, session: object) -> dict[int, WorkerProcess]:
        return {w.plan.gpu: self._process(w) for w in self.run.workers if w.process != "stopped"}

    def signal(self, worker: WorkerProcess, signum: int) -> None:
        name = self.run.worker_on(worker.gpu).name
        if signum == signal.SIGKILL:
            self.run.kill_worker(name)
        else:
            self.run.stop_worker(name)

    def start(self, gpu: int, pool: str) -> WorkerProcess:
        try:
            return self._process(self.run.start_worker(gpu, backend_pool(pool)))
        except ValueError as exc:
            raise SupervisorError(str(exc)) from exc


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
    move_step_seconds: float = MOVE_STEP_SECONDS

    def _next_window_end(self) -> float:
        now = self.run.env.now
        return (math.floor(now / self.window_seconds + 1e-9) + 1) * self.window_seconds

    def step(self) -> PassReport:
        """Run to the end of the next window; the analyzer's cycle, then one controller pass;
        then, up to the next window's end, a pass every controller interval, as the deployed
        controller passes between the analyzer's windows (`gpubalance run`: windows of 30 s,
        passes every 10 s), and while a move is in flight, every `move_step_seconds` (a move
        takes a step per pass). Returns the window's first pass."""
        end = self._next_window_end()
        self.run.advance(end + _AFTER)
        self.service.cycle()
        for recommendation in self.service.recommendations().recommendations:
            self.recommended[recommendation.id] = recommendation.action
        report = self._pass()
        mover = self.controller.mover
        next_end = self._next_window_end()
        while True:
            moving = mover is not None and mover.in_flight() is not None
            step = self.move_step_seconds if moving else self.controller.settings.interval_seconds
            at = self.run.env.now + step
            if at >= next_end - _AFTER or at > self.run.duration:
                break
            self.run.advance(at)
            self._pass()
        return report

    def _pass(self) -> PassReport:
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
    moves: bool | None = None,
) -> ClosedLoop:
    """Analyzer and controller on ``run`` (started: :meth:`FastRun.start`), the analyzer's
    cycle at the end of each analysis window (the scenario's truth window, as
    `gpubalance.lab.apply` uses), the controller's passes at its settings' interval. With
    ``moves`` (by default: when the scenario has more than one pool) the controller has a
    mover, which moves GPUs between the pools through `LabSupervisor` and `LabActuator`."""
    window = run.scenario.truth_window_seconds
    if moves is None:
        moves = len(run.pools) > 1

    def clock() -> float:  # both read the simulated time, in Unix seconds as the frames carry
        return ORIGIN_SECONDS + run.env.now

    service = AnalyzerService(
        RunSource(run),
        classifier,
        recommender or Recommender(),
        window_seconds=window,
        clock=clock,
    )
    actuator = LabActuator(run)
    audit, metrics = AuditLog(audit_path), Metrics()
    mover = None
    if moves:
        mover = Mover(
            LabSupervisor(run, audit_path.parent / "moves"),
            actuator,  # type: ignore[arg-type]  # RuntimeApiActuator's server commands
            audit,
            metrics,
            settings,
            None,  # type: ignore[arg-type]  # no HTTP: the lab's workers are not asked
            clock=clock,
        )
    controller = Controller(
        LabBalancer(run),  # type: ignore[arg-type]  # RuntimeApi's reads, on the lab
        actuator,
        ServiceClient(service),  # type: ignore[arg-type]  # AnalyzerClient's two calls
        audit,
        metrics,
        settings,
        clock=clock,
        mover=mover,
    )
    return ClosedLoop(run, service, controller, window)
