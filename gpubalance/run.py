"""Run the exporter, the analyzer and the controller of one host, in one command.

Each part is the real one, as its own process, talking to the next over HTTP: the analyzer
reads the exporter, the controller reads the analyzer and the host's HAProxy runtime socket.
The controller is dry-run unless --act, and with --paused waits for a person's POST
/api/v1/resume before it acts. Everything listens on 127.0.0.1 unless told otherwise.

--config FILE is the one config file, in the format the parts read: its `exporter:` section
(every key of `gpubalance exporter --config`; exporter.listen is used when --exporter-listen is
not given) and its `controller:` section (`controller.workers`: the worker command and the GPUs,
to let the controller move workers between pools). The analyzer's settings are flags.

The parts start at once, each told where the one it reads listens; a part is up once it logs
"listening on URL" (keep their --log-level at info). Each part's listening socket is bound here
and handed down (its file descriptor in GPUBALANCE_LISTEN_FD), so that a port chosen here,
port 0 made a free one included, cannot be taken by another process before the part binds it.
SIGINT or SIGTERM stops the three (controller first) and exits 0. A part that exits on its
own is named and the others are stopped: the command exits 1 (2 when a part refused its input
at start; every part that fails at start is named, not only the first), never leaving a
half-running stack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpubalance.children import signal_child

DEFAULT_EXPORTER_LISTEN = "127.0.0.1:9450"  # the exporter's own default is every interface
DEFAULT_ANALYZER_LISTEN = "127.0.0.1:9451"
DEFAULT_CONTROLLER_LISTEN = "127.0.0.1:9470"
DEFAULT_AUDIT_LOG = "gpubalance-controller-audit.jsonl"
# each part logs "listening on URL" once it serves: what the next part is given
LISTENING = re.compile(r"listening on (https?://\S+)")
START_TIMEOUT_SECONDS = 60.0
# once a part failed at start, how long the others still have to fail too and say why
SETTLE_SECONDS = 10.0
STOP_TIMEOUT_SECONDS = 30.0
_EXAMPLES = {  # of --PART-args, in --help
    "exporter": "--names both",
    "analyzer": "--window 30 --interval 10",
    "controller": "--interval 10 --dwell-cycles 2",
}


class BadInput(Exception):
    """What the command was given cannot work; the message says which setting and why."""


@dataclass
class Part:
    """One running part: its process, and its URL once it said where it listens."""

    name: str
    process: asyncio.subprocess.Process
    url: str | None = None
    log: asyncio.Future[None] | None = None  # the task passing its log on, done at its EOF
    listening: asyncio.Event = field(default_factory=asyncio.Event)

    async def flushed(self) -> None:
        """Once it exited: wait until its last lines are passed on, so they come before ours."""
        if self.log is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.log), 5.0)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="the config file: its exporter section and controller.workers (see above)",
    )
    parser.add_argument(
        "--haproxy-socket",
        metavar="PATH",
        help="HAProxy's runtime socket (level admin), which the controller reads and sets; "
        "required",
    )
    parser.add_argument(
        "--act",
        action="store_true",
        help="let the controller carry changes out; without it nothing changes",
    )
    parser.add_argument(
        "--paused",
        action="store_true",
        help="start the controller paused: it plans and logs until a person's POST "
        "/api/v1/resume on it (needs --token-file)",
    )
    parser.add_argument(
        "--exporter-listen",
        metavar="HOST:PORT",
        help=f"the exporter's address (default exporter.listen, else {DEFAULT_EXPORTER_LISTEN})",
    )
    parser.add_argument(
        "--analyzer-listen",
        default=DEFAULT_ANALYZER_LISTEN,
        metavar="HOST:PORT",
        help=f"the analyzer's address (default {DEFAULT_ANALYZER_LISTEN})",
    )
    parser.add_argument(
        "--controller-listen",
        default=DEFAULT_CONTROLLER_LISTEN,
        metavar="HOST:PORT",
        help=f"the controller's address (default {DEFAULT_CONTROLLER_LISTEN})",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer token of the analyzer's acks and the controller's control endpoints "
        "(needed by either beyond 127.0.0.1)",
    )
    parser.add_argument(
        "--backend", action="append", metavar="NAME", help="a backend to manage (default: all)"
    )
    parser.add_argument(
        "--audit-log",
        default=DEFAULT_AUDIT_LOG,
        metavar="FILE",
        help=f"the controller's audit log, JSON lines (default ./{DEFAULT_AUDIT_LOG})",
    )
    for part in ("exporter", "analyzer", "controller"):
        parser.add_argument(
            f"--{part}-args",
            default="",
            metavar="FLAGS",
            help=f"more flags for `gpubalance {part}`, as one string "
            f"(e.g. --{part}-args '{_EXAMPLES[part]}')",
        )


def run(args: argparse.Namespace) -> int:
    listeners: dict[str, socket.socket] = {}
    try:
        commands = _commands(args, listeners)
    except BadInput as exc:
        for sock in listeners.values():
            sock.close()
        print(f"gpubalance run: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(supervise(commands, listeners))
    finally:
        for sock in listeners.values():
            sock.close()


def _commands(
    args: argparse.Namespace, listeners: dict[str, socket.socket]
) -> dict[str, list[str]]:
    """Each part's command line; checks what the parts cannot check before they start, and
    binds each part's listening socket into ``listeners``."""
    from gpubalance.config import ConfigError, load_section
    from gpubalance.exporter.config import ExporterConfig

    if not args.haproxy_socket:
        raise BadInput(
            "no HAProxy runtime socket: give --haproxy-socket PATH (the controller reads and "
            "sets HAProxy's servers through it; `stats socket PATH level admin` in haproxy.cfg)"
        )
    if args.paused and not args.token_file:
        raise BadInput(
            "--paused needs --token-file: a person resumes the controller with POST "
            "/api/v1/resume and that token"
        )
    try:
        exporter = load_section(ExporterConfig, args.config, "exporter")
    except ConfigError as exc:
        raise BadInput(str(exc)) from None
    extra = {}
    for part in ("exporter", "analyzer", "controller"):
        try:
            extra[part] = shlex.split(getattr(args, f"{part}_args"))
        except ValueError as exc:
            raise BadInput(f"--{part}-args: {exc}") from None
    if args.exporter_listen is not None:
        exporter_listen = args.exporter_listen
    elif "listen" in exporter.model_fields_set:
        exporter_listen = exporter.listen
    else:
        exporter_listen = DEFAULT_EXPORTER_LISTEN
    exporter_listen, listeners["exporter"] = _address(exporter_listen, "--exporter-listen")
    analyzer_listen, listeners["analyzer"] = _address(args.analyzer_listen, "--analyzer-listen")
    controller_listen, listeners["controller"] = _address(
        args.controller_listen, "--controller-listen"
    )
    if exporter.serving.otlp.enabled:  # its port is its own setting: checked only
        _address(exporter.serving.otlp.listen, "exporter.serving.otlp.listen")[1].close()
    gpubalance = [sys.executable, "-m", "gpubalance"]
    config = ["--config", args.config] if args.config else []
    token = ["--token-file", args.token_file] if args.token_file else []
    return {
        "exporter": [*gpubalance, "exporter", "--listen", exporter_listen, *config]
        + extra["exporter"],
        "analyzer": [
            *gpubalance,
            "analyzer",
            "--source",
            _url(exporter_listen, extra["exporter"]),
            "--listen",
            analyzer_listen,
            *token,
        ]
        + extra["analyzer"],
        "controller": [
            *gpubalance,
            "controller",
            "--analyzer",
            _url(analyzer_listen, extra["analyzer"]),
            "--haproxy-socket",
            args.haproxy_socket,
            "--listen",
            controller_listen,
            "--audit-log",
            args.audit_log,
            *(["--act"] if args.act else []),
            *(["--paused"] if args.paused else []),
            *(arg for name in args.backend or () for arg in ("--backend", name)),
            *config,
            *token,
        ]
        + extra["controller"],
    }


