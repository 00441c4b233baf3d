"""`gpubalance docs metrics`: the reference of every metric the three processes serve.

Built from the code that serves them, not from a list kept by hand: the exporter's renderer runs
on a sample in which every field is set (so every family it can serve appears, in both naming
profiles), the analyzer's collector on a service that has made one cycle, and the controller's
metrics as its registry declares them. Only the DCGM names of the native series are kept here,
because nothing in the code pairs them; a test checks the pairs against the DCGM profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("docs/metrics.md")

# Native series -> the dcgm-exporter field the DCGM profile serves for it (its own unit).
DCGM_NAMES: Mapping[str, str] = {
    "gpubalance_gpu_utilization_ratio": "DCGM_FI_DEV_GPU_UTIL",
    "gpubalance_gpu_memory_utilization_ratio": "DCGM_FI_DEV_MEM_COPY_UTIL",
    "gpubalance_gpu_encoder_utilization_ratio": "DCGM_FI_DEV_ENC_UTIL",
    "gpubalance_gpu_decoder_utilization_ratio": "DCGM_FI_DEV_DEC_UTIL",
    "gpubalance_gpu_memory_total_bytes": "DCGM_FI_DEV_FB_TOTAL",
    "gpubalance_gpu_memory_used_bytes": "DCGM_FI_DEV_FB_USED",
    "gpubalance_gpu_memory_free_bytes": "DCGM_FI_DEV_FB_FREE",
    "gpubalance_gpu_memory_reserved_bytes": "DCGM_FI_DEV_FB_RESERVED",
    "gpubalance_gpu_temperature_celsius": "DCGM_FI_DEV_GPU_TEMP",
    "gpubalance_gpu_memory_temperature_celsius": "DCGM_FI_DEV_MEMORY_TEMP",
    "gpubalance_gpu_power_watts": "DCGM_FI_DEV_POWER_USAGE",
    "gpubalance_gpu_power_limit_watts": "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
    "gpubalance_gpu_energy_joules_total": "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "gpubalance_gpu_pcie_transmit_bytes_per_second": "DCGM_FI_PROF_PCIE_TX_BYTES",
    "gpubalance_gpu_pcie_receive_bytes_per_second": "DCGM_FI_PROF_PCIE_RX_BYTES",
    "gpubalance_gpu_pcie_replays_total": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "gpubalance_gpu_fan_speed_ratio": "DCGM_FI_DEV_FAN_SPEED",
    "gpubalance_gpu_last_xid": "DCGM_FI_DEV_XID_ERRORS",
    "gpubalance_gpu_nvlink_bytes_total": "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "gpubalance_gpu_remapped_rows_failure": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "gpubalance_gpu_remapped_rows_total": (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS, DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
    ),
    "gpubalance_gpu_clock_hertz": "DCGM_FI_DEV_SM_CLOCK, DCGM_FI_DEV_MEM_CLOCK",
    "gpubalance_gpu_max_clock_hertz": "DCGM_FI_DEV_MAX_SM_CLOCK, DCGM_FI_DEV_MAX_MEM_CLOCK",
    "gpubalance_gpu_throttle_reason": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')
# the samples a family of each type serves besides its own name
_SUFFIXES = {"summary": ("_sum", "_count"), "histogram": ("_bucket", "_sum", "_count")}


@dataclass(frozen=True, slots=True)
class MetricDoc:
    name: str  # as served (counters with _total)
    kind: str  # gauge | counter | summary | histogram
    labels: tuple[str, ...]
    help: str
    process: str  # exporter | exporter --names dcgm | analyzer | controller
    dcgm: str | None = None  # the DCGM profile's name for the same figure

    def series(self) -> tuple[str, ...]:
        """The sample names it serves (what a query names)."""
        return tuple(self.name + s for s in _SUFFIXES.get(self.kind, ("",)))


def parse_exposition(text: str, process: str) -> list[MetricDoc]:
    """Families of a text exposition (0.0.4) with the label names their samples carry.
    prometheus_client's ``_created`` gauges are left out: they belong to their counter."""
    kinds: dict[str, str] = {}
    helps: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text.replace("\\n", "\n").replace("\\\\", "\\")
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            kinds[name] = kind
            labels.setdefault(name, set())
        elif line and not line.startswith("#") and (match := _SAMPLE.match(line)):
            family = _family_of(match.group(1), kinds)
            labels[family].update(_LABEL.findall(match.group(2) or ""))
    created = {n for n in kinds if n.endswith("_created") and _owner_of_created(n, kinds)}
    return [
        MetricDoc(name, kind, tuple(sorted(labels[name])), helps.get(name, ""), process)
        for name, kind in kinds.items()
        if name not in created
    ]


