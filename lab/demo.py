"""`make demo`: the live lab on a skewed, heterogeneous RTX server, with `gpubalance run` on it
as a user runs it on a real host: the exporter reading the lab through the fake NVML driver and
the lab's procfs tree, the analyzer judging the exporter's history, and the controller acting on
the analyzer's recommendations (`--act`) through the lab's real HAProxy. The controller starts
paused (`--paused`), as a cautious operator would start it: for the view's first
``WATCH_SECONDS`` it only plans and logs what it would change, while the skew runs; then the
demo resumes it as that operator would (POST /api/v1/resume with the token).

The scenario (lab/scenarios/skewed-heterogeneous.yaml: 3x RTX 4090 + RTX 3090, one card the
default target of a weighted round robin) shows what gpubalance is for: one card hot, the others
idling, the slow card's tail latency; and then the loop fixing it. Below the live view of the
GPUs and the analyzer's verdicts, the loop's panel shows the p99 latency the workers report
(their latency histograms) and the idle-while-queued share the analyzer reads from the exporter,
before the controller's first action and now, what it would change while paused, and each
change it makes (its audit log) as it happens. At the end one line sums up before and after.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.text import Text

from gpubalance.lab import scenario, traffic
from gpubalance.lab.fakenvml import LIBRARY_NAME
from gpubalance.lab.live.run import LiveLab

DEMO_SCENARIO = "skewed-heterogeneous"
FOREVER_SECONDS = 24 * 3600.0  # on a terminal the demo runs until Ctrl-C
# the lab's traffic outlasts the view by this much: the workers, HAProxy and the three parts
# of `gpubalance run` start first, which takes a minute on a busy machine
START_ALLOWANCE_SECONDS = 120.0
# short windows and a quick controller, so that a demo of under a minute in a pipe shows
# verdicts, the controller's changes and what they did: 3 exporter samples a window
ANALYZER_ARGS = "--window 3 --interval 1"
# A re-weighting of the demo's one pool of 4 servers changes 3 or 4 of them, which the default
# breaker share (0.5) takes for a blast radius: the demo lets the whole pool change.
CONTROLLER_ARGS = "--interval 1 --breaker-share 1"
# the controller starts paused and the demo resumes it after this long in view: the skew's
# figures over some hundreds of requests, and what the paused controller would change
WATCH_SECONDS = 15.0
# Every worker serves TGI's /metrics: one queue name for all (one pool, as the analyzer groups
# GPUs by their queues), batch sizes (which idle-while-queued needs and vLLM's lacks) and a
# latency histogram (the p99; Triton's has none).
METRICS_FORMAT = "tgi"
LATENCY = "tgi_request_duration"
RECENT_SECONDS = 10.0  # "now" on the panel: at most the latest this many seconds
STARTED = re.compile(
    r"gpubalance run: exporter (\S+) \(pid \d+\), analyzer (\S+) \(pid \d+\), controller (\S+)"
)


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.1)


# -- `gpubalance run` on the lab -------------------------------------------------------------


def run_config(lab: LiveLab, build_dir: Path) -> Path:
    """The one config file `gpubalance run` reads: the exporter section a host with these
    workers would have (the lab's procfs has no sockets to find the workers by, so each
    endpoint names its GPU)."""
    endpoints = [
        {
            "url": f"http://127.0.0.1:{c.port}/metrics",
            "format": c.metrics_format,
            "worker": c.name,
            "gpu": c.gpu,
            # no serving stack exports its batch limit: a user writes it down, as here
            "max_batch_size": c.max_batch_size,
        }
        for c in lab.configs.values()
    ]
    exporter = {
        "interval": 1.0,
        "window": 10.0,
        "trend_window": 60.0,
        "procfs": str(lab.procfs),
        "nvml_library": str(build_dir.resolve() / LIBRARY_NAME),
        "hostname": lab.plan.scenario.name,
        "serving": {
            "scrape_interval": 0.5,
            "timeout": 1.0,
            "endpoints": endpoints,
            "otlp": {"enabled": False},  # the workers serve /metrics; nothing pushes
        },
    }
    path = lab.run_dir / "gpubalance.yaml"
    path.write_text(yaml.safe_dump({"exporter": exporter}, sort_keys=False))
    return path


def start_stack(
    lab: LiveLab, build_dir: Path, timeout: float = 90.0
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """`gpubalance run --act` on the lab's HAProxy, on free loopback ports: the process and the
    parts' URLs, once all three listen."""
    log_path = lab.run_dir / "run.log"
    lab.procfs.mkdir(exist_ok=True)  # the exporter's --procfs must exist; its files follow
    token_path(lab).touch(mode=0o600)  # readable by this user only before it holds the token
    token_path(lab).write_text(secrets.token_urlsafe(24) + "\n")
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpubalance",
                "run",
                "--act",
                "--paused",
                "--token-file",
                str(token_path(lab)),
                "--config",
                str(run_config(lab, build_dir)),
                # HaproxyConfig's runtime socket, in the lab's run directory
                "--haproxy-socket",
                str(lab.run_dir / "haproxy.sock"),
                "--audit-log",
                str(lab.run_dir / "audit.jsonl"),
                "--exporter-listen",
                "127.0.0.1:0",
                "--analyzer-listen",
                "127.0.0.1:0",
                "--controller-listen",
                "127.0.0.1:0",
                "--analyzer-args",
                ANALYZER_ARGS,
                "--controller-args",
                CONTROLLER_ARGS,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "FAKE_NVML_STATE": str(lab.state_path)},
            start_new_session=True,  # the demo's Ctrl-C reaches it through stop_stack
        )
    deadline = time.monotonic() + timeout
    while not (match := STARTED.search(log_path.read_text(errors="replace"))):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_stack(process)
            raise RuntimeError(
                f"gpubalance run did not start; its log, {log_path}:\n"
                + log_path.read_text(errors="replace")
            )
        time.sleep(0.05)
    return process, dict(zip(("exporter", "analyzer", "controller"), match.groups(), strict=True))


