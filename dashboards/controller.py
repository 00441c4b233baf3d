"""Controller: what it did (actions as annotations), what it refused, the weights recommended
and those HAProxy has, its serving servers, the load HAProxy shed and its queues, and its
guardrails (breaker, dry run, pause, its sources)."""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import dashboard

from gpubalance.dashboards.common import (
    DATASOURCE,
    finish,
    label_variable,
    new_dashboard,
    query,
    series,
)

UID = "gpubalance-controller"
ACTIONS = "gpubalance_controller_actions_total"
# A decision shows where its counter rose, and where its series first appears: the counter of
# an action and outcome is born at 1 with its first decision, which increase() cannot see.
ACTIONS_DECIDED = (
    f"sum by (action, outcome) (increase({ACTIONS}[$__interval]) > 0 "
    f"or ({ACTIONS} unless {ACTIONS} offset $__interval))"
)


def _actions_annotation() -> dashboard.AnnotationQuery:
    return (
        dashboard.AnnotationQuery()
        .name("Controller actions")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("orange")
        .expr(ACTIONS_DECIDED)
    )


def build() -> dict[str, Any]:
    board = (
        new_dashboard(
            UID,
            "gpubalance / Controller",
            "The controller's decisions on HAProxy (marked on every panel), the weights the "
            "analyzer recommends, the recommendations it refused and why, and its guardrails.",
        )
        .annotation(_actions_annotation())
        .with_variable(
            label_variable(
                "gpu", "GPU", "gpubalance_worker_recommended_weight", "gpu", numeric=True
            )
        )
        .with_panel(
            series(
                "Actions decided",
                "Changes decided, by action (set_weight, drain, ready, maint) and outcome "
                "(applied, dry_run, failed), since the controller started.",
                [query(f"sum by (action, outcome) ({ACTIONS})", "{{action}} {{outcome}}")],
                "short",
            )
        )
        .with_panel(
            series(
                "Recommended weights",
                "Each worker's share of its pool in the analyzer's current set_weights "
                "recommendation: what the controller steers HAProxy's weights towards.",
                [
                    query(
                        'gpubalance_worker_recommended_weight{gpu=~"$gpu"}',
                        "GPU {{gpu}} {{worker}}",
                    )
                ],
                "short",
            )
        )
        .with_panel(
            series(
                "HAProxy weights",
                "Each managed server's weight as HAProxy reported it at the controller's last "
                "pass: the recommended weights above, as far as the bounded steps have got.",
                [query("gpubalance_controller_server_weight", "{{backend}}/{{server}}")],
                "short",
            )
        )
        .with_panel(
            series(
                "Serving servers per backend",
                "Servers taking new requests (ready, up, weighted) per backend: a drain or a "
                "worker's move shows as a dip; a pool at 0 serves nothing.",
                [
                    query(
                        "sum by (backend) (gpubalance_controller_server_serving)",
                        "{{backend}}",
                    )
                ],
                "short",
            )
        )
        .with_panel(
            series(
                "Requests shed per backend",
                "Requests HAProxy answered itself instead of a worker, per second: 429 when "
                "the pool's queue is at its max_queue, 503 when no server serves or the queue "
                "timeout expired. Load the pools could not take: capacity or an outage.",
                [
                    query(
                        "sum by (backend, status) (rate(gpubalance_controller_shed_requests_total"
                        "[$__rate_interval]))",
                        "{{backend}} {{status}}",
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            series(
                "Backend queues",
                "Requests waiting in each backend's queue for a free worker slot (HAProxy's "
                "qcur) at the controller's last pass.",
                [query("gpubalance_controller_backend_queue", "{{backend}}")],
                "short",
            )
        )
        .with_panel(
            series(
                "Refusals",
                "Recommendations or changes not carried out per second, by reason (expired, "
                "stale, dwell, freeze, breaker, ...).",
                [
                    query(
                        "sum by (reason) (rate(gpubalance_controller_refusals_total"
                        "[$__rate_interval]))",
                        "{{reason}}",
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            series(
                "Breaker, dry run, pause",
                "1 while the blast-radius breaker is open (a person re-arms it), while the "
                "controller only records (no --act), and while it is paused.",
                [
                    query("gpubalance_controller_breaker_tripped", "breaker tripped"),
                    query("gpubalance_controller_dry_run", "dry run"),
                    query("gpubalance_controller_paused", "paused"),
                ],
                "short",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "Sources",
                "1 when the last pass read HAProxy and the analyzer, and their failed reads or "
                "writes per second.",
                [
                    query("gpubalance_controller_source_up", "{{source}} up"),
                    query(
                        "rate(gpubalance_controller_source_errors_total[$__rate_interval])",
                        "{{source}} errors",
                    ),
                ],
                "short",
            )
        )
        .with_panel(
            series(
                "Pass duration",
                "99th percentile of one observe-plan-guard-act-record pass.",
                [
                    query(
                        "histogram_quantile(0.99, sum by (le, instance) "
                        "(rate(gpubalance_controller_cycle_duration_seconds_bucket"
                        "[$__rate_interval])))",
                        "{{instance}} p99",
                    )
                ],
                "s",
            )
        )
    )
    model = finish(board)
    # Grafana's Prometheus annotation fields the SDK's generic annotation lacks: a step equal to
    # the expression's window, so no decision falls between two steps, and the labels to show
    (annotation,) = model["annotations"]["list"]
    annotation.update(
        {
            "step": "$__interval",
            "titleFormat": "{{action}} ({{outcome}})",
            "tagKeys": "action,outcome",
        }
    )
    return model
