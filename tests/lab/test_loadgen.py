"""The load generator against in-process fake workers, directly and through a real HAProxy.

A fake worker speaks the worker's reply contract; each request's tenant tells it how to answer,
so one request stream covers every outcome.

Every test here runs on real clocks (marker `timing`); none bounds how late this process may be
scheduled: lateness is compared with what the event loop itself measured.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from harness import haproxy_over, refusing_port

from gpubalance.lab.live.haproxy import (
    APT_INSTALL,
    Backend,
    Frontend,
    HaproxyConfig,
    HaproxyNotFoundError,
    HaproxyProcess,
    Server,
    ServerStat,
    find_haproxy,
)
from gpubalance.lab.live.loadgen import LoadResult, send_all
from gpubalance.lab.live.ports import free_port
from gpubalance.lab.workload import Request

pytestmark = pytest.mark.timing


class FakeWorker:
    """An aiohttp server answering `POST /infer` as the tenant of each request asks."""

    def __init__(self, name: str, gpu: int) -> None:
        self.name = name
        self.gpu = gpu
        self.port = 0
        self.seen: list[tuple[dict[str, str], dict[str, object]]] = []
        self.release = asyncio.Event()
        self.highest_id = -1
        self._arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeWorker:
        app = web.Application()
        app.router.add_post("/infer", self.infer)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.port = sock.getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        assert self._runner is not None
        await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def infer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((dict(request.headers), body))
        self.highest_id = max(self.highest_id, body["id"])
        async with self._arrived:
            self._arrived.notify_all()
        enqueued_at = time.time()
        match body["tenant"]:
            case "oom" | "crashed":
                return web.json_response({"id": body["id"], "reason": body["tenant"]}, status=503)
            case "overloaded":
                return web.json_response({"id": body["id"], "reason": "overloaded"}, status=429)
            case "plain503":
                return web.Response(status=503, text="no server available")
            case "error500":
                return web.Response(status=500, text="traceback")
            case "garbage":
                return web.Response(text="not json")
            case "wrong_id":
                body["id"] += 1000
            case "hold":
                await self.release.wait()
            case "until_later":  # answered once a request of a higher id has arrived
                async with self._arrived:
                    await self._arrived.wait_for(lambda: self.highest_id > body["id"])
            case "slow":
                await asyncio.sleep(0.1)
        started_at = time.time()
        await asyncio.sleep(0.002)
        return web.json_response(
            {
                "id": body["id"],
                "gpu": self.gpu,
                "worker": self.name,
                "enqueued_at": enqueued_at,
                "started_at": started_at,
                "finished_at": time.time(),
                "batch_size": 1,
            }
        )


def request(
    request_id: int,
    tenant: str = "ok",
    *,
    at: float = 0.0,
    cls: str = "interactive",
    session: str | None = None,
) -> Request:
    return Request(request_id, at, cls, tenant, "test", 128, 16, session)


def assert_accounted(result: LoadResult, requests: Sequence[Request]) -> None:
    """One record per request, and the counts add up."""
    report = result.report
    assert sorted(r.id for r in result.records) == sorted(r.id for r in requests)
    assert report.sent == len(requests)
    assert report.sent == report.ok + report.rejected + report.oom + report.failed
    assert sum(report.rejections.values()) == report.rejected
    assert sum(report.failures.values()) == report.failed


@dataclass
class LoopStalls:
    """How late this event loop woke a 5 ms sleeper, at worst: the time the process lost to the
    machine (other processes, a busy core), the yardstick for the generator's own lateness."""

    max_seconds: float = 0.0

    async def watch(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.005)
            self.max_seconds = max(self.max_seconds, time.monotonic() - before - 0.005)


