"""The request stream of a lab run: one plain record per request, shared by both speeds.

A scenario and a seed give one list of requests (``gpubalance.lab.traffic.generate``); the fast
speed feeds it to the discrete-event model, the live speed sends it as real HTTP, and the ground
truth is computed from it, so both speeds judge the same load.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Request:
    id: int  # 0.. in arrival order
    arrival_seconds: float  # since the start of the run
    service_class: str  # "interactive", "batch", ... as the traffic source says
    tenant: str
    source: str  # name of the traffic source that made it
    prompt_tokens: int
    output_tokens: int
    session: str | None = None  # sticky routing key, when the source has sessions


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request (a row of requests.csv)."""

    id: int
    arrival_seconds: float
    start_seconds: float | None  # service began on the GPU; None when never served
    end_seconds: float | None  # answered or rejected
    gpu: int | None
    worker: str | None
    service_class: str
    tenant: str
    outcome: str  # "ok" | "rejected" | "oom" | "failed"
    batch_size: int | None = None
