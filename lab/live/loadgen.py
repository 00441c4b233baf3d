"""The live speed's load generator: a request stream sent as real HTTP, on schedule.

Each `Request` leaves at `clock_origin + arrival_seconds` on the monotonic clock as
`POST <url>/infer`, whatever happened to the earlier ones (an open loop, as users are). Every
request sent yields exactly one `RequestRecord`; nothing is dropped, and a request that went
wrong on the way is a counted failure with its reason. A record's `arrival_seconds` is when the
request actually left: its schedule plus the generator's lag, which the report sums up.

The worker's reply contract:

- 200 JSON ``{"id", "gpu", "worker", "enqueued_at", "started_at", "finished_at",
  "batch_size"}``, times from `time.time()` on the same host → outcome "ok";
- 503 or 429 JSON ``{"id", "reason"}`` → "oom" when the reason is "oom", else "rejected";
- a 503 or 429 without a JSON reason is the balancer's own (HAProxy's queue timeout, no server
  up) → "rejected", reason "balancer";
- any other status, a transport error, a timeout or a malformed reply → "failed".
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from gpubalance.lab.live.haproxy import STICKY_COOKIE
from gpubalance.lab.workload import Request, RequestRecord

BALANCER_REASON = "balancer"

_REJECTED = (503, 429)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What the generator saw: outcome counts, its own lateness, and why requests went wrong.

    `sent == ok + rejected + oom + failed` always holds.
    """

    sent: int
    ok: int
    rejected: int
    oom: int
    failed: int
    max_lag_seconds: float  # latest send behind its schedule; large means the generator limited
    mean_lag_seconds: float
    rejections: Mapping[str, int]  # reason ("overloaded", "balancer", ...) → count
    failures: Mapping[str, int]  # reason ("timeout", "HTTP 502", "ClientConnectorError") → count


@dataclass(frozen=True, slots=True)
class LoadResult:
    """The records, one per request in arrival order, and their summary."""

    records: list[RequestRecord]
    report: LoadReport


@dataclass(frozen=True, slots=True)
class _Sent:
    record: RequestRecord
    lag_seconds: float
    reason: str | None  # why it was rejected or failed


async def send_all(
    requests: Sequence[Request],
    url: str,
    *,
    clock_origin: float,
    wall_origin: float | None = None,
    cookie_for: Callable[[Request], str | None] | None = None,
    timeout_seconds: float = 60.0,
    max_in_flight: int = 2000,
) -> LoadResult:
    """Send every request on schedule and wait for all answers.

    `clock_origin` is the `time.monotonic()` of the run start; `wall_origin` the `time.time()`
    of that same instant (by default read from both clocks now), to place the worker's times on
    the run's axis. `cookie_for` names the server a request is pinned to, sent as the sticky
    cookie. At most `max_in_flight` requests wait for an answer at once; beyond that sends fall
    behind schedule and the report's lag says so. Each process needs a file descriptor per
    request in flight (`ulimit -n`).
    """
    ids = [request.id for request in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids repeat; records are matched to requests by id")
    if wall_origin is None:
        wall_origin = time.time() - (time.monotonic() - clock_origin)
    endpoint = url.rstrip("/") + "/infer"
    slots = asyncio.Semaphore(max_in_flight)
    connector = aiohttp.TCPConnector(limit=max_in_flight, limit_per_host=0)
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout_seconds),
        # the cookie is ours to set per request; a jar would carry one request's to the next
        cookie_jar=aiohttp.DummyCookieJar(),
    ) as session:
        tasks = []
        for request in sorted(requests, key=lambda r: r.arrival_seconds):
            await slots.acquire()
            due = clock_origin + request.arrival_seconds
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            cookie = cookie_for(request) if cookie_for is not None else None
            tasks.append(
                asyncio.create_task(
                    _send(session, endpoint, request, cookie, due, clock_origin, wall_origin, slots)
                )
            )
        sent = await asyncio.gather(*tasks)
    return LoadResult([s.record for s in sent], _report(sent))


async def _send(
    session: aiohttp.ClientSession,
    endpoint: str,
    request: Request,
    cookie: str | None,
    due: float,
    clock_origin: float,
    wall_origin: float,
    slots: asyncio.Semaphore,
) -> _Sent:
    """One request, whatever happens to it: every exception becomes a failed record."""
    headers = {"X-Class": request.service_class}
    if cookie is not None:
        headers["Cookie"] = f"{STICKY_COOKIE}={cookie}"
    body = {
        "id": request.id,
        "class": request.service_class,
        "tenant": request.tenant,
        "source": request.source,
        "prompt_tokens": request.prompt_tokens,
        "output_tokens": request.output_tokens,
        "session": request.session,
    }
    sent_at = time.monotonic()
    lag = max(0.0, sent_at - due)
    arrival = sent_at - clock_origin

    def record(
        outcome: str,
        start_seconds: float | None = None,
        end_seconds: float | None = None,
        gpu: int | None = None,
        worker: str | None = None,
        batch_size: int | None = None,
    ) -> RequestRecord:
        return RequestRecord(
            id=request.id,
            arrival_seconds=arrival,
            start_seconds=start_seconds,
            # unserved requests end when the answer (or the error) reached us
            end_seconds=end_seconds if end_seconds is not None else time.monotonic() - clock_origin,
            gpu=gpu,
            worker=worker,
            service_class=request.service_class,
            tenant=request.tenant,
            outcome=outcome,
            batch_size=batch_size,
        )

    try:
        async with session.post(endpoint, json=body, headers=headers) as response:
            status = response.status
            text = await response.text()
    except TimeoutError:
        return _Sent(record("failed"), lag, "timeout")
    # any other exception is a transport failure too (aiohttp lets some OSErrors through):
    # counted under its type, never lost
    except Exception as exc:
        return _Sent(record("failed"), lag, type(exc).__name__)
    finally:
        slots.release()

    reply = _json_object(text)
    if status in _REJECTED:
        reason = reply.get("reason") if reply is not None else None
        if not isinstance(reason, str):
            return _Sent(record("rejected"), lag, BALANCER_REASON)
        return _Sent(record("oom" if reason == "oom" else "rejected"), lag, reason)
    if status != 200:
        return _Sent(record("failed"), lag, f"HTTP {status}")
    if reply is None:
        return _Sent(record("failed"), lag, "200 reply not a JSON object")
    if reply.get("id") != request.id:
        return _Sent(record("failed"), lag, "200 reply for another id")
    try:
        served = record(
            "ok",
            start_seconds=float(reply["started_at"]) - wall_origin,
            end_seconds=float(reply["finished_at"]) - wall_origin,
            gpu=int(reply["gpu"]),
            worker=str(reply["worker"]),
            batch_size=int(reply["batch_size"]),
        )
    except (KeyError, TypeError, ValueError):
        return _Sent(record("failed"), lag, "200 reply missing a field")
    return _Sent(served, lag, None)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _report(sent: Sequence[_Sent]) -> LoadReport:
    outcomes = Counter(s.record.outcome for s in sent)
    lags = [s.lag_seconds for s in sent]
    return LoadReport(
        sent=len(sent),
        ok=outcomes["ok"],
        rejected=outcomes["rejected"],
        oom=outcomes["oom"],
        failed=outcomes["failed"],
        max_lag_seconds=max(lags, default=0.0),
        mean_lag_seconds=sum(lags) / len(lags) if lags else 0.0,
        rejections=dict(Counter(s.reason for s in sent if s.record.outcome == "rejected")),
        failures=dict(Counter(s.reason for s in sent if s.record.outcome == "failed")),
    )
