"""The GPU-free lab: build the fake NVML driver, run the demo.

`gpubalance lab fakenvml build --out DIR` compiles the fake libnvidia-ml.so.1 with gcc;
`gpubalance lab demo` runs a skewed 4-GPU RTX box on it with the exporter and a live view.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_BUILD = Path("build") / "fakenvml"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab_command", metavar="COMMAND", required=True)
    fake = sub.add_parser("fakenvml", help="the fake NVML driver")
    fake_sub = fake.add_subparsers(dest="fakenvml_command", metavar="COMMAND", required=True)
    build = fake_sub.add_parser("build", help="compile libnvidia-ml.so.1 with gcc")
    build.add_argument("--out", type=Path, default=DEFAULT_BUILD, metavar="DIR")
    build.add_argument(
        "--hide",
        action="append",
        default=[],
        metavar="SYMBOL",
        help="leave an NVML symbol out (simulates an older driver); repeatable",
    )
    demo = sub.add_parser("demo", help="a skewed 4-GPU RTX box with the exporter and a live view")
    demo.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD, metavar="DIR")
    demo.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default: until Ctrl-C; 20 s when not a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    if args.lab_command == "fakenvml":
        from gpubalance.lab.fakenvml import build_library

        try:
            path = build_library(args.out, hidden_symbols=args.hide)
        except (OSError, RuntimeError) as exc:
            print(f"gpubalance lab: {exc}", file=sys.stderr)
            return 1
        print(path)
        return 0
    if args.lab_command == "demo":
        from gpubalance.lab.demo import run_demo

        duration = args.duration
        if duration is None and not (
            sys.stdout.isatty() or os.environ.get("GPUBALANCE_DEMO_FOREVER")
        ):
            duration = 20.0
        return run_demo(args.build_dir, duration)
    raise AssertionError(args.lab_command)
