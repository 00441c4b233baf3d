"""A bad configuration is rejected before anything starts, naming file, line, key and type."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpubalance.config import ConfigError, load_section
from gpubalance.exporter.config import ExporterConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpubalance.yaml"
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    config = load_section(ExporterConfig, None, "exporter")
    assert config.listen_address == ("0.0.0.0", 9450)
    assert config.interval == 1.0
    assert config.names == "native"
    assert config.history_length == 302


def test_file_values_and_flag_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path, "exporter:\n  interval: 2\n  names: dcgm\n  collectors:\n    host: false\n"
    )
    config = load_section(
        ExporterConfig,
        path,
        "exporter",
        {"names": "both", "interval": None, "collectors": {"processes": False}},
    )
    assert config.interval == 2.0
    assert config.names == "both"
    assert config.collectors == {"host": False, "processes": False}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "exporter:\n  interval: fast\n",
            "gpubalance.yaml:2: exporter.interval: expected a number, got 'fast'",
        ),
        (
            "exporter:\n  listen: ':9450'\n  history: 3\n",
            "gpubalance.yaml:3: exporter.history: unknown key",
        ),
        (
            "exporter:\n  names: prometheus\n",
            "gpubalance.yaml:2: exporter.names: Input should be 'native', 'dcgm' or 'both'",
        ),
        (
            "exporter:\n  collectors:\n    host: 'yes'\n",
            "gpubalance.yaml:3: exporter.collectors.host: expected true or false, got 'yes'",
        ),
        (
            "exporter:\n  listen: 9450\n",
            "gpubalance.yaml:2: exporter.listen: expected a string, got 9450",
        ),
        ("exporter:\n  listen: 'localhost'\n", "expected HOST:PORT"),
        (
            "exporter:\n  interval: 5\n  window: 2\n",
            "window (2.0 s) must be at least interval (5.0 s)",
        ),
        ("exporters:\n  interval: 1\n", "gpubalance.yaml:1: exporters: unknown section"),
        ("exporter: [1, 2\n", "gpubalance.yaml:2: not valid YAML: expected ',' or ']'"),
        ("exporter: 3\n", "gpubalance.yaml:1: exporter: expected a mapping"),
    ],
)
def test_bad_config_is_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_section(ExporterConfig, write(tmp_path, text), "exporter")
    assert message in str(error.value)


def test_bad_flag_is_named_as_a_flag() -> None:
    with pytest.raises(
        ConfigError, match=r"command line: --interval: Input should be greater than 0"
    ):
        load_section(ExporterConfig, None, "exporter", {"interval": -1.0})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        load_section(ExporterConfig, "nope.yaml", "exporter")


def test_cli_exits_2_with_one_message(tmp_path: Path) -> None:
    path = write(tmp_path, "exporter:\n  interval: fast\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpubalance", "exporter", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gpubalance exporter: {path}:2: exporter.interval: expected a number, got 'fast'"
    )


def test_cli_rejects_unknown_collector_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, "exporter:\n  collectors:\n    gpus: true\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpubalance", "exporter", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "unknown collector(s) ['gpus']" in result.stderr


def test_a_validator_message_says_what_was_given_once() -> None:
    with pytest.raises(ConfigError) as error:
        load_section(ExporterConfig, None, "exporter", {"listen": "foo"})
    assert str(error.value) == "command line: --listen: expected HOST:PORT, got 'foo'"


def _config_from_command_line(*argv: str) -> ExporterConfig:
    from gpubalance.cli import build_parser
    from gpubalance.exporter.cli import load_config

    return load_config(build_parser().parse_args(["exporter", *argv]))


def test_serving_flags_add_to_the_files_endpoints(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "exporter:\n  serving:\n    timeout: 0.25\n    endpoints:\n"
        "      - {url: 'http://127.0.0.1:8000/metrics', format: vllm, gpu: 1, class: batch}\n"
        "      - {url: 'http://127.0.0.1:8001/metrics', format: tgi}\n",
    )
    config = _config_from_command_line(
        "--config",
        str(path),
        "--serving",
        "triton=http://127.0.0.1:8002/metrics",
        "--serving",
        "sglang=http://127.0.0.1:8001/metrics",
    )
    assert config.serving.timeout == 0.25
    by_url = {e.url: e for e in config.serving.endpoints}
    assert {url: e.format for url, e in by_url.items()} == {
        "http://127.0.0.1:8000/metrics": "vllm",
        "http://127.0.0.1:8001/metrics": "sglang",  # given both ways: the flag's format
        "http://127.0.0.1:8002/metrics": "triton",
    }
    kept = by_url["http://127.0.0.1:8000/metrics"]
    assert (kept.gpu, kept.service_class) == (1, "batch")


def test_a_bad_serving_flag_is_named_as_a_flag(tmp_path: Path) -> None:
    path = write(tmp_path, "exporter:\n  serving:\n    endpoints: []\n")
    with pytest.raises(ConfigError, match=r"command line: --serving: .*http:// or https://"):
        _config_from_command_line("--config", str(path), "--serving", "vllm=ftp://x/metrics")


def test_a_closed_pipe_ends_quietly() -> None:
    # `gpubalance exporter --print-schema | head -1`: no traceback, the shell's SIGPIPE status.
    # The reader is gone before the first write, so the write fails whatever the pipe's size.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "gpubalance", "exporter", "--print-schema"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


def test_the_memory_trend_rule_is_configured(tmp_path: Path) -> None:
    from gpubalance.exporter.window import TrendRule

    path = write(tmp_path, "exporter:\n  trend_min_points: 20\n  trend_min_span: 0.8\n")
    config = load_section(ExporterConfig, path, "exporter")
    assert config.trend_rule == TrendRule(min_points=20, min_span_ratio=0.8)
    assert load_section(ExporterConfig, None, "exporter").trend_rule == TrendRule()
    with pytest.raises(ConfigError, match=r"exporter\.trend_min_span: Input should be less than"):
        load_section(
            ExporterConfig, write(tmp_path, "exporter:\n  trend_min_span: 2\n"), "exporter"
        )


def test_the_work_pool_runs_all_its_threads_from_the_start() -> None:
    """The exporter's thread count is fixed once it serves: a soak reads growth as a leak."""
    import threading

    from gpubalance.exporter.cli import started_executor

    before = threading.active_count()
    executor = started_executor(3)
    try:
        assert threading.active_count() - before == 3
        # work that queues up runs on those threads and starts no others
        list(executor.map(lambda _: threading.active_count(), range(50)))
        assert threading.active_count() - before == 3
    finally:
        executor.shutdown()
