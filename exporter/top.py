"""Live terminal view of one exporter: per GPU utilization, memory and its trend, power, clocks,
throttling and the host processes feeding it, read from /api/v1/snapshot every second; with
--analyzer, each GPU's verdict, cause and evidence and the current recommendations below it, read
from the analyzer's API.

On a terminal it redraws in place and keeps retrying an exporter it cannot read, the error on
screen; in a pipe it prints one table per refresh and exits with status 1 at the first read that
fails, so a script sees a dead URL.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING

from pydantic import TypeAdapter
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpubalance.snapshot import Snapshot, from_json

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import RenderableType

    from gpubalance.analyzer.service import DiagnosisReport, RecommendationsReport

GIB = 1024**3


def _seconds(text: str) -> float:
    """A positive number of seconds, for argparse: its error names the flag and the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _url(text: str) -> str:
    """An http(s) base URL, for argparse."""
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"expected an http:// or https:// URL, e.g. http://127.0.0.1:9450, got {text!r}"
        )
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        type=_url,
        default="http://127.0.0.1:9450",
        help="exporter base URL (default http://127.0.0.1:9450)",
    )
    parser.add_argument(
        "--refresh",
        type=_seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds between reads (default 1)",
    )
    parser.add_argument(
        "--duration",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default: until Ctrl-C)",
    )
    parser.add_argument(
        "--analyzer",
        type=_url,
        default=None,
        metavar="URL",
        help="an analyzer's base URL (`gpubalance analyzer`, http://127.0.0.1:9451): show each "
        "GPU's verdict and the current recommendations below the exporter's table",
    )


def fetch(url: str, timeout: float = 5.0) -> Snapshot:
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/snapshot", timeout=timeout) as resp:
        return from_json(resp.read())


def _bar(ratio: float | None, width: int = 10) -> Text:
    if ratio is None:
        return Text("n/a", style="dim")
    filled = round(max(0.0, min(1.0, ratio)) * width)
    style = "red" if ratio >= 0.9 else "yellow" if ratio >= 0.6 else "green"
    return Text("█" * filled + "·" * (width - filled), style=style) + Text(f" {ratio:4.0%}")


def _fmt(value: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{unit}"


def render(snapshot: Snapshot) -> Group:
    sample, window = snapshot.sample, snapshot.window
    gpu_windows = {w.uuid: w for w in window.gpus}
    table = Table(
        title=f"gpubalance · {sample.hostname} · "
        f"{time.strftime('%H:%M:%S', time.localtime(sample.timestamp_seconds))}",
        expand=False,
    )
    for column in (
        "GPU",
        "model",
        f"util ({snapshot.window_seconds:.0f}s)",
        "memory",
        "trend",
        "temp",
        "power",
        "SM clock",
        "throttle",
        "queue",
        f"wait ({snapshot.window_seconds:.0f}s)",
        "processes",
    ):
        table.add_column(column, no_wrap=True)
    for gpu in sample.gpus:
        if gpu.lost or gpu.stale:
            # a stale GPU's reads are hung in the driver: no values, and the call it waits in
            state = (
                Text("LOST", style="bold red")
                if gpu.lost
                else Text(f"STALE in {gpu.stale_call or 'NVML'}", style="bold yellow")
            )
            table.add_row(str(gpu.index), gpu.name or "?", state, *([""] * 9))
            continue
        win = gpu_windows.get(gpu.uuid)
        memory = "n/a"
        if gpu.memory_used_bytes is not None and gpu.memory_total_bytes:
            memory = f"{gpu.memory_used_bytes / GIB:5.1f}/{gpu.memory_total_bytes / GIB:4.1f} GiB"
        trend = "n/a"
        if win is not None and win.memory_used_slope_bytes_per_second is not None:
            trend = f"{win.memory_used_slope_bytes_per_second / 2**20:+.1f} MiB/s"
            if win.memory_time_to_full_seconds is not None:
                trend += f" full in {_duration(win.memory_time_to_full_seconds)}"
        power = _fmt(gpu.power_watts, ".0f")
        if gpu.power_limit_watts:
            power += f"/{gpu.power_limit_watts:.0f} W"
        reasons = sorted((gpu.throttle_reasons or frozenset()) - {"gpu_idle"})
        queue, wait = _serving(snapshot, gpu.index)
        procs = []
        for proc in gpu.processes:
            host = sample.processes.get(proc.pid)
            cpu = window.processes.get(proc.pid)
            label = f"{host.name if host else '?'}/{proc.pid}"
            if cpu is not None:
                label += f" cpu {cpu.cpu_usage_ratio:.0%}"
            procs.append(label)
        table.add_row(
            str(gpu.index),
            (gpu.name or "?").replace("NVIDIA GeForce ", ""),
            _bar(win.utilization_ratio if win else gpu.utilization_ratio),
            memory,
            trend,
            _fmt(gpu.temperature_celsius, ".0f", " °C"),
            power,
            _fmt(None if gpu.sm_clock_hertz is None else gpu.sm_clock_hertz / 1e6, ".0f", " MHz"),
            Text(",".join(reasons) or "-", style="red" if reasons else "dim"),
            queue,
            wait,
            ", ".join(procs) or "-",
        )
    lines = [table]
    if window.host is not None:
        busy = window.host.cpu_busy_ratio
        host_line = (
            f"host: {len(busy)} CPUs, busy mean {sum(busy) / max(len(busy), 1):.0%} "
            f"max {max(busy, default=0):.0%}, iowait {window.host.cpu_iowait_ratio:.0%}"
        )
        lines.append(Text(host_line))
    if not sample.nvml.up:
        lines.append(Text(f"NVML down: {sample.nvml.error}", style="bold red"))
    return Group(*lines)


def _duration(seconds: float) -> str:
    """Seconds under a minute, minutes under an hour, then hours, then days."""
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    if seconds < 3570:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} d"


