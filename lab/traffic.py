"""The lab's request stream: traffic sources of a scenario turned into one list of requests.

A scenario lists traffic sources (``TrafficSource`` and the models it is made of, embedded by the
scenario loader); ``generate(sources, duration_seconds, seed)`` turns them into one ``Request`` list
sorted by arrival. Same inputs give the same list, and each source draws from its own random
streams, keyed by its name, so adding, removing or reordering a source leaves the other
sources' requests unchanged.

Arrival kinds range from clean to dirty: Poisson, ON/OFF bursts, a diurnal rate curve, the replay
of a real Azure LLM trace (bursty ON/OFF with dead minutes for ``azure_code``), and a multi-tenant
mix driven by ServeGen's per-client statistics. The real data ships in ``lab/data/`` (see
``ATTRIBUTION.md`` there); nothing here reads the shared trace folder except the maintainer's
``derive_servegen_extract``.
"""

from __future__ import annotations

import csv
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpubalance.lab.workload import Request

DATA_DIR = Path(__file__).parent / "data"

# trace name in a scenario -> bundled file (byte-identical upstream copies)
REPLAY_TRACES: dict[str, str] = {
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
}
SERVEGEN_TRACES: dict[str, str] = {
    "servegen_language": "servegen_language_m-large_top30_24h.csv",
}

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # safe as a CSV field and a metric label value
_Z90 = 1.2815515655446004  # standard normal quantile at 0.90

# one random stream per purpose, so changing a source's token spec leaves its arrivals unchanged
_ARRIVALS, _PROMPT, _OUTPUT, _SESSIONS = range(4)


# ---------------------------------------------------------------------------------------------
# Schema


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class PoissonArrivals(_Spec):
    """Homogeneous Poisson arrivals: the memoryless baseline (inter-arrival CV 1)."""

    kind: Literal["poisson"]
    rate: float = Field(gt=0, description="requests per second")


class OnOffArrivals(_Spec):
    """Bursts: exponential ON and OFF periods, Poisson arrivals at ``rate`` while ON, none OFF.

    The mean rate is ``rate * on_seconds / (on_seconds + off_seconds)``; inter-arrival CV > 1.
    """

    kind: Literal["onoff"]
    rate: float = Field(gt=0, description="requests per second while ON")
    on_seconds: float = Field(gt=0, description="mean length of an ON period")
    off_seconds: float = Field(gt=0, description="mean length of an OFF period")


class DiurnalArrivals(_Spec):
    """Inhomogeneous Poisson arrivals following a cosine rate curve (daily ramp, compressible).

    ``rate(t) = mean_rate * (1 + amplitude * cos(2π (t - phase_seconds) / period_seconds))``, so
    the rate peaks at ``phase_seconds`` (and every period after it).
    """

    kind: Literal["diurnal"]
    mean_rate: float = Field(gt=0, description="requests per second, averaged over a period")
    amplitude: float = Field(ge=0, le=1, description="relative swing: 0 flat, 1 down to zero")
    period_seconds: float = Field(gt=0, description="length of one cycle")
    phase_seconds: float = Field(default=0.0, description="time of the first peak")


class TraceArrivals(_Spec):
    """Replay of a real request trace's timestamps (and, with ``{kind: trace}`` tokens, its rows).

    Time is scaled, never thinned, so the burst structure survives: a trace time ``t`` (seconds
    from the first request) plays at ``(t - offset_seconds) / time_scale``.
    """

    kind: Literal["trace"]
    trace: Literal["azure_code", "azure_conv"] = Field(
        description="azure_code: bursty ON/OFF, CV 13; azure_conv: near-Poisson, CV 1.1"
    )
    time_scale: float = Field(default=1.0, gt=0, description="speed-up: 4 plays 4x the rate")
    offset_seconds: float = Field(
        default=0.0, ge=0, description="trace time the replay starts from (before scaling)"
    )
    loop: bool = Field(default=True, description="restart the trace when it ends")

    @model_validator(mode="after")
    def _offset_inside_trace(self) -> TraceArrivals:
        span = _load_replay_trace(self.trace).seconds[-1]
        if self.offset_seconds >= span:
            raise ValueError(
                f"offset_seconds {self.offset_seconds} is past the end of trace "
                f"{self.trace!r} ({span:.0f} s long)"
            )
        return self


