"""Scenarios: the YAML files that describe a simulated RTX server, its traffic and its trouble.

Schema and examples: lab/scenarios/README.md. A scenario is checked before anything runs: an
unknown key, a wrong type or an impossible placement (a model larger than its card) fails with
the file, the line and the key. What a valid scenario will still do wrong in a run (an event
after its end, a KV region smaller than one request, a pool swamped) are `Plan.warnings()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpubalance.config import ConfigError, Loc, load_yaml, validate
from gpubalance.lab import traffic
from gpubalance.lab.catalogue import CARDS, MIB, Card
from gpubalance.lab.model.service import ServiceModel
from gpubalance.lab.traffic import TrafficSource
from gpubalance.lab.workload import Request

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
GIB = 1024 * MIB
# a pool offered more than this many times what its workers can serve is a run of queues
OVERLOAD_WARNING_RATIO = 3.0
# the service class a split serves from GPUs of its own (`X-Class: batch`)
BATCH_CLASS = "batch"

Policy = Literal[
    "round_robin", "weighted_round_robin", "least_connections", "random_of_2", "sticky", "pooled"
]
ThrottleReason = Literal[
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class HostSpec(_Strict):
    cores: int = Field(16, ge=1, le=512, description="logical CPUs shared by all workers")
    disk_mb_per_second: float = Field(2000.0, gt=0, description="storage read bandwidth")


class GpuSpec(_Strict):
    card: str = Field(description="a card of lab/catalogue.py, e.g. 'RTX 4090'")
    count: int = Field(1, ge=1, le=64)
    power_limit_watts: float | None = Field(None, gt=0, description="default: the card's TGP")


class HardwareSpec(_Strict):
    host: HostSpec = HostSpec()
    gpus: list[GpuSpec] = Field(min_length=1)


class ModelSpec(_Strict):
    params_billions: float = Field(gt=0, le=200)
    bytes_per_param: float = Field(2.0, gt=0, description="2 for FP16/BF16, 1 for INT8")
    kv_bytes_per_token: int = Field(131072, ge=0, description="KV cache per token of context")
    overhead_mib: int = Field(1024, ge=0, description="CUDA context, activations, workspace")

    @property
    def weights_bytes(self) -> int:
        return int(self.params_billions * 1e9 * self.bytes_per_param)


class PreprocessSpec(_Strict):
    cpu_ms: float = Field(0.0, ge=0, description="host CPU per request (tokenise, decode)")
    cpu_ms_per_1k_prompt_tokens: float = Field(0.0, ge=0)
    threads: int = Field(1, ge=1, le=256, description="threads the worker preprocesses with")


class WorkerSpec(_Strict):
    name: str | None = Field(None, description="default w<gpu>, or w<gpu>-<k> with several")
    gpu: int | list[int] | Literal["all"] = Field(description="GPU index, list, or all")
    model: str
    max_batch_size: int = Field(8, ge=1, le=1024)
    max_queue_delay_ms: float = Field(0.0, ge=0)
    kv_cache_gib: float | None = Field(None, gt=0, description="default: what the card leaves")
    preprocess: PreprocessSpec = PreprocessSpec()
    io_mb_per_request: float = Field(0.0, ge=0, description="data loaded from disk per request")
    pool: str = "default"


class RouterSpec(_Strict):
    policy: Policy = "round_robin"
    weights: dict[str, float] = Field(default_factory=dict, description="worker -> weight")
    pools: dict[str, str] = Field(
        default_factory=dict, description="service class -> pool name; default: pool 'default'"
    )
    queue_timeout_seconds: float = Field(30.0, gt=0, description="pooled: longest wait in queue")
    max_queue: int | None = Field(
        None,
        ge=1,
        description="pooled: requests that may wait in a pool's queue; one more is answered 429 "
        "at once (admission control); default: unbounded",
    )

    @model_validator(mode="after")
    def _bounded_queue(self) -> RouterSpec:
        if self.max_queue is not None and self.policy != "pooled":
            raise ValueError(
                f"max_queue bounds the pooled policy's central queue; policy {self.policy} has none"
            )
        return self


class ThrottleEvent(_Strict):
    gpu: int
    clock_ratio: float = Field(gt=0, le=1)
    reason: ThrottleReason = "sw_thermal_slowdown"


class PreprocessEvent(_Strict):
    worker: str
    cpu_ms: float | None = Field(None, ge=0)
    cpu_ms_per_1k_prompt_tokens: float | None = Field(None, ge=0)


class GpuLostEvent(_Strict):
    gpu: int


class WorkerCrashEvent(_Strict):
    worker: str
    restart_after_seconds: float | None = Field(None, gt=0, description="default: stays down")


class DiskEvent(_Strict):
    disk_mb_per_second: float = Field(gt=0)


class WeightsEvent(_Strict):
    weights: dict[str, float]


class Event(_Strict):
    at: float = Field(ge=0, description="seconds since the start")
    throttle: ThrottleEvent | None = None
    preprocess: PreprocessEvent | None = None
    gpu_lost: GpuLostEvent | None = None
    worker_crash: WorkerCrashEvent | None = None
    disk: DiskEvent | None = None
    router: WeightsEvent | None = None

    @model_validator(mode="after")
    def _one_action(self) -> Event:
        actions = [k for k in ACTIONS if getattr(self, k) is not None]
        if len(actions) != 1:
            raise ValueError(f"an event has exactly one of {', '.join(ACTIONS)}; got {actions}")
        return self

    @property
    def action(self) -> str:
        return next(k for k in ACTIONS if getattr(self, k) is not None)


ACTIONS = ("throttle", "preprocess", "gpu_lost", "worker_crash", "disk", "router")


class Scenario(_Strict):
    name: str
    description: str
    duration_seconds: float = Field(600.0, gt=0)
    seed: int = Field(1, ge=0, description="seed of the request stream and the routers")
    interval_seconds: float = Field(1.0, gt=0, le=60, description="telemetry sample period")
    truth_window_seconds: float = Field(30.0, gt=0, description="ground-truth window")
    hardware: HardwareSpec
    models: dict[str, ModelSpec] = Field(min_length=1)
    workers: list[WorkerSpec] = Field(min_length=1)
    router: RouterSpec = RouterSpec()
    traffic: list[TrafficSource] = Field(min_length=1)
    events: list[Event] = Field(default_factory=list)


# -- the resolved plan both speeds run --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedGpu:
    index: int
    card: Card
    uuid: str
    pci_bus_id: str
    power_limit_watts: float


@dataclass(frozen=True, slots=True)
class PlannedWorker:
    name: str
    index: int
    gpu: int
    model: ModelSpec
    model_name: str
    max_batch_size: int
    max_queue_delay_seconds: float
    kv_cache_bytes: int
    preprocess: PreprocessSpec
    io_mb_per_request: float
    pool: str


@dataclass(frozen=True)
class Plan:
    scenario: Scenario
    source: str  # file the scenario came from
    gpus: tuple[PlannedGpu, ...]
    workers: tuple[PlannedWorker, ...]
    lines: dict[Loc, int] = field(default_factory=dict, compare=False, repr=False)

    def pool_of(self, service_class: str) -> str:
        return self.scenario.router.pools.get(service_class, "default")

    def workers_in(self, pool: str) -> tuple[PlannedWorker, ...]:
        return tuple(w for w in self.workers if w.pool == pool)

    @property
    def splittable(self) -> str | None:
        """The pool that serves the batch class beside another one, under a policy that picks
        a server per request: it has a batch backend (`be_<pool>_batch`, its servers in maint)
        that the batch class goes to while one of them is ready, which a controller's split
        readies. None where no pool does."""
        if self.scenario.router.policy == "pooled":
            return None  # maxconn counts per backend line: a worker's slots would count twice
        classes = {t.service_class for t in self.scenario.traffic}
        if BATCH_CLASS not in classes:
            return None
        pool = self.pool_of(BATCH_CLASS)
        shared = any(self.pool_of(c) == pool for c in classes - {BATCH_CLASS})
        return pool if shared else None

    def warnings(self, duration_seconds: float | None = None, seed: int | None = None) -> list[str]:
        """What this valid scenario will still do wrong in a run of this duration and seed (the
        scenario's by default), one line each, located like the errors. Reads the request
        stream the run will send."""
        scenario = self.scenario
        duration = scenario.duration_seconds if duration_seconds is None else duration_seconds
        found = [
            self._at(
                ("events", i, "at"),
                f"at {event.at:g} s, not earlier than the run's end ({duration:g} s): the "
                f"{event.action} event falls after the run's arrivals, frames and truth",
            )
            for i, event in enumerate(scenario.events)
            if event.at >= duration
        ]
        requests = traffic.generate(
            scenario.traffic, duration, scenario.seed if seed is None else seed
        )
        for pool in sorted({w.pool for w in self.workers}):
            mine = [r for r in requests if self.pool_of(r.service_class) == pool]
            if mine:
                found += self._pool_warnings(pool, mine, duration)
        return found

    def _pool_warnings(
        self, pool: str, requests: Sequence[Request], duration_seconds: float
    ) -> list[str]:
        """KV regions smaller than the pool's mean request; a pool offered far more than its
        GPUs serve."""
        found = []
        prompt = np.array([r.prompt_tokens for r in requests], dtype=float)
        output = np.array([r.output_tokens for r in requests], dtype=float)
        workers = self.workers_in(pool)
        spec_of = _spec_index(self.scenario)
        for w in workers:
            need = float((prompt + output).mean()) * w.model.kv_bytes_per_token
            if need > w.kv_cache_bytes:
                entry = spec_of[w.index]
                key = "kv_cache_gib" if self.scenario.workers[entry].kv_cache_gib else "model"
                found.append(
                    self._at(
                        ("workers", entry, key),
                        f"worker {w.name}'s KV region ({w.kv_cache_bytes / MIB:.0f} MiB) is "
                        f"smaller than the mean request of pool {pool!r} ({need / MIB:.0f} MiB "
                        f"of KV cache): most of its requests will fail with oom",
                    )
                )
        # requests per second at full batches and full clocks; a GPU counts once per pool
        capacity = 0.0
        for gpu in sorted({w.gpu for w in workers}):
            w = next(w for w in workers if w.gpu == gpu)
            model = ServiceModel(
                self.gpus[gpu].card, w.model.params_billions, w.model.bytes_per_param
            )
            a, d = model.request_cost_seconds(w.max_batch_size, prompt, output)
            capacity += 1.0 / float((a + d).mean())
        offered = len(requests) / duration_seconds
        if offered > OVERLOAD_WARNING_RATIO * capacity:
            found.append(
                self._at(
                    ("traffic",),
                    f"pool {pool!r} is offered {offered:.1f} requests/s, "
                    f"{offered / capacity:.1f}x the {capacity:.1f} its workers serve at full "
                    "batches: its queues will grow all run long",
                )
            )
        return found

    def _at(self, loc: Loc, message: str) -> str:
        return _located(self.source, self.lines, loc, message)


def _located(source: str, lines: dict[Loc, int], loc: Loc, message: str) -> str:
    line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
    where = f"{source}:{line}" if line else source
    return f"{where}: {'.'.join(str(p) for p in loc)}: {message}"


def _fail(source: str, lines: dict[Loc, int], loc: Loc, message: str) -> ConfigError:
    return ConfigError(_located(source, lines, loc, message))


def plan(
    scenario: Scenario, source: str = "(scenario)", lines: dict[Loc, int] | None = None
) -> Plan:
    """Resolve GPUs and workers and check what the schema alone cannot (references, fit)."""
    lines = lines or {}
    gpus: list[PlannedGpu] = []
    for i, spec in enumerate(scenario.hardware.gpus):
        if spec.card not in CARDS:
            raise _fail(
                source,
                lines,
                ("hardware", "gpus", i, "card"),
                f"unknown card {spec.card!r}; known: {', '.join(CARDS)}",
            )
        card = CARDS[spec.card]
        for _ in range(spec.count):
            index = len(gpus)
            gpus.append(
                PlannedGpu(
                    index=index,
                    card=card,
                    uuid=f"GPU-{index:08x}-{card.pci_device_id:04x}-4c2d-9e3f-{index:012d}",
                    pci_bus_id=f"00000000:{index + 1:02X}:00.0",
                    power_limit_watts=spec.power_limit_watts or card.power_limit_watts,
                )
            )
    workers: list[PlannedWorker] = []
    for i, spec in enumerate(scenario.workers):
        loc = ("workers", i)
        if spec.model not in scenario.models:
            raise _fail(
                source,
                lines,
                (*loc, "model"),
                f"unknown model {spec.model!r}; defined: {', '.join(scenario.models)}",
            )
        targets = (
            list(range(len(gpus)))
            if spec.gpu == "all"
            else ([spec.gpu] if isinstance(spec.gpu, int) else list(spec.gpu))
        )
        for gpu in targets:
            if not 0 <= gpu < len(gpus):
                raise _fail(
                    source,
                    lines,
                    (*loc, "gpu"),
                    f"GPU {gpu} does not exist (the scenario has {len(gpus)})",
                )
        if spec.name is not None and len(targets) > 1:
            raise _fail(source, lines, (*loc, "name"), "a name needs a single gpu")
        for gpu in targets:
            workers.append(
                PlannedWorker(
                    name=spec.name or f"w{gpu}",
                    index=len(workers),
                    gpu=gpu,
                    model=scenario.models[spec.model],
                    model_name=spec.model,
                    max_batch_size=spec.max_batch_size,
                    max_queue_delay_seconds=spec.max_queue_delay_ms / 1000.0,
                    kv_cache_bytes=0,  # filled below, once all workers of the GPU are known
                    preprocess=spec.preprocess,
                    io_mb_per_request=spec.io_mb_per_request,
                    pool=spec.pool,
                )
            )
    workers = _name_and_size(workers, gpus, scenario, source, lines)
    _check_references(scenario, workers, len(gpus), source, lines)
    return Plan(
        scenario=scenario, source=source, gpus=tuple(gpus), workers=tuple(workers), lines=lines
    )


def _name_and_size(
    workers: list[PlannedWorker],
    gpus: list[PlannedGpu],
    scenario: Scenario,
    source: str,
    lines: dict[Loc, int],
) -> list[PlannedWorker]:
    spec_of = _spec_index(scenario)
    named: dict[str, int] = {}
    for w in workers:
        explicit = scenario.workers[spec_of[w.index]].name
        if explicit is not None and explicit in named:
            raise _fail(
                source,
                lines,
                ("workers", spec_of[w.index], "name"),
                f"worker name {explicit!r} is already taken by workers entry {named[explicit]}",
            )
        if explicit is not None:
            named[explicit] = spec_of[w.index]
    # several unnamed workers on one GPU become w<gpu>-0, w<gpu>-1, ...
    counts: dict[str, int] = {}
    for w in workers:
        counts[w.name] = counts.get(w.name, 0) + 1
    seen: dict[str, int] = {}
    renamed = []
    for w in workers:
        if counts[w.name] > 1:
            seen[w.name] = seen.get(w.name, 0) + 1
            w = replace(w, name=f"{w.name}-{seen[w.name] - 1}")
        renamed.append(w)
    if len({w.name for w in renamed}) != len(renamed):
        raise _fail(source, lines, ("workers",), "worker names must be unique")
    sized = []
    for gpu in gpus:
        mine = [w for w in renamed if w.gpu == gpu.index]
        fixed = sum(w.model.weights_bytes + w.model.overhead_mib * MIB for w in mine)
        if fixed > gpu.card.memory_total_bytes:
            first = spec_of[mine[0].index]
            raise _fail(
                source,
                lines,
                ("workers", first, "model"),
                f"impossible placement: {len(mine)} worker(s) need {fixed / GIB:.1f} GiB for "
                f"weights on GPU {gpu.index} ({gpu.card.model}, "
                f"{gpu.card.memory_total_bytes / GIB:.1f} GiB)",
            )
        left = gpu.card.memory_total_bytes - fixed
        default_kv = left // max(len(mine), 1)
        wanted = [
            int(scenario.workers[spec_of[w.index]].kv_cache_gib * GIB)
            if scenario.workers[spec_of[w.index]].kv_cache_gib
            else default_kv
            for w in mine
        ]
        if sum(wanted) > left:
            raise _fail(
                source,
                lines,
                ("workers", spec_of[mine[0].index], "kv_cache_gib"),
                f"impossible placement: KV caches of {sum(wanted) / GIB:.1f} GiB do not "
                f"fit the {left / GIB:.1f} GiB left on GPU {gpu.index}",
            )
        sized += [replace(w, kv_cache_bytes=kv) for w, kv in zip(mine, wanted, strict=True)]
    return sorted(sized, key=lambda w: w.index)


def _spec_index(scenario: Scenario) -> dict[int, int]:
    """Planned worker index -> index of the `workers:` entry it came from."""
    mapping, n = {}, 0
    gpu_count = sum(g.count for g in scenario.hardware.gpus)
    for i, spec in enumerate(scenario.workers):
        if spec.gpu == "all":
            count = gpu_count
        else:
            count = 1 if isinstance(spec.gpu, int) else len(spec.gpu)
        for _ in range(count):
            mapping[n] = i
            n += 1
    return mapping


def _check_references(
    scenario: Scenario,
    workers: list[PlannedWorker],
    gpu_count: int,
    source: str,
    lines: dict[Loc, int],
) -> None:
    names = {w.name for w in workers}
    pools = {w.pool for w in workers}
    router = scenario.router
    for name in router.weights:
        if name not in names:
            raise _fail(source, lines, ("router", "weights", name), f"no worker named {name!r}")
    for service_class, pool in router.pools.items():
        if pool not in pools:
            raise _fail(
                source,
                lines,
                ("router", "pools", service_class),
                f"no worker in pool {pool!r}; pools: {', '.join(sorted(pools))}",
            )
    classes = {t.service_class for t in scenario.traffic}
    for service_class in classes:
        if router.pools.get(service_class, "default") not in pools:
            raise _fail(
                source,
                lines,
                ("router", "pools"),
                f"traffic of class {service_class!r} has no pool: map it in router.pools "
                f"or put workers in pool 'default'",
            )
    if len({t.name for t in scenario.traffic}) != len(scenario.traffic):
        raise _fail(source, lines, ("traffic",), "traffic source names must be unique")
    for i, event in enumerate(scenario.events):
        body = getattr(event, event.action)
        loc = ("events", i, event.action)
        if hasattr(body, "gpu") and not 0 <= body.gpu < gpu_count:
            raise _fail(source, lines, (*loc, "gpu"), f"GPU {body.gpu} does not exist")
        if hasattr(body, "worker") and body.worker not in names:
            raise _fail(source, lines, (*loc, "worker"), f"no worker named {body.worker!r}")
        if event.action == "router":
            for name in body.weights:
                if name not in names:
                    raise _fail(source, lines, (*loc, "weights", name), f"no worker named {name!r}")
        if event.at >= scenario.duration_seconds:
            raise _fail(
                source,
                lines,
                ("events", i, "at"),
                f"at {event.at:g} s must be earlier than the end "
                f"({scenario.duration_seconds:g} s, duration_seconds)",
            )


# -- finding and loading -----------------------------------------------------------------------


def scenario_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    shipped = SCENARIOS / f"{name_or_path}.yaml"
    if not shipped.exists():
        known = ", ".join(p.stem for p in sorted(SCENARIOS.glob("*.yaml")))
        raise ConfigError(f"no scenario named {name_or_path!r}; shipped: {known}")
    return shipped


def load(name_or_path: str) -> Plan:
    """Load, validate and resolve a shipped scenario (by name) or a YAML file."""
    path = scenario_path(name_or_path)
    data, lines = load_yaml(path)
    scenario = validate(Scenario, data, source=str(path), lines=lines)
    return plan(scenario, str(path), lines)


def shipped() -> list[tuple[str, str]]:
    """(name, description) of every scenario in lab/scenarios/."""
    result = []
    for path in sorted(SCENARIOS.glob("*.yaml")):
        data: Any
        data, _ = load_yaml(path)
        result.append((path.stem, str((data or {}).get("description", ""))))
    return result
