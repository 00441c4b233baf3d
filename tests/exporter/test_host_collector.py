"""The host collector on the fixture procfs tree (tests/fixtures/proc) and on variants of it."""

from __future__ import annotations

import builtins
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpubalance.exporter.collectors import host
from gpubalance.exporter.collectors.base import NoDataError, SampleParts
from gpubalance.exporter.config import ExporterConfig
from gpubalance.telemetry import (
    CpuTimes,
    DiskCounters,
    HostSample,
    NetworkCounters,
    PressureStall,
)

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "proc"
HZ = os.sysconf("SC_CLK_TCK")


def cpu(n: int, *ticks: int) -> CpuTimes:
    return CpuTimes(n, *(t / HZ for t in ticks))


EXPECTED = HostSample(
    cpus=(
        cpu(0, 301893, 412, 81321, 5546203, 12011, 7, 9215, 3),
        cpu(1, 302188, 371, 81710, 5547011, 11876, 5, 1402, 2),
        cpu(2, 1204455, 388, 214388, 4712932, 152182, 4, 1394, 0),
        cpu(3, 301904, 362, 81185, 5547100, 12157, 6, 1426, 1),
    ),
    pressure=(
        PressureStall("cpu", 1.52 / 100, 183.042877, 0.25 / 100, 5.123456),
        PressureStall("io", 12.40 / 100, 912.345678, 10.05 / 100, 801.234567),
        PressureStall("memory", 0.0, 0.003456, 0.0, 0.001234),
    ),
    memory_total_bytes=527951292 * 1024,
    memory_available_bytes=401234568 * 1024,
    disks=(
        DiskCounters(
            device="nvme0n1",
            reads_total=1843218,
            writes_total=9834123,
            read_bytes_total=183736290 * 512,
            written_bytes_total=1402398456 * 512,
            read_time_seconds_total=412.031,
            write_time_seconds_total=8123.456,
            io_time_seconds_total=3123.456,
        ),
        DiskCounters(
            device="sda",
            reads_total=120453,
            writes_total=45032,
            read_bytes_total=9876544 * 512,
            written_bytes_total=3456784 * 512,
            read_time_seconds_total=80.211,
            write_time_seconds_total=120.987,
            io_time_seconds_total=98.765,
        ),
    ),
    networks=(
        NetworkCounters(
            device="eth0",
            receive_bytes_total=1234567890123,
            transmit_bytes_total=456789012345,
            receive_packets_total=987654321,
            transmit_packets_total=654321987,
            receive_errors_total=3,
            transmit_errors_total=1,
            receive_drops_total=17,
            transmit_drops_total=2,
        ),
    ),
    tcp_out_segments_total=8765432109,
    tcp_retransmitted_segments_total=123456,
    load1=12.34,
)


