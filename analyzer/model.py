"""The learned part: a classifier from a GPU's features to its joint label "state/cause".

Gradient-boosted trees (scikit-learn's HistGradientBoostingClassifier: NaN-aware, so "the
telemetry does not say" stays a value of its own) over :data:`~gpubalance.analyzer.features.
COLUMNS`. By default in two steps, as the ground truth decides: the state (from the GPU's load
against its capacity), then the cause given the state, each step with balanced class weights
so that a rare cause is not drowned by a common one; p(state/cause) = p(state) p(cause | state).
Where the figures name a cause directly (:mod:`gpubalance.analyzer.causes`: a pinned feeder,
IO pressure, a batcher idling the GPU, allocation failures), that cause takes
its state's whole probability; the learned causes decide only where no such figure does.

Persisted with skops, never pickle: loading a pickle runs code, loading a skops file
only rebuilds the types it lists, and :func:`load` refuses any type outside scikit-learn and
numpy, and any file written for other feature columns or another format version. Each
estimator's trees (2,250 in the shipped model) are written as a few arrays of all their nodes
rather than three small arrays a tree, which skops reads one file and one header at a time:
the shipped model's read took 1.7 CPU seconds that way, 0.06 s packed (median of 5, one core).
"""

from __future__ import annotations

import copy
import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from gpubalance.analyzer import causes
from gpubalance.analyzer.features import COLUMNS, FeatureTable

FORMAT = "gpubalance.analyzer.model/v3"
# the model gpubalance ships, trained on the lab's generated families by `make model`; the
# analyzer's default classifier (its report, beside it, says on what and how well)
SHIPPED = Path(__file__).parent / "models" / "default.skops"
# rows the trees walk at a time (see GpuStateClassifier._learned_proba): few enough that a
# block's features (8,192 x 64 columns, 4 MB) stay in the processor's cache, many enough that
# a tree's call costs little per row; the fleet bench's 160,000 rows, the shipped model's
# predictions in CPU seconds on an AMD EPYC VM (median of 3, one core): 10.2 in blocks of
# 1,024, 8.0 of 2,048, 6.3 of 4,096, 5.9 of 8,192, 6.4 of 16,384
BLOCK_ROWS = 8192
# below this probability a state's causes are not asked of their trees: the likeliest of the
# three states has at least a third, and the likeliest label at least a third over a state's
# causes (six at most), well above a share of this spread over them
NEGLIGIBLE_STATE = 0.01
# states this close to a row's likeliest count as likeliest too (see predict_likeliest_proba):
# the verdict sums a state's labels again, which can reorder two equal states by an ulp
LIKELIEST_TIE = 1e-9


class ModelError(Exception):
    """A model file that cannot be used; the message says why."""


