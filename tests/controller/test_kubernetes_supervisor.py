"""The worker supervisor's Kubernetes backend, dry-run: the manifests a move writes, in order,
are Pods the Kubernetes API's own schemas accept, and what it observes is what it wrote."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from controller_harness import workers_config
from deploy.kube import validate
from pydantic import ValidationError

from gpubalance.controller.kubernetes_supervisor import KubernetesSupervisor
from gpubalance.controller.supervisor import SupervisorError, WorkerProcess, WorkersConfig

SERVING = {0: "be_a", 1: "be_a", 2: "be_b"}


def kubernetes_workers(tmp_path: Path, **settings: Any) -> WorkersConfig:
    process = workers_config(tmp_path / "state")
    fields = process.model_dump(exclude={"backend", "systemd", "kubernetes"})
    kubernetes = {"node": "gpu-node-1", "image": "registry.example/serve:1.4", "serving": SERVING}
    return WorkersConfig(**fields, backend="kubernetes", kubernetes={**kubernetes, **settings})


def observe(supervisor: KubernetesSupervisor) -> dict[int, WorkerProcess]:
    return asyncio.run(supervisor.observe(None))  # type: ignore[arg-type]  # nothing is asked


def manifests(out_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, yaml.safe_load(p.read_text())) for p in sorted(out_dir.glob("0*.yaml"))]


def test_a_move_is_a_delete_then_a_create_in_order_and_observe_follows(tmp_path: Path) -> None:
    config = kubernetes_workers(tmp_path, ready_after_seconds=30)
    supervisor = KubernetesSupervisor(config)
    out = tmp_path / "state" / "kubernetes"
    # the Pods serving before any move: written first, running
    before = observe(supervisor)
    assert {gpu: (w.pool, w.ready) for gpu, w in before.items()} == {
        0: ("be_a", True),
        1: ("be_a", True),
        2: ("be_b", True),
    }
    assert len({w.port for w in before.values()}) == 3
    # the move of GPU 1 to be_b, as the mover asks for it: SIGTERM, then a start
    supervisor.signal(before[1], signal.SIGTERM)
    assert 1 not in observe(supervisor)
    started = supervisor.start(1, "be_b")
    with pytest.raises(SupervisorError, match="serves be_b; delete it first"):
        supervisor.start(1, "be_a")
    after = observe(supervisor)
    assert (after[1].pool, after[1].port, after[1].ready) == ("be_b", started.port, False)
    names = [name for name, _ in manifests(out)]
    assert names == [
        "0001-create-gpu0-be_a.yaml",
        "0002-create-gpu1-be_a.yaml",
        "0003-create-gpu2-be_b.yaml",
        "0004-delete-gpu1-be_a.yaml",
        "0005-create-gpu1-be_b.yaml",
    ]
    assert (out / "apply.sh").read_text().splitlines()[-3:] == [
        "kubectl apply -f 0003-create-gpu2-be_b.yaml",
        "kubectl delete -f 0004-delete-gpu1-be_a.yaml",
        "kubectl apply -f 0005-create-gpu1-be_b.yaml",
    ]
    for name, manifest in manifests(out):
        validate(manifest)  # the Kubernetes API's schema, strict
        gpu = name.split("-")[2].removeprefix("gpu")
        pool = name.removesuffix(".yaml").split("-", 3)[3]
        assert manifest["kind"] == "Pod"
        metadata = manifest["metadata"]
        assert metadata["name"] == f"{config.instance}-gpu{gpu}"
        assert metadata["namespace"] == "gpubalance"
        assert metadata["labels"]["app.kubernetes.io/component"] == "worker"
        assert (metadata["labels"]["gpubalance/gpu"], metadata["labels"]["gpubalance/pool"]) == (
            gpu,
            pool,
        )
        if "-delete-" in name:
            assert set(manifest) == {"apiVersion", "kind", "metadata"}  # what delete needs
            continue
        spec = manifest["spec"]
        assert (spec["nodeName"], spec["hostNetwork"], spec["restartPolicy"]) == (
            "gpu-node-1",
            True,
            "Never",
        )
        (container,) = spec["containers"]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        env = {e["name"]: e["value"] for e in container["env"]}
        assert (env["NVIDIA_VISIBLE_DEVICES"], env["GPUBALANCE_POOL"]) == (gpu, pool)
        port = int(env["GPUBALANCE_PORT"])
        # the worker's command, its placeholders filled in
        assert container["command"][container["command"].index("--port") + 1] == str(port)
        assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    # a restarted controller reads back what was written, and writes nothing more
    again = KubernetesSupervisor(config)
    assert observe(again) == after
    assert len(manifests(out)) == 5
    # once the load time is over, the written start is ready: the move can complete
    loaded = KubernetesSupervisor(kubernetes_workers(tmp_path, ready_after_seconds=0))
    assert observe(loaded)[1].ready


def test_a_kill_deletes_at_once_and_a_deleted_pod_is_left_alone(tmp_path: Path) -> None:
    supervisor = KubernetesSupervisor(kubernetes_workers(tmp_path))
    worker = observe(supervisor)[2]
    supervisor.signal(worker, signal.SIGKILL)
    supervisor.signal(worker, signal.SIGTERM)  # gone already: nothing more written
    out = tmp_path / "state" / "kubernetes"
    assert [name for name, _ in manifests(out)][-1] == "0004-kill-gpu2-be_b.yaml"
    assert (out / "apply.sh").read_text().splitlines()[-1] == (
        "kubectl delete -f 0004-kill-gpu2-be_b.yaml --grace-period=0 --force"
    )
    assert sorted(observe(supervisor)) == [0, 1]
    assert supervisor.last_words(2) == ""


def test_kubernetes_settings_are_checked() -> None:
    base: dict[str, Any] = {"command": ("serve", "{port}"), "gpus": (0, 1)}
    pods = {"node": "n1", "image": "serve:1"}
    with pytest.raises(ValidationError, match=r"backend kubernetes needs kubernetes\.node"):
        WorkersConfig(**base, backend="kubernetes")
    with pytest.raises(ValidationError, match="names the Pods"):
        WorkersConfig(**base, backend="kubernetes", instance="GPU_balance", kubernetes=pods)
    with pytest.raises(ValidationError, match=r"GPUs \[3\] are not among gpus"):
        WorkersConfig(**base, backend="kubernetes", kubernetes={**pods, "serving": {3: "be_a"}})
    with pytest.raises(ValidationError, match="a DNS label"):
        WorkersConfig(**base, backend="kubernetes", kubernetes={**pods, "node": "Node_1"})
    with pytest.raises(ValidationError, match="kubernetes: set, but backend is process"):
        WorkersConfig(**base, kubernetes=pods)
