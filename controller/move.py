"""A worker's move from one pool to another, one step per pass, decided from what is observed.

A GPU serves one pool (an HAProxy backend) through one worker process, which is the backend's
server `WorkersConfig.server_name` ("gpu2"). Moving the GPU to another pool is, in order: drain
its server -> wait until its sessions reach 0 (at most `drain_timeout_seconds`) -> `maint` ->
stop its worker -> `del server` -> start the other pool's worker on the GPU -> wait until its
health check answers -> `add server` (in `maint`) -> `ready` -> up. A worker that exits while
it loads, or is not ready in time, is undone: the same steps take the GPU back to its old pool.

`next_step` is pure: HAProxy's servers, the supervisor's workers, and one `MoveIntent`, the
only thing a move keeps that cannot be observed (which move, which way, the steps issued and
when), decide the next step. Every step is written to the intent before it is carried out, and
marked once the audit log has it; so after a `kill -9` the step left unmarked is either seen
done (HAProxy or /proc shows what it did; it is recorded then) or is still the next step (it
never happened; it is carried out now), and none is done twice. `IntentStore` writes the record
atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from gpubalance.controller.model import Observed, Refusal, RefusalReason, server_key
from gpubalance.controller.supervisor import WorkerProcess

Phase = Literal["move", "undo"]
StepAction = Literal[
    "begin",  # the move was admitted
    "drain",
    "maint",
    "stop",  # SIGTERM to the worker
    "kill",  # SIGKILL, when it outlived stop_timeout_seconds
    "del_server",
    "start",
    "add_server",
    "set_addr",
    "ready",
    "undo",  # a failed start: from here on the GPU goes back to its old pool
    "finish",
]
Outcome = Literal["moved", "undone", "failed", "refused"]


@dataclass(frozen=True, slots=True)
class Step:
    phase: Phase
    action: StepAction
    at_seconds: float
    detail: str = ""
    recorded: bool = False  # the audit log has it


@dataclass(frozen=True, slots=True)
class MoveIntent:
    id: str
    gpu: int
    server: str  # its HAProxy server's name, the same in either pool
    source: str  # the backend it leaves
    target: str  # the backend it joins
    recommendation_id: str
    created_seconds: float
    steps: tuple[Step, ...] = ()

    @property
    def phase(self) -> Phase:
        return "undo" if any(s.action == "undo" for s in self.steps) else "move"

    @property
    def leaving(self) -> str:
        return self.target if self.phase == "undo" else self.source

    @property
    def destination(self) -> str:
        return self.source if self.phase == "undo" else self.target

    @property
    def last(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    def issued(self, action: StepAction) -> Step | None:
        """The step of this action in the current phase, if it was issued."""
        found = [s for s in self.steps if s.phase == self.phase and s.action == action]
        return found[-1] if found else None

    def with_step(self, step: Step) -> MoveIntent:
        return replace(self, steps=(*self.steps, step))

    def recorded(self) -> MoveIntent:
        """The last step marked as in the audit log."""
        assert self.steps
        return replace(self, steps=(*self.steps[:-1], replace(self.steps[-1], recorded=True)))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MoveIntent:
        data = json.loads(text)
        steps = tuple(Step(**step) for step in data.pop("steps"))
        return cls(**data, steps=steps)


class IntentStore:
    """The move in flight, as one JSON file replaced atomically (write, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> MoveIntent | None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return MoveIntent.from_json(text)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(
                f"{self.path} is not a move intent record ({exc}); it names the move in flight: "
                "finish the move by hand and delete the file"
            ) from exc

    def save(self, intent: MoveIntent) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")
        with part.open("w", encoding="utf-8") as file:
            file.write(intent.to_json())
            file.flush()
            os.fsync(file.fileno())
        os.replace(part, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power cut
        finally:
            os.close(directory)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class MoveLimits:
    drain_timeout_seconds: float
    ready_timeout_seconds: float  # a started worker's model load, and its server's first check
    stop_timeout_seconds: float  # after SIGTERM, SIGKILL


@dataclass(frozen=True, slots=True)
class Act:
    """Carry out one step: on `backend/server` (HAProxy) or on the GPU's worker."""

    action: StepAction
    backend: str = ""
    server: str = ""
    detail: str = ""
    worker: WorkerProcess | None = None  # the one to stop, or (add_server, set_addr) to route to
    pool: str = ""  # start: the pool whose worker to start
    weight: int | None = None  # add_server: what its new peers weigh (None: none serve)


@dataclass(frozen=True, slots=True)
class Wait:
    detail: str


@dataclass(frozen=True, slots=True)
class Undo:
    detail: str
    exited_gpu: int | None = None  # the GPU whose new worker exited: its log says why


@dataclass(frozen=True, slots=True)
class Finished:
    outcome: Outcome
    detail: str
    exited_gpu: int | None = None  # as for Undo


Decision = Act | Wait | Undo | Finished


def next_step(
    intent: MoveIntent,
    observed: Observed,
    workers: Mapping[int, WorkerProcess],
    limits: MoveLimits,
) -> Decision:
    """The move's next step, from HAProxy's servers, the GPU's worker and the intent alone."""
    now = observed.at_seconds
    leaving, dest, name = intent.leaving, intent.destination, intent.server
    here = observed.servers.get(server_key(leaving, name))
    there = observed.servers.get(server_key(dest, name))
    worker = workers.get(intent.gpu)

    def failed(detail: str, exited: bool = False) -> Decision:
        gpu = intent.gpu if exited else None
        if intent.phase == "move":
            return Undo(f"{detail}; GPU {intent.gpu} goes back to {intent.source}", gpu)
        return Finished("failed", f"{detail}; GPU {intent.gpu} serves no pool now", gpu)

    # out of the pool it leaves: drain, sessions to 0, maint
    if here is not None and here.admin == "ready":
        if intent.phase == "move" and here.serving and intent.issued("drain") is None:
            others = [s for s in observed.pool(leaving) if s.key != here.key and s.serving]
            if not others:
                return Finished(
                    "refused",
                    f"last_ready_server: draining {here.key} would leave {leaving} with no "
                    "server taking requests",
                )
        return Act("drain", leaving, name)
    if here is not None and here.admin == "drain":
        drained = intent.issued("drain")
        since = drained.at_seconds if drained is not None else intent.created_seconds
        if here.sessions > 0 and now - since < limits.drain_timeout_seconds:
            return Wait(f"{here.key} drains: {here.sessions} sessions left")
        detail = (
            f"{here.sessions} sessions left after the {limits.drain_timeout_seconds:g} s drain "
            "timeout"
            if here.sessions > 0
            else "no sessions left"
        )
        return Act("maint", leaving, name, detail)
    # its worker stopped
    if worker is not None and worker.pool != dest:
        stopped = intent.issued("stop")
        if stopped is None or not stopped.recorded:
            # unmarked, the SIGTERM may not have been sent before a crash: sending it (again)
            # cannot stop the worker twice
            return Act("stop", detail=f"pid {worker.pid} ({worker.pool})", worker=worker)
        if now - stopped.at_seconds < limits.stop_timeout_seconds:
            return Wait(f"the worker of GPU {intent.gpu} (pid {worker.pid}) stops")
        if intent.issued("kill") is None:
            return Act(
                "kill",
                detail=f"pid {worker.pid} outlived SIGTERM by {limits.stop_timeout_seconds:g} s",
                worker=worker,
            )
        return Wait(f"the worker of GPU {intent.gpu} (pid {worker.pid}) exits after SIGKILL")
    if here is not None:
        if here.sessions > 0:
            return Wait(f"{here.key} still shows {here.sessions} sessions")
        return Act("del_server", leaving, name)
    # into the destination: start, load, add, ready, up
    if worker is None:
        started = intent.issued("start")
        if started is not None and started.recorded:
            return failed(f"the {dest} worker of GPU {intent.gpu} exited during start-up", True)
        return Act("start", pool=dest, detail=f"GPU {intent.gpu} for {dest}")
    if not worker.ready:
        if now - worker.started_seconds > limits.ready_timeout_seconds:
            return failed(
                f"the {dest} worker of GPU {intent.gpu} was not ready within "
                f"{limits.ready_timeout_seconds:g} s"
            )
        return Wait(f"the {dest} worker of GPU {intent.gpu} loads (pid {worker.pid})")
    address = f"{worker.host}:{worker.port}"
    if there is None:
        # as its peers weigh now: a pool the controller re-weighted has left the config's
        # weight behind, and a server added beside them at it would get too much or nothing
        peers = sorted(s.weight for s in observed.pool(dest) if s.serving)
        weight = peers[len(peers) // 2] if peers else None
        return Act("add_server", dest, name, address, worker, weight=weight)
    if (there.address, there.port) != (worker.host, worker.port):
        return Act("set_addr", dest, name, f"{there.address}:{there.port} -> {address}", worker)
    if there.admin != "ready":
        return Act("ready", dest, name)
    if not there.up:
        readied = intent.issued("ready")
        since = readied.at_seconds if readied is not None else now
        if now - since > limits.ready_timeout_seconds:
            return failed(f"{there.key} failed its health checks")
        return Wait(f"{there.key} waits for its health check")
    if intent.phase == "undo":
        return Finished("undone", f"GPU {intent.gpu} serves {dest} again")
    return Finished("moved", f"GPU {intent.gpu} serves {dest} ({address})")


@dataclass(frozen=True, slots=True)
class MoveRequest:
    """An asked-for move: a `move_worker` recommendation, or one a person approved."""

    recommendation_id: str
    gpu: int
    to: str  # the backend the GPU should serve
    target: str = ""  # as the recommendation named it


@dataclass(frozen=True, slots=True)
class Admission:
    intent: MoveIntent | None = None
    refusal: Refusal | None = None
    met: bool = False  # the GPU serves that pool already


def pool_of(
    gpu: int, server: str, observed: Observed, workers: Mapping[int, WorkerProcess]
) -> str | None:
    """The backend a GPU serves now: the one holding its server, else its worker's pool."""
    pools = sorted(s.backend for s in observed.servers.values() if s.server == server)
    if pools:
        return pools[0]
    return workers[gpu].pool if gpu in workers else None


def admit(
    request: MoveRequest,
    observed: Observed,
    workers: Mapping[int, WorkerProcess],
    in_flight: MoveIntent | None,
    gpus: Sequence[int],
    server: str,
    move_id: str,
) -> Admission:
    """A new move's intent, or why it may not start now."""

    def refuse(reason: RefusalReason, detail: str, ack: bool = True) -> Admission:
        return Admission(
            refusal=Refusal(
                request.recommendation_id,
                reason,
                detail,
                ack="rejected" if ack else None,
                target=request.target or f"gpu:{request.gpu}",
            )
        )

    if in_flight is not None:
        return refuse(
            "move_in_flight",
            f"the move of GPU {in_flight.gpu} to {in_flight.target} is in flight (one at a time)",
            ack=False,
        )
    if request.gpu not in gpus:
        return refuse("unknown_target", f"GPU {request.gpu} is not among the managed {list(gpus)}")
    if request.to not in observed.backends:
        return refuse(
            "unknown_target", f"backend {request.to!r} is not among {sorted(observed.backends)}"
        )
    source = pool_of(request.gpu, server, observed, workers)
    if source is None:
        return refuse("unknown_target", f"GPU {request.gpu} serves no pool: nothing to move")
    if source == request.to:
        return Admission(met=True)
    here = observed.servers.get(server_key(source, server))
    others = [s for s in observed.pool(source) if s.serving and s.server != server]
    if here is not None and here.serving and not others:
        return refuse(
            "last_ready_server",
            f"moving GPU {request.gpu} would leave {source} with no server taking requests",
        )
    intent = MoveIntent(
        id=move_id,
        gpu=request.gpu,
        server=server,
        source=source,
        target=request.to,
        recommendation_id=request.recommendation_id,
        created_seconds=observed.at_seconds,
    )
    return Admission(
        intent=intent.with_step(
            Step(
                "move", "begin", observed.at_seconds, f"GPU {request.gpu}: {source} -> {request.to}"
            )
        )
    )


def request_of(
    recommendation_id: str, target: str, parameters: Mapping[str, object]
) -> MoveRequest | str:
    """A `move_worker` recommendation's move ({"gpu": N, "to": backend}), or what is wrong."""
    gpu, to = parameters.get("gpu"), parameters.get("to")
    if isinstance(gpu, bool) or not isinstance(gpu, int):
        return f"move_worker needs parameters.gpu, a GPU index; got {gpu!r}"
    if not isinstance(to, str) or not to:
        return f"move_worker needs parameters.to, the backend to serve; got {to!r}"
    return MoveRequest(recommendation_id, gpu, to, target)