def token_path(lab: LiveLab) -> Path:
    """The bearer token of the controller's control endpoints (and the analyzer's acks)."""
    return lab.run_dir / "token"


def resume(controller_url: str, token: str) -> None:
    """POST /api/v1/resume, as the person watching the paused controller would."""
    request = urllib.request.Request(
        f"{controller_url}/api/v1/resume",
        method="POST",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=5):
        pass


def stop_stack(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM, as systemd stops it: it stops its parts and exits 0."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


# -- the loop's panel --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Latencies:
    """The workers' latency histograms read at one moment: per worker (in the lab's order),
    cumulative counts per upper bound (seconds, +Inf last)."""

    at_seconds: float
    bounds: tuple[float, ...]
    counts: tuple[tuple[float, ...], ...]


def read_latencies(urls: list[str], at_seconds: float) -> Latencies | None:
    """Each worker's request-latency histogram; None when one cannot be read (a sum without
    it would read as a drop)."""
    per_worker: list[dict[float, float]] = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        buckets = {
            float(sample.labels["le"]): sample.value
            for family in text_string_to_metric_families(text)
            if family.name == LATENCY
            for sample in family.samples
            if sample.name == f"{LATENCY}_bucket"
        }
        per_worker.append(buckets)
    bounds = tuple(sorted(per_worker[0])) if per_worker else ()
    counts = tuple(tuple(w.get(b, 0.0) for b in bounds) for w in per_worker)
    return Latencies(at_seconds, bounds, counts)


def p99_between(
    first: Latencies, last: Latencies, worker: int | None = None
) -> tuple[float | None, int]:
    """The 99th percentile of the requests completed between two readings (by all workers, or
    by one), interpolated in its bucket as Prometheus' histogram_quantile does, and how many
    requests that is."""
    workers = range(len(last.counts)) if worker is None else [worker]
    counts = [
        sum(last.counts[w][i] - first.counts[w][i] for w in workers)
        for i in range(len(last.bounds))
    ]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None, 0
    rank = 0.99 * total
    i = bisect.bisect_left(counts, rank)
    finite = [b for b in last.bounds if b != float("inf")]
    if i >= len(finite):
        return finite[-1], int(total)  # in the +Inf bucket: the largest bound is what is known
    lower = finite[i - 1] if i > 0 else 0.0
    below = counts[i - 1] if i > 0 else 0.0
    share = (rank - below) / (counts[i] - below) if counts[i] > below else 1.0
    return lower + (finite[i] - lower) * share, int(total)


@dataclass(frozen=True, slots=True)
class Period:
    """What the workers and the exporter showed over a stretch of the run."""

    start_seconds: float
    end_seconds: float
    p99_seconds: float | None
    requests: int
    idle_while_queued_ratio: float | None
    p99_by_worker: tuple[float | None, ...] = ()

    def describe(self) -> str:
        p99 = "n/a" if self.p99_seconds is None else f"{self.p99_seconds:.2f} s"
        idle = (
            "n/a (no window yet)"
            if self.idle_while_queued_ratio is None
            else f"{self.idle_while_queued_ratio:.0%}"
        )
        by_gpu = " / ".join("-" if v is None else f"{v:.2f}" for v in self.p99_by_worker)
        return (
            f"p99 {p99} ({self.requests} requests; by GPU {by_gpu}), idle while queued {idle},"
            f" over {self.end_seconds - self.start_seconds:.0f} s"
        )


class LoopPanel:
    """The loop as its parts report it: the workers' latency histograms, the analyzer's
    idle-while-queued per window (read from the exporter) and the controller's audit log."""

    def __init__(self, worker_urls: list[str], audit_path: Path) -> None:
        self.worker_urls = worker_urls
        self.audit_path = audit_path
        self.analyzer_url: str | None = None  # once `gpubalance run` says where it listens
        self.readings: list[Latencies] = []  # appended by the reader thread only
        self.windows: list[tuple[float, float, float]] = []  # (start, end, idle-while-queued)
        self.entries: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, name="latencies", daemon=True)

    def start(self) -> None:
        """Read the workers' histograms every second from now on: the "before" starts with
        the traffic, not once the stack is up (by then the controller may have acted)."""
        self._reader.start()

    def stop(self) -> None:
        self._stop.set()
        self._reader.join(timeout=10)

    def _read(self) -> None:
        while not self._stop.is_set():
            reading = read_latencies(self.worker_urls, time.time())
            if reading is not None:
                self.readings.append(reading)
            self._stop.wait(1.0)

    def poll(self) -> None:
        """Read the analyzer's windows and the controller's audit log."""
        if self.analyzer_url is None:
            return
        try:
            url = f"{self.analyzer_url}/api/v1/diagnosis?history=1000"
            with urllib.request.urlopen(url, timeout=5) as resp:
                report = json.loads(resp.read())
            fleet = [*report["fleet_history"], *report["fleet"]]
            self.windows = sorted(
                {
                    (f["t_start"], f["t_end"], f["idle_while_queued_ratio"])
                    for f in fleet
                    if f["idle_while_queued_ratio"] is not None
                }
            )
        except (OSError, ValueError, KeyError):
            pass  # the analyzer starting: the windows read before stay
        if self.audit_path.exists():
            lines = self.audit_path.read_text().splitlines()
            self.entries = [json.loads(line) for line in lines if line.endswith("}")]

    @property
    def applied(self) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["decision"] == "applied"]

    @property
    def paused(self) -> bool:
        """The controller's last word on its pause is "paused" (a person resumes it)."""
        said = [e["decision"] for e in self.entries if e["decision"] in ("paused", "resumed")]
        return bool(said) and said[-1] == "paused"

    def would_change(self) -> list[str]:
        """The servers the paused controller would change now: its latest pass' waits."""
        waits = [
            e
            for e in self.entries
            if e["decision"] == "waiting" and str(e.get("reason", "")).startswith("paused")
        ]
        if not waits:
            return []
        latest = waits[-1]["at_seconds"]
        return sorted({str(e["target"]) for e in waits if e["at_seconds"] == latest})

    def _period(
        self, start: float, end: float, windows: list[tuple[float, float, float]]
    ) -> Period:
        inside = [r for r in self.readings if start <= r.at_seconds <= end]
        if len(inside) < 2:
            return Period(start, end, None, 0, None)
        p99, requests = p99_between(inside[0], inside[-1])
        by_worker = tuple(
            p99_between(inside[0], inside[-1], w)[0] for w in range(len(inside[-1].counts))
        )
        length = sum(e - s for s, e, _ in windows)
        idle = sum((e - s) * r for s, e, r in windows) / length if length > 0 else None
        return Period(start, end, p99, requests, idle, by_worker)

    def before(self) -> Period | None:
        """From the first reading to the controller's first change (or to now, if none)."""
        if not self.readings:
            return None
        applied = self.applied
        end = applied[0]["at_seconds"] if applied else self.readings[-1].at_seconds
        return self._period(
            self.readings[0].at_seconds, end, [w for w in self.windows if w[1] <= end]
        )

    def after(self) -> Period | None:
        """The latest RECENT_SECONDS after the controller's last change; the analyzer's
        windows that began after it."""
        applied = self.applied
        if not applied or not self.readings:
            return None
        last = applied[-1]["at_seconds"]
        now = self.readings[-1].at_seconds
        windows = [w for w in self.windows if w[0] >= last][-2:]
        period = self._period(max(last, now - RECENT_SECONDS), now, windows)
        return period if period.requests else None

    def render(self) -> Group:
        self.poll()
        if self.paused:
            header = (
                "loop · gpubalance run --act --paused: the controller plans and waits; "
                f"the demo resumes it (POST /api/v1/resume) after {WATCH_SECONDS:.0f} s"
            )
        else:
            header = "loop · gpubalance run --act: the controller acts through HAProxy"
        lines = [Text(header, "bold")]
        before, after = self.before(), self.after()
        if before is not None:
            label = "before the controller's first change" if after else "so far, no change yet"
            lines.append(Text(f"{label}: {before.describe()}"))
        if after is not None:
            lines.append(Text(f"after its last change: {after.describe()}"))
        elif self.applied:
            lines.append(Text("after its last change: waiting for the workers' next reading"))
        applied = self.applied
        lines.append(Text(f"controller: {len(applied)} change(s) applied"))
        lines.extend(Text(change_line(entry)) for entry in applied[-8:])
        if self.paused:
            targets = self.would_change()
            would = f"it would change {', '.join(targets)}" if targets else "no change planned yet"
            lines.append(Text(f"  paused; {would}"))
        elif not applied and self.entries:
            last = self.entries[-1]
            lines.append(Text(f"  last decision: {last['decision']}: {last.get('reason', '')}"))
        return Group(*lines)

    def changes(self) -> str:
        """Every change the controller applied over the run, as the audit log holds it (the
        panel shows the latest few; one may land after its last refresh)."""
        self.poll()
        applied = self.applied
        if not applied:
            return "controller: no change applied"
        return "\n".join(
            [f"controller: {len(applied)} change(s) applied ({self.audit_path})"]
            + [change_line(entry) for entry in applied]
        )

    def summary(self) -> str:
        before, after = self.before(), self.after()
        if before is None:
            return "before/after: no latency read from the workers"
        if after is None:
            return f"before/after: the controller made no change; over the run {before.describe()}"
        return (
            f"before/after ({len(self.applied)} change(s) by the controller): "
            f"{_change(before.p99_seconds, after.p99_seconds, 's', '.2f')} p99, "
            f"{_change(before.idle_while_queued_ratio, after.idle_while_queued_ratio, '', '.0%')}"
            " idle while queued"
        )


