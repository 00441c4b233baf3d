"""Service time of a batch on an RTX card, shaped by measurements and scaled by the card.

The shape comes from splitwise-sim's measured performance table (``lab/data/
splitwise_llama2-70b_a100_tp2.csv``, MIT, see lab/data/ATTRIBUTION.md): Llama-2-70B on two
A100-80GB with tensor parallelism 2, prefill time over prompt length (batch 1) and over batch size
(prompt 512), and decode time per token over batch size and context. LLM prefill is bound by
tensor throughput and decode by memory bandwidth, so the measured times are scaled by

- the served model's size against the reference's per-GPU share (70B over TP 2 = 35B), and
- the card's dense FP16 tensor TFLOPS (prefill) or memory bandwidth (decode) against the A100's
  (312 TFLOPS, 2039 GB/s: NVIDIA A100 datasheet, 80GB SXM).

A throttled card runs its SM clock at ``clock_ratio`` of its boost clock: prefill slows in
proportion; decode, bound by memory, only by its square root (memory clocks hold up better).
"""

from __future__ import annotations

import bisect
import csv
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from gpubalance.lab.catalogue import Card

DATA = Path(__file__).resolve().parents[1] / "data" / "splitwise_llama2-70b_a100_tp2.csv"
REFERENCE_PARAMS_PER_GPU = 35e9
A100_FP16_TFLOPS = 312.0
A100_BANDWIDTH_GBPS = 2039.0
REFERENCE_PROMPT = 512


class _Curve:
    """Piecewise-linear interpolation in log-log space, extended linearly beyond the ends."""

    def __init__(self, points: Sequence[tuple[float, float]]) -> None:
        points = sorted(points)
        self.xs = [math.log(x) for x, _ in points]
        self.ys = [math.log(y) for _, y in points]

    def many(self, x: np.ndarray) -> np.ndarray:
        """The curve at every value of ``x`` (numpy), as :meth:`__call__` does one by one."""
        xs, ys = self.xs, self.ys
        lx = np.log(np.maximum(x, 1e-9))
        inside = np.interp(lx, xs, ys)
        low = ys[0] + (ys[1] - ys[0]) / (xs[1] - xs[0]) * (lx - xs[0])
        high = ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (lx - xs[-1])
        return np.exp(np.where(lx < xs[0], low, np.where(lx > xs[-1], high, inside)))

    def __call__(self, x: float) -> float:
        lx = math.log(max(x, 1e-9))
        xs, ys = self.xs, self.ys
        if lx <= xs[0]:
            return math.exp(ys[0] + (ys[1] - ys[0]) / (xs[1] - xs[0]) * (lx - xs[0]))
        if lx >= xs[-1]:
            return math.exp(ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (lx - xs[-1]))
        i = bisect.bisect_right(xs, lx)
        t = (lx - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + t * (ys[i] - ys[i - 1]))


@dataclass(frozen=True)
class ReferenceShape:
    prefill_by_prompt: _Curve  # ms, batch 1
    prefill_by_batch: _Curve  # ms, prompt 512
    token_by_batch: _Curve  # ms per decode step, context 512
    token_by_context: _Curve  # ms per decode step, batch 1


@lru_cache(maxsize=1)
def reference_shape(path: Path = DATA) -> ReferenceShape:
    groups: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            key = (int(row["prompt_size"]), int(row["batch_size"]))
            groups[key].append((float(row["prompt_time"]), float(row["token_time"])))
    median = {
        k: (statistics.median(p for p, _ in v), statistics.median(t for _, t in v))
        for k, v in groups.items()
    }
    by_prompt = [(p, m) for (p, b), m in median.items() if b == 1]
    by_batch = _rising(sorted((b, m) for (p, b), m in median.items() if p == REFERENCE_PROMPT))
    return ReferenceShape(
        prefill_by_prompt=_Curve([(p, m[0]) for p, m in by_prompt]),
        prefill_by_batch=_Curve([(b, m[0]) for b, m in by_batch]),
        token_by_batch=_Curve([(b, m[1]) for b, m in by_batch]),
        token_by_context=_Curve([(p, m[1]) for p, m in by_prompt]),
    )


