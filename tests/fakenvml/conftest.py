"""Helpers for the fake NVML driver's own tests: subprocesses and real PIDs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

RunPython = Callable[..., Any]


@pytest.fixture
def run_python() -> RunPython:
    """Returns run(code, env): runs `code` in a fresh interpreter and parses the
    JSON on its last stdout line. Variants need their own process because
    pynvml and the loader cache the library for the life of a process."""

    def run(code: str, env: dict[str, str], *, timeout: float = 60) -> Any:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert lines, f"no output; stderr:\n{proc.stderr}"
        result = json.loads(lines[-1])
        if isinstance(result, dict):
            result["_stderr"] = proc.stderr
        return result

    return run


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """PIDs of four real processes: peer tools drop PIDs that do not exist."""
    procs = [subprocess.Popen(["sleep", "120"]) for _ in range(4)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()
