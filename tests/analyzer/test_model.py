"""The learned classifier: trained on lab runs, saved without pickle, refused when foreign."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import yaml

from gpubalance.analyzer import causes, model
from gpubalance.analyzer.features import FeatureTable
from gpubalance.analyzer.model import GpuStateClassifier, ModelError
from gpubalance.analyzer.train import Dataset, Example, build_dataset, cross_validate, scores
from gpubalance.analyzer.verdict import Verdicts
from gpubalance.lab import scenario

NAMES = ("skewed-heterogeneous", "balanced-4x4090", "overprovisioned-fleet")


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    examples = [
        Example(name, name, yaml.safe_load(scenario.scenario_path(name).read_text()), 1, 240.0)
        for name in NAMES
    ]
    return build_dataset(examples, workers=1)


def test_every_window_with_a_truth_is_labelled(dataset: Dataset) -> None:
    assert len(dataset) == len(dataset.table.frames) == dataset.table.values.shape[0]
    assert set(dataset.groups) == set(NAMES)
    assert "starved/routing_skew" in dataset.labels and "balanced/none" in dataset.labels


def test_the_same_seed_gives_the_same_model(dataset: Dataset) -> None:
    a = GpuStateClassifier(max_iter=20, random_state=3).fit(dataset.table, dataset.labels)
    b = GpuStateClassifier(max_iter=20, random_state=3).fit(dataset.table, dataset.labels)
    assert np.array_equal(a.predict_proba(dataset.table), b.predict_proba(dataset.table))


def test_a_saved_model_loads_and_predicts_the_same(dataset: Dataset, tmp_path: Path) -> None:
    fitted = GpuStateClassifier(max_iter=20).fit(dataset.table, dataset.labels)
    path = tmp_path / "model.skops"
    model.save(path, fitted, {"data": "three shipped scenarios"})
    loaded = model.load(path)
    assert list(loaded.classes_) == list(fitted.classes_)
    assert np.array_equal(loaded.predict_proba(dataset.table), fitted.predict_proba(dataset.table))
    report = json.loads(path.with_suffix(".report.json").read_text())
    assert report["format"] == model.FORMAT and report["data"] == "three shipped scenarios"


def test_a_pickle_is_refused_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "model.skops"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (Path.touch, (str(marker),))  # type: ignore[return-value]

    path.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ModelError, match="not a gpubalance model file"):
        model.load(path)
    assert not marker.exists()


def test_a_skops_file_of_other_types_is_refused_naming_them(tmp_path: Path) -> None:
    import fractions

    import skops.io as sio

    path = tmp_path / "model.skops"
    header = json.dumps({"format": model.FORMAT})
    sio.dump({"header": header, "estimator": fractions.Fraction(1, 3)}, path)
    with pytest.raises(ModelError, match=r"never does: fractions\.Fraction$"):
        model.load(path)
    # a builtin function is not one of skops' safe builtins: skops refuses it as it loads
    sio.dump({"header": header, "estimator": eval}, path)
    with pytest.raises(ModelError, match=r"not a gpubalance model file .*builtins\.eval"):
        model.load(path)
    path.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip: no schema
    with pytest.raises(ModelError, match="not a gpubalance model file"):
        model.load(path)


def test_a_model_of_other_columns_is_refused(dataset: Dataset, tmp_path: Path) -> None:
    import skops.io as sio

    fitted = GpuStateClassifier(max_iter=5).fit(dataset.table, dataset.labels)
    path = tmp_path / "old.skops"
    header = {"format": model.FORMAT, "columns": ["utilization_ratio"], "params": {}}
    sio.dump({"header": json.dumps(header), "estimator": fitted.estimator_}, path)
    with pytest.raises(ModelError, match="other feature columns"):
        model.load(path)
    header = {"format": "gpubalance.analyzer.model/v0", "columns": [], "params": {}}
    sio.dump({"header": json.dumps(header), "estimator": fitted.estimator_}, path)
    with pytest.raises(ModelError, match="retrain it"):
        model.load(path)


def test_a_model_whose_trees_do_not_add_up_is_refused(dataset: Dataset, tmp_path: Path) -> None:
    import skops.io as sio

    fitted = GpuStateClassifier(max_iter=5).fit(dataset.table, dataset.labels)
    path = tmp_path / "model.skops"
    model.save(path, fitted, {})
    content = sio.load(path, trusted=sio.get_untrusted_types(file=path))
    ends = content["trees"]["nodes_ends"]
    content["trees"]["nodes_ends"] = ends[:-1]  # the last tree's nodes belong to none
    sio.dump(content, path)
    with pytest.raises(ModelError, match="the trees' nodes do not add up"):
        model.load(path)
    content["trees"]["nodes_ends"] = ends
    del content["cause_trees"]
    sio.dump(content, path)
    with pytest.raises(ModelError, match=r"not a gpubalance model file .*cause_trees"):
        model.load(path)


def test_held_out_families_are_scored_each_in_turn(dataset: Dataset) -> None:
    predicted, report = cross_validate(dataset, lambda: GpuStateClassifier(max_iter=10))
    assert set(report["per_family"]) == set(NAMES)
    assert len(predicted) == len(dataset)
    assert report["confusion"]["labels"]


def test_scores_of_a_perfect_and_a_wrong_answer() -> None:
    truth = ["balanced/none", "starved/routing_skew", "overloaded/routing_skew"]
    assert scores(truth, truth)["state_macro_f1"] == 1.0
    assert scores(truth, truth)["cause_accuracy"] == 1.0
    wrong = ["balanced/none", "starved/low_demand", "overloaded/routing_skew"]
    assert scores(truth, wrong)["state_macro_f1"] == 1.0
    assert scores(truth, wrong)["cause_accuracy"] == 0.5


def test_diagnose_judges_with_a_trained_model(
    dataset: Dataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpubalance.cli import main
    from gpubalance.lab import run as lab_run

    # a small model that learns fast enough from this little data to see the skew
    quick = {"max_iter": 20, "learning_rate": 0.08, "max_leaf_nodes": 31, "min_samples_leaf": 20}
    fitted = GpuStateClassifier(**quick).fit(dataset.table, dataset.labels)
    path = tmp_path / "model.skops"
    model.save(path, fitted, {})
    out = tmp_path / "run"
    lab_run.run(scenario.load("skewed-heterogeneous"), "fast", 120, 5, out)
    capsys.readouterr()
    assert main(["diagnose", "--from", str(out), "--classifier", "model", str(path)]) == 0
    table = capsys.readouterr().out
    assert "routing_skew" in table
    (tmp_path / "foreign.skops").write_bytes(b"not a model")
    assert (
        main(
            [
                "diagnose",
                "--from",
                str(out),
                "--classifier",
                "model",
                str(tmp_path / "foreign.skops"),
            ]
        )
        == 2
    )
    assert "not a gpubalance model file" in capsys.readouterr().err


def test_the_state_is_judged_first_then_the_cause_given_it(dataset: Dataset) -> None:
    fitted = GpuStateClassifier(max_iter=20).fit(dataset.table, dataset.labels)
    assert set(fitted.estimator_.classes_) <= {"starved", "overloaded", "balanced"}
    assert set(fitted.classes_) == set(dataset.labels)
    proba = fitted.predict_proba(dataset.table)
    assert np.allclose(proba.sum(axis=1), 1.0)
    states = fitted.estimator_.predict_proba(dataset.table.values)
    for j, state in enumerate(fitted.estimator_.classes_):
        mine = [i for i, label in enumerate(fitted.classes_) if label.startswith(state + "/")]
        assert np.allclose(proba[:, mine].sum(axis=1), states[:, j])


def test_a_state_too_unlikely_to_be_judged_is_not_asked_its_causes(dataset: Dataset) -> None:
    # sure enough of its states (the defaults, leaves of a few windows) for some to be negligible
    fitted = GpuStateClassifier(min_samples_leaf=5, named_causes=False).fit(
        dataset.table, dataset.labels
    )
    proba = fitted.predict_proba(dataset.table)
    values = dataset.table.values
    states = fitted.estimator_.predict_proba(values)
    asked = 0
    for state, cause in fitted.cause_estimators_.items():
        p_state = states[:, list(fitted.estimator_.classes_).index(state)]
        mine = [list(fitted.classes_).index(label) for label in cause.classes_]
        every = p_state[:, None] * cause.predict_proba(values)
        likely = p_state >= model.NEGLIGIBLE_STATE
        assert np.allclose(proba[np.ix_(likely, mine)], every[likely])
        assert np.allclose(proba[np.ix_(~likely, mine)], (p_state[~likely] / len(mine))[:, None])
        assert (np.abs(proba[:, mine] - every) <= model.NEGLIGIBLE_STATE).all()
        asked += int(likely.sum())
    assert 0 < asked < len(values) * len(fitted.cause_estimators_)


class _EveryCauseAsked:
    """The shipped model with every state's causes asked of their trees on every row."""

    def __init__(self, fitted: GpuStateClassifier) -> None:
        self.fitted = fitted
        self.classes_ = fitted.classes_

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        fitted = self.fitted
        out = np.zeros((len(table.frames), len(fitted.classes_)))
        states = fitted.estimator_.predict_proba(table.values)
        for j, state in enumerate(fitted.estimator_.classes_):
            labels = [fitted.only_cause_[state]] if state in fitted.only_cause_ else None
            cause = fitted.cause_estimators_.get(state)
            given = np.ones((len(out), 1)) if cause is None else cause.predict_proba(table.values)
            for k, label in enumerate(labels or cause.classes_):
                out[:, list(fitted.classes_).index(label)] = states[:, j] * given[:, k]
        return causes.apply(out, fitted.classes_, table)


