"""The analyzer as a service: every interval, a source's frames judged into verdicts and
recommendations; the recommendations kept with the acks executors send.

One :meth:`AnalyzerService.cycle` reads the source, builds the features, the verdicts and the
recommendations, and publishes them; the HTTP server (:mod:`gpubalance.analyzer.server`) serves
what the last cycle published and computes nothing itself. A source that cannot be read keeps
the last verdicts as history and turns every GPU it knew ``unknown``, with the source's error
as the reason: the service keeps serving, and says so.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpubalance.analyzer.features import FeatureStream, FeatureTable, concatenate
from gpubalance.analyzer.frames import GpuFrame
from gpubalance.analyzer.sources import FrameSource, SourceError, open_source
from gpubalance.analyzer.verdict import Classifier, Diagnosis, Verdicts, asked_of
from gpubalance.diagnosis import Ack, AckStatus, Action, FleetVerdict, Recommendation, Verdict

log = logging.getLogger("gpubalance.analyzer")

# how long an expired recommendation is kept, so that a late ack hears "expired" (409), not
# "never heard of it" (404)
EXPIRED_KEPT_SECONDS = 3600.0
# A set_weights whose shares are estimates moves a little every cycle; one that moves a share by
# more than this part of it (and by more than RESHARE_MIN of the pool) asks something new: the
# acks that it was applied answered the old ask (a first ask on a guessed capacity, corrected
# once the GPU's capacity is measured, is then carried out again).
RESHARE_RATIO = 0.25
RESHARE_MIN = 0.02
# acks that say an executor did, or will do, what was asked: a new ask needs doing again
DONE: frozenset[AckStatus] = frozenset({"accepted", "applied"})
# a recommendation of the first action expires a standing one of the second for its target
UNDOES: Mapping[Action, Action] = {"add_worker": "drain", "drain": "add_worker"}

# a source error's reason label, from its message: few values, so that a rate per reason means
# something ("unreachable" pages someone, "bad_answer" files a bug)
SOURCE_ERROR_REASONS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("unreachable", re.compile(r"cannot reach|no answer within|timed out")),
    ("http_error", re.compile(r"HTTP \d{3}")),
    # before bad_answer: "not a lab run directory" says nothing is there, not that it is wrong
    ("no_data", re.compile(r"no snapshots|no such file|not a lab run directory")),
    ("bad_answer", re.compile(r"not a |expected a |without data|missing columns|cannot read")),
)


def source_error_reason(message: str) -> str:
    """The reason label of a source error: one of :data:`SOURCE_ERROR_REASONS`, else other."""
    for reason, pattern in SOURCE_ERROR_REASONS:
        if pattern.search(message):
            return reason
    return "other"


class OpeningSource:
    """A source named by a URL that need not answer yet: what it is (Prometheus or an exporter)
    is found at the first pull that reaches it; until then each pull fails with the reason."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url
        self.timeout = timeout
        self._source: FrameSource | None = None

    @property
    def description(self) -> str:
        return self.url if self._source is None else self._source.description

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[GpuFrame]:
        if self._source is None:
            self._source = open_source(self.url, self.timeout)
        return self._source.frames(start, end, window_seconds, hosts)


class RecommenderLike(Protocol):
    """What the service needs of a recommender (gpubalance.analyzer.recommend.Recommender)."""

    def recommend(
        self, diagnosis: Diagnosis, table: FeatureTable, now_seconds: float
    ) -> tuple[Recommendation, ...]: ...


class UnknownRecommendation(Exception):
    """An ack for an id the service does not hold (HTTP 404)."""


class ExpiredRecommendation(Exception):
    """An ack for a recommendation past its expiry (HTTP 409)."""


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """Whether the last pull of the source worked, and when one last did."""

    description: str
    up: bool | None  # None before the first pull has ended
    error: str | None  # the last pull's error; None when it worked
    last_pull_seconds: float | None  # Unix time the last pull ended
    last_success_seconds: float | None


@dataclass(frozen=True, slots=True)
class DiagnosisReport:
    """Each GPU and pool now (its latest window), and optionally the windows before."""

    generated_seconds: float  # Unix time of the cycle that made it
    window_seconds: float
    classifier: str
    source: SourceStatus
    gpus: tuple[Verdict, ...]  # one per GPU, by host then index
    fleet: tuple[FleetVerdict, ...]  # one per pool, by host then pool
    # the windows before now, oldest first (``?history=N``: up to N per GPU and per pool)
    history: tuple[Verdict, ...] = ()
    fleet_history: tuple[FleetVerdict, ...] = ()


