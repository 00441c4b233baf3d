"""Host collector: per-CPU times, PSI, memory, disks, network and load from one procfs root.

Every file is read under ``config.procfs`` (node_exporter's ``--path.procfs``), never from the
real ``/proc`` behind it, so an exporter in a container reports the host when the host's /proc
is mounted (e.g. at /host/proc) and ``procfs`` points there. ``net/dev`` and ``net/snmp`` show
the network namespace of the reading process: in a container, the host's network needs
``hostNetwork: true`` (Kubernetes) or ``--network=host`` (Docker).

The files are parsed here rather than through psutil: psutil's per-CPU times lose the CPU
number when CPUs are offline, its disk counters either keep partitions or drop them by looking
at the real /sys/block, its load average is os.getloadavg() whatever the root, and one bad line
makes it raise rather than skip.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter

from gpubalance.exporter.collectors.base import NoDataError, SampleParts, register
from gpubalance.exporter.config import ExporterConfig
from gpubalance.telemetry import (
    CpuTimes,
    DiskCounters,
    HostSample,
    NetworkCounters,
    PressureStall,
)

log = logging.getLogger(__name__)

# /proc/stat counts in USER_HZ ticks, whatever the kernel's internal HZ.
USER_HZ = os.sysconf("SC_CLK_TCK")
# diskstats counts 512-byte sectors whatever the device's logical block size.
SECTOR_BYTES = 512
# node_exporter's default --collector.diskstats.device-exclude: partitions would count their
# disk's I/O twice; RAM, loop and floppy devices are not the storage a data loader waits on.
IGNORED_DISKS = re.compile(r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]|nvme\d+n\d+p)\d+$")
IGNORED_INTERFACES = frozenset({"lo"})
PSI_RESOURCES = ("cpu", "io", "memory")
# A CPU counter may dip slightly (iowait is known to); holding the previous value keeps rates
# from going negative. An idle drop this large means a hotplugged CPU starting over
# (node_exporter's jumpBackSeconds).
JUMP_BACK_SECONDS = 3.0
CPU_MODES = (
    "user_seconds",
    "nice_seconds",
    "system_seconds",
    "idle_seconds",
    "iowait_seconds",
    "irq_seconds",
    "softirq_seconds",
    "steal_seconds",
)
_NO_PSI = (
    "no PSI under %s/pressure: pressure stalls need a kernel built with CONFIG_PSI=y and, "
    "where it also has CONFIG_PSI_DEFAULT_DISABLED=y, booted with psi=1"
)


class HostCollector:
    name = "host"

    def __init__(self, procfs: str) -> None:
        self.procfs = procfs
        # Lines skipped as malformed, by file under the root; the first one per file is logged.
        self.malformed_lines_total: Counter[str] = Counter()
        self._cpu_last: dict[int, CpuTimes] = {}
        self._no_psi_logged = False
        self._unreadable_logged: set[str] = set()

    def update(self, parts: SampleParts) -> None:
        stat = self._read("stat")
        if stat is None:
            raise NoDataError(
                f"{self.procfs}/stat not found: set procfs (--procfs) to a mounted procfs,"
                " e.g. the host's /proc mounted at /host/proc"
            )
        memory = self._meminfo()
        tcp = self._tcp()
        parts.host = HostSample(
            cpus=self._cpus(stat),
            pressure=self._pressure(),
            memory_total_bytes=memory.get("MemTotal"),
            memory_available_bytes=memory.get("MemAvailable"),
            disks=self._disks(),
            networks=self._networks(),
            tcp_out_segments_total=tcp.get("OutSegs"),
            tcp_retransmitted_segments_total=tcp.get("RetransSegs"),
            load1=self._load1(),
        )

    def close(self) -> None:
        """Nothing to release: every file is opened and closed within one update."""

    def _read(self, name: str) -> str | None:
        path = f"{self.procfs}/{name}"
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if name not in self._unreadable_logged:
                self._unreadable_logged.add(name)
                log.warning(
                    "cannot read %s (%s): check the exporter's permissions on the procfs mount",
                    path,
                    exc,
                )
            return None

    def _malformed(self, name: str, line: str) -> None:
        self.malformed_lines_total[name] += 1
        if self.malformed_lines_total[name] == 1:
            log.warning(
                "skipping malformed line in %s/%s: %r (logged once per file; the rest is used). "
                "If this is a real procfs, please report it with your kernel version (uname -r)",
                self.procfs,
                name,
                line,
            )

    def _cpus(self, stat: str) -> tuple[CpuTimes, ...]:
        cpus = []
        for line in stat.splitlines():
            # "cpu " is the sum over all CPUs; only the per-CPU lines are kept.
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            fields = line.split()
            try:
                if len(fields) < 9:
                    raise ValueError("fewer than 8 modes")
                cpu = int(fields[0][3:])
                times = CpuTimes(cpu, *(int(v) / USER_HZ for v in fields[1:9]))
            except ValueError:
                self._malformed("stat", line)
                continue
            cpus.append(self._hold_back(times))
        # Offline CPUs disappear from /proc/stat; they start over if they come back.
        self._cpu_last = {c.cpu: c for c in cpus}
        return tuple(cpus)

    def _hold_back(self, new: CpuTimes) -> CpuTimes:
        old = self._cpu_last.get(new.cpu)
        if old is None:
            return new
        if old.idle_seconds - new.idle_seconds >= JUMP_BACK_SECONDS:
            log.debug(
                "CPU %d idle time went back from %.2f s to %.2f s: hotplug, starting over",
                new.cpu,
                old.idle_seconds,
                new.idle_seconds,
            )
            return new
        return CpuTimes(new.cpu, *(max(getattr(old, m), getattr(new, m)) for m in CPU_MODES))

    def _pressure(self) -> tuple[PressureStall, ...] | None:
        stalls = []
        found = False
        for resource in PSI_RESOURCES:
            text = self._read(f"pressure/{resource}")
            if text is None:
                continue
            found = True
            stall = self._parse_pressure(resource, text)
            if stall is not None:
                stalls.append(stall)
        if not found and not self._no_psi_logged:
            self._no_psi_logged = True
            log.debug(_NO_PSI, self.procfs)
        return tuple(stalls) if stalls else None

    def _parse_pressure(self, resource: str, text: str) -> PressureStall | None:
        name = f"pressure/{resource}"
        lines: dict[str, tuple[float, float]] = {}
        for line in text.splitlines():
            kind, _, rest = line.partition(" ")
            try:
                values = dict(item.split("=", 1) for item in rest.split())
                # avg10 is a percentage, total is in microseconds.
                lines[kind] = (float(values["avg10"]) / 100, int(values["total"]) / 1e6)
            except (ValueError, KeyError):
                self._malformed(name, line)
        some = lines.get("some")
        if some is None:
            return None
        # The kernel has no "full" line for cpu before 5.13.
        full = lines.get("full", (None, None))
        return PressureStall(resource, some[0], some[1], full[0], full[1])

    def _meminfo(self) -> dict[str, int]:
        text = self._read("meminfo")
        if text is None:
            return {}
        memory = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            # MemAvailable arrived in 3.14; without it memory_available_bytes stays None.
            if key not in ("MemTotal", "MemAvailable"):
                continue
            try:
                memory[key] = int(rest.split()[0]) * 1024  # kB
            except (ValueError, IndexError):
                self._malformed("meminfo", line)
        return memory

    def _disks(self) -> tuple[DiskCounters, ...]:
        text = self._read("diskstats")
        if text is None:
            return ()
        disks = []
        for line in text.splitlines():
            fields = line.split()
            if len(fields) >= 3 and IGNORED_DISKS.match(fields[2]):
                continue
            try:
                if len(fields) < 14:
                    raise ValueError("fewer than 11 counters")
                disks.append(
                    DiskCounters(
                        device=fields[2],
                        reads_total=int(fields[3]),
                        writes_total=int(fields[7]),
                        read_bytes_total=int(fields[5]) * SECTOR_BYTES,
                        written_bytes_total=int(fields[9]) * SECTOR_BYTES,
                        read_time_seconds_total=int(fields[6]) / 1000,
                        write_time_seconds_total=int(fields[10]) / 1000,
                        io_time_seconds_total=int(fields[12]) / 1000,
                    )
                )
            except ValueError:
                self._malformed("diskstats", line)
        return tuple(disks)

    def _networks(self) -> tuple[NetworkCounters, ...]:
        text = self._read("net/dev")
        if text is None:
            return ()
        networks = []
        for line in text.splitlines():
            if "|" in line:  # the two header lines
                continue
            device, sep, rest = line.partition(":")
            device = device.strip()
            if device in IGNORED_INTERFACES:
                continue
            try:
                values = [int(v) for v in rest.split()]
                if not sep or len(values) < 16:
                    raise ValueError("expected 'name:' and 16 counters")
            except ValueError:
                self._malformed("net/dev", line)
                continue
            networks.append(
                NetworkCounters(
                    device=device,
                    receive_bytes_total=values[0],
                    transmit_bytes_total=values[8],
                    receive_packets_total=values[1],
                    transmit_packets_total=values[9],
                    receive_errors_total=values[2],
                    transmit_errors_total=values[10],
                    receive_drops_total=values[3],
                    transmit_drops_total=values[11],
                )
            )
        return tuple(networks)

    def _tcp(self) -> dict[str, int]:
        text = self._read("net/snmp")
        if text is None:
            return {}
        # Each protocol is a line of names followed by a line of values.
        rows = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
        if len(rows) != 2 or len(rows[0]) != len(rows[1]):
            self._malformed("net/snmp", " / ".join(" ".join(row) for row in rows))
            return {}
        tcp = {}
        for key, value in zip(*rows, strict=True):
            if key in ("OutSegs", "RetransSegs"):
                try:
                    tcp[key] = int(value)
                except ValueError:
                    self._malformed("net/snmp", f"Tcp: {key}={value}")
        return tcp

    def _load1(self) -> float | None:
        text = self._read("loadavg")
        if text is None:
            return None
        try:
            return float(text.split()[0])
        except (ValueError, IndexError):
            self._malformed("loadavg", text.strip())
            return None


@register("host", order=20, help="CPU, PSI, memory, disks, network and load from procfs")
def create(config: ExporterConfig) -> HostCollector:
    return HostCollector(config.procfs)
