"""Kubernetes manifests of a training stage's workers: one gang-scheduled job of ``nnodes`` pods,
each running torchrun with ``nproc_per_node`` workers (one per accelerator), as one of

- ``trainjob``: a Kubeflow Trainer v2 ``TrainJob`` (trainer.kubeflow.org/v1alpha1) on a torch
  ClusterTrainingRuntime (``torch-distributed`` by default). The runtime's torch plugin gives
  every node's container torchrun's ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
  ``PET_MASTER_PORT``; gang scheduling is the runtime's ``podGroupPolicy``.
- ``pytorchjob``: a Kubeflow Training Operator v1 ``PyTorchJob`` (kubeflow.org/v1): a Master and
  nnodes-1 Workers, with the same ``PET_*`` variables; ``runPolicy.schedulingPolicy.minAvailable``
  gangs them when the operator runs with a gang scheduler (Volcano or scheduler-plugins).
- ``volcano``: a Volcano ``Job`` (batch.volcano.sh/v1alpha1): a master task and a worker task,
  ``minAvailable`` = nnodes, the ``pytorch`` plugin setting ``MASTER_ADDR``, ``MASTER_PORT`` and
  ``RANK`` (the node rank), ``svc`` the pods' host names, ``env`` their task indices. On Ascend
  with MindCluster, the job and its pods carry MindCluster's ``ring-controller.atlas`` label
  and the containers get ``ASCEND_VISIBLE_DEVICES`` from the device plugin's annotation.

torchrun's own options say ``--nnodes`` and ``--nproc-per-node``; the node rank and master come
from the variables the operator sets (torchrun reads ``PET_<OPTION>``; Volcano's are passed
as ``$(VAR)`` references, which the kubelet expands). Every pod mounts the shared volume (a
PersistentVolumeClaim) at the path where the submitting flow run sees it, so the run's config,
data and checkpoints are at the same paths on every node.
"""

from __future__ import annotations

import copy
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["trainjob", "pytorchjob", "volcano"]
KINDS: tuple[Kind, ...] = ("trainjob", "pytorchjob", "volcano")

GPU = "nvidia.com/gpu"
ASCEND = "huawei.com/Ascend910"

# kubectl's name of each kind's resource, fully qualified (a bare "job" is a batch/v1 Job).
RESOURCES: dict[str, str] = {
    "trainjob": "trainjobs.trainer.kubeflow.org",
    "pytorchjob": "pytorchjobs.kubeflow.org",
    "volcano": "jobs.batch.volcano.sh",
}
# The container that runs torchrun in each kind's pods: the Trainer's runtimes and the
# Training Operator find it by these names.
CONTAINERS: dict[str, str] = {"trainjob": "node", "pytorchjob": "pytorch", "volcano": "trainer"}
SHARED_VOLUME = "shared"
PYTHON = "python"
"""The image's Python (on its PATH): deployments/Dockerfile puts its virtual environment first."""
_NAME_MAX = 40  # pods are named <job>-<role>-<index>[-<suffix>]; services after the job