@dataclass(frozen=True, slots=True)
class RecommendationsReport:
    """The recommendations not yet expired, cheapest first, each with its acks."""

    generated_seconds: float
    source: SourceStatus
    recommender: str | None  # None when the service runs without one
    recommendations: tuple[Recommendation, ...]


@dataclass(frozen=True, slots=True)
class Health:
    """The service's own figures, for /metrics."""

    source: SourceStatus
    source_errors: Mapping[str, int]  # reason -> failed pulls since start
    cycle_failures: Mapping[str, int]  # stage -> cycles that failed in it since start
    cycles: int
    cycle_seconds_total: float
    last_cycle_seconds: float | None


@dataclass(frozen=True, slots=True)
class _Published:
    """What one cycle found: swapped in as a whole, so that a reader never sees half a cycle.

    The last diagnosis the source gave (an old one while it is down), grouped once per cycle
    rather than on every request: each GPU's verdicts and each pool's, in time order, by host
    then GPU index or pool.
    """

    at_seconds: float
    source: SourceStatus
    gpus: tuple[tuple[Verdict, ...], ...] = ()
    pools: tuple[tuple[FleetVerdict, ...], ...] = ()
    # why this cycle judged nothing ("source down: ..."): its GPUs are unknown for that reason
    stale_reason: str | None = None

    @classmethod
    def of(cls, at_seconds: float, source: SourceStatus, diagnosis: Diagnosis) -> _Published:
        gpus: dict[tuple[str, int, str], list[Verdict]] = {}
        for verdict in diagnosis.verdicts:  # in time order already
            gpus.setdefault((verdict.host, verdict.gpu, verdict.uuid), []).append(verdict)
        pools: dict[tuple[str, str], list[FleetVerdict]] = {}
        for fleet in diagnosis.fleet:
            pools.setdefault((fleet.host, fleet.pool), []).append(fleet)
        return cls(
            at_seconds,
            source,
            tuple(tuple(v) for _, v in sorted(gpus.items())),
            tuple(tuple(f) for _, f in sorted(pools.items())),
        )