class TenantsArrivals(_Spec):
    """Many tenants: one renewal process per ServeGen client, from its per-window statistics.

    For each client and window the bundled file gives a rate, an inter-arrival CV and a fitted
    family (Gamma or Weibull); the client's arrivals in that window are a stationary renewal
    process of that family with that CV. All rates are multiplied by one factor so that the sum
    over clients averages ``total_rate`` over the run; the skew between clients, their CVs and
    their daily ramps are kept. The file covers 24 h of windows and wraps around after that.
    """

    kind: Literal["tenants"]
    trace: Literal["servegen_language"] = Field(
        description="ServeGen language/m-large: its top 30 clients by volume over the first day"
    )
    clients: int = Field(ge=1, description="the most active N clients take part")
    total_rate: float = Field(gt=0, description="requests per second, summed over clients")
    window_seconds: float = Field(
        default=600.0,
        gt=0,
        description="run seconds per ServeGen 10-minute window: 600 is real time, less compresses",
    )

    @model_validator(mode="after")
    def _enough_clients(self) -> TenantsArrivals:
        available = len(_load_servegen(self.trace).client_ids)
        if self.clients > available:
            raise ValueError(f"clients {self.clients}: trace {self.trace!r} has {available}")
        return self


class FixedTokens(_Spec):
    """Every request has the same token count."""

    kind: Literal["fixed"]
    value: int = Field(ge=1, description="tokens")


class LogNormalTokens(_Spec):
    """Log-normal token counts given by their median and 90th percentile, cut at ``max``.

    Counts above ``max`` become ``max``, as a serving engine's context limit would cut them.
    """

    kind: Literal["lognormal"]
    median: float = Field(gt=0, description="tokens")
    p90: float = Field(gt=0, description="tokens; must exceed the median")
    max: int = Field(ge=1, description="tokens; larger draws are cut to this")

    @model_validator(mode="after")
    def _ordered(self) -> LogNormalTokens:
        if self.p90 <= self.median:
            raise ValueError(f"p90 {self.p90} must exceed median {self.median}")
        if self.max < self.median:
            raise ValueError(f"max {self.max} must be at least median {self.median}")
        return self


class TraceTokens(_Spec):
    """The token count of the replayed trace row (ContextTokens or GeneratedTokens)."""

    kind: Literal["trace"]


class Sessions(_Spec):
    """Sticky-routing keys: each request gets session ``<source>/s<k>``, k in 0..count-1.

    P(k) ∝ (k + 1) ** -skew, so ``s0`` is the hottest session.
    """

    count: int = Field(ge=1, description="number of distinct sessions")
    skew: float = Field(ge=0, description="Zipf exponent: 0 uniform, ~1 a few hot sessions")


Arrivals = Annotated[
    PoissonArrivals | OnOffArrivals | DiurnalArrivals | TraceArrivals | TenantsArrivals,
    Field(discriminator="kind"),
]
Tokens = Annotated[FixedTokens | LogNormalTokens | TraceTokens, Field(discriminator="kind")]


