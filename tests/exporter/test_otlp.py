"""The OTLP receiver on its own listener (the exporter's otlp_runner, in a thread): encodings,
temporalities, the merge into one reading per series, refusals, limits, the token, a real
OpenTelemetry SDK, and a fuzz."""

from __future__ import annotations

import asyncio
import gzip
import importlib.util
import json
import logging
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
from aiohttp import web
from google.protobuf import json_format
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, UpDownCounter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from gpubalance.exporter.collectors.serving.store import ServingStore, StoredReading
from gpubalance.exporter.otlp import JSON, PROTOBUF, OtlpLimits, OtlpReceiver, otlp_runner
from gpubalance.exporter.otlp.decode import decode
from gpubalance.exporter.otlp.limits import Tally
from gpubalance.exporter.otlp.series import SPECS

ROOT = Path(__file__).resolve().parents[2]
DEPTH = "gpubalance.queue.depth"
DELAY = "gpubalance.batch.assembly_delay"
SIZE = "gpubalance.batch.size"
DURATION = "gpubalance.request.duration"
FAILURES = "gpubalance.memory.allocation_failures"
DELTA, CUMULATIVE = 1, 2
W0 = {"service.instance.id": "w0", "gpu.uuid": "GPU-0", "gpu.index": 0, "gpubalance.class": "chat"}
W0_KEY = "worker=w0,class=chat,gpu_uuid=GPU-0,gpu_index=0"


def _fuzzer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_otlp", ROOT / "bench" / "fuzz_otlp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz_otlp = _fuzzer()


# -- payloads ------------------------------------------------------------------------------


def kv(key: str, value: object) -> KeyValue:
    any_value = AnyValue()
    if isinstance(value, str):
        any_value.string_value = value
    elif isinstance(value, bool):
        any_value.bool_value = value
    elif isinstance(value, int):
        any_value.int_value = value
    elif isinstance(value, float):
        any_value.double_value = value
    else:
        any_value.CopyFrom(value)  # an AnyValue already
    return KeyValue(key=key, value=any_value)


def _attributes(attributes: Mapping[str, object] | None) -> list[KeyValue]:
    return [kv(k, v) for k, v in (attributes or {}).items()]


def gauge(
    value: float, attributes: Mapping[str, object] | None = None, time_unix_nano: int = 1
) -> Metric:
    metric = Metric(name=DEPTH)
    point = metric.gauge.data_points.add(
        time_unix_nano=time_unix_nano, attributes=_attributes(attributes)
    )
    if isinstance(value, int):
        point.as_int = value
    else:
        point.as_double = value
    return metric


def total(
    value: float,
    temporality: int = CUMULATIVE,
    name: str = FAILURES,
    monotonic: bool = True,
    attributes: Mapping[str, object] | None = None,
) -> Metric:
    """A Sum: a counter, or with monotonic=False an UpDownCounter."""
    metric = Metric(name=name)
    metric.sum.aggregation_temporality = temporality
    metric.sum.is_monotonic = monotonic
    metric.sum.data_points.add(as_double=value, attributes=_attributes(attributes))
    return metric


def histogram(
    name: str,
    sum_: float,
    count: int,
    temporality: int = CUMULATIVE,
    attributes: Mapping[str, object] | None = None,
    unit: str = "s",
    time_unix_nano: int = 1,
) -> Metric:
    metric = Metric(name=name, unit=unit)
    metric.histogram.aggregation_temporality = temporality
    point = metric.histogram.data_points.add(
        sum=sum_, count=count, time_unix_nano=time_unix_nano, attributes=_attributes(attributes)
    )
    point.exemplars.add(as_double=0.1, trace_id=bytes(range(16)), span_id=bytes(range(8)))
    return metric


def request(
    *metrics: Metric, resource: Mapping[str, object] | None = W0
) -> ExportMetricsServiceRequest:
    message = ExportMetricsServiceRequest()
    rm = message.resource_metrics.add()
    rm.resource.attributes.extend(_attributes(resource))
    rm.scope_metrics.add().metrics.extend(metrics)
    return message


def five() -> ExportMetricsServiceRequest:
    """The five instruments of one worker; request durations for one tenant."""
    return request(
        gauge(3),
        histogram(DELAY, 0.5, 10),
        histogram(SIZE, 40, 10, unit="{request}"),
        histogram(DURATION, 2.0, 8, attributes={"gpubalance.tenant": "acme"}),
        total(2),
    )