class GpuStateClassifier:
    """Joint "state/cause" labels from a :class:`FeatureTable` (scikit-learn estimator style)."""

    def __init__(
        self,
        max_iter: int = 150,
        learning_rate: float = 0.05,
        max_leaf_nodes: int = 15,
        min_samples_leaf: int = 50,
        l2_regularization: float = 1.0,
        class_weight: str | None = "balanced",
        random_state: int = 0,
        hierarchy: bool = True,
        named_causes: bool = True,
    ) -> None:
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.max_leaf_nodes = max_leaf_nodes
        self.min_samples_leaf = min_samples_leaf
        self.l2_regularization = l2_regularization
        self.class_weight = class_weight
        self.random_state = random_state
        self.hierarchy = hierarchy
        # causes the figures name directly (analyzer/causes.py) decide over the learned ones
        self.named_causes = named_causes

    def get_params(self) -> dict[str, Any]:
        return {
            "max_iter": self.max_iter,
            "learning_rate": self.learning_rate,
            "max_leaf_nodes": self.max_leaf_nodes,
            "min_samples_leaf": self.min_samples_leaf,
            "l2_regularization": self.l2_regularization,
            "class_weight": self.class_weight,
            "random_state": self.random_state,
            "hierarchy": self.hierarchy,
            "named_causes": self.named_causes,
        }

    def _estimator(self) -> Any:
        from sklearn.ensemble import HistGradientBoostingClassifier

        return HistGradientBoostingClassifier(
            max_iter=self.max_iter,
            learning_rate=self.learning_rate,
            max_leaf_nodes=self.max_leaf_nodes,
            min_samples_leaf=self.min_samples_leaf,
            l2_regularization=self.l2_regularization,
            class_weight=self.class_weight,
            early_stopping=False,
            random_state=self.random_state,
        )

    def fit(self, table: FeatureTable, labels: Sequence[str]) -> GpuStateClassifier:
        if table.columns != COLUMNS:
            raise ValueError("the table's columns are not this version's feature columns")
        if len(labels) != len(table.frames):
            raise ValueError(f"{len(labels)} labels for {len(table.frames)} rows")
        joint = np.asarray(labels)
        self.cause_estimators_: dict[str, Any] = {}
        # states with one cause in the data: that cause, with no estimator
        self.only_cause_: dict[str, str] = {}
        if self.hierarchy:
            states = np.asarray([label.split("/", 1)[0] for label in labels])
            self.estimator_ = _fit(self._estimator(), table.values, states)
            for state in self.estimator_.classes_:
                mine = states == state
                causes = joint[mine]
                if len(set(causes)) == 1:
                    self.only_cause_[str(state)] = str(causes[0])
                else:
                    self.cause_estimators_[str(state)] = _fit(
                        self._estimator(), table.values[mine], causes
                    )
            self.classes_ = np.asarray(sorted(set(joint)))
        else:
            self.estimator_ = _fit(self._estimator(), table.values, joint)
            self.classes_ = self.estimator_.classes_
        self.feature_names_in_ = np.asarray(COLUMNS)
        self.n_features_in_ = len(COLUMNS)
        return self

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        return self._proba(table, likeliest_only=False)

    def predict_likeliest_proba(self, table: FeatureTable) -> np.ndarray:
        """As :meth:`predict_proba`, but only each row's likeliest state has its causes asked
        of their trees; the others' probability is spread evenly over their causes. Each
        state's probability and the likeliest state's causes are the same: all a verdict reads
        (:class:`~gpubalance.analyzer.verdict.Verdicts` asks this where a classifier has it),
        for about half the trees' work on a fleet (a balanced row asks no cause tree at all)."""
        return self._proba(table, likeliest_only=True)

    def _proba(self, table: FeatureTable, likeliest_only: bool) -> np.ndarray:
        self._check(table)
        if not len(table.frames):
            return np.zeros((0, len(self.classes_)))
        # one thread: the trees' OpenMP threads spin while they wait for each other, and on a
        # host whose cores are busy (a serving host's feeders, the lab's runs) an 8-row
        # prediction took over 10 s on two threads of this 2-core machine, 12 ms on one
        with threadpool_limits(limits=1):
            learned = self._learned_proba(table, likeliest_only)
        return causes.apply(learned, self.classes_, table) if self.named_causes else learned

    def _learned_proba(self, table: FeatureTable, likeliest_only: bool) -> np.ndarray:
        out = np.empty((len(table.frames), len(self.classes_)))
        # a block of rows at a time: each tree walks a block that stays in the cache, where a
        # table of 160,000 rows (80 MB) read from memory by every tree made the shipped model's
        # trees three times slower (30 CPU seconds against 9 on one core)
        for start in range(0, len(out), BLOCK_ROWS):
            block = table.values[start : start + BLOCK_ROWS]
            out[start : start + len(block)] = self._block_proba(block, likeliest_only)
        return out

    def _block_proba(self, values: np.ndarray, likeliest_only: bool) -> np.ndarray:
        if not self.hierarchy:
            return self.estimator_.predict_proba(values)
        column = {label: i for i, label in enumerate(self.classes_)}
        out = np.zeros((len(values), len(self.classes_)))
        states = self.estimator_.predict_proba(values)
        floor = np.full(len(values), NEGLIGIBLE_STATE)
        if likeliest_only:
            floor = np.maximum(floor, states.max(axis=1) - LIKELIEST_TIE)
        for j, state in enumerate(self.estimator_.classes_):
            p_state = states[:, j]
            if state in self.only_cause_:
                out[:, column[self.only_cause_[state]]] += p_state
                continue
            cause = self.cause_estimators_[state]
            mine = [column[label] for label in cause.classes_]
            # a state below the floor has its share spread evenly over its causes rather than
            # asked of their trees (about half the work): under NEGLIGIBLE_STATE it is not the
            # row's likeliest, whose causes are all a verdict reads, and none of its labels can
            # be the likeliest label (predict's); for a verdict alone, the floor is the
            # likeliest state's probability
            asked = p_state >= floor
            spread = ~asked
            out[np.ix_(spread, mine)] = (p_state[spread] / len(mine))[:, None]
            if asked.any():
                given = cause.predict_proba(values[asked])
                out[np.ix_(asked, mine)] = p_state[asked, None] * given
        return out

    def predict(self, table: FeatureTable) -> np.ndarray:
        proba = self.predict_proba(table)
        return self.classes_[np.argmax(proba, axis=1)] if len(proba) else np.asarray([], str)

    def _check(self, table: FeatureTable) -> None:
        if not hasattr(self, "estimator_"):
            raise ModelError("the classifier is not fitted")
        if tuple(self.feature_names_in_) != table.columns:
            raise ModelError("the table's feature columns differ from the model's")


