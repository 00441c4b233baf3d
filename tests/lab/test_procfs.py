"""The lab's fake procfs tree, read back through the exporter's real host and process collectors."""

from __future__ import annotations

import builtins
import os
import re
import shutil
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpubalance.exporter.collectors import host as host_collector
from gpubalance.exporter.collectors import processes as process_collector
from gpubalance.exporter.collectors.base import SampleParts
from gpubalance.exporter.config import ExporterConfig
from gpubalance.lab.live import procfs
from gpubalance.lab.live.procfs import write_procfs
from gpubalance.telemetry import (
    CpuTimes,
    DiskCounters,
    GpuProcess,
    GpuSample,
    HostSample,
    NetworkCounters,
    PressureStall,
    ProcessHostStats,
)

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "proc"
HZ = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
BOOT = 1714000000
# Each long enough to need cmdline, holding spaces and parentheses, or not ASCII.
NAMES = ("VLLM::EngineCore", "w) (1 2) x)", "trainer-é", "python3", "pt_data_worker", "a\\b")


@pytest.fixture(autouse=True)
def _restore_psutil_procfs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The process collector's factory sets psutil's global root; no test leaks it.
    monkeypatch.setattr(psutil, "PROCFS_PATH", psutil.PROCFS_PATH)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "proc"


def host_sample(step: int = 0, *, pressure: str = "full") -> HostSample:
    """8 CPUs, 2 disks and 2 NICs at the tree's resolution; counters grow with ``step``.

    Values are whole numbers of their unit (``k / unit``), which read back exactly.
    """
    cpus = tuple(
        CpuTimes(n, *((1000 * (n + 1) + 37 * step + m) / HZ for m in range(8))) for n in range(8)
    )
    stalls = {
        "full": (
            PressureStall(
                "cpu", 1.52 / 100, (183042877 + step) / 1e6, 0.25 / 100, (5123456 + step) / 1e6
            ),
            PressureStall("io", 12.40 / 100, 912.345678, 10.05 / 100, 801.234567),
            PressureStall("memory", 0.0, 0.003456, 0.0, 0.001234),
        ),
        # Linux before 5.13 has no "full" line for cpu.
        "cpu_without_full": (
            PressureStall("cpu", 99.99 / 100, 1.000001, None, None),
            PressureStall("io", 100.0 / 100, 2.0, 0.01 / 100, 1.5),
            PressureStall("memory", 0.07 / 100, 0.0, 0.0, 0.0),
        ),
        "none": None,
    }[pressure]
    return HostSample(
        cpus=cpus,
        pressure=stalls,
        memory_total_bytes=527951292 * 1024,
        memory_available_bytes=(401234568 - step) * 1024,
        disks=tuple(
            DiskCounters(
                device=device,
                reads_total=1843218 + step * (n + 1),
                writes_total=9834123 + step,
                read_bytes_total=(183736290 + 8 * step) * 512,
                written_bytes_total=1402398456 * 512,
                read_time_seconds_total=(412031 + step) / 1000,
                write_time_seconds_total=8123.456,
                io_time_seconds_total=(3123456 + step) / 1000,
            )
            for n, device in enumerate(("nvme0n1", "sda"))
        ),
        networks=tuple(
            NetworkCounters(
                device=device,
                receive_bytes_total=1234567890123 + 1500 * step,
                transmit_bytes_total=456789012345 * (n + 1),
                receive_packets_total=987654321 + step,
                transmit_packets_total=654321987,
                receive_errors_total=3,
                transmit_errors_total=n,
                receive_drops_total=17 + step,
                transmit_drops_total=2,
            )
            for n, device in enumerate(("eth0", "enp65s0f1np1"))
        ),
        tcp_out_segments_total=8765432109 + step,
        tcp_retransmitted_segments_total=123456,
        load1=(1234 + step) / 100,
    )


