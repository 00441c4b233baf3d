"""`gpubalance analyzer`: the service as a process, over real HTTP, against a lab run directory
and a live exporter on the fake NVML driver."""

from __future__ import annotations

import json
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpubalance.cli import main
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario

TOKEN = "s3cret-token"
LISTENING = re.compile(r"listening on (https?://[\d.]+:\d+)")
# a fast exporter: windows of 1 s, 6 s of history; OTLP on a free port (tests run side by side)
EXPORTER_FLAGS = ("--listen", "127.0.0.1:0", "--otlp-listen", "127.0.0.1:0", "--interval", "0.2")
EXPORTER_FLAGS += ("--window", "1", "--trend-window", "6")


@dataclass
class Answer:
    status: int
    body: bytes
    headers: Mapping[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Analyzer:
    process: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""  # where to reach it: on loopback when it listens on every interface
    listened: str = ""  # where it says it listens
    context: ssl.SSLContext | None = None  # what an https:// analyzer's certificate is checked with

    def request(
        self,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        request = urllib.request.Request(
            self.url + path,
            data=body,
            headers=dict(headers or {}),
            method="POST" if body else "GET",
        )
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.context) as response:
                return Answer(response.status, response.read(), dict(response.headers))
        except urllib.error.HTTPError as error:
            return Answer(error.code, error.read(), dict(error.headers))

    def diagnosis(self, query: str = "") -> dict[str, Any]:
        answer = self.request(f"/api/v1/diagnosis{query}")
        assert answer.status == 200, answer.body
        return answer.json()

    def wait_for(
        self, check: Callable[[dict[str, Any]], bool], timeout: float = 60.0
    ) -> dict[str, Any]:
        """The first diagnosis ``check`` accepts; the analyzer reports each cycle's outcome."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"analyzer died:\n{self.log()}"
            report = self.diagnosis()
            if check(report):
                return report
            assert time.monotonic() < deadline, f"not within {timeout} s: {report}\n{self.log()}"
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def _command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "gpubalance", "analyzer", *flags]


@pytest.fixture
def start_analyzer(tmp_path: Path) -> Iterator[Callable[..., Analyzer]]:
    """start_analyzer(*flags, wait=True, context=None): the analyzer as a subprocess on a free
    port; with ``wait``, once its first cycle has ended."""
    running: list[Analyzer] = []

    def start(*flags: str, wait: bool = True, context: ssl.SSLContext | None = None) -> Analyzer:
        log_path = tmp_path / f"analyzer-{len(running)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                _command("--listen", "127.0.0.1:0", *flags), stdout=log, stderr=subprocess.STDOUT
            )
        analyzer = Analyzer(process, log_path, context=context)
        running.append(analyzer)
        deadline = time.monotonic() + 60
        while not (match := LISTENING.search(analyzer.log())):
            assert process.poll() is None, f"analyzer exited:\n{analyzer.log()}"
            assert time.monotonic() < deadline, f"analyzer did not listen:\n{analyzer.log()}"
            time.sleep(0.05)
        analyzer.listened = match.group(1)
        analyzer.url = analyzer.listened.replace("//0.0.0.0:", "//127.0.0.1:")
        if wait:
            analyzer.wait_for(lambda report: report["source"]["up"] is not None)
        return analyzer

    yield start
    for analyzer in running:
        analyzer.stop()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("skewed")
    # ten windows: the peers' load, a quarter of their capacity, lies near the line between
    # starved and balanced (0.30), where the verdict step takes a few windows of the GPUs' own
    # history to reach its enter confidence
    lab_run.run(scenario.load("skewed-heterogeneous"), "fast", 300, 1, out, snapshots=True)
    return out


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def _diagnose_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["diagnose", "--from", str(run_dir), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_lab_run_is_judged_as_gpubalance_diagnose_judges_it(
    run_dir: Path,
    start_analyzer: Callable[..., Analyzer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    analyzer = start_analyzer("--source", str(run_dir))
    report = analyzer.diagnosis("?history=2")
    rows = _diagnose_json(run_dir, capsys)
    last = max(r["t_start"] for r in rows)
    keys = ("host", "gpu", "uuid", "t_start", "t_end", "state", "cause", "confidence")
    now = [{k: r[k] for k in keys} for r in rows if r["t_start"] == last]
    assert [{k: v[k] for k in keys} for v in report["gpus"]] == now
    # the shipped model, as the command's default: the favourite's peers starved by the routing
    assert [(v["gpu"], v["state"], v["cause"]) for v in report["gpus"]][1:] == [
        (1, "starved", "routing_skew"),
        (2, "starved", "routing_skew"),
        (3, "starved", "routing_skew"),
    ]
    assert all(v["evidence"] for v in report["gpus"])
    # two windows before now for each GPU, oldest first, as the command has them
    assert [(v["t_start"], v["gpu"]) for v in report["history"]] == [
        (r["t_start"], r["gpu"]) for r in rows if last - 60 <= r["t_start"] < last
    ]
    assert [f["kind"] for f in report["fleet"]] == ["imbalance"]
    assert len(report["fleet_history"]) == 2
    assert report["source"]["up"] is True and report["source"]["error"] is None
    assert report["classifier"] == "model (shipped)" and report["window_seconds"] == 30
    assert analyzer.request("/api/v1/diagnosis?history=-1").status == 400
    # the service's recommender is the one `gpubalance diagnose --recommend` prints
    capsys.readouterr()
    assert main(["diagnose", "--from", str(run_dir), "--format", "json", "--recommend"]) == 0
    printed = json.loads(capsys.readouterr().out)
    served = analyzer.request("/api/v1/recommendations").json()
    served = served["recommendations"] if isinstance(served, dict) else served
    same = ("id", "action", "target", "parameters", "reason")
    assert printed and [{k: r[k] for k in same} for r in served] == [
        {k: r[k] for k in same} for r in printed
    ]
    assert analyzer.stop() == 0
    assert "stopping" in analyzer.log()


def _schema_of(document: dict[str, Any], path: str, method: str, status: int) -> dict[str, Any]:
    answer = document["paths"][path][method]["responses"][str(status)]
    return answer["content"]["application/json"]["schema"]


def _check(document: dict[str, Any], path: str, method: str, answer: Answer) -> None:
    """The answer's body against the document's schema for its path, method and status."""
    schema = {**_schema_of(document, path, method, answer.status), "components": {}}
    schema["components"] = document["components"]
    jsonschema.Draft202012Validator(schema).validate(answer.json())


def test_the_openapi_document_describes_each_answer(
    run_dir: Path, start_analyzer: Callable[..., Analyzer], token_file: Path
) -> None:
    analyzer = start_analyzer("--source", str(run_dir), "--token-file", str(token_file))
    served = analyzer.request("/api/v1/openapi.json")
    assert served.status == 200
    document = served.json()
    assert document["openapi"] == "3.1.0"
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    ack = "/api/v1/recommendations/{id}/ack"
    asked = [
        ("/api/v1/diagnosis", "/api/v1/diagnosis?history=3", None, {}, 200),
        ("/api/v1/diagnosis", "/api/v1/diagnosis?history=many", None, {}, 400),
        ("/api/v1/recommendations", "/api/v1/recommendations", None, {}, 200),
        ("/healthz", "/healthz", None, {}, 200),
        (ack, "/api/v1/recommendations/nope/ack", b'{"status": "applied"}', {}, 401),
        (
            ack,
            "/api/v1/recommendations/nope/ack",
            b"{}",
            {**auth, "Content-Type": "text/plain"},
            415,
        ),
        (ack, "/api/v1/recommendations/nope/ack", b'{"status": "done"}', auth, 400),
        (
            ack,
            "/api/v1/recommendations/nope/ack",
            b'{"status": "applied", "reason": "", "by": "t"}',
            auth,
            404,
        ),
    ]
    for path, url, body, headers, status in asked:
        answer = analyzer.request(url, body, headers)
        assert answer.status == status, (url, answer.body)
        _check(document, path, "post" if body else "get", answer)
    # the one diagnosis with verdicts in it: each verdict's every field is described
    verdict = document["components"]["schemas"]["Verdict"]
    assert set(verdict["required"]) == set(analyzer.diagnosis()["gpus"][0])
    metrics = analyzer.request("/metrics")
    assert metrics.status == 200 and "/metrics" in document["paths"]
    assert analyzer.request("/api/v1/undocumented").status == 404


def _families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_metrics_say_what_the_diagnosis_says(
    run_dir: Path, start_analyzer: Callable[..., Analyzer]
) -> None:
    analyzer = start_analyzer("--source", str(run_dir))
    report = analyzer.diagnosis()
    families = _families(analyzer.request("/metrics").body.decode())
    for verdict in report["gpus"]:
        ids = {"host": verdict["host"], "gpu": str(verdict["gpu"]), "uuid": verdict["uuid"]}
        rows = [
            s for s in families["gpubalance_gpu_state"].samples if ids.items() <= s.labels.items()
        ]
        assert len(rows) == 4  # one per state
        current = [s for s in rows if s.value == 1]
        assert [(s.labels["state"], s.labels["cause"]) for s in current] == [
            (verdict["state"], verdict["cause"])
        ]
        (confidence,) = [
            s.value for s in families["gpubalance_gpu_state_confidence"].samples if s.labels == ids
        ]
        assert confidence == verdict["confidence"]
    (idle,) = families["gpubalance_fleet_idle_while_queued_ratio"].samples
    fleet = report["fleet"][0]
    assert idle.labels == {"host": fleet["host"], "pool": fleet["pool"]}
    assert idle.value == fleet["idle_while_queued_ratio"]
    assert families["gpubalance_analyzer_source_up"].samples[0].value == 1
    (last,) = families["gpubalance_analyzer_last_success_timestamp_seconds"].samples
    assert last.value >= report["source"]["last_success_seconds"]
    cycles = {
        s.name: s.value for s in families["gpubalance_analyzer_cycle_duration_seconds"].samples
    }
    assert cycles["gpubalance_analyzer_cycle_duration_seconds_count"] >= 1
    assert families["gpubalance_analyzer_source_errors"].samples == []
    # the skewed run is re-weighted: each worker's share, as the recommendation gives it
    served = analyzer.request("/api/v1/recommendations").json()
    served = served["recommendations"] if isinstance(served, dict) else served
    (weights,) = [r["parameters"]["weights"] for r in served if r["action"] == "set_weights"]
    assert {
        (s.labels["worker"], s.labels["gpu"], s.value)
        for s in families["gpubalance_worker_recommended_weight"].samples
    } == {(w["worker"], str(w["gpu"]), w["weight"]) for w in weights}
    assert {w["worker"] for w in weights} == {"w0", "w1", "w2", "w3"}


def test_beyond_loopback_it_needs_a_token(
    run_dir: Path, start_analyzer: Callable[..., Analyzer], token_file: Path
) -> None:
    refused = subprocess.run(
        _command("--source", str(run_dir), "--listen", "0.0.0.0:0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    assert "beyond loopback" in refused.stderr and "--token-file" in refused.stderr
    analyzer = start_analyzer(
        "--source", str(run_dir), "--listen", "0.0.0.0:0", "--token-file", str(token_file)
    )
    assert "without TLS: the bearer token travels in clear" in analyzer.log()
    assert analyzer.listened.startswith("http://0.0.0.0:")


def test_acks_need_the_bearer_token(
    run_dir: Path, start_analyzer: Callable[..., Analyzer], token_file: Path
) -> None:
    analyzer = start_analyzer("--source", str(run_dir), "--token-file", str(token_file))
    body = b'{"status": "accepted", "reason": "looks right", "by": "test"}'
    json_type = {"Content-Type": "application/json"}
    path = "/api/v1/recommendations/some-id/ack"
    for headers in (
        json_type,
        {**json_type, "Authorization": "Bearer wrong"},
        {**json_type, "Authorization": f"Basic {TOKEN}"},
    ):
        answer = analyzer.request(path, body, headers)
        assert answer.status == 401, headers
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        assert "token" in answer.json()["error"]
    # with the token it gets as far as the id, which no recommendation has
    answer = analyzer.request(path, body, {**json_type, "Authorization": f"Bearer {TOKEN}"})
    assert answer.status == 404 and "some-id" in answer.json()["error"]


def test_an_unreachable_source_leaves_it_serving_and_saying_why(
    start_analyzer: Callable[..., Analyzer],
) -> None:
    analyzer = start_analyzer("--source", "http://127.0.0.1:9", "--interval", "0.2")
    report = analyzer.diagnosis()
    assert report["source"]["up"] is False and report["gpus"] == []
    assert "127.0.0.1:9" in report["source"]["error"]
    health = analyzer.request("/healthz")
    assert health.status == 200 and health.json()["status"] == "source_down"
    families = _families(analyzer.request("/metrics").body.decode())
    errors = {
        s.labels["reason"]: s.value for s in families["gpubalance_analyzer_source_errors"].samples
    }
    assert errors.get("unreachable", 0) >= 1 and set(errors) == {"unreachable"}
    assert families["gpubalance_analyzer_source_up"].samples[0].value == 0
    assert "gpubalance_analyzer_last_success_timestamp_seconds" not in families


def _exporter(env: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    log_path = tmp_path / "exporter.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpubalance", "exporter", *EXPORTER_FLAGS],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + 60
    while not (match := LISTENING.search(log_path.read_text(errors="replace"))):
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.05)
    return process, match.group(1)


def test_a_source_that_goes_down_turns_its_gpus_unknown(
    fakenvml_env: Callable[[str | Path], dict[str, str]],
    tmp_path: Path,
    start_analyzer: Callable[..., Analyzer],
) -> None:
    from gpubalance.lab.fakenvml import write_state

    state = tmp_path / "nvml.state"
    write_state(state, {"device_count": 2})
    exporter, url = _exporter(fakenvml_env(state), tmp_path)
    try:
        analyzer = start_analyzer("--source", url, "--window", "1", "--interval", "0.3")
        judged = analyzer.wait_for(lambda r: r["source"]["up"] is True and len(r["gpus"]) == 2)
        assert judged["source"]["description"] == f"exporter at {url}"
    finally:
        exporter.terminate()
        exporter.wait(timeout=30)
    down = analyzer.wait_for(lambda r: r["source"]["up"] is False)
    assert "cannot reach the exporter" in down["source"]["error"]
    for verdict in down["gpus"]:
        assert verdict["state"] == "unknown"
        assert verdict["unknown_reason"].startswith("source down: ")
        assert "cannot reach the exporter" in verdict["unknown_reason"]
    assert {v["uuid"] for v in down["gpus"]} == {v["uuid"] for v in judged["gpus"]}
    assert all(f["kind"] == "unknown" for f in down["fleet"])
    # what it said before is history now
    before = analyzer.diagnosis("?history=1")["history"]
    assert {v["uuid"] for v in before} == {v["uuid"] for v in judged["gpus"]}
    families = _families(analyzer.request("/metrics").body.decode())
    unknown = [
        s for s in families["gpubalance_gpu_state"].samples if s.labels["state"] == "unknown"
    ]
    assert [s.value for s in unknown] == [1.0, 1.0]
    assert analyzer.stop() == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ((), "--source is needed"),
        (("--source", "/nonexistent/run"), "neither a URL"),
        (("--source", "/tmp", "--listen", "nowhere"), "expected HOST:PORT"),
        (("--source", "/tmp", "--model", "/nonexistent.skops"), "no such file"),
        (("--source", "/tmp", "--token-file", "/nonexistent/token"), "--token-file: cannot read"),
    ],
)
def test_bad_options_exit_2_with_the_reason(flags: tuple[str, ...], message: str) -> None:
    result = subprocess.run(_command(*flags), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_a_token_and_basic_auth_cannot_share_the_authorization_header(
    run_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    import bcrypt

    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    web_yml = tmp_path / "web.yml"
    web_yml.write_text(f"basic_auth_users:\n  ops: {hashed}\n")
    flags = ("--source", str(run_dir), "--token-file", str(token_file))
    result = subprocess.run(
        _command(*flags, "--web.config.file", str(web_yml)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "both want the Authorization header" in result.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the certificate")
def test_beyond_loopback_with_a_token_over_tls(
    run_dir: Path, start_analyzer: Callable[..., Analyzer], token_file: Path, tmp_path: Path
) -> None:
    crt, key = tmp_path / "analyzer.crt", tmp_path / "analyzer.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"),
            *("-nodes", "-keyout", str(key), "-out", str(crt), "-subj", "/CN=analyzer"),
            *("-days", "2", "-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    web_yml = tmp_path / "web.yml"
    web_yml.write_text(f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n")
    context = ssl.create_default_context(cafile=str(crt))
    analyzer = start_analyzer(
        *("--source", str(run_dir), "--listen", "0.0.0.0:0", "--token-file", str(token_file)),
        *("--web.config.file", str(web_yml)),
        context=context,
    )
    assert analyzer.listened.startswith("https://0.0.0.0:")
    assert "travels in clear" not in analyzer.log()
    assert len(analyzer.diagnosis()["gpus"]) == 4
    body = b'{"status": "accepted", "reason": "", "by": "test"}'
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    assert analyzer.request("/api/v1/recommendations/x/ack", body, headers).status == 404
    plain = urllib.request.Request(analyzer.url.replace("https://", "http://") + "/healthz")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(plain, timeout=10)