def _fit(estimator: Any, values: np.ndarray, labels: np.ndarray) -> Any:
    # a column the training rows never know (per-class durations on servers with one class)
    # cannot be binned; as a constant it splits nothing, whatever later rows hold
    unknown = np.isnan(values).all(axis=0)
    if unknown.any():
        values = values.copy()
        values[:, unknown] = 0.0
    # one thread, as for predictions: on data of this size the trees' OpenMP threads cost more
    # in waiting for each other than they give (a small training: 18 s on one thread, 130 s on
    # two, on a loaded 2-core host); the folds of an evaluation run one per core instead
    with threadpool_limits(limits=1):
        return estimator.fit(values, labels)


@dataclass(frozen=True, slots=True)
class SavedModel:
    classifier: GpuStateClassifier
    report: dict[str, Any]


def save(path: Path, classifier: GpuStateClassifier, report: dict[str, Any]) -> None:
    """Write the fitted estimator (skops) and, beside it, its report (JSON)."""
    import skops.io as sio

    if not hasattr(classifier, "estimator_"):
        raise ModelError("the classifier is not fitted")
    header = {
        "format": FORMAT,
        "columns": list(COLUMNS),
        "params": classifier.get_params(),
        "only_cause": classifier.only_cause_,
    }
    given_state = classifier.cause_estimators_
    sio.dump(
        {
            "header": json.dumps(header),
            "estimator": _without_trees(classifier.estimator_),
            "trees": _packed_trees(classifier.estimator_),
            "causes": {state: _without_trees(e) for state, e in given_state.items()},
            "cause_trees": {state: _packed_trees(e) for state, e in given_state.items()},
        },
        path,
        compression=zipfile.ZIP_DEFLATED,
        compresslevel=9,
    )
    path.with_suffix(".report.json").write_text(
        json.dumps({**header, **report}, indent=2, sort_keys=True) + "\n"
    )


def load_shipped() -> GpuStateClassifier:
    """The model gpubalance ships (:data:`SHIPPED`)."""
    if not SHIPPED.is_file():
        raise ModelError(f"{SHIPPED}: the shipped model is missing; `make model` trains it")
    return load(SHIPPED)


