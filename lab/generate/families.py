"""The generated families: scenario templates, each a base setup and a mechanism.

A family is not a cause. Each one draws a server (cards, model, batcher, policy, host), traffic
whose rates are set from the service model against that server's capacity, its own events, and
0-2 incidents from the shared pool (lab/generate/draw.py), so every cause turns up in several
families and a model must learn it from the mechanism, not from the family. The causes each
family produces are listed in lab/scenarios/README.md, "Generated families".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpubalance.lab.catalogue import CARDS
from gpubalance.lab.generate.draw import (
    BIG_KV,
    CAPACITY_AWARE,
    GIB,
    INTERACTIVE,
    Builder,
    Redraw,
    TokenSample,
    Worker,
    mix,
    sig,
)
from gpubalance.lab.model.service import ServiceModel

POLICIES = (
    "round_robin",
    "weighted_round_robin",
    "least_connections",
    "random_of_2",
    "sticky",
    "pooled",
)
NOT_AWARE = ("round_robin", "weighted_round_robin", "sticky")
STEADY = ("poisson", "diurnal", "azure_conv", "onoff")
EVEN = ("poisson", "azure_conv")  # where a burst would blur the regime a family is about
THERMAL = ("sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown")


@dataclass(frozen=True)
class Family:
    name: str
    summary: str  # one line: the base setup and its mechanism
    causes: tuple[str, ...]  # the (state/)causes its variants are written to produce
    build: Callable[[Builder], None]


@dataclass
class Stream:
    """One traffic source before its rate is set: tokens, arrival shape, token sample."""

    name: str
    service_class: str
    prompt: dict[str, Any]
    output: dict[str, Any]
    shape: dict[str, Any]
    sample: TokenSample
    extra: dict[str, Any] = field(default_factory=dict)


def stream(
    b: Builder,
    name: str = "chat",
    service_class: str = "interactive",
    profiles: Sequence[str] = INTERACTIVE,
    kinds: Sequence[str] = STEADY,
    amplitude: tuple[float, float] = (0.1, 0.4),
    **extra: Any,
) -> Stream:
    """A source of a drawn token profile and arrival kind (``extra``: sessions, tenant)."""
    prompt, output = b.tokens(b.choice(profiles))
    shape = b.arrivals(b.choice(kinds), amplitude)
    trace = shape if shape["kind"] == "trace" else None
    if trace is not None and b.chance(0.5):
        prompt, output = {"kind": "trace"}, {"kind": "trace"}  # the trace rows' own tokens
    return Stream(
        name, service_class, prompt, output, shape, b.sample(prompt, output, trace), extra
    )


def send(b: Builder, s: Stream, rate: float, shares: dict[str, float]) -> None:
    b.route(rate, shares)
    b.source(s.name, s.service_class, b.at_rate(s.shape, rate), s.prompt, s.output, **s.extra)


def costs_of(
    b: Builder, sample: TokenSample, workers: Sequence[Worker] | None = None
) -> dict[str, float]:
    """Seconds per request of ``sample`` on each worker (default: every worker)."""
    return {w.name: b.cost(w, sample) for w in (b.workers if workers is None else workers)}


def capacity(costs: dict[str, float]) -> float:
    """Requests/s the workers serve together at full batches."""
    return sum(1.0 / c for c in costs.values())


def policy(b: Builder, options: Sequence[str] = POLICIES) -> str:
    b.router = {"policy": b.choice(options)}
    b.note("policy", b.router["policy"])
    return b.router["policy"]


def serve(b: Builder, load: float, **kw: Any) -> tuple[Stream, dict[str, float]]:
    """One interactive source on every worker at ``load`` of what they serve together."""
    s = stream(b, **kw)
    b.fit_batch(s.sample)
    costs = costs_of(b, s.sample)
    b.note("load", load)
    send(b, s, load * capacity(costs), b.shares(b.workers, costs))
    return s, costs


def clock_for(b: Builder, worker: Worker, sample: TokenSample, slowdown: float) -> float:
    """The clock ratio at which ``worker`` takes ``slowdown`` times as long per request."""
    full = b.cost(worker, sample)
    low, high = 0.2, 1.0
    for _ in range(30):
        mid = (low + high) / 2
        if b.cost(worker, sample, clock=mid) / full > slowdown:
            low = mid
        else:
            high = mid
    return sig(max(0.25, min(0.85, (low + high) / 2)), 2)


# -- families -------------------------------------------------------------------------------------


def balanced_pool(b: Builder) -> None:
    b.gpus(1, 8)
    policy(b, CAPACITY_AWARE)
    batch, delay = b.batching("latency" if b.chance(0.75) else "throughput")
    b.place(b.model(), batch, delay)
    s, _ = serve(b, b.uniform(0.2, 0.8, 2))
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt)


def weighted_skew(b: Builder) -> None:
    # mode -> the cards it draws
    mixes = {
        "like cards": "same",
        "mixed cards, the slowest weighted heavy": "mixed",
        "least connections, a weight left heavy": "any",
    }
    mode = b.mode(tuple(mixes))
    leastconn = mode.startswith("least")
    b.gpus(2, 8, mix=mixes[mode])
    policy_name = "least_connections" if leastconn else "weighted_round_robin"
    b.router = {"policy": policy_name}
    b.note("policy", policy_name)
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s = stream(b)
    b.fit_batch(s.sample)
    costs = costs_of(b, s.sample)
    load = b.uniform(0.25, 0.65, 2)
    rate = load * capacity(costs)
    names = [w.name for w in b.workers]
    order = [names[int(i)] for i in b.rng.permutation(len(names))]
    if mode.startswith("mixed"):  # weights set per server, not per speed
        order.sort(key=lambda n: -costs[n])
    heavy = order[: 2 if len(names) > 3 and b.chance(0.3) else 1]
    weights = {n: 1.0 if b.chance(0.5) else b.uniform(0.5, 2, 2) for n in names if n not in heavy}
    # the heavy workers' weight puts them at a load of 0.9-1.8: the default target (under
    # least connections a server is sent its weight times its capacity, up to a load of 1)
    target = b.uniform(0.9, 1.8, 2)
    share = min(0.95, sum(target / (rate * costs[n]) for n in heavy))
    speed = {n: 1.0 / costs[n] if leastconn else 1.0 for n in names}
    light = sum(weights[n] * speed[n] for n in weights)
    for n in heavy:
        weights[n] = sig(max(1.5, share * light / (1 - share) / len(heavy) / speed[n]), 2)
    b.router["weights"] = {n: weights[n] for n in names}
    b.note("weights", ", ".join(f"{n} {weights[n]:g}" for n in names))
    b.note("load", load)
    send(b, s, rate, b.shares(b.workers, costs, weights))
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt)


def sticky_skew(b: Builder) -> None:
    b.gpus(2, 8)
    b.router = {"policy": "sticky"}
    b.note("policy", "sticky")
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    count, skew = b.integer(4, 200), b.uniform(0.6, 1.8, 2)
    s = stream(b, "sessions", profiles=("chat", "agent"), sessions={"count": count, "skew": skew})
    b.note("sessions", f"{count}, Zipf skew {skew}")
    b.fit_batch(s.sample)
    costs = costs_of(b, s.sample)
    shares = b.shares(b.workers, costs, sessions=(s.name, count, skew))
    load = b.uniform(0.3, 0.7, 2)
    hottest = max(shares[n] * costs[n] for n in shares)
    hot = load * capacity(costs) * hottest
    if hot < 0.9:  # push the hottest worker past full where the other loads allow
        load = min(0.8, load * b.uniform(0.9, 1.4, 2) / hot)
    b.note("load", sig(load, 2))
    rate = load * capacity(costs)
    if b.chance(0.3):  # some traffic without a session: spread round robin
        loose = stream(b, "anonymous", kinds=("poisson",))
        loose_rate = rate * b.uniform(0.1, 0.4, 2)
        send(b, loose, loose_rate, b.shares(b.workers, costs))
        rate -= loose_rate
    send(b, s, rate, shares)
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt)


def slow_card(b: Builder) -> None:
    n = b.integer(2, 8)
    fast = b.choice(("RTX 4090", "RTX 6000 Ada"))
    slow = [
        b.choice(("RTX 4070 Ti", "RTX 4080", "RTX 3090"))
        for _ in range(b.integer(1, max(1, n // 2)))
    ]
    cards = [fast] * (n - len(slow)) + slow
    b.cards = [cards[i] for i in b.rng.permutation(n)]
    b.note("gpus", ", ".join(b.cards))
    policy(b, ("round_robin", "weighted_round_robin"))
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s = stream(b, kinds=("poisson", "azure_conv", "diurnal"))
    b.fit_batch(s.sample)
    costs = costs_of(b, s.sample)
    slowest, cheapest = max(costs.values()), min(costs.values())
    if slowest < 1.3 * cheapest:
        raise Redraw("the cards are too alike for these requests")
    # round robin: equal counts; the slowest card at 0.95-1.6, the fastest well inside
    target = min(b.uniform(0.95, 1.6, 2), 0.8 * slowest / cheapest)
    rate = target * n / slowest
    rate = min(rate, 0.75 * capacity(costs))  # fair load below 0.85: not a shortage
    b.note("slowest card load", sig(rate / n * slowest, 2))
    send(b, s, rate, b.shares(b.workers, costs))
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt)


def host_preprocess(b: Builder) -> None:
    b.gpus(2, 8)
    policy(b, ("round_robin", "least_connections", "pooled", "random_of_2"))
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s, _ = serve(b, b.uniform(0.3, 0.8, 2), profiles=("chat", "agent", "extract", "code"))
    b.light_host(s.sample.mean_prompt, io=False)
    onset = b.mode(("from the start", "preprocess event"))
    bad = [
        b.workers[i]
        for i in b.rng.permutation(len(b.workers))[: b.integer(1, max(1, len(b.workers) // 3))]
    ]
    for w in bad:
        w.threads = b.integer(1, 2)
        b.spare_cpu(w, s.sample.mean_prompt)  # light until the onset, on fewer threads
        factor = b.rng.uniform(3, 8)  # its preprocessing needs 3-8x what its threads give
        cpu_ms = sig(factor * 1000 * b.cpu_capacity(w) / b.rates[w.name])
        if onset == "from the start":
            w.cpu_ms = cpu_ms
            b.note(f"{w.name} preprocessing", f"{cpu_ms:g} ms on {w.threads} thread(s)")
        else:
            b.event(
                b.at(0.1, 0.6),
                "preprocess",
                {"worker": w.name, "cpu_ms": cpu_ms},
                f"{w.name}'s preprocessing grows to {cpu_ms:g} ms on {w.threads} thread(s)",
            )
    b.incidents(s.sample.mean_prompt, high=1)


def small_host(b: Builder) -> None:
    b.gpus(4, 8)
    policy(b, ("round_robin", "least_connections", "pooled"))
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s, _ = serve(b, b.uniform(0.35, 0.75, 2), kinds=("poisson", "diurnal"), amplitude=(0.2, 0.6))
    b.cores = b.integer(2, 8)
    factor = b.uniform(1.5, 4, 2)  # the workers need 1.5-4x the host's cores
    total = sum(b.rates.values())
    per_request = factor * b.cores / total  # CPU seconds
    split = b.rng.uniform(0.3, 0.8)
    for w in b.workers:
        w.threads = b.integer(2, 4)
        w.cpu_ms = sig(1000 * per_request * split)
        w.cpu_ms_per_1k_prompt_tokens = sig(
            1000 * per_request * (1 - split) / (s.sample.mean_prompt / 1000)
        )
    b.note("host", f"{b.cores} cores, preprocessing needs {factor}x of them")
    b.incidents(s.sample.mean_prompt)


def multimodal(b: Builder) -> None:
    b.gpus(1, 8)
    policy(b, ("round_robin", "least_connections", "pooled", "random_of_2"))
    batch, delay = b.batching()
    b.place(
        b.model(
            shapes=("qwen2.5-1.5b", "gemma-2-2b", "llama-3.2-3b", "qwen2.5-7b", "llama-3.1-8b")
        ),
        batch,
        delay,
    )
    s, _ = serve(b, b.uniform(0.35, 0.8, 2), profiles=("chat", "agent"))
    b.light_host(s.sample.mean_prompt, io=False)
    bound = b.mode(("image decoding", "image reads"))
    for w in b.workers:
        w.io_mb_per_request = b.uniform(0.2, 6, 2)
    factor = b.uniform(2, 5, 2)
    if bound == "image decoding":
        chosen = b.workers if b.chance(0.7) else b.workers[: max(1, len(b.workers) // 2)]
        for w in chosen:
            w.threads = b.integer(1, 4)
        b.cores = max(b.cores, sum(w.threads for w in b.workers))
        for w in chosen:
            w.cpu_ms = sig(factor * 1000 * b.cpu_capacity(w) / b.rates[w.name])
        b.disk_mb_per_second = sig(3 * b.disk_need())
    else:
        b.disk_mb_per_second = sig(b.disk_need() / factor)
    b.note("bound by", f"{bound}, {factor}x what the host gives")
    b.incidents(s.sample.mean_prompt)


def disk_heavy(b: Builder) -> None:
    b.gpus(2, 8)
    policy(b)
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s, _ = serve(b, b.uniform(0.35, 0.8, 2))
    b.light_host(s.sample.mean_prompt, io=False)
    readers = (
        b.workers if b.chance(0.6) else [w for w in b.workers if b.chance(0.5)] or b.workers[:1]
    )
    adapter = b.uniform(8, 120, 2)  # a LoRA adapter read per request
    for w in readers:
        w.io_mb_per_request = adapter
    need = b.disk_need()
    factor = b.uniform(2, 5, 2)
    onset = b.mode(("from the start", "disk event"))
    if onset == "from the start":
        b.disk_mb_per_second = sig(need / factor)
    else:
        b.disk_mb_per_second = sig(need * b.uniform(1.5, 3))
        mb_s = sig(need / factor)
        b.event(
            b.at(0.1, 0.6), "disk", {"disk_mb_per_second": mb_s}, f"the disk slows to {mb_s:g} MB/s"
        )
    b.note(
        "adapters", f"{adapter} MB per request on {len(readers)} worker(s), disk {factor}x short"
    )
    b.incidents(s.sample.mean_prompt, high=1)


def _memory_batch(b: Builder, sample: TokenSample, workers: Sequence[Worker] | None = None) -> None:
    """Each worker's max batch size such that a full batch of the mean request needs
    0.9-3 times its KV region: memory pressure once it is busy."""
    workers = b.workers if workers is None else workers
    for w in workers:
        need = sample.mean_context * b.models[w.model]["kv_bytes_per_token"]
        region = b.kv_region_bytes(w)
        if need * 1.5 > region:
            raise Redraw("the KV region holds barely one request")
        ratio = b.rng.uniform(0.9, 3.0)
        w.max_batch_size = max(2, min(64, math.ceil(ratio * region / need)))
        if w.max_batch_size * need < 0.85 * region:
            raise Redraw("a full batch does not fill the KV region")
    b.note("max_batch_size", workers[0].max_batch_size)


def kv_tight(b: Builder) -> None:
    b.gpus(1, 8)
    policy(b)
    b.place(b.model(), b.choice((8, 16, 24, 32)), float(b.choice((0, 5, 10, 20))))
    s = stream(b, profiles=("chat", "agent", "rag"), kinds=("poisson", "diurnal", "onoff"))
    if s.prompt["kind"] == "lognormal":  # mixed prompt lengths: the allocator fragments
        s.prompt["p90"] = int(s.prompt["median"] * b.rng.uniform(3, 6))
        s.prompt["max"] = max(s.prompt["max"], s.prompt["p90"] * 2)
    s.sample = b.sample(s.prompt, s.output, s.shape if s.shape["kind"] == "trace" else None)
    ratio = b.uniform(0.9, 2.5, 2)
    for w in b.workers:
        need = s.sample.mean_context * b.models[w.model]["kv_bytes_per_token"]
        region = min(b.kv_region_bytes(w), w.max_batch_size * need / ratio)
        if region < 2 * need or w.max_batch_size * need < 0.85 * region:
            raise Redraw("a KV region of under two requests, or one a full batch fits")
        w.kv_cache_gib = math.floor(region / GIB * 100) / 100  # down: it must fit the card
    b.note("kv_cache_gib", f"{b.workers[0].kv_cache_gib} (a full batch needs {ratio}x)")
    costs = costs_of(b, s.sample)
    load = b.uniform(0.55, 0.85, 2)
    b.note("load", load)
    send(b, s, load * capacity(costs), b.shares(b.workers, costs))
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt)


def long_context(b: Builder) -> None:
    b.gpus(1, 8)
    policy(b, ("round_robin", "least_connections", "pooled", "random_of_2"))
    mode = b.mode(("question answering", "ingest jobs"))
    shapes = BIG_KV if b.chance(0.7) else None
    b.place(b.model(min_kv_gib=3, shapes=shapes), 16, float(b.choice((0, 5, 10, 20))))
    questions = stream(
        b, "questions", profiles=("rag",), kinds=("poisson", "diurnal", "azure_conv")
    )
    if mode == "question answering":
        _memory_batch(b, questions.sample)
        costs = costs_of(b, questions.sample)
        load = b.uniform(0.55, 0.85, 2)
        b.note("load", load)
        send(b, questions, load * capacity(costs), b.shares(b.workers, costs))
    else:
        jobs = stream(b, "ingest", "batch", profiles=("ingest",), kinds=("poisson", "onoff"))
        _interfere(b, questions, jobs)
    b.light_host(questions.sample.mean_prompt)
    b.incidents(questions.sample.mean_prompt)


def _interfere(
    b: Builder, chat: Stream, jobs: Stream, workers: Sequence[Worker] | None = None
) -> None:
    """Interactive and batch-class requests in one pool, batch work 30-65 % of the total."""
    pool = list(b.workers if workers is None else workers)
    first = pool[0]
    c_chat = b.cost(first, chat.sample, inflation=False)
    c_job = b.cost(first, jobs.sample, inflation=False)
    if c_job < 4.5 * c_chat:
        raise Redraw("the batch requests are not much costlier than the interactive ones")
    work = b.uniform(0.3, 0.65, 2)
    fraction = work * c_chat / (c_job * (1 - work) + work * c_chat)
    both = mix([(chat.sample, 1 - fraction), (jobs.sample, fraction)])
    b.fit_batch(both, pool)
    costs = costs_of(b, both, pool)
    load = b.uniform(0.35, 0.8, 2)
    b.note("load", load)
    b.note("batch work", f"{work} of the pool's work, {sig(fraction, 2)} of its requests")
    rate = load * capacity(costs)
    shares = b.shares(pool, costs)
    send(b, chat, rate * (1 - fraction), shares)
    send(b, jobs, rate * fraction, shares)


def dense_packing(b: Builder) -> None:
    b.gpus(1, 8, cards=("RTX 4070 Ti", "RTX 4080", "RTX 4090", "RTX 3090"))
    policy(b)
    copies = 2 if b.chance(0.3) else 1
    model = b.model(
        min_kv_gib=0.75,
        copies=copies,
        shapes=(
            "llama-2-7b",
            "mistral-7b",
            "llama-3.1-8b",
            "gemma-2-9b",
            "llama-2-13b",
            "phi-3-medium",
        ),
    )
    smallest = min(range(len(b.cards)), key=lambda g: CARDS[b.cards[g]].memory_total_bytes)
    for _ in range(copies):
        b.place(model, 16, float(b.choice((0, 5, 10))))
    if b.kv_region_bytes(b.workers[smallest]) > 6 * GIB:
        raise Redraw("the model leaves the card roomy")
    b.note("workers per GPU", copies)
    s = stream(b, profiles=("chat", "agent", "rag"))
    _memory_batch(b, s.sample)
    costs = costs_of(b, s.sample)
    load = b.uniform(0.55, 0.85, 2)
    b.note("load", load)
    send(b, s, load * capacity(costs), b.shares(b.workers, costs))
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt)


def multi_model(b: Builder) -> None:
    b.gpus(2, 8)
    policy(b, ("round_robin", "least_connections", "random_of_2", "pooled"))
    mode = b.mode(("a model per card group", "one model, two pools", "two models on every GPU"))
    n = len(b.cards)
    pools, classes = ("pool-a", "pool-b"), ("chat", "code")
    if mode == "two models on every GPU":
        groups = (list(range(n)), list(range(n)))
        models = [b.model(min_kv_gib=1.5, copies=2) for _ in pools]
    else:
        split = b.integer(1, n - 1)
        groups = (list(range(split)), list(range(split, n)))
        if mode == "a model per card group":
            models = [b.model(on=g) for g in groups]
        else:
            models = [b.model()] * 2
    if mode != "one model, two pools" and models[0] == models[1]:
        raise Redraw("the same model twice")
    # a pool of its own may be tuned for throughput: its quiet hours idle on the batcher
    for g_list, model, pool in zip(groups, models, pools, strict=True):
        batch, delay = b.batching("latency" if b.chance(0.6) else "throughput")
        for g in g_list:
            b.workers.append(Worker(g, model, batch, delay, pool=pool))
    b.workers.sort(key=lambda w: w.gpu)  # stable: on a shared GPU, pool-a's worker first
    b.name_workers()
    b.router["pools"] = dict(zip(classes, pools, strict=True))
    # sharing every GPU, the two pools' loads add up on each card
    shared = mode == "two models on every GPU"
    busy = b.uniform(0.5, 0.8, 2) if shared else b.uniform(0.9, 1.5, 2)
    quiet = b.uniform(0.05, 0.25 if shared else 0.45, 2)
    hot = b.choice((0, 1))
    loads = (busy, quiet) if hot == 0 else (quiet, busy)
    b.note("loads", f"{pools[0]} {loads[0]}, {pools[1]} {loads[1]}")
    prompts = []
    for i, (pool, cls, load) in enumerate(zip(pools, classes, loads, strict=True)):
        members = [w for w in b.workers if w.pool == pool]
        s = stream(b, cls, cls, profiles=("chat",) if cls == "chat" else ("code",))
        if shared and i == hot:
            _memory_batch(b, s.sample, members)
        else:
            b.fit_batch(s.sample, members)
        costs = costs_of(b, s.sample, members)
        send(b, s, load * capacity(costs), b.shares(members, costs))
        prompts.append(s.sample.mean_prompt)
    b.light_host(max(prompts))
    b.incidents(max(prompts))


def throttle_prone(b: Builder) -> None:
    b.gpus(2, 8, mix="same" if b.chance(0.7) else "mixed")
    aware = b.chance(0.2)
    policy(b, ("least_connections", "pooled") if aware else ("round_robin", "weighted_round_robin"))
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s, costs = serve(b, b.uniform(0.6, 0.85, 2) if aware else b.uniform(0.45, 0.75, 2), kinds=EVEN)
    rho = b.gpu_rho(costs)
    hot = b.rng.permutation(len(b.cards))[: b.integer(1, min(2, len(b.cards) - 1))]
    for g in (int(x) for x in hot):
        worker = next(w for w in b.workers if w.gpu == g)
        clock = (
            b.uniform(0.3, 0.7, 2)
            if aware
            else clock_for(b, worker, s.sample, b.rng.uniform(0.95, 1.6) / max(rho[g], 0.05))
        )
        at = b.at(0.05, 0.6)
        until = at + b.integer(60, 300) if b.chance(0.4) else None
        b.throttle(g, clock, b.choice(THERMAL), at, until)
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt, high=1)


def power_capped(b: Builder) -> None:
    b.gpus(4, 8, mix="same")
    policy(b, NOT_AWARE)
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s = stream(b, kinds=EVEN)
    b.fit_batch(s.sample)
    costs = costs_of(b, s.sample)
    card = CARDS[b.cards[0]]
    n = len(b.cards)
    capped = sorted(
        int(g) for g in b.rng.permutation(n)[: n if b.chance(0.4) else b.integer(1, n - 1)]
    )
    limit = b.uniform(0.5, 0.8, 2)
    # board power goes as clock^1.5 (lab/model/gpu.py): the clock a cap leaves
    clock = sig(min(0.88, (limit / 0.92) ** (2 / 3)), 2)
    slowdown = (
        b.cost(b.workers[capped[0]], s.sample, clock=clock) / costs[b.workers[capped[0]].name]
    )
    load = max(0.4, min(0.8, b.uniform(0.95, 1.5, 2) / slowdown))
    b.note("load", sig(load, 2))
    b.note("power cap", f"{limit} of the TGP on GPUs {capped}: clock {clock}")
    for g in capped:
        b.power_limits[g] = sig(limit * card.power_limit_watts)
        b.throttle(g, clock, "sw_power_cap", 0.0, None)
    send(b, s, load * capacity(costs), b.shares(b.workers, costs))
    if b.chance(0.5):  # a supply that sags: the power brake on one card for a while
        g = b.integer(0, n - 1)
        at = b.at(0.1, 0.7)
        back = clock if g in capped else 1.0
        b.throttle(g, b.uniform(0.25, 0.5, 2), "hw_power_brake_slowdown", at, None)
        b.event(
            at + b.integer(30, 150),
            "throttle",
            {"gpu": g, "clock_ratio": back, "reason": "sw_power_cap"},
            f"GPU {g} back to {back}",
        )
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt, high=1)


def hardware_faults(b: Builder) -> None:
    b.gpus(3, 8, mix="mixed", cards=("RTX 3090", "RTX 4080", "RTX 4090", "RTX 4070 Ti"))
    policy(b, ("round_robin", "weighted_round_robin", "random_of_2", "least_connections"))
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s, costs = serve(b, b.uniform(0.45, 0.8, 2), kinds=EVEN)
    order = [int(g) for g in b.rng.permutation(len(b.cards))]
    crashed, throttled, lost = order[0], order[1], order[2]
    worker = next(w for w in b.workers if w.gpu == crashed)
    b.crash(worker.name, b.at(0.1, 0.6), float(b.integer(45, 300)) if b.chance(0.6) else None)
    rho = b.gpu_rho(costs)
    hot = next(w for w in b.workers if w.gpu == throttled)
    clock = clock_for(b, hot, s.sample, b.rng.uniform(1.0, 1.6) / max(rho[throttled], 0.05))
    b.throttle(
        throttled, clock, b.choice(("hw_slowdown", "hw_thermal_slowdown")), b.at(0.05, 0.6), None
    )
    if b.chance(0.5):
        b.event(b.at(0.3, 0.8), "gpu_lost", {"gpu": lost}, f"GPU {lost} falls off the bus")
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt, high=1)


def batch_wait(b: Builder) -> None:
    b.gpus(1, 4)
    policy(b, ("round_robin", "least_connections", "pooled"))
    batch, delay = b.batching("throughput")
    b.place(b.model(), batch, delay)
    s = stream(b, profiles=("extract", "chat", "code"), kinds=("poisson", "onoff", "azure_conv"))
    b.fit_batch(s.sample)
    costs = costs_of(b, s.sample)
    shares = b.shares(b.workers, costs)
    # per worker: the most requests/s at which a batch still does not fill in the delay and
    # runs in less time than the batcher waited (half the cycle or more idle)
    limits = []
    for w in b.workers:
        wait = w.max_queue_delay_ms / 1000
        spec = b.models[w.model]
        service = ServiceModel(
            CARDS[b.cards[w.gpu]], spec["params_billions"], spec["bytes_per_param"]
        )
        prompt, output = round(s.sample.mean_prompt), round(float(s.sample.outputs.mean()))
        rate = (w.max_batch_size - 1) / wait
        while rate > 0.05:
            size = max(1, min(w.max_batch_size, round(1 + rate * wait)))
            busy, _ = service.batch_timeline([prompt] * size, [output] * size)
            if busy <= wait:
                break
            rate *= 0.9
        # and starved: under 0.3 of the window at full batches (lab/truth.py's rho)
        limits.append(min(rate, 0.28 / costs[w.name]) / shares[w.name])
    rate = min(limits) * b.uniform(0.3, 0.9, 2)
    b.note("delay", f"{delay:g} ms for batches of {batch}")
    send(b, s, rate, shares)
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt)


def mixed_classes(b: Builder) -> None:
    b.gpus(2, 8)
    policy(b, ("round_robin", "least_connections", "pooled", "random_of_2"))
    mode = b.mode(("one shared pool", "split pools"))
    batch, delay = b.batching()
    b.place(b.model(min_kv_gib=3), batch, delay)
    chat = stream(b, profiles=("chat", "agent"), kinds=("poisson", "diurnal", "azure_conv"))
    jobs = stream(b, "jobs", "batch", profiles=("summarize",), kinds=("poisson", "onoff"))
    if mode == "one shared pool":
        _interfere(b, chat, jobs)
    else:
        n = len(b.cards)
        job_gpus = set(range(n - b.integer(1, max(1, n // 3)), n))
        for w in b.workers:
            w.pool = "jobs" if w.gpu in job_gpus else "chat"
        b.router["pools"] = {"interactive": "chat", "batch": "jobs"}
        for s, pool, load in (
            (chat, "chat", b.uniform(0.3, 0.75, 2)),
            (jobs, "jobs", b.uniform(0.2, 1.1, 2)),
        ):
            members = [w for w in b.workers if w.pool == pool]
            b.fit_batch(s.sample, members)
            costs = costs_of(b, s.sample, members)
            b.note(f"load {pool}", load)
            send(b, s, load * capacity(costs), b.shares(members, costs))
    b.light_host(chat.sample.mean_prompt)
    b.incidents(chat.sample.mean_prompt)


def demand_ramp(b: Builder) -> None:
    b.gpus(2, 8)
    same = len(set(b.cards)) == 1
    policy(b, (*CAPACITY_AWARE, "round_robin") if same else CAPACITY_AWARE)
    batcher = b.mode(("latency batcher", "throughput batcher"))
    peak = b.uniform(1.0, 1.5, 2)
    if batcher == "latency batcher":
        batch, delay = b.batching()
        amplitude = b.uniform(0.35, 0.8, 2)
    else:  # a batcher tuned for the peak idles through the deep trough
        batch, delay = b.choice((16, 24, 32, 48, 64)), b.uniform(800, 3000, 2)
        amplitude = b.uniform(0.7, 0.9, 2)
    b.place(b.model(), batch, delay)
    s = stream(b, kinds=("diurnal",), amplitude=(amplitude, amplitude))
    s.shape["period_seconds"] = sig(b.duration * b.rng.uniform(0.6, 1.2))
    s.shape["phase_seconds"] = float(int(b.uniform(0.3, 0.7) * b.duration))
    b.fit_batch(s.sample)
    costs = costs_of(b, s.sample)
    load = peak / (1 + amplitude)
    b.note("peak load", peak)
    send(b, s, load * capacity(costs), b.shares(b.workers, costs))
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt)


def overprovisioned(b: Builder) -> None:
    b.gpus(4, 8)
    policy(b, (*CAPACITY_AWARE, "round_robin"))
    mode = b.mode(("latency batcher", "throughput batcher", "backfilled with batch jobs"))
    batch, delay = b.batching("throughput" if mode == "throughput batcher" else "latency")
    b.place(b.model(min_kv_gib=3), batch, delay)
    if mode == "backfilled with batch jobs":
        # the idle cards take offline jobs in the same queue: interactive requests wait on them
        chat = stream(b, kinds=("bursts", "azure_code"))
        jobs = stream(b, "backfill", "batch", profiles=("summarize",), kinds=("poisson",))
        _interfere(b, chat, jobs)
    else:
        # lulls of whole windows leave nothing to batch: the throughput batcher gets steadier
        # traffic, as sparse
        kinds = (
            ("bursts", "azure_code", "tenants")
            if mode == "latency batcher"
            else ("onoff", "poisson", "tenants")
        )
        chat, _ = serve(b, b.uniform(0.03, 0.25, 2), kinds=kinds)
    b.light_host(chat.sample.mean_prompt)
    b.incidents(chat.sample.mean_prompt)


def crash_prone(b: Builder) -> None:
    b.gpus(2, 8)
    policy(b, ("round_robin", "least_connections", "pooled", "random_of_2", "weighted_round_robin"))
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s, _ = serve(b, b.uniform(0.35, 0.8, 2))
    crashed = b.rng.permutation(len(b.workers))[: b.integer(1, min(3, len(b.workers) - 1))]
    for i in crashed:
        restart = float(b.integer(45, 300)) if b.chance(0.6) else None
        b.crash(b.workers[int(i)].name, b.at(0.05, 0.7), restart)
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt, high=1)


def rolling_restart(b: Builder) -> None:
    b.gpus(3, 8)
    policy(b, (*CAPACITY_AWARE, "round_robin"))
    batch, delay = b.batching()
    b.place(b.model(), batch, delay)
    s, _ = serve(b, b.uniform(0.35, 0.75, 2))
    t = b.at(0.02, 0.3)
    order = [b.workers[int(i)] for i in b.rng.permutation(len(b.workers))]
    for w in order:
        if t >= b.duration - 30:
            break
        reload = float(b.integer(30, 120))  # model load before the worker serves again
        b.crash(w.name, t, reload)
        t += reload + b.integer(5, 40)
    b.light_host(s.sample.mean_prompt)
    b.incidents(s.sample.mean_prompt, high=1)


def multi_tenant(b: Builder) -> None:
    b.gpus(3, 8)
    policy(b, ("least_connections", "round_robin", "random_of_2", "pooled"))
    mode = b.mode(
        ("reserved premium GPU", "batch tenant in the shared pool", "an adapter per tenant")
    )
    batch, delay = b.batching()
    b.place(b.model(min_kv_gib=3), batch, delay)
    n = len(b.cards)
    reserved = set(range(n - b.integer(1, max(1, n // 4)), n))
    # the premium pool may be tuned for throughput: its quiet hours idle on the batcher
    premium_batch = b.batching("latency" if b.chance(0.6) else "throughput")
    for w in b.workers:
        w.pool = "reserved" if w.gpu in reserved else "shared"
        if w.pool == "reserved":
            w.max_batch_size, w.max_queue_delay_ms = premium_batch
    b.router["pools"] = {"shared": "shared", "premium": "reserved"}
    shared = [w for w in b.workers if w.pool == "shared"]
    tenants = stream(
        b, "tenants", "shared", profiles=("chat", "agent"), kinds=("tenants",), tenant="client"
    )
    if mode == "batch tenant in the shared pool":
        jobs = stream(
            b,
            "pipeline",
            "batch",
            profiles=("summarize",),
            kinds=("poisson", "onoff"),
            tenant="pipeline",
        )
        b.router["pools"]["batch"] = "shared"
        _interfere(b, tenants, jobs, shared)
    else:
        b.fit_batch(tenants.sample, shared)
        costs = costs_of(b, tenants.sample, shared)
        load = b.uniform(0.45, 0.8, 2)
        b.note("load shared", load)
        send(b, tenants, load * capacity(costs), b.shares(shared, costs))
    premium = stream(
        b, "premium", "premium", profiles=("chat",), kinds=("bursts",), tenant="premium"
    )
    members = [w for w in b.workers if w.pool == "reserved"]
    b.fit_batch(premium.sample, members)
    costs = costs_of(b, premium.sample, members)
    load = b.uniform(0.05, 0.4, 2)
    b.note("load reserved", load)
    send(b, premium, load * capacity(costs), b.shares(members, costs))
    b.light_host(tenants.sample.mean_prompt)
    if mode == "an adapter per tenant":
        # multi-LoRA serving: each request loads its tenant's adapter from the one disk
        adapter = b.uniform(8, 60, 2)
        for w in b.workers:
            w.io_mb_per_request = adapter if w.pool == "shared" else 0.0
        factor = b.uniform(1.5, 4, 2)
        b.disk_mb_per_second = sig(b.disk_need() / factor)
        b.note("adapters", f"{adapter} MB per request, the disk {factor}x short")
    b.incidents(tenants.sample.mean_prompt)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "balanced-pool",
            "capacity-aware routing (least connections, random of 2, a pooled queue) over like "
            "or mixed cards at 0.2-0.8 of capacity",
            ("balanced/none", "starved/low_demand"),
            balanced_pool,
        ),
        Family(
            "weighted-skew",
            "weighted round robin, or least connections with weights left over, with one or two "
            "workers weighted to 0.9-1.8 of their capacity while the fleet as a whole is at "
            "0.25-0.65",
            ("starved/routing_skew", "overloaded/routing_skew", "overloaded/slow_card"),
            weighted_skew,
        ),
        Family(
            "sticky-skew",
            "sticky sessions with Zipf-skewed session popularity: the hottest sessions' worker "
            "is pushed past full where the others allow",
            ("overloaded/routing_skew", "starved/routing_skew", "balanced/none"),
            sticky_skew,
        ),
        Family(
            "slow-card",
            "round robin over fast cards and 1-4 slower ones: equal counts put the slowest card "
            "at 0.95-1.6 of its capacity",
            ("overloaded/slow_card", "balanced/none"),
            slow_card,
        ),
        Family(
            "host-preprocess",
            "one to a third of the workers preprocess on 1-2 threads needing 3-8x what they "
            "give, from the start or after a preprocess event",
            ("starved/host_bound", "balanced/none"),
            host_preprocess,
        ),
        Family(
            "small-host",
            "4-8 GPUs on a host of 2-8 cores whose preprocessing needs 1.5-4x of them",
            ("starved/host_bound", "balanced/none"),
            small_host,
        ),
        Family(
            "multimodal",
            "vision-language serving: image decoding on few threads, or image reads from a "
            "disk too slow for them, 2-5x short",
            ("starved/host_bound", "starved/io_bound"),
            multimodal,
        ),
        Family(
            "disk-heavy",
            "a LoRA adapter of 8-120 MB read per request from a disk 2-5x too slow, from the "
            "start or after a disk event",
            ("starved/io_bound", "balanced/none"),
            disk_heavy,
        ),
        Family(
            "kv-tight",
            "KV regions cut short (kv_cache_gib) and prompts of mixed lengths: a full batch "
            "needs 0.9-2.5x the region",
            ("overloaded/memory_pressure", "balanced/none"),
            kv_tight,
        ),
        Family(
            "long-context",
            "retrieval-augmented questions with 1.5-5k-token prompts on large-KV models; or "
            "the same with batch-class document ingest jobs in the pool",
            ("overloaded/memory_pressure", "overloaded/class_interference"),
            long_context,
        ),
        Family(
            "dense-packing",
            "the largest model that fits small cards, one or two per GPU, leaving little KV "
            "region for big batches",
            ("overloaded/memory_pressure", "balanced/none"),
            dense_packing,
        ),
        Family(
            "multi-model",
            "two pools, one busy and one idle: two models on two card groups, one model split "
            "in two pools, or two models sharing every GPU (and its KV memory)",
            (
                "overloaded/capacity_shortage",
                "overloaded/routing_skew",
                "starved/low_demand",
                "overloaded/memory_pressure",
            ),
            multi_model,
        ),
        Family(
            "throttle-prone",
            "1-2 cards throttle (thermal) mid-run to the clock at which their share of the "
            "work needs 0.95-1.6 of the window",
            ("overloaded/throttling", "balanced/none"),
            throttle_prone,
        ),
        Family(
            "power-capped",
            "a dense chassis with power limits of 0.5-0.8 TGP on some or all cards from the "
            "start, and now and then a power brake",
            ("overloaded/throttling", "balanced/none"),
            power_capped,
        ),
        Family(
            "hardware-faults",
            "an older mixed fleet where a worker crashes, a card slows down (hw_slowdown) and "
            "sometimes another falls off the bus",
            ("starved/worker_crash", "overloaded/throttling", "overloaded/capacity_shortage"),
            hardware_faults,
        ),
        Family(
            "batch-wait",
            "throughput-tuned batchers (batches of 16-64, 0.3-3 s max queue delay) at rates "
            "where batches never fill",
            ("starved/batch_delay",),
            batch_wait,
        ),
        Family(
            "mixed-classes",
            "interactive chat and batch-class summarisation jobs in one shared pool, or in "
            "split pools",
            ("overloaded/class_interference", "balanced/none", "starved/low_demand"),
            mixed_classes,
        ),
        Family(
            "demand-ramp",
            "a diurnal ramp whose peak reaches 1.0-1.5 of capacity and whose trough idles, "
            "with a latency-tuned batcher or one tuned for the peak (long queue delay)",
            (
                "overloaded/capacity_shortage",
                "balanced/none",
                "starved/low_demand",
                "starved/batch_delay",
            ),
            demand_ramp,
        ),
        Family(
            "overprovisioned",
            "4-8 cards for bursty ON/OFF, Azure code or multi-tenant traffic at 0.03-0.25 of "
            "capacity, with a latency- or a throughput-tuned batcher",
            ("starved/low_demand", "starved/batch_delay"),
            overprovisioned,
        ),
        Family(
            "crash-prone",
            "1-3 workers crash at random times, some restart after 45-300 s",
            ("starved/worker_crash", "balanced/none"),
            crash_prone,
        ),
        Family(
            "rolling-restart",
            "a rolling deployment restarts the workers one after another, 30-120 s of model "
            "load each",
            ("starved/worker_crash", "balanced/none"),
            rolling_restart,
        ),
        Family(
            "multi-tenant",
            "ServeGen tenants share a pool beside a reserved pool for a premium tenant; a batch "
            "pipeline tenant shares the pool, or each tenant's LoRA adapter is read per request",
            (
                "starved/low_demand",
                "overloaded/routing_skew",
                "overloaded/class_interference",
                "starved/io_bound",
            ),
            multi_tenant,
        ),
    )
}
