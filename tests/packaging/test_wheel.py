"""`pip install .` ships one import root, `gpubalance`, and a working console script."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel, and what its build said."""
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (path,) = out.glob("gpubalance-*.whl")
    return path, result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel(built: tuple[Path, str]) -> Path:
    return built[0]


def test_wheel_has_one_import_root(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/")[0] for n in names if not n.startswith("gpubalance-")}
    assert roots == {"gpubalance"}
    for generic in ("exporter", "analyzer", "controller", "lab"):
        assert not any(n.startswith(f"{generic}/") for n in names)
    assert "gpubalance/exporter/nvml.py" in names
    assert "gpubalance/lab/fakenvml/fakenvml.c" in names  # built at run time by gcc
    assert "gpubalance/analyzer/models/default.skops" in names  # the analyzer's default


def test_every_data_folder_is_shipped_as_a_package_of_its_own(built: tuple[Path, str]) -> None:
    # a folder setuptools is not told is a package it warns it will stop shipping
    path, said = built
    assert "absent from the `packages` configuration" not in said
    names = set(zipfile.ZipFile(path).namelist())
    for data in (
        "gpubalance/lab/scenarios/skewed-heterogeneous.yaml",
        "gpubalance/lab/scenarios/README.md",
        "gpubalance/lab/data/ATTRIBUTION.md",
        "gpubalance/lab/data/AzureLLMInferenceTrace_conv.csv",
        "gpubalance/lab/VALIDATION.md",
        "gpubalance/analyzer/models/default.report.json",
        "gpubalance/dashboards/json/fleet.json",
    ):
        assert data in names, f"{data} is not in the wheel"


def test_every_source_package_is_shipped(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    mapping = {
        "gpubalance": "gpubalance",
        "exporter": "gpubalance/exporter",
        "lab": "gpubalance/lab",
    }
    for folder, target in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.relative_to(ROOT / folder).as_posix()
            assert f"{target}/{relative}" in names, f"{init} is not packaged: add it to pyproject"


def test_fresh_venv_install(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Install the wheel alone; its dependencies come from the test environment by PYTHONPATH
    # (which does not process .pth files, so the editable checkout stays out of sight).
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(site.getsitepackages())}
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import gpubalance.exporter, gpubalance; print(gpubalance.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip().startswith(str(venv))
    site_packages = Path(probe.stdout.strip()).parents[1]
    for generic in ("exporter", "analyzer", "controller", "lab"):
        assert not (site_packages / generic).exists()
    helped = subprocess.run(
        [str(venv / "bin" / "gpubalance"), "exporter", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert helped.returncode == 0, helped.stderr
    assert "--nvml-library" in helped.stdout
    # the installed package loads the model it ships
    loaded = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "from gpubalance.analyzer import model\n"
            "print(model.load_shipped().classes_[0], model.SHIPPED)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split()[-1].startswith(str(venv)), loaded.stdout