def process_stats(pid: int, step: int = 0, *, started_ticks: int | None = None) -> ProcessHostStats:
    n = pid - 4242
    return ProcessHostStats(
        pid=pid,
        name=NAMES[n % len(NAMES)],
        cpu_seconds_total=(123456 + 7890 * n + 25 * step) / HZ,
        resident_memory_bytes=(456789 + 1000 * n + step) * PAGE,
        read_bytes_total=52428800 * n + 4096 * step,
        written_bytes_total=1048576 + step,
        threads=37 + n,
        create_time_seconds=BOOT + (started_ticks or 5000000 + 100 * n) / HZ,
    )


def processes_for(*pids: int, step: int = 0) -> dict[int, ProcessHostStats]:
    return {pid: process_stats(pid, step) for pid in pids}


EIGHT = tuple(range(4242, 4250))


class Reader:
    """The exporter's two procfs collectors on one root, kept across samples as it keeps them."""

    def __init__(self, root: Path) -> None:
        config = ExporterConfig(procfs=str(root))
        self.host = host_collector.create(config)
        self.processes = process_collector.create(config)

    def read(self, *pids: int) -> tuple[HostSample, dict[int, ProcessHostStats]]:
        gpus = (
            GpuSample(index=0, uuid="GPU-0", processes=tuple(GpuProcess(p, 1 << 30) for p in pids)),
        )
        parts = SampleParts(timestamp_seconds=0.0, gpus=gpus)
        self.host.update(parts)
        self.processes.update(parts)
        assert parts.host is not None
        return parts.host, parts.processes


def assert_same(read: object, written: object) -> None:
    for field in fields(written):  # type: ignore[arg-type]
        assert getattr(read, field.name) == getattr(written, field.name), field.name


def assert_reads_back(
    reader: Reader, host: HostSample, processes: dict[int, ProcessHostStats]
) -> None:
    read_host, read_processes = reader.read(*processes)
    assert_same(read_host, host)
    assert read_processes.keys() == processes.keys()
    for pid, stats in processes.items():
        assert_same(read_processes[pid], stats)


@pytest.mark.parametrize("pressure", ["full", "cpu_without_full", "none"])
def test_collectors_read_back_what_was_written(root: Path, pressure: str) -> None:
    host = host_sample(pressure=pressure)
    processes = processes_for(*EIGHT)
    write_procfs(root, host, processes, boot_time_seconds=BOOT)
    assert_reads_back(Reader(root), host, processes)
    assert (root / "pressure").is_dir() == (pressure != "none")
    full_lines = (root / "pressure" / "cpu").read_text().count("full") if pressure != "none" else 0
    assert full_lines == (pressure == "full")


@pytest.mark.parametrize(
    "change",
    [
        {"memory_total_bytes": None, "memory_available_bytes": None},
        {"memory_available_bytes": None},  # Linux before 3.14
        {"tcp_out_segments_total": None, "tcp_retransmitted_segments_total": None},
        {"tcp_retransmitted_segments_total": None},
        {"load1": None},
        {"disks": (), "networks": (), "cpus": ()},
    ],
)
def test_missing_values_read_back_as_missing(root: Path, change: dict[str, Any]) -> None:
    host = replace(host_sample(), **change)
    write_procfs(root, host, {}, boot_time_seconds=BOOT)
    assert_reads_back(Reader(root), host, {})


