"""Process collector: host-side figures of every process NVML lists on a GPU.

This runs every sample for every GPU process (dozens on a busy server), so a process already
known costs three small files under the procfs root, ``<pid>/stat``, ``statm`` and ``io``,
each read with one ``os.open``/``os.read``/``os.close``: psutil's ``oneshot()`` opens five
files through Python file objects and costs several times as much per process.

psutil stays where it does better than a plain read and is needed once per process: the name,
which the kernel cuts to 15 characters and psutil completes from cmdline. The start time in
``stat`` (clock ticks since boot) is read every sample anyway, so it also tells a PID the
kernel has handed to a new process from the one seen before.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property

import psutil

from gpubalance.exporter.collectors.base import NoDataError, SampleParts, register
from gpubalance.exporter.config import ExporterConfig
from gpubalance.telemetry import ProcessHostStats

log = logging.getLogger(__name__)

# stat counts CPU and start times in USER_HZ ticks, statm counts memory in pages.
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Larger than any stat (52 numbers and a 15-byte name), statm or io file: procfs hands over the
# whole file in one read when the buffer holds it.
_READ_SIZE = 4096
# Fields of stat, numbered from 1 as in proc(5), as indices into what follows the name (field 3
# onwards).
_UTIME, _STIME, _THREADS, _STARTTIME = (n - 3 for n in (14, 15, 20, 22))


@dataclass(slots=True)
class _Tracked:
    # stat's name and start time as last resolved: a new start time is a reused PID, a new name
    # an exec or a rename; either way the process is resolved again.
    comm: bytes
    start_ticks: int
    name: str
    create_time_seconds: float
    # /proc/<pid>/io needs ptrace access, which does not change for the life of a process:
    # once denied, it is not asked again.
    io_readable: bool = True


def _read_file(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, _READ_SIZE)
    finally:
        os.close(fd)


class ProcessCollector:
    name = "processes"

    def __init__(self, procfs: str) -> None:
        self._procfs = procfs
        self._tracked: dict[int, _Tracked] = {}
        self._logged: set[str] = set()

    def update(self, parts: SampleParts) -> None:
        pids = sorted({p.pid for gpu in parts.gpus for p in gpu.processes})
        for pid in self._tracked.keys() - set(pids):
            del self._tracked[pid]
        found = 0
        for pid in pids:
            try:
                parts.processes[pid] = self._read(pid)
            except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
                # Gone since NVML listed it: ENOENT once its directory is gone, ESRCH when it
                # exits between open and read (NoSuchProcess also covers ZombieProcess).
                self._tracked.pop(pid, None)
                continue
            except (PermissionError, psutil.AccessDenied) as exc:
                self._log_once(
                    "denied",
                    "cannot read %s/%d (%s): with procfs mounted hidepid=1, run the exporter as"
                    " root or in the group named by the mount's gid= option",
                    self._procfs,
                    pid,
                    exc,
                )
            found += 1
        if pids and not found:
            self._log_once(
                "hidden",
                "none of the %d GPU processes (PIDs %s) is under %s. If this lasts, the exporter"
                " runs in another PID namespace than they do: run it with hostPID: true"
                " (Kubernetes) or --pid=host (Docker), or mount the host's /proc and set procfs"
                " to it",
                len(pids),
                ", ".join(map(str, pids[:8])),
                self._procfs,
            )

    def close(self) -> None:
        self._tracked.clear()

    @cached_property
    def _boot_time(self) -> float:
        # Read once: btime moves only when the wall clock is stepped, and start times of
        # processes seen before are kept as first computed either way. Not _read_file: on a
        # large server the per-CPU and intr lines push btime far past one read.
        path = f"{self._procfs}/stat"
        try:
            with open(path, "rb") as f:
                for line in f:
                    if line.startswith(b"btime "):
                        return float(line.split()[1])
        except FileNotFoundError:
            pass
        raise NoDataError(
            f"no btime in {path}: set procfs (--procfs) to a mounted procfs,"
            " e.g. the host's /proc mounted at /host/proc"
        )

    def _read(self, pid: int) -> ProcessHostStats:
        base = f"{self._procfs}/{pid}"
        stat = _read_file(f"{base}/stat")
        # The name sits between "(" and the LAST ")": it may itself hold spaces and parentheses.
        end = stat.rindex(b")")
        comm = stat[stat.index(b"(") + 1 : end]
        fields = stat[end + 2 :].split()
        start_ticks = int(fields[_STARTTIME])
        tracked = self._tracked.get(pid)
        if tracked is None or tracked.start_ticks != start_ticks or tracked.comm != comm:
            tracked = self._resolve(pid, comm, start_ticks)
        # Resident pages from statm, not from stat's rss: since Linux 6.2 the counters are per
        # CPU, and stat reads them without summing the per-CPU parts, off by up to a batch per
        # CPU (hundreds of MiB on a large server; 0 for a small process). statm sums them on
        # current kernels, and psutil reports it.
        resident_pages = int(_read_file(f"{base}/statm").split()[1])
        read_bytes, written_bytes = self._io(base, pid, tracked)
        return ProcessHostStats(
            pid=pid,
            name=tracked.name,
            cpu_seconds_total=(int(fields[_UTIME]) + int(fields[_STIME])) / CLK_TCK,
            resident_memory_bytes=resident_pages * PAGE_SIZE,
            read_bytes_total=read_bytes,
            written_bytes_total=written_bytes,
            threads=int(fields[_THREADS]),
            create_time_seconds=tracked.create_time_seconds,
        )

    def _resolve(self, pid: int, comm: bytes, start_ticks: int) -> _Tracked:
        # Called after stat is read: should the PID be reused in between, the name is the
        # newcomer's but the start time its predecessor's, so the next sample resolves again.
        tracked = _Tracked(
            comm=comm,
            start_ticks=start_ticks,
            name=psutil.Process(pid).name(),
            # psutil's create_time(), without its read of btime per call.
            create_time_seconds=start_ticks / CLK_TCK + self._boot_time,
        )
        self._tracked[pid] = tracked
        return tracked

    def _io(self, base: str, pid: int, tracked: _Tracked) -> tuple[int | None, int | None]:
        if not tracked.io_readable:
            return None, None
        try:
            # open() is refused to other users, read() when the ptrace check fails.
            io = _read_file(f"{base}/io").split()
        except PermissionError:
            tracked.io_readable = False
            self._log_once(
                "io",
                "cannot read %s/%d/io: I/O bytes of GPU processes owned by other users need"
                " ptrace access; run the exporter as root or grant it CAP_SYS_PTRACE",
                self._procfs,
                pid,
            )
            return None, None
        # "name: value" pairs. read_bytes and write_bytes count what reached the storage layer
        # (psutil's read_bytes and write_bytes), unlike rchar and wchar, which count page-cache
        # hits and pipes too.
        return (
            int(io[io.index(b"read_bytes:") + 1]),
            int(io[io.index(b"write_bytes:") + 1]),
        )

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.info(message, *args)


@register("processes", order=30, help="host CPU, memory and I/O of the GPU processes (procfs)")
def create(config: ExporterConfig) -> ProcessCollector:
    # psutil's documented switch, global to the exporter: its name lookups go to the root too.
    psutil.PROCFS_PATH = config.procfs
    return ProcessCollector(config.procfs)
