"""Worker supervisor backend `systemd`: a GPU's worker is an instance of a template unit,
`gpubalance-worker@N.service` for GPU N (deploy/systemd/gpubalance-worker@.service).

The unit sets `CUDA_VISIBLE_DEVICES=%i` and `CUDA_DEVICE_ORDER=PCI_BUS_ID`; its command is the
operator's `ExecStart` (a drop-in). The pool and port the supervisor chooses reach it through
its environment file, `systemd.environment_dir/N.env` (the unit's `EnvironmentFile=`), which
`start` writes before `systemctl start`, and only while the unit is not running. The unit is
`Type=exec`, so `systemctl start` returns once the worker's command runs (or says why it could
not run it): a pass right after sees the unit running, never a start job still queued.

Nothing is remembered: `observe` asks systemd which instances run (`systemctl show`), reads the
pool and port of each from its environment file, and asks each its health check as the process
backend does. SIGTERM is `systemctl stop --no-block` (systemd sends SIGTERM to the unit's
processes, and SIGKILL after its `TimeoutStopSec=`), SIGKILL is `systemctl kill
--signal=SIGKILL`; what a worker said last is the unit's journal. A failing `systemctl` raises
`SupervisorError` with what it wrote to stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from gpubalance.children import signal_child
from gpubalance.controller.haproxy import check_name
from gpubalance.controller.supervisor import (
    MARK,
    SupervisorError,
    WorkerProcess,
    WorkersConfig,
    asked,
    free_port,
    last_said,
)

# the states of a unit whose processes run (stopping ones included: a move waits for them)
_RUNNING = frozenset({"active", "activating", "deactivating", "reloading", "refreshing"})
_PROPERTIES = "Id,ActiveState,SubState,MainPID,ExecMainStartTimestampMonotonic"
_TIMEOUT_SECONDS = 30.0  # of one systemctl or journalctl command
_JOURNAL_LINES = 20
_MANAGER_PID = "1"  # the journal lines systemd itself writes about a unit (exited, failed)


def parse_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show` of several units (blocks of KEY=VALUE, a blank line between) -> Id ->
    its properties."""
    units: dict[str, dict[str, str]] = {}
    for block in text.split("\n\n"):
        props = dict(line.partition("=")[::2] for line in block.splitlines() if "=" in line)
        if "Id" in props:
            units[props["Id"]] = props
    return units


def _unix_seconds(monotonic_usec: int) -> float:
    """A systemd monotonic timestamp (µs, CLOCK_MONOTONIC, as time.monotonic) as Unix time."""
    if monotonic_usec <= 0:
        return time.time()  # not started yet
    return time.time() - (time.monotonic() - monotonic_usec / 1e6)


