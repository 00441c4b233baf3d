"""SGLang's ``/metrics`` (``--enable-metrics``) as one reading per scheduler, i.e. per GPU.

Source: ``python/sglang/srt/metrics/collector.py``. Each scheduler process (one per GPU: one per
``tp_rank`` of each pipeline stage and data-parallel replica) labels its series with
``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, and where used
``dp_rank``, ``priority`` and ``--extra-metric-labels``; a reading's key holds them all.

- ``queue_depth``: ``sglang:num_queue_reqs``; ``running``: ``sglang:num_running_reqs``.
- ``kv_cache_usage_ratio``: ``sglang:token_usage``, used / total tokens of the KV pool.
- ``batch_assembly_delay_seconds``: the ``sglang:queue_time_seconds`` histogram, from entering
  the waiting queue to entering a forward batch.
- ``allocation_failures_total``: ``sglang:num_retracted_requests_total``: decode requests the
  scheduler sends back to the queue because the KV pool cannot hold the batch's next tokens. An
  approximation: it counts retractions (a request can be retracted more than once), and
  versions before the counter existed give ``None`` (the older ``sglang:num_retracted_reqs`` is
  a gauge of the last interval, not a count).
- ``request_duration_seconds``: the ``sglang:e2e_request_latency_seconds`` histogram. The
  tokenizer manager observes it, with ``model_name`` (newer versions add ``engine_type``, and any
  custom labels) but no rank. Every rank of a TP group runs every request, so each scheduler's
  reading gets the whole of its model's (and engine type's) series, summed over custom labels:
  duplicated, not split. With ``--dp-size`` that is the whole endpoint's latency on every
  replica, not the replica's own.
- ``prompt_tokens_total``, ``generation_tokens_total``: the tokenizer manager's
  ``sglang:prompt_tokens_total`` and ``sglang:generation_tokens_total`` counters, joined onto
  the schedulers as its latency is (every rank of a TP group gets its model's whole count).
- A scheduler is known by its gauges. A histogram or counter series under another label set
  (fewer labels, or labels of its own) is joined onto the gauge rows it fits, as the
  tokenizer's are, rather than read as a scheduler without a queue; one that fits none stays a
  reading of its own. ``pid`` is no part of a reading's key (``formats.VOLATILE_LABELS``).
- ``rank``: ``tp_rank`` where it tells the schedulers apart. With ``--dp-size`` (without DP
  attention) or ``--pp-size`` several schedulers share a ``tp_rank``; theirs is ``None``, since
  the GPU position also needs the TP and PP sizes, which SGLang does not export.
- ``batch_size_*``: ``None``; SGLang exports no per-batch request count.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client.metrics_core import Metric

from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.collectors.serving.formats import (
    Field,
    Labels,
    histogram,
    index,
    key,
    register,
    rows,
)

FORMAT = "sglang"
FOLLOWS = "SGLang 0.5 (00ae9c1: python/sglang/srt/metrics/collector.py)"

_SCHEDULER: tuple[Field, ...] = (
    ("queue_depth", "sglang:num_queue_reqs", "gauge", ""),
    ("running", "sglang:num_running_reqs", "gauge", ""),
    ("kv_cache_usage_ratio", "sglang:token_usage", "gauge", ""),
    ("allocation_failures_total", "sglang:num_retracted_requests", "counter", ""),
    *histogram("batch_assembly_delay_seconds", "sglang:queue_time_seconds"),
)
_TOKENIZER: tuple[Field, ...] = (
    *histogram("request_duration_seconds", "sglang:e2e_request_latency_seconds"),
    ("prompt_tokens_total", "sglang:prompt_tokens", "counter", ""),
    ("generation_tokens_total", "sglang:generation_tokens", "counter", ""),
)


# The labels that tie the tokenizer's series to a scheduler's; others (custom labels) are summed.
_JOIN = ("model_name", "engine_type")

# The fields that only a scheduler's gauges give: a row with one of them is a scheduler.
_GAUGED = frozenset({"queue_depth", "running", "kv_cache_usage_ratio"})

Row = dict[str, float]
Rows = dict[Labels, Row]


@register(FORMAT)
def parse(families: dict[str, Metric]) -> list[ServingReading]:
    """One reading per scheduler label set (per tokenizer one, if no scheduler reports)."""
    schedulers = rows(families, _SCHEDULER)
    gauged = {labels: row for labels, row in schedulers.items() if _GAUGED & row.keys()}
    if gauged:
        loose = {labels: row for labels, row in schedulers.items() if labels not in gauged}
        schedulers = gauged | _join(gauged, loose)
    tokenizer = rows(families, _TOKENIZER)
    joined: Rows = {}
    for labels, row in tokenizer.items():
        sums = joined.setdefault(tuple((n, v) for n, v in labels if n in _JOIN), {})
        for field, value in row.items():
            sums[field] = sums.get(field, 0.0) + value
    _join(schedulers, joined)
    found = schedulers or tokenizer
    tp_ranks = Counter(dict(labels).get("tp_rank") for labels in found)
    readings = []
    for labels, row in found.items():
        tp_rank = dict(labels).get("tp_rank")
        rank = index(tp_rank) if tp_ranks[tp_rank] == 1 else None
        readings.append(ServingReading(key=key(labels), rank=rank, **row))
    return sorted(readings, key=lambda r: r.key)


def _join(targets: Rows, extra: Rows) -> Rows:
    """Add each row of ``extra`` into the target rows it fits; return the rows that fit none.

    A row fits a target when their labels agree on every name they share and one's names hold
    the other's. With fewer names it adds whole to each target it fits (every rank of a TP
    group runs every request); with more, the rows that differ in the extra names are summed.
    Targets are looked up by label values, so the work grows with the rows, not their product.
    """
    shapes: dict[tuple[str, ...], Rows] = {}
    for labels, row in targets.items():
        shapes.setdefault(tuple(n for n, _ in labels), {})[labels] = row
    # (target shape, names looked up) -> values of those names -> the target rows
    indexes: dict[tuple[tuple[str, ...], tuple[str, ...]], dict[tuple[str, ...], list[Row]]] = {}
    unjoined: Rows = {}
    for labels, row in extra.items():
        own = dict(labels)
        names = tuple(own)
        fits: list[Row] = []
        for shape, rows_of_shape in shapes.items():
            if own.keys() <= set(shape):
                lookup = indexes.get((shape, names))
                if lookup is None:
                    lookup = indexes[(shape, names)] = {}
                    for target, target_row in rows_of_shape.items():
                        values_of = dict(target)
                        lookup.setdefault(tuple(values_of[n] for n in names), []).append(target_row)
                fits += lookup.get(tuple(own[n] for n in names), [])
            elif set(shape) <= own.keys():
                target_row = rows_of_shape.get(tuple((n, own[n]) for n in shape))
                if target_row is not None:
                    fits.append(target_row)
        if not fits:
            unjoined[labels] = row
        for target_row in fits:
            for field, value in row.items():
                target_row[field] = target_row.get(field, 0.0) + value
    return unjoined