class AnalyzerService:
    """Pulls ``source`` each :meth:`cycle` and judges it with ``classifier``; ``recommender``
    (anything with :meth:`RecommenderLike.recommend`; None: no recommendations) turns the verdicts
    into recommendations. ``clock`` gives Unix seconds: creation, expiry and ack times."""

    def __init__(
        self,
        source: FrameSource,
        classifier: Classifier,
        recommender: RecommenderLike | None = None,
        window_seconds: float = 30.0,
        classifier_name: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.classifier = classifier
        self.recommender = recommender
        self.window_seconds = window_seconds
        self.classifier_name = classifier_name
        self.clock = clock
        self._published = _Published(
            clock(), SourceStatus(source.description, None, None, None, None)
        )
        # cycles run in a worker thread, acks in the server's: both write the recommendations
        self._lock = threading.Lock()
        self._recommendations: dict[str, Recommendation] = {}
        # what each acked recommendation asked when its latest ack came
        self._asked: dict[str, Mapping[str, object]] = {}
        self._source_errors: Counter[str] = Counter()
        self._cycle_failures: Counter[str] = Counter()
        self._cycles = 0
        self._cycle_seconds_total = 0.0
        self._last_cycle_seconds: float | None = None
        # the features of the last pull and the history behind them: a cycle builds only
        # the windows the last one had not made final (at fleet size a whole lookback costs
        # seconds); a service restarted rebuilds from what the source holds
        self._stream: FeatureStream | None = None
        self._table: FeatureTable | None = None
        # what the classifier said of that table's rows: the final windows' are not asked again
        self._answers: np.ndarray | None = None

    @property
    def recommender_name(self) -> str | None:
        return None if self.recommender is None else type(self.recommender).__name__

    # the cycle

    def cycle(self) -> None:
        """One pull, judgement and recommendation; errors are recorded, never raised."""
        started = time.perf_counter()
        now = self.clock()
        previous = self._published
        try:
            frames = self.source.frames(None, None, self.window_seconds)
        except Exception as exc:  # a source that is down must cost the pull, not the service
            if isinstance(exc, SourceError | ValueError):  # ValueError: a window it cannot cut
                message = str(exc)
                log.warning("source %s: %s", self.source.description, message)
            else:
                message = f"reading the source failed: {exc!r}"
                log.exception("source %s", self.source.description)
            reason = source_error_reason(message)
            status = dataclasses.replace(
                previous.source, up=False, error=message, last_pull_seconds=self.clock()
            )
            with self._lock:
                self._source_errors[reason] += 1
            stale = dataclasses.replace(
                previous, at_seconds=now, source=status, stale_reason=f"source down: {message}"
            )
            self._publish(stale, started)
            return
        status = SourceStatus(self.source.description, True, None, self.clock(), self.clock())
        table: FeatureTable | None = None
        try:
            if frames:
                table, known = self._features(frames)
                fit = getattr(self.classifier, "fit", None)
                if fit is not None and not hasattr(self.classifier, "classes_"):
                    fit(table)  # the rule baselines learn nothing: fit only sets their classes
                answering = _Answering(self.classifier, known)
                diagnosis = Verdicts(answering).diagnose(table)
                self._answers = answering.answers
            else:  # a live source without a complete window yet
                diagnosis = Diagnosis((), ())
        except Exception as exc:  # a bug must cost a cycle, not the service
            log.exception("diagnosis failed")
            # the next cycle rebuilds from the source
            self._stream = self._table = self._answers = None
            with self._lock:
                self._cycle_failures["diagnose"] += 1
            why = f"diagnosis failed: {exc!r}"
            stale = dataclasses.replace(previous, at_seconds=now, source=status, stale_reason=why)
            self._publish(stale, started)
            return
        if self.recommender is not None and table is not None:
            try:
                made = tuple(self.recommender.recommend(diagnosis, table, now))
                for item in made:
                    if not isinstance(item, Recommendation):
                        raise TypeError(f"it gave a {type(item).__name__}, not a Recommendation")
                self._keep(made, now)
            except Exception:  # the verdicts stand without this cycle's recommendations
                log.exception("the recommender failed")
                with self._lock:
                    self._cycle_failures["recommend"] += 1
        self._publish(_Published.of(now, status, diagnosis), started)

    def _features(self, frames: Sequence[GpuFrame]) -> tuple[FeatureTable, np.ndarray | None]:
        """The features of the pull: the windows an earlier cycle made final kept (the table's
        first rows), the rest built on the history the earlier cycles left; and what the
        classifier said of the kept rows (None: none kept). A pull that does not reach back to
        a final window (the first, one after an outage longer than the lookback, a source that
        went back in time) starts afresh from what the source holds, as a restart would."""
        first = min(f.t_start for f in frames)
        newest = max(f.t_start for f in frames)
        stream, kept = self._stream, self._table
        if stream is None or kept is None or not first <= stream.final_t_start <= newest:
            stream, kept = FeatureStream(), None
        final = stream.final_t_start
        parts = [stream.add(frames)]
        known = None
        if kept is not None:
            rows = [i for i, f in enumerate(kept.frames) if first <= f.t_start <= final]
            parts.insert(0, kept.take(rows))
            if self._answers is not None:
                known = self._answers[rows]
        self._stream, self._table = stream, concatenate(parts)
        return self._table, known

    def _publish(self, published: _Published, started: float) -> None:
        self._published = published
        took = time.perf_counter() - started
        with self._lock:
            self._cycles += 1
            self._cycle_seconds_total += took
            self._last_cycle_seconds = took

    def _keep(self, recommendations: Iterable[Recommendation], now: float) -> None:
        """New recommendations join; one with a known id replaces its old self, acks kept
        while it asks what they answered. Acks that it was done (applied, accepted) are
        dropped once it asks something else: it needs doing again. A rejection or a failure
        stands while the id lives, whatever it asks: an executor that undid it or refused it
        is not asked again and again as the estimates move."""
        with self._lock:
            for recommendation in recommendations:
                old = self._recommendations.get(recommendation.id)
                if old is not None and old.acks:
                    asked = self._asked.get(recommendation.id, old.parameters)
                    if all(a.status in DONE for a in old.acks) and not asks_the_same(
                        recommendation.action, asked, recommendation.parameters
                    ):
                        log.info(
                            "recommendation %s asks anew (%s): its acks answered what it asked "
                            "before",
                            recommendation.id,
                            recommendation.action,
                        )
                        self._asked.pop(recommendation.id, None)
                    else:
                        recommendation = dataclasses.replace(recommendation, acks=old.acks)
                self._recommendations[recommendation.id] = recommendation
                self._supersede(recommendation, now)
            for key, recommendation in list(self._recommendations.items()):
                if _forgotten(recommendation, now):
                    del self._recommendations[key]
                    self._asked.pop(key, None)

    def _supersede(self, recommendation: Recommendation, now: float) -> None:
        """Expire the standing recommendations of its target that it undoes: a GPU back from
        being lost is returned (``add_worker``) while the drain of its loss would stand until
        its expiry, and an executor given both would refuse both as contradictory. With the
        lock."""
        undone = UNDOES.get(recommendation.action)
        if undone is None:
            return
        for key, standing in list(self._recommendations.items()):
            if (
                standing.action == undone
                and standing.host == recommendation.host
                and standing.target == recommendation.target
                and standing.expires_seconds > now
            ):
                log.info(
                    "recommendation %s (%s %s) is superseded by %s (%s)",
                    key,
                    standing.action,
                    standing.target,
                    recommendation.id,
                    recommendation.action,
                )
                self._recommendations[key] = dataclasses.replace(standing, expires_seconds=now)

    # what the server reads

    def diagnosis(self, history: int = 0) -> DiagnosisReport:
        """Each GPU and pool now; ``history`` windows before now for each as well."""
        published = self._published
        by_gpu, by_pool = published.gpus, published.pools
        down = published.stale_reason is not None
        if down:
            # what the source said before is history; now is unknown, with the reason
            gpus = tuple(self._source_down(v[-1], published) for v in by_gpu)
            fleet = tuple(self._pool_down(f[-1], published) for f in by_pool)
        else:
            gpus = tuple(v[-1] for v in by_gpu)
            fleet = tuple(f[-1] for f in by_pool)
        past: list[Verdict] = []
        past_fleet: list[FleetVerdict] = []
        if history > 0:
            for verdicts in by_gpu:
                past.extend((verdicts if down else verdicts[:-1])[-history:])
            for fleets in by_pool:
                past_fleet.extend((fleets if down else fleets[:-1])[-history:])
        past.sort(key=lambda v: (v.t_start, v.host, v.gpu))
        past_fleet.sort(key=lambda f: (f.t_start, f.host, f.pool))
        return DiagnosisReport(
            generated_seconds=published.at_seconds,
            window_seconds=self.window_seconds,
            classifier=self.classifier_name,
            source=published.source,
            gpus=gpus,
            fleet=fleet,
            history=tuple(past),
            fleet_history=tuple(past_fleet),
        )

    def _source_down(self, last: Verdict, published: _Published) -> Verdict:
        reason = str(published.stale_reason)
        return Verdict(
            host=last.host,
            gpu=last.gpu,
            uuid=last.uuid,
            t_start=last.t_end,
            t_end=max(last.t_end, published.at_seconds),
            state="unknown",
            cause="none",
            confidence=1.0,
            evidence=(
                f"{reason}; the last verdict, {last.state}/{last.cause}, is for the window "
                f"that ended at {_clock(last.t_end)}",
            ),
            unknown_reason=reason,
            pool=last.pool,
        )

    def _pool_down(self, last: FleetVerdict, published: _Published) -> FleetVerdict:
        return FleetVerdict(
            host=last.host,
            pool=last.pool,
            t_start=last.t_end,
            t_end=max(last.t_end, published.at_seconds),
            kind="unknown",
            gpus=last.gpus,
            idle_while_queued_ratio=None,
            evidence=(str(published.stale_reason),),
        )

    def recommendations(self) -> RecommendationsReport:
        """The recommendations not expired now, cheapest first, then the surest."""
        now = self.clock()
        with self._lock:
            live = [r for r in self._recommendations.values() if r.expires_seconds > now]
        live.sort(key=lambda r: (r.cost_rank, -r.confidence, r.id))
        published = self._published
        return RecommendationsReport(
            generated_seconds=published.at_seconds,
            source=published.source,
            recommender=self.recommender_name,
            recommendations=tuple(live),
        )

    def ack(
        self, recommendation_id: str, status: AckStatus, reason: str, by: str
    ) -> Recommendation:
        """Record an executor's answer; the recommendation with every ack so far."""
        now = self.clock()
        with self._lock:
            recommendation = self._recommendations.get(recommendation_id)
            if recommendation is None or _forgotten(recommendation, now):
                raise UnknownRecommendation(
                    f"no recommendation {recommendation_id!r}: never made, or expired more "
                    f"than {EXPIRED_KEPT_SECONDS:.0f} s ago"
                )
            if recommendation.expires_seconds <= now:
                raise ExpiredRecommendation(
                    f"recommendation {recommendation_id!r} expired at "
                    f"{_clock(recommendation.expires_seconds)}, "
                    f"{now - recommendation.expires_seconds:.0f} s ago; act on a current one "
                    "(GET /api/v1/recommendations)"
                )
            recommendation = dataclasses.replace(
                recommendation, acks=(*recommendation.acks, Ack(status, reason, by, now))
            )
            self._recommendations[recommendation_id] = recommendation
            self._asked[recommendation_id] = recommendation.parameters
        log.info("recommendation %s %s by %s: %s", recommendation_id, status, by, reason)
        return recommendation

    def health(self) -> Health:
        with self._lock:
            return Health(
                source=self._published.source,
                source_errors=dict(self._source_errors),
                cycle_failures=dict(self._cycle_failures),
                cycles=self._cycles,
                cycle_seconds_total=self._cycle_seconds_total,
                last_cycle_seconds=self._last_cycle_seconds,
            )


class _Answering:
    """The service's classifier asked only of the rows no earlier cycle answered: a cycle's
    table starts with the windows the last cycle made final, ``known`` what the classifier
    said of them then (a classifier answers each row from that row's features, and a final
    window's features do not change). At a fleet's size the classifier's trees are most of a
    cycle's verdicts: 160,000 GPU-windows of lookback asked again every cycle."""

    def __init__(self, classifier: Classifier, known: np.ndarray | None) -> None:
        self.classifier = classifier
        self.classes_ = classifier.classes_
        self.known = known
        self.answers: np.ndarray | None = None

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        ask = asked_of(self.classifier)  # what Verdicts would ask of the classifier itself
        done = 0 if self.known is None else len(self.known)
        if done == 0:
            self.answers = np.asarray(ask(table), dtype=np.float64)
        elif done == len(table.frames):
            self.answers = self.known
        else:
            rest = FeatureTable(table.frames[done:], table.values[done:], table.columns)
            self.answers = np.concatenate([self.known, np.asarray(ask(rest), dtype=np.float64)])
        return self.answers


def asks_the_same(action: str, before: Mapping[str, object], now: Mapping[str, object]) -> bool:
    """Whether a recommendation's parameters ``now`` ask what they asked ``before``: the same
    values, a set_weights' shares within :data:`RESHARE_RATIO` of each other (or
    :data:`RESHARE_MIN` of the pool) on the same workers."""
    if action != "set_weights":
        return before == now
    old, new = _shares(before), _shares(now)
    if old is None or new is None or old.keys() != new.keys():
        return before == now
    return all(
        abs(new[k] - old[k]) <= max(RESHARE_MIN, RESHARE_RATIO * max(old[k], new[k])) for k in old
    )


def _shares(parameters: Mapping[str, object]) -> dict[tuple[object, object], float] | None:
    """A set_weights' shares by (GPU, worker); None when they are not that shape."""
    items = parameters.get("weights")
    if not isinstance(items, list):
        return None
    out: dict[tuple[object, object], float] = {}
    for item in items:
        if not isinstance(item, Mapping) or not isinstance(item.get("weight"), int | float):
            return None
        out[(item.get("gpu"), item.get("worker"))] = float(item["weight"])
    return out


def _forgotten(recommendation: Recommendation, now: float) -> bool:
    return recommendation.expires_seconds + EXPIRED_KEPT_SECONDS <= now


def _clock(t: float) -> str:
    """A Unix time as a UTC clock time; a lab CSV's seconds since its start as such."""
    if t < 10**8:
        return f"{t:.0f} s"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
