"""Fleet balance: are the GPUs of each pool sharing the work, and if not, which and why.

What dcgm-exporter's and vLLM's dashboards lack: idle-while-queued, the spread across the GPUs
of a pool, and the analyzer's verdict per GPU over time.
"""

from __future__ import annotations

from typing import Any

from gpubalance.dashboards.common import (
    finish,
    label_variable,
    listing,
    new_dashboard,
    query,
    series,
    states,
)

UID = "gpubalance-fleet"
GPU = 'instance=~"$host", gpu=~"$gpu"'
SERVING = 'instance=~"$host", queue=~"$pool", gpu=~"$gpu"'
VERDICT = 'host=~"$host", gpu=~"$gpu"'
# the analyzer's states as numbers a state timeline can colour; "unknown" sums to 0
STATE_CODES = {"balanced": 1, "starved": 2, "overloaded": 3}
STATE_MAPPING = {
    "0": ("unknown", "text"),
    "1": ("balanced", "green"),
    "2": ("starved", "blue"),
    "3": ("overloaded", "red"),
}


def _verdict_code() -> str:
    return " + ".join(
        f'{code} * max by (host, gpu) (gpubalance_gpu_state{{{VERDICT}, state="{state}"}})'
        for state, code in STATE_CODES.items()
    )


def _spread(expr: str, by: str) -> str:
    return f"max by ({by}) ({expr}) - min by ({by}) ({expr})"


def build() -> dict[str, Any]:
    utilization = f"gpubalance_gpu_utilization_ratio{{{GPU}}}"
    completions = (
        f"sum by (instance, queue, gpu) "
        f"(rate(gpubalance_request_duration_seconds_count{{{SERVING}}}[$__rate_interval]))"
    )
    queue_per_gpu = f"sum by (instance, queue, gpu) (gpubalance_queue_depth{{{SERVING}}})"
    board = (
        new_dashboard(
            UID,
            "gpubalance / Fleet balance",
            "Per pool (the GPUs of a host serving the same queue): work left idle while a peer "
            "queues, the spread of utilization and queues, the analyzer's verdict per GPU, and "
            "demand against capacity.",
        )
        .with_variable(
            label_variable("host", "Host", "gpubalance_gpu_info", "instance"),
        )
        .with_variable(
            label_variable("pool", "Pool", 'gpubalance_queue_depth{instance=~"$host"}', "queue")
        )
        .with_variable(
            label_variable(
                "gpu", "GPU", 'gpubalance_gpu_info{instance=~"$host"}', "gpu", numeric=True
            )
        )
        .with_panel(
            series(
                "Idle while queued",
                "Share of the pool's GPU-time in which a GPU idled (or ran batches below full) "
                "while another GPU of the pool held at least half a batch of waiting work "
                "(the analyzer's latest window). Above a few percent, the router is leaving "
                "capacity unused.",
                [
                    query(
                        'gpubalance_fleet_idle_while_queued_ratio{host=~"$host", pool=~"$pool"}',
                        "{{host}} {{pool}}",
                    )
                ],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "Utilization spread across GPUs",
                "Busiest minus idlest GPU of each host, and the standard deviation: GPUs that "
                "serve the same model behind one balancer should look alike.",
                [
                    query(_spread(utilization, "instance"), "{{instance}} max − min"),
                    query(f"stddev by (instance) ({utilization})", "{{instance}} std dev"),
                ],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "Utilization per GPU",
                "Fraction of time a kernel ran, averaged over the exporter's window.",
                [query(utilization, "{{instance}} GPU {{gpu}}")],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "Queue spread across GPUs",
                "Longest minus shortest queue of each pool: one GPU queueing while its peers "
                "have none is imbalance, not load.",
                [query(_spread(queue_per_gpu, "instance, queue"), "{{instance}} {{queue}}")],
                "short",
            )
        )
        .with_panel(
            states(
                "Verdict per GPU",
                "The analyzer's state of each GPU over time: balanced, starved (idle while "
                "work waits elsewhere, or starved by its host) or overloaded.",
                [query(_verdict_code(), "{{host}} GPU {{gpu}}")],
                STATE_MAPPING,
            )
        )
        .with_panel(
            listing(
                "Verdict and cause now",
                "Each GPU's current state, with its cause and how sure the analyzer is.",
                [
                    (
                        f"gpubalance_gpu_state_confidence{{{VERDICT}}} * on (host, gpu, uuid) "
                        f"group_left (state, cause) (gpubalance_gpu_state{{{VERDICT}}} == 1)",
                        "Confidence",
                        "percentunit",
                    )
                ],
                width=12,
            )
        )
        .with_panel(
            series(
                "Demand against capacity per pool",
                "Demand: requests completed per second plus the growth of the queue (what "
                "arrives). Capacity: each GPU's best completions per second at full busy over "
                "the last 30 minutes (its completions divided by its busy share, GPUs above "
                "10 % busy), summed over the pool. NVML's busy share saturates before a "
                "card's throughput does, so the capacity reads low under heavy batching.",
                [
                    query(
                        f"sum by (instance, queue) ({completions}) + sum by (instance, queue) "
                        f"(deriv(gpubalance_queue_depth{{{SERVING}}}[$__rate_interval]))",
                        "{{instance}} {{queue}} demand",
                    ),
                    query(
                        f"sum by (instance, queue) (max_over_time(({completions} "
                        f"/ on (instance, gpu) group_left () "
                        f'(gpubalance_gpu_utilization_ratio{{instance=~"$host"}} > 0.1))[30m:]))',
                        "{{instance}} {{queue}} capacity",
                    ),
                ],
                "reqps",
                width=12,
            )
        )
    )
    return finish(board)
