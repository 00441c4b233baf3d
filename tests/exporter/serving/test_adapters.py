"""The serving adapters on each server's own /metrics text: every field of every reading, the
renames, partial and wrongly typed metrics, several models, engines and ranks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpubalance.exporter.collectors.serving import sglang, tgi, triton, vllm
from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.collectors.serving.formats import FORMATS, read
from gpubalance.exporter.config import SERVING_FORMATS

FIXTURES = Path(__file__).parent / "fixtures"
GPU0 = "GPU-5b1d4d34-8c7e-2f21-0d45-2f5b8c1e7a10"
GPU1 = "GPU-a3f09c6e-41d2-7b8e-95c0-6e2d1f4b3c87"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "engine_type=unified,model_name=Qwen/Qwen2.5-32B-Instruct,moe_ep_rank=0,pp_rank=0"
QWEN3 = "engine_type=unified,model_name=Qwen/Qwen3-32B,moe_ep_rank=0,pp_rank=0"


def fixture(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


TRITON = [
    ServingReading(
        key=f"model=bert_large,version=2,gpu_uuid={GPU1}",
        gpu_uuid=GPU1,
        queue_depth=0.0,
        batch_assembly_delay_seconds_sum=183.6,
        batch_assembly_delay_seconds_count=6120.0,
        batch_size_sum=6120.0,
        batch_size_count=1530.0,
        request_duration_seconds_sum=489.6,
        request_duration_seconds_count=6120.0,
        allocation_failures_total=12.0,
    ),
    # densenet_onnx's 5 pending requests, shared by its two GPUs
    ServingReading(
        key=f"model=densenet_onnx,version=1,gpu_uuid={GPU0}",
        gpu_uuid=GPU0,
        queue_depth=2.5,
        batch_assembly_delay_seconds_sum=38.568,
        batch_assembly_delay_seconds_count=48210.0,
        batch_size_sum=48210.0,
        batch_size_count=9642.0,
        request_duration_seconds_sum=120.525,
        request_duration_seconds_count=48210.0,
        allocation_failures_total=1.0,
    ),
    ServingReading(
        key=f"model=densenet_onnx,version=1,gpu_uuid={GPU1}",
        gpu_uuid=GPU1,
        queue_depth=2.5,
        batch_assembly_delay_seconds_sum=28.794,
        batch_assembly_delay_seconds_count=47990.0,
        batch_size_sum=47990.0,
        batch_size_count=10663.0,
        request_duration_seconds_sum=110.377,
        request_duration_seconds_count=47990.0,
        allocation_failures_total=0.0,
    ),
    # an ensemble: no GPU of its own, its queue whole
    ServingReading(
        key="model=ensemble_pipeline,version=1",
        queue_depth=2.0,
        batch_assembly_delay_seconds_sum=0.0612,
        batch_assembly_delay_seconds_count=6120.0,
        batch_size_sum=6120.0,
        batch_size_count=6120.0,
        request_duration_seconds_sum=526.32,
        request_duration_seconds_count=6120.0,
        allocation_failures_total=0.0,
    ),
]

# Triton 24.05: failures without a reason, taken whole
TRITON_BEFORE_FAILURE_REASONS = [
    ServingReading(
        key="model=preprocess,version=1",
        queue_depth=0.0,
        batch_assembly_delay_seconds_sum=0.6,
        batch_assembly_delay_seconds_count=60000.0,
        batch_size_sum=60000.0,
        batch_size_count=60000.0,
        request_duration_seconds_sum=12.0,
        request_duration_seconds_count=60000.0,
        allocation_failures_total=2.0,
    ),
    *(
        ServingReading(
            key=f"model=resnet50,version=1,gpu_uuid={gpu}",
            gpu_uuid=gpu,
            queue_depth=4.0,  # 8 pending, shared by the two GPUs
            batch_assembly_delay_seconds_sum=delay,
            batch_assembly_delay_seconds_count=requests,
            batch_size_sum=requests,
            batch_size_count=batches,
            request_duration_seconds_sum=duration,
            request_duration_seconds_count=requests,
            allocation_failures_total=failures,
        )
        for gpu, delay, requests, batches, duration, failures in (
            (GPU0, 15.1, 30200.0, 3775.0, 90.6, 6.0),
            (GPU1, 17.88, 29800.0, 4257.0, 92.38, 0.0),
        )
    ),
]


def _triton_cpu_model(model: str, requests: float, batches: float, delay: float, duration: float):
    return ServingReading(
        key=f"model={model},version=1",
        queue_depth=0.0,
        batch_assembly_delay_seconds_sum=delay,
        batch_assembly_delay_seconds_count=requests,
        batch_size_sum=requests,
        batch_size_count=batches,
        request_duration_seconds_sum=duration,
        request_duration_seconds_count=requests,
        allocation_failures_total=0.0,  # the ensemble's 5 failures are OTHER, not BACKEND
    )


# Triton with the TensorRT-LLM backend: the queue, the batch and the KV cache are TensorRT-LLM's
TRITON_TENSORRT_LLM = [
    _triton_cpu_model("ensemble", 5120.0, 5120.0, 5.12, 40960.0),
    _triton_cpu_model("postprocessing", 614400.0, 307200.0, 61.44, 307.2),
    _triton_cpu_model("preprocessing", 5125.0, 2050.0, 10.25, 25.625),
    ServingReading(
        key="model=tensorrt_llm,version=1",
        queue_depth=15.0,  # 1 pending in Triton, 14 waiting in TensorRT-LLM's executor
        running=48.0,
        batch_assembly_delay_seconds_sum=2.56,
        batch_assembly_delay_seconds_count=5120.0,
        batch_size_sum=5120.0,
        batch_size_count=4096.0,
        request_duration_seconds_sum=38912.0,
        request_duration_seconds_count=5120.0,
        allocation_failures_total=5.0,
        kv_cache_usage_ratio=0.625,  # 5120 of 8192 blocks
    ),
]

VLLM = [
    ServingReading(
        key=f"engine=0,model_name={LLAMA}",
        rank=0,
        queue_depth=4.0,
        running=12.0,
        batch_assembly_delay_seconds_sum=797.3125,
        batch_assembly_delay_seconds_count=1280.0,
        request_duration_seconds_sum=6491.5,
        request_duration_seconds_count=1280.0,
        allocation_failures_total=3.0,
        kv_cache_usage_ratio=0.4375,
        prompt_tokens_total=918432.0,
        generation_tokens_total=196608.0,
    ),
    ServingReading(
        key=f"engine=1,model_name={LLAMA}",
        rank=1,
        queue_depth=0.0,
        running=9.0,
        batch_assembly_delay_seconds_sum=728.625,
        batch_assembly_delay_seconds_count=1220.0,
        request_duration_seconds_sum=6057.5,
        request_duration_seconds_count=1220.0,
        allocation_failures_total=0.0,
        kv_cache_usage_ratio=0.3125,
        prompt_tokens_total=877120.0,
        generation_tokens_total=181248.0,
    ),
]

TGI = [
    ServingReading(
        key="router",
        queue_depth=7.0,
        running=32.0,
        batch_assembly_delay_seconds_sum=155.234375,
        batch_assembly_delay_seconds_count=1240.0,
        batch_size_sum=1275.0,
        batch_size_count=389.0,
        request_duration_seconds_sum=4943.984375,
        request_duration_seconds_count=1240.0,
        prompt_tokens_total=1012480.0,  # the token-count histograms' sums
        generation_tokens_total=158720.0,
    )
]

SGLANG = [
    ServingReading(
        key=f"{QWEN},tp_rank={rank}",
        rank=rank,
        queue_depth=6.0,
        running=24.0,
        batch_assembly_delay_seconds_sum=delay,
        batch_assembly_delay_seconds_count=2048.0,
        # the tokenizer's end-to-end latency, which has no rank: each rank's, whole
        request_duration_seconds_sum=14063.5625,
        request_duration_seconds_count=2048.0,
        allocation_failures_total=7.0,
        kv_cache_usage_ratio=0.578125,
        # the tokenizer's token counters, as its latency: each rank's, whole
        prompt_tokens_total=2053120.0,
        generation_tokens_total=419840.0,
    )
    for rank, delay in ((0, 2203.5625), (1, 2205.5625))
]

# the queue-time histogram, without moe_ep_rank, joined onto each rank's gauges: two readings
SGLANG_HISTOGRAM_LABELS = [
    ServingReading(
        key=f"{QWEN3},tp_rank={rank}",
        rank=rank,
        queue_depth=9.0,
        running=20.0,
        batch_assembly_delay_seconds_sum=delay,
        batch_assembly_delay_seconds_count=1536.0,
        request_duration_seconds_sum=9984.0,
        request_duration_seconds_count=1536.0,
        allocation_failures_total=4.0,
        kv_cache_usage_ratio=0.75,
    )
    for rank, delay in ((0, 812.5), (1, 813.0))
]

# fixture -> (format, readings)
FIXTURES_READ = {
    "triton": ("triton", TRITON),
    "triton_before_failure_reasons": ("triton", TRITON_BEFORE_FAILURE_REASONS),
    "triton_tensorrt_llm": ("triton", TRITON_TENSORRT_LLM),
    "vllm": ("vllm", VLLM),
    "tgi": ("tgi", TGI),
    "sglang": ("sglang", SGLANG),
    "sglang_histogram_labels": ("sglang", SGLANG_HISTOGRAM_LABELS),
}


@pytest.mark.parametrize("name", FIXTURES_READ)
def test_each_server_fixture_reads_exactly(name: str) -> None:
    format, expected = FIXTURES_READ[name]
    assert read(format, fixture(name)) == expected


def test_every_fixture_is_read_and_names_what_it_follows() -> None:
    assert {p.stem for p in FIXTURES.glob("*.txt")} == set(FIXTURES_READ)
    for name in FIXTURES_READ:
        header = fixture(name).split("\n# HELP", 1)[0]
        assert header.startswith("# ") and any(c.isdigit() for c in header), name


def test_the_registry_holds_every_configurable_format() -> None:
    modules = (triton, vllm, tgi, sglang)
    assert set(FORMATS) == set(SERVING_FORMATS) == {m.FORMAT for m in modules}
    for module in modules:
        assert FORMATS[module.FORMAT] is module.parse
        assert module.FOLLOWS


def test_an_unknown_format_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown serving format 'nim'; known: sglang, tgi, tri"):
        read("nim", fixture("vllm"))


def test_no_metrics_of_the_format_give_no_readings() -> None:
    assert read("triton", fixture("vllm")) == []
    assert read("tgi", "") == []


@pytest.mark.parametrize("name", FIXTURES_READ)
def test_counters_read_alike_with_and_without_total(name: str) -> None:
    """prometheus-cpp and metrics-exporter-prometheus write counters without ``_total``,
    prometheus_client with it; a server or proxy may do either."""
    format, text = FIXTURES_READ[name][0], fixture(name)
    counters = {
        line.split()[2]
        for line in text.splitlines()
        if line.startswith("# TYPE ") and line.endswith(" counter")
    }
    toggled = []
    for line in text.splitlines():
        words = line.split()
        if line.startswith("# ") and len(words) > 2 and words[2] in counters:
            words[2] = _toggle_total(words[2])
            line = " ".join(words)
        elif line and not line.startswith("#"):
            name_end = min(i for i in (line.find("{"), line.find(" ")) if i >= 0)
            if line[:name_end] in counters:
                line = _toggle_total(line[:name_end]) + line[name_end:]
        toggled.append(line)
    assert "\n".join(toggled) != text
    assert read(format, "\n".join(toggled)) == read(format, text)


def _toggle_total(name: str) -> str:
    return name.removesuffix("_total") if name.endswith("_total") else name + "_total"


VLLM_HEAD = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
"""


