"""The worker supervisor: starts, stops and observes one serving worker process per GPU.

`WorkerSupervisor` is what the mover needs of one; `controller.workers.backend` chooses which
runs the workers (`worker_backends.supervisor_for`): this module's `Supervisor` (`process`, the
default), systemd template units (`systemd_supervisor`) or Kubernetes manifests written for a
person to apply (`kubernetes_supervisor`, dry-run). The configuration of all three is here.

With the `process` backend a worker is started from the command template in the
controller's config (`controller.workers` in the config file), its placeholders `{gpu}`,
`{port}`, `{pool}` and `{host}` filled in, with `CUDA_VISIBLE_DEVICES` set to its GPU
(`CUDA_DEVICE_ORDER=PCI_BUS_ID`, so CUDA counts the cards as NVML and the exporter do). It runs
in a session of its own, so it outlives a controller that is killed, and is stopped as a
process group (a serving stack's own children with it).

Nothing about the workers is remembered: each `observe` finds them in /proc by the environment
they were started with (`GPUBALANCE_SUPERVISOR`, `GPUBALANCE_GPU`, `GPUBALANCE_POOL`,
`GPUBALANCE_PORT`), and asks each its health check. A started worker loads its model first and
serves nothing meanwhile: it is ready when its health check answers 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpubalance.controller.haproxy import check_name

MARK = "GPUBALANCE_SUPERVISOR"
_PLACEHOLDERS = ("gpu", "port", "pool", "host")
_HEALTH_TIMEOUT_SECONDS = 2.0
_LAST_WORDS_BYTES = 4096  # of a worker's log read for what it said last


class SupervisorError(RuntimeError):
    """A worker could not be started or stopped; the message says why."""


# a Kubernetes object's name (RFC 1123 subdomain) and a namespace's (RFC 1123 label)
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class SystemdSettings(BaseModel):
    """`controller.workers.systemd`: the template unit a GPU's worker runs as (backend systemd;
    deploy/systemd/gpubalance-worker@.service)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unit: str = "gpubalance-worker@"  # the template; its instance is the GPU index
    # where the supervisor writes each GPU's pool and port, as the unit's EnvironmentFile= reads
    environment_dir: Path = Path("/var/lib/gpubalance/workers")
    systemctl: str = "systemctl"
    journalctl: str = "journalctl"

    @field_validator("unit")
    @classmethod
    def _template(cls, unit: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9:_.\-]+@", unit):
            raise ValueError(
                f"{unit!r} must be a template unit's name up to its @ (gpubalance-worker@)"
            )
        return unit


