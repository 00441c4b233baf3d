"""Building the library: the exported symbol set, caching, and useful errors."""

from __future__ import annotations

import subprocess

import pytest

import gpubalance.lab.fakenvml.build as build
from gpubalance.lab.fakenvml import (
    EXPORTED_SYMBOLS,
    LIBRARY_NAME,
    TEST_HOOKS,
    BuildError,
    build_library,
)


def exported(library) -> set[str]:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True
    ).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[1] == "T"}


def test_exported_symbols_are_the_documented_list(fakenvml_dir):
    assert len(EXPORTED_SYMBOLS) == len(set(EXPORTED_SYMBOLS))
    assert exported(fakenvml_dir / LIBRARY_NAME) == set(EXPORTED_SYMBOLS) | set(TEST_HOOKS)


def test_library_has_the_soname(fakenvml_dir):
    # without it an in-process CDLL(<absolute path>) does not satisfy pynvml's CDLL(soname)
    out = subprocess.run(
        ["readelf", "-d", str(fakenvml_dir / LIBRARY_NAME)], capture_output=True, text=True
    ).stdout
    assert f"Library soname: [{LIBRARY_NAME}]" in out


def test_hidden_symbols_leave_the_rest(tmp_path):
    lib = build_library(tmp_path, hidden_symbols=["nvmlDeviceGetFanSpeed_v2"], optimize=False)
    assert exported(lib) == (set(EXPORTED_SYMBOLS) | set(TEST_HOOKS)) - {"nvmlDeviceGetFanSpeed_v2"}


def test_matching_stamp_skips_the_rebuild(tmp_path, monkeypatch):
    lib = build_library(tmp_path, optimize=False)
    before = lib.stat().st_mtime_ns

    def no_gcc(*args, **kwargs):
        raise AssertionError("rebuilt although nothing changed")

    monkeypatch.setattr(build.subprocess, "run", no_gcc)
    assert build_library(tmp_path, optimize=False) == lib
    assert lib.stat().st_mtime_ns == before


def test_unknown_hidden_symbol_is_refused(tmp_path):
    with pytest.raises(ValueError, match="nvmlDeviceGetFanSpeeed"):
        build_library(tmp_path, hidden_symbols=["nvmlDeviceGetFanSpeeed"])


def test_missing_gcc_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(BuildError, match="apt-get install gcc"):
        build_library(tmp_path)


def test_compile_error_carries_gcc_output(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "COMPILE_FLAGS", (*build.COMPILE_FLAGS, "-DNVML_SUCCESS="))
    with pytest.raises(BuildError, match="error") as err:
        build_library(tmp_path, optimize=False)
    assert "fakenvml.c" in str(err.value)
    assert not (tmp_path / LIBRARY_NAME).exists()
