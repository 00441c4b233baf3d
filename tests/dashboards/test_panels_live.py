"""Every panel of every dashboard has data on a real Prometheus fed by a live lab run.

Prometheus scrapes, every second: the live lab's exporter (the skewed demo server: real
workers behind a real HAProxy, on the fake NVML driver) in the native profile and again as
``?names=dcgm``; a second exporter (``--names both``), a host of two GPUs whose fake driver
this test drives (an XID error after the start, a thermal slowdown), so the fault panels have
something to show; the vLLM-format workers' own /metrics; the analyzer (reading that Prometheus, as
deployed); and the controller in dry run over the lab's HAProxy. Every target of every panel,
annotations included, with the variables set as a user selecting every value would set them,
then goes through the HTTP API's query_range and must return at least one series: all of
them, except the DCGM fields a GeForce card cannot serve, which must return none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from controller_harness import haproxy_installed
from harness import LISTENING

from gpubalance.dashboards import DASHBOARDS
from gpubalance.dashboards.dcgm import UNSUPPORTED_ON_GEFORCE
from gpubalance.lab import scenario, traffic
from gpubalance.lab.fakenvml import write_state
from gpubalance.lab.live.ports import start_prometheus
from gpubalance.lab.live.run import LiveLab

pytestmark = [
    pytest.mark.live,
    pytest.mark.haproxy,
    pytest.mark.skipif(not haproxy_installed(), reason="HAProxy: sudo apt-get install haproxy"),
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="apt-get install prometheus"),
    pytest.mark.timeout(600),
]

SCRAPE_SECONDS = 1
STEP_SECONDS = 2
# as Grafana sets them for a Prometheus data source whose scrape interval is 1 s: the step,
# and max(step + scrape interval, 4 scrape intervals)
INTERVALS = {
    "__interval": f"{STEP_SECONDS}s",
    "__rate_interval": f"{max(STEP_SECONDS + SCRAPE_SECONDS, 4 * SCRAPE_SECONDS)}s",
}
DURATION = (
    240.0  # the most the lab runs (a busy machine starts slowly); it stops once all have data
)
HW_THERMAL_SLOWDOWN = 0x40
XID = 79  # "GPU has fallen off the bus": what the fault host's GPU 1 reports
LABEL_VALUES = re.compile(r"^label_values\((?P<match>.+),\s*(?P<label>\w+)\)$")


@dataclass(frozen=True)
class Target:
    dashboard: str
    where: str  # the panel's title, or "annotation <name>"
    expr: str


def targets(name: str, model: dict[str, Any]) -> list[Target]:
    """Every query of a dashboard: its panels' targets and its annotations."""
    found = [
        Target(name, panel["title"], target["expr"])
        for panel in model["panels"]
        for target in panel["targets"]
    ]
    found += [
        Target(name, f"annotation {a['name']}", a["expr"])
        for a in model["annotations"].get("list", [])
        if "expr" in a
    ]
    return found