class KubernetesSettings(BaseModel):
    """`controller.workers.kubernetes`: the Pods the dry-run backend writes, one per GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str  # the node whose GPUs `gpus` are (spec.nodeName)
    image: str  # the serving image; the container runs `command`
    namespace: str = "gpubalance"
    # where the manifests go, in order (default: state_dir/kubernetes)
    out_dir: Path | None = None
    # the pool each GPU's Pod serves before the first move (the Pods written first)
    serving: dict[int, str] = Field(default_factory=dict)
    # a written start is reported ready this long after it (nothing is observed)
    ready_after_seconds: float = Field(default=30.0, ge=0)
    gpu_resource: str = "nvidia.com/gpu"  # one of it per Pod

    @field_validator("node", "namespace")
    @classmethod
    def _dns(cls, name: str) -> str:
        if not _DNS_LABEL.fullmatch(name):
            raise ValueError(f"{name!r} must be lower-case letters, digits and '-' (a DNS label)")
        return name

    @field_validator("serving")
    @classmethod
    def _pools(cls, serving: dict[int, str]) -> dict[int, str]:
        for pool in serving.values():
            check_name("pool", pool)
        return serving


class WorkersConfig(BaseModel):
    """`controller.workers` in the config file: how the supervisor runs a GPU's worker."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # process: started here; systemd: template units; kubernetes: manifests written (dry-run)
    backend: Literal["process", "systemd", "kubernetes"] = "process"
    # with {gpu} {port} {pool} {host}; systemd's is the unit's ExecStart instead
    command: tuple[str, ...] | None = Field(default=None, min_length=1)
    gpus: tuple[int, ...] = Field(min_length=1)  # the GPUs whose workers it manages
    instance: str = "gpubalance"  # tells this controller's workers from another's
    host: str = "127.0.0.1"  # where the workers listen, and HAProxy reaches them
    health_path: str = "/healthz"
    ready_timeout_seconds: float = Field(default=300.0, gt=0)  # model load, bounded
    stop_timeout_seconds: float = Field(default=30.0, gt=0)  # SIGTERM, then SIGKILL
    server_name: str = "gpu{gpu}"  # the HAProxy server a GPU's worker is, in its pool
    weight: int = Field(default=100, ge=1, le=256)  # of a server added to a pool
    # the ports workers listen on: below Linux's ephemeral range (32768-60999), so that no
    # outgoing connection on the host holds the port between its choice and the worker's bind
    ports: tuple[int, int] = (20000, 20999)
    state_dir: Path = Path("gpubalance-controller")  # the move's intent record, worker logs
    systemd: SystemdSettings = SystemdSettings()
    kubernetes: KubernetesSettings | None = None

    @field_validator("command")
    @classmethod
    def _placeholders(cls, command: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if command is None:
            return None
        for word in command:
            try:
                word.format(**dict.fromkeys(_PLACEHOLDERS, ""))
            except (KeyError, IndexError, ValueError):
                raise ValueError(
                    f"{word!r}: only {', '.join('{' + p + '}' for p in _PLACEHOLDERS)} "
                    "are filled in (write {{ and }} for a brace)"
                ) from None
        if not any("{port}" in word for word in command):
            raise ValueError("the command must pass the worker its {port}")
        return command

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, gpus: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(gpus)) != len(gpus) or min(gpus) < 0:
            raise ValueError(f"GPU indexes {list(gpus)} must be distinct and not negative")
        return gpus

    @field_validator("ports")
    @classmethod
    def _ports(cls, ports: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= ports[0] <= ports[1] <= 65535:
            raise ValueError(f"ports {list(ports)} must be [first, last] within 1..65535")
        return ports

    @field_validator("server_name")
    @classmethod
    def _server_name(cls, template: str) -> str:
        check_name("server name", template.replace("{gpu}", "0"))
        return template

    @field_validator("instance")
    @classmethod
    def _instance(cls, instance: str) -> str:
        check_name("instance", instance)
        return instance

    @model_validator(mode="after")
    def _backend(self) -> WorkersConfig:
        backend = self.backend
        if backend == "systemd" and self.command is not None:
            raise ValueError(
                "command: with backend systemd the worker's command is its unit's ExecStart "
                "(a drop-in, see deploy/systemd/README.md); leave command out"
            )
        if backend != "systemd" and self.command is None:
            raise ValueError(f"command: backend {backend} starts each worker from it; set it")
        for name, default in (("systemd", SystemdSettings()), ("kubernetes", None)):
            if getattr(self, name) != default and backend != name:
                raise ValueError(f"{name}: set, but backend is {backend}; set backend: {name}")
        if backend == "kubernetes":
            if self.kubernetes is None:
                raise ValueError("kubernetes: backend kubernetes needs kubernetes.node and .image")
            if not _DNS_SUBDOMAIN.fullmatch(f"{self.instance}-gpu0"):
                raise ValueError(
                    f"instance: {self.instance!r} names the Pods (<instance>-gpu<N>): lower-case "
                    "letters, digits and '-'"
                )
            if self.kubernetes.ready_after_seconds >= self.ready_timeout_seconds:
                raise ValueError(
                    "kubernetes.ready_after_seconds must be below ready_timeout_seconds, or "
                    "every dry-run start would time out"
                )
            unknown = sorted(set(self.kubernetes.serving) - set(self.gpus))
            if unknown:
                raise ValueError(f"kubernetes.serving: GPUs {unknown} are not among gpus")
        return self

    def server_of(self, gpu: int) -> str:
        return self.server_name.replace("{gpu}", str(gpu))

    def argv(self, gpu: int, port: int, pool: str) -> list[str]:
        """The worker's command, its placeholders filled in (backends process, kubernetes)."""
        if self.command is None:
            raise SupervisorError(f"backend {self.backend} has no worker command")
        values = {"gpu": gpu, "port": port, "pool": pool, "host": self.host}
        return [word.format(**values) for word in self.command]


@dataclass(frozen=True, slots=True)
class WorkerProcess:
    """One GPU's worker as /proc and its health check show it now."""

    gpu: int
    pool: str  # the backend it was started for
    pid: int
    host: str
    port: int
    started_seconds: float  # Unix time it was started
    ready: bool  # its health check answered 200


class WorkerSupervisor(Protocol):
    """What the mover needs of a worker supervisor, whichever backend runs the workers."""

    config: WorkersConfig

    async def observe(self, session: aiohttp.ClientSession) -> dict[int, WorkerProcess]:
        """GPU -> its worker now, asked whether it is ready; nothing remembered."""
        ...

    def start(self, gpu: int, pool: str) -> WorkerProcess:
        """Start the worker of `pool` on `gpu`; it is ready once `observe` says so."""
        ...

    def signal(self, worker: WorkerProcess, signum: int) -> None:
        """SIGTERM: stop it; SIGKILL: kill it. Gone already is fine."""
        ...

    def last_words(self, gpu: int) -> str:
        """'; ... ends: LINE', what the GPU's worker said last, or ''."""
        ...


async def asked(
    session: aiohttp.ClientSession, config: WorkersConfig, workers: Iterable[WorkerProcess]
) -> dict[int, WorkerProcess]:
    """GPU -> its worker, each asked its health check (in parallel, bounded)."""

    async def ready(worker: WorkerProcess) -> WorkerProcess:
        url = f"http://{worker.host}:{worker.port}{config.health_path}"
        timeout = aiohttp.ClientTimeout(total=_HEALTH_TIMEOUT_SECONDS)
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with session.get(url, timeout=timeout) as resp:
                return replace(worker, ready=resp.status == 200)
        return worker

    found = await asyncio.gather(*(ready(w) for w in workers))
    by_gpu: dict[int, WorkerProcess] = {}
    for worker in sorted(found, key=lambda w: w.started_seconds):
        by_gpu[worker.gpu] = worker  # two on one GPU: the later one is what a move made
    return by_gpu


def free_port(config: WorkersConfig, taken: set[int], *, probe: bool = True) -> int:
    """The first port of `ports` not in `taken` that nothing else holds (with `probe`: bound
    here to see; the workers of a node the controller is not on are not probed)."""
    first, last = config.ports
    for port in range(first, last + 1):
        if port not in taken and (not probe or _bindable(config.host, port)):
            return port
    raise SupervisorError(
        f"no free port in {first}..{last} on {config.host} for a worker; widen "
        "controller.workers.ports"
    )


async def wait_ready(
    supervisor: WorkerSupervisor,
    session: aiohttp.ClientSession,
    gpu: int,
    timeout_seconds: float | None = None,
) -> WorkerProcess:
    """The GPU's worker once its health check answers; SupervisorError when it exits or the
    time (`ready_timeout_seconds` by default) runs out first."""
    config = supervisor.config
    limit = config.ready_timeout_seconds if timeout_seconds is None else timeout_seconds
    deadline = time.monotonic() + limit
    while True:
        worker = (await supervisor.observe(session)).get(gpu)
        if worker is None:
            raise SupervisorError(
                f"the worker of GPU {gpu} exited during start-up{supervisor.last_words(gpu)}"
            )
        if worker.ready:
            return worker
        if time.monotonic() > deadline:
            raise SupervisorError(f"the worker of GPU {gpu} was not ready within {limit} s")
        await asyncio.sleep(0.05)


def last_said(lines: Iterable[str]) -> str | None:
    """The last line of a worker's output that says something (a traceback's last line names
    the error), cut to 300 characters; None when there is none."""
    said = [line.strip() for line in lines if line.strip()]
    if not said:
        return None
    return said[-1] if len(said[-1]) <= 300 else said[-1][:297] + "..."


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        # as the worker's server will bind it: a port whose last connections linger in
        # TIME_WAIT is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # the state follows the command's closing parenthesis; a zombie has exited
            if stat.read().rpartition(b")")[2].split()[0] == b"Z":
                return None
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (OSError, IndexError):
        return None  # gone, or another user's
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class Supervisor:
    def __init__(self, config: WorkersConfig) -> None:
        self.config = config
        # started here, reaped as they exit -> the worker each is
        self._children: dict[subprocess.Popen[bytes], WorkerProcess] = {}

    def _reap(self) -> None:
        self._children = {c: w for c, w in self._children.items() if c.poll() is None}

    def _marked(self) -> dict[int, dict[str, str]]:
        """PID -> environment of each live process this supervisor started (and their
        children, which inherit the environment)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                env = _environ(int(entry.name))
                if env is not None and env.get(MARK) == self.config.instance:
                    found[int(entry.name)] = env
        return found

    def processes(self) -> list[WorkerProcess]:
        """The workers /proc shows, not yet asked whether they are ready."""
        self._reap()
        marked = self._marked()
        workers = []
        for pid, env in marked.items():
            if _parent(pid) in marked:
                continue  # a worker's own child
            try:
                gpu, port = int(env["GPUBALANCE_GPU"]), int(env["GPUBALANCE_PORT"])
                started = float(env["GPUBALANCE_STARTED_SECONDS"])
                pool = env["GPUBALANCE_POOL"]
            except (KeyError, ValueError):
                continue  # marked by hand, not by start()
            workers.append(WorkerProcess(gpu, pool, pid, self.config.host, port, started, False))
        # a child just started may not show its environment yet (the kernel sets it up after
        # the exec that Popen waits for): it is running, and it is the worker it was started as
        seen = {w.pid for w in workers}
        workers += [w for w in self._children.values() if w.pid not in seen]
        return workers

    async def observe(self, session: aiohttp.ClientSession) -> dict[int, WorkerProcess]:
        """GPU -> its worker, each asked its health check (in parallel, bounded)."""
        return await asked(session, self.config, await asyncio.to_thread(self.processes))

    def start(self, gpu: int, pool: str) -> WorkerProcess:
        """Start the worker of `pool` on `gpu`; it is ready once `observe` says so."""
        if gpu not in self.config.gpus:
            raise SupervisorError(f"GPU {gpu} is not among the managed GPUs {self.config.gpus}")
        check_name("pool", pool)
        # the workers' ports, those started here that /proc does not show as ours yet among
        # them: a worker binds its port only once loaded, so another start must not be given
        # it meanwhile
        taken = {w.port for w in self.processes()}
        port = free_port(self.config, taken)
        argv = self.config.argv(gpu, port, pool)
        started = time.time()
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": str(gpu),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            MARK: self.config.instance,
            "GPUBALANCE_GPU": str(gpu),
            "GPUBALANCE_POOL": pool,
            "GPUBALANCE_PORT": str(port),
            "GPUBALANCE_STARTED_SECONDS": repr(started),
        }
        log_path = self.log_path(gpu)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            try:
                process = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise SupervisorError(f"cannot start {argv[0]!r} for GPU {gpu}: {exc}") from exc
        worker = WorkerProcess(gpu, pool, process.pid, self.config.host, port, started, False)
        self._children[process] = worker
        return worker

    def log_path(self, gpu: int) -> Path:
        return self.config.state_dir / "logs" / f"gpu{gpu}.log"

    def last_words(self, gpu: int) -> str:
        """What the GPU's worker said last, from its log, for the message of one that exited:
        '; its log (PATH) ends: LINE' (a traceback's last line names the error), or ''."""
        path = self.log_path(gpu)
        try:
            with path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - _LAST_WORDS_BYTES))
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        last = last_said(lines)
        return "" if last is None else f"; its log ({path}) ends: {last}"

    def signal(self, worker: WorkerProcess, signum: int) -> None:
        """Signal the worker's process group (its own children too); gone already is fine."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signum)

    async def stop(self, worker: WorkerProcess) -> None:
        """SIGTERM, and SIGKILL if it is still there after `stop_timeout_seconds`."""
        self.signal(worker, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_seconds
        while self._alive(worker):
            if time.monotonic() > deadline:
                self.signal(worker, signal.SIGKILL)
                return
            await asyncio.sleep(0.02)

    def _alive(self, worker: WorkerProcess) -> bool:
        # reaps our own children; a worker a killed controller left is reaped by init
        self._reap()
        if any(w.pid == worker.pid for w in self._children.values()):
            # ours and not reaped: it has not exited. (While it exits, /proc stops showing its
            # environment before the kernel lets it be reaped: read then, it looked gone, and
            # `processes` still listed it as a child.)
            return True
        env = _environ(worker.pid)
        return env is not None and env.get("GPUBALANCE_STARTED_SECONDS") == repr(
            worker.started_seconds
        )
