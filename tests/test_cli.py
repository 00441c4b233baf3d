"""The `gpubalance` command loads the part it runs, not every part."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from gpubalance.cli import SUBCOMMANDS, build_parser

# what a command imports is what it costs to start: scikit-learn alone takes seconds
PROBE = """
import json, sys
from gpubalance.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in ("sklearn", "aiohttp", "pynvml", "grafana_foundation_sdk")
                        if m in sys.modules)), file=sys.stderr)
"""


def _loaded(*argv: str) -> tuple[str, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    return result.stdout, json.loads(result.stderr.strip().splitlines()[-1])


def test_the_help_lists_every_command_and_loads_none() -> None:
    shown, loaded = _loaded("--help")
    assert all(re.search(rf"^ +{name}( |$)", shown, re.M) for name in SUBCOMMANDS), shown
    assert loaded == []


def test_a_command_loads_only_what_it_runs() -> None:
    shown, loaded = _loaded("lab", "list")
    assert "default-target" in shown
    assert loaded == []
    shown, loaded = _loaded("diagnose", "--help")
    assert "--from DIR_OR_URL" in shown and loaded == []
    _, loaded = _loaded("exporter", "--help")
    assert "pynvml" in loaded and "sklearn" not in loaded


def test_the_whole_parser_still_parses_every_command() -> None:
    parser = build_parser()
    args = parser.parse_args(["diagnose", "--from", "run"])
    assert args.command == "diagnose" and callable(args._run)
    assert parser.parse_args(["lab", "list"]).command == "lab"
