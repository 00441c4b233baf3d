"""Fuzz the serving parsers: mutated inputs must end in a clean result or a ParseError, never in
another exception, and in bounded memory.

Exposition half: the adapters' test fixtures (tests/exporter/serving/fixtures/, one per serving
format) are mutated (bit flips, deletions, duplications, junk, absurd values, stray labels,
retyped families, swapped lines, truncation) and read with
``gpubalance.exporter.collectors.serving.formats.read``, a tenth of them through another
format's adapter. Deterministic for a given seed, apart from time and memory figures.

    python bench/fuzz.py [--exposition 100000] [--otlp 100000] [--seed 0] [--trace-every 10]

Each part writes its own section of bench/RESULTS.md; a part given 0 inputs is skipped and
keeps its section.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

from gpubalance.exporter.collectors.serving.base import ParseError
from gpubalance.exporter.collectors.serving.formats import FORMATS, read

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_otlp import fuzz_otlp
from results import write_section

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ROOT / "tests" / "exporter" / "serving" / "fixtures"
MIB = 1024 * 1024

# What mutations insert: the exposition format's own punctuation, control and non-ASCII
# characters, values a parser may choke on, and labels the adapters give meaning to.
JUNK = ("{", "}", '"', "\\", ",", "=", " ", "\t", "\n", "#", "\x00", "\x7f", "é", "\u2028")
VALUES = (
    "NaN",
    "+Inf",
    "-Inf",
    "-1",
    "-0",
    "1e309",
    "1e-320",
    "0x10",
    "1_000",
    "",
    "1.5.2",
    "\u0663",
    "9" * 400,
    "1" + "0" * 5000,
    "18446744073709551616",
    "1 -9999999999999999999999",
)
LABELS = (
    'le="+Inf"',
    'reason="BACKEND"',
    'gpu_uuid=""',
    'gpu_uuid="GPU-fuzz"',
    'engine="-1"',
    'engine="\u0663"',
    'tp_rank="99999999999"',
    'tp_rank="0"',
    'model_name="m"',
    'model="m",version="1"',
    '__name__="vllm:num_requests_waiting"',
    'bad-name="1"',
    '"quoted.name"="1"',
    'a="\\"',
    'a="\\n\\\\"',
    'x="' + "a" * 100_000 + '"',
)
TYPES = ("counter", "gauge", "histogram", "summary", "untyped", "info", "stateset", "bogus")


def mutate(text: str, rng: random.Random) -> str:
    """``text`` after one to four random mutations."""
    for _ in range(rng.randint(1, 4)):
        text = rng.choice(_MUTATIONS)(text, rng)
    return text


def _span(text: str, rng: random.Random, longest: int = 200) -> tuple[int, int]:
    start = rng.randrange(len(text) + 1)
    return start, min(len(text), start + rng.randint(1, longest))


def _flip_bit(text: str, rng: random.Random) -> str:
    data = bytearray(text.encode())
    if data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return data.decode("utf-8", "replace")  # as the scraper decodes a body


def _delete(text: str, rng: random.Random) -> str:
    start, end = _span(text, rng)
    return text[:start] + text[end:]


def _duplicate(text: str, rng: random.Random) -> str:
    start, end = _span(text, rng, 2000)
    return text[:end] + text[start:end] * rng.randint(1, 8) + text[end:]


def _insert_junk(text: str, rng: random.Random) -> str:
    at = rng.randrange(len(text) + 1)
    return text[:at] + "".join(rng.choices(JUNK, k=rng.randint(1, 5))) + text[at:]


def _replace_value(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    head, _, _ = lines[i].rpartition(" ")
    lines[i] = f"{head} {rng.choice(VALUES)}" if head else rng.choice(VALUES)
    return "\n".join(lines)


def _insert_label(text: str, rng: random.Random) -> str:
    label = rng.choice(LABELS)
    at = text.find("{", rng.randrange(len(text) + 1))
    if at < 0:
        return text + f"vllm:num_requests_waiting{{{label}}} 1\n"
    return text[: at + 1] + label + rng.choice((",", "", ",,")) + text[at + 1 :]


def _retype(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    typed = [i for i, line in enumerate(lines) if line.startswith("# TYPE ")]
    if typed:
        i = rng.choice(typed)
        lines[i] = lines[i].rsplit(" ", 1)[0] + " " + rng.choice(TYPES)
    return "\n".join(lines)


def _swap_lines(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


def _truncate(text: str, rng: random.Random) -> str:
    return text[: rng.randrange(len(text) + 1)]


_MUTATIONS = (
    _flip_bit,
    _delete,
    _duplicate,
    _insert_junk,
    _replace_value,
    _insert_label,
    _retype,
    _swap_lines,
    _truncate,
)


def seeds() -> dict[str, str]:
    """The fixture of each serving format, by format."""
    return {name: (SEEDS / f"{name}.txt").read_text() for name in sorted(FORMATS)}


def fuzz_exposition(n: int, seed: int = 0, trace_every: int = 10) -> dict[str, Any]:
    """Read ``n`` mutated fixtures; counts, memory and speed.

    Every ``trace_every``-th input is read under tracemalloc (which slows reading about 3.5
    times): its peak is the Python memory one read allocated. The process's max RSS covers all
    inputs, and would show a leak from one input to the next.

    The result (``fuzz_otlp`` returns the same shape): ``inputs``, ``clean`` (read without
    error), ``parse_errors`` (ParseError reason -> count), ``crashes`` (any other exception)
    with the first few in ``crash_examples``, ``tracemalloc_peak_bytes``, ``traced`` (inputs
    read under tracemalloc), ``max_rss_bytes`` (of the process so far), ``seconds``.
    """
    rng = random.Random(seed)
    texts = seeds()
    names = list(texts)
    clean, crashes, peak, traced = 0, 0, 0, 0
    reasons: Counter[str] = Counter()
    examples: list[str] = []
    started = time.perf_counter()
    for i in range(n):
        source = names[i % len(names)]
        # a tenth go to another server's adapter, which must ignore what it does not know
        adapter = rng.choice(names) if rng.random() < 0.1 else source
        text = mutate(texts[source], rng)
        if i % trace_every == 0:
            tracemalloc.start()
        try:
            read(adapter, text)
            clean += 1
        except ParseError as exc:
            reasons[exc.reason] += 1
        except Exception as exc:  # the finding: anything but ParseError escaped
            crashes += 1
            if len(examples) < 5:
                examples.append(f"{adapter} <- {source}: {exc!r} on {text[:300]!r}")
        finally:
            if tracemalloc.is_tracing():
                peak = max(peak, tracemalloc.get_traced_memory()[1])
                traced += 1
                tracemalloc.stop()
    return {
        "inputs": n,
        "clean": clean,
        "parse_errors": dict(sorted(reasons.items())),
        "crashes": crashes,
        "crash_examples": examples,
        "tracemalloc_peak_bytes": peak,
        "traced": traced,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": time.perf_counter() - started,
    }


def report(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one row per fuzzed part, and any crash examples under it."""
    lines = [
        "| part | inputs | clean | ParseError (by reason) | crashes "
        "| tracemalloc peak (inputs traced) | max RSS | inputs/s |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for part, r in results.items():
        errors = sum(r["parse_errors"].values())
        by_reason = ", ".join(f"{reason} {count}" for reason, count in r["parse_errors"].items())
        lines.append(
            f"| {part} | {r['inputs']} | {r['clean']} | {errors} ({by_reason}) | {r['crashes']} "
            f"| {r['tracemalloc_peak_bytes'] / MIB:.1f} MiB ({r['traced']}) "
            f"| {r['max_rss_bytes'] / MIB:.0f} MiB "
            f"| {r['inputs'] / r['seconds']:.0f} |"
        )
    for part, r in results.items():
        lines.extend(f"\n{part} crash: {example}" for example in r["crash_examples"])
    return "\n".join(lines)


# What each part goes through; its section of RESULTS.md says when and how it last ran.
PARTS = {
    "exposition": ("/metrics texts", "the exposition adapters"),
    "otlp": ("OTLP requests", "the OTLP receiver"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--exposition", type=int, default=100_000, help="mutated /metrics texts to read (0: skip)"
    )
    parser.add_argument("--otlp", type=int, default=100_000, help="mutated OTLP requests (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace-every", type=int, default=10, help="read every k-th input under tracemalloc"
    )
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    if args.exposition:
        results["exposition"] = fuzz_exposition(args.exposition, args.seed, args.trace_every)
    if args.otlp:
        results["otlp"] = fuzz_otlp(args.otlp, args.seed)
    command = f"python bench/fuzz.py --exposition {args.exposition} --otlp {args.otlp}"
    for part, result in results.items():  # a skipped part keeps its section as it was
        inputs, through = PARTS[part]
        # max RSS is of the process so far: the OTLP part's covers the exposition part's
        after = part == "otlp" and "exposition" in results
        shared = " (max RSS after the exposition part)" if after else ""
        write_section(
            f"fuzz-{part}",
            f"Serving inputs: fuzzed {inputs}",
            f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, seed {args.seed}, "
            f"`{command}`{shared}. Mutated real inputs (byte flips, cuts, duplications, "
            f"floods, hostile structures) through {through}: no input may raise anything but "
            "a counted rejection, and memory stays bounded.\n\n" + report({part: result}),
        )
    text = report(results)
    print(text)
    return 1 if any(r["crashes"] for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
