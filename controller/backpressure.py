"""The load HAProxy turned away, per backend, from the counters `show stat` reports.

HAProxy 2.6 counts, in a backend's row (verified on 2.6.12, tests/controller/test_pools.py):

- an `http-request deny` in the backend (the pools' 429 when `max_queue` requests wait): its
  `dreq` and its `hrsp_4xx`, not a server's;
- a response HAProxy makes itself there, without a worker (the pools' 503 when no server
  serves, HAProxy's 503 when the queue timeout expires or no server can be connected): its
  `hrsp_5xx`, not a server's; a worker's own 5xx is counted in both the server's and the
  backend's `hrsp_5xx`.

So a backend's shed requests are its `dreq` (status 429) and its `hrsp_5xx` less its servers'
(status 503). HAProxy's counters start at 0 with each process (a reload starts a new one) and
a deleted server takes its counters with it, so what was shed is taken as the growth between
two readings, from 0 for a backend or server not seen before or whose counters went back. A
controller's first reading is its baseline (controller/metrics.py): a restarted controller
does not count HAProxy's earlier answers again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpubalance.controller.haproxy import ServerStat

SHED_STATUSES = ("429", "503")


@dataclass(frozen=True, slots=True)
class BackendCounts:
    """One backend's counters as HAProxy reported them at one reading (since it started)."""

    backend: str
    requests_total: int  # stot: every request the backend took, shed ones included
    denied: int  # dreq
    haproxy_5xx: int  # the backend's hrsp_5xx, workers' answers included
    servers_5xx: Mapping[str, int]  # each server's hrsp_5xx: the workers' own
    queue: int  # qcur: requests waiting now

    def shed_since(self, before: BackendCounts | None) -> dict[str, int]:
        """Requests shed between `before` and this reading, by status."""
        if before is not None and (
            self.requests_total < before.requests_total
            or self.denied < before.denied
            or self.haproxy_5xx < before.haproxy_5xx
        ):
            before = None  # a new HAProxy process: its counters started again at 0
        if before is None:
            before = BackendCounts(self.backend, 0, 0, 0, {}, 0)
        workers_5xx = sum(
            _growth(before.servers_5xx.get(server, 0), now)
            for server, now in self.servers_5xx.items()
        )
        return {
            "429": self.denied - before.denied,
            "503": max(0, self.haproxy_5xx - before.haproxy_5xx - workers_5xx),
        }


def _growth(before: int, now: int) -> int:
    # a server deleted and added again under its name starts from 0
    return now - before if now >= before else now


def backend_counts(
    stats: Iterable[ServerStat], backends: frozenset[str] | None = None
) -> dict[str, BackendCounts]:
    """Each backend's counts in one `show stat`; only the managed backends when given."""
    rows = [s for s in stats if backends is None or s.pxname in backends]
    servers: dict[str, dict[str, int]] = {}
    for row in rows:
        if row.type == "server":
            servers.setdefault(row.pxname, {})[row.svname] = row.hrsp_5xx or 0
    return {
        row.pxname: BackendCounts(
            backend=row.pxname,
            requests_total=row.stot,
            denied=row.dreq or 0,
            haproxy_5xx=row.hrsp_5xx or 0,
            servers_5xx=servers.get(row.pxname, {}),
            queue=row.qcur or 0,
        )
        for row in rows
        if row.type == "backend"
    }


def shed(
    before: Mapping[str, BackendCounts], now: Mapping[str, BackendCounts]
) -> dict[tuple[str, str], int]:
    """(backend, status) -> requests shed between two readings, for each backend now."""
    return {
        (backend, status): n
        for backend, counts in now.items()
        for status, n in counts.shed_since(before.get(backend)).items()
    }