def _family_of(sample: str, kinds: Mapping[str, str]) -> str:
    if sample in kinds:
        return sample
    for name, kind in kinds.items():
        if any(sample == name + s for s in _SUFFIXES.get(kind, ())):
            return name
    raise ValueError(f"sample {sample} belongs to no family of the exposition")


def _owner_of_created(name: str, kinds: Mapping[str, str]) -> bool:
    base = name.removesuffix("_created")
    return kinds.get(base + "_total") == "counter" or kinds.get(base) in _SUFFIXES


# -- the exporter ----------------------------------------------------------------------------


def _filled(cls: type, overrides: Mapping[str, Any]) -> Any:
    """An instance of dataclass ``cls`` with every field that can hold a value holding one:
    None and empty defaults are filled, other defaults (``lost=False``) kept."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        default = f.default
        if default is MISSING and f.default_factory is not MISSING:
            default = f.default_factory()
        if default is MISSING or default is None or default in ((), {}, frozenset()):
            values[f.name] = _value(hints[f.name], overrides)
    return cls(**values)


def _value(hint: Any, overrides: Mapping[str, Any]) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return _value(next(a for a in args if a is not type(None)), overrides)
    if origin is typing.Literal:
        return args[0]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (_value(args[0], overrides),)
        return tuple(_value(a, overrides) for a in args)
    if origin in (dict, Mapping) or origin is typing.get_origin(Mapping[str, str]):
        return {_value(args[0], overrides): _value(args[1], overrides)}
    if origin is frozenset:
        return frozenset({_value(args[0], overrides)})
    if is_dataclass(hint):
        return _filled(hint, overrides)
    return {bool: True, int: 1, float: 1.0, str: "x"}[hint]


def exporter_metrics() -> list[MetricDoc]:
    from gpubalance.exporter.collectors.gpu import THROTTLE_REASONS
    from gpubalance.exporter.exposition.profiles import render
    from gpubalance.exporter.view import View

    # one real reason: the DCGM profile turns the reasons into NVML's bit mask
    overrides = {"throttle_reasons": frozenset({next(iter(THROTTLE_REASONS))})}
    view = _filled(View, overrides)
    # a stale GPU's series name the NVML call it is stuck in
    stale = dataclasses.replace(view.sample.gpus[0], stale=True, stale_call="x")
    stale_view = dataclasses.replace(view, sample=dataclasses.replace(view.sample, gpus=(stale,)))
    stale_labels = {
        m.name: m.labels
        for m in parse_exposition(render(stale_view, "native").decode(), "exporter")
    }
    native = [
        _with_labels(m, stale_labels.get(m.name, ()))
        for m in parse_exposition(render(view, "native").decode(), "exporter")
    ]
    dcgm_only = {m.name for m in parse_exposition(render(view, "dcgm").decode(), "dcgm")}
    dcgm = [
        MetricDoc(m.name, m.kind, m.labels, m.help, "exporter --names dcgm")
        for m in parse_exposition(render(view, "both").decode(), "exporter")
        if m.name in dcgm_only and not m.name.startswith("gpubalance_")
    ]
    return [
        MetricDoc(m.name, m.kind, m.labels, m.help, m.process, DCGM_NAMES.get(m.name))
        for m in native
    ] + dcgm


# -- the analyzer and the controller ---------------------------------------------------------


class _NoFrames:
    """A source that answers with no complete window: one cycle then succeeds."""

    description = "reference"

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[Any]:
        return []


def analyzer_metrics() -> list[MetricDoc]:
    from prometheus_client import generate_latest

    from gpubalance.analyzer.baselines import CLASSIFIERS
    from gpubalance.analyzer.server import AnalyzerCollector, AnalyzerServer
    from gpubalance.analyzer.service import AnalyzerService

    service = AnalyzerService(_NoFrames(), CLASSIFIERS["baseline-queue"]())
    service.cycle()  # the timestamp and last-cycle families appear after one
    server = AnalyzerServer(service)
    docs = parse_exposition(generate_latest(server.registry).decode(), "analyzer")
    # families with no sample yet (no verdicts from a source without frames) carry their
    # label names only in the collector's families
    declared = {
        _served_name(f.name, f.type): tuple(getattr(f, "_labelnames", ()))
        for f in AnalyzerCollector(service).collect()
    }
    return [_with_labels(m, declared.get(m.name, ())) for m in docs]


def controller_metrics() -> list[MetricDoc]:
    from prometheus_client import generate_latest
    from prometheus_client.metrics import MetricWrapperBase

    from gpubalance.controller.metrics import Metrics

    metrics = Metrics()
    docs = parse_exposition(generate_latest(metrics.registry).decode(), "controller")
    # a labelled metric with no child yet (no action taken) serves HELP and TYPE only: its label
    # names are in the wrapper, which prometheus_client keeps in these attributes
    declared = {
        _served_name(m._name, m._type): tuple(m._labelnames)
        for m in vars(metrics).values()
        if isinstance(m, MetricWrapperBase)
    }
    return [_with_labels(m, declared.get(m.name, ())) for m in docs]


def _served_name(name: str, kind: str) -> str:
    return name + "_total" if kind == "counter" and not name.endswith("_total") else name


def _with_labels(doc: MetricDoc, labels: Iterable[str]) -> MetricDoc:
    merged = tuple(sorted(set(doc.labels) | set(labels)))
    return MetricDoc(doc.name, doc.kind, merged, doc.help, doc.process, doc.dcgm)


def all_metrics() -> list[MetricDoc]:
    return exporter_metrics() + analyzer_metrics() + controller_metrics()


# -- the document ----------------------------------------------------------------------------


def markdown(metrics: Sequence[MetricDoc]) -> str:
    intro = (
        "Every metric the exporter, the analyzer and the controller serve on `/metrics`, "
        "generated from the code that serves them: `gpubalance docs metrics` writes this file "
        "(a test checks it is current and lists everything a real scrape shows). Counters "
        "and summaries of the analyzer and the controller also serve prometheus_client's "
        "`_created` gauge, left out here. The exporter's labels are those of the native "
        "profile; Prometheus adds `instance` and `job`."
    )
    lines = ["# Metrics reference", "", textwrap.fill(intro, 95, break_on_hyphens=False), ""]
    for process, title in (
        ("exporter", "Exporter (`gpubalance exporter`, native profile)"),
        ("exporter --names dcgm", "Exporter, DCGM profile (`--names dcgm` or `both`)"),
        ("analyzer", "Analyzer (`gpubalance analyzer`)"),
        ("controller", "Controller (`gpubalance controller`)"),
    ):
        rows = sorted((m for m in metrics if m.process == process), key=lambda m: m.name)
        dcgm = process == "exporter"
        lines += [f"## {title}", ""]
        header = "| name | type | labels | help |" + (" DCGM name |" if dcgm else "")
        lines += [header, "|---|---|---|---|" + ("---|" if dcgm else "")]
        for m in rows:
            labels = ", ".join(f"`{label}`" for label in m.labels)
            cells = [f"`{m.name}`", m.kind, labels, _cell(m.help)]
            if dcgm:
                cells.append(", ".join(f"`{n}`" for n in m.dcgm.split(", ")) if m.dcgm else "")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=("metrics",), help="the reference to write")
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="FILE",
        help=f"where to write it (default {DEFAULT_OUT}; - for standard output)",
    )


def run(args: argparse.Namespace) -> int:
    text = markdown(all_metrics())
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0