def _rising(
    points: Sequence[tuple[int, tuple[float, float]]],
) -> list[tuple[int, tuple[float, float]]]:
    """The batch points, less any whose prefill or decode time falls below a smaller batch's.

    A larger batch never takes less time. The table's batch-64 row does (prefill 794 ms against
    6633 ms at batch 32, decode 67 ms against 72 ms); kept, it made prefill shrink beyond batch 32
    and, extrapolated, head to zero for larger batches. Without it the curves continue the
    slope of batches 16 to 32.
    """
    kept: list[tuple[int, tuple[float, float]]] = []
    for batch, (prefill, token) in points:
        if kept and (prefill < kept[-1][1][0] or token < kept[-1][1][1]):
            continue
        kept.append((batch, (prefill, token)))
    return kept


@dataclass(frozen=True)
class ServiceModel:
    """Seconds a batch keeps one card busy, and when each of its requests is done."""

    card: Card
    params_billions: float
    # Decode streams the weights once per step: INT8 weights (1 byte) halve that traffic
    # against the FP16 reference. Prefill stays at FP16 tensor speed (weights dequantised).
    bytes_per_param: float = 2.0

    @property
    def _prefill_scale(self) -> float:
        return (self.params_billions * 1e9 / REFERENCE_PARAMS_PER_GPU) * (
            A100_FP16_TFLOPS / self.card.fp16_tensor_tflops
        )

    @property
    def _decode_scale(self) -> float:
        return (
            (self.params_billions * 1e9 / REFERENCE_PARAMS_PER_GPU)
            * (self.bytes_per_param / 2.0)
            * (A100_BANDWIDTH_GBPS / self.card.memory_bandwidth_gbps)
        )

    def prefill_seconds(self, batch: int, mean_prompt_tokens: float) -> float:
        ref = reference_shape()
        at_batch = ref.prefill_by_batch(batch) / ref.prefill_by_batch(1)
        return (
            ref.prefill_by_prompt(max(mean_prompt_tokens, 1.0))
            * at_batch
            * (self._prefill_scale / 1000.0)
        )

    def token_seconds(self, batch: int, context_tokens: float) -> float:
        ref = reference_shape()
        at_context = ref.token_by_context(max(context_tokens, 1.0)) / ref.token_by_context(
            REFERENCE_PROMPT
        )
        return ref.token_by_batch(batch) * at_context * (self._decode_scale / 1000.0)

    def batch_timeline(
        self,
        prompt_tokens: Sequence[int],
        output_tokens: Sequence[int],
        clock_ratio: float = 1.0,
    ) -> tuple[float, list[float]]:
        """(busy seconds of the batch, finish offset of each request in it).

        Static batching: one prefill for the batch, then decode steps with the requests still
        generating; a request is done after its last token, the card after the longest one.
        """
        n = len(prompt_tokens)
        mean_prompt = sum(prompt_tokens) / n
        prefill = self.prefill_seconds(n, mean_prompt) / clock_ratio
        decode_slowdown = 1.0 / math.sqrt(clock_ratio)
        order = sorted(range(n), key=lambda i: output_tokens[i])
        finish = [0.0] * n
        elapsed, done_steps = prefill, 0
        for rank, i in enumerate(order):
            steps = max(output_tokens[i], 1) - done_steps
            if steps > 0:
                active = n - rank
                context = mean_prompt + done_steps + steps / 2
                elapsed += steps * self.token_seconds(active, context) * decode_slowdown
                done_steps += steps
            finish[i] = elapsed
        return elapsed, finish

    def request_cost_seconds(
        self, batch: int, prompt_tokens: np.ndarray, output_tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per request (numpy), its share of a full batch of ``batch``: prefill and decode
        seconds, unthrottled. A throttled card takes prefill / r + decode / sqrt(r)."""
        ref = reference_shape()
        prompt = np.maximum(prompt_tokens.astype(float), 1.0)
        output = np.maximum(output_tokens.astype(float), 1.0)
        at_batch = ref.prefill_by_batch(batch) / ref.prefill_by_batch(1)
        prefill = ref.prefill_by_prompt.many(prompt) * at_batch * self._prefill_scale / 1000.0
        step = ref.token_by_batch(batch) * self._decode_scale / 1000.0
        at_context = ref.token_by_context.many(prompt + output / 2) / ref.token_by_context(
            REFERENCE_PROMPT
        )
        return prefill / batch, output * step * at_context / batch

    def requests_per_second(
        self, batch: int, prompt_tokens: float, output_tokens: float, clock_ratio: float = 1.0
    ) -> float:
        """Throughput of back-to-back batches of identical requests: the card's capacity."""
        busy, _ = self.batch_timeline(
            [round(prompt_tokens)] * batch, [round(output_tokens)] * batch, clock_ratio
        )
        return batch / busy