def grafana_regex(values: list[str]) -> str:
    """A multi-value selection as Grafana's Prometheus data source writes it into a regex
    matcher: each value's regex characters escaped for a PromQL string, joined as (a|b)."""
    escaped = [re.sub(r"([\\$^*{}\[\]'+?.()|])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):  # $gpu before a shorter name
        expr = expr.replace(f"${{{name}}}", variables[name]).replace(f"${name}", variables[name])
    return expr


@dataclass
class Prometheus:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def api(self, path: str, params: list[tuple[str, str]]) -> Any:
        assert self.process.poll() is None, f"Prometheus died:\n{self.log_path.read_text()}"
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                return json.load(r)["data"]
        except urllib.error.HTTPError as error:  # a bad query: say which, with Prometheus' why
            raise AssertionError(f"{path} {params}: {error.read().decode()}") from None

    def label_values(self, match: str, label: str, start: float, end: float) -> list[str]:
        params = [("match[]", match), ("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
        return sorted({s[label] for s in self.api("series", params) if s.get(label)})

    def series(self, expr: str, start: float, end: float) -> int:
        params = [
            ("query", expr),
            ("start", f"{start:.3f}"),
            ("end", f"{end:.3f}"),
            ("step", str(STEP_SECONDS)),
        ]
        return len(self.api("query_range", params)["result"])


def resolve_variables(
    prometheus: Prometheus, model: dict[str, Any], start: float, end: float
) -> tuple[dict[str, str], list[str]]:
    """Each variable set to all its values, in order (a later query may name an earlier
    variable), and the variables that have none."""
    chosen = dict(INTERVALS)
    empty = []
    for variable in model["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = LABEL_VALUES.match(variable["query"])
        assert match, variable["query"]
        selector = substitute(match["match"], chosen)
        values = prometheus.label_values(selector, match["label"], start, end)
        if not values:
            empty.append(f"{variable['name']}: {variable['query']}")
        chosen[variable["name"]] = grafana_regex(values) if values else "^$"
    return chosen, empty


def unsupported(target: Target) -> bool:
    return target.dashboard == "dcgm" and any(f in target.expr for f in UNSUPPORTED_ON_GEFORCE)


def test_grafana_regex_escapes_each_value_for_a_promql_string() -> None:
    assert grafana_regex(["127.0.0.1:9450"]) == r"127\\.0\\.0\\.1:9450"
    assert grafana_regex(["0", "1"]) == "(0|1)"
    assert (
        substitute(
            'x{gpu=~"$gpu", i=~"${host}"}[$__rate_interval]',
            {"gpu": "(0|1)", "host": "h", "__rate_interval": "4s"},
        )
        == 'x{gpu=~"(0|1)", i=~"h"}[4s]'
    )


def test_every_panel_target_returns_data_from_a_live_lab_run(
    fakenvml_dir: Path, fakenvml_env: Callable[[str | Path], dict[str, str]], tmp_path: Path
) -> None:
    with LiveSystem(fakenvml_dir, fakenvml_env, tmp_path) as system:
        all_targets = [t for name, build in DASHBOARDS.items() for t in targets(name, build())]
        assert len(all_targets) > 60
        missing, unexpected, empty_variables = system.wait_for_data(all_targets)
    assert not system.failure, f"the live lab failed: {system.failure[0]!r}"
    assert not empty_variables, "variables without values:\n" + "\n".join(empty_variables)
    assert not missing, "targets without data (logs in {}):\n{}".format(
        tmp_path, "\n".join(f"{t.dashboard} / {t.where}: {t.expr}" for t in missing)
    )
    # the GeForce list is honest: what it names has no data on our exporter
    assert not unexpected, "\n".join(f"{t.where}: {t.expr}" for t in unexpected)
    assert {f for f in UNSUPPORTED_ON_GEFORCE if any(f in t.expr for t in all_targets)} == set(
        UNSUPPORTED_ON_GEFORCE
    )


class LiveSystem:
    """The lab, the fault host, Prometheus, the analyzer and the controller, started in order
    and stopped in reverse."""

    def __init__(
        self,
        fakenvml_dir: Path,
        fakenvml_env: Callable[[str | Path], dict[str, str]],
        tmp_path: Path,
    ) -> None:
        self.tmp = tmp_path
        self.env = fakenvml_env
        self.processes: list[subprocess.Popen[bytes]] = []
        plan = scenario.load("skewed-heterogeneous")
        requests = traffic.generate(plan.scenario.traffic, DURATION, plan.scenario.seed)
        self.ready = threading.Event()
        self.lab = LiveLab(
            plan,
            requests,
            DURATION,
            start_exporter=True,
            exporter_args=("--interval", "1", "--window", "5", "--trend-window", "30"),
            build_dir=fakenvml_dir,
            on_ready=lambda _: self.ready.set(),
        )
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._run_lab)
        # where the fault host's exporter, the analyzer and the controller listen: each on a
        # port of its own choice (0), read from its log
        self.urls: dict[str, str] = {}

    def _run_lab(self) -> None:
        try:
            asyncio.run(self.lab.run())
        except BaseException as exc:  # handed to the test
            self.failure.append(exc)

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Path:
        log_path = self.tmp / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "gpubalance", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.processes.append(process)
        return log_path

    def _wait_listening(self, log_path: Path, seconds: float = 60) -> str:
        """The URL the process last started says it listens on."""
        deadline = time.monotonic() + seconds
        while not (said := LISTENING.search(log_path.read_text(errors="replace"))):
            assert self.processes[-1].poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"not listening:\n{log_path.read_text()}"
            time.sleep(0.1)
        return said[1]

    def _start_fault_host(self) -> None:
        """Two GPUs; GPU 1 in a hardware thermal slowdown, and an XID once NVML events are
        registered (an XID before registration is not an event)."""
        self.fault_state = self.tmp / "fault-host.state"
        state: dict[str, object] = {
            "device_count": 2,
            "gpu0.utilization.gpu": 40,
            "gpu1.utilization.gpu": 90,
            "gpu1.throttle_reasons": HW_THERMAL_SLOWDOWN,
            "gpu1.temp.gpu": 91,
        }
        write_state(self.fault_state, state)
        log_path = self._start(
            "fault-host",
            [
                "exporter",
                "--listen",
                "127.0.0.1:0",
                "--otlp-listen",
                "127.0.0.1:0",
                "--hostname",
                "fault-host",
                "--names",
                "both",  # the DCGM profile by its flag, as the lab's exporter by ?names=
                "--interval",
                "1",
                "--window",
                "5",
            ],
            self.env(self.fault_state),
        )
        self.urls["fault-host"] = self._wait_listening(log_path)
        url = f"{self.urls['fault-host']}/metrics"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url, timeout=10) as answer:
                    if 'capability="xid_events"} 1' in answer.read().decode():
                        break
            except urllib.error.HTTPError as error:
                # listening before its first sample: "no sample taken yet; retry in a second"
                if error.code != 503:
                    raise
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        write_state(self.fault_state, {**state, "gpu1.xid": str(XID)})

    def _prometheus_config(self) -> Path:
        """Prometheus' scrape jobs: the analyzer's and the controller's once they listen."""
        vllm = [
            f"127.0.0.1:{c.port}" for c in self.lab.configs.values() if c.metrics_format == "vllm"
        ]
        target = {name: url.removeprefix("http://") for name, url in self.urls.items()}
        exporters = [f"127.0.0.1:{self.lab.exporter_port}", target["fault-host"]]
        jobs = {
            "gpubalance-exporter": (exporters, {}),
            "dcgm": ([exporters[0]], {"params": {"names": ["dcgm"]}}),
            "vllm": (vllm, {}),
        }
        for name in ("analyzer", "controller"):
            if name in target:
                jobs[f"gpubalance-{name}"] = ([target[name]], {})
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_SECONDS}s",
                "scrape_timeout": f"{SCRAPE_SECONDS}s",
            },
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}], **extra}
                for job, (hosts, extra) in jobs.items()
            ],
        }
        config_path = self.tmp / "prometheus.yml"
        config_path.write_text(json.dumps(config))  # JSON is YAML
        return config_path

    def _start_prometheus(self) -> None:
        config_path = self._prometheus_config()
        server = start_prometheus(config_path, self.tmp / "tsdb")
        self.processes.append(server.process)
        self.prometheus = Prometheus(server.process, server.url, server.log_path)

    def _reload_prometheus(self) -> None:
        """Prometheus scrapes the analyzer and the controller too, once it has reloaded."""
        self._prometheus_config()
        self.prometheus.process.send_signal(signal.SIGHUP)
        targets = [self.urls[n].removeprefix("http://") for n in ("analyzer", "controller")]
        deadline = time.monotonic() + 30
        while not all(t in self.prometheus.api("status/config", [])["yaml"] for t in targets):
            assert time.monotonic() < deadline, self.prometheus.log_path.read_text()
            time.sleep(0.2)

    def __enter__(self) -> LiveSystem:
        try:
            self._start_fault_host()
            self.thread.start()
            assert self.ready.wait(120), "the live lab did not start"
            # the exporter's and the workers' ports are known once they listen (the lab
            # changes one another process took at start)
            self._start_prometheus()
            self.started = time.time()
            analyzer_log = self._start(
                "analyzer",
                [
                    "analyzer",
                    "--source",
                    self.prometheus.url,
                    "--window",
                    "10",
                    "--interval",
                    "2",
                    "--listen",
                    "127.0.0.1:0",
                ],
            )
            self.urls["analyzer"] = self._wait_listening(analyzer_log)
            controller_log = self._start(
                "controller",
                [
                    "controller",
                    "--analyzer",
                    self.urls["analyzer"],
                    "--haproxy-socket",
                    str(self.lab.run_dir / "haproxy.sock"),
                    "--listen",
                    "127.0.0.1:0",
                    "--audit-log",
                    str(self.tmp / "audit.jsonl"),
                    "--interval",
                    "1",
                    "--dwell-cycles",
                    "1",
                ],
            )
            self.urls["controller"] = self._wait_listening(controller_log)
            self._reload_prometheus()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.thread.is_alive():
                # the run may end between the check and the halt: its loop is closed then
                with contextlib.suppress(RuntimeError):
                    self.lab.halt()
                self.thread.join(120)
        finally:  # whatever failed above, no process outlives the test
            for process in reversed(self.processes):
                if process.poll() is None:
                    process.terminate()
                    try:
                        process.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()

    def wait_for_data(
        self, all_targets: list[Target]
    ) -> tuple[list[Target], list[Target], list[str]]:
        """Query every target until each has data or the lab's run ends: what still has none,
        what has data but should not, and the variables without values."""
        while True:
            end = time.time()
            missing, unexpected, empty = self._check(all_targets, end)
            # the latest state, for a look at a run that is slow to fill
            (self.tmp / "missing.txt").write_text(
                "\n".join([*empty, *(f"{t.dashboard} / {t.where}: {t.expr}" for t in missing)])
            )
            if (not missing and not empty) or not self.thread.is_alive():
                return missing, unexpected, empty
            time.sleep(2)

    def _check(
        self, all_targets: list[Target], end: float
    ) -> tuple[list[Target], list[Target], list[str]]:
        missing, unexpected, empty = [], [], []
        for name, build in DASHBOARDS.items():
            model = build()
            variables, no_values = resolve_variables(self.prometheus, model, self.started, end)
            empty += [f"{name} / {v}" for v in no_values]
            for target in (t for t in all_targets if t.dashboard == name):
                found = self.prometheus.series(
                    substitute(target.expr, variables), self.started, end
                )
                if unsupported(target):
                    if found:
                        unexpected.append(target)
                elif not found:
                    missing.append(target)
        return missing, unexpected, empty
