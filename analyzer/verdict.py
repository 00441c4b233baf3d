"""Verdicts: a classifier's probabilities turned into what a person acts on.

Per GPU and window, in time order: rules first where physics is plain (a GPU with no fresh
readings is ``unknown`` with the reason, never idle), then the classifier, then persistence
(a state changes only after ``persistence_windows`` windows in a row name it, whatever cause
each gives, and takes the latest one's; a held state's cause, after as many name the same new
one) with hysteresis on confidence (the new state's probability must reach
``enter_confidence`` and the held one's fall below ``leave_confidence``), and evidence in words
a person can check on a dashboard.

A fleet's table has 10^5 rows: the rules, the causes, the peers' medians, persistence and
hysteresis run on numpy arrays (persistence a window at a time over every GPU at once), and only
the evidence is written row by row, each sentence only where its figures say something.

Per pool (the GPUs of a host that serve the same queues) and window, a :class:`FleetVerdict`
says whether moving work would help (``imbalance``), only more GPUs would
(``capacity_shortage``), fewer would do (``over_provisioning``), or neither (``balanced``).

**Idle while queued.** For pool P and window w, with n GPUs that have figures,

    idle_while_queued(P, w) = 1/n · Σ_g (1 − min(1, u_g · f_g)) · [∃ h ≠ g in P: q_h ≥ ½ batch]

where u_g is g's NVML utilization (the busy share of the window), f_g its batch fill (mean
batch size over the largest batch its pool reached), and q_h a peer's mean queue in batches:
the share of the pool's GPU-time in which a GPU's capacity went unused (idle, or running
batches below full) while another GPU of the pool held at least half a batch of waiting work.
It is the mean of the features' ``idle_while_peer_queued`` over the pool's rows; over a run
it is the same mean weighted by window length. A pool behind one central queue holds its
waiting work in that queue, never at a worker, so its ratio is 0; so is a single GPU's.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpubalance.analyzer import causes
from gpubalance.analyzer.baselines import split_label
from gpubalance.analyzer.collection import collection_paused
from gpubalance.analyzer.features import FeatureTable
from gpubalance.analyzer.frames import GpuFrame
from gpubalance.diagnosis import CAUSES, CAUSES_OF, Cause, FleetKind, FleetVerdict, State, Verdict

# the cause a state falls back to when the rules rule out every cause the classifier gave it:
# the ground truth's own "otherwise" for each state
FALLBACK_CAUSE: Mapping[State, Cause] = {
    "overloaded": "routing_skew",
    "starved": "low_demand",
    "balanced": "none",
    "unknown": "none",
}
# starved for a reason more work would cure: these GPUs can take work from a busy peer
TAKES_WORK: frozenset[Cause] = frozenset({"routing_skew", "low_demand"})
# a peer queue at least this many batches counts as "work waiting" for the fleet verdict
QUEUED_BATCHES = 1.0
JUDGED: tuple[State, ...] = ("starved", "overloaded", "balanced")
STATES_SUMMED: tuple[State, ...] = (*JUDGED, "unknown")


class Classifier(Protocol):
    """What the verdict step needs of a classifier (the baselines and the learned model).

    One that also has ``predict_likeliest_proba(table)`` (the learned model) is asked that
    instead: the same states' probabilities and likeliest state's causes, the others' causes
    unasked."""

    classes_: np.ndarray

    def predict_proba(self, table: FeatureTable) -> np.ndarray: ...


def asked_of(classifier: Classifier) -> Callable[[FeatureTable], np.ndarray]:
    """What the verdict step asks of ``classifier``: every state's probability but only the
    likeliest state's causes, where it can leave the others unasked (the learned model's
    ``predict_likeliest_proba``), else its ``predict_proba``."""
    likeliest = getattr(classifier, "predict_likeliest_proba", None)
    return classifier.predict_proba if likeliest is None else likeliest


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Everything one feature table says: per GPU and window, per pool and window."""

    verdicts: tuple[Verdict, ...]  # in time order, then host and GPU index
    fleet: tuple[FleetVerdict, ...]  # in time order


def pool_name(frame: GpuFrame) -> str:
    """What a GPU's serving queues serve; "" when the telemetry names none."""
    return ",".join(frame.queue_names)


def idle_while_queued_ratio(
    table: FeatureTable, host: str | None = None, pool: str | None = None
) -> float | None:
    """Idle-while-queued over every window of the table (or of one host, one pool), weighted
    by window length; None when no GPU has the figures."""
    values = table.column("idle_while_peer_queued")
    weighted = total = 0.0
    for frame, value in zip(table.frames, values.tolist(), strict=True):
        if math.isnan(value) or (host is not None and frame.host != host):
            continue
        if pool is not None and pool_name(frame) != pool:
            continue
        weighted += value * frame.seconds
        total += frame.seconds
    return weighted / total if total > 0 else None


def _pct(ratio: float) -> str:
    return f"{ratio * 100:.0f} %"


def _count(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.1f}"


def _known(value: float) -> bool:
    return math.isfinite(value)


# the features the evidence and the unjudgeable reason read
_EVIDENCE_FEATURES = (
    "queue_batches",
    "feeder_cpu_pinned",
    "memory_used_ratio",
    "throughput_vs_own_best_ratio",
    "throughput_vs_peers_ratio",
    "batch_delay_share",
    "batch_fill_ratio",
    "idle_while_peer_queued",
    "peer_queue_max_batches",
    "utilization_ratio",
    "kv_cache_usage_ratio",
    "rho_fitted_ratio",
    "peer_rho_fitted_max",
    "pool_fair_rho_fitted_ratio",
)
# the frame figures the rules and the evidence read, one float64 column each (None: NaN)
_FIGURES = (
    "queue_depth_mean",
    "utilization_mean_ratio",
    "sm_clock_ratio",
    "throttled_ratio",
    "feeder_cpu_cores_max",
    "host_cpu_pressure_ratio",
    "host_io_pressure_ratio",
    "host_iowait_ratio",
    "allocation_failures",
    "memory_total_bytes",
    "completions_per_second",
    "batch_delay_seconds",
    "batch_size_mean",
    "queue_depth_max",
    "running_mean",
    "max_batch_size",
)
_FIGURE_VALUES = operator.attrgetter(*_FIGURES)
_COUNTS = ("sample_count", "expected_sample_count", "stale_sample_count", "serving_queues", "lost")
_COUNT_VALUES = operator.attrgetter(*_COUNTS)
# the figures whose None the rules read as "none" (``not value``) where a NaN is a value
_NONE_READ = ("queue_depth_max", "running_mean", "sm_clock_ratio")
_NONE_VALUES = operator.attrgetter(*_NONE_READ)
# a (state, cause) pair as one number: state index · len(CAUSES) + cause index
_PAIRS: tuple[tuple[State, Cause], ...] = tuple((s, c) for s in STATES_SUMMED for c in CAUSES)
_NO_PAIR = -1
# what a GPU's row in a window is to the persistence step
_MISSING, _GUARDED, _CRASHED, _UNJUDGEABLE, _JUDGED = range(5)
# the note a judged row's evidence ends with
_NO_NOTE, _LEANS, _PENDING = range(3)


