"""The serving formats by name, and the reading helpers their adapters share.

An adapter (``triton.py``, ``vllm.py``, ``tgi.py``, ``sglang.py``) turns the metric families of
one server's ``/metrics`` into :class:`ServingReading` records and registers its ``parse`` here
under its ``FORMAT``. :func:`read` is what a scrape calls: the bounded real parser of
:func:`parse_exposition`, then the adapter.

Adapters read values only from a family of the type its server documents, and only finite,
non-negative ones: a wrong type, NaN, a negative count or a number past float range leaves that
field ``None`` (unknown), never 0 and never an exception.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client.metrics_core import Metric

from gpubalance.exporter.collectors.serving.base import ServingReading, parse_exposition

Adapter = Callable[[dict[str, Metric]], list[ServingReading]]

# A series' identity: its labels as (name, value) pairs sorted by name.
Labels = tuple[tuple[str, str], ...]

# (reading field, family, type, sample suffix: "" or a histogram's "_sum" / "_count")
Field = tuple[str, str, str, str]

# A series whose labels hold more text is skipped: no server names a queue so, and a reading's
# key becomes a label value on our /metrics.
MAX_LABELS_CHARS = 1024

# Labels that name a process, not a queue: prometheus_client's multiprocess collector adds
# ``pid`` to gauges in its "all" modes (SGLang's retraction gauges, for one), and a new PID
# after a restart must not make a new queue. Left out of a series' identity.
VOLATILE_LABELS = frozenset({"pid"})

FORMATS: dict[str, Adapter] = {}


def register(format: str) -> Callable[[Adapter], Adapter]:
    """Decorator: ``parse`` of the adapter for ``format``."""

    def decorate(parse: Adapter) -> Adapter:
        if format in FORMATS:
            raise ValueError(f"serving format {format!r} registered twice")
        FORMATS[format] = parse
        return parse

    return decorate


def read(format: str, text: str) -> list[ServingReading]:
    """The readings in one scrape's text, in the exposition format of server ``format``.

    Raises ParseError for text that cannot be used (``too_large``, ``too_many_series``,
    ``malformed``) and ValueError for a format that is not one of :data:`FORMATS`.
    """
    parse = FORMATS.get(format)
    if parse is None:
        raise ValueError(f"unknown serving format {format!r}; known: {', '.join(sorted(FORMATS))}")
    return parse(parse_exposition(text))


def values(
    families: dict[str, Metric], name: str, kind: str, suffix: str = ""
) -> dict[Labels, float]:
    """Family ``name``'s values by label set, if the family has the type ``kind``.

    ``suffix`` picks a histogram's ``_sum`` or ``_count``. A counter's samples end in ``_total``
    whether or not the server wrote it (the parser adds it), so both spellings read alike.
    Series with more than :data:`MAX_LABELS_CHARS` of labels are left out, and
    :data:`VOLATILE_LABELS` from the label sets; of series that differ only in those, the last
    written wins (prometheus_client keeps a dead process's series in "all" mode, so none is
    surely the live one).
    """
    family = families.get(name)
    if family is None or family.type != kind:
        return {}
    wanted = name + (suffix or ("_total" if kind == "counter" else ""))
    found: dict[Labels, float] = {}
    for sample in family.samples:
        labels = tuple(sorted((n, v) for n, v in sample.labels.items() if n not in VOLATILE_LABELS))
        if sample.name != wanted or sum(len(n) + len(v) for n, v in labels) > MAX_LABELS_CHARS:
            continue
        try:
            value = float(sample.value)
        except OverflowError:  # the parser keeps an integer of hundreds of digits as an int
            continue
        if math.isfinite(value) and value >= 0:
            found[labels] = value
    return found


def histogram(field: str, name: str) -> tuple[Field, Field]:
    """Histogram ``name``'s sum and count as the reading's ``<field>_sum`` and ``_count``."""
    return (
        (f"{field}_sum", name, "histogram", "_sum"),
        (f"{field}_count", name, "histogram", "_count"),
    )


def rows(families: dict[str, Metric], fields: tuple[Field, ...]) -> dict[Labels, dict[str, float]]:
    """The reading fields each label set has a value for, from a table of fields.

    A later row of the table for the same field wins where both have a value: list a metric's
    old name before its new one.
    """
    found: dict[Labels, dict[str, float]] = {}
    for field, name, kind, suffix in fields:
        for labels, value in values(families, name, kind, suffix).items():
            found.setdefault(labels, {})[field] = value
    return found


def key(labels: Labels) -> str:
    """A reading's key: ``name=value`` pairs in label-name order, stable across scrapes."""
    return ",".join(f"{name}={value}" for name, value in labels)


def index(value: str | None) -> int | None:
    """A rank or engine label as an int; a value that is not a small decimal number is none."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 6:
        return None
    return int(value)


# Last, because the adapters import the helpers above; importing this module registers them.
from gpubalance.exporter.collectors.serving import sglang, tgi, triton, vllm  # noqa: E402, F401