@dataclass(frozen=True)
class TrainingJob:
    """Everything a training job's manifest says."""

    name: str
    """The job's name: a DNS-1035 label (see ``job_name``)."""
    image: str
    module: str
    """``python -m module *args`` is each worker's program."""
    args: tuple[str, ...]
    nnodes: int
    nproc_per_node: int
    namespace: str = "default"
    env: Mapping[str, str] = field(default_factory=dict)
    pvc: str | None = None
    """PersistentVolumeClaim of the storage every node shares (ReadWriteMany), if any."""
    mount_path: str = "/workspace"
    accelerator: str | None = GPU
    """Extended resource of the accelerators (nvidia.com/gpu, huawei.com/Ascend910), or None."""
    accelerators_per_node: int | None = None
    """Accelerators each node's pod asks for (default: nproc_per_node)."""
    cpu: str | None = None
    memory: str | None = None
    shm_size: str | None = "16Gi"
    """Size of the pods' /dev/shm (memory-backed), which data loaders and NCCL use."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    image_pull_policy: str = "IfNotPresent"
    queue: str | None = None
    """Volcano queue (volcano, and pytorchjob's scheduling policy)."""
    trainer_runtime: str = "torch-distributed"
    """ClusterTrainingRuntime of a trainjob."""
    ring_controller: str | None = "ascend-910b"
    """MindCluster's ring-controller.atlas label of an Ascend volcano job."""
    master_port: int = 29500
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(f"nnodes={self.nnodes} and nproc_per_node={self.nproc_per_node} must be at least 1")
        if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", self.name) or len(self.name) > 63:
            raise ValueError(f"job name {self.name!r} is not a DNS-1035 label (lower case, digits, '-', at most 63)")

    @property
    def ascend(self) -> bool:
        return self.accelerator == ASCEND


def job_name(base: str, suffix: str | None = None) -> str:
    """A unique DNS-1035 job name from ``base`` (a stage's job name): lower case, other
    characters as '-', cut to leave room for a random suffix and the pods' role and index."""
    suffix = suffix if suffix is not None else secrets.token_hex(3)
    stem = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")
    stem = re.sub(r"^[^a-z]+", "", stem) or "llmflow"
    stem = stem[: _NAME_MAX - len(suffix) - 1].rstrip("-")
    return f"{stem}-{suffix}"


def torchrun(job: TrainingJob, rendezvous: Sequence[str] = ()) -> list[str]:
    """The container command: torchrun on ``job.nproc_per_node`` processes per node of
    ``job.nnodes``, meeting by ``rendezvous`` (options; default: torchrun's PET_* variables)."""
    return [PYTHON, "-m", "torch.distributed.run", f"--nnodes={job.nnodes}",
            f"--nproc-per-node={job.nproc_per_node}", *rendezvous, "-m", job.module, *job.args]


def resources(job: TrainingJob) -> dict[str, Any]:
    """Each node's requests and limits: the accelerators (limits = requests, as extended
    resources must), cpu and memory when given."""
    amounts: dict[str, Any] = {}
    if job.accelerator is not None:
        amounts[job.accelerator] = job.accelerators_per_node or job.nproc_per_node
    if job.cpu is not None:
        amounts["cpu"] = job.cpu
    if job.memory is not None:
        amounts["memory"] = job.memory
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def env_list(job: TrainingJob) -> list[dict[str, Any]]:
    """The containers' environment: ``job.env``, unbuffered Python output, and on Ascend the
    devices the device plugin chose (the Ascend Docker Runtime reads ASCEND_VISIBLE_DEVICES)."""
    values = {"PYTHONUNBUFFERED": "1", **job.env}
    entries: list[dict[str, Any]] = [{"name": k, "value": str(v)} for k, v in values.items()]
    if job.ascend and "ASCEND_VISIBLE_DEVICES" not in values:
        entries.append({"name": "ASCEND_VISIBLE_DEVICES",
                        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{ASCEND}']"}}})
    return entries


def volumes(job: TrainingJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pods' volumes and the container's mounts: the shared claim and /dev/shm."""
    vols: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if job.pvc is not None:
        vols.append({"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": job.pvc}})
        mounts.append({"name": SHARED_VOLUME, "mountPath": job.mount_path})
    if job.shm_size is not None:
        vols.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return vols, mounts


def container(job: TrainingJob, name: str, command: list[str], ports: Sequence[Mapping[str, Any]] = ()) -> dict:
    """The torchrun container of every node's pod."""
    _, mounts = volumes(job)
    spec: dict[str, Any] = {"name": name, "image": job.image, "imagePullPolicy": job.image_pull_policy,
                            "command": command, "env": env_list(job)}
    if ports:
        spec["ports"] = [dict(p) for p in ports]
    if resources(job):
        spec["resources"] = resources(job)
    if mounts:
        spec["volumeMounts"] = mounts
    return spec


def pod_template(job: TrainingJob, container_name: str, command: list[str],
                 ports: Sequence[Mapping[str, Any]] = (), labels: Mapping[str, str] | None = None,
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A core PodTemplateSpec of one node: the container, the volumes, the placement."""
    vols, _ = volumes(job)
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container(job, container_name, command, ports)]}
    if vols:
        spec["volumes"] = vols
    if job.node_selector:
        spec["nodeSelector"] = dict(job.node_selector)
    if job.tolerations:
        spec["tolerations"] = [dict(t) for t in job.tolerations]
    spec.update(extra or {})
    metadata = {"labels": {**job.labels, **(labels or {})}}
    return {"metadata": metadata, "spec": spec}


def _metadata(job: TrainingJob, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {"name": job.name, "namespace": job.namespace,
            "labels": {"app.kubernetes.io/managed-by": "llmflow", **job.labels, **(labels or {})}}


def trainjob(job: TrainingJob) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, Trainer v2.3). The image,
    command, environment, node count, processes and resources per node are the trainer's;
    the volumes and placement patch the runtime's ``node`` pods (runtimePatches)."""
    vols, mounts = volumes(job)
    trainer: dict[str, Any] = {"image": job.image, "command": torchrun(job), "env": env_list(job),
                               "numNodes": job.nnodes, "numProcPerNode": job.nproc_per_node}
    if resources(job):
        trainer["resourcesPerNode"] = resources(job)
    pod: dict[str, Any] = {}
    if vols:
        pod["volumes"] = vols
        pod["containers"] = [{"name": CONTAINERS["trainjob"], "volumeMounts": mounts}]
    if job.node_selector:
        pod["nodeSelector"] = dict(job.node_selector)
    if job.tolerations:
        pod["tolerations"] = [dict(t) for t in job.tolerations]
    spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                       "name": job.trainer_runtime},
        "trainer": trainer,
    }
    if pod:
        node = {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}
        spec["runtimePatches"] = [{"manager": "llmflow",
                                   "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node]}}}}]
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(job),
            "spec": spec}


def trainjob_pod_template(job: TrainingJob) -> dict[str, Any]:
    """The pod a trainjob's node runs, as the runtime makes it from the trainer's fields and
    patches (without what the runtime adds itself: PET_* variables, its port)."""
    return pod_template(job, CONTAINERS["trainjob"], torchrun(job))


def pytorchjob(job: TrainingJob) -> dict[str, Any]:
    """A Kubeflow Training Operator v1 PyTorchJob: one Master, nnodes-1 Workers; no elastic
    policy (a fixed node count); no retry; the Master's port is the rendezvous."""
    ports = [{"name": "pytorchjob-port", "containerPort": job.master_port}]
    template = pod_template(job, CONTAINERS["pytorchjob"], torchrun(job), ports)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if job.nnodes > 1:
        replicas["Worker"] = {"replicas": job.nnodes - 1, "restartPolicy": "Never", "template": copy.deepcopy(template)}
    scheduling: dict[str, Any] = {"minAvailable": job.nnodes}
    if job.queue is not None:
        scheduling["queue"] = job.queue
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(job),
            "spec": {"nprocPerNode": str(job.nproc_per_node),
                     # Running pods are stopped when the job ends (a failed worker ends the master).
                     "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "Running", "schedulingPolicy": scheduling},
                     "pytorchReplicaSpecs": replicas}}


def volcano(job: TrainingJob) -> dict[str, Any]:
    """A Volcano Job: gang-scheduled (minAvailable = nnodes), a master task and nnodes-1
    workers, one node each; the job completes with the master and aborts when any pod fails."""
    name = CONTAINERS["volcano"]
    rendezvous = ["--node-rank=$(RANK)", "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]
    labels = {"ring-controller.atlas": job.ring_controller} if job.ascend and job.ring_controller else {}
    # One pod per node: each takes its node's accelerators (MindCluster's examples say so too).
    spread = {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchExpressions": [{"key": "volcano.sh/job-name", "operator": "In",
                                                "values": [job.name]}]},
        "topologyKey": "kubernetes.io/hostname"}]}}}
    template = pod_template(job, name, torchrun(job, rendezvous), labels=labels,
                            extra={"schedulerName": "volcano", **spread})
    tasks: list[dict[str, Any]] = [{"name": "master", "replicas": 1, "template": template,
                                    "policies": [{"event": "TaskCompleted", "action": "CompleteJob"}]}]
    if job.nnodes > 1:
        tasks.append({"name": "worker", "replicas": job.nnodes - 1, "template": copy.deepcopy(template)})
    spec: dict[str, Any] = {
        "schedulerName": "volcano",
        "minAvailable": job.nnodes,
        "plugins": {"pytorch": ["--master=master", "--worker=worker", f"--port={job.master_port}"],
                    "svc": [], "env": []},
        "policies": [{"event": "PodFailed", "action": "AbortJob"}, {"event": "PodEvicted", "action": "AbortJob"}],
        "tasks": tasks,
    }
    if job.queue is not None:
        spec["queue"] = job.queue
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": _metadata(job, labels),
            "spec": spec}