def as_json(message: ExportMetricsServiceRequest) -> bytes:
    return json.dumps(fuzz_otlp.otlp_json(message)).encode()


# -- the app ---------------------------------------------------------------------------------


class Served:
    """A receiver on a real HTTP server in a thread of its own."""

    def __init__(self, receiver: OtlpReceiver, url: str) -> None:
        self.receiver = receiver
        self.store = receiver.store
        self.url = url

    def post(
        self,
        body: bytes,
        content_type: str = PROTOBUF,
        encoding: str | None = None,
        token: str | None = None,
    ) -> tuple[int, bytes, str]:
        headers = {"Content-Type": content_type}
        if encoding:
            headers["Content-Encoding"] = encoding
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        call = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(call, timeout=30) as response:
                return response.status, response.read(), response.headers["Content-Type"]
        except urllib.error.HTTPError as error:
            return error.code, error.read(), error.headers["Content-Type"]

    def push(
        self, message: ExportMetricsServiceRequest, content_type: str = PROTOBUF
    ) -> ExportMetricsServiceResponse:
        if content_type == JSON:
            status, body, _ = self.post(as_json(message), JSON)
            assert status == 200, body
            return json_format.Parse(body, ExportMetricsServiceResponse())
        status, body, _ = self.post(message.SerializeToString())
        assert status == 200, body
        return ExportMetricsServiceResponse.FromString(body)

    def readings(self) -> dict[str, StoredReading]:
        return {stored.reading.key: stored for stored in self.store.readings()}