def test_sends_on_schedule_at_200_per_second() -> None:
    # each request is answered only once a later one has arrived (late sends may arrive out of
    # order): a generator that waited for answers before sending on would never send the second
    requests = [request(i, "until_later", at=i / 200) for i in range(399)]
    requests.append(request(399, at=399 / 200))
    stalls = LoopStalls()

    async def scenario() -> LoadResult:
        async with FakeWorker("w0", 0) as worker:
            watching = asyncio.create_task(stalls.watch())
            origin = time.monotonic() + 0.2
            try:
                async with asyncio.timeout(60):
                    return await send_all(requests, worker.url, clock_origin=origin)
            finally:
                watching.cancel()

    result = asyncio.run(scenario())
    assert_accounted(result, requests)
    assert result.report.ok == 400
    lags = []
    for sent, req in zip(result.records, requests, strict=True):
        lags.append(sent.arrival_seconds - req.arrival_seconds)
        assert lags[-1] >= -1e-6, "sent before its time"
        # the worker's wall-clock times land on the run's axis, after the send
        assert sent.arrival_seconds - 0.05 < sent.start_seconds <= sent.end_seconds
        assert (sent.gpu, sent.worker, sent.batch_size) == (0, "w0", 1)
    assert result.report.max_lag_seconds == pytest.approx(max(lags), abs=1e-3)
    assert result.report.mean_lag_seconds == pytest.approx(sum(lags) / len(lags), abs=1e-3)
    # late only by as much as the loop was kept from running (a busy machine starves it): once
    # while the send waits, once more in the loop pass that catches up with what piled up
    # meanwhile, plus the few milliseconds a send takes; no lateness of the generator's making
    assert result.report.max_lag_seconds <= 2 * stalls.max_seconds + 0.05, (result.report, stalls)


def test_every_outcome_is_mapped_and_counted() -> None:
    tenants = [
        ("ok", "ok"),
        ("oom", "oom"),
        ("overloaded", "rejected"),
        ("crashed", "rejected"),
        ("plain503", "rejected"),
        ("error500", "failed"),
        ("garbage", "failed"),
        ("wrong_id", "failed"),
    ]
    requests = [request(i, tenant) for i, (tenant, _) in enumerate(tenants)]
    # never answered: its own send, with a short timeout, so the others' answers have as long
    # as they need however busy the machine
    held = [request(len(tenants), "hold")]

    async def scenario() -> list[LoadResult]:
        async with FakeWorker("w0", 0) as worker:
            origin = time.monotonic()
            return await asyncio.gather(
                send_all(requests, worker.url, clock_origin=origin),
                send_all(held, worker.url, clock_origin=origin, timeout_seconds=0.5),
            )

    result, timed_out = asyncio.run(scenario())
    assert_accounted(result, requests)
    assert [r.outcome for r in result.records] == [outcome for _, outcome in tenants]
    report = result.report
    assert (report.ok, report.oom, report.rejected, report.failed) == (1, 1, 3, 3)
    assert report.rejections == {"overloaded": 1, "crashed": 1, "balancer": 1}
    assert report.failures == {
        "HTTP 500": 1,
        "200 reply not a JSON object": 1,
        "200 reply for another id": 1,
    }
    assert_accounted(timed_out, held)
    assert (timed_out.report.failed, timed_out.report.failures) == (1, {"timeout": 1})
    for record in result.records + timed_out.records:
        assert record.end_seconds is not None and record.end_seconds >= record.arrival_seconds
        if record.outcome != "ok":
            assert (record.start_seconds, record.gpu, record.worker) == (None, None, None)


def test_connection_refused_is_a_counted_failure() -> None:
    requests = [request(i, at=i * 0.01) for i in range(5)]
    with refusing_port() as port:
        result = asyncio.run(
            send_all(requests, f"http://127.0.0.1:{port}", clock_origin=time.monotonic())
        )
    assert_accounted(result, requests)
    assert result.report.failures == {"ClientConnectorError": 5}


def test_falling_behind_sends_at_once_and_reports_the_lag() -> None:
    # one request in flight at a time, 0.1 s each: the fifth leaves about 0.4 s late
    requests = [request(i, "slow") for i in range(5)]

    async def scenario() -> LoadResult:
        async with FakeWorker("w0", 0) as worker:
            return await send_all(
                requests, worker.url, clock_origin=time.monotonic(), max_in_flight=1
            )

    result = asyncio.run(scenario())
    assert_accounted(result, requests)
    assert result.report.ok == 5
    assert result.report.max_lag_seconds >= 0.35
    arrivals = [r.arrival_seconds for r in result.records]
    assert arrivals == sorted(arrivals) and arrivals[-1] >= 0.35


