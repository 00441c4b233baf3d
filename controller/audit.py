"""The audit log: one JSON line per decision, appended and flushed as it is taken.

Each line holds `at_seconds`, `decision` (applied, dry_run, failed, rejected, waiting, met,
breaker_tripped, rearmed, paused, resumed, verified, undone, returned; for a worker's move also
approved, step, and its end: moved, undone, failed, refused), `recommendation`, `target`,
`action`, `reason`, `before` and `after`; a move's lines name it (`move`) and a step its `phase`
(move or undo). It is also the controller's memory of what it did, which HAProxy cannot show:
at start the changes applied within the last hour (for the rate limit, the freezes and the
breaker), whether the breaker was left open or a person paused it, and which servers it took
out of rotation itself (less those a `returned` line names: seen ready again, readied by
someone else) are read back from it. Each line is also an event of the trace span it was
decided in (controller/tracing.py).

The file is read once, at the first question asked of it; the lines recorded after that are
kept as they are written, so a controller's later questions (each step of a move asks whether
the log has it) cost no read. It is rotated by size, as a log a service keeps should be: once
it passes `max_bytes` it becomes `PATH.1` (the older ones `PATH.2` ... `PATH.<keep>`, the
oldest dropped), and a fresh file is begun. A restarted controller reads the rotated files
too, oldest first. What the controller keeps in memory across a rotation is what its questions
need: the lines of the last `memory_seconds` (a day; the rate limit, the freezes and a move in
flight look back an hour at most), the breaker's last word (tripped or re-armed), a person's
last pause or resume and its own last state change of each server, however old.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from gpubalance.controller import tracing
from gpubalance.controller.model import Applied

log = logging.getLogger("gpubalance.controller")

MAX_BYTES = 64 * 1024 * 1024  # a file this size is rotated
KEEP = 5  # rotated files kept beside the current one
MEMORY_SECONDS = 86400.0  # the lines a controller keeps in memory across a rotation
_BREAKER = ("breaker_tripped", "rearmed")
_PAUSE = ("paused", "resumed")
# lines that change a server's admin state: its own changes, their undoing, and a server it had
# taken out seen ready again
_STATE_DECISIONS = ("applied", "undone", "returned")
_STATES = ("drain", "maint", "ready")


class AuditLog:
    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = MAX_BYTES,
        keep: int = KEEP,
        memory_seconds: float = MEMORY_SECONDS,
    ) -> None:
        if max_bytes < 1 or keep < 1:
            raise ValueError(
                f"the audit log's max_bytes ({max_bytes}) and keep ({keep}) must be >= 1"
            )
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.memory_seconds = memory_seconds
        self._file: IO[str] | None = None
        self._entries: list[dict[str, Any]] | None = None  # read at the first question

    def record(self, at_seconds: float, decision: str, **fields: Any) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        elif self._file.tell() >= self.max_bytes:
            self._rotate()
        line = {"at_seconds": round(at_seconds, 3), "decision": decision, **fields}
        text = json.dumps(line, sort_keys=True, default=str)
        assert self._file is not None
        self._file.write(text + "\n")
        self._file.flush()
        if self._entries is not None:
            self._entries.append(json.loads(text))  # as a later read would give it back
        tracing.event(decision, fields)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def rotated(self) -> list[Path]:
        """The rotated files there are, oldest first."""
        older = (self.path.with_name(f"{self.path.name}.{k}") for k in range(self.keep, 0, -1))
        return [p for p in older if p.exists()]

    def _rotate(self) -> None:
        self.close()
        for k in range(self.keep, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{k}")
            if k == self.keep:
                older.unlink(missing_ok=True)
            else:
                newer = self.path.with_name(f"{self.path.name}.{k + 1}")
                if older.exists():
                    os.replace(older, newer)
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = self.path.open("a", encoding="utf-8")
        log.info(
            "audit log %s rotated (%d bytes); the last %d kept",
            self.path,
            self.max_bytes,
            self.keep,
        )
        if self._entries:
            newest = max((e["at_seconds"] for e in self._entries if _timed(e)), default=0.0)
            breaker = [e for e in self._entries if e.get("decision") in _BREAKER][-1:]
            pause = [e for e in self._entries if e.get("decision") in _PAUSE][-1:]
            states: dict[str, dict[str, Any]] = {}  # each server's last state change
            for e in self._entries:
                if (state := _state_of(e)) is not None:
                    states[state[0]] = e
            last_words = {id(e) for e in [*breaker, *pause, *states.values()]}
            self._entries = [
                e
                for e in self._entries
                if id(e) in last_words
                or (_timed(e) and e["at_seconds"] > newest - self.memory_seconds)
            ]

    def entries(self) -> list[dict[str, Any]]:
        """Every readable line, the rotated files' first; a torn line (a crash mid-write) is
        skipped with a warning. After a rotation in this process: what the log's memory keeps
        (the module's docstring). A copy: a caller may record while it walks them."""
        if self._entries is None:
            self._entries = [e for path in [*self.rotated(), self.path] for e in _read(path)]
        return list(self._entries)

    def applied_since(self, since_seconds: float) -> list[Applied]:
        fields = ("at_seconds", "target", "recommendation", "action")
        return [
            Applied(*(e[f] for f in fields), e["before"] if _whole(e.get("before")) else None)
            for e in self.entries()
            if e.get("decision") == "applied"
            and all(f in e for f in fields)
            and e["at_seconds"] >= since_seconds
        ]

    def last_rearm(self) -> float:
        """When a person last re-armed the breaker (0 if never): earlier changes do not count."""
        return max(
            (e["at_seconds"] for e in self.entries() if e.get("decision") == "rearmed"),
            default=0.0,
        )

    def taken_out(self) -> frozenset[str]:
        """The servers (``backend/server``) whose last state change by this controller took
        them out of rotation (a drain or a maint) and that no one was seen to ready since."""
        last: dict[str, str] = {}
        for e in self.entries():
            if (state := _state_of(e)) is not None:
                last[state[0]] = state[1]
        return frozenset(key for key, state in last.items() if state != "ready")

    def breaker_open(self) -> bool:
        """The breaker stays open across a restart until a person re-arms it."""
        return self._last_word(_BREAKER) == "breaker_tripped"

    def paused(self) -> bool:
        """A person's pause holds across a restart (a crash, an upgrade, systemd's
        Restart=) until they resume the controller."""
        return self._last_word(_PAUSE) == "paused"

    def _last_word(self, decisions: tuple[str, ...]) -> str | None:
        last = [e["decision"] for e in self.entries() if e.get("decision") in decisions]
        return last[-1] if last else None


def _read(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, 1):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError:
                log.warning("%s line %d is not JSON; skipped", path, number)
                continue
            if isinstance(entry, dict):
                yield entry


def _state_of(entry: dict[str, Any]) -> tuple[str, str] | None:
    """(server, state) for a line that changed a server's admin state, else None."""
    target, action = entry.get("target"), entry.get("action")
    if entry.get("decision") in _STATE_DECISIONS and action in _STATES and isinstance(target, str):
        return target, action
    return None


def _timed(entry: dict[str, Any]) -> bool:
    return isinstance(entry.get("at_seconds"), int | float)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
