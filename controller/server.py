"""The controller's HTTP endpoints: /metrics, GET /api/v1/status, POST pause, resume, rearm,
and POST /api/v1/moves (a person's approved move of a GPU's worker to another pool).

The POST endpoints change what the controller does, so each needs `Authorization: Bearer
<token>` (the `--token-file`); without a token file they answer 403. Reads are open, as an
exporter's are; `--web.config.file` adds TLS and a rate limit (the exporter's helpers).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpubalance.controller.loop import Controller

INDEX = """<!doctype html>
<html><head><title>gpubalance controller</title></head><body>
<h1>gpubalance controller</h1>
<ul>
<li><a href="/metrics">/metrics</a></li>
<li><a href="/api/v1/status">/api/v1/status</a></li>
<li>POST /api/v1/pause, /api/v1/resume, /api/v1/rearm (bearer token)</li>
<li>POST /api/v1/moves {"gpu": N, "to": "backend"} (bearer token)</li>
</ul></body></html>
"""


class ControlServer:
    def __init__(self, controller: Controller, token: str | None) -> None:
        self.controller = controller
        self._token = token

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.index)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/v1/status", self.status)
        for name in ("pause", "resume", "rearm"):
            app.router.add_post(f"/api/v1/{name}", self._control(name))
        app.router.add_post("/api/v1/moves", self.move)
        return app

    async def move(self, request: web.Request) -> web.Response:
        """Approve a move; the next pass admits it (or refuses it, in the audit log), and
        in dry-run only records it."""
        refused = self._refusal(request)
        if refused is not None:
            return refused
        try:
            body = await request.json()
        except ValueError:
            return _bad('the body must be JSON: {"gpu": N, "to": "backend"}')
        gpu = body.get("gpu") if isinstance(body, dict) else None
        to = body.get("to") if isinstance(body, dict) else None
        if isinstance(gpu, bool) or not isinstance(gpu, int):
            return _bad(f"gpu must be a GPU index, got {gpu!r}")
        if not isinstance(to, str) or not to:
            return _bad(f"to must name the backend to serve, got {to!r}")
        try:
            move_id = self.controller.approve_move(gpu, to)
        except ValueError as exc:
            return _bad(str(exc), status=409)
        mode = "act" if self.controller.settings.act else "dry_run"
        return web.json_response({"id": move_id, "mode": mode}, status=202)

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(text=INDEX, content_type="text/html")

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.controller.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, request: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(self.controller.status(), indent=2) + "\n",
            content_type="application/json",
        )

    def _refusal(self, request: web.Request) -> web.Response | None:
        if self._token is None:
            return web.Response(
                status=403,
                text="control endpoints are off: start the controller with --token-file\n",
            )
        scheme, _, given = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self._token.encode()
        ):
            return web.Response(
                status=401,
                text="needs Authorization: Bearer <the --token-file token>\n",
                headers={hdrs.WWW_AUTHENTICATE: "Bearer"},
            )
        return None

    def _control(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            refused = self._refusal(request)
            if refused is not None:
                return refused
            getattr(self.controller, name)()
            return await self.status(request)

        return handle


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)