def test_sends_class_header_cookie_and_body() -> None:
    requests = [
        request(0, session="a"),
        request(1, cls="batch"),
        request(2, session="b", at=0.01),
    ]

    async def scenario() -> FakeWorker:
        async with FakeWorker("w0", 0) as worker:
            await send_all(
                requests,
                worker.url + "/",
                clock_origin=time.monotonic(),
                cookie_for=lambda r: f"gpu-{r.session}" if r.session else None,
            )
            return worker

    worker = asyncio.run(scenario())
    seen = {body["id"]: (headers, body) for headers, body in worker.seen}
    assert seen[0][0]["Cookie"] == "SERVERID=gpu-a"
    assert seen[2][0]["Cookie"] == "SERVERID=gpu-b"
    assert "Cookie" not in seen[1][0]
    assert [seen[i][0]["X-Class"] for i in range(3)] == ["interactive", "batch", "interactive"]
    assert seen[1][1] == {
        "id": 1,
        "class": "batch",
        "tenant": "ok",
        "source": "test",
        "prompt_tokens": 128,
        "output_tokens": 16,
        "session": None,
    }


def _installed() -> bool:
    try:
        find_haproxy()
    except HaproxyNotFoundError:
        return False
    return True


@pytest.mark.haproxy
@pytest.mark.skipif(not _installed(), reason=f"haproxy is not installed: {APT_INSTALL}")
def test_through_haproxy_sticky_and_pooled_rejection(tmp_path: Path) -> None:
    """Sticky cookies pick the worker; a full pooled backend answers HAProxy's own 503."""
    interactive = [request(i, session="ab"[i % 2], at=i * 0.01) for i in range(8)]
    pinned = {"a": "w1", "b": "w2"}
    batch = [request(100 + i, "hold", cls="batch") for i in range(3)]

    async def scenario() -> LoadResult:
        async with (
            FakeWorker("w1", 1) as w1,
            FakeWorker("w2", 2) as w2,
            FakeWorker("wp", 3) as pool,
        ):
            config = HaproxyConfig(
                frontends=(Frontend("fe", free_port(), "be_i", routes={"batch": "be_b"}),),
                backends=(
                    Backend(
                        "be_i",
                        tuple(Server(w.name, "127.0.0.1", w.port) for w in (w1, w2)),
                        "sticky",
                    ),
                    Backend(
                        "be_b",
                        (Server("wp", "127.0.0.1", pool.port, maxconn=1),),
                        "pooled",
                        queue_timeout_seconds=0.2,
                    ),
                ),
                run_dir=tmp_path,
            )
            async with haproxy_over(config) as haproxy:

                async def release_after_two_rejections() -> None:
                    async with asyncio.timeout(20):
                        while _row(haproxy, "be_b", "BACKEND").hrsp_5xx != 2:
                            await asyncio.sleep(0.02)
                    pool.release.set()

                result, _ = await asyncio.gather(
                    send_all(
                        interactive + batch,
                        f"http://127.0.0.1:{haproxy.config.frontends[0].port}",
                        clock_origin=time.monotonic(),
                        cookie_for=lambda r: pinned.get(r.session or ""),
                    ),
                    release_after_two_rejections(),
                )
            return result

    result = asyncio.run(scenario())
    assert_accounted(result, interactive + batch)
    by_id = {r.id: r for r in result.records}
    for req in interactive:
        assert by_id[req.id].outcome == "ok"
        assert by_id[req.id].worker == pinned[req.session]
    assert sorted(by_id[r.id].outcome for r in batch) == ["ok", "rejected", "rejected"]
    assert result.report.rejections == {"balancer": 2}


def _row(haproxy: HaproxyProcess, proxy: str, svname: str) -> ServerStat:
    (row,) = [s for s in haproxy.api.show_stat(proxy) if s.svname == svname]
    return row
