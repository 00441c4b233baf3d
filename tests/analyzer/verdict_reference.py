"""The verdict step as it was before it ran over a window's rows in numpy, frozen.

tests/analyzer/test_verdict_equivalence.py holds today's Verdicts to these verdicts, fleet
verdicts and evidence, word for word. Kept as it was (a row at a time in Python); change it
never.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpubalance.analyzer.baselines import split_label
from gpubalance.analyzer.causes import KV_FULL_BATCH
from gpubalance.analyzer.features import FeatureTable
from gpubalance.analyzer.frames import GpuFrame
from gpubalance.diagnosis import CAUSES_OF, Cause, FleetKind, FleetVerdict, State, Verdict

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
# the causes whose evidence says the work against the pool's
WORK_CAUSES: frozenset[Cause] = frozenset({"routing_skew", "low_demand", "capacity_shortage"})
# a peer queue at least this many batches counts as "work waiting" for the fleet verdict
QUEUED_BATCHES = 1.0
JUDGED: tuple[State, ...] = ("starved", "overloaded", "balanced")
STATES_SUMMED: tuple[State, ...] = (*JUDGED, "unknown")


class Classifier(Protocol):
    """What the verdict step needs of a classifier (the baselines and the learned model)."""

    classes_: np.ndarray

    def predict_proba(self, table: FeatureTable) -> np.ndarray: ...


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


class _Context:
    """Row lookups shared by the rules and the evidence: a frame's peers in its window.

    A fleet's table has 10^5 rows, each the peer of a few others: each frame's finite copy and
    features row are made once, when first asked for.
    """

    def __init__(self, table: FeatureTable) -> None:
        self.table = table
        self.pools: dict[tuple[str, str, float], list[int]] = {}
        for i, frame in enumerate(table.frames):
            self.pools.setdefault((frame.host, pool_name(frame), frame.t_start), []).append(i)
        self._finite: list[GpuFrame | None] = [None] * len(table.frames)
        self._values = table.values.tolist()

    def finite(self, row: int) -> GpuFrame:
        frame = self._finite[row]
        if frame is None:
            frame = self._finite[row] = _finite(self.table.frames[row])
        return frame

    def row(self, row: int) -> dict[str, float]:
        """The row's features by column, as ``table.row``."""
        return dict(zip(self.table.columns, self._values[row], strict=True))

    def peers(self, row: int) -> list[GpuFrame]:
        """The frames of the row's pool in its window that have readings, finite."""
        frame = self.table.frames[row]
        key = (frame.host, pool_name(frame), frame.t_start)
        return [
            self.finite(i)
            for i in self.pools[key]
            if i != row and self.table.frames[i].sample_count > 0
        ]


_FIELDS = tuple(f.name for f in dataclasses.fields(GpuFrame))
_FIELD_VALUES = operator.attrgetter(*_FIELDS)
# the fields that hold numbers (or None): the only ones a NaN can be in
_FIGURE_VALUES = operator.attrgetter(
    *(f.name for f in dataclasses.fields(GpuFrame) if re.search(r"\b(float|int)\b", str(f.type)))
)


def _finite(frame: GpuFrame) -> GpuFrame:
    """The frame with NaN or infinite figures (a damaged recording) as None: unknown."""
    # a sum of finite figures is finite (or overflows: then each is looked at); None and
    # zeros left out of it change nothing, and filter drops them without a Python loop
    if math.isfinite(sum(filter(None, _FIGURE_VALUES(frame)))):
        return frame
    values = _FIELD_VALUES(frame)
    bad = {
        name: None
        for name, value in zip(_FIELDS, values, strict=True)
        if isinstance(value, float) and not math.isfinite(value)
    }
    return dataclasses.replace(frame, **bad) if bad else frame


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _state_probabilities(
    probabilities: np.ndarray, labels: Sequence[tuple[State, Cause]]
) -> list[list[float]]:
    """Per row, each of :data:`STATES_SUMMED`' probability: the sum of its labels' (NaN as 0),
    added in label order, as the rows' own loop would."""
    known = np.where(np.isnan(probabilities), 0.0, probabilities)
    sums = np.zeros((len(STATES_SUMMED), len(probabilities)))
    for column, (state, _) in enumerate(labels):
        sums[STATES_SUMMED.index(state)] += known[:, column]
    return sums.T.tolist()


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


