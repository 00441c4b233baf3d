"""Process attribution on the fixture procfs tree (tests/fixtures/proc) and on the real /proc."""

from __future__ import annotations

import builtins
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpubalance.exporter.collectors import processes
from gpubalance.exporter.collectors.base import NoDataError, SampleParts
from gpubalance.exporter.config import ExporterConfig
from gpubalance.telemetry import GpuProcess, GpuSample, ProcessHostStats

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "proc"
HZ = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
BOOT = 1714000000  # btime in the fixture's stat
FILES = ("stat", "statm", "io")  # what a known process costs each sample

TRAINER = ProcessHostStats(
    pid=4242,
    name="python3",
    cpu_seconds_total=(123456 + 7890) / HZ,
    resident_memory_bytes=456789 * PAGE,
    read_bytes_total=52428800,
    written_bytes_total=1048576,
    threads=37,
    create_time_seconds=BOOT + 5000000 / HZ,
)
ENGINE = ProcessHostStats(
    pid=4343,
    # The kernel keeps 15 characters ("VLLM::EngineCor"); the full name comes from cmdline.
    name="VLLM::EngineCore",
    cpu_seconds_total=(98765 + 4321) / HZ,
    resident_memory_bytes=1234567 * PAGE,
    read_bytes_total=21474836480,
    written_bytes_total=8192,
    threads=212,
    create_time_seconds=BOOT + 6000000 / HZ,
)


@pytest.fixture(autouse=True)
def _restore_psutil_procfs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The factory sets psutil's global root; no test leaks it into another.
    monkeypatch.setattr(psutil, "PROCFS_PATH", psutil.PROCFS_PATH)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A writable copy of the fixture tree."""
    root = tmp_path / "proc"
    shutil.copytree(FIXTURE, root)
    return root


class Syscalls:
    """The file calls the collector makes, recorded, with failures injected by path suffix."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[str] = []  # through os.open
        self.opened_by_python: list[str] = []  # through builtins.open (psutil, one-off reads)
        self.open_errors: dict[str, Callable[[str], OSError]] = {}
        self.read_errors: dict[str, OSError] = {}
        self.open_fds: dict[int, str] = {}
        real_open, real_read, real_close = os.open, os.read, os.close
        real_python_open = builtins.open

        def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
            self.opened.append(str(path))
            for suffix, make_error in self.open_errors.items():
                if str(path).endswith(suffix):
                    raise make_error(str(path))
            fd = real_open(path, *args, **kwargs)
            self.open_fds[fd] = str(path)
            return fd

        def os_read(fd: int, n: int) -> bytes:
            for suffix, error in self.read_errors.items():
                if self.open_fds.get(fd, "").endswith(suffix):
                    raise error
            return real_read(fd, n)

        def os_close(fd: int) -> None:
            self.open_fds.pop(fd, None)
            real_close(fd)

        def python_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            self.opened_by_python.append(str(file))
            return real_python_open(file, *args, **kwargs)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(os, "read", os_read)
        monkeypatch.setattr(os, "close", os_close)
        monkeypatch.setattr(builtins, "open", python_open)


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> Syscalls:
    return Syscalls(monkeypatch)


def refused(path: str) -> OSError:
    return PermissionError(13, "Permission denied", path)


@pytest.fixture
def sleeper() -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    spawned = time.time()
    child = subprocess.Popen(["sleep", "60"])
    yield child, spawned
    child.kill()
    child.wait()


def collector_for(root: Path) -> processes.ProcessCollector:
    return processes.create(ExporterConfig(procfs=str(root)))


def collect(collector: processes.ProcessCollector, *pids: int) -> dict[int, ProcessHostStats]:
    # Two GPUs; a process on both is attributed once.
    gpus = tuple(
        GpuSample(index=i, uuid=f"GPU-{i}", processes=tuple(GpuProcess(p, 1 << 30) for p in pids))
        for i in range(2)
    )
    parts = SampleParts(timestamp_seconds=0.0, gpus=gpus)
    collector.update(parts)
    return parts.processes


