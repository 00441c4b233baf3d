"""The analyzer's panel in `gpubalance top` (tests/lab/test_demo.py shows it live in `make
demo`)."""

from __future__ import annotations

import re

from rich.console import Console

from gpubalance.analyzer.service import DiagnosisReport, RecommendationsReport, SourceStatus
from gpubalance.diagnosis import Ack, FleetVerdict, Recommendation, Verdict
from gpubalance.exporter.top import render_analysis

T = 1_800_000_000.0
UP = SourceStatus("exporter at http://127.0.0.1:9450", True, None, T, T)


def _verdict(gpu: int, state: str, cause: str, evidence: str, why: str | None = None) -> Verdict:
    return Verdict(
        host="box",
        gpu=gpu,
        uuid=f"GPU-{gpu}",
        t_start=T - 30,
        t_end=T,
        state=state,  # type: ignore[arg-type]
        cause=cause,  # type: ignore[arg-type]
        confidence=0.9,
        evidence=(evidence,),
        unknown_reason=why,
        pool="llama",
    )


def _text(diagnosis: DiagnosisReport, recommendations: RecommendationsReport) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(render_analysis(diagnosis, recommendations))
    return console.export_text()


def test_the_panel_shows_each_gpu_its_verdict_cause_and_what_to_do() -> None:
    diagnosis = DiagnosisReport(
        generated_seconds=T,
        window_seconds=30,
        classifier="baseline-queue",
        source=UP,
        gpus=(
            _verdict(0, "overloaded", "routing_skew", "queue 14 vs peer median 0"),
            _verdict(1, "starved", "routing_skew", "[bold]idle[/bold] 88 % of its capacity"),
        ),
        fleet=(FleetVerdict("box", "llama", T - 30, T, "imbalance", (0, 1), 0.68),),
    )
    recommendation = Recommendation(
        id="w",
        action="set_weights",
        host="box",
        target="llama",
        parameters={},
        reason="GPU 0 queues while GPU 1 idles",
        evidence=(),
        confidence=0.9,
        created_seconds=T,
        expires_seconds=T + 300,
        acks=(Ack("accepted", "ok", "controller", T),),
    )
    text = _text(diagnosis, RecommendationsReport(T, UP, "Recommender", (recommendation,)))
    lines = text.splitlines()
    assert "analyzer · baseline-queue · windows of 30 s" in text
    row0 = next(line for line in lines if re.match(r"│ 0 ", line))
    assert "overloaded" in row0 and "routing_skew" in row0 and "queue 14 vs peer median 0" in row0
    row1 = next(line for line in lines if re.match(r"│ 1 ", line))
    # the telemetry's words are printed as they are, never read as markup
    assert "starved" in row1 and "[bold]idle[/bold] 88 %" in row1
    assert "pool llama: imbalance, idle while queued 68%" in lines
    assert (
        "recommend set_weights llama (0.90): GPU 0 queues while GPU 1 idles "
        "[accepted by controller]" in lines
    )


def test_the_panel_says_when_the_source_is_down_or_nothing_recommends() -> None:
    down = SourceStatus(UP.description, False, "cannot reach the exporter: refused", T, T - 60)
    why = "source down: cannot reach the exporter: refused"
    diagnosis = DiagnosisReport(
        generated_seconds=T,
        window_seconds=30,
        classifier="baseline-queue",
        source=down,
        gpus=(_verdict(0, "unknown", "none", why, why),),
        fleet=(),
    )
    text = _text(diagnosis, RecommendationsReport(T, down, None, ()))
    row0 = next(line for line in text.splitlines() if re.match(r"│ 0 ", line))
    assert "unknown" in row0 and why in row0
    assert "analyzer: source down: cannot reach the exporter: refused" in text
    assert "recommendations: none (the analyzer runs without a recommender)" in text