def _ruled_out(frame: GpuFrame) -> set[Cause]:
    """Causes the figures exclude whatever the classifier says."""
    out: set[Cause] = set()
    no_traffic = (
        frame.completions_per_second == 0 and not frame.queue_depth_max and not frame.running_mean
    )
    if no_traffic:
        # nothing reached it: no host or disk stood between it and its work
        out |= {"host_bound", "io_bound"}
    unthrottled = frame.throttled_ratio == 0 and not frame.throttle_reasons
    if unthrottled and (frame.sm_clock_ratio is None or frame.sm_clock_ratio >= 0.99):
        out.add("throttling")
    return out


class _Evidence:
    """Sentences a person can check on a dashboard: a figure, its value, what it is against."""

    def __init__(self, context: _Context) -> None:
        self.context = context

    def sentences(self, row: int, state: State, cause: Cause) -> list[str]:
        frame = self.context.finite(row)
        features = self.context.row(row)
        peers = self.context.peers(row)
        found = {
            "load": self._load(frame, features, peers),
            "clock": self._clock(frame, cause),
            "feeder": self._feeder(frame, features, cause),
            "io": self._io(frame),
            "memory": self._memory(frame, features),
            "throughput": self._throughput(frame, features, cause),
            "batch": self._batch(frame, features, state),
            "idle": self._idle(features),
            "work": self._work(features) if cause in WORK_CAUSES else None,
            "coverage": self._coverage(frame),
        }
        first = {
            "throttling": ("clock", "throughput"),
            "host_bound": ("feeder",),
            "io_bound": ("io",),
            "memory_pressure": ("memory",),
            "batch_delay": ("batch",),
            "slow_card": ("throughput",),
            "routing_skew": ("load", "work", "idle"),
            "low_demand": ("load", "work"),
            "capacity_shortage": ("load", "work"),
        }.get(cause, ("load",))
        order = [*first, *(name for name in found if name not in first)]
        return [found[name] for name in order if found[name]]

    @staticmethod
    def _load(frame: GpuFrame, features: Mapping[str, float], peers: list[GpuFrame]) -> str:
        parts = []
        queue, utilization = frame.queue_depth_mean, frame.utilization_mean_ratio
        peer_queue = _median(p.queue_depth_mean for p in peers)
        peer_utilization = _median(p.utilization_mean_ratio for p in peers)
        if queue is not None:
            if peer_queue is not None:
                parts.append(f"queue {_count(queue)} vs peer median {_count(peer_queue)}")
            elif _known(features["queue_batches"]) and features["queue_batches"] > 0:
                batches = features["queue_batches"]
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
        return "; ".join(parts)

    @staticmethod
    def _clock(frame: GpuFrame, cause: Cause) -> str | None:
        # a clock below its maximum without a reason is boost at work, not news
        if not frame.throttle_reasons and cause != "throttling":
            return None
        reasons = ", ".join(sorted(frame.throttle_reasons)) or "no slowdown reason"
        if frame.sm_clock_ratio is not None:
            return f"SM clock {_pct(frame.sm_clock_ratio)} of max ({reasons})"
        if frame.sm_clock_ratio is None and frame.throttled_ratio:
            return f"throttled {_pct(frame.throttled_ratio)} of the window ({reasons})"
        return None

    @staticmethod
    def _feeder(frame: GpuFrame, features: Mapping[str, float], cause: Cause) -> str | None:
        cores = frame.feeder_cpu_cores_max
        if cores is None:
            return None
        pinned = features["feeder_cpu_pinned"]
        pressure = frame.host_cpu_pressure_ratio
        tail = f"; host CPU pressure {_pct(pressure)} of the window" if pressure else ""
        if _known(pinned) and pinned >= 0.5:
            return f"feeding process at {cores:.2f} cores (pinned){tail}"
        if cause == "host_bound":
            return f"feeding process at {cores:.2f} cores{tail}"
        return None

    @staticmethod
    def _io(frame: GpuFrame) -> str | None:
        pressure, iowait = frame.host_io_pressure_ratio, frame.host_iowait_ratio
        if (pressure or 0) < 0.1 and (iowait or 0) < 0.1:
            return None
        parts = []
        if pressure is not None:
            parts.append(f"host IO pressure {_pct(pressure)} of the window")
        if iowait is not None:
            parts.append(f"iowait {_pct(iowait)} of CPU time")
        return ", ".join(parts)

    @staticmethod
    def _memory(frame: GpuFrame, features: Mapping[str, float]) -> str | None:
        parts = []
        usage, limit, running = (
            features["kv_cache_usage_ratio"],
            frame.max_batch_size,
            frame.running_mean,
        )
        if _known(usage) and limit and running and running > 0:
            full = usage * limit / running
            if full >= KV_FULL_BATCH:
                parts.append(
                    f"a full batch of {limit:.0f} would need {_pct(full)} of the KV cache "
                    f"({_pct(usage)} in use by {running:.1f} running requests)"
                )
        ratio = features["memory_used_ratio"]
        used = f"memory {_pct(ratio)} used" if _known(ratio) else "memory use unknown"
        if frame.allocation_failures:
            parts.append(
                f"{frame.allocation_failures:.0f} KV allocation failures in the window; {used}"
            )
        elif _known(ratio) and ratio >= 0.9:
            total = (frame.memory_total_bytes or 0) / 2**30
            parts.append(f"memory {_pct(ratio)} of {total:.0f} GiB used")
        return "; ".join(parts) or None

    @staticmethod
    def _throughput(frame: GpuFrame, features: Mapping[str, float], cause: Cause) -> str | None:
        completions = frame.completions_per_second
        own, peers = features["throughput_vs_own_best_ratio"], features["throughput_vs_peers_ratio"]
        if completions is None:
            return None
        if cause == "slow_card" and _known(peers) and peers > 0:
            return f"completions {completions:.1f}/s vs peer mean {completions / peers:.1f}/s"
        if _known(own) and 0 < own < 0.8:
            return f"completions {completions:.1f}/s vs its own best {completions / own:.1f}/s"
        return None

    @staticmethod
    def _batch(frame: GpuFrame, features: Mapping[str, float], state: State) -> str | None:
        if state != "starved":
            return None  # a busy GPU's requests wait in its queue, not for a batch to fill
        share, fill = features["batch_delay_share"], features["batch_fill_ratio"]
        if _known(share) and share >= 0.3:
            return f"batch assembly {_pct(share)} of request time"
        if frame.batch_delay_seconds is not None and frame.batch_delay_seconds >= 0.5:
            return f"oldest request waits {frame.batch_delay_seconds:.2f} s for its batch"
        if frame.batch_size_mean is not None and _known(fill) and fill:
            largest = frame.batch_size_mean / fill
            return f"mean batch {frame.batch_size_mean:.1f} of {largest:.0f} ({_pct(fill)} full)"
        return None

    @staticmethod
    def _idle(features: Mapping[str, float]) -> str | None:
        idle, peer = features["idle_while_peer_queued"], features["peer_queue_max_batches"]
        if _known(idle) and idle >= 0.2 and _known(peer):
            return f"idle {_pct(idle)} of its capacity while a peer had {peer:.1f} batches queued"
        return None

    @staticmethod
    def _work(features: Mapping[str, float]) -> str | None:
        rho = features["rho_fitted_ratio"]
        if not _known(rho):
            return None
        text = f"its work would keep it busy {_pct(rho)} of the window at full batches"
        if _known(peer := features["peer_rho_fitted_max"]):
            text += f", its busiest peer's {_pct(peer)}"
        if _known(fair := features["pool_fair_rho_fitted_ratio"]):
            text += f"; the pool's, split by capacity, {_pct(fair)} each"
        return text

    @staticmethod
    def _coverage(frame: GpuFrame) -> str | None:
        expected = frame.expected_sample_count
        if frame.stale_sample_count:
            call = frame.stale_call or "an NVML call"
            return (
                f"{frame.stale_sample_count} of {expected} samples stale (NVML call hung in {call})"
            )
        if frame.sample_count < expected:
            return f"{frame.sample_count} of {expected} expected samples"
        return None


