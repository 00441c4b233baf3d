"""The controller's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpubalance.controller.backpressure import SHED_STATUSES, BackendCounts, shed
from gpubalance.controller.model import REFUSAL_REASONS, Observed

SOURCES = ("haproxy", "analyzer")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.actions = Counter(
            "gpubalance_controller_actions",
            "Changes decided, by action (set_weight, drain, ready, maint; move, a worker's "
            "move to another pool, and its steps when one fails) and outcome (applied, "
            "dry_run, failed; undone: put back after its recommendation made its backend "
            "slower)",
            ["action", "outcome"],
            registry=r,
        )
        self.refusals = Counter(
            "gpubalance_controller_refusals",
            "Recommendations or changes not carried out, by reason; each reason once per "
            "recommendation and target",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)
        self.verifications = Counter(
            "gpubalance_controller_verifications",
            "Recommendations verified after their freeze, by result: kept, or undone when "
            "their backend's mean time in the system grew past --undo-worse-ratio",
            ["result"],
            registry=r,
        )
        for result in ("kept", "undone"):
            self.verifications.labels(result)
        self.breaker_tripped = Gauge(
            "gpubalance_controller_breaker_tripped",
            "1 while the blast-radius breaker is open (POST /api/v1/rearm closes it)",
            registry=r,
        )
        self.dry_run = Gauge(
            "gpubalance_controller_dry_run", "1 unless started with --act", registry=r
        )
        self.paused = Gauge(
            "gpubalance_controller_paused", "1 while paused (POST /api/v1/resume)", registry=r
        )
        self.source_up = Gauge(
            "gpubalance_controller_source_up",
            "1 when the last pass read the source (haproxy, analyzer), 0 when it failed",
            ["source"],
            registry=r,
        )
        self.source_errors = Counter(
            "gpubalance_controller_source_errors",
            "Failed reads of or writes to a source (haproxy, analyzer)",
            ["source"],
            registry=r,
        )
        for source in SOURCES:
            self.source_errors.labels(source)
        self.moves_in_flight = Gauge(
            "gpubalance_controller_moves_in_flight",
            "1 while a worker's move between pools is under way (at most one at a time)",
            registry=r,
        )
        # what HAProxy showed at the last pass that read it, the controller's changes included
        self.server_weight = Gauge(
            "gpubalance_controller_server_weight",
            "Each managed server's weight (0-256) as HAProxy reported it at the last pass",
            ["backend", "server"],
            registry=r,
        )
        self.server_serving = Gauge(
            "gpubalance_controller_server_serving",
            "1 while the server takes new requests (ready, up, weighted) at the last pass",
            ["backend", "server"],
            registry=r,
        )
        self.shed_requests = Counter(
            "gpubalance_controller_shed_requests",
            "Requests HAProxy answered itself instead of a worker, by backend and status: 429 "
            "(an http-request deny, the pools' full queue: HAProxy's dreq), 503 (no serving "
            "server, the queue timeout, no connection to a worker: the backend's hrsp_5xx less "
            "its servers'); counted between passes, so HAProxy reloads do not lower it",
            ["backend", "status"],
            registry=r,
        )
        self.backend_queue = Gauge(
            "gpubalance_controller_backend_queue",
            "Requests waiting in the backend's queue (HAProxy's qcur) at the last pass",
            ["backend"],
            registry=r,
        )
        # the backends' counters at the last pass; None before the first, which is the
        # baseline: what HAProxy shed before this controller started is not counted again
        self._counts: dict[str, BackendCounts] | None = None
        self.cycle_duration = Histogram(
            "gpubalance_controller_cycle_duration_seconds",
            "Time of one observe-plan-guard-act-record pass",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )

    def servers(self, observed: Observed) -> None:
        """The server gauges as HAProxy shows them now: a server it no longer has is gone."""
        self.server_weight.clear()
        self.server_serving.clear()
        for server in observed.servers.values():
            self.server_weight.labels(server.backend, server.server).set(server.weight)
            self.server_serving.labels(server.backend, server.server).set(int(server.serving))

    def backends(self, counts: dict[str, BackendCounts]) -> None:
        """The queue gauges as HAProxy shows them now, and what it shed since the last pass."""
        self.backend_queue.clear()
        for backend, now in counts.items():
            self.backend_queue.labels(backend).set(now.queue)
            for status in SHED_STATUSES:
                self.shed_requests.labels(backend, status)  # 0 from the first reading
        if self._counts is not None:
            for (backend, status), n in shed(self._counts, counts).items():
                self.shed_requests.labels(backend, status).inc(n)
        self._counts = counts
