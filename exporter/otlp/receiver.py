"""The OTLP/HTTP receiver and its listener: ``POST /v1/metrics`` into the serving store.

The receiver listens on a port of its own (``exporter.serving.otlp.listen``, by default
127.0.0.1:4318, OTLP/HTTP's port), never on the scrape port: workers on the host push to
localhost, and whoever can read /metrics cannot forge the queue figures a controller acts on.
Beyond loopback the listener needs TLS and a bearer token, or an explicit
``allow_unauthenticated: true``.

The request is hostile until proven otherwise: the token is checked before the body is read;
the body is read incrementally up to a limit, before and after gzip (which the receiver
inflates itself, so an encoding it does not take gets 415, whatever aiohttp could inflate);
decoding (the costly part, bounded by the body size) runs in a worker thread with a bounded
number at a time, so a 4 MiB body never stalls /metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from google.protobuf import json_format
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)

from gpubalance.config import ConfigError, read_token
from gpubalance.exporter.collectors.serving.store import (
    SeriesLimitReached,
    ServingStore,
    StoredReading,
)
from gpubalance.exporter.config import OtlpSettings
from gpubalance.exporter.otlp.decode import JSON, PROTOBUF
from gpubalance.exporter.otlp.limits import DEFAULT_LIMITS, OtlpLimits, Refused, show
from gpubalance.exporter.otlp.series import Batch, Group, Series, changes_of, read_batch
from gpubalance.webconfig import bearer_refusal, is_loopback, parse_listen

log = logging.getLogger(__name__)

PATH = "/v1/metrics"
SOURCE = "otlp"
ENDPOINT = "otlp"  # the store's endpoint (and status) key for every pushed series
ENCODINGS = ("gzip", "identity")  # Content-Encoding taken; none at all means identity
KEY = "exporter.serving.otlp"


@dataclass(frozen=True, slots=True)
class OtlpStats:
    """Counters since start, for the exporter's self-metrics."""

    requests: Mapping[str, int]  # outcome (accepted, partial, or a refusal reason) -> count
    accepted_points: int
    rejected_points: Mapping[str, int]  # reason -> points refused (partial success)
    ignored_points: Mapping[str, int]  # reason -> points not for us (unknown_metric, ...)


@dataclass(frozen=True, slots=True)
class OtlpReply:
    """An HTTP answer: status, body and its content type."""

    status: int
    body: bytes
    content_type: str
    outcome: str  # accepted, partial, or the refusal's reason (as counted in stats().requests)


