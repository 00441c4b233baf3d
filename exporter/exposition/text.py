"""Prometheus text exposition format 0.0.4, written directly.

prometheus_client's renderer appends ``_total`` to every counter's name; the DCGM profile must
keep dcgm-exporter's counter names verbatim (``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``), so the
text is written here. Tests check the output with prometheus_client's parser and promtool.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

Labels = Mapping[str, str]


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


@dataclass
class _Family:
    kind: str
    help: str
    lines: list[str] = field(default_factory=list)


class Exposition:
    """Collects samples by family (in first-seen order) and renders them as text."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(
        self,
        name: str,
        kind: str,
        help: str,
        value: float | bool | None,
        labels: Labels | None = None,
        sample: str | None = None,
    ) -> None:
        """Add one sample; ``None`` (unsupported, unknown) adds nothing. ``sample`` names a
        sample that differs from its family (a histogram's ``_bucket``, ``_sum``, ``_count``)."""
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = _Family(kind, help)
        if value is None:
            return
        sample = sample or name
        if labels:
            label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            family.lines.append(f"{sample}{{{label_text}}} {format_value(float(value))}\n")
        else:
            family.lines.append(f"{sample} {format_value(float(value))}\n")

    def names(self) -> list[str]:
        return [name for name, family in self._families.items() if family.lines]

    def render(self) -> bytes:
        parts: list[str] = []
        for name, family in self._families.items():
            if not family.lines:
                continue
            parts.append(f"# HELP {name} {_escape_help(family.help)}\n")
            parts.append(f"# TYPE {name} {family.kind}\n")
            parts.extend(family.lines)
        return "".join(parts).encode()
