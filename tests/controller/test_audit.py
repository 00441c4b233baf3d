"""The audit log: read once, kept as written, rotated by size without losing what the
controller reads back from it (the last hour's changes, the breaker's state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpubalance.controller.audit import AuditLog


def _applied(log: AuditLog, at: float, target: str = "be/s1") -> None:
    log.record(
        at,
        "applied",
        recommendation=f"r{at:g}",
        target=target,
        action="set_weight",
        before=100,
        after=60,
    )


def test_the_file_is_read_once_and_what_is_recorded_after_is_kept_as_a_read_gives_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    _applied(log, 10.0)
    assert [e["recommendation"] for e in log.entries()] == ["r10"]
    # another writer's line (there is none in use: one controller writes its log) is not
    # seen by the log that has read the file already, and is by a fresh one
    with path.open("a", encoding="utf-8") as other:
        other.write(json.dumps({"at_seconds": 11.0, "decision": "paused"}) + "\n")
    assert [e["decision"] for e in log.entries()] == ["applied"]
    # recorded after the read: in memory as a read of the file gives it back (a Path is text)
    log.record(12.0, "rejected", recommendation="r12", reason="stale", before=tmp_path)
    assert log.entries()[-1] == AuditLog(path).entries()[-1]
    assert log.entries()[-1]["before"] == str(tmp_path)
    assert [e["decision"] for e in AuditLog(path).entries()] == ["applied", "paused", "rejected"]
    log.close()


def test_a_torn_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"at_seconds": 1, "decision": "paused"}\n{"at_seconds": 2, "deci', "utf-8")
    assert [e["decision"] for e in AuditLog(path).entries()] == ["paused"]


def test_a_walk_over_the_entries_may_record(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    _applied(log, 1.0)
    for entry in log.entries():
        log.record(2.0, "verified", recommendation=entry["recommendation"])
    assert [e["decision"] for e in log.entries()] == ["applied", "verified"]
    log.close()


def test_the_log_rotates_by_size_and_keeps_the_last_files(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=2000, keep=2)
    for k in range(100):
        _applied(log, float(k), target=f"be/s{k}")
    log.close()
    rotated = [path.with_name("audit.jsonl.1"), path.with_name("audit.jsonl.2")]
    assert log.rotated() == rotated[::-1]  # oldest first
    assert not path.with_name("audit.jsonl.3").exists()
    for file in (path, *rotated):
        # a file is rotated at the first line that finds it past the size
        assert file.stat().st_size < 2000 + 200
    # a restarted controller reads the rotated files too, oldest first, every line of them
    kept = [e["at_seconds"] for e in AuditLog(path, max_bytes=2000, keep=2).entries()]
    assert kept == sorted(kept) and kept[-1] == 99.0
    lines = sum(len(f.read_text("utf-8").splitlines()) for f in (path, *rotated))
    assert len(kept) == lines < 100  # the oldest file went


def test_across_a_rotation_the_memory_keeps_the_last_day_and_the_last_words(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=3000, keep=100, memory_seconds=3600.0)
    log.record(0.0, "breaker_tripped", reason="3 of 4 servers changed within 300 s")
    log.record(1.0, "paused", by="operator")
    assert log.breaker_open() and log.paused()
    day = 86400.0
    for k in range(60):
        _applied(log, day + 600.0 * k)  # ten hours: rotations on the way
    assert log.rotated(), "the log rotated"
    # in memory: the breaker's and the pause's last words, however old, and the last hour
    assert log.breaker_open() and log.paused()
    # (at each rotation, what is older than memory_seconds before the newest line goes)
    remembered = [a.at_seconds for a in log.applied_since(0.0)]
    assert [day + 600.0 * k for k in range(60)][-len(remembered) :] == remembered
    assert 6 <= len(remembered) < 60
    # read back after a restart, every retained file: the breaker is still open
    again = AuditLog(path, max_bytes=3000, keep=100)
    assert again.breaker_open() and again.paused()
    assert len(again.applied_since(0.0)) == 60
    log.record(day * 2, "rearmed", by="operator")
    log.record(day * 2, "resumed", by="operator")
    assert not log.breaker_open() and log.last_rearm() == day * 2 and not log.paused()
    log.close()


@pytest.mark.parametrize(("max_bytes", "keep"), [(0, 5), (100, 0)])
def test_a_log_that_could_not_rotate_is_refused(tmp_path: Path, max_bytes: int, keep: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        AuditLog(tmp_path / "audit.jsonl", max_bytes=max_bytes, keep=keep)


@pytest.mark.parametrize("flag", ["--audit-log-max-bytes", "--audit-log-keep"])
def test_the_controllers_rotation_flags_take_a_count(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpubalance.cli import main

    args = ["controller", "--analyzer", "http://127.0.0.1:9", "--haproxy-socket", "/nonexistent"]
    with pytest.raises(SystemExit) as exited:
        main([*args, flag, "0"])
    assert exited.value.code == 2
    assert f"{flag}: expected an integer of 1 or more, got '0'" in capsys.readouterr().err


def _state(log: AuditLog, at: float, target: str, action: str, decision: str = "applied") -> None:
    log.record(at, decision, recommendation=f"r{at:g}", target=target, action=action)


def test_the_servers_it_took_out_are_read_back_and_kept_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=3000, keep=100, memory_seconds=3600.0)
    _state(log, 0.0, "be/s1", "drain")
    _state(log, 10.0, "be/s1", "maint")  # removed: drain, then maint
    _state(log, 20.0, "be/s2", "drain")
    _state(log, 30.0, "be/s2", "ready", "undone")  # its drain undone
    _state(log, 40.0, "be/s3", "maint")
    log.record(50.0, "returned", target="be/s3", action="ready", reason="readied by a person")
    _state(log, 60.0, "be/s4", "maint", "dry_run")  # not done
    assert log.taken_out() == {"be/s1"}
    for k in range(60):
        _applied(log, 86400.0 + 600.0 * k)  # ten hours of re-weightings: rotations on the way
    assert log.rotated() and log.taken_out() == {"be/s1"}
    assert AuditLog(path, keep=100).taken_out() == {"be/s1"}  # and after a restart
    _state(log, 2 * 86400.0, "be/s1", "ready")
    assert log.taken_out() == frozenset()
    log.close()
