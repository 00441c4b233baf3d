"""Plain types of the analyzer's answers: frame -> features -> verdict -> recommendation -> action.

The analyzer writes them, its HTTP API serves them as JSON, and the controller (or any external
executor) reads them; nothing else crosses between the two. Units are in the field names; an
unknown figure is ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

State = Literal["starved", "overloaded", "balanced", "unknown"]
STATES: tuple[State, ...] = get_args(State)

Cause = Literal[
    "routing_skew",
    "slow_card",
    "host_bound",
    "io_bound",
    "memory_pressure",
    "throttling",
    "batch_delay",
    "class_interference",
    "capacity_shortage",
    "low_demand",
    "worker_crash",
    "none",
]
CAUSES: tuple[Cause, ...] = get_args(Cause)

# which causes a state can have (the ground truth's decision rules give the same pairs)
CAUSES_OF: Mapping[State, tuple[Cause, ...]] = {
    "overloaded": (
        "memory_pressure",
        "throttling",
        "class_interference",
        "capacity_shortage",
        "slow_card",
        "routing_skew",
    ),
    "starved": (
        "worker_crash",
        "host_bound",
        "io_bound",
        "batch_delay",
        "routing_skew",
        "low_demand",
    ),
    "balanced": ("none",),
    "unknown": ("none",),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """One GPU over one window: its state, why, how sure, and what shows it."""

    host: str
    gpu: int
    uuid: str
    t_start: float  # Unix seconds (seconds since the start for a lab run's frames.csv)
    t_end: float
    state: State
    cause: Cause
    confidence: float  # 0..1
    # sentences a person can check on a dashboard: "queue 14 vs peer median 0"
    evidence: tuple[str, ...] = ()
    # why the state is unknown ("no samples for 45 s", "NVML call hung: nvmlDeviceGetPowerUsage")
    unknown_reason: str | None = None
    pool: str = ""  # the peers it was compared with: what its serving queues serve


FleetKind = Literal["imbalance", "capacity_shortage", "over_provisioning", "balanced", "unknown"]


@dataclass(frozen=True, slots=True)
class FleetVerdict:
    """One pool (the GPUs of a host that serve the same queues) over one window."""

    host: str
    pool: str
    t_start: float
    t_end: float
    kind: FleetKind
    gpus: tuple[int, ...]
    # the share of GPU-time in which some GPU of the pool idled while another had work queued
    idle_while_queued_ratio: float | None
    evidence: tuple[str, ...] = ()


Action = Literal[
    "set_weights",
    "drain",
    "move_worker",
    "add_worker",
    "remove_worker",
    "split_pools",
    "tune_batching",
    "scale_out",
    "investigate_host",
]

AckStatus = Literal["accepted", "rejected", "applied", "failed"]


@dataclass(frozen=True, slots=True)
class ExpectedEffect:
    """What the capacity model predicts the action does: ρ per GPU and idle-while-queued."""

    rho_before: Mapping[int, float]  # GPU index -> offered work over capacity
    rho_after: Mapping[int, float]
    idle_while_queued_before: float | None
    idle_while_queued_after: float | None
    # the fitted capacity behind each GPU's ρ (completions per second with work always
    # waiting) and how it was measured: "saturated" (its own windows with a queue), "shrunk"
    # (a few of those, pulled toward its same-card peers), "peers" (its same-card peers'),
    # "fitted" (its card's full-batch cost, from batch times against batch sizes), "prior"
    # (the same where its card's batch sizes did not spread: the batch-time exponent's prior),
    # "busy_rate" (its completions per busy second: a lower bound, so ρ is an upper one)
    capacity_per_second: Mapping[int, float] = field(default_factory=dict)
    capacity_source: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Recommendation:
    """A typed action an executor can take, with its reason and what it should change."""

    id: str
    action: Action
    host: str
    target: str  # a worker, a GPU ("gpu:2") or a pool
    # per action (README, "Recommendations"); set_weights: {"pool", "weights": [{"gpu",
    # "worker", "weight"}]}, each worker's share of the pool's work; drain / remove_worker:
    # {"gpu", "workers"}: the names an executor finds the GPU's servers by
    parameters: Mapping[str, object]
    reason: str
    evidence: tuple[str, ...]
    confidence: float
    # Unix time: when the situation it answers began (the first of the windows that agree on
    # it), which an executor's dwell counts from
    created_seconds: float
    expires_seconds: float
    expected: ExpectedEffect | None = None
    # cheapest first: re-weight (0) before drain before move before scale
    cost_rank: int = 0
    acks: tuple[Ack, ...] = field(default_factory=tuple)
    # Unix time: the end of the newest window it rests on, which its staleness counts from
    # (None from an analyzer before it: its creation time then)
    observed_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    """An executor's answer to a recommendation."""

    status: AckStatus
    reason: str
    by: str
    at_seconds: float