@pytest.fixture(autouse=True)
def _restore_psutil_procfs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Collector factories may set psutil's global root; no test leaks it into another.
    monkeypatch.setattr(psutil, "PROCFS_PATH", psutil.PROCFS_PATH)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A writable copy of the fixture tree, for variants."""
    root = tmp_path / "proc"
    shutil.copytree(FIXTURE, root)
    return root


def collect(root: Path, collector: host.HostCollector | None = None) -> HostSample:
    collector = collector or host.create(ExporterConfig(procfs=str(root)))
    parts = SampleParts(timestamp_seconds=0.0)
    collector.update(parts)
    assert parts.host is not None
    return parts.host


def edit(path: Path, change: Callable[[str], str]) -> None:
    path.write_text(change(path.read_text()))


def test_reads_every_field_from_the_fixture() -> None:
    assert collect(FIXTURE) == EXPECTED


def test_reads_nothing_outside_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = builtins.open

    def spy(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    collect(FIXTURE)
    assert opened
    assert all(path.startswith(f"{FIXTURE}/") for path in opened), opened


@pytest.mark.parametrize(
    "device",
    ["sda1", "hdb2", "vdc3", "xvda1", "nvme0n1p1", "nvme12n3p15", "loop0", "ram7", "zram0", "fd0"],
)
def test_ignores_partitions_and_virtual_disks(device: str) -> None:
    assert host.IGNORED_DISKS.match(device)


@pytest.mark.parametrize("device", ["sda", "xvda", "nvme0n1", "nvme10n2", "dm-0", "md127", "sr0"])
def test_keeps_whole_disks(device: str) -> None:
    assert not host.IGNORED_DISKS.match(device)


def test_skips_loopback_interface() -> None:
    assert "lo" in (FIXTURE / "net" / "dev").read_text()
    assert [n.device for n in collect(FIXTURE).networks] == ["eth0"]


def test_no_psi_is_none_and_logged_once(tree: Path, caplog: pytest.LogCaptureFixture) -> None:
    shutil.rmtree(tree / "pressure")
    collector = host.create(ExporterConfig(procfs=str(tree)))
    with caplog.at_level(logging.DEBUG, logger=host.__name__):
        first = collect(tree, collector)
        second = collect(tree, collector)
    assert first.pressure is None and second.pressure is None
    messages = [r.getMessage() for r in caplog.records if "PSI" in r.getMessage()]
    assert len(messages) == 1
    assert "CONFIG_PSI=y" in messages[0] and "psi=1" in messages[0]
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
    # The rest of the sample is unaffected.
    assert first.cpus == EXPECTED.cpus


def test_cpu_pressure_without_full_line(tree: Path) -> None:
    # Kernels before 5.13 have no "full" line for cpu.
    edit(tree / "pressure" / "cpu", lambda t: t.splitlines()[0] + "\n")
    pressure = collect(tree).pressure
    assert pressure is not None
    assert pressure[0] == PressureStall("cpu", 1.52 / 100, 183.042877, None, None)
    assert pressure[1:] == EXPECTED.pressure[1:]


def test_partial_psi_keeps_what_is_there(tree: Path) -> None:
    (tree / "pressure" / "memory").unlink()
    assert collect(tree).pressure == EXPECTED.pressure[:2]


def test_missing_optional_files_give_none_or_empty(tree: Path) -> None:
    for name in ("meminfo", "diskstats", "net/dev", "net/snmp", "loadavg"):
        (tree / name).unlink()
    sample = collect(tree)
    assert sample == HostSample(
        cpus=EXPECTED.cpus,
        pressure=EXPECTED.pressure,
        memory_total_bytes=None,
        memory_available_bytes=None,
        disks=(),
        networks=(),
        tcp_out_segments_total=None,
        tcp_retransmitted_segments_total=None,
        load1=None,
    )


def test_kernel_without_mem_available(tree: Path) -> None:
    # MemAvailable arrived in 3.14: None, not an estimate.
    edit(tree / "meminfo", lambda t: t.replace("MemAvailable:   401234568 kB\n", ""))
    sample = collect(tree)
    assert sample.memory_total_bytes == EXPECTED.memory_total_bytes
    assert sample.memory_available_bytes is None


def test_missing_stat_means_wrong_root(tmp_path: Path) -> None:
    with pytest.raises(NoDataError, match=r"stat not found: set procfs"):
        collect(tmp_path)


def test_malformed_lines_are_skipped_counted_and_logged_once(
    tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edit(tree / "stat", lambda t: t.replace("cpu3 301904", "cpu3 30x904"))
    edit(tree / "diskstats", lambda t: t + "   8      16 sdb 1 2 3\n")
    edit(tree / "net" / "dev", lambda t: t + "  eth1: 12 banana\n")
    edit(tree / "pressure" / "io", lambda t: t.replace("full avg10=10.05", "full avg10=high"))
    edit(tree / "meminfo", lambda t: t.replace("MemTotal:       527951292", "MemTotal: n/a"))
    edit(tree / "loadavg", lambda t: "garbage\n")
    edit(tree / "net" / "snmp", lambda t: t.replace(" 8765432109 123456 3", " 8765432109 123456"))
    collector = host.create(ExporterConfig(procfs=str(tree)))
    with caplog.at_level(logging.WARNING, logger=host.__name__):
        sample = collect(tree, collector)
        collect(tree, collector)

    assert sample == HostSample(
        cpus=EXPECTED.cpus[:3],
        pressure=(
            EXPECTED.pressure[0],
            PressureStall("io", 12.40 / 100, 912.345678, None, None),
            EXPECTED.pressure[2],
        ),
        memory_total_bytes=None,
        memory_available_bytes=EXPECTED.memory_available_bytes,
        disks=EXPECTED.disks,
        networks=EXPECTED.networks,
        tcp_out_segments_total=None,
        tcp_retransmitted_segments_total=None,
        load1=None,
    )
    files = ("stat", "diskstats", "net/dev", "pressure/io", "meminfo", "loadavg", "net/snmp")
    assert collector.malformed_lines_total == dict.fromkeys(files, 2)
    assert len(caplog.records) == len(files)  # once per file, not once per sample
    assert "uname -r" in caplog.records[0].getMessage()


def test_cpu_counter_dip_holds_previous_value(tree: Path) -> None:
    collector = host.create(ExporterConfig(procfs=str(tree)))
    collect(tree, collector)
    # iowait of cpu0 goes back one tick, as the kernel's per-CPU iowait is known to.
    before, after = "cpu0 301893 412 81321 5546203 12011", "cpu0 301993 412 81321 5546203 12010"
    edit(tree / "stat", lambda t: t.replace(before, after))
    cpu0 = collect(tree, collector).cpus[0]
    assert cpu0.iowait_seconds == 12011 / HZ
    assert cpu0.user_seconds == 301993 / HZ


def test_cpu_hotplug_starts_over(tree: Path) -> None:
    collector = host.create(ExporterConfig(procfs=str(tree)))
    collect(tree, collector)
    before, after = "cpu1 302188 371 81710 5547011 11876", "cpu1 10 0 20 300 4"
    edit(tree / "stat", lambda t: t.replace(before, after))
    assert collect(tree, collector).cpus[1] == cpu(1, 10, 0, 20, 300, 4, 5, 1402, 2)


def test_offline_cpu_keeps_its_number(tree: Path) -> None:
    edit(
        tree / "stat", lambda t: t.replace("cpu1 302188 371 81710 5547011 11876 5 1402 2 0 0\n", "")
    )
    assert [c.cpu for c in collect(tree).cpus] == [0, 2, 3]


def test_real_procfs() -> None:
    sample = collect(Path("/proc"))
    assert len(sample.cpus) >= 1
    assert all(c.total_seconds > 0 for c in sample.cpus)
    assert sample.memory_total_bytes is not None and sample.memory_total_bytes > 0
    assert sample.load1 is not None and sample.load1 >= 0
    assert all(n.device != "lo" for n in sample.networks)