RENDERERS = {"trainjob": trainjob, "pytorchjob": pytorchjob, "volcano": volcano}


def render(kind: str, job: TrainingJob) -> dict[str, Any]:
    """The manifest of ``job`` as a ``kind`` (trainjob, pytorchjob or volcano)."""
    if kind not in RENDERERS:
        raise ValueError(f"unknown Kubernetes job kind {kind!r}: expected one of {', '.join(KINDS)}")
    return RENDERERS[kind](job)


def master_selector(kind: str, name: str) -> str:
    """Label selector of the pod of node rank 0 of job ``name`` (whose output is the run's)."""
    return {
        "trainjob": f"jobset.sigs.k8s.io/jobset-name={name},batch.kubernetes.io/job-completion-index=0",
        "pytorchjob": (f"training.kubeflow.org/job-name={name},training.kubeflow.org/replica-type=master,"
                       "training.kubeflow.org/replica-index=0"),
        "volcano": f"volcano.sh/job-name={name},volcano.sh/task-spec=master",
    }[kind]


def outcome(kind: str, obj: Mapping[str, Any]) -> tuple[Literal["succeeded", "failed"] | None, str]:
    """Whether the job ``obj`` (as ``kubectl get -o json`` shows it) has succeeded, failed or
    not finished (None), with the status's message or phase."""
    status = obj.get("status") or {}
    if kind == "volcano":
        state = status.get("state") or {}
        phase = state.get("phase", "")
        message = state.get("message") or state.get("reason") or phase
        if phase == "Completed":
            return "succeeded", message
        if phase in ("Failed", "Aborted", "Terminated"):
            return "failed", message
        return None, message
    done, failed = ("Complete", "Failed") if kind == "trainjob" else ("Succeeded", "Failed")
    for condition in status.get("conditions") or []:
        if condition.get("status") != "True":
            continue
        message = condition.get("message") or condition.get("reason") or condition.get("type", "")
        if condition.get("type") == done:
            return "succeeded", message
        if condition.get("type") == failed:
            return "failed", message
    return None, ""
