"""The controller's plain types: what it observes, what it plans, what it did, and its limits.

One pass reads `Observed` (HAProxy's servers now) and the analyzer's `Recommendation`s, plans
`Change`s, guards them and records `Applied` ones. A server is named `backend/server`, as on
HAProxy's runtime CLI; a pool is a backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from gpubalance.controller.haproxy import AdminState, ServerStat, ServerState
from gpubalance.diagnosis import AckStatus

ChangeKind = Literal["set_weight", "set_state"]

# why a recommendation, or a change planned from it, was not carried out (metric label values)
RefusalReason = Literal[
    "expired",
    "stale",
    "wrong_host",
    "unknown_target",
    "bad_parameters",
    "unsupported_action",
    "contradictory",
    "already_split",
    "last_ready_server",
    "drain_timeout",
    "draining",
    "ladder",
    "dwell",
    "frozen",
    "rate_limited",
    "breaker_open",
    "paused",
    "moving",
    "move_in_flight",
]
REFUSAL_REASONS: tuple[RefusalReason, ...] = get_args(RefusalReason)


def server_key(backend: str, server: str) -> str:
    return f"{backend}/{server}"


@dataclass(frozen=True, slots=True)
class ObservedServer:
    """One HAProxy server as `show servers state` and `show stat` report it now."""

    backend: str
    server: str
    admin: AdminState
    weight: int  # the weight now (runtime API or agent-check), 0..256
    initial_weight: int  # the weight in HAProxy's config
    up: bool  # running and not failing its health checks
    sessions: int  # requests in flight now
    address: str = ""  # where HAProxy sends its requests
    port: int = 0
    requests_total: int = 0  # requests served since HAProxy started (stot)

    @property
    def key(self) -> str:
        return server_key(self.backend, self.server)

    @property
    def serving(self) -> bool:
        """Takes new requests: ready, up and weighted."""
        return self.admin == "ready" and self.up and self.weight > 0


@dataclass(frozen=True, slots=True)
class Observed:
    """HAProxy's servers at one moment, by `backend/server`."""

    at_seconds: float  # Unix time of the reading
    servers: Mapping[str, ObservedServer]
    # backend -> its balance algorithm, as `show stat`'s BACKEND row names it (where it does)
    algorithms: Mapping[str, str] = field(default_factory=dict)

    def pool(self, backend: str) -> tuple[ObservedServer, ...]:
        return tuple(s for s in self.servers.values() if s.backend == backend)

    @property
    def backends(self) -> frozenset[str]:
        return frozenset(s.backend for s in self.servers.values())


def observed_from(
    states: list[ServerState],
    stats: list[ServerStat],
    at_seconds: float,
    backends: frozenset[str] | None = None,
) -> Observed:
    """Join `show servers state` and `show stat` rows; only the managed backends when given."""
    rows = {(s.pxname, s.svname): s for s in stats if s.type == "server"}
    servers = {}
    for state in states:
        if backends is not None and state.backend not in backends:
            continue
        stat = rows.get((state.backend, state.server))
        status = stat.status if stat is not None else ""
        servers[server_key(state.backend, state.server)] = ObservedServer(
            backend=state.backend,
            server=state.server,
            admin=state.admin,
            weight=state.uweight,
            initial_weight=state.iweight,
            # op_state 2 is running; a failing health check shows as DOWN in `show stat`
            up=state.op_state == 2 and not status.startswith("DOWN"),
            sessions=stat.scur if stat is not None else 0,
            requests_total=stat.stot if stat is not None else 0,
            address=state.address,
            port=state.port,
        )
    algorithms = {
        s.pxname: s.algo
        for s in stats
        if s.type == "backend" and s.algo and (backends is None or s.pxname in backends)
    }
    return Observed(at_seconds=at_seconds, servers=servers, algorithms=algorithms)


