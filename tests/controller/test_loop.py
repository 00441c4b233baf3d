"""The reconcile loop against a real HAProxy with real backends, and an analyzer at the edge.

Each test drives passes itself (`run_once`), so "after N passes" is what HAProxy reports, not a
sleep; waits on HAProxy (an agent poll, sessions finishing) have bounded deadlines.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controller_harness import (
    FAST,
    Analyzer,
    Backends,
    haproxy_over,
    make_controller,
    needs_haproxy,
    recommendation,
    weights,
)

from gpubalance.controller.audit import AuditLog
from gpubalance.controller.haproxy import RuntimeApi, RuntimeApiError
from gpubalance.controller.model import Settings

pytestmark = needs_haproxy


def _answers(api: RuntimeApi) -> bool:
    try:
        api.command("show info")
    except RuntimeApiError:
        return False
    return True


def audit(path: Path) -> list[dict[str, Any]]:
    return AuditLog(path).entries()


def sample(controller: Any, name: str, **labels: str) -> float | None:
    return controller.metrics.registry.get_sample_value(name, labels)


def test_acting_converges_then_does_nothing_and_acks_applied(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                analyzer.recommendations = [
                    recommendation("r1", "set_weights", "be", {"weights": {"s1": 40}})
                ]
                settings = Settings(act=True, dwell_cycles=2, max_weight_step=32)
                controller = make_controller(
                    config.socket_path, analyzer.url, http, tmp_path / "audit.jsonl", settings
                )
                first = await controller.run_once()  # dwell: seen once, no action
                assert first.ok and first.applied == []
                assert weights(haproxy.api)["s1"] == (100, "ready")
                for _ in range(5):
                    await controller.run_once()
                    if weights(haproxy.api)["s1"][0] == 40:
                        break
                assert weights(haproxy.api) == {"s1": (40, "ready"), "s2": (100, "ready")}
                # 100 -> 68 -> 40 by the bounded step, then nothing more
                applied = [e for e in audit(tmp_path / "audit.jsonl") if e["decision"] == "applied"]
                assert [(e["before"], e["after"]) for e in applied] == [(100, 68), (68, 40)]
                assert applied[0]["recommendation"] == "r1" and applied[0]["target"] == "be/s1"
                last = await controller.run_once()
                assert last.applied == [] and last.planned == [] and last.met == ["r1"]
                # HAProxy's weights as the last pass read them, on /metrics
                labels = {"backend": "be", "server": "s1"}
                assert sample(controller, "gpubalance_controller_server_weight", **labels) == 40
                assert sample(controller, "gpubalance_controller_server_serving", **labels) == 1
                assert analyzer.acks_of("r1") == [("applied", "HAProxy shows what it asks for")]
                assert (
                    sample(
                        controller,
                        "gpubalance_controller_actions_total",
                        action="set_weight",
                        outcome="applied",
                    )
                    == 2
                )
                # acked: the analyzer still lists it, the controller leaves it alone
                await controller.run_once()
                assert len(analyzer.acks) == 1

    asyncio.run(scenario())


def test_dry_run_changes_nothing_in_haproxy_but_records_the_decision(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                analyzer.recommendations = [
                    recommendation("r1", "set_weights", "be", {"weights": {"s1": 40}}),
                    recommendation("r2", "drain", "be/s2", cost_rank=1),
                ]
                dry = Settings(dwell_cycles=1, max_weight_step=256)
                assert not dry.act  # dry-run is the default
                controller = make_controller(
                    config.socket_path, analyzer.url, http, tmp_path / "audit.jsonl", dry
                )
                for _ in range(3):
                    report = await controller.run_once()
                    assert report.ok and report.applied == []
                assert weights(haproxy.api) == {"s1": (100, "ready"), "s2": (100, "ready")}
                entries = audit(tmp_path / "audit.jsonl")
                dry_runs = [e for e in entries if e["decision"] == "dry_run"]
                assert [(e["target"], e["before"], e["after"]) for e in dry_runs] == [
                    ("be/s1", 100, 40)
                ]
                assert any(e["reason"].startswith("ladder") for e in entries)
                assert analyzer.acks == []
                assert sample(controller, "gpubalance_controller_dry_run") == 1
                assert (
                    sample(
                        controller,
                        "gpubalance_controller_actions_total",
                        action="set_weight",
                        outcome="dry_run",
                    )
                    == 1
                )

    asyncio.run(scenario())


def test_the_last_ready_server_is_never_drained(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                haproxy.api.set_state("be", "s2", "drain")
                analyzer.recommendations = [recommendation("r1", "drain", "be/s1")]
                controller = make_controller(
                    config.socket_path, analyzer.url, http, tmp_path / "audit.jsonl"
                )
                report = await controller.run_once()
                assert report.applied == [] and report.refused == ["r1: last_ready_server"]
                assert weights(haproxy.api) == {"s1": (100, "ready"), "s2": (100, "drain")}
                [(status, reason)] = analyzer.acks_of("r1")
                assert status == "rejected" and reason.startswith("last_ready_server")
                [entry] = [
                    e for e in audit(tmp_path / "audit.jsonl") if e["decision"] == "rejected"
                ]
                assert entry["recommendation"] == "r1"
                async with http.get(f"http://127.0.0.1:{haproxy.config.frontends[0].port}/") as r:
                    assert await r.text() == "s1"

    asyncio.run(scenario())


def test_remove_worker_drains_until_sessions_reach_zero_then_enters_maint(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                front = f"http://127.0.0.1:{haproxy.config.frontends[0].port}"
                # round robin: the first request goes to s1 and stays in flight
                held = asyncio.create_task(http.get(f"{front}/hold"))
                async with asyncio.timeout(10):
                    while sum(backends.held.values()) < 1:
                        await asyncio.sleep(0.01)
                analyzer.recommendations = [recommendation("r1", "remove_worker", "be/s1")]
                controller = make_controller(
                    config.socket_path, analyzer.url, http, tmp_path / "audit.jsonl"
                )
                await controller.run_once()
                assert weights(haproxy.api)["s1"] == (100, "drain")
                waiting = await controller.run_once()
                assert waiting.refused == ["r1: draining"]
                assert weights(haproxy.api)["s1"] == (100, "drain")
                backends.release.set()
                response = await held
                assert await response.text() == "s1"
                response.release()
                async with asyncio.timeout(10):
                    while {r.svname: r for r in haproxy.api.show_stat("be")}["s1"].scur:
                        await asyncio.sleep(0.01)
                await controller.run_once()
                assert weights(haproxy.api)["s1"] == (100, "maint")
                await controller.run_once()
                assert analyzer.acks_of("r1") == [("applied", "HAProxy shows what it asks for")]

    asyncio.run(scenario())


def test_the_breaker_trips_stays_open_across_a_restart_and_a_person_rearms_it(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        names = ["s0", "s1", "s2", "s3"]
        async with Backends(names) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                # drains take servers out of service (a re-weighting keeps them serving and
                # counts only when it moves much of the pool's traffic)
                analyzer.recommendations = [
                    recommendation(f"r{i}", "drain", f"be/{n}") for i, n in enumerate(names[:3])
                ]
                log = tmp_path / "audit.jsonl"
                controller = make_controller(config.socket_path, analyzer.url, http, log)
                report = await controller.run_once()
                # two of four changed is 50 %, the third would exceed it
                assert len(report.applied) == 2 and controller.breaker_open
                [trip] = [e for e in audit(log) if e["decision"] == "breaker_tripped"]
                assert trip["reason"] == (
                    "3 of 4 servers changed within 300 s would exceed 50%; the breaker trips"
                )
                assert sample(controller, "gpubalance_controller_breaker_tripped") == 1
                admin = sorted(a for _, a in weights(haproxy.api).values())
                assert admin == ["drain", "drain", "ready", "ready"]
                again = await controller.run_once()
                assert again.applied == []

                restarted = make_controller(config.socket_path, analyzer.url, http, log)
                assert restarted.breaker_open
                assert (await restarted.run_once()).applied == []
                restarted.rearm()
                assert sample(restarted, "gpubalance_controller_breaker_tripped") == 0
                assert [e["decision"] for e in audit(log)].count("rearmed") == 1
                # re-armed, the changes before count no more: the third drain goes ahead
                assert len((await restarted.run_once()).applied) == 1
                assert not restarted.breaker_open
                admin = sorted(a for _, a in weights(haproxy.api).values())
                assert admin == ["drain", "drain", "drain", "ready"]

    asyncio.run(scenario())


def test_a_pause_holds_across_a_restart_until_a_person_resumes(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(["s0", "s1"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                analyzer.recommendations = [recommendation("r1", "drain", "be/s0")]
                log = tmp_path / "audit.jsonl"
                controller = make_controller(config.socket_path, analyzer.url, http, log)
                controller.pause()
                assert (await controller.run_once()).applied == []
                # a crash or a restart by systemd: the person's pause still holds
                restarted = make_controller(config.socket_path, analyzer.url, http, log)
                assert restarted.paused and restarted.status()["paused"]
                assert sample(restarted, "gpubalance_controller_paused") == 1
                assert (await restarted.run_once()).applied == []
                assert {a for _, a in weights(haproxy.api).values()} == {"ready"}
                restarted.resume()
                assert len((await restarted.run_once()).applied) == 1
                # resumed, a later restart acts too
                again = make_controller(config.socket_path, analyzer.url, http, log)
                assert not again.paused and sample(again, "gpubalance_controller_paused") == 0

    asyncio.run(scenario())


def test_a_restarted_controller_rederives_state_and_repeats_no_action(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                log = tmp_path / "audit.jsonl"
                analyzer.recommendations = [
                    recommendation("r1", "set_weights", "be", {"weights": {"s1": 40}})
                ]
                first = make_controller(config.socket_path, analyzer.url, http, log)
                assert len((await first.run_once()).applied) == 1
                # killed before its next pass acked r1; meanwhile r2 asks s1 to drain
                analyzer.recommendations.append(recommendation("r2", "drain", "be/s1"))
                second = make_controller(config.socket_path, analyzer.url, http, log)
                assert [a.recommendation_id for a in second.history] == ["r1"]
                report = await second.run_once()
                # r1 is met in HAProxy: acked, not applied again; r2 waits out r1's freeze,
                # which the audit log remembered
                assert report.applied == [] and report.met == ["r1"]
                assert report.refused == ["r2: frozen"]
                assert analyzer.acks_of("r1") == [("applied", "HAProxy shows what it asks for")]
                assert weights(haproxy.api)["s1"] == (40, "ready")
                applied = [e for e in audit(log) if e["decision"] == "applied"]
                assert len(applied) == 1

    asyncio.run(scenario())


def test_a_recommendation_that_asks_anew_after_its_ack_is_carried_out_again(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                log = tmp_path / "audit.jsonl"
                analyzer.recommendations = [
                    recommendation("r1", "set_weights", "be", {"weights": {"s1": 40}})
                ]
                controller = make_controller(config.socket_path, analyzer.url, http, log, FAST)
                assert len((await controller.run_once()).applied) == 1
                assert (await controller.run_once()).met == ["r1"]
                done = ("applied", "HAProxy shows what it asks for")
                assert analyzer.acks_of("r1") == [done]
                # listed with its ack, whatever it asks: the analyzer's word that it is done
                analyzer.recommendations = [
                    replace(analyzer.recommendations[0], parameters={"weights": {"s1": 60}})
                ]
                assert (await controller.run_once()).planned == []
                assert weights(haproxy.api)["s1"] == (40, "ready")
                # listed without it: the analyzer dropped the ack of an ask it changed
                analyzer.recommendations = [
                    recommendation("r1", "set_weights", "be", {"weights": {"s1": 80}})
                ]
                assert len((await controller.run_once()).applied) == 1
                assert weights(haproxy.api)["s1"] == (80, "ready")
                assert (await controller.run_once()).met == ["r1"]
                assert analyzer.acks_of("r1") == [done, done]
                met = [e for e in audit(log) if e["decision"] == "met"]
                assert [e["recommendation"] for e in met] == ["r1", "r1"]
                await controller.run_once()
                assert len(analyzer.acks) == 2

    asyncio.run(scenario())


def test_unreachable_haproxy_or_analyzer_means_no_action_a_metric_and_back_off(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with aiohttp.ClientSession() as http:
                log = tmp_path / "audit.jsonl"
                gone = make_controller(tmp_path / "nowhere.sock", analyzer.url, http, log)
                for delay in (0.1, 0.2, 0.4):
                    report = await gone.run_once()
                    assert not report.ok and "nowhere.sock" in (report.error or "")
                    assert gone.next_delay() == pytest.approx(delay)
                assert sample(gone, "gpubalance_controller_source_up", source="haproxy") == 0
                assert (
                    sample(gone, "gpubalance_controller_source_errors_total", source="haproxy") == 3
                )
                async with haproxy_over(config) as haproxy:
                    analyzer.recommendations = [recommendation("r1", "drain", "be/s1")]
                    analyzer.broken = True
                    controller = make_controller(config.socket_path, analyzer.url, http, log)
                    report = await controller.run_once()
                    assert not report.ok and "500" in (report.error or "")
                    assert (
                        sample(controller, "gpubalance_controller_source_up", source="analyzer")
                        == 0
                    )
                    analyzer.broken = False
                    assert (await controller.run_once()).ok and controller.next_delay() == 0.05
                    assert weights(haproxy.api)["s1"] == (100, "drain")
                assert audit(log)[-1]["decision"] == "applied"

    asyncio.run(scenario())


def test_stale_expired_and_unknown_recommendations_are_rejected_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                analyzer.recommendations = [
                    recommendation("old", "drain", "be/s1", age_seconds=900, ttl_seconds=900),
                    recommendation("gone", "drain", "be/s1", age_seconds=10, ttl_seconds=-1),
                    recommendation("who", "drain", "be/s9"),
                    recommendation("move", "move_worker", "gpu:1"),
                ]
                log = tmp_path / "audit.jsonl"
                controller = make_controller(config.socket_path, analyzer.url, http, log)
                await controller.run_once()
                await controller.run_once()
                assert {a["id"]: a["reason"].split(":")[0] for a in analyzer.acks} == {
                    "old": "stale",
                    "gone": "expired",
                    "who": "unknown_target",
                    "move": "unsupported_action",
                }
                assert len(analyzer.acks) == 4 and all(
                    a["status"] == "rejected" for a in analyzer.acks
                )
                assert all(a["by"] == "gpubalance-controller" for a in analyzer.acks)
                assert [e["decision"] for e in audit(log)] == ["rejected"] * 4
                assert weights(haproxy.api) == {"s1": (100, "ready"), "s2": (100, "ready")}

    asyncio.run(scenario())


def test_agent_check_responder_sets_weights_and_states_without_the_socket(
    tmp_path: Path,
) -> None:
    from gpubalance.controller.agent import AgentCheckResponder
    from gpubalance.lab.live.haproxy import find_haproxy, render

    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            agent = AgentCheckResponder()
            _, agent_port = await agent.start("127.0.0.1", 0)
            config = backends.config(tmp_path / "run")
            run_dir = tmp_path / "run"
            run_dir.mkdir()
            lines = []
            for line in render(config).splitlines():
                if line.strip().startswith("server "):
                    name = line.split()[1]
                    line += (
                        f" agent-check agent-addr 127.0.0.1 agent-port {agent_port}"
                        f' agent-send "be/{name}\\n" agent-inter 100ms'
                    )
                lines.append(line)
            cfg = run_dir / "agent.cfg"
            cfg.write_text("\n".join(lines) + "\n")
            process = await asyncio.create_subprocess_exec(
                find_haproxy(),
                "-db",
                "-f",
                str(cfg),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            api = RuntimeApi(config.socket_path)
            try:
                async with asyncio.timeout(15):
                    while not _answers(api):
                        await asyncio.sleep(0.02)
                async with aiohttp.ClientSession() as http:
                    analyzer.recommendations = [
                        recommendation("r1", "set_weights", "be", {"weights": {"s1": 40}}),
                        recommendation("r2", "drain", "be/s2"),
                    ]
                    both = Settings(act=True, dwell_cycles=1, max_weight_step=256, breaker_share=1)
                    controller = make_controller(
                        config.socket_path, analyzer.url, http, tmp_path / "a.jsonl", both, agent
                    )
                    report = await controller.run_once()
                    assert len(report.applied) == 2
                    assert agent.reply_for("be/s1") == "40%" and agent.reply_for("be/s2") == "drain"
                    async with asyncio.timeout(15):
                        while weights(api) != {"s1": (40, "ready"), "s2": (100, "drain")}:
                            await asyncio.sleep(0.05)
                    last = await controller.run_once()
                    assert last.planned == [] and sorted(last.met) == ["r1", "r2"]
            finally:
                process.terminate()
                await process.wait()
                await agent.close()

    asyncio.run(scenario())


def test_an_unreadable_haproxy_answer_costs_the_pass_not_the_process(tmp_path: Path) -> None:
    """A socket that answers garbage, as a wrong socket path or another program would."""

    async def scenario() -> None:
        async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readline()
            writer.write(b"1\n# be_name srv_name\nonly two\n")
            writer.close()

        path = tmp_path / "odd.sock"
        server = await asyncio.start_unix_server(garbage, path)
        async with server, Analyzer() as analyzer, aiohttp.ClientSession() as http:
            controller = make_controller(path, analyzer.url, http, tmp_path / "audit.jsonl")
            report = await controller.run_once()
            assert not report.ok and "is not `show stat`" in (report.error or "")
            assert sample(controller, "gpubalance_controller_source_up", source="haproxy") == 0
            stop = asyncio.Event()
            task = asyncio.create_task(controller.run(stop))
            async with asyncio.timeout(20):
                while controller.passes < 3:
                    await asyncio.sleep(0.01)
            stop.set()
            await task
            assert controller.failures >= 3

    asyncio.run(scenario())


def test_a_worker_it_removed_comes_back_when_given_a_share_and_a_persons_maint_stays(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        names = ["s0", "s1", "s2", "s3"]
        settings = replace(FAST, freeze_seconds=0.0)  # its passes come milliseconds apart
        async with Backends(names) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                log = tmp_path / "audit.jsonl"
                analyzer.recommendations = [
                    recommendation("r1", "remove_worker", "be/s3"),
                    recommendation("r2", "remove_worker", "be/s2"),
                ]
                first = make_controller(config.socket_path, analyzer.url, http, log, settings)
                for _ in range(3):  # drain, then maint (no session in flight)
                    await first.run_once()
                assert weights(haproxy.api)["s2"] == weights(haproxy.api)["s3"] == (100, "maint")
                # a person takes s1 out, and readies s2 (the controller sees it on its next
                # pass) to take it out again later: both are theirs now
                haproxy.api.command("set server be/s1 state maint")
                haproxy.api.command("set server be/s2 state ready")
                await first.run_once()
                haproxy.api.command("set server be/s2 state maint")
                # the demand comes back: the analyzer gives every worker a share. A restarted
                # controller reads from its log which server it took out itself
                analyzer.recommendations = [
                    recommendation(
                        "r3", "set_weights", "be", {"weights": dict.fromkeys(names, 100)}
                    )
                ]
                second = make_controller(config.socket_path, analyzer.url, http, log, settings)
                assert second.audit.taken_out() == {"be/s3"}
                report = await second.run_once()
                assert report.applied == ["set server be/s3 state ready (was maint)"], (
                    report.refused
                )
                assert {n: a for n, (_, a) in weights(haproxy.api).items()} == {
                    "s0": "ready",
                    "s1": "maint",
                    "s2": "maint",
                    "s3": "ready",
                }
                await second.run_once()
                assert analyzer.acks_of("r3") == [("applied", "HAProxy shows what it asks for")]
                returned = [e for e in audit(log) if e["decision"] == "returned"]
                assert [e["target"] for e in returned] == ["be/s2"]

    asyncio.run(scenario())