def _pair(state: State, cause: Cause) -> int:
    return STATES_SUMMED.index(state) * len(CAUSES) + CAUSES.index(cause)


class _Rows:
    """The table's frames as numpy columns, and what each row's pool peers show.

    ``figures``: :data:`_FIGURES` with NaN where a figure is None, NaN or infinite (a damaged
    recording's unknown); ``raw``: the same with infinities kept, as the rules compare them.
    """

    def __init__(self, table: FeatureTable) -> None:
        frames = table.frames
        self.table = table
        n = len(frames)
        self.raw = np.array([_FIGURE_VALUES(f) for f in frames], dtype=np.float64).reshape(
            n, len(_FIGURES)
        )
        self.figures = np.where(np.isfinite(self.raw), self.raw, np.nan)
        nones = np.array([_NONE_VALUES(f) for f in frames], dtype=object)
        self.none = np.equal(nones.reshape(n, len(_NONE_READ)), None)
        counts = np.array([_COUNT_VALUES(f) for f in frames], dtype=np.int64).reshape(n, 5)
        self.samples, self.expected, self.stale, self.queues, lost = counts.T
        self.lost = lost.astype(bool)
        self.t_start = np.array([f.t_start for f in frames], dtype=np.float64)
        self.t_end = np.array([f.t_end for f in frames], dtype=np.float64)
        self.pools = [pool_name(f) for f in frames]
        self.throttle_reasons = np.array([bool(f.throttle_reasons) for f in frames], dtype=bool)
        groups: dict[tuple[str, str, float], int] = {}
        self.group = np.array(
            [
                groups.setdefault((f.host, pool, f.t_start), len(groups))
                for f, pool in zip(frames, self.pools, strict=True)
            ],
            dtype=np.int64,
        )
        # the per-row lists the evidence formats from: Python floats, None where unknown
        self.values = {name: _objects(self.figures[:, i]) for i, name in enumerate(_FIGURES)}
        peers = self.samples > 0
        self.values["peer_queue"] = _objects(
            _peer_median(self.column("queue_depth_mean"), self.group, peers)
        )
        self.values["peer_utilization"] = _objects(
            _peer_median(self.column("utilization_mean_ratio"), self.group, peers)
        )
        self.features = {name: table.column(name).tolist() for name in _EVIDENCE_FEATURES}

    def column(self, name: str) -> np.ndarray:
        return self.figures[:, _FIGURES.index(name)]

    def raw_column(self, name: str) -> np.ndarray:
        return self.raw[:, _FIGURES.index(name)]

    def is_none(self, name: str) -> np.ndarray:
        return self.none[:, _NONE_READ.index(name)]

    def guarded(self, min_coverage: float) -> np.ndarray:
        """The rows :func:`_unknown_reason` gives a reason for."""
        stale_init = np.array([f.stale_call == "nvmlInit" for f in self.table.frames], dtype=bool)
        with np.errstate(invalid="ignore", divide="ignore"):
            coverage = np.where(self.expected == 0, 0.0, self.samples / self.expected)
        return stale_init | self.lost | ~(coverage >= min_coverage)

    def ruled_out(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row, whether the figures rule out host_bound and io_bound (no traffic reached
        the GPU), and throttling (full clock, no slowdown reason), as :func:`_ruled_out`."""
        raw = self.raw_column

        def nothing(name: str) -> np.ndarray:  # ``not value``: None, zero
            return self.is_none(name) | (raw(name) == 0)

        no_traffic = (
            (raw("completions_per_second") == 0)
            & nothing("queue_depth_max")
            & nothing("running_mean")
        )
        unthrottled = (raw("throttled_ratio") == 0) & ~self.throttle_reasons
        full_clock = self.is_none("sm_clock_ratio") | (raw("sm_clock_ratio") >= 0.99)
        return no_traffic, unthrottled & full_clock


def _objects(values: np.ndarray) -> list[float | None]:
    """``values`` as Python floats, None where NaN."""
    out = values.astype(object)
    out[np.isnan(values)] = None
    return out.tolist()


def _peer_median(values: np.ndarray, group: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Per row, the median of the known ``values`` of the other ``eligible`` rows of its
    group (NaN when none), as ``statistics.median`` gives it: the middle value, or the mean of
    the two middle ones."""
    n = len(values)
    known = eligible & ~np.isnan(values)
    order = np.lexsort((np.where(known, values, np.inf), group))
    ranked = values[order]
    groups = int(group.max()) + 1 if n else 0
    start = np.searchsorted(group[order], np.arange(groups))
    count = np.bincount(group[known], minlength=groups)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - start[group[order]]
    mine = known.astype(np.int64)  # the row's own value is among its group's known ones
    k = count[group] - mine
    first = start[group]

    def remaining(j: np.ndarray) -> np.ndarray:
        """The j-th smallest known value of the group without the row's own."""
        skip = (mine == 1) & (j >= rank)
        at = np.clip(first + j + skip, 0, max(n - 1, 0))
        return ranked[at] if n else np.zeros(0)

    middle = np.maximum(k - 1, 0) // 2
    odd = remaining(middle)
    even = (remaining(np.maximum(k // 2 - 1, 0)) + remaining(k // 2)) / 2
    return np.where(k == 0, np.nan, np.where(k % 2 == 1, odd, even))


def _state_probabilities(
    probabilities: np.ndarray, labels: Sequence[tuple[State, Cause]]
) -> np.ndarray:
    """Per row, each of :data:`STATES_SUMMED`' probability: the sum of its labels' (NaN as 0),
    added in label order, as the rows' own loop would."""
    known = np.where(np.isnan(probabilities), 0.0, probabilities)
    sums = np.zeros((len(STATES_SUMMED), len(probabilities)))
    for column, (state, _) in enumerate(labels):
        sums[STATES_SUMMED.index(state)] += known[:, column]
    return sums.T


def _causes(
    probabilities: np.ndarray,
    labels: Sequence[tuple[State, Cause]],
    best: np.ndarray,
    no_traffic: np.ndarray,
    unthrottled: np.ndarray,
) -> np.ndarray:
    """Per row, the index in CAUSES of the likeliest cause of its ``best`` state (an index in
    JUDGED), ruled-out causes' probability moved to the state's likeliest allowed cause first.

    The causes of a state are its labels' in label order and then, where the rules left it
    none, its fallback: of equal probabilities the first wins, as ``max`` over a dict does.
    """
    n = len(probabilities)
    known = np.where(np.isnan(probabilities), 0.0, probabilities)
    out = np.zeros(n, dtype=np.int64)
    for s, state in enumerate(JUDGED):
        rows = np.flatnonzero(best == s)
        if not len(rows):
            continue
        columns = [j for j, (of, _) in enumerate(labels) if of == state]
        causes = [labels[j][1] for j in columns]
        p = known[np.ix_(rows, columns)] if columns else np.zeros((len(rows), 0))
        ruled = np.zeros(p.shape, dtype=bool)
        for i, cause in enumerate(causes):
            if cause in ("host_bound", "io_bound"):
                ruled[:, i] = no_traffic[rows]
            elif cause == "throttling":
                ruled[:, i] = unthrottled[rows]
        moved = np.zeros(len(rows))
        for i in range(len(causes)):  # in label order, as the loop adds them
            moved = moved + np.where(ruled[:, i], p[:, i], 0.0)
        allowed = (p > 0) & ~ruled
        fallback = FALLBACK_CAUSE[state]
        target = np.full(len(rows), CAUSES.index(fallback))
        cause_index = np.array([CAUSES.index(c) for c in causes], dtype=np.int64)
        allowed_any = allowed.any(axis=1)
        if causes:
            pick = np.argmax(np.where(allowed, p, -np.inf), axis=1)
            target[allowed_any] = cause_index[pick[allowed_any]]
        fits = np.isin(target, [CAUSES.index(c) for c in CAUSES_OF[state]])
        target[~fits] = CAUSES.index(fallback)
        # the candidates: the label causes not ruled out, in order, then the target when it
        # is none of them
        scores = np.where(ruled, -np.inf, p)
        in_labels = (cause_index[None, :] == target[:, None]) & ~ruled
        scores = scores + np.where(in_labels, moved[:, None], 0.0)
        extra = np.where(in_labels.any(axis=1), -np.inf, moved)
        scores = np.concatenate([scores, extra[:, None]], axis=1)
        options = np.concatenate(
            [np.broadcast_to(cause_index, (len(rows), len(causes))), target[:, None]], axis=1
        )
        chosen = options[np.arange(len(rows)), np.argmax(scores, axis=1)]
        out[rows] = chosen
    return out


def _persist(
    kinds: np.ndarray,
    candidates: np.ndarray,
    states: np.ndarray,
    persistence: int,
    enter: float,
    leave: float,
    abandon: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Persistence and hysteresis over each GPU's windows: ``kinds``, ``candidates`` (pair
    numbers) and ``states`` (probabilities of STATES_SUMMED) are (GPU, window) grids, a
    window at a time over every GPU at once. Returns the pair each GPU holds after each
    window, the note its evidence ends with, and the windows a pending change has counted."""
    gpus, windows = kinds.shape
    held = np.full(gpus, _NO_PAIR)
    pending = np.full(gpus, _NO_PAIR)
    counted = np.zeros(gpus, dtype=np.int64)
    held_out = np.full((gpus, windows), _NO_PAIR)
    notes = np.zeros((gpus, windows), dtype=np.int64)
    counts = np.zeros((gpus, windows), dtype=np.int64)
    crash = _pair("starved", "worker_crash")
    everyone = np.arange(gpus)
    for w in range(windows):
        kind, candidate = kinds[:, w], candidates[:, w]
        reset = (kind == _MISSING) | (kind == _GUARDED) | (kind == _UNJUDGEABLE)
        crashed = kind == _CRASHED
        judged = kind == _JUDGED
        first = judged & (held == _NO_PAIR)
        same = judged & ~first & (candidate == held)
        change = judged & ~first & ~same
        new_state = np.maximum(candidate, 0) // len(CAUSES)
        held_state = np.maximum(held, 0) // len(CAUSES)
        # the same state with another cause needs persistence alone; another state must reach
        # enter while the held one is below leave, unless the held one is all but gone
        held_p = states[everyone, w, held_state]
        supports = (
            (new_state == held_state)
            | ((states[everyone, w, new_state] >= enter) & (held_p < leave))
            | (held_p < abandon)
        )
        leans = change & ~supports
        counting = change & supports
        # a change of state counts its windows whatever cause each gives, and takes the latest;
        # leaving a state all but gone counts them whatever state each gives
        pending_state = np.maximum(pending, 0) // len(CAUSES)
        continues = (pending == candidate) | (
            (pending != _NO_PAIR)
            & (new_state != held_state)
            & ((pending_state == new_state) | (held_p < abandon))
        )
        counted = np.where(counting, np.where(continues, counted + 1, 1), counted)
        pending = np.where(counting, candidate, pending)
        done = counting & (counted >= persistence)
        notes[:, w] = np.where(leans, _LEANS, np.where(counting & ~done, _PENDING, _NO_NOTE))
        counts[:, w] = counted
        held = np.where(reset, _NO_PAIR, held)
        held = np.where(crashed, crash, held)
        held = np.where(first | done, candidate, held)
        clear = reset | crashed | same | leans | done
        pending = np.where(clear, _NO_PAIR, pending)
        counted = np.where(clear, 0, counted)
        held_out[:, w] = held
    return held_out, notes, counts


def _unknown_reason(
    frame: GpuFrame, min_coverage: float, last_reading_end: float | None
) -> tuple[str, str] | None:
    """Why a frame cannot be judged (reason, evidence sentence), or None when it can."""
    expected = frame.expected_sample_count
    if frame.stale_call == "nvmlInit":
        return (
            "NVML down (nvmlInit failing)",
            f"NVML did not initialise in this window: {frame.stale_sample_count} of {expected} "
            "samples without a reading; the GPU's state is unknown, not idle",
        )
    if frame.lost:
        before = (
            f"{frame.sample_count} of {expected} samples before it"
            if frame.sample_count
            else "no reading in the window"
        )
        return (
            "GPU lost",
            f"NVML reports GPU {frame.gpu} lost (fallen off the bus); {before}",
        )
    if frame.coverage_ratio >= min_coverage:
        return None
    if frame.stale_sample_count > 0:
        call = frame.stale_call or "an NVML call"
        return (
            f"NVML call hung in {call}",
            f"{frame.stale_sample_count} of {expected} samples stale: NVML call hung in {call}; "
            f"{frame.sample_count} fresh readings, {_pct(min_coverage)} needed",
        )
    if frame.sample_count == 0:
        since = frame.t_end - (frame.t_start if last_reading_end is None else last_reading_end)
        return (
            f"no samples for {since:.0f} s",
            f"no reading of GPU {frame.gpu} for {since:.0f} s (0 of {expected} samples in "
            "this window)",
        )
    return (
        f"only {frame.sample_count} of {expected} expected samples",
        f"{frame.sample_count} of {expected} expected samples ({_pct(frame.coverage_ratio)}, "
        f"{_pct(min_coverage)} needed): the GPU came, went or the source had gaps",
    )


class _Evidence:
    """Sentences a person can check on a dashboard: a figure, its value, what it is against.

    Each row's figures come from :class:`_Rows`' lists (None where unknown), its peers'
    medians made there for every row at once.
    """

    def __init__(self, rows: _Rows) -> None:
        self.rows = rows
        self.v = rows.values
        self.f = rows.features
        figure, feature = rows.column, rows.table.column
        with np.errstate(invalid="ignore"):
            # the rows with a sentence besides the load whatever their state and cause, and
            # those with a batch sentence when starved: the others' evidence is the load alone
            io = (np.nan_to_num(figure("host_io_pressure_ratio")) >= 0.1) | (
                np.nan_to_num(figure("host_iowait_ratio")) >= 0.1
            )
            failures = np.nan_to_num(figure("allocation_failures")) != 0
            # what a full batch would need of the KV region: where it is most, the memory
            # limits the batches (the figure that names memory pressure)
            kv_full_batch = causes.kv_full_batch_ratio(rows.table)
            memory = (
                failures
                | (feature("memory_used_ratio") >= 0.9)
                | (kv_full_batch >= causes.KV_FULL_BATCH)
            )
            own = feature("throughput_vs_own_best_ratio")
            throughput = ~np.isnan(figure("completions_per_second")) & (own > 0) & (own < 0.8)
            idle = (feature("idle_while_peer_queued") >= 0.2) & np.isfinite(
                feature("peer_queue_max_batches")
            )
            coverage = (rows.stale > 0) | (rows.samples < rows.expected)
            pinned = ~np.isnan(figure("feeder_cpu_cores_max")) & (
                feature("feeder_cpu_pinned") >= 0.5
            )
            fill = feature("batch_fill_ratio")
            batch = (
                (feature("batch_delay_share") >= 0.3)
                | (figure("batch_delay_seconds") >= 0.5)
                | (~np.isnan(figure("batch_size_mean")) & np.isfinite(fill) & (fill != 0))
            )
        more = io | memory | throughput | idle | coverage | pinned | rows.throttle_reasons
        self.more, self.batch = more.tolist(), batch.tolist()
        self.io, self.memory, self.throughput = io.tolist(), memory.tolist(), throughput.tolist()
        self.idle, self.coverage, self.pinned = idle.tolist(), coverage.tolist(), pinned.tolist()
        self.reasons = rows.throttle_reasons.tolist()
        self.kv_full_batch = kv_full_batch.tolist()
        # every row has one, most rows that alone: made in one pass (at a fleet's 10^5 rows a
        # call per row costs more than the sentence)
        self.loads = _load_sentences(self.v, self.f)

    def sentences(self, row: int, state: State, cause: Cause) -> list[str]:
        if (
            not self.more[row]
            and cause not in _CAUSE_SENTENCES
            and not (state == "starved" and self.batch[row])
        ):
            return [self.loads[row]]
        # each sentence where it may say something, in _SENTENCES' order after the cause's own
        found = {"load": self.loads[row]}
        if self.reasons[row] or cause == "throttling":
            found["clock"] = self._clock(row, cause)
        if self.pinned[row] or cause == "host_bound":
            found["feeder"] = self._feeder(row, cause)
        if self.io[row]:
            found["io"] = self._io(row)
        if self.memory[row]:
            found["memory"] = self._memory(row)
        if self.throughput[row] or cause == "slow_card":
            found["throughput"] = self._throughput(row, cause)
        if state == "starved" and self.batch[row]:
            found["batch"] = self._batch(row, state)
        if self.idle[row]:
            found["idle"] = self._idle(row)
        if cause in _WORK_CAUSES:
            found["work"] = self._work(row)
        if self.coverage[row]:
            found["coverage"] = self._coverage(row)
        return [text for name in _ORDER.get(cause, _SENTENCES) if (text := found.get(name))]

    def _clock(self, row: int, cause: Cause) -> str | None:
        throttle_reasons = self.rows.table.frames[row].throttle_reasons
        # a clock below its maximum without a reason is boost at work, not news
        if not throttle_reasons and cause != "throttling":
            return None
        reasons = ", ".join(sorted(throttle_reasons)) or "no slowdown reason"
        clock, throttled = self.v["sm_clock_ratio"][row], self.v["throttled_ratio"][row]
        if clock is not None:
            return f"SM clock {_pct(clock)} of max ({reasons})"
        if throttled:
            return f"throttled {_pct(throttled)} of the window ({reasons})"
        return None

    def _feeder(self, row: int, cause: Cause) -> str | None:
        cores = self.v["feeder_cpu_cores_max"][row]
        if cores is None:
            return None
        pinned = self.f["feeder_cpu_pinned"][row]
        pressure = self.v["host_cpu_pressure_ratio"][row]
        tail = f"; host CPU pressure {_pct(pressure)} of the window" if pressure else ""
        if _known(pinned) and pinned >= 0.5:
            return f"feeding process at {cores:.2f} cores (pinned){tail}"
        if cause == "host_bound":
            return f"feeding process at {cores:.2f} cores{tail}"
        return None

    def _io(self, row: int) -> str | None:
        pressure, iowait = self.v["host_io_pressure_ratio"][row], self.v["host_iowait_ratio"][row]
        if (pressure or 0) < 0.1 and (iowait or 0) < 0.1:
            return None
        parts = []
        if pressure is not None:
            parts.append(f"host IO pressure {_pct(pressure)} of the window")
        if iowait is not None:
            parts.append(f"iowait {_pct(iowait)} of CPU time")
        return ", ".join(parts)

    def _memory(self, row: int) -> str | None:
        parts = []
        full = self.kv_full_batch[row]
        if _known(full) and full >= causes.KV_FULL_BATCH:
            limit, running = self.v["max_batch_size"][row], self.v["running_mean"][row]
            usage = self.f["kv_cache_usage_ratio"][row]
            parts.append(
                f"a full batch of {limit:.0f} would need {_pct(full)} of the KV cache "
                f"({_pct(usage)} in use by {running:.1f} running requests)"
            )
        ratio = self.f["memory_used_ratio"][row]
        failures = self.v["allocation_failures"][row]
        if failures:
            used = f"memory {_pct(ratio)} used" if _known(ratio) else "memory use unknown"
            parts.append(f"{failures:.0f} KV allocation failures in the window; {used}")
        elif _known(ratio) and ratio >= 0.9:
            total = (self.v["memory_total_bytes"][row] or 0) / 2**30
            parts.append(f"memory {_pct(ratio)} of {total:.0f} GiB used")
        return "; ".join(parts) or None

    def _throughput(self, row: int, cause: Cause) -> str | None:
        completions = self.v["completions_per_second"][row]
        if completions is None:
            return None
        own = self.f["throughput_vs_own_best_ratio"][row]
        peers = self.f["throughput_vs_peers_ratio"][row]
        if cause == "slow_card" and _known(peers) and peers > 0:
            return f"completions {completions:.1f}/s vs peer mean {completions / peers:.1f}/s"
        if _known(own) and 0 < own < 0.8:
            return f"completions {completions:.1f}/s vs its own best {completions / own:.1f}/s"
        return None

    def _batch(self, row: int, state: State) -> str | None:
        if state != "starved":
            return None  # a busy GPU's requests wait in its queue, not for a batch to fill
        share, fill = self.f["batch_delay_share"][row], self.f["batch_fill_ratio"][row]
        delay, size = self.v["batch_delay_seconds"][row], self.v["batch_size_mean"][row]
        if _known(share) and share >= 0.3:
            return f"batch assembly {_pct(share)} of request time"
        if delay is not None and delay >= 0.5:
            return f"oldest request waits {delay:.2f} s for its batch"
        if size is not None and _known(fill) and fill:
            largest = size / fill
            return f"mean batch {size:.1f} of {largest:.0f} ({_pct(fill)} full)"
        return None

    def _idle(self, row: int) -> str | None:
        idle, peer = self.f["idle_while_peer_queued"][row], self.f["peer_queue_max_batches"][row]
        if _known(idle) and idle >= 0.2 and _known(peer):
            return f"idle {_pct(idle)} of its capacity while a peer had {peer:.1f} batches queued"
        return None

    def _work(self, row: int) -> str | None:
        """The figures that tell routing skew, low demand and capacity shortage apart (the
        causes' lines, causes.BUSY_PEER_RHO and causes.ROUTING_FAIR_RHO; the ground truth's
        0.85 of the pool's work split by capacity): the GPU's work, its busiest peer's and the
        pool's split by capacity, each the share of the window it keeps a GPU busy at full
        batches."""
        rho = self.f["rho_fitted_ratio"][row]
        if not _known(rho):
            return None
        peer, fair = self.f["peer_rho_fitted_max"][row], self.f["pool_fair_rho_fitted_ratio"][row]
        text = f"its work would keep it busy {_pct(rho)} of the window at full batches"
        if _known(peer):
            text += f", its busiest peer's {_pct(peer)}"
        if _known(fair):
            text += f"; the pool's, split by capacity, {_pct(fair)} each"
        return text

    def _coverage(self, row: int) -> str | None:
        frame = self.rows.table.frames[row]
        expected = frame.expected_sample_count
        if frame.stale_sample_count:
            call = frame.stale_call or "an NVML call"
            return (
                f"{frame.stale_sample_count} of {expected} samples stale (NVML call hung in {call})"
            )
        if frame.sample_count < expected:
            return f"{frame.sample_count} of {expected} expected samples"
        return None


def _load_sentences(
    values: Mapping[str, list[float | None]], features: Mapping[str, list[float]]
) -> list[str]:
    """Each row's queue and utilization against its peers' medians."""
    out = []
    for queue, utilization, peer_queue, peer_utilization, batches in zip(
        values["queue_depth_mean"],
        values["utilization_mean_ratio"],
        values["peer_queue"],
        values["peer_utilization"],
        features["queue_batches"],
        strict=True,
    ):
        parts = []
        if queue is not None:
            if peer_queue is not None:
                parts.append(f"queue {_count(queue)} vs peer median {_count(peer_queue)}")
            elif _known(batches) and batches > 0:
                parts.append(f"queue {_count(queue)}, {batches:.1f} times its largest batch")
            else:
                parts.append(f"queue {_count(queue)} with no peer to compare")
        if utilization is not None:
            if peer_utilization is not None:
                parts.append(f"utilization {_pct(utilization)} vs {_pct(peer_utilization)}")
            else:
                parts.append(f"utilization {_pct(utilization)} of the window")
        if queue is None:
            parts.append("no serving queue figures")
        out.append("; ".join(parts))
    return out


# the causes whose evidence says the work against the pool's (what tells them apart)
_WORK_CAUSES = frozenset({"routing_skew", "low_demand", "capacity_shortage"})
# the causes that bring a sentence of their own (clock, feeder, throughput, work)
_CAUSE_SENTENCES = frozenset({"throttling", "host_bound", "slow_card"}) | _WORK_CAUSES
# the sentences a cause's evidence starts with
_FIRST: Mapping[str, tuple[str, ...]] = {
    "throttling": ("clock", "throughput"),
    "host_bound": ("feeder",),
    "io_bound": ("io",),
    "memory_pressure": ("memory",),
    "batch_delay": ("batch",),
    "slow_card": ("throughput",),
    "routing_skew": ("load", "work", "idle"),
    "low_demand": ("load", "work"),
    "capacity_shortage": ("load", "work"),
}
# the sentences in the order `_Evidence.sentences` finds them, and each cause's order: its own
# first, then the rest as found
_SENTENCES = (
    "load",
    "clock",
    "feeder",
    "io",
    "memory",
    "throughput",
    "batch",
    "idle",
    "work",
    "coverage",
)
_ORDER: Mapping[str, tuple[str, ...]] = {
    cause: (*first, *(name for name in _SENTENCES if name not in first))
    for cause, first in _FIRST.items()
}


class Verdicts:
    """A fitted classifier's answers as verdicts per GPU and window, and per pool.

    ``persistence_windows``: windows in a row that must agree before a GPU's state or cause
    changes. ``enter_confidence`` / ``leave_confidence``: a new state must be at least this
    probable, the held one less than that. ``abandon_confidence``: a held state less probable
    than this is left for the likeliest one even where that one falls short of
    ``enter_confidence`` (split between the other two states): a verdict is not held at a few
    percent for want of one clear successor (persistence still applies).
    ``min_coverage_ratio``: the share of a window's expected samples a GPU needs fresh readings
    for to be judged at all.

    The defaults are those `python bench/verdict_settings.py` found best on held-out scenario
    families: of the settings whose median detection delay is within 2 windows, the fewest
    false alarms at the same state macro-F1 and cause accuracy (leave_confidence 0.3 rather
    than 0.4: 5.7 false alarms per GPU-day rather than 9.4, 1 % more changes missed, with
    folds trained on 32 variants a family; enter_confidence 0.5 ties it, missing 5 fewer).
    """

    def __init__(
        self,
        classifier: Classifier,
        persistence_windows: int = 2,
        enter_confidence: float = 0.6,
        leave_confidence: float = 0.3,
        abandon_confidence: float = 0.1,
        min_coverage_ratio: float = 0.5,
    ) -> None:
        self.classifier = classifier
        self.persistence_windows = persistence_windows
        self.enter_confidence = enter_confidence
        self.leave_confidence = leave_confidence
        self.abandon_confidence = abandon_confidence
        self.min_coverage_ratio = min_coverage_ratio

    def diagnose(self, table: FeatureTable) -> Diagnosis:
        if not 0 <= self.abandon_confidence <= self.leave_confidence <= self.enter_confidence <= 1:
            raise ValueError(
                f"need 0 <= abandon_confidence <= leave_confidence <= enter_confidence <= 1, "
                f"got {self.abandon_confidence}, {self.leave_confidence} and "
                f"{self.enter_confidence}"
            )
        if self.persistence_windows < 1:
            raise ValueError(f"persistence_windows must be 1 or more: {self.persistence_windows}")
        with collection_paused():
            judged = self._judge(table)
            judged.sort(key=lambda item: (item[0].t_start, item[0].host, item[0].gpu))
            return Diagnosis(tuple(v for v, _ in judged), tuple(self._fleet(table, judged)))

    # per GPU

    def _judge(self, table: FeatureTable) -> list[tuple[Verdict, int | None]]:
        """Every GPU's verdict in every window its host reported, gaps included, in GPU order
        (first seen first), then time; the table row each came from (None: a gap)."""
        frames = table.frames
        if not frames:
            return []
        rows = _Rows(table)
        labels = [split_label(str(label)) for label in self.classifier.classes_]
        matrix = np.asarray(asked_of(self.classifier)(table), dtype=np.float64)
        states = _state_probabilities(matrix, labels)
        # no utilization reading: NVML said nothing of the GPU's work, and no classifier judges
        # it by its serving figures alone (the rules say unknown; a model would guess)
        states[np.isnan(table.column("utilization_ratio")), STATES_SUMMED.index("unknown")] = 1.0
        n = len(frames)
        best = np.argmax(states[:, : len(JUDGED)], axis=1)  # of equal ones the first
        unjudgeable = states[:, STATES_SUMMED.index("unknown")] >= states[np.arange(n), best]
        no_traffic, unthrottled = rows.ruled_out()
        candidates = best * len(CAUSES) + _causes(matrix, labels, best, no_traffic, unthrottled)
        guarded = rows.guarded(self.min_coverage_ratio)
        grid = _Grid(frames, rows)
        pool_before, pool_after = grid.pools(rows.pools)
        slot_of_row = grid.slot_rows()
        present = slot_of_row >= 0
        r = slot_of_row[present]
        # a GPU read fine whose serving queues are all gone after it served a pool: its worker
        # is down (crashed, restarting), whatever the classifier makes of an idle GPU
        crashed = (
            (pool_before[present] & (rows.queues[r] == 0) & ~rows.lost[r])
            & (rows.samples[r] > 0)
            & ~guarded[r]
        )
        kind = np.where(
            guarded[r],
            _GUARDED,
            np.where(crashed, _CRASHED, np.where(unjudgeable[r], _UNJUDGEABLE, _JUDGED)),
        )
        kinds = np.full(grid.shape, _MISSING)
        grid_candidates = np.full(grid.shape, _NO_PAIR)
        grid_states = np.zeros((*grid.shape, len(STATES_SUMMED)))
        where = grid.position(np.flatnonzero(present))
        kinds[where] = kind
        grid_candidates[where] = candidates[r]
        grid_states[where] = states[r]
        held, notes, counted = _persist(
            kinds,
            grid_candidates,
            grid_states,
            self.persistence_windows,
            self.enter_confidence,
            self.leave_confidence,
            self.abandon_confidence,
        )
        slot_kind = np.full(grid.slots, _MISSING)
        slot_kind[present] = kind
        on_slots = grid.on_slots
        held_l, notes_l, counted_l = on_slots(held), on_slots(notes), on_slots(counted)
        last_reading = grid.last_reading_end(rows)
        latest = grid.latest_row()
        evidence = _Evidence(rows)
        states_l = states.tolist()
        candidates_l = candidates.tolist()
        out: list[tuple[Verdict, int | None]] = []
        for slot, (row, what) in enumerate(
            zip(slot_of_row.tolist(), slot_kind.tolist(), strict=True)
        ):
            pool = pool_after[slot]
            if what == _MISSING:
                last = frames[latest[slot]]
                out.append(
                    (self._missing(last, grid.t_start(slot), last_reading[slot], pool), None)
                )
                continue
            frame = frames[row]
            if what == _GUARDED:
                guard = _unknown_reason(frame, self.min_coverage_ratio, last_reading[slot])
                assert guard is not None  # the rows guarded are those it has a reason for
                reason, sentence = guard
                verdict = _verdict(frame, "unknown", "none", 1.0, (sentence,), reason, pool)
            elif what == _CRASHED:
                sentences = (
                    f"no serving queue of pool {pool} reports from GPU {frame.gpu}: its worker "
                    "is down",
                    *evidence.sentences(row, "starved", "worker_crash"),
                )
                verdict = _verdict(frame, "starved", "worker_crash", 1.0, sentences, None, pool)
            elif what == _UNJUDGEABLE:
                why = self._unjudgeable(rows, row)
                unknown = states_l[row][STATES_SUMMED.index("unknown")]
                verdict = _verdict(frame, "unknown", "none", unknown, (why,), why, pool)
            else:
                state, cause = _PAIRS[held_l[slot]]
                sentences = evidence.sentences(row, state, cause)
                note = notes_l[slot]
                if note != _NO_NOTE:
                    sentences.append(
                        self._note(note, candidates_l[row], state, states_l[row], counted_l[slot])
                    )
                confidence = states_l[row][STATES_SUMMED.index(state)]
                verdict = _verdict(frame, state, cause, confidence, tuple(sentences), None, pool)
            out.append((verdict, row))
        return out

    def _missing(
        self, last: GpuFrame, t_start: float, last_reading_end: float | None, pool: str
    ) -> Verdict:
        """A window in which the host reported and this GPU did not."""
        t_end = t_start + last.seconds
        since = t_end - (last_reading_end if last_reading_end is not None else t_start)
        reason = f"no samples for {since:.0f} s"
        return Verdict(
            host=last.host,
            gpu=last.gpu,
            uuid=last.uuid,
            t_start=t_start,
            t_end=t_end,
            state="unknown",
            cause="none",
            confidence=1.0,
            evidence=(f"{reason}: the host reported, GPU {last.gpu} did not",),
            unknown_reason=reason,
            pool=pool,
        )

    def _note(
        self, note: int, candidate: int, held_state: State, states: Sequence[float], counted: int
    ) -> str:
        """Where a change of the held verdict stands: held back by hysteresis, or counting."""
        new_state, new_cause = _PAIRS[candidate]
        new_p = states[STATES_SUMMED.index(new_state)]
        if note == _LEANS:
            held_p = states[STATES_SUMMED.index(held_state)]
            return (
                f"the classifier leans {new_state} ({new_p:.2f}), short of "
                f"{self.enter_confidence:.2f} to enter it while {held_state} holds "
                f"({held_p:.2f}, leaves below {self.leave_confidence:.2f})"
            )
        return (
            f"the classifier says {new_state}/{new_cause} ({new_p:.2f}): "
            f"{counted} of {self.persistence_windows} windows to change"
        )

    @staticmethod
    def _unjudgeable(rows: _Rows, row: int) -> str:
        missing = [
            text
            for name, text in (
                ("utilization_ratio", "no utilization reading"),
                ("queue_batches", "no serving queue figures"),
            )
            if math.isnan(rows.features[name][row])
        ]
        what = " and ".join(missing) or "figures it cannot read"
        return f"the classifier cannot judge: {what}"

    # per pool

    def _fleet(
        self, table: FeatureTable, judged: Sequence[tuple[Verdict, int | None]]
    ) -> Iterable[FleetVerdict]:
        keys: dict[tuple[float, str, str], int] = {}
        group = [keys.setdefault((v.t_start, v.host, v.pool), len(keys)) for v, _ in judged]
        members: list[list[Verdict]] = [[] for _ in keys]
        for (verdict, _), g in zip(judged, group, strict=True):
            members[g].append(verdict)
        row = np.array([-1 if r is None else r for _, r in judged], dtype=np.int64)
        ratios = _pool_means(
            table.column("idle_while_peer_queued"), np.array(group, dtype=np.int64), row
        )
        queue = table.column("queue_batches")
        with np.errstate(invalid="ignore"):
            mine = queue[np.maximum(row, 0)]
            waiting = (row >= 0) & np.isfinite(mine) & (mine >= QUEUED_BATCHES)
        queued: list[set[int]] = [set() for _ in keys]
        for i in np.flatnonzero(waiting).tolist():
            queued[group[i]].add(judged[i][0].gpu)
        for (t_start, host, pool), mine, ratio, waits in zip(
            keys, members, ratios, queued, strict=True
        ):
            kind, sentences = _fleet_kind(mine, waits)
            if ratio is not None:
                sentences.append(
                    f"idle while queued {_pct(ratio)} of the pool's GPU-time in the window"
                )
            yield FleetVerdict(
                host=host,
                pool=pool,
                t_start=t_start,
                t_end=mine[0].t_end,
                kind=kind,
                gpus=tuple(sorted(v.gpu for v in mine)),
                idle_while_queued_ratio=ratio,
                evidence=tuple(sentences),
            )


def _pool_means(values: np.ndarray, group: np.ndarray, row: np.ndarray) -> list[float | None]:
    """Per pool, the mean of its members' known ``values`` (rounded to 4 places), None when
    none is known: each pool's values in member order, pools of as many values at once, the
    same sum as ``np.mean`` of one pool's list."""
    pools = int(group.max()) + 1 if len(group) else 0
    value = values[np.maximum(row, 0)]
    known = (row >= 0) & np.isfinite(value)
    order = np.flatnonzero(known)
    order = order[np.argsort(group[order], kind="stable")]
    count = np.bincount(group[order], minlength=pools)
    start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    means = np.full(pools, np.nan)
    for k in np.unique(count[count > 0]).tolist():
        of = np.flatnonzero(count == k)
        at = start[of][:, None] + np.arange(k)[None, :]
        means[of] = np.mean(value[order[at]], axis=1)
    return [None if math.isnan(m) else round(m, 4) for m in means.tolist()]


def _verdict(
    frame: GpuFrame,
    state: State,
    cause: Cause,
    confidence: float,
    evidence: tuple[str, ...],
    why: str | None,
    pool: str,
) -> Verdict:
    return Verdict(
        host=frame.host,
        gpu=frame.gpu,
        uuid=frame.uuid,
        t_start=frame.t_start,
        t_end=frame.t_end,
        state=state,
        cause=cause,
        confidence=round(float(confidence), 4),
        evidence=evidence,
        unknown_reason=why,
        pool=pool,
    )


class _Grid:
    """Each GPU's windows, from its first through its host's last, gaps included: the slots
    its verdicts fill, GPU after GPU (first seen first), window after window.

    A row's window is its index from the GPU's first, in the first row's window lengths; of
    two rows in one window of one GPU the later in time order stands.
    """

    def __init__(self, frames: Sequence[GpuFrame], rows: _Rows) -> None:
        gpus: dict[tuple[str, str], int] = {}
        hosts: dict[str, int] = {}
        gpu = np.array([gpus.setdefault((f.host, f.uuid), len(gpus)) for f in frames])
        host = np.array([hosts.setdefault(f.host, len(hosts)) for f in frames])
        order = np.lexsort((rows.t_start, gpu))  # each GPU's rows in time order, stably
        head = order[np.searchsorted(gpu[order], np.arange(len(gpus)))]
        first, seconds = rows.t_start[head], (rows.t_end - rows.t_start)[head]
        index = np.rint((rows.t_start - first[gpu]) / seconds[gpu]).astype(np.int64)
        latest = np.full(len(hosts), -np.inf)
        np.maximum.at(latest, host, rows.t_start)
        windows = np.rint((latest[host[head]] - first) / seconds).astype(np.int64) + 1
        self.offset = np.concatenate([[0], np.cumsum(windows)[:-1]]).astype(np.int64)
        self.slots = int(windows.sum())
        self.shape = (len(gpus), int(windows.max()))
        self.gpu_of_slot = np.repeat(np.arange(len(gpus)), windows)
        self.window_of_slot = np.arange(self.slots) - self.offset[self.gpu_of_slot]
        slot = (self.offset[gpu] + index)[order[::-1]]
        taken, last = np.unique(slot, return_index=True)  # the last in time order of each
        self.row_of_slot = np.full(self.slots, -1)
        self.row_of_slot[taken] = order[::-1][last]
        self.first, self.seconds = first.tolist(), seconds.tolist()
        self.rows = rows

    def slot_rows(self) -> np.ndarray:
        """Each slot's row, -1 for a gap."""
        return self.row_of_slot

    def position(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.gpu_of_slot[slots], self.window_of_slot[slots]

    def on_slots(self, grid: np.ndarray) -> list[int]:
        return grid[self.gpu_of_slot, self.window_of_slot].tolist()

    def t_start(self, slot: int) -> float:
        g = int(self.gpu_of_slot[slot])
        return self.first[g] + int(self.window_of_slot[slot]) * self.seconds[g]

    def _latest(self, marked: np.ndarray, before: bool) -> np.ndarray:
        """Per slot, the latest marked slot of its GPU at it (or before it), -1 for none."""
        at = np.maximum.accumulate(np.where(marked, np.arange(self.slots), -1))
        if before:
            at = np.concatenate([[-1], at[:-1]])
        return np.where(at >= self.offset[self.gpu_of_slot], at, -1)

    def latest_row(self) -> list[int]:
        """Per slot, the GPU's latest row at or before it (its first slot always has one)."""
        at = self._latest(self.row_of_slot >= 0, before=False)
        return self.row_of_slot[at].tolist()

    def pools(self, names: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """Per slot, whether the GPU served a pool before it, and the pool it last served up
        to it: a lost GPU or a crashed worker names no queues, yet its pool is still the one
        it belongs to."""
        named = np.array([bool(p) for p in names], dtype=bool)
        rows = self.row_of_slot
        marked = (rows >= 0) & named[np.maximum(rows, 0)]
        before = self._latest(marked, before=True) >= 0
        after = self._latest(marked, before=False)
        return before, [names[rows[s]] if s >= 0 else "" for s in after.tolist()]

    def last_reading_end(self, rows: _Rows) -> list[float | None]:
        """Per slot, when the GPU's last window with readings before it ended ("no samples
        for" counts from there)."""
        slot_rows = self.row_of_slot
        marked = (slot_rows >= 0) & (rows.samples[np.maximum(slot_rows, 0)] > 0)
        at = self._latest(marked, before=True)
        ends = rows.t_end[slot_rows[at]]
        return [
            float(e) if a >= 0 else None for a, e in zip(at.tolist(), ends.tolist(), strict=True)
        ]


def _gpus(verdicts: Iterable[Verdict]) -> str:
    indices = sorted(v.gpu for v in verdicts)
    return ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(map(str, indices))


def _fleet_kind(verdicts: Sequence[Verdict], queued: set[int]) -> tuple[FleetKind, list[str]]:
    """The pool's kind from its GPUs' verdicts, in this order:

    unknown (no GPU judged, or more than half unknown); imbalance (a GPU that could take work,
    starved for routing or demand, while another has work waiting, or an overloaded GPU other
    than for want of capacity while another could take work); capacity shortage (a GPU
    overloaded and none that could take work); over-provisioning (every GPU starved, none with
    work waiting, most for low demand); otherwise balanced.
    """
    known = [v for v in verdicts if v.state != "unknown"]
    unknown = [v for v in verdicts if v.state == "unknown"]
    if not known or len(unknown) > len(verdicts) / 2:
        reasons = sorted({v.unknown_reason or "unknown" for v in unknown})
        return "unknown", [f"{_gpus(unknown)} of {len(verdicts)} unknown: {'; '.join(reasons)}"]
    over = [v for v in known if v.state == "overloaded"]
    starved = [v for v in known if v.state == "starved"]
    takers = [v for v in starved if v.cause in TAKES_WORK]
    room = takers + [v for v in known if v.state == "balanced"]
    waiting = [v for v in known if v.state == "overloaded" or v.gpu in queued]
    movable = [v for v in over if v.cause != "capacity_shortage"]
    summary = [_summary(known, unknown)]
    if takers and any(w.gpu not in {t.gpu for t in takers} for w in waiting):
        summary.append(
            f"{_gpus(takers)} could take the work waiting at {_gpus(waiting)}: move work"
        )
        return "imbalance", summary
    if movable and room:
        summary.append(f"{_gpus(room)} could take work from {_gpus(movable)}: move work")
        return "imbalance", summary
    if over and not room:
        summary.append(f"no GPU of the pool could take the work of {_gpus(over)}: scale out")
        return "capacity_shortage", summary
    if len(starved) == len(known) and not waiting:
        low = [v for v in starved if v.cause == "low_demand"]
        if len(low) * 2 > len(starved):
            summary.append("every GPU starved with no work waiting anywhere: scale in")
            return "over_provisioning", summary
        summary.append("every GPU starved by its own feed, not by the routing")
    return "balanced", summary


def _summary(known: Sequence[Verdict], unknown: Sequence[Verdict]) -> str:
    parts = []
    for state in ("overloaded", "starved", "balanced"):
        members = [v for v in known if v.state == state]
        if members:
            causes = sorted({v.cause for v in members} - {"none"})
            why = f" ({', '.join(causes)})" if causes else ""
            parts.append(f"{_gpus(members)} {state}{why}")
    if unknown:
        parts.append(f"{_gpus(unknown)} unknown")
    return "; ".join(parts)