class TrafficSource(_Spec):
    """One traffic source of a scenario: who sends, when (arrivals) and how much (tokens)."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    name: str = Field(pattern=_NAME_PATTERN, description="unique within the scenario")
    service_class: str = Field(
        alias="class", pattern=_NAME_PATTERN, description='"interactive", "batch", ...'
    )
    tenant: str = Field(
        default="default",
        pattern=_NAME_PATTERN,
        description="who sends; with tenants arrivals, the prefix of each client's tenant name",
    )
    arrivals: Arrivals
    prompt_tokens: Tokens
    output_tokens: Tokens
    sessions: Sessions | None = None

    @model_validator(mode="after")
    def _trace_tokens_need_trace_rows(self) -> TrafficSource:
        for field in ("prompt_tokens", "output_tokens"):
            if isinstance(getattr(self, field), TraceTokens) and not isinstance(
                self.arrivals, TraceArrivals
            ):
                raise ValueError(
                    f"{field}: kind trace takes the tokens of replayed trace rows, so it needs "
                    f"arrivals of kind trace (got {self.arrivals.kind})"
                )
        return self


# ---------------------------------------------------------------------------------------------
# Bundled data


@dataclass(frozen=True)
class _ReplayTrace:
    seconds: np.ndarray  # from the first request, ascending
    context_tokens: np.ndarray
    generated_tokens: np.ndarray

    @property
    def period_seconds(self) -> float:
        """Length of one loop: the span plus one mean gap, so looping keeps the mean rate."""
        span = float(self.seconds[-1])
        return span + span / (len(self.seconds) - 1)


@cache
def _load_replay_trace(name: str) -> _ReplayTrace:
    with open(DATA_DIR / REPLAY_TRACES[name], newline="") as f:
        rows = list(csv.DictReader(f))
    # ISO with a "T" lets numpy parse the 100 ns wall-clock stamps exactly
    stamps = np.array([r["TIMESTAMP"].replace(" ", "T") for r in rows], dtype="datetime64[ns]")
    seconds = (stamps - stamps[0]).astype(np.int64) / 1e9
    trace = _ReplayTrace(
        seconds=seconds,
        context_tokens=np.array([int(r["ContextTokens"]) for r in rows], dtype=np.int64),
        generated_tokens=np.array([int(r["GeneratedTokens"]) for r in rows], dtype=np.int64),
    )
    for array in (trace.seconds, trace.context_tokens, trace.generated_tokens):
        array.flags.writeable = False  # cached and shared between calls
    return trace


@dataclass(frozen=True)
class _ServeGenClients:
    client_ids: tuple[int, ...]  # upstream chunk number, most active first
    rate: np.ndarray  # (client, window) requests per second; 0 = no requests
    cv: np.ndarray  # (client, window) inter-arrival CV
    weibull: np.ndarray  # (client, window) True where the fitted family is Weibull


@cache
def _load_servegen(name: str) -> _ServeGenClients:
    with open(DATA_DIR / SERVEGEN_TRACES[name], newline="") as f:
        rows = list(csv.DictReader(f))
    client_ids = tuple(dict.fromkeys(int(r["client"]) for r in rows))  # file order = rank
    shape = (len(client_ids), len(rows) // len(client_ids))
    tables = _ServeGenClients(
        client_ids=client_ids,
        rate=np.array([float(r["rate_rps"]) for r in rows]).reshape(shape),
        cv=np.array([float(r["cv"]) for r in rows]).reshape(shape),
        weibull=np.array([r["family"] == "Weibull" for r in rows]).reshape(shape),
    )
    for array in (tables.rate, tables.cv, tables.weibull):
        array.flags.writeable = False
    return tables


def derive_servegen_extract(
    source_dir: Path, out: Path, clients: int = 30, windows: int = 144
) -> None:
    """Maintainers only: rebuild the bundled ServeGen extract from upstream per-client files.

    ``source_dir`` holds ServeGen's ``data/language/m-large/chunk-<id>-trace.csv`` (no header:
    t_s, rate_rps, cv, family, p1, p2 per 600 s window). Keeps the first ``windows`` windows of
    the ``clients`` clients with the most requests (sum of rate * 600) in them, ties by id; writes
    their first four fields verbatim, most active client first, then by time.
    """
    upstream: dict[int, list[list[str]]] = {}
    for path in source_dir.glob("chunk-*-trace.csv"):
        with open(path, newline="") as f:
            upstream[int(path.name.split("-")[1])] = list(csv.reader(f))[:windows]
    volume = {cid: sum(float(r[1]) * 600 for r in rs) for cid, rs in upstream.items()}
    top = sorted(volume, key=lambda cid: (-volume[cid], cid))[:clients]
    with open(out, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["client", "t_s", "rate_rps", "cv", "family"])
        for cid in top:
            writer.writerows([cid, *row[:4]] for row in upstream[cid])


# ---------------------------------------------------------------------------------------------
# Statistics


def interarrival_cv(arrivals: Sequence[float] | np.ndarray) -> float:
    """Coefficient of variation of the gaps between arrivals (1 for Poisson, 13 for azure_code)."""
    gaps = np.diff(np.sort(np.asarray(arrivals, dtype=float)))
    if len(gaps) == 0 or gaps.mean() == 0:
        raise ValueError("interarrival_cv needs at least two arrivals at different times")
    return float(gaps.std() / gaps.mean())


def trace_statistics(name: str) -> dict[str, float]:
    """Requests, span, mean rate and inter-arrival CV of a bundled replay trace, as shipped.

    The validation report compares replays against these figures.
    """
    if name not in REPLAY_TRACES:
        raise ValueError(f"trace {name!r}: expected one of {sorted(REPLAY_TRACES)}")
    seconds = _load_replay_trace(name).seconds
    span = float(seconds[-1])
    return {
        "requests": len(seconds),
        "span_seconds": span,
        "mean_rate_rps": (len(seconds) - 1) / span,  # one over the mean gap, as a loop plays it
        "interarrival_cv": interarrival_cv(seconds),
    }


# ---------------------------------------------------------------------------------------------
# Generation


@dataclass(frozen=True)
class _Drawn:
    """One source's arrivals before tokens, in time order."""

    seconds: np.ndarray
    trace: _ReplayTrace | None = None  # trace kind: the replayed trace
    trace_rows: np.ndarray | None = None  # trace kind: its row per arrival
    clients: np.ndarray | None = None  # index into the client table per arrival (tenants kind)


