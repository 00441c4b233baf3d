"""The audit log: one JSON line per decision, appended and flushed as it is taken.

Each line holds `at_seconds`, `decision` (applied, dry_run, failed, rejected, waiting, met,
breaker_tripped, rearmed, paused, resumed, verified, undone; for a worker's move also approved,
step, and its end: moved, undone, failed, refused), `recommendation`, `target`, `action`,
`reason`, `before` and `after`; a move's lines name it (`move`) and a step its `phase` (move or
undo). It is also
the controller's memory of what it did, which HAProxy cannot show: at start the changes applied
within the last hour (for the rate limit, the freezes and the breaker) and whether the breaker
was left open are read back from it. Each line is also an event of the trace span it was
decided in (controller/tracing.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import IO, Any

from gpubalance.controller import tracing
from gpubalance.controller.model import Applied

log = logging.getLogger("gpubalance.controller")


class AuditLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def record(self, at_seconds: float, decision: str, **fields: Any) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        line = {"at_seconds": round(at_seconds, 3), "decision": decision, **fields}
        self._file.write(json.dumps(line, sort_keys=True, default=str) + "\n")
        self._file.flush()
        tracing.event(decision, fields)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def entries(self) -> list[dict[str, Any]]:
        """Every readable line; a torn last line (a crash mid-write) is skipped with a warning."""
        if not self.path.exists():
            return []
        found = []
        for number, text in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError:
                log.warning("%s line %d is not JSON; skipped", self.path, number)
                continue
            if isinstance(entry, dict):
                found.append(entry)
        return found

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

    def breaker_open(self) -> bool:
        """The breaker stays open across a restart until a person re-arms it."""
        last = [
            e["decision"]
            for e in self.entries()
            if e.get("decision") in ("breaker_tripped", "rearmed")
        ]
        return bool(last) and last[-1] == "breaker_tripped"


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
