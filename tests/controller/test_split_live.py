"""A split of a shared pool, through a real HAProxy: the batch class goes to its own servers.

The config is the one `gpubalance lab live` renders for a pool that serves a batch class beside
another: `be` with every server, `be_batch` with the same servers `disabled`, and a frontend
that sends `X-Class: batch` to `be_batch` while it has a usable server (`nbsrv`). The
controller readies the split's batch servers in `be_batch`, then drains them out of `be`,
while requests of both classes keep coming.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from pathlib import Path

import aiohttp
from controller_harness import (
    FAST,
    Analyzer,
    Backends,
    SteadyLoad,
    haproxy_over,
    make_controller,
    needs_haproxy,
    recommendation,
)

from gpubalance.controller.audit import AuditLog
from gpubalance.controller.loop import Controller
from gpubalance.lab.live.haproxy import Backend, Frontend, HaproxyConfig, HaproxyProcess, Server
from gpubalance.lab.live.ports import free_port

pytestmark = needs_haproxy

WORKERS = ["w0", "w1", "w2", "w3"]


def split_config(backends: Backends, run_dir: Path) -> HaproxyConfig:
    servers = tuple(Server(n, "127.0.0.1", backends.ports[n]) for n in WORKERS)
    return HaproxyConfig(
        frontends=(Frontend("fe", free_port(), "be", routes_while_up={"batch": "be_batch"}),),
        backends=(
            Backend("be", servers),
            Backend("be_batch", tuple(replace(s, disabled=True) for s in servers)),
        ),
        run_dir=run_dir,
    )


async def answered_by(
    http: aiohttp.ClientSession, port: int, cls: str, n: int = 24
) -> Counter[str]:
    """Which servers answer ``n`` requests of class ``cls`` (each answers its name)."""
    out: Counter[str] = Counter()
    for _ in range(n):
        async with http.get(f"http://127.0.0.1:{port}/", headers={"X-Class": cls}) as resp:
            assert resp.status == 200
            out[await resp.text()] += 1
    return out


def splitting(
    haproxy: HaproxyProcess, analyzer: Analyzer, http: aiohttp.ClientSession, audit: Path
) -> Controller:
    """A controller acting on ``haproxy``, and the analyzer asking it to split w3 out."""
    split = {"batch_workers": ["w3"], "interactive_workers": ["w0", "w1", "w2"]}
    analyzer.recommendations = [recommendation("s1", "split_pools", "pool:m", split, cost_rank=4)]
    return make_controller(haproxy.config.socket_path, analyzer.url, http, audit, FAST)


def test_a_split_serves_the_batch_class_from_its_own_servers_losing_no_request(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with Backends(WORKERS) as backends, Analyzer() as analyzer:
            config = split_config(backends, tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                port = haproxy.config.frontends[0].port
                # before: the batch backend has no server up, so batch goes to the shared pool
                assert set(await answered_by(http, port, "batch")) == set(WORKERS)

                controller = splitting(haproxy, analyzer, http, tmp_path / "audit.jsonl")
                load = SteadyLoad(port, 20.0, ("interactive", "batch"))
                stop = asyncio.Event()
                sending = asyncio.create_task(load.run(stop))
                passes = []
                for _ in range(10):
                    passes.append(await controller.run_once())
                    if "s1" in passes[-1].met:
                        break
                    await asyncio.sleep(0.2)
                stop.set()
                await sending

                assert "s1" in passes[-1].met, [p.applied for p in passes]
                # ready in the batch backend first, then out of the shared one
                assert [p.applied for p in passes if p.applied] == [
                    ["set server be_batch/w3 state ready (was maint)"],
                    ["set server be/w3 state drain (was ready)"],
                    ["set server be/w3 state maint (was drain)"],
                ]
                assert await answered_by(http, port, "batch") == {"w3": 24}
                assert set(await answered_by(http, port, "interactive")) == {"w0", "w1", "w2"}
                assert load.failures == {} and load.answered == load.sent > 0
                assert analyzer.acks_of("s1") == [("applied", "HAProxy shows what it asks for")]
                decisions = [
                    (e["decision"], e.get("target"))
                    for e in AuditLog(tmp_path / "audit.jsonl").entries()
                    if e["decision"] == "applied"
                ]
                assert decisions == [
                    ("applied", "be_batch/w3"),
                    ("applied", "be/w3"),
                    ("applied", "be/w3"),
                ]

                # another split of the same pool is a person's call: refused, nothing changes
                other = {"batch_workers": ["w2"], "interactive_workers": ["w0", "w1", "w3"]}
                analyzer.recommendations = [
                    recommendation("s2", "split_pools", "pool:m", other, cost_rank=4)
                ]
                report = await controller.run_once()
                assert report.applied == [] and report.refused == ["s2: already_split"]
                assert analyzer.acks_of("s2")[0][0] == "rejected"

    asyncio.run(scenario())


def test_a_split_without_a_batch_backend_is_refused_with_what_to_add(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(WORKERS) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                controller = splitting(haproxy, analyzer, http, tmp_path / "audit.jsonl")
                report = await controller.run_once()
                assert report.applied == [] and report.refused == ["s1: unknown_target"]
                [(status, reason)] = analyzer.acks_of("s1")
                assert status == "rejected"
                assert "use_backend be_batch if { req.hdr(X-Class) -m str batch }" in reason

    asyncio.run(scenario())
