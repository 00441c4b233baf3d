"""The operator guide links files that exist and shows commands gpubalance takes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gpubalance.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "operator-guide.md"


def _links() -> list[str]:
    return [t for t in re.findall(r"\]\(([^)#\s]+)\)", GUIDE.read_text()) if "://" not in t]


def _commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip().startswith("gpubalance ")
    ]


def test_the_guide_links_files_and_shows_commands() -> None:
    assert len(_links()) >= 10 and len(_commands()) >= 4


@pytest.mark.parametrize("target", _links())
def test_a_link_leads_to_a_file_of_the_repository(target: str) -> None:
    assert (GUIDE.parent / target).resolve().exists(), f"{target} does not exist"


@pytest.mark.parametrize("command", _commands())
def test_a_command_parses_as_gpubalance_takes_it(command: str) -> None:
    # an unknown command or flag, or a missing required one, exits 2 (SystemExit fails the test)
    build_parser().parse_args(shlex.split(command)[1:])


def test_a_renamed_flag_would_fail() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["diagnose", "--form", "http://127.0.0.1:9450"])
