"""Hostile and broken /metrics text: every outcome is readings or a ParseError with a reason,
never another exception, in bounded memory; plus a short run of bench/fuzz.py's fuzzer."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from gpubalance.exporter.collectors.serving.base import ParseError, ServingReading
from gpubalance.exporter.collectors.serving.formats import read

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = Path(__file__).parent / "fixtures"
ALL = ("triton", "vllm", "tgi", "sglang")
WAITING = 'vllm:num_requests_waiting{engine="0",model_name="m"}'
GAUGE = f"# TYPE vllm:num_requests_waiting gauge\n{WAITING} "
RUNNING = 'vllm:num_requests_running{engine="0",model_name="m"}'


def outcome(format: str, text: str) -> str | list[ServingReading]:
    """The readings, or the ParseError's reason; any other exception fails the test."""
    try:
        return read(format, text)
    except ParseError as exc:
        return exc.reason


def garbage(size: int) -> str:
    return random.Random(size).randbytes(size).decode("utf-8", "replace")


# (id, text, formats to read it as, the outcome: a ParseError reason or "clean")
NASTY = [
    ("empty", "", ALL, "clean"),
    ("type-without-kind", "# TYPE vllm:num_requests_waiting\n", ALL, "malformed"),
    ("cut-in-labels", f"{GAUGE}1\n{WAITING[:30]}", ALL, "malformed"),
    ("cut-before-value", GAUGE, ALL, "malformed"),
    ("two-dots", GAUGE + "1.2.3\n", ALL, "malformed"),
    ("hex", GAUGE + "0x1F\n", ALL, "malformed"),
    ("underscores", GAUGE + "1_000\n", ALL, "malformed"),
    ("double-minus", GAUGE + "--1\n", ALL, "malformed"),
    ("timestamp-past-float", GAUGE + "1 " + "9" * 400 + "\n", ALL, "malformed"),
    ("nul-in-name", "vllm:num_requests\x00_waiting 1\n", ALL, "malformed"),
    ("unclosed-quote", GAUGE.replace('"m"', '"m'), ALL, "malformed"),
    ("binary", garbage(100_000), ALL, "malformed"),
    ("inf", GAUGE + "+Inf\n", ALL, "clean"),
    ("nan", GAUGE + "NaN\n", ALL, "clean"),
    ("negative", GAUGE + "-7\n", ALL, "clean"),
    ("int-past-float", GAUGE + "9" * 400 + "\n", ALL, "clean"),
    ("digits-past-int-limit", GAUGE + "1" + "0" * 5000 + "\n", ALL, "clean"),  # float: inf
    ("denormal", GAUGE + "1e-400\n", ALL, "clean"),
    ("help-twice", "# HELP x a\n# HELP x b\n# TYPE x gauge\nx 1\n", ALL, "clean"),
    ("type-twice", f"# TYPE vllm:num_requests_waiting counter\n{GAUGE}1\n", ALL, "clean"),
    ("family-twice", f"{GAUGE}1\n# TYPE x gauge\nx 1\n{GAUGE}2\n", ALL, "clean"),
    ("exemplar", GAUGE + '1 # {trace_id="abc"} 1\n', ALL, "clean"),
    ("label-7MB", GAUGE.replace('"m"', '"' + "m" * 7_000_000 + '"') + "1\n", ("vllm",), "clean"),
    ("text-9MB", GAUGE + "1\n" + "#\n" * 4_500_000, ("vllm",), "too_large"),
    ("lines-1e6", "a 1\n" * 1_000_000, ("vllm",), "too_many_series"),
    ("blank-lines-1e6", "\n" * 1_000_000, ("vllm",), "clean"),
    ("families-6000", "".join(f"# TYPE m{i} gauge\nm{i} 1\n" for i in range(6000)), ALL,
     "too_many_series"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "formats", "expected"),
    [pytest.param(text, formats, expected, id=name) for name, text, formats, expected in NASTY],
)
def test_nasty_text_reads_or_fails_with_a_reason(
    text: str, formats: tuple[str, ...], expected: str
) -> None:
    for format in formats:
        result = outcome(format, text)
        assert (result if isinstance(result, str) else "clean") == expected, format


