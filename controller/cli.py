"""Act on the analyzer's recommendations through HAProxy: dry-run unless --act; with --paused,
only once a person resumes it.

Each pass reads HAProxy's servers (runtime socket) and the analyzer's recommendations, plans the
changes, guards them, carries them out (runtime API or agent-check), and records every decision
in the audit log, the metrics and an ack to the analyzer.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpubalance.arguments import positive_int
from gpubalance.controller.audit import KEEP, MAX_BYTES
from gpubalance.controller.model import Settings

if TYPE_CHECKING:
    from gpubalance.controller.supervisor import WorkersConfig

DEFAULT_LISTEN = "127.0.0.1:9470"


def configure(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument("--analyzer", required=True, metavar="URL", help="the analyzer's base URL")
    parser.add_argument(
        "--haproxy-socket",
        required=True,
        metavar="PATH",
        help="HAProxy's runtime socket (level admin for --actuator runtime_api)",
    )
    parser.add_argument(
        "--act", action="store_true", help="carry changes out; without it nothing changes"
    )
    parser.add_argument(
        "--paused",
        action="store_true",
        help="start paused: plan and log what it would do until a person's POST "
        "/api/v1/resume (needs --token-file); a pause holds across restarts",
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        type=_listen,
        help=f"HOST:PORT of /metrics and /api/v1 (default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer token for POST pause/resume/rearm and for the analyzer; needed to listen "
        "beyond 127.0.0.1",
    )
    parser.add_argument(
        "--web.config.file",
        dest="web_config_file",
        metavar="FILE",
        help="TLS and rate limit of the listener (exporter-toolkit format)",
    )
    parser.add_argument(
        "--actuator",
        choices=("runtime_api", "agent_check"),
        default="runtime_api",
        help="how changes reach HAProxy (default runtime_api)",
    )
    parser.add_argument(
        "--agent-listen",
        default="127.0.0.1:9471",
        type=_listen,
        help="HOST:PORT the agent-check responder listens on (default 127.0.0.1:9471)",
    )
    parser.add_argument(
        "--audit-log",
        type=Path,
        default=Path("gpubalance-controller-audit.jsonl"),
        help="JSON lines, appended (default ./gpubalance-controller-audit.jsonl)",
    )
    parser.add_argument(
        "--audit-log-max-bytes",
        type=positive_int,
        default=MAX_BYTES,
        metavar="BYTES",
        help=f"rotate the audit log past this size (default {MAX_BYTES})",
    )
    parser.add_argument(
        "--audit-log-keep",
        type=positive_int,
        default=KEEP,
        metavar="N",
        help=f"rotated audit logs kept, PATH.1 the newest (default {KEEP})",
    )
    parser.add_argument(
        "--backend", action="append", metavar="NAME", help="a backend to manage (default: all)"
    )
    parser.add_argument("--host", help="act only on recommendations for this host name")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="the config file; its controller.workers section (the worker command, the GPUs) "
        "lets the controller move workers between pools",
    )
    limits = parser.add_argument_group("guardrails")
    limits.add_argument("--interval", type=float, default=d.interval_seconds, help="seconds")
    limits.add_argument(
        "--max-age",
        type=float,
        default=d.max_age_seconds,
        help="seconds: refuse recommendations resting on older telemetry",
    )
    limits.add_argument("--max-weight-step", type=int, default=d.max_weight_step)
    limits.add_argument("--dwell-cycles", type=int, default=d.dwell_cycles)
    limits.add_argument("--freeze", type=float, default=d.freeze_seconds, help="seconds")
    limits.add_argument("--max-actions-per-hour", type=int, default=d.max_actions_per_hour)
    limits.add_argument("--drain-timeout", type=float, default=d.drain_timeout_seconds)
    limits.add_argument("--breaker-share", type=float, default=d.breaker_share)
    limits.add_argument("--breaker-window", type=float, default=d.breaker_window_seconds)
    limits.add_argument(
        "--breaker-weight-share",
        type=float,
        default=d.breaker_weight_share,
        help="a re-weighted server counts for the breaker once its share of the backend's "
        "weight fell by more than this, or rose by more than this above its share before and "
        "an even split",
    )
    limits.add_argument(
        "--undo-worse-ratio",
        type=float,
        default=d.undo_worse_ratio,
        help="after its freeze, undo a recommendation whose backend's mean time in the system "
        "grew more than this many times",
    )


def _listen(value: str) -> tuple[str, int]:
    from gpubalance.webconfig import parse_listen

    try:
        return parse_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _token(path: str | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        settings = Settings(
            act=args.act,
            host=args.host,
            backends=frozenset(args.backend) if args.backend else None,
            interval_seconds=args.interval,
            max_age_seconds=args.max_age,
            max_weight_step=args.max_weight_step,
            dwell_cycles=args.dwell_cycles,
            freeze_seconds=args.freeze,
            max_actions_per_hour=args.max_actions_per_hour,
            drain_timeout_seconds=args.drain_timeout,
            breaker_share=args.breaker_share,
            breaker_window_seconds=args.breaker_window,
            breaker_weight_share=args.breaker_weight_share,
            undo_worse_ratio=args.undo_worse_ratio,
        )
        token = _token(args.token_file)
        workers = _workers(args.config)
    except (ValueError, OSError) as exc:
        print(f"gpubalance controller: {exc}", file=sys.stderr)
        return 2
    if args.paused and token is None:
        print(
            "gpubalance controller: --paused needs --token-file: a person resumes it with "
            "POST /api/v1/resume and that token",
            file=sys.stderr,
        )
        return 2
    if token is None and not _loopback(args.listen[0]):
        print(
            f"gpubalance controller: listening on {args.listen[0]} (beyond 127.0.0.1) needs "
            "--token-file",
            file=sys.stderr,
        )
        return 2
    return asyncio.run(serve(args, settings, token, workers))


def _workers(path: str | None) -> WorkersConfig | None:
    from pydantic import ConfigDict, create_model

    from gpubalance.config import ConfigError, load_section
    from gpubalance.controller.supervisor import WorkersConfig

    # the controller section holds only the workers' settings so far; flags set the rest
    section = create_model(
        "ControllerSection",
        __config__=ConfigDict(extra="forbid"),
        workers=(WorkersConfig | None, None),
    )
    if path is None:
        return None
    try:
        return load_section(section, path, "controller").workers
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


async def serve(
    args: argparse.Namespace,
    settings: Settings,
    token: str | None,
    workers: WorkersConfig | None = None,
) -> int:
    import aiohttp
    from aiohttp import web

    from gpubalance.config import ConfigError
    from gpubalance.controller.agent import AgentCheckResponder
    from gpubalance.controller.analyzer_client import AnalyzerClient
    from gpubalance.controller.audit import AuditLog
    from gpubalance.controller.haproxy import RuntimeApi
    from gpubalance.controller.loop import Controller
    from gpubalance.controller.metrics import Metrics
    from gpubalance.controller.mover import Mover
    from gpubalance.controller.runtime_actuator import RuntimeApiActuator
    from gpubalance.controller.server import ControlServer
    from gpubalance.controller.tracing import from_environment
    from gpubalance.webconfig import WebSecurity

    log = logging.getLogger("gpubalance.controller")
    try:
        security = WebSecurity(args.web_config_file)
    except ConfigError as exc:
        print(f"gpubalance controller: {exc}", file=sys.stderr)
        return 2
    if security.config.users:
        print(
            "gpubalance controller: --web.config.file sets basic_auth_users, but the control "
            "endpoints take a bearer token (--token-file) in the same header; keep TLS only",
            file=sys.stderr,
        )
        return 2
    api = RuntimeApi(args.haproxy_socket)
    agent = None
    if args.actuator == "agent_check":
        agent = AgentCheckResponder()
        actuator = agent
    else:
        actuator = RuntimeApiActuator(api)
    tracing = from_environment()
    if tracing.endpoint is not None:
        log.info("traces of the decisions go to %s (OTLP/HTTP)", tracing.endpoint)
    async with aiohttp.ClientSession() as session:
        audit = AuditLog(
            args.audit_log, max_bytes=args.audit_log_max_bytes, keep=args.audit_log_keep
        )
        metrics = Metrics()
        mover = None
        if workers is not None:
            from gpubalance.controller.worker_backends import supervisor_for

            runtime = RuntimeApiActuator(api)
            supervisor = supervisor_for(workers)
            mover = Mover(supervisor, runtime, audit, metrics, settings, session, tracing.tracer)
        controller = Controller(
            api,
            actuator,
            AnalyzerClient(args.analyzer, session, token=token),
            audit,
            metrics,
            settings,
            mover=mover,
            tracer=tracing.tracer,
        )
        if args.paused and not controller.paused:
            controller.pause()
        app = ControlServer(controller, token).app()
        security.install(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await security.listen(runner.server, *args.listen)
            if agent is not None:
                where = await agent.start(*args.agent_listen)
                log.info("agent-check responder on %s:%d", *where)
        except OSError as exc:
            await runner.cleanup()
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            print(f"gpubalance controller: cannot listen: {reason}", file=sys.stderr)
            return 2
        for url in security.urls():
            log.info("listening on %s", url)
        log.info(
            "%s; audit log %s",
            "acting" if controller.settings.act else "dry-run (start with --act to act)",
            args.audit_log,
        )
        if controller.paused:
            log.warning("paused: it plans and logs, and acts after POST /api/v1/resume")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await controller.run(stop)
        log.info("stopping")
        if agent is not None:
            await agent.close()
        security.close()
        await runner.cleanup()
        controller.audit.close()
    await asyncio.to_thread(tracing.shutdown)
    return 0
