"""`add server`, `del server` and `set server addr` on a real HAProxy, as a move uses them."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from controller_harness import Backends, haproxy_over, needs_haproxy

from gpubalance.controller.haproxy import RuntimeApi, RuntimeApiError

pytestmark = needs_haproxy


async def _get(http: aiohttp.ClientSession, port: int) -> str:
    async with http.get(f"http://127.0.0.1:{port}/") as resp:
        return await resp.text()


async def _wait_up(api: RuntimeApi, backend: str, server: str) -> None:
    async with asyncio.timeout(20):
        while not any(
            s.server == server and s.op_state == 2 for s in api.show_servers_state(backend)
        ):
            await asyncio.sleep(0.05)


def test_a_server_is_added_in_maint_readied_readdressed_and_deleted(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2", "s3"]) as backends:
            config = backends.config(tmp_path / "run")
            # only s1 in HAProxy's config: s2 arrives at runtime, then moves to s3's port
            be = config.backends[0]
            config = replace(config, backends=(replace(be, servers=be.servers[:1]),))
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                port = haproxy.config.frontends[0].port
                api = haproxy.api
                api.add_server("be", "gpu1", "127.0.0.1", backends.ports["s2"], 100)
                added = {s.server: s for s in api.show_servers_state("be")}["gpu1"]
                assert added.admin == "maint" and added.port == backends.ports["s2"]
                api.set_state("be", "gpu1", "ready")
                await _wait_up(api, "be", "gpu1")
                api.set_state("be", "s1", "maint")
                assert await _get(http, port) == "s2"

                api.set_addr("be", "gpu1", "127.0.0.1", backends.ports["s3"])
                assert await _get(http, port) == "s3"

                with pytest.raises(RuntimeApiError, match="maintenance"):
                    api.del_server("be", "gpu1")  # still ready: HAProxy refuses
                api.set_state("be", "s1", "ready")
                api.set_state("be", "gpu1", "maint")
                api.del_server("be", "gpu1")
                assert [s.server for s in api.show_servers_state("be")] == ["s1"]
                with pytest.raises(RuntimeApiError, match="No such server"):
                    api.del_server("be", "gpu1")
                with pytest.raises(RuntimeApiError, match="set server be/nosuch addr"):
                    api.set_addr("be", "nosuch", "127.0.0.1", 1)
                # the name is free again: the GPU's worker can come back to this pool
                api.add_server("be", "gpu1", "127.0.0.1", backends.ports["s2"], 100)
                assert {s.server for s in api.show_servers_state("be")} == {"s1", "gpu1"}

    asyncio.run(scenario())


def test_bad_addresses_are_refused_before_reaching_haproxy(tmp_path: Path) -> None:
    api = RuntimeApi(tmp_path / "no.sock")
    with pytest.raises(ValueError, match="port 0"):
        api.add_server("be", "gpu1", "127.0.0.1", 0, 100)
    with pytest.raises(ValueError, match="spaces"):
        api.set_addr("be", "gpu1", "127.0.0.1 weight 0", 80)
    with pytest.raises(ValueError, match="weight 300"):
        api.add_server("be", "gpu1", "127.0.0.1", 80, 300)