def _types_named_in(path: Path) -> set[str]:
    """Every ``module.class`` a skops file's schema names: read from its schema.json alone,
    a fraction of the time skops' own audit takes over a forest of trees."""
    try:
        with zipfile.ZipFile(path) as archive:
            schema = json.loads(archive.read("schema.json"))
    except (zipfile.BadZipFile, KeyError, OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a gpubalance model file ({exc})") from None
    types: set[str] = set()
    nodes: list[object] = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            module, name = node.get("__module__"), node.get("__class__")
            if isinstance(module, str) and isinstance(name, str):
                types.add(f"{module}.{name}")
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
    return types


def load(path: Path) -> GpuStateClassifier:
    """Read a model written by :func:`save`; refuse anything else, executing nothing."""
    import skops.io as sio

    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    types = _types_named_in(path)
    allowed = sorted(t for t in types if t.startswith(("sklearn.", "numpy.")))
    refused = sorted(t for t in types - set(allowed) if not t.startswith("builtins."))
    if refused:
        raise ModelError(f"{path}: holds types a gpubalance model never does: {', '.join(refused)}")
    try:
        # skops checks every type against this list (and its own safe builtins) as it loads:
        # anything else, a builtins function included, is refused before it is created
        content = sio.load(path, trusted=allowed)
        header = json.loads(content["header"])
    except Exception as exc:
        raise ModelError(f"{path}: not a gpubalance model file ({exc})") from None
    if header.get("format") != FORMAT:
        raise ModelError(
            f"{path}: model format {header.get('format')!r}, this gpubalance reads {FORMAT!r}; "
            "retrain it with `gpubalance analyzer train`"
        )
    if tuple(header.get("columns", ())) != COLUMNS:
        raise ModelError(
            f"{path}: trained on other feature columns than this gpubalance computes; "
            "retrain it with `gpubalance analyzer train`"
        )
    try:
        estimator = _with_trees(content["estimator"], content["trees"])
        causes = {
            state: _with_trees(e, content["cause_trees"][state])
            for state, e in content["causes"].items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{path}: not a gpubalance model file ({exc})") from None
    classifier = GpuStateClassifier(**header["params"])
    classifier.estimator_ = estimator
    classifier.cause_estimators_ = dict(causes)
    classifier.only_cause_ = dict(header.get("only_cause", {}))
    if classifier.hierarchy:
        joint = set(classifier.only_cause_.values())
        for cause in causes.values():
            joint |= {str(c) for c in cause.classes_}
        classifier.classes_ = np.asarray(sorted(joint))
    else:
        classifier.classes_ = estimator.classes_
    classifier.feature_names_in_ = np.asarray(COLUMNS)
    classifier.n_features_in_ = len(COLUMNS)
    return classifier


# a fitted HistGradientBoostingClassifier keeps its trees as a list (per iteration) of lists
# (per class) of TreePredictor(nodes, binned_left_cat_bitsets, raw_left_cat_bitsets): what
# _packed_trees writes and _with_trees rebuilds (scikit-learn's own types, arrays as views)
_TREE_PARTS = ("nodes", "binned_left_cat_bitsets", "raw_left_cat_bitsets")


def _without_trees(estimator: Any) -> Any:
    stripped = copy.copy(estimator)
    stripped._predictors = []
    return stripped


def _packed_trees(estimator: Any) -> dict[str, np.ndarray]:
    """Every tree's three arrays, each part concatenated over the trees in order, and where
    each tree's part ends (``{part}_ends``)."""
    trees = [tree for iteration in estimator._predictors for tree in iteration]
    packed: dict[str, np.ndarray] = {}
    for part in _TREE_PARTS:
        arrays = [getattr(tree, part) for tree in trees]
        packed[part] = np.concatenate(arrays)
        packed[f"{part}_ends"] = np.cumsum([len(a) for a in arrays], dtype=np.int64)
    return packed


def _with_trees(estimator: Any, packed: dict[str, np.ndarray]) -> Any:
    """``estimator`` (written without its trees) with the trees ``packed`` holds."""
    from sklearn.ensemble._hist_gradient_boosting.common import PREDICTOR_RECORD_DTYPE
    from sklearn.ensemble._hist_gradient_boosting.predictor import TreePredictor

    if packed["nodes"].dtype != PREDICTOR_RECORD_DTYPE:
        raise ValueError("tree nodes of another scikit-learn's layout; retrain the model")
    per_iteration = int(estimator.n_trees_per_iteration_)
    parts: list[list[np.ndarray]] = []
    for part in _TREE_PARTS:
        values, ends = packed[part], packed[f"{part}_ends"]
        if len(ends) and (np.any(np.diff(ends) < 0) or ends[0] < 0 or ends[-1] != len(values)):
            raise ValueError(f"the trees' {part} do not add up")
        parts.append(np.split(values, ends[:-1]))
    count = len(parts[0])
    if any(len(p) != count for p in parts) or count % per_iteration:
        raise ValueError(f"{count} trees for {per_iteration} a boosting iteration")
    trees = [TreePredictor(*arrays) for arrays in zip(*parts, strict=True)]
    estimator._predictors = [trees[i : i + per_iteration] for i in range(0, count, per_iteration)]
    return estimator