@pytest.mark.parametrize("value", ["+Inf", "-Inf", "NaN", "-7", "9" * 400, "1" + "0" * 5000])
def test_a_value_that_makes_no_sense_is_unknown(value: str) -> None:
    text = f"{GAUGE}{value}\n# TYPE vllm:num_requests_running gauge\n{RUNNING} 1\n"
    assert read("vllm", text) == [ServingReading(key="engine=0,model_name=m", rank=0, running=1.0)]


def test_labels_with_escapes_and_any_unicode_make_a_key() -> None:
    name = 'llama \\"8b\\" \\\\ é 🚀 \ud800\\n'
    text = GAUGE.replace('"m"', f'"{name}"') + "3\n"
    assert read("vllm", text) == [
        ServingReading(key='engine=0,model_name=llama "8b" \\ é 🚀 \ud800\n', rank=0, queue_depth=3)
    ]


def test_a_series_with_kilobytes_of_labels_is_skipped() -> None:
    """Its key would be a label of that size on our /metrics."""
    for size, expected in ((1000, 1), (1025, 0), (7_000_000, 0)):
        text = GAUGE.replace('"m"', '"' + "m" * size + '"') + "1\n"
        assert len(read("vllm", text)) == expected, size


@pytest.mark.parametrize("format", ALL)
def test_windows_line_endings_read_alike(format: str) -> None:
    text = (FIXTURES / f"{format}.txt").read_text()
    assert read(format, text.replace("\n", "\r\n")) == read(format, text)


def _fuzz_module() -> ModuleType:
    """bench/fuzz.py, which is a script, not a package module."""
    spec = importlib.util.spec_from_file_location("bench_fuzz", ROOT / "bench" / "fuzz.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fuzzed_fixtures_never_crash_and_stay_small() -> None:
    result = _fuzz_module().fuzz_exposition(600, seed=20240601, trace_every=3)
    assert result["crashes"] == 0, "\n".join(result["crash_examples"])
    # the mutations reach the adapters (clean reads) as well as the parser's errors
    assert result["clean"] > 50 and sum(result["parse_errors"].values()) > 50
    assert result["traced"] == 200
    assert result["tracemalloc_peak_bytes"] < 100 * 1024 * 1024


def _many_sglang(n: int) -> str:
    scheduler = "".join(
        f'sglang:num_queue_reqs{{model_name="m",tp_rank="{i}"}} 1\n' for i in range(n)
    )
    tokenizer = "".join(
        f'sglang:e2e_request_latency_seconds_sum{{model_name="m{i}"}} 1\n'
        f'sglang:e2e_request_latency_seconds_count{{model_name="m{i}"}} 1\n'
        for i in range(n)
    )
    return (
        f"# TYPE sglang:num_queue_reqs gauge\n{scheduler}"
        f"# TYPE sglang:e2e_request_latency_seconds histogram\n{tokenizer}"
    )


def _many_triton(n: int) -> str:
    counters = "".join(
        f'nv_inference_exec_count{{gpu_uuid="GPU-{i}",model="m{i}",version="1"}} 1\n'
        for i in range(n)
    )
    pending = "".join(
        f'nv_inference_pending_request_count{{model="m{i}",version="1"}} 1\n' for i in range(n)
    )
    return (
        f"# TYPE nv_inference_exec_count counter\n{counters}"
        f"# TYPE nv_inference_pending_request_count gauge\n{pending}"
    )


@pytest.mark.parametrize(("format", "build"), [("sglang", _many_sglang), ("triton", _many_triton)])
def test_many_series_cost_time_in_proportion(format: str, build: Callable[[int], str]) -> None:
    """Tying series to one another (tokenizer to scheduler, pending count to GPU) is a lookup:
    20 000 of each are all read, where 20 000 squared comparisons would run past the test's
    timeout (no wall-time assert: the machine's load is not the code's)."""
    assert len(read(format, build(20_000))) == 20_000
