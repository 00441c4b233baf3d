"""What every generated family draws the same way: cards, models, token profiles, arrivals, the
capacity arithmetic that sets rates, and the shared pool of incidents.

A family (lab/generate/families.py) builds one scenario on a ``Builder``: it draws hardware and
a model, places workers, draws its traffic's tokens, asks the service model what a request
costs on each worker (``cost``, as lab/truth.py counts it: full batches, static-batching
inflation, clock ratio) and sets the rates from a target load, so the regime it is written for
happens. ``Redraw`` says the draw does not fit (placement, memory): the variant is drawn again
from the same random stream.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from gpubalance.lab import traffic
from gpubalance.lab.catalogue import CARDS, MIB
from gpubalance.lab.model.service import ServiceModel
from gpubalance.lab.routing import sticky_target
from gpubalance.lab.traffic import TrafficSource
from gpubalance.lab.truth import expected_max

GIB = 1024 * MIB
CARD_NAMES = tuple(CARDS)
PROBE_REQUESTS = 2000  # token draws per traffic source for the cost estimates
CAPACITY_AWARE = ("least_connections", "random_of_2", "pooled")
THROTTLE_REASONS = (
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)
INCIDENTS = ("throttle", "worker_crash", "preprocess", "disk", "router", "gpu_lost")


# the bundled traces' figures (rate, span), read once
_trace_statistics = functools.cache(traffic.trace_statistics)


class Redraw(Exception):
    """This draw cannot become a valid scenario of its family: draw the variant again."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A public model's size and KV cache per token at FP16 (layers x 2 x KV heads x head dim
    x 2 bytes, from its config.json)."""

    name: str
    params_billions: float
    kv_bytes_per_token: int


MODELS: tuple[ModelShape, ...] = (
    ModelShape("llama-3.2-1b", 1.24, 32768),
    ModelShape("qwen2.5-1.5b", 1.54, 28672),
    ModelShape("gemma-2-2b", 2.61, 106496),
    ModelShape("llama-3.2-3b", 3.21, 114688),
    ModelShape("llama-2-7b", 6.74, 524288),  # multi-head attention: 4x the KV of GQA models
    ModelShape("mistral-7b", 7.25, 131072),
    ModelShape("qwen2.5-7b", 7.62, 57344),
    ModelShape("llama-3.1-8b", 8.03, 131072),
    ModelShape("gemma-2-9b", 9.24, 344064),
    ModelShape("llama-2-13b", 13.0, 819200),
    ModelShape("phi-3-medium", 13.96, 204800),
)
BIG_KV = ("llama-2-7b", "gemma-2-9b", "llama-2-13b", "phi-3-medium")
QUANTS: dict[str, float] = {"fp16": 2.0, "int8": 1.0, "int4": 0.5}

# token profile -> (prompt median range, prompt p90/median range, prompt max,
#                   output median range, output p90/median range, output max)
PROFILES: dict[str, tuple[Any, ...]] = {
    "chat": ((128, 512), (2.0, 3.0), 4096, (24, 96), (1.8, 2.5), 512),
    "agent": ((384, 1200), (2.0, 2.5), 8192, (16, 64), (2.0, 3.0), 512),
    "code": ((800, 2000), (2.0, 3.0), 8192, (8, 32), (2.0, 3.0), 256),
    "extract": ((200, 800), (1.5, 2.5), 4096, (4, 24), (1.8, 2.5), 128),
    "rag": ((1000, 3000), (1.4, 2.0), 12288, (32, 128), (1.8, 2.5), 1024),
    "summarize": ((2000, 6000), (1.3, 1.8), 12288, (200, 600), (1.3, 1.6), 1024),
    "ingest": ((7000, 12000), (1.1, 1.3), 16384, (400, 800), (1.2, 1.5), 1536),
}
INTERACTIVE = ("chat", "agent", "code", "extract")


def sig(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits: readable YAML, the same bytes for a seed."""
    return float(f"{x:.{digits}g}")


@dataclass
class Worker:
    """One worker as the generator places it (one GPU each); emitted as `workers:` entries."""

    gpu: int
    model: str
    max_batch_size: int = 8
    max_queue_delay_ms: float = 0.0
    kv_cache_gib: float | None = None
    cpu_ms: float = 0.0
    cpu_ms_per_1k_prompt_tokens: float = 0.0
    threads: int = 1
    io_mb_per_request: float = 0.0
    pool: str = "default"
    name: str = field(default="", compare=False)