def test_the_verdicts_and_labels_are_those_of_every_cause_asked(dataset: Dataset) -> None:
    shipped = model.load_shipped()
    # more rows than a block, so that the blocks' seams are crossed too
    table = dataset.table
    while len(table.frames) <= 2 * model.BLOCK_ROWS:
        table = FeatureTable(table.frames * 2, np.vstack([table.values, table.values]))
    every = _EveryCauseAsked(shipped)
    ours, theirs = shipped.predict_proba(table), every.predict_proba(table)
    assert np.array_equal(ours.argmax(axis=1), theirs.argmax(axis=1))
    assert np.abs(ours - theirs).max() <= model.NEGLIGIBLE_STATE
    # Verdicts asks the model for its likeliest state's causes alone (predict_likeliest_proba)
    assert Verdicts(shipped).diagnose(dataset.table) == Verdicts(every).diagnose(dataset.table)


def test_the_verdicts_ask_only_the_likeliest_states_causes(dataset: Dataset) -> None:
    shipped = model.load_shipped()
    table = dataset.table
    every = _EveryCauseAsked(shipped).predict_proba(table)
    likeliest = shipped.predict_likeliest_proba(table)
    states = shipped.estimator_.predict_proba(table.values)
    top = states.argmax(axis=1)
    for j, state in enumerate(shipped.estimator_.classes_):
        mine = [i for i, label in enumerate(shipped.classes_) if label.startswith(state + "/")]
        # every state's probability as before, and the likeliest one's causes
        assert np.allclose(likeliest[:, mine].sum(axis=1), states[:, j])
        assert np.allclose(likeliest[np.ix_(top == j, mine)], every[np.ix_(top == j, mine)])
    # the other states' causes were not asked (spread over them, then the named causes)
    assert not np.allclose(likeliest, every)
