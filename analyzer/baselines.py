"""Two rule classifiers: what an SRE gets today, and the plainest rule that reads the queue.

Both follow scikit-learn's classifier contract over a :class:`FeatureTable` (``fit`` returns
``self``, ``predict`` / ``predict_proba`` with columns in ``classes_`` order), so the verdict
step takes them, or the learned model, alike. Their classes are joint labels ``"state/cause"``
(``"overloaded/routing_skew"``, ``"balanced/none"``); ``"unknown/none"`` is the answer when the
figures a rule reads are missing.

A rule's probabilities come from its thresholds: each comparison ``x >= t`` is true to the
degree ``logistic((x - t) / scale)``, "and" is the least of its parts, "or" the largest. At a
threshold a rule is 50 % sure, one ``scale`` past it 73 %, three past it 95 %; the most probable
class is always the one the rule's comparisons pick.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

import numpy as np

from gpubalance.analyzer.features import FeatureTable
from gpubalance.diagnosis import CAUSES_OF, STATES, Cause, State

UNKNOWN = "unknown/none"
# every joint label a classifier may have in classes_: the ground truth's pairs, and each state
# with cause "none" for a classifier that names no cause (a utilization alert)
LABELS: tuple[str, ...] = tuple(
    f"{s}/{c}" for s in STATES for c in dict.fromkeys((*CAUSES_OF[s], "none"))
)


def joint_label(state: State, cause: Cause) -> str:
    return f"{state}/{cause}"


def split_label(label: str) -> tuple[State, Cause]:
    """``"starved/host_bound"`` -> ``("starved", "host_bound")``; ValueError if not a label."""
    if label not in LABELS:
        raise ValueError(
            f"not a verdict label: {label!r} (expected state/cause, e.g. balanced/none)"
        )
    state, cause = label.split("/")
    return state, cause  # type: ignore[return-value]


def _at_least(values: np.ndarray, threshold: float, scale: float) -> np.ndarray:
    """How true ``values >= threshold`` is, 0..1; NaN stays NaN (the figure is unknown)."""
    # the nudge makes a value exactly at the threshold count as past it, as >= does
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-((values - threshold) / scale + 1e-9)))


def _below(values: np.ndarray, threshold: float, scale: float) -> np.ndarray:
    return 1.0 - _at_least(values, threshold, scale)


def _known(truth: np.ndarray) -> np.ndarray:
    """An unknown figure makes its comparison false (0), never a guess either way."""
    return np.nan_to_num(truth, nan=0.0)


class _RuleClassifier(abc.ABC):
    """The classifier contract both rules share; a subclass says which states and causes."""

    @abc.abstractmethod
    def _rule_labels(self) -> tuple[str, ...]:
        """Every label the rule can answer."""

    @abc.abstractmethod
    def _judge(
        self, table: FeatureTable
    ) -> tuple[dict[State, np.ndarray], dict[State, np.ndarray]]:
        """Per state its truth 0..1 (``unknown``: 1 where the rule cannot judge) and per state
        the cause each row gets (an array of cause names)."""

    def fit(self, table: FeatureTable, labels: Sequence[str] | None = None) -> _RuleClassifier:
        """Nothing to learn; checks the labels if given (one joint label per row)."""
        if labels is not None:
            if len(labels) != len(table.frames):
                raise ValueError(f"{len(labels)} labels for {len(table.frames)} rows")
            for label in set(labels):
                split_label(label)
        self.classes_ = np.array(sorted(self._rule_labels()))
        return self

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        if not hasattr(self, "classes_"):
            # scikit-learn's own error, imported here: a command that never fits a model
            # starts without loading scikit-learn
            from sklearn.exceptions import NotFittedError

            raise NotFittedError(f"{type(self).__name__} is not fitted yet: call fit first")
        truth, causes = self._judge(table)
        unknown = truth.pop("unknown", np.zeros(len(table.frames)))
        over = truth["overloaded"]
        starved = np.minimum(1.0 - over, truth["starved"])
        balanced = np.minimum(1.0 - over, 1.0 - truth["starved"])
        states: dict[State, np.ndarray] = {
            "overloaded": over,
            "starved": starved,
            "balanced": balanced,
        }
        total = over + starved + balanced
        out = np.zeros((len(table.frames), len(self.classes_)))
        index = {label: i for i, label in enumerate(self.classes_)}
        for state, share in states.items():
            for cause in set(causes[state].tolist()):
                rows = causes[state] == cause
                column = index[joint_label(state, cause)]
                out[rows, column] = share[rows] / total[rows] * (1.0 - unknown[rows])
        if UNKNOWN in index:
            out[:, index[UNKNOWN]] += unknown
        return out

    def predict(self, table: FeatureTable) -> np.ndarray:
        proba = self.predict_proba(table)
        return self.classes_[np.argmax(proba, axis=1)]


class UtilizationThreshold(_RuleClassifier):
    """What a DCGM alert says: starved below 30 % utilization, overloaded above 90 %.

    Such an alert knows no cause: a starved GPU reads ``low_demand``, an overloaded one
    ``none``. NVML utilization counts any kernel running, so a GPU serving a trickle of
    small batches reads busy: this is the baseline that calls a healthy server overloaded.
    """

    def __init__(
        self,
        starved_below_ratio: float = 0.30,
        overloaded_above_ratio: float = 0.90,
        scale_ratio: float = 0.05,
    ) -> None:
        self.starved_below_ratio = starved_below_ratio
        self.overloaded_above_ratio = overloaded_above_ratio
        self.scale_ratio = scale_ratio

    def _rule_labels(self) -> tuple[str, ...]:
        return ("starved/low_demand", "overloaded/none", "balanced/none", UNKNOWN)

    def _judge(
        self, table: FeatureTable
    ) -> tuple[dict[State, np.ndarray], dict[State, np.ndarray]]:
        utilization = table.column("utilization_ratio")
        n = len(utilization)
        truth: dict[State, np.ndarray] = {
            "overloaded": _known(
                _at_least(utilization, self.overloaded_above_ratio, self.scale_ratio)
            ),
            "starved": _known(_below(utilization, self.starved_below_ratio, self.scale_ratio)),
            "unknown": np.isnan(utilization).astype(float),
        }
        causes: dict[State, np.ndarray] = {
            "overloaded": np.full(n, "none", dtype=object),
            "starved": np.full(n, "low_demand", dtype=object),
            "balanced": np.full(n, "none", dtype=object),
        }
        return truth, causes


class QueueUtilization(_RuleClassifier):
    """Overloaded when work waits and the GPU is busy; starved when it idles or idles while a
    peer's work waits.

    The thresholds, from what the figures mean rather than from any scenario:

    - ``overloaded_queue_batches`` = 1: a whole batch waiting on average means requests arrive
      faster than the GPU starts them; less is the normal wait for the next batch to begin.
    - ``busy_ratio`` = 0.9: with a backlog a work-conserving GPU never idles, so it must read
      busy nearly all the window (the bar a DCGM alert uses too); a backlog on an idle GPU is
      held by something else (its batcher, its host).
    - ``starved_below_ratio`` = 0.3: busy less than a third of the window, the DCGM alert's
      low bar.
    - ``idle_while_peer_queued_ratio`` = 0.5: at least half its capacity (time idle, plus the
      empty slots of the batches it ran) unused while a peer holds half a batch or more: work
      could have come here.

    Causes, where the figures are plain: overloaded is ``memory_pressure`` when KV allocations
    fail, ``throttling`` when the clock runs at 90 % of its maximum or less with a slowdown
    reason half the window, ``capacity_shortage`` when every GPU of its pool has work waiting,
    otherwise ``routing_skew``; starved is ``host_bound`` when its feeding process is pinned at
    whole cores, ``io_bound`` when the host waits on IO half the window, ``routing_skew`` when a
    peer holds queued work, otherwise ``low_demand``. Without queue figures the rule can only
    say starved (by utilization); anything busier is ``unknown``.
    """

    def __init__(
        self,
        overloaded_queue_batches: float = 1.0,
        busy_ratio: float = 0.90,
        starved_below_ratio: float = 0.30,
        idle_while_peer_queued_ratio: float = 0.5,
        queue_scale_batches: float = 0.25,
        scale_ratio: float = 0.05,
    ) -> None:
        self.overloaded_queue_batches = overloaded_queue_batches
        self.busy_ratio = busy_ratio
        self.starved_below_ratio = starved_below_ratio
        self.idle_while_peer_queued_ratio = idle_while_peer_queued_ratio
        self.queue_scale_batches = queue_scale_batches
        self.scale_ratio = scale_ratio

    def _rule_labels(self) -> tuple[str, ...]:
        return (
            "overloaded/throttling",
            "overloaded/memory_pressure",
            "overloaded/capacity_shortage",
            "overloaded/routing_skew",
            "starved/host_bound",
            "starved/io_bound",
            "starved/routing_skew",
            "starved/low_demand",
            "balanced/none",
            UNKNOWN,
        )

    def _judge(
        self, table: FeatureTable
    ) -> tuple[dict[State, np.ndarray], dict[State, np.ndarray]]:
        column = table.column
        utilization = column("utilization_ratio")
        queue = column("queue_batches")
        n = len(utilization)
        over = np.minimum(
            _known(_at_least(queue, self.overloaded_queue_batches, self.queue_scale_batches)),
            _known(_at_least(utilization, self.busy_ratio, self.scale_ratio)),
        )
        starved = np.maximum(
            _known(_below(utilization, self.starved_below_ratio, self.scale_ratio)),
            _known(
                _at_least(
                    column("idle_while_peer_queued"),
                    self.idle_while_peer_queued_ratio,
                    self.scale_ratio,
                )
            ),
        )
        # no utilization, or no queue on a GPU busy enough that only the queue could tell
        unknown = np.isnan(utilization) | (np.isnan(queue) & (starved <= 0.5))
        truth: dict[State, np.ndarray] = {
            "overloaded": over,
            "starved": starved,
            "unknown": unknown.astype(float),
        }
        overloaded_cause = np.select(
            [
                column("allocation_failures_per_completion") > 0,
                (column("clock_ratio") <= 0.90) & (column("throttled_ratio") >= 0.5),
                column("pool_busy_share") >= 1.0,
            ],
            ["memory_pressure", "throttling", "capacity_shortage"],
            "routing_skew",
        )
        starved_cause = np.select(
            [
                column("feeder_cpu_pinned") >= 0.5,
                (column("host_io_pressure_ratio") >= 0.5),
                column("peer_queue_max_batches") >= 0.5,
            ],
            ["host_bound", "io_bound", "routing_skew"],
            "low_demand",
        )
        causes: dict[State, np.ndarray] = {
            "overloaded": overloaded_cause.astype(object),
            "starved": starved_cause.astype(object),
            "balanced": np.full(n, "none", dtype=object),
        }
        return truth, causes


CLASSIFIERS: Mapping[str, type[_RuleClassifier]] = {
    "baseline-threshold": UtilizationThreshold,
    "baseline-queue": QueueUtilization,
}