def test_vllm_reads_the_kv_cache_metric_under_its_old_name() -> None:
    old = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
"""
    new = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""
    base = ServingReading(key="engine=0,model_name=m", rank=0, queue_depth=2.0)
    assert read("vllm", VLLM_HEAD + old) == [replace(base, kv_cache_usage_ratio=0.25)]
    # both served (0.9 to 0.10): the new name wins, in either order
    assert read("vllm", VLLM_HEAD + old + new) == [replace(base, kv_cache_usage_ratio=0.5)]
    assert read("vllm", VLLM_HEAD + new + old) == [replace(base, kv_cache_usage_ratio=0.5)]


def test_a_server_exposing_only_some_metrics_leaves_the_rest_unknown() -> None:
    assert read("vllm", VLLM_HEAD) == [
        ServingReading(key="engine=0,model_name=m", rank=0, queue_depth=2.0)
    ]
    tgi_text = "# TYPE tgi_queue_size gauge\ntgi_queue_size 0\n"
    assert read("tgi", tgi_text) == [ServingReading(key="router", queue_depth=0.0)]
    # Triton's model-level pending count alone: the model has no GPU reading to share it
    triton_text = """\
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="m",version="1"} 3
"""  # noqa: E501
    assert read("triton", triton_text) == [ServingReading(key="model=m,version=1", queue_depth=3.0)]


def test_vllm_data_parallel_engines_of_several_models() -> None:
    text = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 1.0
vllm:num_requests_running{engine="1",model_name="a"} 2.0
vllm:num_requests_running{engine="3",model_name="b"} 3.0
vllm:num_requests_running{engine="x",model_name="b"} 4.0
"""
    assert read("vllm", text) == [
        ServingReading(key="engine=0,model_name=a", rank=0, running=1.0),
        ServingReading(key="engine=1,model_name=a", rank=1, running=2.0),
        ServingReading(key="engine=3,model_name=b", rank=3, running=3.0),
        ServingReading(key="engine=x,model_name=b", running=4.0),  # not an index: no rank
    ]


