"""The worker supervisor `controller.workers.backend` names."""

from __future__ import annotations

from gpubalance.controller.kubernetes_supervisor import KubernetesSupervisor
from gpubalance.controller.supervisor import Supervisor, WorkersConfig, WorkerSupervisor
from gpubalance.controller.systemd_supervisor import SystemdSupervisor


def supervisor_for(config: WorkersConfig) -> WorkerSupervisor:
    """`process`: worker processes started here; `systemd`: instances of a template unit;
    `kubernetes`: Pod manifests written for a person to apply (dry-run)."""
    if config.backend == "systemd":
        return SystemdSupervisor(config)
    if config.backend == "kubernetes":
        return KubernetesSupervisor(config)
    return Supervisor(config)
