"""Deploy kit generators: the Kubernetes PrometheusRule of gpubalance's Prometheus rules files,
and the HAProxy frontends and backends of the pools in a config file.

The rules are written once, as plain Prometheus rules files (deploy/prometheus/rules/*.yml, what
promtool checks and tests); the prometheus-operator's PrometheusRule is made from them, so the
two never drift apart.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpubalance.config import ConfigError, load_yaml

RULE_KEYS = {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
GROUP_KEYS = {"name", "interval", "limit", "query_offset", "labels", "rules"}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="deploy_command", metavar="COMMAND", required=True)
    rule = sub.add_parser(
        "prometheusrule",
        help="a PrometheusRule (prometheus-operator) holding Prometheus rules files",
        description="Print a PrometheusRule whose groups are those of the rules files, in order.",
    )
    rule.add_argument("rules", nargs="+", type=Path, metavar="RULES.yml")
    rule.add_argument("--name", default="gpubalance", help="metadata.name (default gpubalance)")
    rule.add_argument("--namespace", default="gpubalance", help="metadata.namespace")
    rule.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label for the Prometheus' ruleSelector to match, e.g. "
        "release=kube-prometheus-stack (repeatable)",
    )
    rule.add_argument("--out", type=Path, metavar="FILE", help="write here instead of stdout")
    haproxy = sub.add_parser(
        "haproxy",
        help="HAProxy frontends and backends of the pools in a config file (pools as policies)",
        description="Print the frontend and backends of each pool in the config file's haproxy "
        "section: its policy (utilization_first, equal_share, fixed_share), tenant routing and "
        "admission (429 or 503 with Retry-After). Load it beside your own global and defaults "
        "sections: haproxy -f haproxy.cfg -f pools.cfg.",
    )
    haproxy.add_argument("--config", required=True, type=Path, metavar="FILE")
    haproxy.add_argument("--out", type=Path, metavar="FILE", help="write here instead of stdout")
    haproxy.set_defaults(_run=_haproxy)


def rule_groups(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The groups of the rules files, checked for what the PrometheusRule's schema refuses."""
    groups: list[dict[str, Any]] = []
    seen: dict[str, Path] = {}
    for path in paths:
        data, lines = load_yaml(path)
        if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
            raise ConfigError(f"{path}: not a Prometheus rules file (no list under 'groups')")
        for i, group in enumerate(data["groups"]):
            where = f"{path}:{lines.get(('groups', i), 1)}"
            if not isinstance(group, dict) or not isinstance(group.get("name"), str):
                raise ConfigError(f"{where}: groups[{i}] has no name")
            name = group["name"]
            unknown = set(group) - GROUP_KEYS
            if unknown:
                raise ConfigError(f"{where}: group {name}: unknown keys {sorted(unknown)}")
            # the CRD keys its list of groups by name: a second group of a name would be refused
            if name in seen:
                raise ConfigError(f"{where}: group {name} is also in {seen[name]}")
            seen[name] = path
            for j, rule in enumerate(group.get("rules") or []):
                if (
                    not isinstance(rule, dict)
                    or "expr" not in rule
                    or set(rule) - RULE_KEYS
                    or ("record" in rule) == ("alert" in rule)
                ):
                    at = lines.get(("groups", i, "rules", j), lines.get(("groups", i), 1))
                    raise ConfigError(
                        f"{path}:{at}: group {name}, rule {j}: expected expr and one of record "
                        f"or alert (keys {sorted(RULE_KEYS)})"
                    )
            groups.append(group)
    return groups


def prometheus_rule(
    groups: list[dict[str, Any]], name: str, namespace: str, labels: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "gpubalance", **labels},
        },
        "spec": {"groups": groups},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (expressions, descriptions) as YAML blocks, as they were written."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def dump(document: Mapping[str, Any], source: str) -> str:
    header = f"# Generated by `gpubalance deploy prometheusrule` from {source}: edit those.\n"
    return header + yaml.dump(dict(document), Dumper=_Dumper, sort_keys=False, width=100)


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--label {pair!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def run(args: argparse.Namespace) -> int:
    try:
        document = prometheus_rule(
            rule_groups(args.rules), args.name, args.namespace, _labels(args.label)
        )
    except ConfigError as exc:
        print(f"gpubalance deploy prometheusrule: {exc}", file=sys.stderr)
        return 2
    text = dump(document, " ".join(str(path) for path in args.rules))
    return _write(text, args.out, "prometheusrule")


def _haproxy(args: argparse.Namespace) -> int:
    from gpubalance.controller.pools import load, render

    try:
        text = render(load(args.config), str(args.config))
    except ConfigError as exc:
        print(f"gpubalance deploy haproxy: {exc}", file=sys.stderr)
        return 2
    return _write(text, args.out, "haproxy")


def _write(text: str, out: Path | None, command: str) -> int:
    if out is None:
        sys.stdout.write(text)
        return 0
    try:
        out.write_text(text)
    except OSError as exc:
        print(f"gpubalance deploy {command}: --out {out}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0
