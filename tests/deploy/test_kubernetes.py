"""The Kubernetes manifests in deploy/kubernetes and the PrometheusRule generator: valid against
the Kubernetes schemas and the prometheus-operator CRDs, consistent with each other, and each
container's arguments a command line gpubalance's own parser takes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy.kube import documents, load, parse_args, validate

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
RULES = ROOT / "deploy" / "prometheus" / "rules"

# a small rules file of the shape deploy/prometheus/rules holds: a recording rule, an alert
# reading it with a multi-line description and a template the operator must pass through
RULES_FIXTURE = """\
groups:
  - name: gpubalance.test
    interval: 30s
    rules:
      - record: host_pool:gpubalance_fleet_idle_while_queued_ratio:avg10m
        expr: avg by (host, pool) (avg_over_time(gpubalance_fleet_idle_while_queued_ratio[10m]))
      - alert: GPUBalancePoolImbalance
        expr: host_pool:gpubalance_fleet_idle_while_queued_ratio:avg10m > 0.2
        for: 10m
        labels: {severity: warning}
        annotations:
          summary: GPUs of a pool idle while others have work queued.
          description: >-
            Pool {{ $labels.pool }} on {{ $labels.host }}: {{ $value | humanizePercentage }}
            of its GPU-time went unused.
          runbook_url: docs/runbooks/GPUBalancePoolImbalance.md
