"""The lab's routers, for the fast speed; the live speed has HAProxy do the same.

round_robin, weighted_round_robin (smooth, as HAProxy's roundrobin with weights),
least_connections (fewest in flight per unit of weight, as HAProxy's leastconn weighs
servers), random_of_2 (fewer in flight of two random picks, HAProxy's random(2)),
sticky (a session always goes to the worker its key hashes to; both speeds use
:func:`sticky_target`, the live speed through HAProxy's cookie persistence) and pooled (one
central queue the workers pull from: the simulator handles it, no per-request pick).
A worker takes new requests while its weight is above 0 and its admin state is `ready` (a
controller's `drain` or `maint`, as on HAProxy's runtime API, stops them; those in flight
finish).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Candidate(Protocol):
    name: str
    in_flight: int


def sticky_target(session: str, names: Sequence[str]) -> str:
    """The worker a session key belongs to: CRC32 of the key over the pool, in pool order."""
    return names[zlib.crc32(session.encode()) % len(names)]


class Router:
    def __init__(self, policy: str, weights: dict[str, float], seed: int) -> None:
        self.policy = policy
        self.weights = dict(weights)
        self.states: dict[str, str] = {}  # worker -> "drain" | "maint"; absent: ready
        self._rng = np.random.default_rng([seed, 0x5EED])
        self._next: dict[tuple[str, ...], int] = {}
        self._current: dict[str, float] = {}

    def weight(self, name: str) -> float:
        return self.weights.get(name, 1.0)

    def takes(self, name: str) -> bool:
        """Whether new requests may go to the worker: ready and weighted."""
        return self.states.get(name, "ready") == "ready" and self.weight(name) > 0

    def pick(
        self, pool: Sequence[Candidate], up: Sequence[Candidate], session: str | None
    ) -> Candidate:
        """Choose among ``up`` (live, non-empty) workers of ``pool`` (all, in pool order)."""
        policy = self.policy
        if policy == "sticky" and session is not None:
            target = sticky_target(session, [c.name for c in pool])
            for candidate in up:
                if candidate.name == target:
                    return candidate
            # its worker is down: HAProxy redispatches (option redispatch) round robin
        if policy == "weighted_round_robin":
            return self._smooth_weighted(up)
        if policy == "least_connections":
            # HAProxy's key: (in flight + 1) / weight; with equal weights, the fewest in flight
            load = {c.name: (c.in_flight + 1) / self.weight(c.name) for c in up}
            least = min(load.values())
            return self._round_robin([c for c in up if load[c.name] == least])
        if policy == "random_of_2":
            if len(up) == 1:
                return up[0]
            i, j = self._rng.choice(len(up), size=2, replace=False)
            a, b = up[int(i)], up[int(j)]
            return a if a.in_flight <= b.in_flight else b
        return self._round_robin(up)

    def _round_robin(self, up: Sequence[Candidate]) -> Candidate:
        key = tuple(c.name for c in up)
        i = self._next.get(key, 0)
        self._next[key] = i + 1
        return up[i % len(up)]

    def _smooth_weighted(self, up: Sequence[Candidate]) -> Candidate:
        # nginx's smooth weighted round robin: spreads picks evenly in proportion to weights
        total = 0.0
        best: Candidate | None = None
        for c in up:
            w = self.weight(c.name)
            total += w
            self._current[c.name] = self._current.get(c.name, 0.0) + w
            if best is None or self._current[c.name] > self._current[best.name]:
                best = c
        assert best is not None
        self._current[best.name] -= total
        return best