def test_files_are_in_the_kernels_formats(root: Path) -> None:
    processes = processes_for(*EIGHT)
    write_procfs(root, host_sample(), processes, boot_time_seconds=BOOT + 0.9)
    stat = (root / "stat").read_text().splitlines()
    per_cpu = [[int(v) for v in line.split()[1:]] for line in stat[1:9]]
    assert stat[0].startswith("cpu  ")
    assert [int(v) for v in stat[0].split()[1:]] == [sum(c) for c in zip(*per_cpu, strict=True)]
    assert [line.split()[0] for line in stat[1:9]] == [f"cpu{n}" for n in range(8)]
    assert all(len(c) == 10 for c in per_cpu)
    assert f"btime {BOOT}" in stat
    assert {line.split()[0] for line in stat[9:]} == {
        line.split()[0] for line in (FIXTURE / "stat").read_text().splitlines()[5:]
    }
    # The protocols' columns are the real kernel's.
    snmp = (root / "net" / "snmp").read_text().splitlines()
    expected = [
        line
        for line in (FIXTURE / "net" / "snmp").read_text().splitlines()[::2]
        if not line.startswith("IcmpMsg")
    ]
    assert snmp[::2] == expected
    assert all(len(h.split()) == len(v.split()) for h, v in zip(snmp[::2], snmp[1::2], strict=True))
    net_dev = (root / "net" / "dev").read_text().splitlines()
    assert net_dev[:2] == (FIXTURE / "net" / "dev").read_text().splitlines()[:2]
    assert all(len(line.split(":")[1].split()) == 16 for line in net_dev[2:])
    assert all(len(line.split()) == 20 for line in (root / "diskstats").read_text().splitlines())
    psi = re.compile(r"^(some|full) avg10=\d+\.\d\d avg60=\d+\.\d\d avg300=\d+\.\d\d total=\d+$")
    for resource in ("cpu", "io", "memory"):
        lines = (root / "pressure" / resource).read_text().splitlines()
        assert [psi.match(line)[1] for line in lines] == ["some", "full"]  # type: ignore[index]
    assert re.fullmatch(
        r"\d+\.\d\d \d+\.\d\d \d+\.\d\d \d+/\d+ \d+\n", (root / "loadavg").read_text()
    )
    meminfo = (root / "meminfo").read_text().splitlines()
    assert meminfo[0] == "MemTotal:       527951292 kB"
    assert all(re.fullmatch(r"\w+: +\d+ kB", line) for line in meminfo)

    trainer = root / "4245"
    stat_fields = (trainer / "stat").read_text().split()
    assert len(stat_fields) == 52
    assert stat_fields[21] == str(5000000 + 100 * 3)  # starttime in ticks after the whole btime
    assert (trainer / "comm").read_text() == "python3\n"
    assert (trainer / "cmdline").read_bytes() == b"python3\0"
    status = dict(line.split(":\t", 1) for line in (trainer / "status").read_text().splitlines())
    assert status["Name"] == "python3"
    assert status["Threads"] == "40"
    assert status["VmRSS"].split() == [str((456789 + 3000) * PAGE // 1024), "kB"]
    assert status["Uid"].split() == [str(os.getuid())] * 4
    assert [line.split(":")[0] for line in (trainer / "io").read_text().splitlines()] == [
        line.split(":")[0] for line in (FIXTURE / "4242" / "io").read_text().splitlines()
    ]
    # The kernel keeps 15 bytes of a name; psutil completes it from cmdline.
    engine = root / "4242"
    assert (engine / "comm").read_text() == "VLLM::EngineCor\n"
    assert (root / "4247" / "status").read_text().startswith("Name:\ta\\\\b\n")


def test_repeated_writes_read_back_the_new_values(root: Path) -> None:
    reader = Reader(root)
    for step in range(4):
        host, processes = host_sample(step), processes_for(*EIGHT, step=step)
        write_procfs(root, host, processes, boot_time_seconds=BOOT)
        assert_reads_back(reader, host, processes)


def test_a_process_no_longer_listed_disappears(root: Path) -> None:
    reader = Reader(root)
    write_procfs(root, host_sample(), processes_for(4242, 4243), boot_time_seconds=BOOT)
    assert set(reader.read(4242, 4243)[1]) == {4242, 4243}
    write_procfs(root, host_sample(), processes_for(4243), boot_time_seconds=BOOT)
    assert not (root / "4242").exists()
    assert reader.read(4242, 4243)[1] == processes_for(4243)
    assert sorted(p.name for p in root.iterdir()) == ["4243", "diskstats", *FILES_BUT_PIDS]


FILES_BUT_PIDS = ["loadavg", "meminfo", "net", "pressure", "stat"]


def test_a_reused_pid_is_a_new_process(root: Path) -> None:
    reader = Reader(root)
    first = process_stats(4242, started_ticks=5000000)
    write_procfs(root, host_sample(), {4242: first}, boot_time_seconds=BOOT)
    assert reader.read(4242)[1] == {4242: first}
    # Same PID and name, later start: only the start time tells the new process.
    second = replace(
        process_stats(4242, started_ticks=7000000), cpu_seconds_total=15 / HZ, threads=3
    )
    write_procfs(root, host_sample(), {4242: second}, boot_time_seconds=BOOT)
    assert reader.read(4242)[1] == {4242: second}


def test_pressure_that_goes_away_takes_its_directory(root: Path) -> None:
    reader = Reader(root)
    write_procfs(root, host_sample(), {}, boot_time_seconds=BOOT)
    write_procfs(root, host_sample(pressure="none"), {}, boot_time_seconds=BOOT)
    assert not (root / "pressure").exists()
    assert reader.read()[0].pressure is None
    only_io = (host_sample().pressure or ())[1:2]
    write_procfs(root, replace(host_sample(), pressure=only_io), {}, boot_time_seconds=BOOT)
    assert sorted(p.name for p in (root / "pressure").iterdir()) == ["io"]
    assert reader.read()[0].pressure == only_io


def test_values_between_units_are_rounded_to_the_nearest(root: Path) -> None:
    base = host_sample()
    cpu = replace(base.cpus[0], user_seconds=1.234)
    disk = replace(base.disks[0], read_bytes_total=1000, read_time_seconds_total=0.0004)
    host = replace(
        base,
        cpus=(cpu,),
        disks=(disk,),
        memory_total_bytes=1536,
        load1=0.125,
        pressure=(PressureStall("cpu", 0.123456, 0.0000004, None, None),),
    )
    stats = replace(
        process_stats(4242),
        resident_memory_bytes=PAGE + 1,
        create_time_seconds=BOOT + 0.5 + 1.006,
    )
    write_procfs(root, host, {4242: stats}, boot_time_seconds=BOOT + 0.5)
    read_host, read_processes = Reader(root).read(4242)
    assert read_host.cpus[0].user_seconds == round(1.234 * HZ) / HZ
    assert read_host.disks[0].read_bytes_total == 1024
    assert read_host.disks[0].read_time_seconds_total == 0.0
    assert read_host.memory_total_bytes == 2048  # halves go up
    assert read_host.load1 in (0.12, 0.13)
    assert read_host.pressure == (PressureStall("cpu", 0.1235, 0.0, None, None),)
    assert read_processes[4242].resident_memory_bytes == PAGE
    assert read_processes[4242].create_time_seconds == BOOT + round(1.506 * HZ) / HZ


@pytest.mark.parametrize(
    ("host_change", "stats_change", "message"),
    [
        ({"pressure": ()}, {}, "pressure"),
        ({"pressure": (PressureStall("gpu", 0.0, 0.0, None, None),)}, {}, "pressure"),
        (
            {"pressure": (PressureStall("io", 0, 0, 0, 0), PressureStall("cpu", 0, 0, 0, 0))},
            {},
            "order",
        ),
        ({"pressure": (PressureStall("cpu", 0.0, 0.0, 0.0, None),)}, {}, "come together"),
        ({"disks": (DiskCounters("nvme0n1p1", 0, 0, 0, 0, 0, 0, 0),)}, {}, "nvme0n1p1"),
        ({"disks": (DiskCounters("my disk", 0, 0, 0, 0, 0, 0, 0),)}, {}, "my disk"),
        ({"networks": (NetworkCounters("lo", 0, 0, 0, 0, 0, 0, 0, 0),)}, {}, "'lo'"),
        ({"networks": (NetworkCounters("eth0:1", 0, 0, 0, 0, 0, 0, 0, 0),)}, {}, "eth0:1"),
        ({}, {"pid": 1}, "keyed 4242"),
        ({}, {"read_bytes_total": None}, "io cannot be refused"),
        ({}, {"create_time_seconds": BOOT - 1}, "before boot"),
        ({}, {"name": "/usr/bin/python3.11"}, "cmdline"),
        ({}, {"name": "data loader worker"}, "cmdline"),
        ({}, {"name": "trainer-é-rank-0"}, "cmdline"),
        ({}, {"name": "line\nbreak"}, "printable"),
    ],
)
def test_refuses_what_cannot_read_back_and_writes_nothing(
    root: Path, host_change: dict[str, Any], stats_change: dict[str, Any], message: str
) -> None:
    host = replace(host_sample(), **host_change)
    stats = replace(process_stats(4242), **stats_change)
    with pytest.raises(ValueError, match=re.escape(message)):
        write_procfs(root, host, {4242: stats}, boot_time_seconds=BOOT)
    assert not root.exists()


class Writes:
    """Every path the writer creates, replaces, renames or removes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real_open = os.open
        writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

        def spy_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & writing:
                self.paths.append(str(path))
            return real_open(path, flags, *args, **kwargs)

        def spy(real: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                # Names relative to a dir_fd are inside a directory recorded already (rmtree).
                if "dir_fd" not in kwargs:
                    self.paths.extend(str(a) for a in args if isinstance(a, str | os.PathLike))
                return real(*args, **kwargs)

            return call

        monkeypatch.setattr(os, "open", spy_open)
        for name in ("replace", "rename", "mkdir", "unlink", "rmdir"):
            monkeypatch.setattr(os, name, spy(getattr(os, name)))
        monkeypatch.setattr(shutil, "rmtree", spy(shutil.rmtree))

        real_python_open = builtins.open

        def python_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if set(mode) & set("wax+"):
                self.paths.append(str(file))
            return real_python_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", python_open)


def test_writes_nothing_outside_the_root(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    writes = Writes(monkeypatch)
    write_procfs(root, host_sample(), processes_for(*EIGHT), boot_time_seconds=BOOT)
    write_procfs(root, host_sample(1, pressure="none"), processes_for(4242), boot_time_seconds=BOOT)
    assert writes.paths
    assert all(path == str(root) or path.startswith(f"{root}/") for path in writes.paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "proc"]
    assert list(cwd.iterdir()) == []
    # Nothing left behind in the root either: temporaries are renamed into place or removed.
    assert not [p for p in root.rglob(".*")]


def test_unchanged_files_are_not_rewritten(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_procfs(root, host_sample(), processes_for(*EIGHT), boot_time_seconds=BOOT)
    writes = Writes(monkeypatch)
    write_procfs(root, host_sample(), processes_for(*EIGHT), boot_time_seconds=BOOT)
    assert writes.paths == [f"{root}/net", f"{root}/pressure"]  # mkdir, which finds them
    writes.paths.clear()
    write_procfs(
        root, replace(host_sample(), load1=1.0), processes_for(*EIGHT), boot_time_seconds=BOOT
    )
    assert [p for p in writes.paths if not p.endswith(".tmp")] == [
        f"{root}/net",
        f"{root}/pressure",
        f"{root}/loadavg",
    ]


def test_resolution_constants_are_the_kernels() -> None:
    assert procfs.CLK_TCK == host_collector.USER_HZ == process_collector.CLK_TCK
    assert procfs.PAGE_SIZE == process_collector.PAGE_SIZE
    assert procfs.SECTOR_BYTES == host_collector.SECTOR_BYTES