def _address(listen: str, setting: str) -> tuple[str, socket.socket]:
    """``listen`` with its port, and a socket bound and listening there: an address already
    taken is refused before anything starts, and port 0 becomes a free port now, so that the
    part that reads this one can be given its URL at start (and, handed the socket, the part
    cannot lose that port to another process before it serves)."""
    from gpubalance.webconfig import parse_listen

    try:
        host, port = parse_listen(listen)
    except ValueError as exc:
        raise BadInput(f"{setting} {listen}: {exc}") from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # as the parts' listeners bind: a port in TIME_WAIT is free to them
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise BadInput(f"cannot listen on {listen} ({setting}): {reason}") from None
    port = sock.getsockname()[1]
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}"), sock


def _url(listen: str, flags: Sequence[str]) -> str:
    """Where a part listening on ``listen`` is reached from this host: HTTPS when its flags
    give it a web config (TLS), every interface by loopback."""
    from gpubalance.webconfig import parse_listen

    host, port = parse_listen(listen)
    scheme = "https" if any(f.startswith("--web.config.file") for f in flags) else "http"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def supervise(
    commands: dict[str, list[str]], listeners: dict[str, socket.socket] | None = None
) -> int:
    """Start the parts, all at once (each is given the address of the one it reads, and
    waits for it: starting one after the other would add their start-up times), each handed
    its listening socket from ``listeners`` where there is one; wait until each listens; then
    wait for a signal or a part that exits. The exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    listeners = listeners or {}
    parts: list[Part] = []
    try:
        for name, argv in commands.items():
            parts.append(await _spawn(name, argv, listeners.get(name)))
        failed: list[Part] = []
        for part in parts:
            # once one failed, the others get a short while to fail too: each says why
            await _listening(part, stop, SETTLE_SECONDS if failed else START_TIMEOUT_SECONDS)
            if stop.is_set():
                return await _stop_all(parts)
            if part.url is None and (not failed or part.process.returncode is not None):
                failed.append(part)
        if failed:
            for part in failed:
                await part.flushed()
                code = part.process.returncode
                how = (
                    f"did not say where it listens within {START_TIMEOUT_SECONDS:.0f} s"
                    if code is None
                    else f"exited at start with status {code}"
                )
                print(
                    f"gpubalance run: the {part.name} {how}; stopping the others",
                    file=sys.stderr,
                )
            await _stop_all(parts)
            return 2 if any(p.process.returncode == 2 for p in failed) else 1
        _say(
            ", ".join(f"{p.name} {p.url} (pid {p.process.pid})" for p in parts)
            + ("; the controller acts" if "--act" in commands["controller"] else "; dry-run")
            + (
                " (paused until POST /api/v1/resume)"
                if "--paused" in commands["controller"]
                else ""
            )
        )
        exits = {asyncio.ensure_future(p.process.wait()): p for p in parts}
        stopping = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({stopping, *exits}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        dead = [exits[task] for task in exits if task in done]
        if not dead:
            code = await _stop_all(parts)
            if code == 0:
                _say("stopped")
            return code
        for part in dead:
            await part.flushed()
            print(
                f"gpubalance run: the {part.name} (pid {part.process.pid}) exited with "
                f"{_status(part.process.returncode)}; stopping the others",
                file=sys.stderr,
            )
        await _stop_all(parts)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


async def _spawn(name: str, argv: Sequence[str], listener: socket.socket | None) -> Part:
    from gpubalance.webconfig import INHERITED_LISTENER

    handed = () if listener is None else (listener.fileno(),)
    env = None if listener is None else {**os.environ, INHERITED_LISTENER: str(handed[0])}
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        pass_fds=handed,
        env=env,
        # its own process group: a Ctrl-C on the terminal reaches this command alone, which
        # stops the parts in order (so no part's exit is taken for a crash)
        process_group=0,
    )
    if listener is not None:
        listener.close()  # the part holds it now
    _say(f"starting the {name} (pid {process.pid})")
    part = Part(name, process)
    part.log = asyncio.ensure_future(_forward(part))
    return part


async def _listening(part: Part, stop: asyncio.Event, timeout: float) -> None:
    """Wait until a part says where it listens, exits, or the command is stopped, for
    ``timeout`` seconds at most."""
    waits = {
        asyncio.ensure_future(part.listening.wait()),
        asyncio.ensure_future(part.process.wait()),
        asyncio.ensure_future(stop.wait()),
    }
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()


async def _forward(part: Part) -> None:
    """Pass a part's log on to ours, line by line (each line names its logger), and catch its
    first "listening on URL"."""
    assert part.process.stdout is not None
    while line := await part.process.stdout.readline():
        text = line.decode(errors="replace")
        sys.stderr.write(text)
        sys.stderr.flush()
        if part.url is None and (match := LISTENING.search(text)):
            part.url = match.group(1)
            part.listening.set()


async def _stop_all(parts: Sequence[Part]) -> int:
    """SIGTERM the parts still running, last started first (the controller stops acting before
    the analyzer it reads goes); SIGKILL one that does not exit in time. 0 when every part
    stopped cleanly."""
    code = 0
    for part in reversed(parts):
        process = part.process
        if process.returncode is None:
            signal_child(process, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT_SECONDS)
            except TimeoutError:
                print(
                    f"gpubalance run: the {part.name} did not stop within "
                    f"{STOP_TIMEOUT_SECONDS:.0f} s of SIGTERM; killing it",
                    file=sys.stderr,
                )
                signal_child(process, signal.SIGKILL)
                await process.wait()
                code = 1
            else:
                if process.returncode != 0:
                    print(
                        f"gpubalance run: the {part.name} stopped with "
                        f"{_status(process.returncode)}",
                        file=sys.stderr,
                    )
                    code = 1
    return code


def _status(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"status {returncode}"


def _say(message: str) -> None:
    print(f"gpubalance run: {message}", file=sys.stderr, flush=True)