class SystemdSupervisor:
    def __init__(self, config: WorkersConfig) -> None:
        self.config = config

    def unit_of(self, gpu: int) -> str:
        return f"{self.config.systemd.unit}{gpu}.service"

    def environment_file(self, gpu: int) -> Path:
        return self.config.systemd.environment_dir / f"{gpu}.env"

    def _environment(self, gpu: int) -> dict[str, str]:
        """The GPU's environment file as the unit reads it; {} when there is none."""
        try:
            text = self.environment_file(gpu).read_text()
        except OSError:
            return {}
        return {
            key.strip(): value.strip()
            for key, _, value in (line.partition("=") for line in text.splitlines())
            if key.strip() and not key.lstrip().startswith("#")
        }

    def _worker(self, gpu: int, props: Mapping[str, str]) -> WorkerProcess | None:
        if props.get("ActiveState") not in _RUNNING:
            return None
        env = self._environment(gpu)
        try:
            pool, port = env["GPUBALANCE_POOL"], int(env["GPUBALANCE_PORT"])
            pid = int(props.get("MainPID", "0"))
            started = _unix_seconds(int(props.get("ExecMainStartTimestampMonotonic", "0")))
        except (KeyError, ValueError):
            return None  # started by hand, not by start()
        return WorkerProcess(gpu, pool, pid, self.config.host, port, started, False)

    async def observe(self, session: aiohttp.ClientSession) -> dict[int, WorkerProcess]:
        units = {self.unit_of(gpu): gpu for gpu in self.config.gpus}
        shown = parse_show(await self._run_async(["show", f"--property={_PROPERTIES}", *units]))
        found = (self._worker(gpu, shown.get(unit, {})) for unit, gpu in units.items())
        return await asked(session, self.config, [w for w in found if w is not None])

    def start(self, gpu: int, pool: str) -> WorkerProcess:
        if gpu not in self.config.gpus:
            raise SupervisorError(f"GPU {gpu} is not among the managed GPUs {self.config.gpus}")
        check_name("pool", pool)
        unit = self.unit_of(gpu)
        state = parse_show(self._run(["show", "--property=Id,ActiveState", unit])).get(unit, {})
        if state.get("ActiveState") in _RUNNING:
            # its environment file must keep saying what the running worker serves
            raise SupervisorError(f"{unit} is {state['ActiveState']}; stop it first")
        # a worker binds its port only once loaded: the ports of the others are theirs
        taken = set()
        for other in self.config.gpus:
            port = self._environment(other).get("GPUBALANCE_PORT", "") if other != gpu else ""
            if port.isdigit():
                taken.add(int(port))
        port = free_port(self.config, taken)
        self._write_environment(gpu, pool, port)
        started = time.time()
        self._run(["start", unit])
        return WorkerProcess(gpu, pool, 0, self.config.host, port, started, False)

    def _write_environment(self, gpu: int, pool: str, port: int) -> None:
        path = self.environment_file(gpu)
        lines = [
            f"# GPU {gpu}'s worker, written by the gpubalance controller before it starts "
            f"{self.unit_of(gpu)}",
            f"{MARK}={self.config.instance}",
            f"GPUBALANCE_GPU={gpu}",
            f"GPUBALANCE_POOL={pool}",
            f"GPUBALANCE_PORT={port}",
            f"GPUBALANCE_HOST={self.config.host}",
        ]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text("\n".join(lines) + "\n")
            os.replace(partial, path)  # a unit started meanwhile reads the old or the new
        except OSError as exc:
            raise SupervisorError(
                f"cannot write {path} (controller.workers.systemd.environment_dir): {exc}"
            ) from exc

    def signal(self, worker: WorkerProcess, signum: int) -> None:
        unit = self.unit_of(worker.gpu)
        if signum == signal.SIGTERM:
            self._run(["stop", "--no-block", unit])  # gone already: systemd says nothing
            return
        try:
            self._run(["kill", f"--signal={signal.Signals(signum).name}", unit])
        except SupervisorError:
            state = parse_show(self._run(["show", "--property=Id,ActiveState", unit]))
            if state.get(unit, {}).get("ActiveState") in _RUNNING:
                raise
            # it exited meanwhile: nothing left to signal

    def last_words(self, gpu: int) -> str:
        """'; its journal (UNIT) ends: LINE', the last line its own processes wrote, or ''."""
        unit = self.unit_of(gpu)
        argv = [self.config.systemd.journalctl, f"--unit={unit}", f"--lines={_JOURNAL_LINES}"]
        argv += ["--output=json", "--no-pager"]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_SECONDS)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        own, manager = [], []
        for line in result.stdout.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            message = entry.get("MESSAGE")
            if isinstance(message, list):  # not UTF-8: the journal gives the bytes
                message = bytes(message).decode(errors="replace")
            if isinstance(message, str):
                # systemd's own lines ("Failed with result 'exit-code'") only when there is
                # nothing else: the worker's last line says why
                (manager if entry.get("_PID") == _MANAGER_PID else own).append(message)
        last = last_said(own) or last_said(manager)
        return "" if last is None else f"; its journal ({unit}) ends: {last}"

    def _argv(self, args: Sequence[str]) -> list[str]:
        return [self.config.systemd.systemctl, *args]

    def _failed(self, args: Sequence[str], code: int | None, stderr: str) -> SupervisorError:
        said = stderr.strip() or f"exit status {code}"
        return SupervisorError(f"systemctl {' '.join(args)}: {said}")

    def _run(self, args: Sequence[str]) -> str:
        try:
            result = subprocess.run(
                self._argv(args), capture_output=True, text=True, timeout=_TIMEOUT_SECONDS
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise self._failed(args, None, str(exc)) from exc
        if result.returncode != 0:
            raise self._failed(args, result.returncode, result.stderr)
        return result.stdout

    async def _run_async(self, args: Sequence[str]) -> str:
        try:
            process = await asyncio.create_subprocess_exec(
                *self._argv(args),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise self._failed(args, None, str(exc)) from exc
        try:
            async with asyncio.timeout(_TIMEOUT_SECONDS):
                out, err = await process.communicate()
        except TimeoutError:
            signal_child(process, signal.SIGKILL)
            await process.wait()
            raise self._failed(args, None, f"no answer in {_TIMEOUT_SECONDS:g} s") from None
        if process.returncode != 0:
            raise self._failed(args, process.returncode, err.decode(errors="replace"))
        return out.decode(errors="replace")