def generate(sources: Sequence[TrafficSource], duration_seconds: float, seed: int) -> list[Request]:
    """All requests of ``sources`` arriving in ``[0, duration_seconds)``, sorted by arrival.

    Ties keep the order of the sources, then each source's own order; ids are 0.. in that order.
    """
    if not (math.isfinite(duration_seconds) and duration_seconds > 0):
        raise ValueError(f"duration_seconds must be positive, got {duration_seconds}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        # random streams are keyed by name, so two sources of one name would draw the same
        raise ValueError(f"traffic names must be unique, got {names}")

    times, source_index, position = [], [], []
    prompts, outputs, tenants, sessions = [], [], [], []
    for index, source in enumerate(sources):
        key = int.from_bytes(hashlib.blake2b(source.name.encode(), digest_size=8).digest())

        def stream(purpose: int, key: int = key) -> np.random.Generator:
            return np.random.default_rng([seed, key, purpose])

        drawn = _draw_arrivals(source.arrivals, duration_seconds, stream(_ARRIVALS))
        n = len(drawn.seconds)
        times.append(drawn.seconds)
        source_index.append(np.full(n, index))
        position.append(np.arange(n))
        prompts.append(_draw_tokens(source.prompt_tokens, drawn, "context", stream(_PROMPT)))
        outputs.append(_draw_tokens(source.output_tokens, drawn, "generated", stream(_OUTPUT)))
        tenants.extend(_tenants(source, drawn))
        sessions.extend(_sessions(source.name, source.sessions, n, stream(_SESSIONS)))

    if not times:
        return []
    all_times = np.concatenate(times)
    all_sources = np.concatenate(source_index)
    order = np.lexsort((np.concatenate(position), all_sources, all_times))
    classes = [s.service_class for s in sources]
    columns = zip(
        all_times[order].tolist(),
        all_sources[order].tolist(),
        np.concatenate(prompts)[order].tolist(),
        np.concatenate(outputs)[order].tolist(),
        [tenants[k] for k in order.tolist()],
        [sessions[k] for k in order.tolist()],
        strict=True,
    )
    return [
        Request(i, t, classes[s], tenant, names[s], prompt, output, session)
        for i, (t, s, prompt, output, tenant, session) in enumerate(columns)
    ]


def _draw_arrivals(spec: Arrivals, duration: float, rng: np.random.Generator) -> _Drawn:
    match spec:
        case PoissonArrivals():
            return _Drawn(_poisson(spec.rate, duration, rng))
        case OnOffArrivals():
            return _Drawn(_onoff(spec, duration, rng))
        case DiurnalArrivals():
            return _Drawn(_diurnal(spec, duration, rng))
        case TraceArrivals():
            return _replay(spec, duration)
        case TenantsArrivals():
            return _tenant_mix(spec, duration, rng)
    raise AssertionError(f"unhandled arrivals kind {spec.kind}")


def _poisson(rate: float, duration: float, rng: np.random.Generator) -> np.ndarray:
    # given the count, Poisson arrivals are uniform order statistics: one vectorised draw
    return np.sort(rng.uniform(0.0, duration, rng.poisson(rate * duration)))


def _onoff(spec: OnOffArrivals, duration: float, rng: np.random.Generator) -> np.ndarray:
    cycle = spec.on_seconds + spec.off_seconds
    # exponential periods are memoryless: starting ON with the stationary probability and a
    # fresh period is already the steady state, no warm-up needed
    starts_on = rng.random() < spec.on_seconds / cycle
    on, off = np.empty(0), np.empty(0)
    while on.sum() + off.sum() < duration + cycle:
        more = int(duration / cycle) + 16
        on = np.append(on, rng.exponential(spec.on_seconds, more))
        off = np.append(off, rng.exponential(spec.off_seconds, more))
    # ON period i starts after i full cycles, plus the first OFF period when starting OFF
    on_start = np.concatenate(([0.0], np.cumsum(on + off)[:-1])) + (0.0 if starts_on else off[0])
    on_length = np.clip(np.minimum(on_start + on, duration) - on_start, 0.0, None)
    # Poisson on the clock that runs only while ON, mapped back to run time
    on_clock_end = np.cumsum(on_length)
    on_clock = _poisson(spec.rate, float(on_clock_end[-1]), rng)
    period = np.searchsorted(on_clock_end, on_clock, side="right")
    return on_start[period] + on_clock - (on_clock_end[period] - on_length[period])


def _diurnal(spec: DiurnalArrivals, duration: float, rng: np.random.Generator) -> np.ndarray:
    peak = spec.mean_rate * (1 + spec.amplitude)
    candidates = _poisson(peak, duration, rng)
    rate = spec.mean_rate * (
        1
        + spec.amplitude
        * np.cos(2 * np.pi * (candidates - spec.phase_seconds) / spec.period_seconds)
    )
    # thinning (Lewis-Shedler): keep each candidate with probability rate(t) / peak
    return candidates[rng.random(len(candidates)) * peak < rate]


def _replay(spec: TraceArrivals, duration: float) -> _Drawn:
    trace = _load_replay_trace(spec.trace)
    end = spec.offset_seconds + duration * spec.time_scale  # trace time at the end of the run
    loops = math.ceil(end / trace.period_seconds) if spec.loop else 1
    unwrapped = (trace.seconds[None, :] + trace.period_seconds * np.arange(loops)[:, None]).ravel()
    keep = np.flatnonzero((unwrapped >= spec.offset_seconds) & (unwrapped < end))
    seconds = (unwrapped[keep] - spec.offset_seconds) / spec.time_scale
    return _Drawn(seconds, trace=trace, trace_rows=keep % len(trace.seconds))


def _tenant_mix(spec: TenantsArrivals, duration: float, rng: np.random.Generator) -> _Drawn:
    table = _load_servegen(spec.trace)
    window = spec.window_seconds
    n_windows = math.ceil(duration / window)
    lengths = np.minimum(window, duration - window * np.arange(n_windows))
    columns = np.arange(n_windows) % table.rate.shape[1]  # wrap after the day the file holds
    rate = table.rate[: spec.clients, columns]
    expected = float((rate * lengths).sum())
    if expected == 0:
        raise ValueError(f"tenants: the top {spec.clients} clients are idle for the whole run")
    scaled = rate * (spec.total_rate * duration / expected)

    times, clients = [], []
    for client, w in zip(*np.nonzero(scaled), strict=True):
        t = _renewal(
            float(scaled[client, w]),
            float(table.cv[client, columns[w]]),
            bool(table.weibull[client, columns[w]]),
            float(lengths[w]),
            rng,
        )
        times.append(window * w + t)
        clients.append(np.full(len(t), client))
    seconds = np.concatenate(times)
    order = np.argsort(seconds, kind="stable")
    return _Drawn(seconds[order], clients=np.concatenate(clients)[order])


def _renewal(
    rate: float, cv: float, weibull: bool, length: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrivals in ``[0, length)`` of a stationary renewal process with this rate and gap CV."""
    mean_gap = 1 / rate
    if weibull:
        shape = _weibull_shape(cv)
        scale = mean_gap / math.gamma(1 + 1 / shape)

        def gaps(n: int) -> np.ndarray:
            return scale * rng.weibull(shape, n)

        # the gap that straddles time 0 is length-biased: for Weibull that is
        # scale * Gamma(1 + 1/shape) ** (1/shape)
        straddling = scale * rng.gamma(1 + 1 / shape) ** (1 / shape)
    else:
        shape, scale = 1 / cv**2, mean_gap * cv**2

        def gaps(n: int) -> np.ndarray:
            return rng.gamma(shape, scale, n)

        straddling = rng.gamma(shape + 1, scale)  # length-biased Gamma
    # starting part-way through the straddling gap makes the window stationary, so the
    # expected count is rate * length however large the CV (a fresh start would overshoot)
    arrivals = [np.array([rng.random() * straddling])]
    last = arrivals[0][-1]
    while last < length:
        more = last + np.cumsum(gaps(int((length - last) * rate) + 16))
        arrivals.append(more)
        last = more[-1]
    out = np.concatenate(arrivals)
    return out[out < length]


@cache
def _weibull_cv_table() -> tuple[np.ndarray, np.ndarray]:
    # gap CV of a Weibull is a decreasing function of its shape alone
    shapes = np.geomspace(0.05, 50.0, 2000)
    cvs = np.array(
        [
            math.sqrt(math.exp(math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k)) - 1)
            for k in shapes
        ]
    )
    return np.log(cvs[::-1]), np.log(shapes[::-1])


def _weibull_shape(cv: float) -> float:
    log_cvs, log_shapes = _weibull_cv_table()
    return float(np.exp(np.interp(math.log(cv), log_cvs, log_shapes)))


def _draw_tokens(
    spec: Tokens, drawn: _Drawn, column: Literal["context", "generated"], rng: np.random.Generator
) -> np.ndarray:
    n = len(drawn.seconds)
    match spec:
        case FixedTokens():
            return np.full(n, spec.value, dtype=np.int64)
        case LogNormalTokens():
            sigma = math.log(spec.p90 / spec.median) / _Z90
            draws = spec.median * np.exp(sigma * rng.standard_normal(n))
            return np.clip(np.rint(draws), 1, spec.max).astype(np.int64)
        case TraceTokens():
            # the schema allows trace tokens only with trace arrivals
            assert drawn.trace is not None and drawn.trace_rows is not None
            trace = drawn.trace
            values = trace.context_tokens if column == "context" else trace.generated_tokens
            return values[drawn.trace_rows]
    raise AssertionError(f"unhandled token kind {spec.kind}")


def _tenants(source: TrafficSource, drawn: _Drawn) -> list[str]:
    if drawn.clients is None:
        return [source.tenant] * len(drawn.seconds)
    assert isinstance(source.arrivals, TenantsArrivals)
    ids = _load_servegen(source.arrivals.trace).client_ids
    names = [f"{source.tenant}-{ids[k]}" for k in range(source.arrivals.clients)]
    return [names[k] for k in drawn.clients.tolist()]


def _sessions(
    source: str, spec: Sessions | None, n: int, rng: np.random.Generator
) -> list[str | None]:
    # keys carry the source name: two sources with sessions never share a sticky key
    if spec is None:
        return [None] * n
    weights = np.arange(1, spec.count + 1, dtype=float) ** -spec.skew
    cumulative = np.cumsum(weights) / weights.sum()
    # inverse CDF; the clip guards the last bin against cumulative[-1] rounding below 1
    picks = np.minimum(np.searchsorted(cumulative, rng.random(n), side="right"), spec.count - 1)
    names = [f"{source}/s{k}" for k in range(spec.count)]
    return [names[k] for k in picks.tolist()]
