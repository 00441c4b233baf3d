"""Run the host exporter: NVML, /proc and serving signals sampled in the background, served as
Prometheus metrics (/metrics), a JSON snapshot (/api/v1/snapshot) and a health check (/healthz).

Settings come from the `exporter:` section of --config FILE; flags override it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import TYPE_CHECKING, Any

from gpubalance.config import LOG_FORMAT

if TYPE_CHECKING:
    from gpubalance.exporter.config import ExporterConfig


def configure(parser: argparse.ArgumentParser) -> None:
    from gpubalance.exporter.collectors import REGISTRY

    parser.add_argument("--config", metavar="FILE", help="YAML configuration file")
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="address to serve on (default :9450; port 0 picks a free one)",
    )
    parser.add_argument(
        "--web.config.file",
        dest="web_config_file",
        metavar="FILE",
        help="TLS and basic auth of the scrape port, in the exporter-toolkit format that "
        "node_exporter reads; reloaded on SIGHUP",
    )
    parser.add_argument(
        "--otlp-listen",
        type=_listen,
        metavar="HOST:PORT",
        help="address of the OTLP/HTTP receiver (default 127.0.0.1:4318; beyond loopback it "
        "needs TLS and a token, see exporter.serving.otlp)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        metavar="SECONDS",
        help="seconds between background samples (default 1)",
    )
    parser.add_argument(
        "--window",
        type=float,
        metavar="SECONDS",
        help="seconds averaged by window figures (default 30)",
    )
    parser.add_argument(
        "--trend-window",
        type=float,
        metavar="SECONDS",
        help="seconds of memory trend for slope and time to full (default 300)",
    )
    parser.add_argument(
        "--names", choices=("native", "dcgm", "both"), help="metric naming profile (default native)"
    )
    parser.add_argument("--procfs", metavar="PATH", help="procfs root to read (default /proc)")
    parser.add_argument(
        "--nvml-library", metavar="PATH", help="load this libnvidia-ml.so.1 before NVML init"
    )
    parser.add_argument(
        "--hostname",
        help="Hostname label of the DCGM profile (default: $NODE_NAME, else the host name)",
    )
    parser.add_argument(
        "--serving",
        action="append",
        default=[],
        metavar="FORMAT=URL",
        help="scrape a serving endpoint, FORMAT one of triton, vllm, tgi, sglang (repeatable; "
        "its GPU is found from the process on its port; map GPUs in --config otherwise)",
    )
    for spec in REGISTRY.values():
        parser.add_argument(
            f"--collector.{spec.name}",
            dest=f"collector__{spec.name}",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{spec.help} (default {'on' if spec.default_enabled else 'off'})",
        )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="take one sample, print the /metrics text and exit (1 when NVML did not come up)",
    )
    parser.add_argument(
        "--print-schema",
        action="store_true",
        help="print the JSON Schema of /api/v1/snapshot and exit",
    )


def _listen(value: str) -> str:
    from gpubalance.webconfig import parse_listen

    try:
        parse_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _with_otlp_listen(config: Any, listen: str | None) -> Any:
    """The config with --otlp-listen in place of exporter.serving.otlp.listen (checked above),
    keeping the file's other OTLP keys."""
    if listen is None:
        return config
    otlp = config.serving.otlp.model_copy(update={"listen": listen})
    return config.model_copy(update={"serving": config.serving.model_copy(update={"otlp": otlp})})


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    collectors = {
        key.removeprefix("collector__"): value
        for key, value in vars(args).items()
        if key.startswith("collector__") and value is not None
    }
    return {
        "listen": args.listen,
        "interval": args.interval,
        "window": args.window,
        "trend_window": args.trend_window,
        "names": args.names,
        "procfs": args.procfs,
        "nvml_library": args.nvml_library,
        "hostname": args.hostname,
        "collectors": collectors or None,
    }


def _flag_endpoints(specs: list[str]) -> list[dict[str, str]]:
    endpoints = []
    for spec in specs:
        form, sep, url = spec.partition("=")
        if not sep:
            raise ValueError(
                f"--serving {spec!r}: expected FORMAT=URL, e.g. vllm=http://127.0.0.1:8000/metrics"
            )
        endpoints.append({"format": form, "url": url})
    return endpoints


def load_config(args: argparse.Namespace) -> ExporterConfig:
    """The config file with the flags applied; --serving endpoints add to the file's.

    An endpoint given both ways (same URL) takes the flag's format.
    """
    from gpubalance.config import load_section
    from gpubalance.exporter.config import ExporterConfig

    overrides = _overrides(args)
    config = load_section(ExporterConfig, args.config, "exporter", overrides)
    if not args.serving:
        return config
    flagged = _flag_endpoints(args.serving)
    urls = {e["url"] for e in flagged}
    kept = [
        e.model_dump(by_alias=True, exclude_none=True)
        for e in config.serving.endpoints
        if e.url not in urls
    ]
    replaced = len(config.serving.endpoints) - len(kept)
    if config.serving.endpoints:
        logging.getLogger("gpubalance.exporter").info(
            "--serving adds %d endpoint(s) to the %d of %s%s",
            len(flagged) - replaced,
            len(config.serving.endpoints),
            args.config,
            f" ({replaced} given both ways: the flag's format is used)" if replaced else "",
        )
    overrides["serving"] = {"endpoints": kept + flagged}
    return load_section(ExporterConfig, args.config, "exporter", overrides)