def change_line(entry: Mapping[str, Any]) -> str:
    """One applied change of the audit log, as the loop panel lists it."""
    at = time.strftime("%H:%M:%S", time.localtime(entry["at_seconds"]))
    return (
        f"  {at} {entry['action']} {entry['target']} {entry['before']} -> {entry['after']}"
        f" ({entry['recommendation']})"
    )


def _change(before: float | None, after: float | None, unit: str, form: str) -> str:
    def one(value: float | None) -> str:
        return "n/a" if value is None else f"{value:{form}}" + (f" {unit}" if unit else "")

    return f"{one(before)} -> {one(after)}"


# -- the demo ----------------------------------------------------------------------------------


def run_demo(build_dir: Path, duration: float | None) -> int:
    from gpubalance.exporter.top import watch

    plan = scenario.load(DEMO_SCENARIO)
    horizon = (duration or FOREVER_SECONDS) + START_ALLOWANCE_SECONDS
    requests = traffic.generate(plan.scenario.traffic, horizon, plan.scenario.seed)
    ready = threading.Event()
    lab = LiveLab(
        plan,
        requests,
        horizon,
        build_dir=build_dir,
        metrics_formats=(METRICS_FORMAT,),
        on_ready=lambda _: ready.set(),
        keep_files=True,  # the demo names its run directory: it is there to be looked at
    )
    shown = False
    failure: list[BaseException] = []
    stack: subprocess.Popen[bytes] | None = None
    panel: LoopPanel | None = None
    resumer: threading.Timer | None = None
    unresumed: list[str] = []  # why the demo could not resume the controller

    def serve() -> None:
        try:
            asyncio.run(lab.run())
        except BaseException as exc:  # shown to the user below
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=serve, name="live-lab", daemon=True)
    thread.start()
    try:
        ready.wait()
        if failure:
            raise failure[0]
        panel = LoopPanel(
            [f"http://127.0.0.1:{c.port}/metrics" for c in lab.configs.values()],
            lab.run_dir / "audit.jsonl",
        )
        panel.start()
        stack, urls = start_stack(lab, build_dir)
        panel.analyzer_url = urls["analyzer"]
        wait_http(urls["exporter"] + "/healthz")
        print(f"{plan.scenario.name}: {plan.scenario.description}")
        print(
            f"exporter: {urls['exporter']}/metrics   analyzer: {urls['analyzer']}/api/v1/diagnosis"
            f"   controller: {urls['controller']}/metrics"
            f"   HAProxy frontend: http://127.0.0.1:{lab.frontend_port}   lab files: {lab.run_dir}"
        )
        shown = True

        def resume_controller() -> None:
            try:
                resume(urls["controller"], token_path(lab).read_text().strip())
            except OSError as exc:
                unresumed.append(str(exc))

        resumer = threading.Timer(WATCH_SECONDS, resume_controller)
        resumer.daemon = True
        resumer.start()
        code = watch(
            urls["exporter"],
            refresh=1.0,
            duration=duration,
            analyzer=urls["analyzer"],
            below=panel.render,
        )
        stopped = stop_stack(stack)
        stack = None
        if stopped != 0:
            print(f"gpubalance run exited with {stopped}; its log: {lab.run_dir / 'run.log'}")
            code = code or 1
        print(panel.changes())
        print(panel.summary())
        for reason in unresumed:
            print(f"the demo could not resume the controller: {reason}")
        return code
    finally:
        if resumer is not None:
            resumer.cancel()
        if panel is not None:
            panel.stop()
        if stack is not None:
            stop_stack(stack)
        if thread.is_alive():  # else its traffic ended, and its event loop with it
            lab.halt()
        thread.join(timeout=60)
        if shown:
            print(f"lab files kept in {lab.run_dir}; remove them with: rm -r {lab.run_dir}")
        else:
            shutil.rmtree(lab.run_dir, ignore_errors=True)
