"""A fake procfs tree that the exporter reads back as the lab's host and GPU processes.

The live lab simulates an RTX server whose host contention (CPU, PSI, disks, network) must be
the same on every run whatever this machine is doing, so the exporter runs with ``--procfs`` at
a tree written here rather than at /proc. The files are in the kernel's formats (proc(5)) and go
through the same parsers as on a real host.

The kernel keeps counters in integer units that the exporter divides back. A value reads back
exactly when it is a whole number of its unit (built as ``k / unit``, or ``k * unit`` for
bytes); others are rounded to the nearest:

- CPU mode times and process CPU time: 1 / ``SC_CLK_TCK`` s (10 ms at USER_HZ 100);
- process create time: 1 / ``SC_CLK_TCK`` s after the boot time, itself whole seconds (btime);
- PSI avg10: 0.0001 (a percentage with two decimals); PSI totals: 1 µs;
- memory (meminfo): 1024 bytes; disk bytes: 512 (sectors); disk times: 1 ms;
- load1: 0.01; process resident memory: ``SC_PAGE_SIZE`` bytes;
- everything else (operation, packet and segment counts, threads, I/O bytes): exact.

What the exporter does not read is filled in so every file has the lines and columns a real
one has: zeros for counters that are not modelled, and plain constants elsewhere (state S,
parent PID 1, the writer's uid and gid).

The exporter reads while the lab writes, every fraction of a second: each file is replaced
atomically, a new process directory appears complete and a gone one vanishes at once, and a
file whose content did not change is left alone. Put the root on tmpfs (/dev/shm): on ext4 a
rename over a file starts that file's write-back (auto_da_alloc), which makes a write of the
tree several times dearer.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpubalance.exporter.collectors.host import (
    CPU_MODES,
    IGNORED_DISKS,
    IGNORED_INTERFACES,
    PSI_RESOURCES,
)
from gpubalance.telemetry import (
    CpuTimes,
    DiskCounters,
    HostSample,
    PressureStall,
    ProcessHostStats,
)

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
SECTOR_BYTES = 512
# TASK_COMM_LEN less the NUL: the kernel keeps this many bytes of a process name.
COMM_BYTES = 15
# Block-extended major, which NVMe namespaces get; the exporter reads only the name.
_DISK_MAJOR = 259
_NET_DEV_HEADER = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs "
    "drop fifo colls carrier compressed\n"
)
_NET_DEV_LINE = (
    "{:>6}: {:7d} {:7d} {:4d} {:4d} {:4d} {:5d} {:10d} {:9d} "
    "{:8d} {:7d} {:4d} {:4d} {:4d} {:5d} {:7d} {:10d}\n"
)
# net/snmp's protocols around Tcp, as Linux 6.x prints them (IcmpMsg only once an ICMP message
# was counted). Ip Forwarding 2 is "not a router".
_SNMP_BEFORE_TCP = (
    "Ip: Forwarding DefaultTTL InReceives InHdrErrors InAddrErrors ForwDatagrams "
    "InUnknownProtos InDiscards InDelivers OutRequests OutDiscards OutNoRoutes ReasmTimeout "
    "ReasmReqds ReasmOKs ReasmFails FragOKs FragFails FragCreates OutTransmits\n"
    "Ip: 2 64" + " 0" * 18 + "\n"
    "Icmp: InMsgs InErrors InCsumErrors InDestUnreachs InTimeExcds InParmProbs InSrcQuenchs "
    "InRedirects InEchos InEchoReps InTimestamps InTimestampReps InAddrMasks InAddrMaskReps "
    "OutMsgs OutErrors OutRateLimitGlobal OutRateLimitHost OutDestUnreachs OutTimeExcds "
    "OutParmProbs OutSrcQuenchs OutRedirects OutEchos OutEchoReps OutTimestamps "
    "OutTimestampReps OutAddrMasks OutAddrMaskReps\n"
    "Icmp:" + " 0" * 29 + "\n"
)
_SNMP_AFTER_TCP = "".join(
    f"{proto}: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors "
    f"InCsumErrors IgnoredMulti MemErrors\n{proto}:" + " 0" * 9 + "\n"
    for proto in ("Udp", "UdpLite")
)
# Tcp's columns with the kernel's constants (RFC 6298 RTO bounds in ms, no connection limit).
_TCP_COLUMNS = {
    "RtoAlgorithm": 1,
    "RtoMin": 200,
    "RtoMax": 120000,
    "MaxConn": -1,
    "ActiveOpens": 0,
    "PassiveOpens": 0,
    "AttemptFails": 0,
    "EstabResets": 0,
    "CurrEstab": 0,
    "InSegs": 0,
    "OutSegs": 0,
    "RetransSegs": 0,
    "InErrs": 0,
    "OutRsts": 0,
    "InCsumErrors": 0,
}


def write_procfs(
    root: Path,
    host: HostSample,
    processes: Mapping[int, ProcessHostStats],
    *,
    boot_time_seconds: float,
) -> None:
    """Make the tree under ``root`` read back as ``host`` and ``processes`` (by PID).

    ``boot_time_seconds`` is cut to whole seconds (btime); create times count from there.
    ``host.pressure`` None leaves no ``pressure/`` directory, a stall without ``full_*`` no
    "full" line; ``memory_*``, ``tcp_*`` or ``load1`` all None leave out their file, one of them
    None its line or column. Processes not listed lose their directories.

    Raises ValueError, before writing anything, for what the exporter cannot read back as
    given: see :func:`_check`.
    """
    btime = math.floor(boot_time_seconds)
    _check(host, processes, btime)
    last_pid = max(processes, default=1)
    threads = sum(p.threads for p in processes.values())
    host_files = {
        "stat": _stat(host.cpus, btime, last_pid),
        "meminfo": _meminfo(host.memory_total_bytes, host.memory_available_bytes),
        "diskstats": "".join(_diskstats_line(i, d) for i, d in enumerate(host.disks)),
        "net/dev": _net_dev(host),
        "net/snmp": _snmp(host.tcp_out_segments_total, host.tcp_retransmitted_segments_total),
        "loadavg": _loadavg(host.load1, threads, last_pid),
    }
    if host.pressure is not None:
        stalls = {s.resource: s for s in host.pressure}
        for resource in PSI_RESOURCES:
            stall = stalls.get(resource)
            host_files[f"pressure/{resource}"] = None if stall is None else _pressure(stall)

    (root / "net").mkdir(parents=True, exist_ok=True)
    if host.pressure is not None:
        (root / "pressure").mkdir(exist_ok=True)
    # Host files first: the process collector needs btime before any process.
    for name, content in host_files.items():
        path = f"{root}/{name}"
        if content is None:
            _remove_file(path)
        else:
            _replace(path, content.encode())
    if host.pressure is None:
        _remove_dir(f"{root}/pressure")

    uid, gid = os.getuid(), os.getgid()
    for pid, stats in processes.items():
        files = _process_files(stats, btime, uid, gid)
        directory = f"{root}/{pid}"
        if os.path.isdir(directory):
            for name, content in files.items():
                _replace(f"{directory}/{name}", content)
        else:
            _create_dir(directory, files)
    with os.scandir(root) as entries:
        gone = [e.path for e in entries if _is_pid(e.name) and int(e.name) not in processes]
    for path in gone:
        _remove_dir(path)


def _check(host: HostSample, processes: Mapping[int, ProcessHostStats], btime: int) -> None:
    """Refuse what would read back otherwise: names the exporter skips or cannot parse, PSI it
    reads in another order, half-missing pairs the kernel reports together, and what the
    format cannot hold."""
    resources = [s.resource for s in host.pressure or ()]
    if host.pressure is not None and (
        not resources or resources != [r for r in PSI_RESOURCES if r in resources]
    ):
        raise ValueError(
            f"pressure {resources}: expected some of {list(PSI_RESOURCES)}, in that order, once"
            " each (an empty tuple reads back as None)"
        )
    for stall in host.pressure or ():
        if (stall.full_avg10_ratio is None) != (stall.full_total_seconds is None):
            raise ValueError(f"pressure {stall.resource}: full avg10 and total come together")
    for disk in host.disks:
        if IGNORED_DISKS.match(disk.device) or not _is_token(disk.device):
            raise ValueError(f"disk {disk.device!r}: the exporter skips it or cannot parse it")
    for net in host.networks:
        # ":" ends the name in net/dev; a line with "|" is taken for the header.
        if (
            net.device in IGNORED_INTERFACES
            or not _is_token(net.device)
            or {":", "|"} & set(net.device)
        ):
            raise ValueError(f"interface {net.device!r}: the exporter skips it or cannot parse it")
    for pid, stats in processes.items():
        if pid != stats.pid:
            raise ValueError(f"process keyed {pid} has pid {stats.pid}")
        if stats.read_bytes_total is None or stats.written_bytes_total is None:
            # The exporter sees None when open() or read() of io is refused, which a regular
            # file cannot do to root.
            raise ValueError(f"process {pid}: I/O bytes must be given (io cannot be refused)")
        if stats.create_time_seconds < btime:
            raise ValueError(f"process {pid} created before boot ({btime})")
        _check_name(stats)


def _is_token(name: str) -> bool:
    return bool(name) and name.isprintable() and not any(c.isspace() for c in name)


def _check_name(stats: ProcessHostStats) -> None:
    name = stats.name
    if not name.isprintable():
        raise ValueError(f"process {stats.pid} name {name!r}: not printable")
    if len(name.encode()) <= COMM_BYTES:
        return
    # Past 15 bytes psutil completes the name from the basename of argv[0], and only when the
    # 15 bytes it has make 15 characters; an argv[0] with spaces and no other argument it
    # splits at the spaces.
    if not name.isascii() or "/" in name or " " in name:
        raise ValueError(
            f"process {stats.pid} name {name!r}: past {COMM_BYTES} bytes a name must be ASCII"
            " without '/' or ' ' to be completed from cmdline"
        )


def _is_pid(name: str) -> bool:
    return name.isascii() and name.isdigit()


def _ticks(seconds: float) -> int:
    return round(seconds * CLK_TCK)


def _units(count_bytes: int, unit: int) -> int:
    # Nearest, in integers: bytes may exceed what a float holds exactly.
    return (count_bytes + unit // 2) // unit


def _stat(cpus: tuple[CpuTimes, ...], btime: int, last_pid: int) -> str:
    per_cpu = [[_ticks(getattr(c, mode)) for mode in CPU_MODES] for c in cpus]
    total = [sum(column) for column in zip(*per_cpu, strict=True)] or [0] * len(CPU_MODES)
    # guest and guest_nice close each line; they are already counted in user and nice.
    lines = ["cpu  " + _join([*total, 0, 0])]
    lines += [f"cpu{c.cpu} " + _join([*t, 0, 0]) for c, t in zip(cpus, per_cpu, strict=True)]
    # Interrupts, context switches and run queues are not modelled. PIDs are handed out in
    # fork order, so the last one stands for the forks since boot; the reader itself runs.
    lines += [
        "intr 0",
        "ctxt 0",
        f"btime {btime}",
        f"processes {last_pid}",
        "procs_running 1",
        "procs_blocked 0",
        "softirq " + _join([0] * 11),
    ]
    return "\n".join(lines) + "\n"


def _join(values: Iterable[int]) -> str:
    return " ".join(map(str, values))


def _pressure(stall: PressureStall) -> str:
    text = _psi_line("some", stall.some_avg10_ratio, stall.some_total_seconds)
    if stall.full_avg10_ratio is not None and stall.full_total_seconds is not None:
        text += _psi_line("full", stall.full_avg10_ratio, stall.full_total_seconds)
    return text


def _psi_line(kind: str, avg10_ratio: float, total_seconds: float) -> str:
    # Only avg10 is sampled: the longer averages repeat it, as under steady pressure.
    avg = f"{avg10_ratio * 100:.2f}"
    return f"{kind} avg10={avg} avg60={avg} avg300={avg} total={round(total_seconds * 1e6)}\n"


def _meminfo(total_bytes: int | None, available_bytes: int | None) -> str | None:
    if total_bytes is None and available_bytes is None:
        return None
    # No page cache or swap is modelled: all available memory is free.
    fields = [
        ("MemTotal", total_bytes),
        ("MemFree", available_bytes),
        ("MemAvailable", available_bytes),
        ("Buffers", 0),
        ("Cached", 0),
        ("SwapCached", 0),
        ("SwapTotal", 0),
        ("SwapFree", 0),
    ]
    return "".join(
        f"{key + ':':<16}{_units(value, 1024):>8} kB\n"
        for key, value in fields
        if value is not None
    )


def _diskstats_line(minor: int, disk: DiskCounters) -> str:
    read_ms = round(disk.read_time_seconds_total * 1000)
    write_ms = round(disk.write_time_seconds_total * 1000)
    counters = [
        disk.reads_total,
        0,  # merged
        _units(disk.read_bytes_total, SECTOR_BYTES),
        read_ms,
        disk.writes_total,
        0,
        _units(disk.written_bytes_total, SECTOR_BYTES),
        write_ms,
        0,  # in flight
        round(disk.io_time_seconds_total * 1000),
        read_ms + write_ms,  # weighted: each request's time in flight, summed
        *[0] * 6,  # discards (4.18) and flushes (5.5)
    ]
    return f"{_DISK_MAJOR:4d} {minor:7d} {disk.device} {_join(counters)}\n"


def _net_dev(host: HostSample) -> str:
    # Every network namespace has a loopback; the exporter skips it.
    lines = [_NET_DEV_HEADER, _NET_DEV_LINE.format("lo", *[0] * 16)]
    for n in host.networks:
        lines.append(
            _NET_DEV_LINE.format(
                n.device,
                n.receive_bytes_total,
                n.receive_packets_total,
                n.receive_errors_total,
                n.receive_drops_total,
                *[0] * 4,  # fifo frame compressed multicast
                n.transmit_bytes_total,
                n.transmit_packets_total,
                n.transmit_errors_total,
                n.transmit_drops_total,
                *[0] * 4,  # fifo colls carrier compressed
            )
        )
    return "".join(lines)


def _snmp(out_segments: int | None, retransmitted: int | None) -> str | None:
    if out_segments is None and retransmitted is None:
        return None
    columns = {**_TCP_COLUMNS, "OutSegs": out_segments, "RetransSegs": retransmitted}
    present = {k: v for k, v in columns.items() if v is not None}
    tcp = f"Tcp: {' '.join(present)}\nTcp: {_join(present.values())}\n"
    return _SNMP_BEFORE_TCP + tcp + _SNMP_AFTER_TCP


def _loadavg(load1: float | None, threads: int, last_pid: int) -> str | None:
    if load1 is None:
        return None
    # Only load1 is sampled: load5 and load15 repeat it, as under a steady load.
    load = f"{load1:.2f}"
    return f"{load} {load} {load} 1/{max(threads, 1)} {last_pid}\n"


def _process_files(stats: ProcessHostStats, btime: int, uid: int, gid: int) -> dict[str, bytes]:
    pid = stats.pid
    comm = stats.name.encode()[:COMM_BYTES].decode()
    pages = _units(stats.resident_memory_bytes, PAGE_SIZE)
    kb = pages * PAGE_SIZE // 1024
    start = _ticks(stats.create_time_seconds - btime)
    # proc(5) fields 3 to 52. ProcessHostStats keeps user + system: all of it goes to user.
    # Only resident memory is modelled, so the virtual size equals it.
    fields = [
        "S",
        1,  # ppid
        pid,  # process group
        pid,  # session
        0,  # tty
        -1,  # tpgid
        0x400000,  # flags: PF_RANDOMIZE, as an exec'd process has
        *[0] * 4,  # faults
        _ticks(stats.cpu_seconds_total),  # utime
        0,  # stime
        0,  # cutime
        0,  # cstime
        20,  # priority
        0,  # nice
        stats.threads,
        0,  # itrealvalue
        start,
        pages * PAGE_SIZE,  # vsize
        pages,  # rss
        2**64 - 1,  # rsslim: RLIM_INFINITY
        *[0] * 12,  # code and stack addresses, signals, wchan, nswap, cnswap
        17,  # exit signal: SIGCHLD
        *[0] * 14,  # processor, scheduling, delay accounting, guest time, addresses, exit code
    ]
    ids = f"{pid}\n"
    # status escapes a backslash in the name (psutil reads the name from stat, not here).
    escaped = comm.replace("\\", "\\\\")
    status = (
        f"Name:\t{escaped}\n"
        "Umask:\t0022\n"
        "State:\tS (sleeping)\n"
        f"Tgid:\t{pid}\nNgid:\t0\nPid:\t{pid}\nPPid:\t1\nTracerPid:\t0\n"
        f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
        f"Gid:\t{gid}\t{gid}\t{gid}\t{gid}\n"
        "FDSize:\t64\nGroups:\t\n"
        f"NStgid:\t{ids}NSpid:\t{ids}NSpgid:\t{ids}NSsid:\t{ids}"
        + "".join(
            f"{key}:\t{value:8d} kB\n"
            for key, value in (
                ("VmPeak", kb),
                ("VmSize", kb),
                ("VmLck", 0),
                ("VmPin", 0),
                ("VmHWM", kb),
                ("VmRSS", kb),
                ("RssAnon", kb),
                ("RssFile", 0),
                ("RssShmem", 0),
                ("VmData", kb),
                ("VmStk", 0),
                ("VmExe", 0),
                ("VmLib", 0),
                ("VmPTE", 0),
                ("VmSwap", 0),
            )
        )
        + f"Threads:\t{stats.threads}\n"
        "voluntary_ctxt_switches:\t0\nnonvoluntary_ctxt_switches:\t0\n"
    )
    io = (
        f"rchar: {stats.read_bytes_total}\nwchar: {stats.written_bytes_total}\n"
        "syscr: 0\nsyscw: 0\n"
        f"read_bytes: {stats.read_bytes_total}\nwrite_bytes: {stats.written_bytes_total}\n"
        "cancelled_write_bytes: 0\n"
    )
    return {
        # psutil completes a name past 15 bytes from argv[0]; the process ran as its name.
        "cmdline": f"{stats.name}\0".encode(),
        "comm": f"{comm}\n".encode(),
        "io": io.encode(),
        "stat": f"{pid} ({comm}) {_join(fields)}\n".encode(),
        "statm": f"{pages} {pages} 0 0 0 {pages} 0\n".encode(),
        "status": status.encode(),
    }


def _replace(path: str, content: bytes) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        pass
    else:
        try:
            # One byte more than expected tells a longer file from an equal one.
            same = os.read(fd, len(content) + 1) == content
        finally:
            os.close(fd)
        if same:
            return
    # No fsync: readers share the page cache, and nothing needs to outlive a crash.
    head, _, name = path.rpartition("/")
    temporary = f"{head}/.{name}.{os.getpid()}.tmp"
    _write_new(temporary, content)
    os.replace(temporary, path)


def _write_new(path: str, content: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _create_dir(path: str, files: Mapping[str, bytes]) -> None:
    # Filled under a hidden name, then renamed: the exporter never sees a half-made process.
    head, _, name = path.rpartition("/")
    temporary = f"{head}/.{name}.{os.getpid()}.new"
    shutil.rmtree(temporary, ignore_errors=True)  # left by a writer that died
    os.mkdir(temporary)
    for file, content in files.items():
        _write_new(f"{temporary}/{file}", content)
    os.rename(temporary, path)


def _remove_dir(path: str) -> None:
    # Renamed away first: the exporter sees the whole directory or none of it.
    head, _, name = path.rpartition("/")
    doomed = f"{head}/.{name}.{os.getpid()}.gone"
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed)


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