class OtlpReceiver:
    """Serves OTLP/HTTP ``POST /v1/metrics`` (protobuf or JSON, optionally gzip) into a store.

    With a ``token``, a request must carry ``Authorization: Bearer <token>``; one without it
    gets 401 and touches nothing in the store.
    """

    def __init__(
        self,
        store: ServingStore,
        limits: OtlpLimits = DEFAULT_LIMITS,
        clock: Callable[[], float] = time.time,
        token: str | None = None,
    ) -> None:
        self.store = store
        self.limits = limits
        self.clock = clock
        self.token = token
        self._decoding = asyncio.Semaphore(limits.max_concurrent_decodes)
        self._counting = threading.Lock()  # stats() is read from the sampler's thread
        self._requests: Counter[str] = Counter()
        self._accepted = 0
        self._rejected: Counter[str] = Counter()
        self._ignored: Counter[str] = Counter()
        # attribute -> values over stored OTLP series; a superset once the store drops some
        self._values: dict[str, set[object]] = {}

    def stats(self) -> OtlpStats:
        with self._counting:
            return OtlpStats(
                requests=dict(self._requests),
                accepted_points=self._accepted,
                rejected_points=dict(self._rejected),
                ignored_points=dict(self._ignored),
            )

    async def handle(self, request: web.Request) -> web.Response:
        """The aiohttp handler for ``POST /v1/metrics``."""
        started = time.perf_counter()
        content_type = request.content_type
        unauthorized = self._unauthorized(request.headers.get("Authorization"))
        if unauthorized is not None:
            with self._counting:
                self._requests["unauthorized"] += 1
            reply = _encode(Status(message=unauthorized), 401, content_type, "unauthorized")
            return web.Response(
                status=reply.status,
                body=reply.body,
                content_type=reply.content_type,
                headers={"WWW-Authenticate": 'Bearer realm="gpubalance OTLP"'},
            )
        try:
            try:
                encoding = self._check_headers(content_type, request.headers)
                async with self._decoding:
                    body = await self._read(request)
                    batch = await asyncio.get_running_loop().run_in_executor(
                        None, read_batch, body, content_type, encoding, self.limits
                    )
            except Refused as refused:
                reply = self._refuse(refused, content_type, started)
            else:
                reply = self._store(batch, content_type, started)
        except Exception:  # a bug must cost one request, not the exporter; the fuzzer hunts them
            log.exception("OTLP receiver failed on a request")
            reply = self._refuse(
                Refused(500, "internal_error", "the receiver failed; see the exporter's log"),
                content_type,
                started,
            )
        return web.Response(status=reply.status, body=reply.body, content_type=reply.content_type)

    def process(self, body: bytes, content_type: str, content_encoding: str = "") -> OtlpReply:
        """handle() without HTTP (nor a token), on a body already read: for the fuzzer."""
        started = time.perf_counter()
        try:
            encoding = self._check_headers(content_type, {"Content-Encoding": content_encoding})
            if len(body) > self.limits.max_body_bytes:
                raise Refused(
                    413, "too_large", f"the body exceeds {self.limits.max_body_bytes} bytes"
                )
            batch = read_batch(body, content_type, encoding, self.limits)
        except Refused as refused:
            return self._refuse(refused, content_type, started)
        return self._store(batch, content_type, started)

    def _unauthorized(self, authorization: str | None) -> str | None:
        """Why a request may not push, if so."""
        if self.token is None:
            return None
        return bearer_refusal(authorization, self.token, f"{KEY}.token_file")

    @staticmethod
    def _check_headers(content_type: str, headers: Mapping[str, str]) -> str:
        if content_type not in (PROTOBUF, JSON):
            raise Refused(
                415,
                "unsupported_media_type",
                f"Content-Type must be {PROTOBUF} or {JSON}, not {show(content_type)}",
            )
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", *ENCODINGS):
            raise Refused(
                415,
                "unsupported_encoding",
                f"Content-Encoding must be {' or '.join(ENCODINGS)} (or absent),"
                f" not {show(encoding)}",
            )
        return "gzip" if encoding == "gzip" else ""

    async def _read(self, request: web.Request) -> bytes:
        """The body as sent (still gzip, if so), never more than the limit in memory."""
        limit = self.limits.max_body_bytes
        too_large = Refused(413, "too_large", f"the body exceeds {limit} bytes")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        body = bytearray()
        try:
            async for chunk in request.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > limit:
                    raise too_large
        except ConnectionResetError:  # the client went away: nobody left to answer
            log.debug("an OTLP client disconnected after %d bytes of its body", len(body))
            raise Refused(
                400, "disconnected", "a client disconnected before its body was read"
            ) from None
        return bytes(body)

    def _refuse(self, refused: Refused, content_type: str, started: float) -> OtlpReply:
        with self._counting:
            self._requests[refused.reason] += 1
        status = self.store.status(SOURCE, ENDPOINT)
        with self.store.lock():
            status.last_attempt_seconds = self.clock()
            status.duration_seconds = time.perf_counter() - started
            status.error = refused.message
            status.errors_total[refused.reason] += 1
            status.requests_total[refused.reason] += 1
        return _encode(
            Status(message=refused.message), refused.status, content_type, refused.reason
        )

    def _store(self, batch: Batch, content_type: str, started: float) -> OtlpReply:
        now = self.clock()
        accepted = self._apply(batch, now)
        rejected = sum(batch.rejected.values())
        outcome = "partial" if rejected else "accepted"
        with self._counting:
            self._requests[outcome] += 1
            self._accepted += accepted
            self._rejected.update(batch.rejected)
            self._ignored.update(batch.ignored)
        response = ExportMetricsServiceResponse()
        message = None
        if rejected:
            message = f"rejected {rejected} of {accepted + rejected} points: " + "; ".join(
                f"{reason} {n} ({batch.details[reason]})"
                for reason, n in batch.rejected.most_common()
            )
            response.partial_success.rejected_data_points = rejected
            response.partial_success.error_message = message
        status = self.store.status(SOURCE, ENDPOINT)
        with self.store.lock():
            status.up = True
            status.last_attempt_seconds = status.last_success_seconds = now
            status.duration_seconds = time.perf_counter() - started
            status.error = message
            status.errors_total.update(batch.rejected)
            status.requests_total[outcome] += 1
            status.points_total.update(
                accepted=accepted, rejected=rejected, ignored=sum(batch.ignored.values())
            )
        return _encode(response, 200, content_type, outcome)

    def _apply(self, batch: Batch, now: float) -> int:
        """Merge the batch into the store, series by series; returns the points accepted."""
        by_series: dict[Series, list[tuple[str, Group]]] = {}
        for (series, name), group in batch.groups.items():
            by_series.setdefault(series, []).append((name, group))
        accepted = 0
        recounted = False
        for series, groups in by_series.items():
            stored = self.store.get(SOURCE, ENDPOINT, series.worker, series.key)
            reading = stored.reading if stored is not None else series.reading()
            changes, points = changes_of(batch, groups, reading)
            if not changes:
                continue
            if stored is None and (full := self._full_attribute(series)) is not None:
                if not recounted:  # once per request: it walks every stored series
                    self._recount_values()
                    recounted = True
                    full = self._full_attribute(series)
                if full is not None:
                    limit = self.limits.max_values_per_attribute
                    batch.reject("attribute_cardinality", f"{full} has {limit} values", points)
                    continue
            try:
                self.store.put(
                    StoredReading(
                        SOURCE,
                        series.worker,
                        ENDPOINT,
                        replace(reading, **changes),
                        now,
                        series.gpu_index,
                    )
                )
            except SeriesLimitReached as exc:
                batch.reject("series_limit", str(exc), points)
                continue
            if stored is None:
                self._count_values(series)
            accepted += points
        return accepted

    def _full_attribute(self, series: Series) -> str | None:
        """The attribute a new series would take past max_values_per_attribute, if any."""
        for key, value in series.labels():
            seen = self._values.get(key, ())
            if (
                value is not None
                and value not in seen
                and len(seen) >= self.limits.max_values_per_attribute
            ):
                return key
        return None

    def _count_values(self, series: Series) -> None:
        for key, value in series.labels():
            if value is not None:
                self._values.setdefault(key, set()).add(value)

    def _recount_values(self) -> None:
        # the store may have dropped series since their values were counted
        self._values = {}
        for stored in self.store.readings():
            if stored.source == SOURCE:
                r = stored.reading
                self._count_values(
                    Series(stored.worker, r.service_class, r.tenant, r.gpu_uuid, stored.gpu_index)
                )


