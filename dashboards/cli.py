"""Grafana dashboards: `gpubalance dashboards build --out DIR` writes one JSON file each."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpubalance.dashboards import DASHBOARDS
from gpubalance.dashboards.common import render


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dashboards_command", metavar="COMMAND", required=True)
    build = sub.add_parser("build", help="write each dashboard as Grafana JSON")
    build.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write to")


def write_all(out: Path) -> list[Path]:
    """Each dashboard as ``out/<name>.json``; the folder is made if missing."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in DASHBOARDS.items():
        path = out / f"{name}.json"
        path.write_text(render(build()))
        written.append(path)
    return written


def run(args: argparse.Namespace) -> int:
    try:
        written = write_all(args.out)
    except OSError as exc:
        print(f"gpubalance dashboards: cannot write to {args.out}: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