def _serving(snapshot: Snapshot, gpu: int) -> tuple[Text, str]:
    """Requests waiting in front of the GPU now, and their mean batch-assembly delay over the
    window (from the serving sources mapped to it)."""
    depths = [
        s.queue_depth
        for s in snapshot.sample.serving
        if s.gpu_index == gpu and s.queue_depth is not None
    ]
    waits = [
        w.batch_assembly_delay_seconds
        for w in snapshot.window.serving
        if w.gpu_index == gpu and w.batch_assembly_delay_seconds is not None
    ]
    if not depths:
        queue = Text("-", style="dim")
    else:
        total = sum(depths)
        queue = Text(f"{total:.0f}", style="red" if total >= 8 else "yellow" if total else "")
    wait = "-" if not waits else f"{1000 * max(waits):.0f} ms"
    return queue, wait


# -- the analyzer's panel ----------------------------------------------------------------------

STATE_STYLES = {
    "overloaded": "bold red",
    "starved": "bold yellow",
    "balanced": "green",
    "unknown": "magenta",
}
FLEET_STYLES = {
    "imbalance": "bold red",
    "capacity_shortage": "bold red",
    "over_provisioning": "bold yellow",
    "balanced": "green",
    "unknown": "magenta",
}
RECOMMENDATIONS_SHOWN = 3


def fetch_analysis(url: str, timeout: float = 5.0) -> tuple[DiagnosisReport, RecommendationsReport]:
    """The analyzer's diagnosis and recommendations, as the types it serves."""
    diagnosis_type, recommendations_type = _analysis_types()

    def get(path: str) -> bytes:
        with urllib.request.urlopen(f"{url.rstrip('/')}{path}", timeout=timeout) as resp:
            return resp.read()

    diagnosis = diagnosis_type.validate_json(get("/api/v1/diagnosis"))
    recommendations = recommendations_type.validate_json(get("/api/v1/recommendations"))
    return diagnosis, recommendations


@functools.cache
def _analysis_types() -> tuple[TypeAdapter[DiagnosisReport], TypeAdapter[RecommendationsReport]]:
    """The analyzer's answer types (imported only with --analyzer: they bring numpy along)."""
    from gpubalance.analyzer.service import DiagnosisReport, RecommendationsReport

    return TypeAdapter(DiagnosisReport), TypeAdapter(RecommendationsReport)


