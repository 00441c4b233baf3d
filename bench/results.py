"""Shared by the benchmarks: one RESULTS.md with a section per benchmark, and progress bars
that show on a terminal and stay quiet in pipes and CI."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = (
    "# Benchmark results\n\n"
    "Written by `make bench`; each section by its own script in `bench/`. Figures are medians\n"
    "of repeated runs on the machine named in each section, measured side by side in one run.\n"
)


def write_section(key: str, title: str, body: str) -> None:
    """Replace (or add) the section ``key`` of RESULTS.md, keeping the others."""
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    start, end = f"<!-- bench:{key}:start -->", f"<!-- bench:{key}:end -->"
    section = f"{start}\n## {title}\n\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = (
        pattern.sub(lambda _: section, text)
        if pattern.search(text)
        else (text.rstrip("\n") + "\n\n" + section + "\n")
    )
    RESULTS.write_text(text)


@contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[], None]]:
    """Yields advance(); draws a bar only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


def machine() -> str:
    """The CPU, its count and the Python version: what a benchmark's figures were measured on."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