def run(args: argparse.Namespace) -> int:
    from gpubalance.config import ConfigError
    from gpubalance.exporter.otlp import OtlpListener
    from gpubalance.webconfig import WebSecurity

    if args.print_schema:
        from gpubalance.snapshot import json_schema

        print(json.dumps(json_schema(), indent=2, sort_keys=True))
        return 0
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        config = _with_otlp_listen(load_config(args), args.otlp_listen)
        check_paths(config)
        collectors = build_collectors(config)
        security = WebSecurity(args.web_config_file)
        otlp = OtlpListener.from_settings(config.serving.otlp)
    except (ConfigError, ValueError) as exc:
        print(f"gpubalance exporter: {exc}", file=sys.stderr)
        return 2
    from gpubalance.exporter.sampler import Sampler

    sampler = Sampler(config, collectors, config.resolved_hostname())
    if args.once:
        from gpubalance.exporter.exposition.profiles import render

        try:
            serving = next((c for c in collectors if getattr(c, "name", "") == "serving"), None)
            if serving is not None:
                asyncio.run(serving.scraper.scrape_once())
            view = sampler.sample_once()
            sys.stdout.buffer.write(render(view, config.names))
        finally:
            sampler.stop()
        nvml = view.sample.nvml
        if not nvml.up and any(c.name == "gpu" for c in collectors):
            # the metrics are printed all the same: the host part of them is still good
            print(f"gpubalance exporter: NVML did not come up: {nvml.error}", file=sys.stderr)
            return 1
        return 0
    return asyncio.run(serve(config, sampler, security, otlp))


def check_paths(config: ExporterConfig) -> None:
    """Paths that cannot work: refused at start (exit 2), not retried or skipped for ever."""
    from gpubalance.exporter.collectors import enabled_specs
    from gpubalance.exporter.nvml import library_problem

    enabled = {spec.name for spec in enabled_specs(config.collectors)}
    # Only the root must exist at start: its files may follow (a procfs tree being written).
    if enabled & {"host", "processes"} and not os.path.isdir(config.procfs):
        what = "is not a directory" if os.path.exists(config.procfs) else "does not exist"
        raise ValueError(
            f"--procfs {config.procfs} {what}: point it at a mounted procfs, e.g. the "
            "host's /proc mounted at /host/proc (exporter.procfs in --config)"
        )
    if "gpu" in enabled and config.nvml_library:
        problem = library_problem(config.nvml_library)
        if problem is not None:
            raise ValueError(f"--nvml-library: {problem}")


def build_collectors(config: Any) -> list[Any]:
    from gpubalance.exporter.collectors import enabled_specs

    return [spec.factory(config) for spec in enabled_specs(config.collectors)]


# the workers that decode OTLP pushes and parse serving scrapes off the event loop: asyncio's
# default executor's size
WORK_THREADS = min(32, (os.cpu_count() or 1) + 4)


def started_executor(threads: int = WORK_THREADS) -> ThreadPoolExecutor:
    """A pool with all its threads running: a pool starts threads as work queues up, so a busy
    minute would add threads long after start, which a soak would read as a leak."""
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpubalance-work")
    everyone = threading.Barrier(threads)  # each task waits for the others: one thread each
    wait_all([executor.submit(everyone.wait) for _ in range(threads)])
    return executor


async def serve(config: Any, sampler: Any, security: Any, otlp: Any = None) -> int:
    from aiohttp import web

    from gpubalance.exporter.server import ExporterServer

    log = logging.getLogger("gpubalance.exporter")
    asyncio.get_running_loop().set_default_executor(started_executor())
    server = ExporterServer(sampler, config)
    app = server.app()
    security.install(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = config.listen_address
    try:
        await security.listen(runner.server, host, port)
    except OSError as exc:
        await runner.cleanup()
        sampler.stop()
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        print(f"gpubalance exporter: cannot listen on {config.listen}: {reason}", file=sys.stderr)
        return 2
    log.info("web config %s: %s", security.config.source, security.config.describe())
    for url in security.urls():
        log.info("listening on %s", url)
    otlp_runner = None
    if otlp is not None and server.serving is not None:
        try:
            otlp_runner, server.otlp_url = await otlp.start(server.serving.store)
        except OSError as exc:
            security.close()
            await runner.cleanup()
            sampler.stop()
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            listen = config.serving.otlp.listen
            print(
                f"gpubalance exporter: cannot listen on {listen} (exporter.serving.otlp.listen,"
                f" --otlp-listen): {reason}",
                file=sys.stderr,
            )
            return 2
        log.info("OTLP receiver at %s", server.otlp_url)
    sampler.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if security.path:
        loop.add_signal_handler(signal.SIGHUP, security.reload_soon)
    await stop.wait()
    log.info("stopping")
    if otlp_runner is not None:
        await otlp_runner.cleanup()
    security.close()
    await runner.cleanup()
    sampler.stop()
    return 0