@contextmanager
def serve(receiver: OtlpReceiver) -> Iterator[Served]:
    """``receiver`` on 127.0.0.1 (a free port), on the runner the exporter's listener uses."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = otlp_runner(receiver)

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield Served(receiver, f"http://127.0.0.1:{runner.addresses[0][1]}/v1/metrics")
    finally:
        # after an early 413 aiohttp still reads the unread body; stopping midway waits 10 s
        deadline = time.monotonic() + 5
        while runner.server is not None and runner.server.connections:
            assert time.monotonic() < deadline, "connections stay open"
            time.sleep(0.01)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture
def served() -> Iterator[Served]:
    with serve(OtlpReceiver(ServingStore())) as s:
        yield s


def message_of(body: bytes, content_type: str) -> str:
    """The message of an error response (google.rpc.Status, as OTLP/HTTP specifies)."""
    if content_type == JSON:
        return json.loads(body)["message"]
    return Status.FromString(body).message


# -- encodings and the merge ---------------------------------------------------------------


def test_protobuf_and_json_give_the_same_store(served: Served) -> None:
    status, body, content_type = served.post(five().SerializeToString())
    assert (status, content_type) == (200, PROTOBUF)
    assert ExportMetricsServiceResponse.FromString(body) == ExportMetricsServiceResponse()
    by_protobuf = served.readings()

    with serve(OtlpReceiver(ServingStore())) as other:
        status, body, content_type = other.post(as_json(five()), JSON)
        assert (status, json.loads(body), content_type) == (200, {}, JSON)
        by_json = other.readings()

    assert {k: v.reading for k, v in by_json.items()} == {
        k: v.reading for k, v in by_protobuf.items()
    }
    w0 = by_protobuf[W0_KEY]
    assert (w0.source, w0.endpoint, w0.worker, w0.gpu_index) == ("otlp", "otlp", "w0", 0)
    r = w0.reading
    assert (r.gpu_uuid, r.service_class, r.tenant) == ("GPU-0", "chat", None)
    assert r.queue_depth == 3
    assert (r.batch_assembly_delay_seconds_sum, r.batch_assembly_delay_seconds_count) == (0.5, 10)
    assert (r.batch_size_sum, r.batch_size_count) == (40, 10)
    assert r.allocation_failures_total == 2
    assert r.request_duration_seconds_sum is None  # those came for one tenant: another series
    acme = by_protobuf["worker=w0,class=chat,tenant=acme,gpu_uuid=GPU-0,gpu_index=0"].reading
    assert (acme.request_duration_seconds_sum, acme.request_duration_seconds_count) == (2.0, 8)
    assert acme.queue_depth is None


def test_pushes_of_different_instruments_merge_into_one_reading(served: Served) -> None:
    served.push(request(gauge(4)))
    served.push(request(histogram(DELAY, 0.25, 5)))
    served.push(request(histogram(DURATION, 1.5, 3, unit="ms")))  # converted to seconds
    assert list(served.readings()) == [W0_KEY]
    r = served.readings()[W0_KEY].reading
    assert (r.queue_depth, r.batch_assembly_delay_seconds_sum) == (4, 0.25)
    assert (r.request_duration_seconds_sum, r.request_duration_seconds_count) == (0.0015, 3)


def test_gzip(served: Served) -> None:
    assert served.post(gzip.compress(five().SerializeToString()), encoding="gzip")[0] == 200
    assert served.post(gzip.compress(as_json(five())), JSON, "gzip")[0] == 200
    assert served.readings()[W0_KEY].reading.queue_depth == 3
    assert served.post(b"not gzip at all", encoding="gzip")[0] == 400
    assert served.receiver.stats().requests["bad_compression"] == 1


def test_cumulative_replaces_and_delta_adds(served: Served) -> None:
    served.push(request(histogram(DURATION, 2.0, 4)))
    served.push(request(histogram(DURATION, 3.0, 6)))
    served.push(request(total(2, DELTA), total(5, DELTA, DEPTH, monotonic=False)))
    served.push(request(total(3, DELTA), total(-2, DELTA, DEPTH, monotonic=False)))
    r = served.readings()[W0_KEY].reading
    assert (r.request_duration_seconds_sum, r.request_duration_seconds_count) == (3.0, 6)
    assert (r.allocation_failures_total, r.queue_depth) == (5, 3)
    # a delta that would take the depth below zero (deltas lost) is refused, the rest kept
    response = served.push(request(total(-10, DELTA, DEPTH, monotonic=False), total(1, DELTA)))
    assert response.partial_success.rejected_data_points == 1
    assert "invalid_value" in response.partial_success.error_message
    r = served.readings()[W0_KEY].reading
    assert (r.queue_depth, r.allocation_failures_total) == (3, 6)
    served.push(request(gauge(7)))  # a Gauge replaces
    assert served.readings()[W0_KEY].reading.queue_depth == 7


def test_streams_of_one_series_are_summed_and_a_repeated_stream_counts_once(
    served: Served,
) -> None:
    route_a = histogram(DURATION, 1.0, 2, attributes={"route": "a"}, time_unix_nano=5)
    route_b = histogram(DURATION, 2.0, 3, attributes={"route": "b"}, time_unix_nano=5)
    route_a_earlier = histogram(DURATION, 0.5, 1, attributes={"route": "a"}, time_unix_nano=4)
    served.push(request(route_a, route_b, route_a_earlier))  # as a batching collector sends
    r = served.readings()[W0_KEY].reading
    assert (r.request_duration_seconds_sum, r.request_duration_seconds_count) == (3.0, 5)


def test_gpu_and_worker_from_the_point_else_the_resource(served: Served) -> None:
    served.push(
        request(
            gauge(1),
            gauge(2, {"gpu.index": 1, "gpu.uuid": "GPU-1"}),
            resource={"service.instance.id": "w0", "gpu.index": 0, "gpu.uuid": "GPU-0"},
        )
    )
    served.push(request(gauge(5), resource={"gpu.index": " 2"}))  # OTEL_RESOURCE_ATTRIBUTES
    bad = served.push(request(*(gauge(1, {"gpu.index": v}) for v in (1024, -1, "9" * 5000, 1.0))))
    assert bad.partial_success.rejected_data_points == 4
    got = {
        key: (s.worker, s.gpu_index, s.reading.gpu_uuid, s.reading.queue_depth)
        for key, s in served.readings().items()
    }
    assert got == {
        "worker=w0,gpu_uuid=GPU-0,gpu_index=0": ("w0", 0, "GPU-0", 1),
        "worker=w0,gpu_uuid=GPU-1,gpu_index=1": ("w0", 1, "GPU-1", 2),
        "worker=unknown,gpu_index=2": ("unknown", 2, None, 5),
    }


def test_separators_in_values_keep_keys_apart(served: Served) -> None:
    served.push(request(gauge(1, {"gpubalance.tenant": "a,class=b"})))
    served.push(request(gauge(2, {"gpubalance.tenant": "a", "gpubalance.class": "b"})))
    assert len(served.readings()) == 2
    assert (
        "worker=w0,class=chat,tenant=a%2Cclass%3Db,gpu_uuid=GPU-0,gpu_index=0" in served.readings()
    )


# -- refusals and partial success --------------------------------------------------------------


REFUSALS = [
    (b"{}", "text/plain", None, 415, "unsupported_media_type", "Content-Type must be"),
    (b"", PROTOBUF, "deflate", 415, "unsupported_encoding", "Content-Encoding must be"),
    (b"\xff\xff\xff", PROTOBUF, None, 400, "malformed", "not an ExportMetricsServiceRequest"),
    (b"[1, 2]", JSON, None, 400, "malformed", "must be a JSON object"),
    (b'{"resourceMetrics": {}}', JSON, None, 400, "malformed", "not an OTLP/JSON Export"),
    # upb fails on a lone surrogate in a key with a SystemError
    (b'{"resourceMetrics": [{"\\ud800": 1}]}', JSON, None, 400, "malformed", "lone surrogate"),
    # json_format takes enum names (OTLP/JSON forbids them) and fails on Infinity
    *(
        (
            b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "gpubalance.batch.size",'
            b' "histogram": {"aggregationTemporality": %s}}]}]}]}' % temporality,
            JSON,
            None,
            400,
            "malformed",
            "aggregationTemporality must be an integer",
        )
        for temporality in (b"Infinity", b"1.0", b'"AGGREGATION_TEMPORALITY_DELTA"')
    ),
    (
        b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "gpubalance.batch.size",'
        b' "histogram": {"dataPoints": [{"exemplars": [{"traceId": "AQID=="}]}]}}]}]}]}',
        JSON,
        None,
        400,
        "malformed",
        "exemplar traceId must be hex",
    ),
    (b"{}", JSON, "br", 415, "unsupported_encoding", "must be gzip or identity"),
    (b"{}", JSON, "zstd", 415, "unsupported_encoding", "must be gzip or identity"),
    (b"\xff{}", JSON, None, 400, "malformed", "not JSON"),
    (b"\0" * (4 * 1024 * 1024 + 1), PROTOBUF, None, 413, "too_large", "exceeds 4194304 bytes"),
    (
        gzip.compress(b"\0" * (16 << 20)),
        PROTOBUF,
        "gzip",
        413,
        "decompressed_too_large",
        "inflates",
    ),
]


@pytest.mark.parametrize(
    ("body", "content_type", "encoding", "status", "reason", "message"),
    REFUSALS,
    ids=[r[4] for r in REFUSALS],
)
def test_refusals_answer_with_a_status_and_a_message(
    served: Served,
    body: bytes,
    content_type: str,
    encoding: str | None,
    status: int,
    reason: str,
    message: str,
) -> None:
    got_status, got_body, got_type = served.post(body, content_type, encoding)
    assert got_status == status
    assert message in message_of(got_body, got_type)
    assert got_type == (JSON if content_type == JSON else PROTOBUF)
    assert served.receiver.stats().requests == {reason: 1}
    (source,) = served.store.statuses()
    assert (source.source, source.up, source.errors_total[reason]) == ("otlp", False, 1)
    assert message in source.error
    assert len(served.store) == 0


@pytest.mark.parametrize("content_type", [PROTOBUF, JSON])
def test_partial_success_keeps_the_good_points(served: Served, content_type: str) -> None:
    wrong_type = histogram(DEPTH, 1.0, 1)
    no_temporality = histogram(DELAY, 1.0, 1, temporality=0)
    stale = gauge(9, {"gpubalance.tenant": "gone"})
    stale.gauge.data_points[0].flags = 1  # NO_RECORDED_VALUE
    unknown = Metric(name="http.server.active_requests")
    unknown.gauge.data_points.add(as_int=1)
    message = request(
        gauge(2),
        wrong_type,
        no_temporality,
        gauge(float("nan"), {"gpubalance.tenant": "x"}),
        total(-1),
        gauge(1, {"gpu.index": "first"}),
        gauge(1, {"gpubalance.tenant": "line\nbreak"}),
        histogram(DURATION, 1.0, 2, unit="min"),
        stale,
        unknown,
    )
    body = as_json(message) if content_type == JSON else message.SerializeToString()
    status, reply, _ = served.post(body, content_type)
    assert status == 200
    if content_type == JSON:
        partial = json.loads(reply)["partialSuccess"]
        rejected, text = int(partial["rejectedDataPoints"]), partial["errorMessage"]
    else:
        response = ExportMetricsServiceResponse.FromString(reply).partial_success
        rejected, text = response.rejected_data_points, response.error_message
    assert rejected == 7
    assert text.startswith("rejected 7 of 8 points: invalid_value 2 (")
    stats = served.receiver.stats()
    assert stats.rejected_points == {
        "wrong_type": 1,
        "bad_temporality": 1,
        "invalid_value": 2,
        "bad_attribute": 2,
        "wrong_unit": 1,
    }
    assert stats.ignored_points == {"unknown_metric": 1, "no_recorded_value": 1}
    assert (stats.accepted_points, stats.requests) == (1, {"partial": 1})
    assert {k: v.reading.queue_depth for k, v in served.readings().items()} == {W0_KEY: 2}
    (source,) = served.store.statuses()
    assert source.up and source.errors_total["bad_attribute"] == 2
    assert source.error == text


# -- limits ------------------------------------------------------------------------------------


def tenants(*indexes: int, **extra: object) -> Metric:
    """One queue depth gauge with a point per tenant ``t<index>``."""
    metric = Metric(name=DEPTH)
    for i in indexes:
        attributes = _attributes({"gpubalance.tenant": f"t{i}", **extra})
        metric.gauge.data_points.add(as_int=i, attributes=attributes)
    return metric


def _nested(depth: int) -> AnyValue:
    value = AnyValue(string_value="leaf")
    for _ in range(depth - 1):
        outer = AnyValue()
        outer.array_value.values.append(value)
        value = outer
    return value


LIMITS = [
    # (limits, store series limit, metrics of the request, reason, rejected points, kept series)
    (OtlpLimits(max_points_per_request=3), 100, [tenants(*range(5))], "too_many_points", 2, 3),
    (
        OtlpLimits(max_attributes=4),
        100,
        [gauge(1), gauge(2, {f"k{i}": i for i in range(5)})],
        "too_many_attributes",
        1,
        1,
    ),
    (
        OtlpLimits(max_attribute_value_length=8),
        100,
        [gauge(1), gauge(2, {"gpubalance.tenant": "x" * 9})],
        "attribute_too_long",
        1,
        1,
    ),
    (
        OtlpLimits(max_values_per_attribute=2),
        100,
        [tenants(0, 1, 2)],
        "attribute_cardinality",
        1,
        2,
    ),
    (
        OtlpLimits(max_any_value_depth=3),
        100,
        [gauge(1, {"ok": _nested(3)}), gauge(2, {"deep": _nested(4), "gpubalance.tenant": "t"})],
        "attribute_too_deep",
        1,
        1,
    ),
    (OtlpLimits(), 2, [tenants(0, 1, 2)], "series_limit", 1, 2),
]


@pytest.mark.parametrize("content_type", [PROTOBUF, JSON])
@pytest.mark.parametrize(
    ("limits", "max_series", "metrics", "reason", "rejected", "kept"),
    LIMITS,
    ids=[case[3] for case in LIMITS],
)
def test_each_limit_rejects_with_its_reason_and_keeps_the_rest(
    limits: OtlpLimits,
    max_series: int,
    metrics: list[Metric],
    reason: str,
    rejected: int,
    kept: int,
    content_type: str,
) -> None:
    with serve(OtlpReceiver(ServingStore(max_series), limits)) as served:
        response = served.push(request(*metrics), content_type)
        assert response.partial_success.rejected_data_points == rejected
        assert served.receiver.stats().rejected_points == {reason: rejected}
        assert len(served.store) == kept


def test_cardinality_counts_values_over_requests_and_forgets_dropped_series() -> None:
    store = ServingStore()
    with serve(OtlpReceiver(store, OtlpLimits(max_values_per_attribute=2))) as served:
        served.push(request(tenants(0, 1)))
        assert served.push(request(tenants(0, 1, 2))).partial_success.rejected_data_points == 1
        store.replace_endpoint("otlp", "otlp", "w0", [], now=0.0)  # the store drops them
        assert served.push(request(tenants(1, 2))).partial_success.rejected_data_points == 0
        assert len(store) == 2


def test_a_resource_over_a_limit_rejects_all_its_points() -> None:
    limits = OtlpLimits(max_attributes=5)
    resource = {**W0, **{f"extra{i}": "v" for i in range(2)}}
    with serve(OtlpReceiver(ServingStore(), limits)) as served:
        response = served.push(request(gauge(1), total(1), resource=resource))
        assert response.partial_success.rejected_data_points == 2
        assert "resource: 6 attributes" in response.partial_success.error_message


@pytest.mark.parametrize("content_type", [PROTOBUF, JSON])
def test_body_and_metric_count_limits_refuse_the_request(content_type: str) -> None:
    limits = OtlpLimits(max_body_bytes=2000, max_points_per_request=3)
    encode = as_json if content_type == JSON else ExportMetricsServiceRequest.SerializeToString
    with serve(OtlpReceiver(ServingStore(), limits)) as served:
        big = request(tenants(0, 1, 2, padding="p" * 1000))
        assert served.post(encode(big), content_type)[0] == 413
        assert served.post(gzip.compress(encode(big)), content_type, "gzip")[0] == 413
        many = request(*[gauge(1)] * 4)
        status, body, got_type = served.post(encode(many), content_type)
        assert (status, served.receiver.stats().requests["too_many_metrics"]) == (413, 1)
        assert "send smaller batches" in message_of(body, got_type)
        assert served.receiver.stats().requests == {
            "too_large": 1,
            "decompressed_too_large": 1,
            "too_many_metrics": 1,
        }


# -- OTLP/JSON: proto3's JSON mapping with the specification's deviations ---------------------


def test_json_decodes_to_the_message_protobuf_carries() -> None:
    """Hex trace and span ids (either case), enums as integers, 64-bit integers as numbers or
    strings, lowerCamelCase keys (and the proto names the collector also takes)."""
    expected = request(
        histogram(DELAY, 0.5, 10, temporality=DELTA, time_unix_nano=2**62),
        resource={"service.instance.id": "w0", "gpu.index": 3},
    )
    point = {
        "timeUnixNano": 2**62,
        "count": "10",
        "sum": 0.5,
        "exemplars": [
            {
                "asDouble": 0.1,
                "traceId": bytes(range(16)).hex().upper(),
                "span_id": "0001020304050607",
            }
        ],
    }
    body = json.dumps(
        {
            "resourceMetrics": [
                {
                    "resource": {
                        "attributes": [
                            {"key": "service.instance.id", "value": {"stringValue": "w0"}},
                            {"key": "gpu.index", "value": {"intValue": 3}},
                        ]
                    },
                    "scope_metrics": [
                        {
                            "metrics": [
                                {
                                    "name": DELAY,
                                    "unit": "s",
                                    "histogram": {
                                        "aggregationTemporality": 1,
                                        "dataPoints": [point],
                                    },
                                    "futureField": {"ignored": True},
                                }
                            ]
                        }
                    ],
                }
            ]
        }
    ).encode()
    tally = Tally.of(OtlpLimits())
    assert decode(body, JSON, "", OtlpLimits(), tally, SPECS) == expected
    assert (tally.over_budget, tally.ignored) == (0, {})


def test_a_json_body_of_too_many_values_is_refused_and_protobuf_is_not() -> None:
    with serve(OtlpReceiver(ServingStore(), OtlpLimits(max_json_values=50))) as served:
        status, body, content_type = served.post(as_json(five()), JSON)
        assert status == 413
        assert "max_json_values" in message_of(body, content_type)
        assert served.post(five().SerializeToString())[0] == 200


# -- who may push ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    [None, "", "s3cre7", "s3cre", "s3cret0"],
    ids=["none", "empty", "wrong", "prefix", "longer"],
)
def test_without_the_token_a_push_gets_401_and_changes_nothing(token: str | None) -> None:
    with serve(OtlpReceiver(ServingStore(), token="s3cret")) as served:
        status, body, content_type = served.post(five().SerializeToString(), token=token)
        assert status == 401
        assert "token" in message_of(body, content_type)
        assert len(served.store) == 0 and not served.store.statuses()
        assert served.receiver.stats().requests == {"unauthorized": 1}
        assert served.post(five().SerializeToString(), token="s3cret")[0] == 200
        assert len(served.store) == 2


def test_a_client_gone_mid_upload_costs_one_quiet_line(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = int(served.url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 100000\r\n\r\n" + b"\0" * 1000
        )
    deadline = time.monotonic() + 10
    while "disconnected" not in served.receiver.stats().requests:
        assert time.monotonic() < deadline, served.receiver.stats()
        time.sleep(0.01)
    ours = [r for r in caplog.records if r.name.startswith("gpubalance")]
    assert [(r.levelno, r.exc_info) for r in ours] == [(logging.DEBUG, None)]
    assert "disconnected" in ours[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(served.store) == 0


# -- a real OpenTelemetry SDK --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("compression", "temporality"),
    [
        (Compression.NoCompression, AggregationTemporality.CUMULATIVE),
        (Compression.Gzip, AggregationTemporality.CUMULATIVE),
        (Compression.NoCompression, AggregationTemporality.DELTA),
    ],
    ids=["protobuf", "gzip", "delta"],
)
def test_the_opentelemetry_sdk_pushes_into_the_store(
    served: Served, compression: Compression, temporality: AggregationTemporality
) -> None:
    exporter = OTLPMetricExporter(
        endpoint=served.url,
        compression=compression,
        preferred_temporality={kind: temporality for kind in (Counter, UpDownCounter, Histogram)},
    )
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource.create(
            {"service.instance.id": "sdk", "gpu.uuid": "GPU-7", "gpu.index": 7}
        ),
    )
    meter = provider.get_meter("test")
    depth = meter.create_up_down_counter(DEPTH)
    delay = meter.create_histogram(DELAY, unit="s")
    size = meter.create_histogram(SIZE)
    duration = meter.create_histogram(DURATION, unit="s")
    failures = meter.create_counter(FAILURES)
    for _ in range(2):  # the second push tells replacing from adding
        depth.add(3)
        depth.add(-1)
        delay.record(0.25)
        size.record(4)
        size.record(8)
        duration.record(0.5, {"gpubalance.tenant": "acme", "http.route": "/a"})
        duration.record(1.5, {"gpubalance.tenant": "acme", "http.route": "/b"})
        failures.add(1)
        assert provider.force_flush(10_000)
    provider.shutdown()

    base = "worker=sdk,gpu_uuid=GPU-7,gpu_index=7"
    readings = served.readings()
    assert set(readings) == {base, "worker=sdk,tenant=acme,gpu_uuid=GPU-7,gpu_index=7"}
    assert readings[base].gpu_index == 7
    r = readings[base].reading
    assert r.queue_depth == 4
    assert (r.batch_assembly_delay_seconds_sum, r.batch_assembly_delay_seconds_count) == (0.5, 2)
    assert (r.batch_size_sum, r.batch_size_count) == (24, 4)
    assert r.allocation_failures_total == 2
    acme = readings["worker=sdk,tenant=acme,gpu_uuid=GPU-7,gpu_index=7"].reading
    assert (acme.request_duration_seconds_sum, acme.request_duration_seconds_count) == (4.0, 4)
    assert set(served.receiver.stats().requests) == {"accepted"}


# -- hostile input -------------------------------------------------------------------------------


def test_fuzzed_requests_never_escape_the_receiver_and_memory_stays_bounded() -> None:
    limits = OtlpLimits(max_body_bytes=256 * 1024, max_points_per_request=2000)
    result = fuzz_otlp.fuzz_otlp(1000, seed=11, limits=limits)
    assert result["crashes"] == 0, result["crash_examples"]
    outcomes = result["outcomes"]
    assert outcomes["200 accepted"] > 50 and outcomes["200 partial"] > 50
    assert outcomes["400 malformed"] > 50 and outcomes["413 decompressed_too_large"] >= 2
    assert outcomes["413 too_many_metrics"] >= 1
    # the costliest body is JSON of empty objects: ~25 bytes of Python objects per byte
    assert result["tracemalloc_peak_bytes"] < 40 * limits.max_body_bytes


def test_fuzzed_requests_over_http_get_only_4xx_or_200(served: Served) -> None:
    rng = random.Random(3)
    requests = [fuzz_otlp.valid_request(rng, t) for t in (1, 2)]
    seeds = [r.SerializeToString() for r in requests]
    texts = [json.dumps(fuzz_otlp.otlp_json(r)) for r in requests]
    inputs = [fuzz_otlp.make_input(rng, requests, seeds, texts) for _ in range(150)]
    statuses = {served.post(*fuzzed)[0] for fuzzed in inputs}
    assert statuses <= {200, 400, 413, 415}
    assert "internal_error" not in served.receiver.stats().requests