def render_analysis(diagnosis: DiagnosisReport, recommendations: RecommendationsReport) -> Group:
    """Each GPU's verdict now, each pool's, and the recommendations to act on first."""
    source = diagnosis.source
    lines: list[Table | Text] = []
    table = Table(
        title=f"analyzer · {diagnosis.classifier} · windows of {diagnosis.window_seconds:g} s",
        expand=False,
    )
    for column in ("GPU", "verdict", "cause", "conf", "evidence (now)"):
        table.add_column(column, no_wrap=column != "evidence (now)")
    for verdict in diagnosis.gpus:
        # Text, not str: evidence is the telemetry's words, never rich markup
        table.add_row(
            Text(str(verdict.gpu)),
            Text(verdict.state, style=STATE_STYLES.get(verdict.state, "")),
            Text(verdict.cause if verdict.state != "unknown" else "-"),
            Text(f"{verdict.confidence:.2f}"),
            Text(
                verdict.unknown_reason or (verdict.evidence[0] if verdict.evidence else ""),
            ),
        )
    if diagnosis.gpus:
        lines.append(table)
    elif source.up is None:
        lines.append(Text("analyzer: first pull of its source under way", style="dim"))
    elif source.up:
        lines.append(Text("analyzer: no complete window yet", style="dim"))
    if source.up is False:
        lines.append(Text(f"analyzer: source down: {source.error}", style="bold red"))
    for fleet in diagnosis.fleet:
        line = Text(f"pool {fleet.pool or '(unnamed)'}: ")
        line.append(fleet.kind.replace("_", " "), style=FLEET_STYLES.get(fleet.kind, ""))
        if fleet.idle_while_queued_ratio is not None:
            line.append(f", idle while queued {fleet.idle_while_queued_ratio:.0%}")
        lines.append(line)
    if recommendations.recommender is None:
        lines.append(
            Text("recommendations: none (the analyzer runs without a recommender)", style="dim")
        )
    elif not recommendations.recommendations:
        lines.append(Text("recommendations: none now", style="dim"))
    for recommendation in recommendations.recommendations[:RECOMMENDATIONS_SHOWN]:
        line = Text("recommend ", style="bold")
        line.append(f"{recommendation.action} {recommendation.target}", style="bold cyan")
        line.append(f" ({recommendation.confidence:.2f}): {recommendation.reason}")
        if recommendation.acks:
            last = recommendation.acks[-1]
            line.append(f" [{last.status} by {last.by}]", style="dim")
        lines.append(line)
    return Group(*lines)


def _analysis_view(url: str) -> Group | Text:
    try:
        return render_analysis(*fetch_analysis(url))
    except (OSError, ValueError) as exc:  # the analyzer may be starting: say so, keep going
        return Text(f"analyzer: {_read_error(url, exc, 'analyzer')}", style="bold red")


def run(args: argparse.Namespace) -> int:
    return watch(args.url, args.refresh, args.duration, args.analyzer)


def _read_error(url: str, exc: OSError | ValueError, what: str = "exporter") -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"{url} answered HTTP {exc.code} {exc.reason}: is it a gpubalance {what}?"
    if isinstance(exc, OSError):
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return f"cannot reach {url}: {reason}"
    return f"{url} did not answer as a gpubalance {what} does: {exc}"


def watch(
    url: str,
    refresh: float = 1.0,
    duration: float | None = None,
    analyzer: str | None = None,
    below: Callable[[], RenderableType] | None = None,
) -> int:
    """Show ``url`` every ``refresh`` s, for ``duration`` s or until Ctrl-C, with ``analyzer``'s
    panel below when given, and what ``below`` draws under it (the demo's loop panel). Returns 1
    when the last read of the exporter failed (in a pipe, the first failure ends the run), else
    0; an analyzer that cannot be read is shown, not fatal."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a pipe or a log file: no reason to truncate columns
    deadline = None if duration is None else time.monotonic() + duration
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    failed = False
    try:
        if live is not None:
            live.start()
        while deadline is None or time.monotonic() < deadline:
            try:
                view: Group | Text = render(fetch(url))
                if analyzer is not None:
                    view = Group(view, _analysis_view(analyzer))
                if below is not None:
                    view = Group(view, below())
                failed = False
            except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
                failed = True
                message = _read_error(url, exc)
                if live is None:
                    print(f"gpubalance top: {message}", file=sys.stderr)
                    return 1
                view = Text(f"{message} (retrying every {refresh:g} s)", style="bold red")
            if live is not None:
                live.update(view, refresh=True)
            else:
                console.print(view)
            time.sleep(refresh)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(watch(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:9450"))