def set_stat_field(root: Path, pid: int, field: int, value: int | str) -> None:
    """Rewrite field ``field`` (1-based, as in proc(5)) of /proc/<pid>/stat; 2 is the name."""
    path = root / str(pid) / "stat"
    text = path.read_text()
    head, _, tail = text.rpartition(") ")
    if field == 2:
        path.write_text(f"{head[: head.index(' (')]} ({value}) {tail}")
        return
    fields = tail.split()
    fields[field - 3] = str(value)
    path.write_text(f"{head}) {' '.join(fields)}\n")


def test_reads_every_field_from_the_fixture() -> None:
    assert collect(collector_for(FIXTURE), 4242, 4343) == {4242: TRAINER, 4343: ENGINE}


def test_factory_points_psutil_at_the_root() -> None:
    collector_for(FIXTURE)
    assert str(FIXTURE) == psutil.PROCFS_PATH


def test_reads_nothing_outside_the_root(syscalls: Syscalls) -> None:
    collect(collector_for(FIXTURE), 4242, 4343)
    paths = syscalls.opened + syscalls.opened_by_python
    assert syscalls.opened and syscalls.opened_by_python
    assert all(path.startswith(f"{FIXTURE}/") for path in paths), paths


def test_a_known_process_costs_three_small_reads_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch, syscalls: Syscalls
) -> None:
    collector = collector_for(FIXTURE)
    collect(collector, 4242, 4343)
    syscalls.opened.clear()
    syscalls.opened_by_python.clear()

    def unexpected(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("psutil called for a known process")

    monkeypatch.setattr(psutil, "Process", unexpected)
    assert collect(collector, 4242, 4343) == {4242: TRAINER, 4343: ENGINE}
    per_process = [f"{FIXTURE}/{pid}/{file}" for pid in (4242, 4343) for file in FILES]
    assert syscalls.opened == per_process
    assert syscalls.opened_by_python == []
    assert syscalls.open_fds == {}


def test_name_with_spaces_and_parentheses(tree: Path) -> None:
    # A process may name itself anything up to 15 bytes (prctl PR_SET_NAME), ")" included.
    shutil.copytree(tree / "4242", tree / "4444")
    set_stat_field(tree, 4444, 2, "w) (1 2) x)")
    collector = collector_for(tree)
    expected = replace(TRAINER, pid=4444, name="w) (1 2) x)")
    assert collect(collector, 4444) == {4444: expected}
    entry = collector._tracked[4444]
    assert collect(collector, 4444) == {4444: expected}
    assert collector._tracked[4444] is entry


def test_unresolvable_pids_are_absent_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    collector = collector_for(FIXTURE)
    with caplog.at_level(logging.INFO, logger=processes.__name__):
        assert collect(collector, 999999) == {}
        assert collect(collector, 999999, 888888) == {}
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "999999" in message and "hostPID: true" in message and "--pid=host" in message
    assert str(FIXTURE) in message


def test_one_exited_process_among_others_is_not_a_namespace_problem(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger=processes.__name__):
        assert collect(collector_for(FIXTURE), 4242, 999999) == {4242: TRAINER}
    assert caplog.records == []


def test_process_gone_between_samples_is_skipped_and_forgotten(tree: Path) -> None:
    collector = collector_for(tree)
    assert set(collect(collector, 4242, 4343)) == {4242, 4343}
    shutil.rmtree(tree / "4242")
    assert collect(collector, 4242, 4343) == {4343: ENGINE}
    assert set(collector._tracked) == {4343}


@pytest.mark.parametrize("seen_before", [False, True])
@pytest.mark.parametrize("file", ["statm", "io"])
def test_process_gone_after_its_stat(
    tree: Path, syscalls: Syscalls, seen_before: bool, file: str
) -> None:
    collector = collector_for(tree)
    if seen_before:
        collect(collector, 4242)

    def vanish(path: str) -> OSError:
        shutil.rmtree(tree / "4242")
        return FileNotFoundError(2, "No such file or directory", path)

    syscalls.open_errors[f"/4242/{file}"] = vanish
    assert collect(collector, 4242, 4343) == {4343: ENGINE}
    assert set(collector._tracked) == {4343}


@pytest.mark.parametrize("seen_before", [False, True])
def test_process_that_exits_between_open_and_read(syscalls: Syscalls, seen_before: bool) -> None:
    # procfs answers ESRCH to a read of a file opened before the process was reaped.
    collector = collector_for(FIXTURE)
    if seen_before:
        collect(collector, 4242)
    syscalls.read_errors["/4242/stat"] = ProcessLookupError(3, "No such process")
    assert collect(collector, 4242, 4343) == {4343: ENGINE}
    assert set(collector._tracked) == {4343}
    assert syscalls.open_fds == {}


@pytest.mark.parametrize("error", [psutil.NoSuchProcess(4242), psutil.ZombieProcess(4242)])
def test_process_that_dies_or_is_a_zombie_while_resolved_is_skipped(
    error: psutil.Error, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_name = psutil.Process.name

    def name(self: psutil.Process) -> str:
        if self.pid == 4242:
            raise error
        return real_name(self)

    monkeypatch.setattr(psutil.Process, "name", name)
    collector = collector_for(FIXTURE)
    assert collect(collector, 4242, 4343) == {4343: ENGINE}
    assert set(collector._tracked) == {4343}


def test_same_process_keeps_its_entry_and_reads_fresh_counters(tree: Path) -> None:
    collector = collector_for(tree)
    collect(collector, 4242)
    entry = collector._tracked[4242]
    set_stat_field(tree, 4242, 14, 200000)  # utime
    set_stat_field(tree, 4242, 15, 9000)  # stime
    set_stat_field(tree, 4242, 20, 40)  # threads
    # Resident memory comes from statm: stat's rss is a per-CPU counter left unsummed.
    set_stat_field(tree, 4242, 24, 1)
    (tree / "4242" / "statm").write_text("8123456 500000 34567 1234 0 2345678 0\n")
    io = tree / "4242" / "io"
    io.write_text(io.read_text().replace("52428800", "60000000").replace("1048576\n", "2000000\n"))
    assert collect(collector, 4242)[4242] == replace(
        TRAINER,
        cpu_seconds_total=(200000 + 9000) / HZ,
        threads=40,
        resident_memory_bytes=500000 * PAGE,
        read_bytes_total=60000000,
        written_bytes_total=2000000,
    )
    assert collector._tracked[4242] is entry


def test_boot_time_is_read_once(tree: Path, syscalls: Syscalls) -> None:
    # btime moves when the wall clock is stepped; the first value serves every process, so
    # their start times keep the order of their start ticks.
    collector = collector_for(tree)
    assert collect(collector, 4242) == {4242: TRAINER}
    (tree / "stat").write_text((tree / "stat").read_text().replace(f"btime {BOOT}", "btime 1"))
    assert collect(collector, 4242, 4343) == {4242: TRAINER, 4343: ENGINE}
    assert syscalls.opened_by_python.count(f"{tree}/stat") == 1


@pytest.mark.parametrize("stat", ["cpu  1 2 3 4 5 6 7 8 0 0\n", None])
def test_missing_boot_time_fails_the_collector_with_the_fix(tree: Path, stat: str | None) -> None:
    if stat is None:
        (tree / "stat").unlink()
    else:
        (tree / "stat").write_text(stat)
    with pytest.raises(NoDataError, match="set procfs"):
        collect(collector_for(tree), 4242)


def test_reused_pid_is_a_new_process(tree: Path) -> None:
    collector = collector_for(tree)
    collect(collector, 4242)
    entry = collector._tracked[4242]
    # The kernel hands PID 4242 to a new process: a later start time, fresh counters, and io
    # access asked again (the old process's denial was its own).
    entry.io_readable = False
    set_stat_field(tree, 4242, 22, 7000000)
    set_stat_field(tree, 4242, 14, 10)
    set_stat_field(tree, 4242, 15, 5)
    stats = collect(collector, 4242)[4242]
    assert collector._tracked[4242] is not entry
    assert stats == replace(
        TRAINER, cpu_seconds_total=(10 + 5) / HZ, create_time_seconds=BOOT + 7000000 / HZ
    )


def test_renamed_process_is_resolved_again(tree: Path) -> None:
    # Same PID and start time, new name: an exec, or prctl(PR_SET_NAME).
    collector = collector_for(tree)
    collect(collector, 4242)
    set_stat_field(tree, 4242, 2, "torchrun")
    assert collect(collector, 4242) == {4242: replace(TRAINER, name="torchrun")}


def test_forgets_processes_that_left_the_gpus() -> None:
    collector = collector_for(FIXTURE)
    collect(collector, 4242, 4343)
    collect(collector, 4343)
    assert set(collector._tracked) == {4343}
    collector.close()
    assert collector._tracked == {}


@pytest.mark.parametrize("refused_by", ["open", "read"])
def test_io_without_ptrace_access_is_none_and_not_retried(
    syscalls: Syscalls, caplog: pytest.LogCaptureFixture, refused_by: str
) -> None:
    # Other users' io files are mode 0400, refused at open(); a process that made itself
    # non-dumpable passes open() and fails the ptrace check at read().
    if refused_by == "open":
        syscalls.open_errors["/4242/io"] = refused
    else:
        syscalls.read_errors["/4242/io"] = refused("/4242/io")
    collector = collector_for(FIXTURE)
    with caplog.at_level(logging.INFO, logger=processes.__name__):
        first = collect(collector, 4242, 4343)
        second = collect(collector, 4242, 4343)
    denied = replace(TRAINER, read_bytes_total=None, written_bytes_total=None)
    assert first == second == {4242: denied, 4343: ENGINE}
    io_paths = [p for p in syscalls.opened if p.endswith("/io")]
    assert io_paths == [f"{FIXTURE}/4242/io", f"{FIXTURE}/4343/io", f"{FIXTURE}/4343/io"]
    assert syscalls.open_fds == {}
    assert len(caplog.records) == 1
    assert "CAP_SYS_PTRACE" in caplog.records[0].getMessage()


@pytest.mark.parametrize("refused_by", ["procfs", "psutil"])
def test_unreadable_process_is_skipped_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
    syscalls: Syscalls,
    caplog: pytest.LogCaptureFixture,
    refused_by: str,
) -> None:
    # hidepid=1 leaves /proc/<pid> listed but refuses its files to other users.
    def denied(self: psutil.Process) -> Any:
        raise psutil.AccessDenied(self.pid)

    if refused_by == "procfs":
        syscalls.open_errors["/stat"] = refused
    else:
        monkeypatch.setattr(psutil.Process, "name", denied)
    collector = collector_for(FIXTURE)
    with caplog.at_level(logging.INFO, logger=processes.__name__):
        assert collect(collector, 4242, 4343) == {}
        assert collect(collector, 4242) == {}
    assert len(caplog.records) == 1  # readable PIDs exist: not a namespace problem
    assert "hidepid" in caplog.records[0].getMessage()


def test_real_process_is_attributed_then_forgotten_when_it_exits(
    sleeper: tuple[subprocess.Popen[bytes], float],
) -> None:
    child, spawned = sleeper
    collector = processes.create(ExporterConfig())
    stats = collect(collector, child.pid)[child.pid]
    assert stats.name == "sleep"
    assert stats.threads == 1
    assert stats.resident_memory_bytes > 0
    assert stats.cpu_seconds_total >= 0
    assert stats.read_bytes_total is not None and stats.written_bytes_total is not None
    # btime has whole seconds and the start time ticks of 1/HZ s.
    assert spawned - 2 <= stats.create_time_seconds <= time.time() + 1
    assert stats.create_time_seconds == psutil.Process(child.pid).create_time()

    child.kill()
    child.wait()
    assert collect(collector, child.pid) == {}
    assert child.pid not in collector._tracked


def test_real_process_reads_as_psutil_reads_it(
    sleeper: tuple[subprocess.Popen[bytes], float],
) -> None:
    child, _ = sleeper
    process = psutil.Process(child.pid)
    deadline = time.monotonic() + 5
    # Once in its sleep, nothing it counts moves.
    while process.status() != psutil.STATUS_SLEEPING and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = collect(processes.create(ExporterConfig()), child.pid)[child.pid]
    with process.oneshot():
        cpu = process.cpu_times()
        io = process.io_counters()
        assert stats == ProcessHostStats(
            pid=child.pid,
            name=process.name(),
            cpu_seconds_total=pytest.approx(cpu.user + cpu.system),
            resident_memory_bytes=process.memory_info().rss,
            read_bytes_total=io.read_bytes,
            written_bytes_total=io.write_bytes,
            threads=process.num_threads(),
            create_time_seconds=process.create_time(),
        )


def test_real_process_that_exited_before_the_read() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert collect(processes.create(ExporterConfig()), child.pid) == {}
