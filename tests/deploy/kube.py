"""Validation of Kubernetes objects: built-in kinds against the Kubernetes API's own JSON schemas
(kubernetes-validate bundles them, strict: unknown fields are refused, as `kubectl apply
--validate=strict` refuses them), the prometheus-operator's kinds against their CRDs' schemas.

The two CRD schemas below are written down from the openAPIV3Schema of the prometheus-operator's
published CRDs (example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml,
operator 0.87.0, and monitoring.coreos.com_prometheusrules.yaml, 0.82.2, in
github.com/prometheus-operator/prometheus-operator; Apache-2.0, which allows it): types,
patterns, enums and required fields of the fields gpubalance writes, descriptions left out.
They admit only those fields (the CRD admits more), so a misspelt or misplaced field fails here
where a server would drop it without a word.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from gpubalance.cli import build_parser

KUBERNETES_VERSION = "1.37"
# the CRDs' pattern of a Prometheus duration
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
RELABEL_ACTIONS = [
    case(action)
    for action in (
        "Replace",
        "Keep",
        "Drop",
        "HashMod",
        "LabelMap",
        "LabelDrop",
        "LabelKeep",
        "Lowercase",
        "Uppercase",
        "KeepEqual",
        "DropEqual",
    )
    for case in (str.lower, str)
]


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_METADATA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": STRINGS},
    "required": ["name"],
}
_RELABEL = _object(
    {
        "action": {"type": "string", "enum": RELABEL_ACTIONS},
        "modulus": {"type": "integer"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "targetLabel": {"type": "string"},
    }
)
_SELECTOR = _object(
    {
        "matchLabels": STRINGS,
        "matchExpressions": {
            "type": "array",
            "items": _object(
                {
                    "key": {"type": "string"},
                    "operator": {"type": "string"},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)
SERVICE_MONITOR = _object(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "jobLabel": {"type": "string"},
                "selector": _SELECTOR,
                "namespaceSelector": _object(
                    {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    }
                ),
                "endpoints": {
                    "type": "array",
                    "items": _object(
                        {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["integer", "string"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": _RELABEL},
                            "metricRelabelings": {"type": "array", "items": _RELABEL},
                            "tlsConfig": {"type": "object"},
                            "basicAuth": {"type": "object"},
                            "authorization": {"type": "object"},
                        }
                    ),
                },
            },
            ("endpoints", "selector"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)
_RULE = _object(
    {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["integer", "string"]},
        "for": DURATION,
        "keep_firing_for": {**DURATION, "minLength": 1},
        "labels": STRINGS,
        "annotations": STRINGS,
    },
    ("expr",),
)
PROMETHEUS_RULE = _object(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "groups": {
                    "type": "array",
                    "items": _object(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "query_offset": DURATION,
                            "limit": {"type": "integer"},
                            "labels": STRINGS,
                            "rules": {"type": "array", "items": _RULE},
                        },
                        ("name",),
                    ),
                }
            }
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)
# the CRD's own rule, "only one of record and alert must be set", in schema words
PROMETHEUS_RULE["properties"]["spec"]["properties"]["groups"]["items"]["properties"]["rules"][
    "items"
]["oneOf"] = [{"required": ["alert"]}, {"required": ["record"]}]
CRDS = {"ServiceMonitor": SERVICE_MONITOR, "PrometheusRule": PROMETHEUS_RULE}


def validate(document: dict[str, Any]) -> None:
    """Raise with the object and the failing field unless the object is valid."""
    kind = document.get("kind")
    name = f"{kind}/{document.get('metadata', {}).get('name')}"
    if kind in CRDS:
        errors = sorted(jsonschema.Draft202012Validator(CRDS[kind]).iter_errors(document), key=str)
        if errors:
            where = "/".join(str(p) for p in errors[0].absolute_path)
            raise AssertionError(f"{name}: {where}: {errors[0].message}")
        return
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{name}: {where}: {exc.message}") from None


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def load(path: Path) -> list[dict[str, Any]]:
    return documents(path.read_text())


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`gpubalance ARGV` as our own parser reads it; fails naming a flag it does not know."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed which flag it refused
        raise AssertionError(f"gpubalance refuses {shlex.join(argv)}") from exc
    # argparse takes an abbreviation of a flag: a unit must spell each one out
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    known = commands.choices[argv[0]]._option_string_actions
    flags = {word.split("=", 1)[0] for word in argv if word.startswith("--")}
    assert flags <= known.keys(), f"gpubalance {argv[0]} has no {sorted(flags - known.keys())}"
    return args
