"""The `gpubalance` command: one subcommand per part, each a thin layer over its package."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from gpubalance import __version__

# subcommand -> (module with `configure(parser)` and `run(args) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "exporter": ("gpubalance.exporter.cli", "run the host exporter (NVML, /proc, serving signals)"),
    "top": ("gpubalance.exporter.top", "live terminal view of an exporter's GPUs"),
    "lab": ("gpubalance.lab.cli", "the GPU-free lab: fake NVML driver, scenarios, demo"),
    "docs": ("gpubalance.metrics_reference", "write the metrics reference (docs/metrics.md)"),
    "diagnose": ("gpubalance.analyzer.cli", "each GPU starved, overloaded or balanced, and why"),
    "controller": ("gpubalance.controller.cli", "act on recommendations through HAProxy, safely"),
    "analyzer": ("gpubalance.analyzer.server", "verdicts and recommendations over HTTP; training"),
    "dashboards": ("gpubalance.dashboards.cli", "write the Grafana dashboards as JSON"),
    "report": ("gpubalance.analyzer.report", "an HTML page of plots of a recorded run"),
    "deploy": ("gpubalance.deploy", "deploy kit: the Kubernetes PrometheusRule of the rules files"),
    "run": ("gpubalance.run", "exporter, analyzer and controller of one host in one command"),
    "bench": ("gpubalance.lab.loop_bench", "benchmarks: bench loop, the closed loop in the lab"),
}
# a command's own subcommands (`gpubalance analyzer train`): the module's add_commands(sub) adds
# them, each with its own _run default; the bare command does what its own module's run() does
NESTED: dict[str, str] = {
    "analyzer": "gpubalance.analyzer.training_cli",
    "bench": "gpubalance.lab.loop_bench",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` only that subcommand's module is imported and
    configured (the others are listed by their help alone), so a command starts without
    loading every part's libraries."""
    parser = argparse.ArgumentParser(
        prog="gpubalance",
        description="Observability and imbalance diagnosis for multi-GPU NVIDIA RTX servers.",
    )
    parser.add_argument("--version", action="version", version=f"gpubalance {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if command is None or name == command:
            _add_command(sub, name, module_name, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    module_name: str,
    help_text: str,
) -> None:
    module = importlib.import_module(module_name)
    child = sub.add_parser(name, help=help_text, description=module.__doc__)
    module.configure(child)
    child.set_defaults(_run=module.run)
    if name in NESTED:
        nested = importlib.import_module(NESTED[name])
        nested.add_commands(child.add_subparsers(dest=f"{name}_command", metavar="COMMAND"))


def _command_of(argv: Sequence[str]) -> str:
    """The subcommand ``argv`` names: its first word that is not an option (the top level
    takes no option with a value). Empty when there is none."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_of(words)).parse_args(words)
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`gpubalance ... | head`): stop quietly, as coreutils do;
        # stdout goes to /dev/null so the interpreter's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # killed by SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