def test_triton_models_with_namespace_tags_and_a_pending_count_per_gpu() -> None:
    text = """\
# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{_team="search",gpu_uuid="GPU-0",model="m",namespace="a",version="1"} 10
nv_inference_exec_count{_team="search",gpu_uuid="GPU-1",model="m",namespace="a",version="1"} 20
nv_inference_exec_count{_team="search",gpu_uuid="GPU-2",model="m",namespace="a",version="1"} 30
nv_inference_exec_count{gpu_uuid="GPU-0",model="m",namespace="b",version="1"} 40
nv_inference_exec_count{gpu_uuid="",model="c",version="1"} 50
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{_team="search",model="m",namespace="a",version="1"} 6
nv_inference_pending_request_count{gpu_uuid="GPU-0",model="m",namespace="b",version="1"} 1
"""  # noqa: E501
    a = "_team=search,model=m,namespace=a,version=1,gpu_uuid=GPU-"
    assert read("triton", text) == [
        ServingReading(key=f"{a}0", gpu_uuid="GPU-0", queue_depth=2.0, batch_size_count=10.0),
        ServingReading(key=f"{a}1", gpu_uuid="GPU-1", queue_depth=2.0, batch_size_count=20.0),
        ServingReading(key=f"{a}2", gpu_uuid="GPU-2", queue_depth=2.0, batch_size_count=30.0),
        # an empty gpu_uuid is no label
        ServingReading(key="model=c,version=1", batch_size_count=50.0),
        # a pending count that names its GPU goes to that GPU whole
        ServingReading(
            key="model=m,namespace=b,version=1,gpu_uuid=GPU-0",
            gpu_uuid="GPU-0",
            queue_depth=1.0,
            batch_size_count=40.0,
        ),
    ]