def _encode(message: Any, status: int, content_type: str, outcome: str) -> OtlpReply:
    """A response message in the request's encoding (protobuf when that is unknown)."""
    if content_type == JSON:
        body = json.dumps(json_format.MessageToDict(message), separators=(",", ":")).encode()
        return OtlpReply(status, body, JSON, outcome)
    return OtlpReply(status, message.SerializeToString(), PROTOBUF, outcome)


# -- the listener ------------------------------------------------------------------------------


def otlp_runner(receiver: OtlpReceiver) -> web.AppRunner:
    """An aiohttp runner serving ``receiver`` at POST /v1/metrics, and nothing else."""
    # bodies up to the receiver's own limit, which answers 413 itself
    app = web.Application(client_max_size=receiver.limits.max_body_bytes + 1024)
    app.router.add_post(PATH, receiver.handle)
    # the receiver inflates gzip itself: aiohttp would answer br or zstd with 400 (or inflate
    # them when their modules happen to be installed), never with OTLP's 415
    return web.AppRunner(app, auto_decompress=False, access_log=None)


@dataclass(frozen=True)
class OtlpListener:
    """Where the receiver listens, with its token and TLS; checked at start."""

    host: str
    port: int
    token: str | None
    ssl_context: ssl.SSLContext | None
    limits: OtlpLimits

    @classmethod
    def from_settings(cls, settings: OtlpSettings) -> OtlpListener | None:
        """The listener, None when the receiver is off. Reads the token and certificate;
        raises ConfigError naming the key at fault, and for a listener beyond loopback without
        TLS and a token (unless allow_unauthenticated)."""
        if not settings.enabled:
            return None
        host, port = parse_listen(settings.listen)
        token = None
        if settings.token_file is not None:
            token = read_token(settings.token_file, f"{KEY}.token_file")
        context = None
        if settings.tls_cert_file is not None and settings.tls_key_file is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"{KEY}.tls_cert_file, tls_key_file: cannot load"
                    f" {settings.tls_cert_file} with {settings.tls_key_file}: {exc}"
                ) from None
        if not is_loopback(host) and not (token and context) and not settings.allow_unauthenticated:
            raise ConfigError(
                f"{KEY}.listen (--otlp-listen): {settings.listen} is beyond loopback, where"
                " anyone who reaches it could push queue figures; set token_file, tls_cert_file"
                f" and tls_key_file under {KEY}, or allow_unauthenticated: true"
            )
        return cls(host, port, token, context, OtlpLimits(max_body_bytes=settings.max_body_bytes))

    async def start(self, store: ServingStore) -> tuple[web.AppRunner, str]:
        """Listen; returns the runner to clean up and the URL pushes go to. Raises OSError."""
        runner = otlp_runner(OtlpReceiver(store, self.limits, token=self.token))
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port, ssl_context=self.ssl_context).start()
        except OSError:
            await runner.cleanup()
            raise
        host, port = runner.addresses[0][:2]
        scheme = "https" if self.ssl_context is not None else "http"
        host = f"[{host}]" if ":" in host else host
        return runner, f"{scheme}://{host}:{port}{PATH}"