"""


def _manifests() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in load(path):
            found[f"{document['kind']}/{document['metadata']['name']}"] = document
    return found


def _generate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubalance", "deploy", "prometheusrule", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("name", sorted(_manifests()))
def test_manifest_validates(name: str) -> None:
    validate(_manifests()[name])


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


def test_validation_refuses_a_misspelt_field() -> None:
    """What the validation above is worth: a field the API does not have fails, in both kinds."""
    manifests = _manifests()
    daemonset = manifests["DaemonSet/gpubalance-exporter"]
    pod = daemonset["spec"]["template"]["spec"]
    broken = {**daemonset, "spec": {**daemonset["spec"], "template": {"spec": {**pod}}}}
    broken["spec"]["template"]["spec"]["hostPid"] = broken["spec"]["template"]["spec"].pop(
        "hostPID"
    )
    with pytest.raises(AssertionError, match="hostPid"):
        validate(broken)
    monitor = manifests["ServiceMonitor/gpubalance-exporter"]
    endpoint = {**monitor["spec"]["endpoints"][0], "intervall": "10s"}
    with pytest.raises(AssertionError, match="intervall"):
        validate({**monitor, "spec": {**monitor["spec"], "endpoints": [endpoint]}})


def test_exporter_daemonset_runs_where_attribution_works() -> None:
    pod = _manifests()["DaemonSet/gpubalance-exporter"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {t["key"] for t in pod["tolerations"]} == {"nvidia.com/gpu"}
    (container,) = pod["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    args = parse_args(container["args"])
    # --procfs is the host's /proc, mounted read-only
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    proc = mounts[args.procfs]
    assert proc["readOnly"] is True
    assert volumes[proc["name"]]["hostPath"]["path"] == "/proc"
    # the --config file is the ConfigMap's, and the exporter loads it
    config_mount = next(
        m for m in container["volumeMounts"] if args.config.startswith(m["mountPath"])
    )
    config_map = _manifests()[f"ConfigMap/{volumes[config_mount['name']]['configMap']['name']}"]
    assert Path(args.config).name in config_map["data"]


def test_exporter_config_map_loads(tmp_path: Path) -> None:
    from gpubalance.exporter.cli import load_config

    pod = _manifests()["DaemonSet/gpubalance-exporter"]["spec"]["template"]["spec"]
    args = parse_args(pod["containers"][0]["args"])
    path = tmp_path / "exporter.yaml"
    path.write_text(_manifests()["ConfigMap/gpubalance-exporter"]["data"]["exporter.yaml"])
    args.config = str(path)
    args.procfs = str(tmp_path)  # checked only at start, on the node
    config = load_config(args)
    assert config.listen == ":9450"


def test_analyzer_deployment_arguments_parse() -> None:
    pod = _manifests()["Deployment/gpubalance-analyzer"]["spec"]["template"]["spec"]
    args = parse_args(pod["containers"][0]["args"])
    assert args.command == "analyzer"
    # beyond loopback the analyzer needs its token: the mounted Secret's file
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    token = next(v for v in pod["volumes"] if "secret" in v)
    assert args.token_file.startswith(mounts[token["name"]] + "/")


@pytest.mark.parametrize("component", ["exporter", "analyzer"])
def test_services_and_monitors_reach_the_pods(component: str) -> None:
    manifests = _manifests()
    workload = next(
        doc
        for doc in manifests.values()
        if doc["kind"] in {"DaemonSet", "Deployment"} and component in doc["metadata"]["name"]
    )
    template = workload["spec"]["template"]
    service = manifests[f"Service/gpubalance-{component}"]
    monitor = manifests[f"ServiceMonitor/gpubalance-{component}"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert workload["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    container_ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    account = template["spec"]["serviceAccountName"]
    assert f"ServiceAccount/{account}" in manifests


def test_prometheusrule_holds_the_rules_files_groups(tmp_path: Path) -> None:
    rules = tmp_path / "alerts.yml"
    rules.write_text(RULES_FIXTURE)
    result = _generate(rules, "--label", "release=kube-prometheus-stack")
    assert result.returncode == 0, result.stderr
    (rule,) = documents(result.stdout)
    validate(rule)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FIXTURE)["groups"]


def test_prometheusrule_of_several_files_keeps_their_order(tmp_path: Path) -> None:
    first, second = tmp_path / "recording.yml", tmp_path / "alerts.yml"
    first.write_text("groups:\n  - name: a\n    rules:\n      - {record: 'x:y', expr: 'sum(y)'}\n")
    second.write_text(RULES_FIXTURE)
    out = tmp_path / "prometheusrule.yaml"
    assert _generate(first, second, "--out", out).returncode == 0
    (rule,) = load(out)
    assert [g["name"] for g in rule["spec"]["groups"]] == ["a", "gpubalance.test"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules: []\n", "not a Prometheus rules file"),
        ("groups:\n  - name: g\n    rules:\n      - {alert: A}\n", ":4: group g, rule 0: expected"),
        ("groups:\n  - name: g\n    rule: []\n", ":2: group g: unknown keys ['rule']"),
        (
            "groups:\n  - name: g\n    rules:\n      - {alert: A, record: 'a:b', expr: '1'}\n",
            ":4: group g, rule 0: expected expr and one of record or alert",
        ),
    ],
)
def test_prometheusrule_refuses_what_the_crd_would(tmp_path: Path, text: str, message: str) -> None:
    rules = tmp_path / "bad.yml"
    rules.write_text(text)
    result = _generate(rules)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


def test_prometheusrule_refuses_a_group_name_twice(tmp_path: Path) -> None:
    one, two = tmp_path / "one.yml", tmp_path / "two.yml"
    one.write_text(RULES_FIXTURE)
    two.write_text(RULES_FIXTURE)
    result = _generate(one, two)
    assert result.returncode == 2
    assert f"group gpubalance.test is also in {one}" in result.stderr


def test_prometheusrule_of_the_shipped_rules_validates() -> None:
    files = sorted(RULES.glob("*.yml"))
    if not files:
        pytest.skip("deploy/prometheus/rules holds no rules file yet")
    result = _generate(*files)
    assert result.returncode == 0, result.stderr
    (rule,) = documents(result.stdout)
    validate(rule)
    names = [g["name"] for f in files for g in yaml.safe_load(f.read_text())["groups"]]
    assert [g["name"] for g in rule["spec"]["groups"]] == names
    # the chart, given the same files as `--set-file prometheusRule.files.NAME=FILE`
    charted = _render({"prometheusRule": {"files": {f.stem: f.read_text() for f in files}}})
    validate(charted["PrometheusRule/gpubalance"])
    assert sorted(
        g["name"] for g in charted["PrometheusRule/gpubalance"]["spec"]["groups"]
    ) == sorted(names)


# -- the Helm chart, rendered by Helm's own engine (helm-python-sdk binds Helm's Go SDK) ------

CHART = ROOT / "deploy" / "helm" / "gpubalance"


def _render(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        files = chart.render(values or {}, name="gpubalance", namespace="gpubalance")
    return {
        f"{doc['kind']}/{doc['metadata']['name']}": doc
        for path, text in sorted(files.items())
        if path.endswith(".yaml")
        for doc in documents(text)
    }


def test_chart_lints() -> None:
    import helm_python

    report = helm_python.lint(CHART)
    assert report["errors"] == [], report


def test_chart_renders_valid_objects() -> None:
    rendered = _render()
    for document in rendered.values():
        validate(document)
    # without rules files given, no empty PrometheusRule
    assert not any(name.startswith("PrometheusRule/") for name in rendered)
    assert set(rendered) >= {
        "DaemonSet/gpubalance-exporter",
        "Deployment/gpubalance-analyzer",
        "ServiceMonitor/gpubalance-exporter",
        "Role/gpubalance-prometheus-discovery",
    }


def test_chart_pods_are_the_manifests_pods() -> None:
    """The chart and deploy/kubernetes run the same pods: one cannot be fixed without the other."""
    rendered, static = _render(), _manifests()
    for name in ("DaemonSet/gpubalance-exporter", "Deployment/gpubalance-analyzer"):
        assert (
            rendered[name]["spec"]["template"]["spec"] == static[name]["spec"]["template"]["spec"]
        )
    config = "ConfigMap/gpubalance-exporter"
    assert yaml.safe_load(rendered[config]["data"]["exporter.yaml"]) == yaml.safe_load(
        static[config]["data"]["exporter.yaml"]
    )


def test_chart_prometheusrule_is_the_generators(tmp_path: Path) -> None:
    recording = "groups:\n  - name: a\n    rules:\n      - {record: 'x:y', expr: 'sum(y)'}\n"
    rendered = _render(
        {
            "prometheusRule": {
                "files": {"alerts": RULES_FIXTURE, "recording": recording},
                "labels": {"release": "kube-prometheus-stack"},
            }
        }
    )
    rule = rendered["PrometheusRule/gpubalance"]
    validate(rule)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (tmp_path / "alerts.yml").write_text(RULES_FIXTURE)
    (tmp_path / "recording.yml").write_text(recording)
    generated = _generate(tmp_path / "alerts.yml", tmp_path / "recording.yml")
    (expected,) = documents(generated.stdout)
    assert rule["spec"] == expected["spec"]


def test_chart_refuses_a_file_that_is_not_rules() -> None:
    import helm_python

    with pytest.raises(
        helm_python.HelmError, match=re.escape("prometheusRule.files.alerts is not a")
    ):
        _render({"prometheusRule": {"files": {"alerts": "rules: []\n"}}})


def test_chart_without_analyzer_or_monitors() -> None:
    rendered = _render(
        {"analyzer": {"enabled": False}, "prometheusDiscovery": {"serviceAccount": ""}}
    )
    for document in rendered.values():
        validate(document)
    assert [n for n in rendered if "analyzer" in n] == []
    assert "ServiceMonitor/gpubalance-exporter" in rendered
    assert not any(n.startswith("Role") for n in rendered)
