"""The systemd units in deploy/systemd: systemd accepts them, and each ExecStart is a command
line our own argument parser takes, with the configuration examples beside the units."""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy.kube import parse_args

from gpubalance.controller.supervisor import SystemdSettings
from gpubalance.exporter.cli import load_config

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
INSTALLED = "/opt/gpubalance/bin/gpubalance"  # where deploy/systemd/README.md installs it
UNIT_NAMES = ["gpubalance-exporter", "gpubalance-analyzer", "gpubalance-controller"]
# systemd's specifiers used in the units, as a system manager expands them
SPECIFIERS = {"%S": "/var/lib", "%%": "%"}


def _service(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(UNITS / f"{name}.service")
    return parser["Service"]


def _installed(path: str) -> Path:
    """An /etc/gpubalance file of a unit: its example beside the units."""
    assert path.startswith("/etc/gpubalance/"), path
    example = UNITS / Path(path).name
    assert example.is_file(), f"{path} has no example {example.relative_to(ROOT)}"
    return example


def _environment(service: configparser.SectionProxy) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in service.get("EnvironmentFile", "").splitlines():
        for raw in _installed(line.strip().removeprefix("-")).read_text().splitlines():
            if raw.strip() and not raw.lstrip().startswith("#"):
                key, _, value = raw.partition("=")
                env[key.strip()] = value.strip()
    return env


def _argv(name: str) -> list[str]:
    """ExecStart as systemd expands it: ${VAR} one word, $VAR split on spaces."""
    service = _service(name)
    env = _environment(service)
    words: list[str] = []
    for word in shlex.split(service["ExecStart"]):
        for spec, value in SPECIFIERS.items():
            word = word.replace(spec, value)
        whole = re.fullmatch(r"\$\{(\w+)\}", word)
        split = re.fullmatch(r"\$(\w+)", word)
        if whole:
            words.append(env[whole.group(1)])
        elif split:
            words.extend(env[split.group(1)].split())
        else:
            assert "$" not in word, f"{name}: ${word} mixes a variable into a word"
            words.append(word)
    assert words[0] == INSTALLED, f"{name}: ExecStart runs {words[0]}"
    return words[1:]


def _verifiable(name: str, tmp_path: Path) -> Path:
    """The unit with ExecStart's program at this checkout's gpubalance (systemd-analyze checks
    that the program exists); the only change, the flags are checked by the parser below."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    program = str(Path(sys.executable).with_name("gpubalance"))
    unit = tmp_path / f"{name}.service"
    unit.write_text((UNITS / f"{name}.service").read_text().replace(INSTALLED, program))
    return unit


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_passes_systemd_analyze_verify(name: str, tmp_path: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(_verifiable(name, tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # an unknown key or a value systemd cannot parse is only a warning, exit status 0
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_exposure_is_low(name: str, tmp_path: Path) -> None:
    """systemd's own rating of the sandbox: 0 is locked down, 10 is none; under 2 is "OK"."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(_verifiable(name, tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= 2.0, result.stdout


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_is_hardened(name: str) -> None:
    service = _service(name)
    assert service["User"] == "gpubalance"
    expected = {
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "CapabilityBoundingSet": "",
    }
    assert {key: service.get(key) for key in expected} == expected
    assert "gpubalance" in (UNITS / "gpubalance.sysusers.conf").read_text().split()


def test_exporter_unit_reaches_nvml_devices_only() -> None:
    service = _service("gpubalance-exporter")
    assert service["DevicePolicy"] == "closed"
    # DeviceAllow= repeats; configparser keeps the last line of a repeated key
    lines = (UNITS / "gpubalance-exporter.service").read_text().splitlines()
    allowed = {line.split("=", 1)[1] for line in lines if line.startswith("DeviceAllow=")}
    assert allowed == {"char-nvidia-frontend rw", "/dev/nvidiactl rw"}
    assert "PrivateDevices" not in service  # it would hide /dev/nvidia*


def test_controller_unit_joins_the_haproxy_socket_group() -> None:
    service = _service("gpubalance-controller")
    assert service["SupplementaryGroups"] == "haproxy"
    args = parse_args(_argv("gpubalance-controller"))
    assert args.haproxy_socket == "/run/haproxy/admin.sock"
    assert str(args.audit_log).startswith("/var/lib/gpubalance/")  # its StateDirectory
    assert not args.act, "the example starts dry-run"


def test_exporter_exec_start_parses_and_its_config_loads() -> None:
    args = parse_args(_argv("gpubalance-exporter"))
    assert args.command == "exporter"
    args.config = str(_installed(args.config))
    config = load_config(args)
    assert config.listen == ":9450"
    assert config.procfs == "/proc"


def test_analyzer_exec_start_parses() -> None:
    args = parse_args(_argv("gpubalance-analyzer"))
    assert (args.command, args.source, args.listen) == (
        "analyzer",
        "http://127.0.0.1:9450",
        "127.0.0.1:9451",
    )
    assert args.interval == 10


def test_a_renamed_flag_is_refused() -> None:
    """What the tests above rely on: the parser refuses a flag it does not know."""
    argv = _argv("gpubalance-exporter")
    with pytest.raises(AssertionError, match="refuses"):
        parse_args([word.replace("--config", "--config-file") for word in argv])


WORKER = "gpubalance-worker@"


def test_worker_template_with_its_drop_in_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    shutil.copy(UNITS / f"{WORKER}.service", tmp_path)
    drop_in = UNITS / f"{WORKER}.service.d" / "serve.conf"
    (tmp_path / f"{WORKER}.service.d").mkdir()
    # the example's serving command, at a program that exists (systemd-analyze checks it)
    text = drop_in.read_text().replace("/opt/serve/bin/serve", str(shutil.which("true")))
    (tmp_path / f"{WORKER}.service.d" / "serve.conf").write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / f"{WORKER}0.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_worker_template_pins_its_gpu_and_reads_what_the_controller_writes() -> None:
    service = _service(WORKER)
    assert set(service["Environment"].split()) == {
        "CUDA_VISIBLE_DEVICES=%i",
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
    }
    # the controller's defaults name this unit and its environment file
    settings = SystemdSettings()
    assert settings.unit == WORKER
    assert service["EnvironmentFile"] == f"{settings.environment_dir}/%i.env"
    assert service["Restart"] == "no", "a worker that cannot load is the controller's to undo"
    drop_in = configparser.ConfigParser(strict=False, interpolation=None)
    drop_in.read(UNITS / f"{WORKER}.service.d" / "serve.conf")
    command = drop_in["Service"]["ExecStart"].strip()  # the last one: the empty one clears
    assert "${GPUBALANCE_POOL}" in command and "${GPUBALANCE_PORT}" in command
