"""The recommendations and their acks over real HTTP, with a recommender of fixed answers built
from the verdicts (the service takes any recommender), and a clock the test moves."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gpubalance.analyzer.baselines import QueueUtilization
from gpubalance.analyzer.features import FeatureTable
from gpubalance.analyzer.server import AnalyzerServer, openapi_document
from gpubalance.analyzer.service import EXPIRED_KEPT_SECONDS, AnalyzerService
from gpubalance.analyzer.sources import LabRunSource
from gpubalance.analyzer.verdict import Diagnosis
from gpubalance.diagnosis import Action, Recommendation
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario

START = 1_800_000_000.0
TOKEN = "ack-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@dataclass
class Clock:
    now: float = START

    def __call__(self) -> float:
        return self.now


@dataclass
class FixedRecommender:
    """Re-weights the pool towards its starved GPUs and says to look at the overloaded one:
    the same ids each cycle, so that acks must survive a cycle."""

    fail: bool = False
    calls: list[float] = field(default_factory=list)
    hot_weight: float = 1.0  # the overloaded GPU's weight (the others' is 3)
    extra: tuple[Recommendation, ...] = ()  # made on each call besides

    def recommend(
        self, diagnosis: Diagnosis, table: FeatureTable, now_seconds: float
    ) -> tuple[Recommendation, ...]:
        self.calls.append(now_seconds)
        if self.fail:
            raise RuntimeError("the recommender broke")
        last = max(v.t_start for v in diagnosis.verdicts)
        now = [v for v in diagnosis.verdicts if v.t_start == last]
        weights = [
            {
                "worker": f"worker-{v.gpu}",
                "gpu": v.gpu,
                "weight": self.hot_weight if v.state == "overloaded" else 3,
            }
            for v in now
        ]
        hot = next(v for v in now if v.state == "overloaded")
        return (
            Recommendation(
                id="weights-1",
                action="set_weights",
                host=hot.host,
                target=hot.pool,
                parameters={"weights": weights},
                reason="GPU 0 queues while its peers idle",
                evidence=hot.evidence,
                confidence=0.9,
                created_seconds=now_seconds,
                expires_seconds=now_seconds + 300,
            ),
            Recommendation(
                id="look-1",
                action="investigate_host",
                host=hot.host,
                target=f"gpu:{hot.gpu}",
                parameters={},
                reason="check the card",
                evidence=(),
                confidence=0.5,
                created_seconds=now_seconds,
                expires_seconds=now_seconds + 60,
                cost_rank=5,
            ),
            *self.extra,
        )


@dataclass
class Served:
    url: str
    server: AnalyzerServer
    app: web.Application

    def request(
        self, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=body,
            headers=dict(headers or {}),
            method="POST" if body else "GET",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        if path == "/metrics":
            return status, raw.decode()
        return status, json.loads(raw)

    def ack(self, rec_id: str, body: object, headers: Mapping[str, str] = AUTH) -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.request(f"/api/v1/recommendations/{rec_id}/ack", raw, headers)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("skewed")
    lab_run.run(scenario.load("skewed-heterogeneous"), "fast", 120, 1, out, snapshots=True)
    return out


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def recommender() -> FixedRecommender:
    return FixedRecommender()


@pytest.fixture
def served(run_dir: Path, clock: Clock, recommender: FixedRecommender) -> Iterator[Served]:
    """The server on a free loopback port, in a thread of its own; cycles run when the test
    says (service.cycle()), not on a timer."""
    service = AnalyzerService(
        LabRunSource(run_dir), QueueUtilization(), recommender, classifier_name="q", clock=clock
    )
    server = AnalyzerServer(service, token=TOKEN)
    app = server.app()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    host, port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    service.cycle()
    try:
        yield Served(f"http://{host}:{port}", server, app)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_an_ack_is_kept_with_its_recommendation_through_later_cycles(
    served: Served, clock: Clock
) -> None:
    status, listed = served.request("/api/v1/recommendations")
    assert status == 200 and listed["recommender"] == "FixedRecommender"
    # cheapest first: re-weighting (rank 0) before investigating (rank 5)
    assert [r["id"] for r in listed["recommendations"]] == ["weights-1", "look-1"]
    clock.now += 5
    body = {"status": "accepted", "reason": "weights look right", "by": "controller"}
    status, answered = served.ack("weights-1", body)
    assert status == 200
    assert answered["acks"] == [{**body, "at_seconds": START + 5}]
    clock.now += 5
    served.server.service.cycle()  # the recommender makes weights-1 anew, without acks
    applied = {"status": "applied", "reason": "haproxy weights set", "by": "controller"}
    assert served.ack("weights-1", applied)[0] == 200
    _, listed = served.request("/api/v1/recommendations")
    weights = next(r for r in listed["recommendations"] if r["id"] == "weights-1")
    assert [a["status"] for a in weights["acks"]] == ["accepted", "applied"]
    assert weights["created_seconds"] == START + 10  # the later cycle's recommendation
    look = next(r for r in listed["recommendations"] if r["id"] == "look-1")
    assert look["acks"] == []


def test_acks_that_it_was_done_go_when_it_asks_anew_and_a_refusal_stays(
    served: Served, clock: Clock, recommender: FixedRecommender
) -> None:
    def acks() -> list[str]:
        _, listed = served.request("/api/v1/recommendations")
        weights = next(r for r in listed["recommendations"] if r["id"] == "weights-1")
        return [a["status"] for a in weights["acks"]]

    def cycle(hot_weight: float) -> list[str]:
        recommender.hot_weight = hot_weight
        clock.now += 5
        served.server.service.cycle()
        return acks()

    applied = {"status": "applied", "reason": "haproxy weights set", "by": "controller"}
    assert served.ack("weights-1", applied)[0] == 200
    # estimates move a little each cycle: the same ask, still applied
    assert cycle(1.2) == ["applied"]
    assert cycle(0.9) == ["applied"]
    # measured at last, the hot GPU's share doubles: a new ask, to be carried out again
    assert cycle(2.0) == []
    assert served.ack("weights-1", applied)[0] == 200
    # drifting away by small steps is measured from what the ack answered, not the last cycle
    assert cycle(2.4) == ["applied"]
    assert cycle(2.8) == []
    # a refusal stands, whatever it asks next
    rejected = {"status": "rejected", "reason": "a person said no", "by": "controller"}
    assert served.ack("weights-1", rejected)[0] == 200
    assert cycle(1.0) == ["rejected"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"{not json", "body: Invalid JSON"),
        (b"[]", "Input should be an object"),
        ({"status": "done", "reason": "", "by": "x"}, "status: Input should be 'accepted'"),
        ({"status": "applied", "reason": "r"}, "by: Field required"),
        ({"status": "applied", "by": "x"}, "reason: Field required"),
        ({"status": "applied", "reason": "r", "by": ""}, "by: String should have at least 1"),
        ({"status": "applied", "reason": "r", "by": 7}, "by: Input should be a valid string"),
        ({"status": "applied", "reason": "r", "by": "x", "when": 1}, "when: Extra inputs"),
        (
            {"status": "failed", "reason": "x" * 3000, "by": "x"},
            "reason: String should have at most",
        ),
    ],
)
def test_a_malformed_ack_gets_400_saying_what_is_wrong(
    served: Served, body: object, problem: str
) -> None:
    status, answer = served.ack("weights-1", body)
    assert status == 400
    assert problem in answer["error"], answer
    _, listed = served.request("/api/v1/recommendations")
    assert all(r["acks"] == [] for r in listed["recommendations"])


def test_an_ack_must_be_json_and_small(served: Served) -> None:
    good = json.dumps({"status": "applied", "reason": "r", "by": "x"}).encode()
    status, answer = served.ack("weights-1", good, {**AUTH, "Content-Type": "text/plain"})
    assert status == 415 and "application/json" in answer["error"]
    huge = json.dumps({"status": "applied", "reason": "r" * 100_000, "by": "x"}).encode()
    status, answer = served.ack("weights-1", huge)
    assert status == 413 and "at most" in answer["error"]


def test_an_expired_recommendation_gets_409_then_an_unknown_one_404(
    served: Served, clock: Clock
) -> None:
    body = {"status": "applied", "reason": "late", "by": "controller"}
    assert served.ack("nothing-like-it", body)[0] == 404
    clock.now += 61  # look-1 lives 60 s
    status, answer = served.ack("look-1", body)
    assert status == 409 and "expired" in answer["error"] and "1 s ago" in answer["error"]
    _, listed = served.request("/api/v1/recommendations")
    assert [r["id"] for r in listed["recommendations"]] == ["weights-1"]
    clock.now += EXPIRED_KEPT_SECONDS
    status, answer = served.ack("look-1", body)
    assert status == 404 and "look-1" in answer["error"]


def _gpu_action(action: Action, host: str, now: float) -> Recommendation:
    return Recommendation(
        id=f"{action}-2",
        action=action,
        host=host,
        target="gpu:2",
        parameters={"gpu": 2, "workers": ["worker-2"]},
        reason="GPU 2's worker",
        evidence=(),
        confidence=1.0,
        created_seconds=now,
        expires_seconds=now + 120,
    )


def test_a_return_supersedes_the_drain_of_its_gpu_and_a_drain_the_return(
    served: Served, clock: Clock, recommender: FixedRecommender
) -> None:
    """A drain stands its 120 s after its last cycle; an executor given it beside the return of
    the same GPU would refuse both as contradictory, and the GPU would stay out."""

    def listed() -> list[str]:
        return [r["id"] for r in served.request("/api/v1/recommendations")[1]["recommendations"]]

    host = served.request("/api/v1/diagnosis")[1]["gpus"][0]["host"]
    recommender.extra = (_gpu_action("drain", host, clock.now),)
    served.server.service.cycle()
    assert "drain-2" in listed()
    clock.now += 30
    recommender.extra = (_gpu_action("add_worker", host, clock.now),)
    served.server.service.cycle()
    assert "add_worker-2" in listed() and "drain-2" not in listed()
    body = {"status": "applied", "reason": "drained", "by": "controller"}
    status, answer = served.ack("drain-2", body)
    assert status == 409 and "expired" in answer["error"]
    # lost again: the drain is back, the return gone; the rest untouched
    clock.now += 30
    recommender.extra = (_gpu_action("drain", host, clock.now),)
    served.server.service.cycle()
    assert sorted(listed()) == ["drain-2", "look-1", "weights-1"]


def test_a_failing_recommender_costs_its_cycle_not_the_service(
    served: Served, recommender: FixedRecommender
) -> None:
    recommender.fail = True
    served.server.service.cycle()
    status, report = served.request("/api/v1/diagnosis")
    assert status == 200 and report["source"]["up"] is True and len(report["gpus"]) == 4
    _, text = served.request("/metrics")
    failures = {
        s.labels["stage"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "gpubalance_analyzer_cycle_failures"
        for s in family.samples
    }
    assert failures == {"recommend": 1.0}


def test_recommended_weights_are_served_for_a_router(served: Served) -> None:
    _, text = served.request("/metrics")
    (family,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "gpubalance_worker_recommended_weight"
    ]
    weights = {(s.labels["worker"], s.labels["gpu"]): s.value for s in family.samples}
    assert weights == {
        ("worker-0", "0"): 1,
        ("worker-1", "1"): 3,
        ("worker-2", "2"): 3,
        ("worker-3", "3"): 3,
    }


def test_the_document_lists_exactly_the_routes(served: Served) -> None:
    document = openapi_document(token=True)
    routes = {
        (route.resource.canonical, route.method.lower())
        for route in served.app.router.routes()
        if route.method != "HEAD"  # aiohttp adds HEAD beside each GET
    }
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert routes == documented
    _, served_document = served.request("/api/v1/openapi.json")
    assert served_document == json.loads(json.dumps(document))
    # the ack's body schema refuses what the server refuses
    schema = {**document["components"]["schemas"]["AckBody"], "components": document["components"]}
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"status": "applied", "reason": "", "by": "x"})
    assert not validator.is_valid({"status": "applied", "reason": "", "by": "x", "when": 1})
    assert not validator.is_valid({"status": "done", "reason": "", "by": "x"})
    # and the recommendation the ack answers with is what the document says
    _, listed = served.request("/api/v1/recommendations")
    schema = {
        "$ref": "#/components/schemas/Recommendation",
        "components": document["components"],
    }
    for recommendation in listed["recommendations"]:
        jsonschema.Draft202012Validator(schema).validate(recommendation)
    assert "401" in document["paths"]["/api/v1/recommendations/{id}/ack"]["post"]["responses"]
    without = openapi_document(token=False)["paths"]["/api/v1/recommendations/{id}/ack"]["post"]
    assert "401" not in without["responses"] and "security" not in without