def test_triton_failures_without_a_reason_count_whole_and_only_backend_ones_with_one() -> None:
    """Triton before failure reasons counted all failures in one series; since, only BACKEND
    failures are the backend's (an empty reason is no label, as in Prometheus)."""
    head = """\
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
"""
    old = 'nv_inference_request_failure{gpu_uuid="GPU-0",model="m",version="1"} 4.000000\n'
    new = "".join(
        f'nv_inference_request_failure{{gpu_uuid="GPU-0",model="m",reason="{reason}",version="1"}}'
        f" {count}\n"
        for reason, count in (("REJECTED", 9), ("CANCELED", 8), ("BACKEND", 3), ("OTHER", 7))
    )
    empty = 'nv_inference_request_failure{gpu_uuid="GPU-0",model="m",reason="",version="1"} 2\n'
    reading = ServingReading(key="model=m,version=1,gpu_uuid=GPU-0", gpu_uuid="GPU-0")
    assert read("triton", head + old) == [replace(reading, allocation_failures_total=4.0)]
    assert read("triton", head + new) == [replace(reading, allocation_failures_total=3.0)]
    assert read("triton", head + empty) == [replace(reading, allocation_failures_total=2.0)]


TRT_LLM_BEFORE_WAITING = """\
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 2
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 12
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 64
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 12
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 0
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 0
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 0
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
"""  # noqa: E501


