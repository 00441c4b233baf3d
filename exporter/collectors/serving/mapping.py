"""Which process serves a port, and which GPUs that process (or its children) holds.

The serving stacks do not say which GPU a queue is in front of (Triton's gpu_uuid aside). When
the configuration does not either, the exporter finds it: the listening socket of the endpoint's
port (``<procfs>/net/tcp``, ``tcp6``) → the process holding that socket (``<procfs>/<pid>/fd``)
→ that process and its descendants → the GPUs whose NVML process list holds one of them.
Reading other users' ``fd`` directories needs root (or CAP_SYS_PTRACE), as for ``/proc/<pid>/io``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpubalance.telemetry import GpuSample

log = logging.getLogger(__name__)

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
RESOLVE_EVERY_SECONDS = 60.0


def listening_inodes(procfs: str, port: int) -> set[str]:
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(procfs, "net", name)) as f:
                next(f, None)  # header
                for line in f:
                    fields = line.split()
                    if len(fields) < 10 or fields[3] != LISTEN:
                        continue
                    if int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except (OSError, ValueError, IndexError):
            continue
    return inodes


def pid_of_port(procfs: str, port: int) -> int | None:
    """The process listening on ``port`` (the first found), or None."""
    inodes = listening_inodes(procfs, port)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in os.scandir(procfs):
        if not entry.name.isdigit():
            continue
        fd_dir = os.path.join(entry.path, "fd")
        try:
            for fd in os.scandir(fd_dir):
                try:
                    if os.readlink(fd.path) in wanted:
                        return int(entry.name)
                except OSError:
                    continue
        except OSError:  # gone, or not ours to read
            continue
    return None


def descendants(procfs: str, pid: int) -> set[int]:
    """``pid`` and every process below it (from each process's parent in ``stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir(procfs):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat"), "rb") as f:
                data = f.read()
            ppid = int(data[data.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = {pid}, [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def gpus_of(pids: set[int], gpus: Iterable[GpuSample]) -> list[GpuSample]:
    return [g for g in gpus if any(p.pid in pids for p in g.processes)]


@dataclass
class _Resolved:
    pids: set[int]
    at: float


class PortMapper:
    """Caches port → process tree; the GPUs are looked up each sample (they can change)."""

    def __init__(self, procfs: str) -> None:
        self.procfs = procfs
        self._cache: dict[int, _Resolved] = {}
        self._warned: set[int] = set()

    def gpus(self, port: int, gpus: Sequence[GpuSample]) -> list[GpuSample]:
        resolved = self._cache.get(port)
        now = time.monotonic()
        stale = (
            resolved is None
            or now - resolved.at > RESOLVE_EVERY_SECONDS
            or not any(os.path.exists(os.path.join(self.procfs, str(p))) for p in resolved.pids)
        )
        if stale:
            pid = pid_of_port(self.procfs, port)
            resolved = _Resolved(descendants(self.procfs, pid) if pid else set(), now)
            self._cache[port] = resolved
            if pid is None and port not in self._warned:
                self._warned.add(port)
                log.info(
                    "no process found listening on port %d under %s: map its serving "
                    "endpoint to a GPU in the configuration (gpu: N), or run the exporter "
                    "as root in the host's PID namespace",
                    port,
                    self.procfs,
                )
        return gpus_of(resolved.pids, gpus)
