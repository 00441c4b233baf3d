"""Scrape the serving endpoints of the configuration, each on its own schedule, off the sampler.

Runs in the HTTP server's event loop: every endpoint is fetched concurrently with a timeout, its
text parsed by its format's adapter, and the result replaces what the store held for it. A slow
or dead endpoint costs its own timeout, never a sample or a /metrics answer.

A scrape uses the whole body or nothing. It arrives in as many network reads as the server's
writes and the network make of it; the timeout covers all of them, so a body still arriving
when the timeout ends is a timeout, and a body the server cuts off (a short Content-Length, a
missing last chunk) is ``truncated``: a part of an exposition, even cut on a line boundary,
would pass for a server whose other series are gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import aiohttp

from gpubalance.exporter.collectors.serving.base import MAX_EXPOSITION_BYTES, ParseError
from gpubalance.exporter.collectors.serving.formats import read
from gpubalance.exporter.collectors.serving.store import SeriesLimitReached, ServingStore
from gpubalance.exporter.config import ServingConfig, ServingEndpoint

log = logging.getLogger(__name__)

# The parser's bound, checked while the body arrives so that no more than this is held.
MAX_RESPONSE_BYTES = MAX_EXPOSITION_BYTES


class _TooLarge(Exception):
    pass


async def _read_body(response: aiohttp.ClientResponse) -> bytes:
    """The whole body, as it arrives; raises _TooLarge past MAX_RESPONSE_BYTES, at once when
    the server declares a longer Content-Length."""
    declared, limit = response.content_length, MAX_RESPONSE_BYTES
    if declared is not None and declared > limit:
        raise _TooLarge(f"Content-Length {declared} bytes, larger than {limit}")
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise _TooLarge(f"body larger than {limit} bytes")
    return bytes(body)


def worker_name(endpoint: ServingEndpoint) -> str:
    return endpoint.worker or urlsplit(endpoint.url).netloc


class ServingScraper:
    def __init__(self, config: ServingConfig, store: ServingStore) -> None:
        self.config = config
        self.store = store

    async def run(self) -> None:
        """Scrape every endpoint every scrape_interval until cancelled."""
        if not self.config.endpoints:
            return
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._loop(session, e) for e in self.config.endpoints))

    async def scrape_once(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self.scrape(session, e) for e in self.config.endpoints))

    async def _loop(self, session: aiohttp.ClientSession, endpoint: ServingEndpoint) -> None:
        interval = self.config.scrape_interval
        next_at = time.monotonic()
        while True:
            await self.scrape(session, endpoint)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def scrape(self, session: aiohttp.ClientSession, endpoint: ServingEndpoint) -> None:
        started = time.perf_counter()
        now = time.time()
        error: tuple[str, str] | None = None
        readings = None
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.timeout)
            async with session.get(endpoint.url, timeout=timeout) as response:
                if response.status != 200:
                    error = (f"http_{response.status}", f"HTTP {response.status}")
                else:
                    body = await _read_body(response)
                    # parsing a large exposition takes milliseconds: off the event loop
                    readings = await asyncio.get_running_loop().run_in_executor(
                        None, read, endpoint.format, body.decode("utf-8", "replace")
                    )
        except TimeoutError:  # aiohttp's total timeout, which covers the body's reads
            error = ("timeout", f"no whole answer within {self.config.timeout} s")
        except _TooLarge as exc:
            error = ("too_large", str(exc))
        except aiohttp.ClientPayloadError as exc:
            error = ("truncated", f"body cut off: {exc}")
        except aiohttp.ClientError as exc:
            error = ("unreachable", f"{type(exc).__name__}: {exc}")
        except ParseError as exc:
            error = (exc.reason, str(exc))
        if readings is not None:
            gpu = endpoint.gpu if isinstance(endpoint.gpu, int) else None
            try:
                self.store.replace_endpoint(
                    endpoint.format, endpoint.url, worker_name(endpoint), readings, now, gpu
                )
            except SeriesLimitReached as exc:
                error = ("too_many_series", str(exc))
        status = self.store.status(endpoint.format, endpoint.url)
        with self.store.lock():
            status.last_attempt_seconds = now
            status.duration_seconds = time.perf_counter() - started
            status.requests_total["ok" if error is None else error[0]] += 1
            if error is None:
                status.up, status.error, status.last_success_seconds = True, None, now
            else:
                if status.error != error[1]:
                    log.warning("serving endpoint %s: %s", endpoint.url, error[1])
                status.up, status.error = False, error[1]
                status.errors_total[error[0]] += 1