@dataclass
class Builder:
    """One variant in the making: the random stream, what was drawn, the scenario's parts."""

    rng: np.random.Generator
    family: str
    index: int
    mode_offset: int  # stratifies a family's modes over variant indices
    duration: float
    drawn: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    interval_seconds: float = 1.0
    cards: list[str] = field(default_factory=list)
    power_limits: dict[int, float] = field(default_factory=dict)
    cores: int = 16
    disk_mb_per_second: float = 2000.0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)
    router: dict[str, Any] = field(default_factory=lambda: {"policy": "round_robin"})
    traffic: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    rates: dict[str, float] = field(default_factory=dict)  # worker -> requests/s routed to it

    # -- drawing ----------------------------------------------------------------------------

    def note(self, key: str, value: object) -> None:
        """Record a drawn parameter for the file's header comment."""
        self.drawn[key] = str(value)

    def uniform(self, low: float, high: float, digits: int = 3) -> float:
        return sig(float(self.rng.uniform(low, high)), digits)

    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high], both included."""
        return int(self.rng.integers(low, high + 1))

    def choice(self, options: Sequence[Any], p: Sequence[float] | None = None) -> Any:
        return options[int(self.rng.choice(len(options), p=p))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def mode(self, options: Sequence[str]) -> str:
        """A family's mode, by variant index: any run of len(options) variants has each once."""
        chosen = options[(self.index + self.mode_offset) % len(options)]
        self.note("mode", chosen)
        return chosen

    # -- hardware and models ----------------------------------------------------------------

    def gpus(
        self, low: int, high: int, mix: str = "any", cards: Sequence[str] = CARD_NAMES
    ) -> list[str]:
        """1-8 cards: one kind ("same"), drawn per GPU ("mixed", at least two kinds), or
        either ("any")."""
        n = self.integer(low, high)
        if mix == "any":
            mix = "mixed" if n > 1 and self.chance(0.4) else "same"
        if mix == "same":
            self.cards = [self.choice(cards)] * n
        else:
            while True:
                self.cards = [self.choice(cards) for _ in range(n)]
                if len(set(self.cards)) > 1:
                    break
        self.note("gpus", _card_list(self.cards))
        return self.cards

    def host(self, cores: Sequence[int] = (8, 16, 24, 32, 48, 64)) -> None:
        self.cores = int(self.choice(cores))

    def model(
        self,
        min_kv_gib: float = 2.0,
        shapes: Sequence[str] | None = None,
        quants: Sequence[str] = tuple(QUANTS),
        on: Sequence[int] | None = None,
        copies: int = 1,
    ) -> str:
        """Draw a model and a quantization that fit every GPU in ``on`` (default: all) with
        ``copies`` workers each and at least ``min_kv_gib`` of KV region per worker."""
        gpus = range(len(self.cards)) if on is None else on
        candidates = [m for m in MODELS if shapes is None or m.name in shapes]
        for _ in range(40):
            shape = self.choice(candidates)
            quant = self.choice(quants)
            overhead = self.integer(2, 6) * 256
            spec = {
                "params_billions": shape.params_billions,
                "bytes_per_param": QUANTS[quant],
                "kv_bytes_per_token": shape.kv_bytes_per_token,
                "overhead_mib": overhead,
            }
            if all(self._left(self.cards[g], spec, copies) >= min_kv_gib * GIB for g in gpus):
                name = f"{shape.name}-{quant}"
                self.models[name] = spec
                self.note(f"model {name}", f"{shape.params_billions} B params, {quant}")
                return name
        raise Redraw("no model of the family fits its cards")

    @staticmethod
    def _left(card: str, spec: dict[str, Any], copies: int) -> float:
        weights = spec["params_billions"] * 1e9 * spec["bytes_per_param"]
        fixed = copies * (weights + spec["overhead_mib"] * MIB)
        return (CARDS[card].memory_total_bytes - fixed) / copies

    def kv_region_bytes(self, worker: Worker) -> float:
        """The worker's KV region as the planner sizes it (default: what its GPU leaves)."""
        if worker.kv_cache_gib is not None:
            return worker.kv_cache_gib * GIB
        mine = [w for w in self.workers if w.gpu == worker.gpu]
        fixed = sum(
            int(
                self.models[w.model]["params_billions"]
                * 1e9
                * self.models[w.model]["bytes_per_param"]
            )
            + self.models[w.model]["overhead_mib"] * MIB
            for w in mine
        )
        return (CARDS[self.cards[worker.gpu]].memory_total_bytes - fixed) // len(mine)

    def batching(self, kind: str = "latency") -> tuple[int, float]:
        """(max_batch_size, max_queue_delay_ms): a latency-tuned batcher, or a throughput-tuned
        one that waits long for full batches."""
        if kind == "latency":
            return self.choice((4, 8, 12, 16, 24, 32)), float(self.choice((0, 2, 5, 10, 20)))
        return self.choice((16, 24, 32, 48, 64)), self.uniform(300, 3000, 2)

    def place(self, model: str, batch: int, delay_ms: float, **kw: Any) -> None:
        """One worker of ``model`` on every GPU."""
        for g in range(len(self.cards)):
            self.workers.append(Worker(g, model, batch, delay_ms, **kw))
        self.name_workers()

    def name_workers(self) -> None:
        """The names the planner gives: w<gpu>, or w<gpu>-<k> with several on one GPU."""
        per_gpu: dict[int, int] = {}
        for w in self.workers:
            per_gpu[w.gpu] = per_gpu.get(w.gpu, 0) + 1
        seen: dict[int, int] = {}
        for w in self.workers:
            if per_gpu[w.gpu] == 1:
                w.name = f"w{w.gpu}"
            else:
                w.name = f"w{w.gpu}-{seen.get(w.gpu, 0)}"
                seen[w.gpu] = seen.get(w.gpu, 0) + 1

    def fit_batch(
        self, samples: TokenSample, workers: Sequence[Worker] | None = None, limit: float = 0.6
    ) -> None:
        """Lower each worker's (default: every worker's) max batch size until a full batch of
        the mean request needs at most ``limit`` of its KV region: families not about memory
        stay clear of memory pressure (lab/truth.py: 0.8)."""
        for w in self.workers if workers is None else workers:
            need = samples.mean_context * self.models[w.model]["kv_bytes_per_token"]
            region = self.kv_region_bytes(w)
            while w.max_batch_size > 1 and w.max_batch_size * need > limit * region:
                w.max_batch_size = max(1, w.max_batch_size // 2)
            if need > limit * region:
                raise Redraw("one request fills the KV region")

    # -- tokens, costs and routing ------------------------------------------------------------

    def tokens(self, profile: str, fixed: float = 0.1) -> tuple[dict[str, Any], dict[str, Any]]:
        """(prompt_tokens, output_tokens) of a profile: log-normal with drawn median and p90,
        or now and then fixed at the median."""
        p_med, p_spread, p_max, o_med, o_spread, o_max = PROFILES[profile]
        specs = []
        for (low, high), (s_low, s_high), top in (
            (p_med, p_spread, p_max),
            (o_med, o_spread, o_max),
        ):
            median = int(self.rng.uniform(low, high))
            if self.chance(fixed):
                specs.append({"kind": "fixed", "value": median})
            else:
                p90 = int(median * self.rng.uniform(s_low, s_high)) + 1
                specs.append({"kind": "lognormal", "median": median, "p90": p90, "max": top})
        return specs[0], specs[1]

    def sample(
        self,
        prompt: dict[str, Any],
        output: dict[str, Any],
        trace: dict[str, Any] | None = None,
    ) -> TokenSample:
        """Token counts these specs draw (``trace``: the arrivals whose rows trace tokens
        take), from the request stream itself with the scenario's seed."""
        probe: dict[str, Any] = {
            "name": "probe",
            "class": "interactive",
            "prompt_tokens": prompt,
            "output_tokens": output,
            "arrivals": {"kind": "poisson", "rate": 1.0},
        }
        duration = float(PROBE_REQUESTS)
        if "trace" in (prompt["kind"], output["kind"]):
            assert trace is not None
            probe["arrivals"] = {**trace, "time_scale": 1.0}
            duration = PROBE_REQUESTS / _trace_statistics(trace["trace"])["mean_rate_rps"]
        requests = traffic.generate([TrafficSource.model_validate(probe)], duration, self.seed)
        return TokenSample(
            np.array([r.prompt_tokens for r in requests], dtype=float),
            np.array([r.output_tokens for r in requests], dtype=float),
        )

    def cost(
        self, worker: Worker, samples: TokenSample, clock: float = 1.0, inflation: bool = True
    ) -> float:
        """GPU seconds per request of ``samples`` on ``worker`` at full batches, at clock ratio
        ``clock`` and with the static-batching inflation (a batch decodes until its longest
        request is done), as lab/truth.py counts it."""
        spec = self.models[worker.model]
        service = ServiceModel(
            CARDS[self.cards[worker.gpu]], spec["params_billions"], spec["bytes_per_param"]
        )
        batch = worker.max_batch_size
        a, d = service.request_cost_seconds(batch, samples.prompts, samples.outputs)
        outputs = np.maximum(samples.outputs, 1.0)
        stretch = expected_max(outputs, batch) / float(outputs.mean()) if inflation else 1.0
        return float(a.mean() / clock + d.mean() * stretch / math.sqrt(clock))

    def shares(
        self,
        workers: Sequence[Worker],
        costs: dict[str, float],
        weights: dict[str, float] | None = None,
        sessions: tuple[str, int, float] | None = None,
    ) -> dict[str, float]:
        """Share of a pool's requests each worker gets, as the ground truth splits them:
        capacity-aware policies by capacity (least connections by weight times capacity),
        weighted round robin by weight, sticky by the
        sessions' CRC32 targets (``sessions``: source name, count, Zipf skew), else evenly."""
        policy = self.router["policy"]
        names = [w.name for w in workers]
        if policy == "least_connections":
            # weight times capacity (the cap at a load of 1 that moves the rest is left out)
            raw = {n: (weights or {}).get(n, 1.0) / costs[n] for n in names}
        elif policy in CAPACITY_AWARE:
            raw = {n: 1.0 / costs[n] for n in names}
        elif policy == "weighted_round_robin":
            raw = {n: (weights or {}).get(n, 1.0) for n in names}
        elif policy == "sticky" and sessions is not None:
            source, count, skew = sessions
            p = np.arange(1, count + 1, dtype=float) ** -skew
            raw = dict.fromkeys(names, 0.0)
            for k, pk in enumerate((p / p.sum()).tolist()):
                raw[sticky_target(f"{source}/s{k}", names)] += pk
        else:
            raw = dict.fromkeys(names, 1.0)
        total = sum(raw.values())
        return {n: v / total for n, v in raw.items()}

    def gpu_rho(self, costs: dict[str, float]) -> dict[int, float]:
        """Each GPU's load from the routed rates: requests/s x seconds per request."""
        rho: dict[int, float] = dict.fromkeys(range(len(self.cards)), 0.0)
        for w in self.workers:
            rho[w.gpu] += self.rates.get(w.name, 0.0) * costs.get(w.name, 0.0)
        return rho

    # -- traffic --------------------------------------------------------------------------------

    def arrivals(self, kind: str, amplitude: tuple[float, float] = (0.1, 0.4)) -> dict[str, Any]:
        """The shape of arrivals of ``kind`` at a mean of 1 request/s; ``at_rate`` scales it."""
        if kind == "poisson":
            return {"kind": "poisson", "rate": 1.0}
        if kind == "onoff":  # bursts shorter than a truth window: its load holds
            return {
                "kind": "onoff",
                "rate": 1.0,
                "on_seconds": self.uniform(5, 20),
                "off_seconds": self.uniform(2, 10),
            }
        if kind == "bursts":  # long bursts and lulls: whole windows idle, others swamped
            return {
                "kind": "onoff",
                "rate": 1.0,
                "on_seconds": self.uniform(10, 60),
                "off_seconds": self.uniform(20, 120),
            }
        if kind == "diurnal":
            period = sig(self.duration * self.rng.uniform(0.5, 2))
            return {
                "kind": "diurnal",
                "mean_rate": 1.0,
                "amplitude": self.uniform(*amplitude, 2),
                "period_seconds": period,
                "phase_seconds": self.uniform(0, period),
            }
        if kind == "tenants":
            return {
                "kind": "tenants",
                "trace": "servegen_language",
                "clients": self.integer(5, 30),
                "total_rate": 1.0,
                "window_seconds": self.uniform(2, 30, 2),
            }
        if kind in traffic.REPLAY_TRACES:
            span = _trace_statistics(kind)["span_seconds"]
            return {
                "kind": "trace",
                "trace": kind,
                "time_scale": 1.0,
                "offset_seconds": float(self.integer(0, int(span * 0.8))),
            }
        raise AssertionError(kind)

    @staticmethod
    def at_rate(shape: dict[str, Any], rate: float) -> dict[str, Any]:
        """Arrivals of this shape averaging ``rate`` requests/s."""
        spec = dict(shape)
        kind = spec["kind"]
        if kind == "poisson":
            spec["rate"] = sig(rate)
        elif kind == "onoff":
            spec["rate"] = sig(
                rate * (spec["on_seconds"] + spec["off_seconds"]) / spec["on_seconds"]
            )
        elif kind == "diurnal":
            spec["mean_rate"] = sig(rate)
        elif kind == "tenants":
            spec["total_rate"] = sig(rate)
        else:
            mean = _trace_statistics(spec["trace"])["mean_rate_rps"]
            spec["time_scale"] = sig(rate / mean)
        return spec

    def source(
        self,
        name: str,
        service_class: str,
        arrivals: dict[str, Any],
        prompt: dict[str, Any],
        output: dict[str, Any],
        **extra: Any,
    ) -> None:
        self.traffic.append(
            {
                "name": name,
                "class": service_class,
                **({"tenant": extra.pop("tenant")} if "tenant" in extra else {}),
                "arrivals": arrivals,
                "prompt_tokens": prompt,
                "output_tokens": output,
                **extra,
            }
        )
        self.note(f"traffic {name}", _describe_arrivals(arrivals))

    def route(self, rate: float, shares: dict[str, float]) -> None:
        """Add ``rate`` requests/s split by ``shares`` to the workers' routed rates."""
        for n, s in shares.items():
            self.rates[n] = self.rates.get(n, 0.0) + rate * s

    # -- host and disk ----------------------------------------------------------------------

    def cpu_capacity(self, worker: Worker) -> float:
        """Cores the worker's preprocessing can use (lab/truth.py's CPU cap, per second)."""
        threads_total = sum(w.threads for w in self.workers)
        return min(worker.threads, self.cores * worker.threads / max(threads_total, self.cores))

    def cpu_need(self, worker: Worker, mean_prompt: float) -> float:
        """Cores its preprocessing needs at its routed rate."""
        per_request = worker.cpu_ms + worker.cpu_ms_per_1k_prompt_tokens * mean_prompt / 1000
        return self.rates.get(worker.name, 0.0) * per_request / 1000

    def light_host(self, mean_prompt: float, io: bool = True) -> None:
        """Tokenising and, for some servers, a small read per request (adapters, images) that
        never limit the server: at most half of each worker's threads and of the disk. A
        preprocess or disk incident can then make them bind."""
        self.host()
        cpu_ms, per_1k = self.uniform(0.2, 3, 2), self.uniform(0, 5, 2)
        io_mb = self.uniform(0.1, 4, 2) if io and self.chance(0.4) else 0.0
        threads = self.integer(2, 8)
        for w in self.workers:
            w.cpu_ms, w.cpu_ms_per_1k_prompt_tokens = cpu_ms, per_1k
            w.threads = threads
            w.io_mb_per_request = io_mb
        self.cores = max(self.cores, sum(w.threads for w in self.workers))
        for w in self.workers:
            self.spare_cpu(w, mean_prompt)
        disk_need = self.disk_need()
        self.disk_mb_per_second = float(max(self.choice((1000, 2000, 3500, 7000)), 3 * disk_need))
        self.disk_mb_per_second = sig(self.disk_mb_per_second)
        self.note("host", f"{self.cores} cores, disk {self.disk_mb_per_second:g} MB/s")
        self.note("preprocess", f"{cpu_ms} ms + {per_1k} ms/1k prompt tokens; io {io_mb} MB")

    def spare_cpu(self, worker: Worker, mean_prompt: float) -> None:
        """Scale the worker's preprocessing down to at most half of what it can use."""
        need = self.cpu_need(worker, mean_prompt)
        room = 0.5 * self.cpu_capacity(worker)
        if need > room:
            worker.cpu_ms = sig(worker.cpu_ms * room / need, 2)
            worker.cpu_ms_per_1k_prompt_tokens = sig(
                worker.cpu_ms_per_1k_prompt_tokens * room / need, 2
            )

    def disk_need(self) -> float:
        """MB/s the workers read at their routed rates."""
        return sum(self.rates.get(w.name, 0.0) * w.io_mb_per_request for w in self.workers)

    # -- events ---------------------------------------------------------------------------------

    def at(self, low: float = 0.1, high: float = 0.85) -> float:
        """A time between ``low`` and ``high`` of the run, in whole seconds."""
        return float(int(self.duration * self.rng.uniform(low, high)))

    def event(self, at: float, action: str, body: dict[str, Any], what: str) -> None:
        if at < self.duration:
            self.events.append({"at": at, action: body})
            self.note(f"event {len(self.events)}", f"at {at:g} s, {what}")

    def throttle(self, gpu: int, clock: float, reason: str, at: float, until: float | None) -> None:
        self.event(
            at,
            "throttle",
            {"gpu": gpu, "clock_ratio": clock, "reason": reason},
            f"GPU {gpu} throttles to {clock} ({reason})",
        )
        if until is not None:
            self.event(until, "throttle", {"gpu": gpu, "clock_ratio": 1.0}, f"GPU {gpu} recovers")

    def crash(self, worker: str, at: float, restart: float | None) -> None:
        body: dict[str, Any] = {"worker": worker}
        if restart is not None:
            body["restart_after_seconds"] = restart
        after = f", restarts after {restart:g} s" if restart is not None else ", stays down"
        self.event(at, "worker_crash", body, f"{worker} crashes{after}")

    def incidents(self, mean_prompt: float, low: int = 0, high: int = 2) -> None:
        """0-2 incidents from the shared pool at random times, sized against the server: a
        throttle (random clock ratio and reason, sometimes lifted), a crash with or without a
        restart, preprocessing that outgrows its threads, a disk that slows below what the
        workers read, a weight change (a drain where weights are not the policy), a lost GPU."""
        count = self.integer(low, high)
        kinds = [k for k in INCIDENTS if self._applies(k)]
        for kind in (kinds[int(i)] for i in self.rng.permutation(len(kinds))[:count]):
            at = self.at()
            if kind == "throttle":
                gpu = self.integer(0, len(self.cards) - 1)
                until = at + self.integer(60, 300) if self.chance(0.4) else None
                self.throttle(
                    gpu, self.uniform(0.35, 0.85, 2), self.choice(THROTTLE_REASONS), at, until
                )
            elif kind == "worker_crash":
                worker = self.choice(self.workers).name
                self.crash(worker, at, float(self.integer(30, 240)) if self.chance(0.6) else None)
            elif kind == "preprocess":
                w = self.choice([w for w in self.workers if self.rates.get(w.name, 0) > 0])
                factor = self.rng.uniform(2, 6)
                cpu_ms = sig(factor * 1000 * self.cpu_capacity(w) / self.rates[w.name])
                self.event(
                    at,
                    "preprocess",
                    {"worker": w.name, "cpu_ms": cpu_ms},
                    f"{w.name}'s preprocessing grows to {cpu_ms:g} ms per request",
                )
            elif kind == "disk":
                mb_s = sig(self.disk_need() / self.rng.uniform(1.5, 5))
                self.event(
                    at,
                    "disk",
                    {"disk_mb_per_second": mb_s},
                    f"the disk slows to {mb_s:g} MB/s",
                )
            elif kind == "router":
                self._weights_incident(at)
            else:
                gpu = self.integer(0, len(self.cards) - 1)
                self.event(at, "gpu_lost", {"gpu": gpu}, f"GPU {gpu} falls off the bus")

    def _applies(self, kind: str) -> bool:
        if kind == "disk":
            return self.disk_need() > 0
        if kind == "gpu_lost":
            return len(self.cards) > 1
        if kind == "preprocess":
            return any(self.rates.get(w.name, 0) > 0 for w in self.workers)
        if kind == "router":
            return len(self.workers) > 1
        return True

    def _weights_incident(self, at: float) -> None:
        w = self.choice(self.workers).name
        if self.router["policy"] == "weighted_round_robin":
            weight = self.uniform(0.2, 10, 2)
            self.event(at, "router", {"weights": {w: weight}}, f"{w}'s weight becomes {weight}")
            return
        # weights only take a worker in or out of rotation under the other policies: a drain
        self.event(at, "router", {"weights": {w: 0.0}}, f"{w} is drained (weight 0)")
        if self.chance(0.5):
            back = at + self.integer(60, 240)
            self.event(back, "router", {"weights": {w: 1.0}}, f"{w} is back in rotation")

    # -- the document ---------------------------------------------------------------------------

    def document(self, name: str, description: str) -> dict[str, Any]:
        gpus: list[dict[str, Any]] = []
        for g, card in enumerate(self.cards):
            entry: dict[str, Any] = {"card": card}
            if g in self.power_limits:
                entry["power_limit_watts"] = self.power_limits[g]
            if gpus and {k: v for k, v in gpus[-1].items() if k != "count"} == entry:
                gpus[-1]["count"] = gpus[-1].get("count", 1) + 1
            else:
                gpus.append(entry)
        doc: dict[str, Any] = {
            "name": name,
            "description": description,
            "duration_seconds": self.duration,
            "seed": self.seed,
            "interval_seconds": self.interval_seconds,
            "truth_window_seconds": 30.0,
            "hardware": {
                "host": {"cores": self.cores, "disk_mb_per_second": self.disk_mb_per_second},
                "gpus": gpus,
            },
            "models": self.models,
            "workers": _worker_entries(self.workers, len(self.cards)),
            "router": self.router,
            "traffic": self.traffic,
        }
        if self.events:
            doc["events"] = sorted(self.events, key=lambda e: e["at"])
        return doc


@dataclass(frozen=True)
class TokenSample:
    prompts: np.ndarray
    outputs: np.ndarray

    @property
    def mean_context(self) -> float:
        return float((self.prompts + self.outputs).mean())

    @property
    def mean_prompt(self) -> float:
        return float(self.prompts.mean())


def mix(parts: Sequence[tuple[TokenSample, float]]) -> TokenSample:
    """The token sample of a pool whose requests come from ``parts`` (sample, share of the
    requests)."""
    total = sum(share for _, share in parts)
    prompts, outputs = [], []
    for sample, share in parts:
        k = max(1, round(PROBE_REQUESTS * share / total))
        prompts.append(sample.prompts[:k])
        outputs.append(sample.outputs[:k])
    return TokenSample(np.concatenate(prompts), np.concatenate(outputs))


def _card_list(cards: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for c in cards:
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{n}x {c}" if n > 1 else c for c, n in counts.items())


def _describe_arrivals(spec: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in spec.items())


_WORKER_DEFAULTS = Worker(gpu=0, model="")


def _worker_entries(workers: Sequence[Worker], gpu_count: int) -> list[dict[str, Any]]:
    """`workers:` entries: consecutive workers alike but for their GPU share one entry (a list
    of GPUs, or `all`); keys at their schema default are left out."""
    entries: list[tuple[dict[str, Any], list[int]]] = []
    for w in workers:
        body: dict[str, Any] = {"model": w.model}
        for f in fields(Worker):
            if f.name in ("gpu", "model", "name"):
                continue
            value = getattr(w, f.name)
            if value == getattr(_WORKER_DEFAULTS, f.name) and f.name != "max_batch_size":
                continue
            body[f.name] = value
        preprocess = {
            k: body.pop(k)
            for k in ("cpu_ms", "cpu_ms_per_1k_prompt_tokens", "threads")
            if k in body
        }
        if preprocess:
            body["preprocess"] = preprocess
        if entries and entries[-1][0] == body and w.gpu not in entries[-1][1]:
            entries[-1][1].append(w.gpu)
        else:
            entries.append((body, [w.gpu]))
    out = []
    for body, gpus in entries:
        if len(entries) == 1 and gpus == list(range(gpu_count)):
            gpu: Any = "all"
        else:
            gpu = gpus[0] if len(gpus) == 1 else gpus
        out.append({"gpu": gpu, **body})
    return out
