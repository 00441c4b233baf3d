"""Shared fixtures: the fake NVML driver, built once per test session."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpubalance.lab.fakenvml import LIBRARY_NAME, build_library, write_state


@pytest.fixture(scope="session")
def fakenvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the fake `libnvidia-ml.so.1`, private to this run."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc builds the fake NVML library: sudo apt-get install gcc")
    out = tmp_path_factory.mktemp("fakenvml")
    build_library(out)
    return out


@pytest.fixture
def fakenvml_env(fakenvml_dir: Path) -> Callable[[str | Path], dict[str, str]]:
    """Returns env(state_path): the environment for a subprocess on the fake driver."""

    def env(state_path: str | Path) -> dict[str, str]:
        environ = dict(os.environ)
        # the loader reads LD_LIBRARY_PATH only at process start, hence subprocesses
        environ["LD_LIBRARY_PATH"] = str(fakenvml_dir)
        environ["FAKE_NVML_STATE"] = str(state_path)
        return environ

    return env


@dataclass(frozen=True)
class FakeNvml:
    """The in-process fake driver: its state file and the loaded library."""

    state_path: Path
    lib: ctypes.CDLL

    def write(self, state: Mapping[str, object]) -> None:
        write_state(self.state_path, state)


@pytest.fixture
def nvml(fakenvml_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    """pynvml initialised on the fake driver with 8 default GPUs."""
    import pynvml

    state_path = tmp_path / "nvml-state"
    write_state(state_path, {"device_count": 8})
    monkeypatch.setenv("FAKE_NVML_STATE", str(state_path))
    monkeypatch.delenv("FAKE_NVML_RELOAD", raising=False)
    # glibc matches pynvml's later CDLL("libnvidia-ml.so.1") to this object by SONAME
    lib = ctypes.CDLL(str(fakenvml_dir / LIBRARY_NAME))
    pynvml.nvmlInit()
    assert pynvml.nvmlLib._handle == lib._handle, "pynvml loaded a real NVML library, not the fake"
    yield FakeNvml(state_path=state_path, lib=lib)
    with contextlib.suppress(pynvml.NVMLError_Uninitialized):  # the test shut down itself
        pynvml.nvmlShutdown()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for `pytest -n 2 --dist loadgroup` (make test): the tests on real clocks (live lab
    runs, real HAProxy processes) run one after another on one worker, as they would alone,
    while the other worker takes the rest file by file (a file's module fixtures built once)."""
    for item in items:
        on_the_clock = item.get_closest_marker("live") or item.get_closest_marker("haproxy")
        group = "real-clock" if on_the_clock else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With GPUBALANCE_FAILURE_LOG set (`make test-repeat` sets it), each failure's traceback is
    appended to that file as it happens: a long repeat's summary comes only at its end, and a
    run stopped early would otherwise lose them. Under pytest-xdist the controller process
    receives every worker's reports and writes the file alone (a worker, which has the hook
    too, leaves it)."""
    path = os.environ.get("GPUBALANCE_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n")
            log.write(f"{report.longreprtext}\n")
            for name, text in report.sections:
                log.write(f"--- {name}\n{text[-4000:]}\n")
            log.write("\n")
