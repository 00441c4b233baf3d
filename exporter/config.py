"""The exporter's configuration: the `exporter:` section of the YAML file, or flags."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpubalance.exporter.window import TrendRule
from gpubalance.webconfig import parse_listen

DEFAULT_PORT = 9450


SERVING_FORMATS = ("triton", "vllm", "tgi", "sglang")


class ServingEndpoint(BaseModel):
    """One serving server's /metrics to scrape."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    url: str = Field(description="http(s)://host:port/metrics")
    format: Literal["triton", "vllm", "tgi", "sglang"]
    worker: str | None = Field(None, description="worker label; default host:port of the URL")
    gpu: int | str | None = Field(
        None, description="GPU index or UUID; default: found from the port's process (NVML)"
    )
    gpus: list[int] | None = Field(
        None, description="GPUs of a multi-GPU server, by rank (SGLang tp_rank, vLLM engine)"
    )
    service_class: str | None = Field(None, alias="class", description="class label")
    max_batch_size: int | None = Field(
        None,
        ge=1,
        description="the server's batch limit in requests (vLLM --max-num-seqs, TGI "
        "--max-batch-size, Triton max_batch_size, SGLang --max-running-requests): no serving "
        "stack exports it, and the analyzer's capacity estimates are sharper with it",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value


DEFAULT_OTLP_LISTEN = "127.0.0.1:4318"  # OTLP/HTTP's port, on loopback


class OtlpSettings(BaseModel):
    """The OTLP receiver's listener; beyond loopback it needs TLS and a token (checked at start,
    with the files, by gpubalance.exporter.otlp.OtlpListener)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = True
    listen: str = Field(DEFAULT_OTLP_LISTEN, description="HOST:PORT, apart from the scrape port")
    token_file: str | None = Field(None, description="file holding the bearer token pushes need")
    allow_unauthenticated: bool = Field(False, description="listen wide without TLS and token")
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    max_series: int = Field(10_000, gt=0, description="serving series, scraped and pushed")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> OtlpSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self


class ServingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    scrape_interval: float = Field(1.0, gt=0, description="seconds between scrapes")
    timeout: float = Field(0.5, gt=0, description="seconds a scrape may take")
    stale_after: float = Field(5.0, gt=0, description="older figures are not served")
    endpoints: list[ServingEndpoint] = Field(default_factory=list)
    otlp: OtlpSettings = OtlpSettings()


class ExporterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    listen: str = f":{DEFAULT_PORT}"
    interval: float = Field(1.0, gt=0, le=3600, description="seconds between samples")
    window: float = Field(30.0, gt=0, description="seconds averaged by window figures")
    trend_window: float = Field(300.0, gt=0, description="seconds of memory trend (slope)")
    trend_min_points: int = Field(10, ge=3, description="readings a memory slope needs")
    trend_min_span: float = Field(
        0.5, gt=0, le=1, description="share of trend_window the readings of a slope must span"
    )
    names: Literal["native", "dcgm", "both"] = "native"
    procfs: str = "/proc"
    nvml_library: str | None = None
    hostname: str | None = None
    nvml_retry_max: float = Field(30.0, gt=0, description="longest wait between NVML re-inits")
    nvml_deadline: float = Field(
        0.5, gt=0, description="seconds a GPU's reads may take per sample (at most the interval)"
    )
    nvml_lost_recheck: float = Field(30.0, gt=0, description="seconds between lost-GPU re-checks")
    collectors: dict[str, bool] = Field(default_factory=dict)
    serving: ServingConfig = ServingConfig()

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @model_validator(mode="after")
    def _check_windows(self) -> ExporterConfig:
        if self.window < self.interval:
            raise ValueError(
                f"window ({self.window} s) must be at least interval ({self.interval} s)"
            )
        if self.trend_window < self.window:
            raise ValueError(
                f"trend_window ({self.trend_window} s) must be at least window ({self.window} s)"
            )
        return self

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def trend_rule(self) -> TrendRule:
        return TrendRule(min_points=self.trend_min_points, min_span_ratio=self.trend_min_span)

    @property
    def history_length(self) -> int:
        """Samples kept: enough to cover the trend window."""
        return int(self.trend_window / self.interval) + 2

    def resolved_hostname(self) -> str:
        # dcgm-exporter's rule: NODE_NAME (set by Kubernetes), else the host name.
        return self.hostname or os.environ.get("NODE_NAME") or socket.gethostname()
