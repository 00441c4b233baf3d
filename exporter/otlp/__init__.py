"""OTLP/HTTP metrics receiver: custom serving workers push their queues to ``POST /v1/metrics``
on a listener of its own (127.0.0.1:4318 by default).

A worker that no scrape adapter understands reports through OpenTelemetry instead (see
:mod:`gpubalance.instrument`). One path for both encodings, one module per step:

- :mod:`.decode`: body -> ``ExportMetricsServiceRequest`` (gzip; protobuf, or OTLP/JSON through
  protobuf's ``json_format``)
- :mod:`.limits`: the messages -> plain metrics and points, within the request's limits
- :mod:`.series`: points -> what to store, one series per (worker, class, tenant, GPU)
- :mod:`.receiver`: HTTP, the token, the store, and the listener
"""

from gpubalance.exporter.otlp.decode import JSON, PROTOBUF
from gpubalance.exporter.otlp.limits import OtlpLimits
from gpubalance.exporter.otlp.receiver import (
    OtlpListener,
    OtlpReceiver,
    OtlpReply,
    OtlpStats,
    otlp_runner,
)

__all__ = [
    "JSON",
    "PROTOBUF",
    "OtlpLimits",
    "OtlpListener",
    "OtlpReceiver",
    "OtlpReply",
    "OtlpStats",
    "otlp_runner",
]
