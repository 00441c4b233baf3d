"""Worker supervisor backend `kubernetes`, dry-run: it never talks to a cluster.

A GPU's worker is one Pod, `<instance>-gpu<N>`, on the node of `kubernetes.node`, labelled
with its pool, requesting one `nvidia.com/gpu` with the card pinned by
`NVIDIA_VISIBLE_DEVICES=N`, on the node's network (HAProxy reaches it at `host:port` as it
reaches the other backends' workers), running `command` in `kubernetes.image`. Each start and
stop the mover asks for becomes a file for a person to review and apply, in order, in
`kubernetes.out_dir`: `NNNN-create-gpuN-POOL.yaml` (`kubectl apply -f`), `NNNN-delete-...`
(`kubectl delete -f`; SIGTERM, the Pod's grace period) or `NNNN-kill-...` (SIGKILL: `kubectl
delete -f --grace-period=0 --force`), each command also appended to `out_dir/apply.sh`.

What it observes is what it has written, the desired state, kept in one file
(`state_dir/kubernetes-pods.json`, replaced atomically) so that a restarted controller reads
it back: a Pod written is a worker from then on, ready `kubernetes.ready_after_seconds` after
it was written; a Pod deleted is gone at once. The Pods of `kubernetes.serving` are written
first and taken as running. Nothing is asked of a cluster or of the workers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import asdict, replace
from typing import Any

import aiohttp
import yaml

from gpubalance.controller.haproxy import check_name
from gpubalance.controller.supervisor import (
    SupervisorError,
    WorkerProcess,
    WorkersConfig,
    free_port,
)

STATE_FILE = "kubernetes-pods.json"
SCRIPT = "apply.sh"
# a label value: what a pool name may be to label its Pods
_LABEL_VALUE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]")
_NUMBERED = re.compile(r"(\d{4})-")


class KubernetesSupervisor:
    def __init__(self, config: WorkersConfig) -> None:
        if config.kubernetes is None:
            raise ValueError("the kubernetes backend needs controller.workers.kubernetes")
        self.config = config
        self.settings = config.kubernetes
        self.out_dir = self.settings.out_dir or config.state_dir / "kubernetes"
        self.state_path = config.state_dir / STATE_FILE

    def pod_name(self, gpu: int) -> str:
        return f"{self.config.instance}-gpu{gpu}"

    # the desired state

    def pods(self) -> dict[int, WorkerProcess]:
        """GPU -> the Pod written for it, as the state file has it (the `serving` Pods written
        first when there is none)."""
        try:
            raw = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return self._seed()
        except (OSError, ValueError) as exc:
            raise SupervisorError(f"cannot read {self.state_path}: {exc}") from exc
        return {int(gpu): WorkerProcess(**pod) for gpu, pod in raw.items()}

    def _save(self, pods: dict[int, WorkerProcess]) -> None:
        body = {str(gpu): asdict(pod) for gpu, pod in sorted(pods.items())}
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.state_path.with_name(self.state_path.name + ".partial")
        partial.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(partial, self.state_path)

    def _seed(self) -> dict[int, WorkerProcess]:
        # running before the controller: ready from the start (a second more than the load
        # time, whatever the rounding of the subtraction)
        since = time.time() - self.settings.ready_after_seconds - 1.0
        pods: dict[int, WorkerProcess] = {}
        for gpu, pool in sorted(self.settings.serving.items()):
            port = free_port(self.config, {p.port for p in pods.values()}, probe=False)
            pods[gpu] = self._create(gpu, pool, port, since)
        self._save(pods)
        return pods

    # the supervisor's part

    async def observe(self, session: aiohttp.ClientSession) -> dict[int, WorkerProcess]:
        now = time.time()
        ready_after = self.settings.ready_after_seconds
        return {
            gpu: replace(pod, ready=now - pod.started_seconds >= ready_after)
            for gpu, pod in self.pods().items()
        }

    def start(self, gpu: int, pool: str) -> WorkerProcess:
        if gpu not in self.config.gpus:
            raise SupervisorError(f"GPU {gpu} is not among the managed GPUs {self.config.gpus}")
        check_name("pool", pool)
        pods = self.pods()
        if gpu in pods:
            raise SupervisorError(
                f"GPU {gpu}'s Pod {self.pod_name(gpu)} serves {pods[gpu].pool}; delete it first"
            )
        taken = {p.port for p in pods.values()}
        pods[gpu] = self._create(gpu, pool, free_port(self.config, taken, probe=False), time.time())
        self._save(pods)
        return pods[gpu]

    def signal(self, worker: WorkerProcess, signum: int) -> None:
        pods = self.pods()
        pod = pods.pop(worker.gpu, None)
        if pod is None:
            return  # deleted already
        verb = "kill" if signum == signal.SIGKILL else "delete"
        flags = " --grace-period=0 --force" if verb == "kill" else ""
        self._write(verb, pod, _identity(self._pod(pod)), f"kubectl delete -f {{file}}{flags}")
        self._save(pods)

    def last_words(self, gpu: int) -> str:
        return ""  # dry-run: no Pod runs here to have said anything

    # the manifests

    def _create(self, gpu: int, pool: str, port: int, started: float) -> WorkerProcess:
        pod = WorkerProcess(gpu, pool, 0, self.config.host, port, started, False)
        self._write("create", pod, self._pod(pod), "kubectl apply -f {file}")
        return pod

    def _pod(self, pod: WorkerProcess) -> dict[str, Any]:
        if not _LABEL_VALUE.fullmatch(pod.pool):
            raise SupervisorError(f"pool {pod.pool!r} cannot label a Pod (a label value)")
        env = {
            "NVIDIA_VISIBLE_DEVICES": str(pod.gpu),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "GPUBALANCE_GPU": str(pod.gpu),
            "GPUBALANCE_POOL": pod.pool,
            "GPUBALANCE_PORT": str(pod.port),
        }
        container = {
            "name": "worker",
            "image": self.settings.image,
            "command": self.config.argv(pod.gpu, pod.port, pod.pool),
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "ports": [{"name": "http", "containerPort": pod.port}],
            "readinessProbe": {"httpGet": {"path": self.config.health_path, "port": pod.port}},
            "resources": {"limits": {self.settings.gpu_resource: 1}},
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.pod_name(pod.gpu),
                "namespace": self.settings.namespace,
                "labels": {
                    "app.kubernetes.io/name": "gpubalance",
                    "app.kubernetes.io/component": "worker",
                    "app.kubernetes.io/instance": self.config.instance,
                    "gpubalance/gpu": str(pod.gpu),
                    "gpubalance/pool": pod.pool,
                },
            },
            "spec": {
                "nodeName": self.settings.node,
                "hostNetwork": True,
                # the controller decides what a GPU serves: a worker that exits while it loads
                # is undone, which a restart would hide
                "restartPolicy": "Never",
                "containers": [container],
            },
        }

    def _write(self, verb: str, pod: WorkerProcess, manifest: dict[str, Any], command: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        numbers = (_NUMBERED.match(p.name) for p in self.out_dir.glob("[0-9]*-*.yaml"))
        number = max((int(m.group(1)) for m in numbers if m), default=0) + 1
        path = self.out_dir / f"{number:04d}-{verb}-gpu{pod.gpu}-{pod.pool}.yaml"
        line = command.format(file=path.name)
        what = {
            "create": f"starts serving {pod.pool} (port {pod.port})",
            "delete": f"stops serving {pod.pool}",
            "kill": f"stops serving {pod.pool} at once",
        }[verb]
        header = (
            f"# gpubalance controller (dry-run): GPU {pod.gpu} of node {self.settings.node} "
            f"{what}.\n# {line}\n"
        )
        path.write_text(header + yaml.safe_dump(manifest, sort_keys=False))
        script = self.out_dir / SCRIPT
        if not script.exists():
            script.write_text(
                "#!/bin/sh\n# the controller's manifests in the order written: review them, "
                'then run this (or the lines not yet applied)\nset -e\ncd "$(dirname "$0")"\n'
            )
            script.chmod(0o755)
        with script.open("a") as out:
            out.write(line + "\n")


def _identity(manifest: dict[str, Any]) -> dict[str, Any]:
    """What `kubectl delete -f` needs of a Pod: its kind, name, namespace (and labels)."""
    return {key: manifest[key] for key in ("apiVersion", "kind", "metadata")}
