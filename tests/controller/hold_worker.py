"""The pool tests' workers, several in one process, one per port: `GET /hold/KEY` answers once
`POST /release/KEY` came (to any of them), so a test decides when each request in flight ends;
`GET /held` lists the keys held on that port now; `/healthz` and any other path answer at once.

    python hold_worker.py COUNT

prints `ports P1 P2 ...` once every worker listens.
"""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import socket
import sys

from aiohttp import web

released: collections.defaultdict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)


def worker(port_of: dict[str, int]) -> web.Application:
    held: collections.Counter[str] = collections.Counter()

    async def hold(request: web.Request) -> web.Response:
        key = request.match_info["key"]
        held[key] += 1
        try:
            await released[key].wait()
        finally:
            held[key] -= 1
        return web.Response(text=str(port_of["port"]))

    async def release(request: web.Request) -> web.Response:
        released[request.match_info["key"]].set()
        return web.Response(status=204)

    async def listing(request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(sorted(+held)))

    async def answer(request: web.Request) -> web.Response:
        return web.Response(text=str(port_of["port"]))

    app = web.Application()
    app.router.add_get("/hold/{key}", hold)
    app.router.add_post("/release/{key}", release)
    app.router.add_get("/held", listing)
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


async def serve(count: int) -> None:
    runners, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port_of = {"port": sock.getsockname()[1]}
        runner = web.AppRunner(worker(port_of), access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        runners.append(runner)
        ports.append(port_of["port"])
    print("ports", *ports, flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    for event in released.values():
        event.set()
    for runner in runners:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
    sys.exit(0)