@dataclass
class _Track:
    """One GPU's held verdict and the change it may be on the way to."""

    held: tuple[State, Cause] | None = None
    pending: tuple[State, Cause] | None = None
    pending_windows: int = 0
    last_reading_end: float | None = None
    # the pool it last served: a lost GPU or a crashed worker names no queues, yet its pool
    # is still the one it belongs to
    pool: str = ""

    def reset(self) -> None:
        self.held, self.pending, self.pending_windows = None, None, 0


class Verdicts:
    """A fitted classifier's answers as verdicts per GPU and window, and per pool.

    ``persistence_windows``: windows in a row that must agree before a GPU's state or cause
    changes. ``enter_confidence`` / ``leave_confidence``: a new state must be at least this
    probable, the held one less than that; one less probable than ``abandon_confidence`` is
    left for the likeliest whatever its probability. ``min_coverage_ratio``: the share of a
    window's expected samples a GPU needs fresh readings for to be judged at all.
    """

    def __init__(
        self,
        classifier: Classifier,
        persistence_windows: int = 2,
        enter_confidence: float = 0.6,
        leave_confidence: float = 0.4,
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
        if not 0 <= self.leave_confidence <= self.enter_confidence <= 1:
            raise ValueError(
                f"need 0 <= leave_confidence <= enter_confidence <= 1, got "
                f"{self.leave_confidence} and {self.enter_confidence}"
            )
        if self.persistence_windows < 1:
            raise ValueError(f"persistence_windows must be 1 or more: {self.persistence_windows}")
        context = _Context(table)
        judged = self._judge(table, context)
        judged.sort(key=lambda item: (item[0].t_start, item[0].host, item[0].gpu))
        return Diagnosis(tuple(v for v, _ in judged), tuple(self._fleet(table, judged)))

    # per GPU

    def _judge(self, table: FeatureTable, context: _Context) -> list[tuple[Verdict, int | None]]:
        if not table.frames:
            return []
        labels = [split_label(str(label)) for label in self.classifier.classes_]
        matrix = np.asarray(self.classifier.predict_proba(table), dtype=np.float64)
        states = _state_probabilities(matrix, labels)
        # Python floats, converted once for all rows: the rows are judged one by one
        probabilities = matrix.tolist()
        evidence = _Evidence(context)
        by_gpu: dict[tuple[str, str], list[int]] = {}
        windows: dict[str, set[float]] = {}  # host -> the windows it reported
        for i, frame in enumerate(table.frames):
            by_gpu.setdefault((frame.host, frame.uuid), []).append(i)
            windows.setdefault(frame.host, set()).add(frame.t_start)
        out: list[tuple[Verdict, int | None]] = []
        for (host, _), rows in by_gpu.items():
            rows.sort(key=lambda i: table.frames[i].t_start)
            track = _Track()
            last = table.frames[rows[0]]
            # windows by their index from the GPU's first: every one its host reported, gaps
            # included, through the host's last
            first, seconds = last.t_start, last.seconds
            at = {round((table.frames[i].t_start - first) / seconds): i for i in rows}
            for index in range(round((max(windows[host]) - first) / seconds) + 1):
                row = at.get(index)
                if row is None:
                    out.append((self._missing(last, first + index * seconds, track), None))
                    continue
                last = table.frames[row]
                verdict = self._step(row, probabilities[row], states[row], labels, track, evidence)
                out.append((verdict, row))
        return out

    def _missing(self, last: GpuFrame, t_start: float, track: _Track) -> Verdict:
        """A window in which the host reported and this GPU did not."""
        track.reset()
        t_end = t_start + last.seconds
        since = t_end - (track.last_reading_end if track.last_reading_end is not None else t_start)
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
            pool=track.pool,
        )

    def _step(
        self,
        row: int,
        probabilities: Sequence[float],
        state_probabilities: Sequence[float],
        labels: Sequence[tuple[State, Cause]],
        track: _Track,
        evidence: _Evidence,
    ) -> Verdict:
        frame = evidence.context.table.frames[row]
        # a GPU read fine whose serving queues are all gone after it served a pool: its worker
        # is down (crashed, restarting), whatever the classifier makes of an idle GPU
        worker_gone = bool(track.pool) and frame.serving_queues == 0 and not frame.lost
        track.pool = pool_name(frame) or track.pool

        def verdict(
            state: State, cause: Cause, confidence: float, sentences: Sequence[str], why: str | None
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
                evidence=tuple(sentences),
                unknown_reason=why,
                pool=track.pool,
            )

        guard = _unknown_reason(frame, self.min_coverage_ratio, track.last_reading_end)
        if frame.sample_count > 0:
            track.last_reading_end = frame.t_end  # "no samples for" counts from here
        if guard is not None:
            track.reset()
            return verdict("unknown", "none", 1.0, [guard[1]], guard[0])
        if worker_gone and frame.sample_count > 0:
            track.held, track.pending, track.pending_windows = ("starved", "worker_crash"), None, 0
            sentences = [
                f"no serving queue of pool {track.pool} reports from GPU {frame.gpu}: its worker "
                "is down",
                *evidence.sentences(row, "starved", "worker_crash"),
            ]
            return verdict("starved", "worker_crash", 1.0, sentences, None)
        states = dict(zip(STATES_SUMMED, state_probabilities, strict=True))
        if math.isnan(evidence.context.row(row)["utilization_ratio"]):
            states["unknown"] = 1.0  # no classifier judges a GPU without its utilization
        best = max(JUDGED, key=states.__getitem__)
        if states["unknown"] >= states[best]:
            track.reset()
            why = self._unjudgeable(evidence.context.row(row))
            return verdict("unknown", "none", states["unknown"], [why], why)
        candidate = (best, self._cause(frame, best, probabilities, labels))
        notes: list[str] = []
        if track.held is None:
            track.held = candidate
        elif candidate == track.held:
            track.pending, track.pending_windows = None, 0
        else:
            notes.append(self._change(track, candidate, states))
        state, cause = track.held
        sentences = evidence.sentences(row, state, cause) + [n for n in notes if n]
        return verdict(state, cause, states[state], sentences, None)

    @staticmethod
    def _cause(
        frame: GpuFrame,
        state: State,
        probabilities: Sequence[float],
        labels: Sequence[tuple[State, Cause]],
    ) -> Cause:
        """The likeliest cause of ``state``, ruled-out causes' probability moved to the state's
        likeliest allowed cause first."""
        ruled_out = _ruled_out(frame)
        causes: dict[Cause, float] = {}
        moved = 0.0
        for (of, cause), p in zip(labels, probabilities, strict=True):
            if of != state:
                continue
            p = 0.0 if math.isnan(p) else p
            if cause in ruled_out:
                moved += p
            else:
                causes[cause] = causes.get(cause, 0.0) + p
        allowed = {c: p for c, p in causes.items() if p > 0}
        target = max(allowed, key=allowed.__getitem__) if allowed else FALLBACK_CAUSE[state]
        if target not in CAUSES_OF[state]:
            target = FALLBACK_CAUSE[state]
        causes[target] = causes.get(target, 0.0) + moved
        return max(causes, key=causes.__getitem__)

    def _change(
        self, track: _Track, candidate: tuple[State, Cause], states: Mapping[State, float]
    ) -> str:
        """Count this window towards a change of the held verdict; a note on where it stands."""
        assert track.held is not None
        held_state = track.held[0]
        new_state, new_cause = candidate
        if new_state != held_state:
            supports = (
                states[new_state] >= self.enter_confidence
                and states[held_state] < self.leave_confidence
            ) or states[held_state] < self.abandon_confidence
        else:
            supports = True  # the same state with another cause: persistence alone
        if not supports:
            track.pending, track.pending_windows = None, 0
            return (
                f"the classifier leans {new_state} ({states[new_state]:.2f}), short of "
                f"{self.enter_confidence:.2f} to enter it while {held_state} holds "
                f"({states[held_state]:.2f}, leaves below {self.leave_confidence:.2f})"
            )
        # a change of state counts its windows whatever cause each gives, and takes the latest;
        # leaving a state all but gone counts them whatever state each gives
        if track.pending == candidate or (
            track.pending is not None
            and new_state != held_state
            and (track.pending[0] == new_state or states[held_state] < self.abandon_confidence)
        ):
            track.pending, track.pending_windows = candidate, track.pending_windows + 1
        else:
            track.pending, track.pending_windows = candidate, 1
        if track.pending_windows >= self.persistence_windows:
            track.held, track.pending, track.pending_windows = candidate, None, 0
            return ""
        return (
            f"the classifier says {new_state}/{new_cause} ({states[new_state]:.2f}): "
            f"{track.pending_windows} of {self.persistence_windows} windows to change"
        )

    @staticmethod
    def _unjudgeable(features: Mapping[str, float]) -> str:
        missing = [
            text
            for name, text in (
                ("utilization_ratio", "no utilization reading"),
                ("queue_batches", "no serving queue figures"),
            )
            if math.isnan(features[name])
        ]
        what = " and ".join(missing) or "figures it cannot read"
        return f"the classifier cannot judge: {what}"

    # per pool

    def _fleet(
        self, table: FeatureTable, judged: Sequence[tuple[Verdict, int | None]]
    ) -> Iterable[FleetVerdict]:
        groups: dict[tuple[float, str, str], list[tuple[Verdict, int | None]]] = {}
        for verdict, row in judged:
            groups.setdefault((verdict.t_start, verdict.host, verdict.pool), []).append(
                (verdict, row)
            )
        # Python floats, converted once for all pools
        idle = table.column("idle_while_peer_queued").tolist()
        queue = table.column("queue_batches").tolist()
        for (t_start, host, pool), members in groups.items():
            rows = [r for _, r in members if r is not None]
            values = [idle[r] for r in rows if _known(idle[r])]
            ratio = round(float(np.mean(values)), 4) if values else None
            queued = {
                v.gpu
                for v, r in members
                if r is not None and _known(queue[r]) and queue[r] >= QUEUED_BATCHES
            }
            kind, sentences = _fleet_kind([v for v, _ in members], queued)
            if ratio is not None:
                sentences.append(
                    f"idle while queued {_pct(ratio)} of the pool's GPU-time in the window"
                )
            yield FleetVerdict(
                host=host,
                pool=pool,
                t_start=t_start,
                t_end=members[0][0].t_end,
                kind=kind,
                gpus=tuple(sorted(v.gpu for v, _ in members)),
                idle_while_queued_ratio=ratio,
                evidence=tuple(sentences),
            )


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