def test_tensorrt_llm_backends_before_the_waiting_count_keep_tritons_pending_count() -> None:
    """tensorrtllm_backend 7f9aa46 reports no waiting requests, and before its first
    iteration no KV blocks (max 0): the queue is Triton's own, the KV usage unknown."""
    assert read("triton", TRT_LLM_BEFORE_WAITING) == [
        ServingReading(key="model=tensorrt_llm,version=1", queue_depth=2.0, running=12.0)
    ]


def test_tensorrt_llm_gauges_of_a_wrong_type_or_without_their_type_label_are_skipped() -> None:
    text = TRT_LLM_BEFORE_WAITING.replace(
        "# TYPE nv_trt_llm_request_metrics gauge", "# TYPE nv_trt_llm_request_metrics counter"
    ).replace('kv_cache_block_type="tokens_per",', "")
    assert read("triton", text) == [
        ServingReading(key="model=tensorrt_llm,version=1", queue_depth=2.0)
    ]


SGLANG_DP = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="m",pp_rank="0",tp_rank="0"} 1.0
sglang:num_queue_reqs{dp_rank="0",model_name="m",pp_rank="0",tp_rank="1"} 1.0
sglang:num_queue_reqs{dp_rank="1",model_name="m",pp_rank="0",tp_rank="0"} 5.0
sglang:num_queue_reqs{dp_rank="1",model_name="m",pp_rank="0",tp_rank="1"} 5.0
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_sum{customer="x",model_name="m"} 30.0
sglang:e2e_request_latency_seconds_count{customer="x",model_name="m"} 10.0
sglang:e2e_request_latency_seconds_sum{customer="y",model_name="m"} 12.0
sglang:e2e_request_latency_seconds_count{customer="y",model_name="m"} 2.0
sglang:e2e_request_latency_seconds_sum{customer="z",model_name="other"} 99.0
sglang:e2e_request_latency_seconds_count{customer="z",model_name="other"} 9.0
"""


def test_sglang_data_parallel_replicas_share_tp_ranks_so_rank_is_unknown() -> None:
    readings = read("sglang", SGLANG_DP)
    assert readings == [
        ServingReading(
            key=f"dp_rank={dp},model_name=m,pp_rank=0,tp_rank={tp}",
            queue_depth=depth,
            # the tokenizer's series of this model, custom labels summed over
            request_duration_seconds_sum=42.0,
            request_duration_seconds_count=12.0,
        )
        for dp, depth in ((0, 1.0), (1, 5.0))
        for tp in (0, 1)
    ]


def test_sglang_tokenizer_alone_gives_its_own_readings() -> None:
    tokenizer = SGLANG_DP[SGLANG_DP.index("# HELP sglang:e2e") :]
    assert [(r.key, r.request_duration_seconds_count) for r in read("sglang", tokenizer)] == [
        ("customer=x,model_name=m", 10.0),
        ("customer=y,model_name=m", 2.0),
        ("customer=z,model_name=other", 9.0),
    ]


SGLANG_GAUGES = """\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 3.0
sglang:num_queue_reqs{model_name="m",tp_rank="1"} 3.0
# TYPE sglang:queue_time_seconds histogram
"""


def test_sglang_scheduler_histograms_under_other_labels_join_their_gauges() -> None:
    """A histogram series with labels of its own (a priority) is summed into the gauges' row
    it fits; one with fewer labels adds to each row it fits; one that fits none is a reading."""
    text = SGLANG_GAUGES + "".join(
        f"sglang:queue_time_seconds_{part}{{{labels}}} {value}\n"
        for labels, sums, count in (
            ('model_name="m",priority="0",tp_rank="0"', 1.5, 3),
            ('model_name="m",priority="1",tp_rank="0"', 2.5, 5),
            ('model_name="m",tp_rank="1"', 4.0, 8),
            ('model_name="other",tp_rank="2"', 9.0, 9),
        )
        for part, value in (("sum", sums), ("count", count))
    )
    assert read("sglang", text) == [
        ServingReading(
            key=f"model_name=m,tp_rank={tp}",
            rank=tp,
            queue_depth=3.0,
            batch_assembly_delay_seconds_sum=4.0,
            batch_assembly_delay_seconds_count=8.0,
        )
        for tp in (0, 1)
    ] + [
        ServingReading(
            key="model_name=other,tp_rank=2",
            rank=2,
            batch_assembly_delay_seconds_sum=9.0,
            batch_assembly_delay_seconds_count=9.0,
        )
    ]
    # fewer labels: the TP group's one series, whole on each rank
    group = SGLANG_GAUGES + (
        'sglang:queue_time_seconds_sum{model_name="m"} 6.0\n'
        'sglang:queue_time_seconds_count{model_name="m"} 10\n'
    )
    assert [
        (r.key, r.batch_assembly_delay_seconds_sum, r.batch_assembly_delay_seconds_count)
        for r in read("sglang", group)
    ] == [("model_name=m,tp_rank=0", 6.0, 10.0), ("model_name=m,tp_rank=1", 6.0, 10.0)]


def test_a_pid_label_is_no_part_of_a_reading() -> None:
    """prometheus_client's multiprocess "all" mode writes a gauge per process with its pid,
    and keeps a dead process's: a restarted scheduler is the same queue, the later line wins."""
    text = (
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m",pid="4101",tp_rank="0"} 7.0\n'
        'sglang:num_queue_reqs{model_name="m",pid="5230",tp_rank="0"} 2.0\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 5.0\n'
    )
    assert read("sglang", text) == [
        ServingReading(key="model_name=m,tp_rank=0", rank=0, queue_depth=2.0, running=5.0)
    ]


def test_a_family_of_the_wrong_type_is_skipped() -> None:
    text = """\
# TYPE tgi_queue_size counter
tgi_queue_size 4
# TYPE tgi_batch_current_size histogram
tgi_batch_current_size_sum 3
tgi_batch_current_size_count 1
# TYPE tgi_request_duration summary
tgi_request_duration_sum 10.0
tgi_request_duration_count 4
# TYPE tgi_request_queue_duration histogram
tgi_request_queue_duration_bucket{le="+Inf"} 4
tgi_request_queue_duration_sum 0.5
tgi_request_queue_duration_count 4
tgi_batch_next_size 7
"""
    # counted as a counter, histogram, summary, untyped: only the histogram is as documented
    assert read("tgi", text) == [
        ServingReading(
            key="router",
            batch_assembly_delay_seconds_sum=0.5,
            batch_assembly_delay_seconds_count=4.0,
        )
    ]