@dataclass(frozen=True, slots=True)
class Change:
    """One runtime command: a server's weight, or its admin state."""

    kind: ChangeKind
    backend: str
    server: str
    value: int | AdminState  # the weight (set_weight) or the state (set_state)
    before: int | AdminState  # what HAProxy reported before it
    recommendation_id: str
    cost_rank: int = 0
    initial_weight: int | None = None  # the config's weight, which agent-check weights scale

    @property
    def key(self) -> str:
        return server_key(self.backend, self.server)

    @property
    def action(self) -> str:
        """The metric's action label: set_weight, drain, ready or maint."""
        return "set_weight" if self.kind == "set_weight" else str(self.value)

    def applied(self, at_seconds: float) -> Applied:
        """What the history holds of it once HAProxy took it."""
        before = self.before if isinstance(self.before, int) else None
        return Applied(at_seconds, self.key, self.recommendation_id, self.action, before)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A recommendation (or one of its changes) not carried out now, and why.

    `ack` is what the analyzer is told: `rejected` or `failed` when retrying cannot help, None
    while the controller only waits (dwell, freeze, a drain in progress).
    """

    recommendation_id: str
    reason: RefusalReason
    detail: str
    ack: AckStatus | None = None
    target: str = ""


@dataclass(frozen=True, slots=True)
class Applied:
    """A change HAProxy took: what the rate limit, freeze and breaker count."""

    at_seconds: float
    key: str  # backend/server
    recommendation_id: str
    action: str  # Change.action
    before: int | None = None  # a set_weight's weight before it, which the breaker compares


@dataclass(frozen=True, slots=True)
class Plan:
    """What one pass would do: changes, refusals, and the recommendations already met."""

    changes: tuple[Change, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    converged: tuple[str, ...] = ()  # recommendation ids whose state HAProxy shows now


@dataclass(frozen=True, slots=True)
class Settings:
    """The controller's limits; the defaults are conservative, for a server that works."""

    act: bool = False  # dry-run unless --act
    host: str | None = None  # recommendations for another host are not ours (None: any)
    backends: frozenset[str] | None = None  # the pools it manages (None: every backend)
    interval_seconds: float = 10.0
    # a recommendation resting on older telemetry is stale, whatever its expiry
    max_age_seconds: float = 300.0
    max_weight_step: int = 32  # per cycle and server, so a bad weight cannot land at once
    dwell_cycles: int = 2  # cycles a recommendation must be seen in before it acts
    freeze_seconds: float = 60.0  # per server, after an action from another recommendation
    max_actions_per_hour: int = 30
    drain_timeout_seconds: float = 120.0  # sessions must reach 0 before maint
    breaker_share: float = 0.5  # trips when more than this share of servers changed ...
    breaker_window_seconds: float = 300.0  # ... within this period
    # a re-weighting keeps a server serving: it counts as a change for the breaker only once
    # the server's share of its backend's weight fell by more than this within the period, or
    # rose by more than this above its share then and an even split of its backend
    breaker_weight_share: float = 0.25
    # after a recommendation's freeze, undo it when its backend's mean time in the system grew
    # more than this many times what it was before it
    undo_worse_ratio: float = 1.25

    def __post_init__(self) -> None:
        if self.interval_seconds <= 0:
            raise ValueError(f"interval {self.interval_seconds} s must be above 0")
        if not 1 <= self.max_weight_step <= 256:
            raise ValueError(f"max weight step {self.max_weight_step} is outside 1..256")
        if self.dwell_cycles < 1:
            raise ValueError(f"dwell {self.dwell_cycles} cycles must be at least 1")
        if not 0 < self.breaker_share <= 1:
            raise ValueError(f"breaker share {self.breaker_share} is outside (0, 1]")
        if not 0 <= self.breaker_weight_share <= 1:
            raise ValueError(f"breaker weight share {self.breaker_weight_share} is outside [0, 1]")
        for name in ("max_age_seconds", "freeze_seconds", "drain_timeout_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} must not be negative")
        if self.undo_worse_ratio < 1:
            raise ValueError(f"undo worse ratio {self.undo_worse_ratio} must be at least 1")
        if self.max_actions_per_hour < 1:
            raise ValueError("max actions per hour must be at least 1")
