"""A stage's workers as a gang-scheduled Kubernetes job (``llmflow.cluster.manifests``: a Kubeflow
TrainJob or PyTorchJob, or a Volcano Job), submitted with ``kubectl``.

``run_kubernetes`` applies the job's manifest, streams the output of node rank 0's pod
(``kubectl logs -f``) to a callback, polls the job's status until it succeeds or fails
(``WorkerError`` with its last output lines), and deletes the job when the caller is interrupted
(a cancelled flow run), so that no pod outlives the stage.

The job's image, namespace and shared volume default to what the flow run's own pod was given
by the Kubernetes work pool (deployments/kubernetes/base-job-template.json): LLMFLOW_IMAGE,
LLMFLOW_K8S_NAMESPACE, LLMFLOW_K8S_PVC and LLMFLOW_K8S_MOUNT_PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import CliApp, CliPositionalArg, CliSubCommand

from llmflow.cluster import manifests
from llmflow.cluster.job import WorkerJob
from llmflow.cluster.manifests import RESOURCES, TrainingJob
from llmflow.launch import WorkerError, run_workers

IMAGE_ENV = "LLMFLOW_IMAGE"
NAMESPACE_ENV = "LLMFLOW_K8S_NAMESPACE"
PVC_ENV = "LLMFLOW_K8S_PVC"
MOUNT_PATH_ENV = "LLMFLOW_K8S_MOUNT_PATH"
_STARTED = ("Running", "Succeeded", "Failed")
_KUBECTL_RETRIES = 6
_POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubectlError(OSError):
    """kubectl is missing, has no cluster, or refused a request."""


class KubernetesSettings(BaseModel):
    """Kubernetes job settings (launcher kubernetes). Image, namespace and shared volume
    default to the flow run's own (the Kubernetes work pool sets them)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    kind: Literal["trainjob", "pytorchjob", "volcano"] = "trainjob"
    """trainjob: Kubeflow Trainer v2 TrainJob (GPU); pytorchjob: Kubeflow Training Operator v1
    PyTorchJob (GPU); volcano: Volcano Job (Ascend with MindCluster, or GPU)."""
    image: str | None = None
    """Image of the workers (default: LLMFLOW_IMAGE, the flow run's image)."""
    namespace: str | None = None
    """Namespace of the job (default: LLMFLOW_K8S_NAMESPACE, else this pod's, else default)."""
    pvc: str | None = None
    """PersistentVolumeClaim (ReadWriteMany) every node mounts: the workspace with the run's
    config, data and checkpoints (default: LLMFLOW_K8S_PVC)."""
    mount_path: str | None = None
    """Where the claim is mounted, the same path as in the flow run (default:
    LLMFLOW_K8S_MOUNT_PATH, else /workspace)."""
    accelerator: Literal["nvidia.com/gpu", "huawei.com/Ascend910", "none"] = "nvidia.com/gpu"
    """Accelerator resource each node asks for (none: CPU nodes)."""
    accelerators_per_node: int | None = Field(default=None, ge=1)
    """Accelerators per node (default: the processes per node)."""
    cpu: str | None = None
    """CPU request and limit of each node's pod (a quantity such as 32)."""
    memory: str | None = None
    """Memory request and limit of each node's pod (a quantity such as 512Gi)."""
    shm_size: str | None = "16Gi"
    """Size of each pod's /dev/shm (memory-backed); none to keep the runtime's default."""
    node_selector: dict[str, str] = {}
    """Node labels the pods must match (e.g. accelerator-type: module-910b-8)."""
    tolerations: list[dict[str, Any]] = []
    """Tolerations of the pods (Kubernetes' toleration objects)."""
    env: dict[str, str] = {}
    """Extra environment of the workers (NCCL_*, HCCL_* settings)."""
    queue: str | None = None
    """Volcano queue (volcano; pytorchjob's scheduling policy)."""
    trainer_runtime: str = "torch-distributed"
    """ClusterTrainingRuntime of a trainjob (a runtime with a podGroupPolicy gang-schedules)."""
    ring_controller: str = "ascend-910b"
    """MindCluster's ring-controller.atlas label of an Ascend volcano job (ascend-910, ascend-910b)."""
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    """Pull policy of the workers' image."""
    context: str | None = None
    """kubectl context (default: the current one, or the pod's service account in a cluster)."""
    poll_s: float = Field(default=10.0, gt=0)
    """Seconds between two looks at the job's status."""

    def training_job(self, name: str, module: str, args: tuple[str, ...] | list[str], nnodes: int,
                     nproc_per_node: int, env: dict[str, str] | None = None) -> TrainingJob:
        """The job of ``nnodes`` x ``nproc_per_node`` workers running ``python -m module args``
        named ``name``, with these settings (their defaults taken from the environment)."""
        image = self.image or os.environ.get(IMAGE_ENV)
        if not image:
            raise ValueError(f"launcher kubernetes needs the workers' image: set kubernetes.image or {IMAGE_ENV}")
        return TrainingJob(
            name=name, image=image, module=module, args=tuple(args), nnodes=nnodes, nproc_per_node=nproc_per_node,
            namespace=self.resolved_namespace(), env={**self.env, **(env or {})},
            pvc=self.pvc or os.environ.get(PVC_ENV) or None,
            mount_path=self.mount_path or os.environ.get(MOUNT_PATH_ENV) or "/workspace",
            accelerator=None if self.accelerator == "none" else self.accelerator,
            accelerators_per_node=self.accelerators_per_node, cpu=self.cpu, memory=self.memory,
            shm_size=self.shm_size, node_selector=self.node_selector, tolerations=tuple(self.tolerations),
            image_pull_policy=self.image_pull_policy, queue=self.queue, trainer_runtime=self.trainer_runtime,
            ring_controller=self.ring_controller,
        )

    def resolved_namespace(self) -> str:
        if self.namespace:
            return self.namespace
        if os.environ.get(NAMESPACE_ENV):
            return os.environ[NAMESPACE_ENV]
        try:
            return _POD_NAMESPACE_FILE.read_text().strip() or "default"
        except OSError:
            return "default"


class Kubectl:
    """kubectl in one namespace (and context)."""

    def __init__(self, namespace: str, context: str | None = None) -> None:
        executable = shutil.which("kubectl")
        if executable is None:
            raise KubectlError("launcher kubernetes: kubectl is not on PATH (the llmflow image has it)")
        self.base = [executable, *([f"--context={context}"] if context else []), f"--namespace={namespace}"]
        in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        if context is None and not in_cluster:
            current = subprocess.run([executable, "config", "current-context"], capture_output=True, text=True,
                                     check=False)
            if current.returncode != 0:
                raise KubectlError("launcher kubernetes: kubectl has no cluster (no current context, not in a pod): "
                                   + (current.stderr.strip().splitlines() or ["kubectl config current-context"])[-1])

    def args(self, *args: str) -> list[str]:
        return [*self.base, *args]

    def run(self, *args: str, input: str | None = None) -> str:
        done = subprocess.run(self.args(*args), input=input, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            message = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[-1]
            raise KubectlError(f"kubectl {args[0]}: {message}")
        return done.stdout

    def json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.run(*args, "-o", "json"))


def run_kubernetes(job: WorkerJob, nnodes: int, settings: KubernetesSettings, on_line: Callable[[str], None],
                   env: dict[str, str]) -> None:
    """Run ``job`` (a ``WorkerJob``) as a ``settings.kind`` job of ``nnodes`` pods; node rank 0's
    output goes to ``on_line``. Raises ``WorkerError`` when the job fails; deletes the job
    when interrupted."""
    training = settings.training_job(manifests.job_name(job.name), job.module, job.args, nnodes,
                                     job.nproc_per_node, env)
    manifest = manifests.render(settings.kind, training)
    kubectl = Kubectl(training.namespace, settings.context)
    kubectl.run("apply", "-f", "-", input=yaml.safe_dump(manifest, sort_keys=False))
    try:
        on_line(f"submitted {manifest['kind']} {training.namespace}/{training.name} ({nnodes} nodes x "
                f"{job.nproc_per_node} processes)")
        result, tail = follow(kubectl, settings.kind, training.name, on_line, settings.poll_s)
    except BaseException:
        subprocess.run(kubectl.args("delete", RESOURCES[settings.kind], training.name, "--ignore-not-found",
                                    "--wait=false"), capture_output=True, check=False)
        raise
    if result != "succeeded":  # the failed job stays, for kubectl describe and logs
        raise WorkerError(1, tail)


def follow(kubectl: Kubectl, kind: str, name: str, on_line: Callable[[str], None], poll_s: float,
           tail_lines: int = 50) -> tuple[str, list[str]]:
    """Stream node rank 0's output while job ``name`` runs, until it has succeeded or failed;
    returns which, with the last output lines (and on failure the status's message)."""
    tail: deque[str] = deque(maxlen=tail_lines)

    def line(text: str) -> None:
        tail.append(text)
        on_line(text)

    streamed: set[str] = set()
    failures = 0
    while True:
        try:
            result, message = manifests.outcome(kind, kubectl.json("get", RESOURCES[kind], name))
            pod, phase = master_pod(kubectl, kind, name)
            failures = 0
        except KubectlError:
            # An API server that does not answer for a moment must not end a days-long run.
            failures += 1
            if failures >= _KUBECTL_RETRIES:
                raise
            time.sleep(poll_s)
            continue
        if pod is not None and phase in _STARTED and (pod not in streamed or phase == "Running"):
            # Follows the container until it ends; a stream cut short resumes with new lines only.
            resumed = pod in streamed
            streamed.add(pod)
            command = kubectl.args("logs", "-f", f"pod/{pod}", "-c", manifests.CONTAINERS[kind],
                                   *(["--tail=0"] if resumed else []))
            try:
                run_workers(command, on_line=line)
            except WorkerError:
                pass  # the pod went away: its job's status says why
            if not resumed:
                continue
        if result == "succeeded":
            return result, list(tail)
        if result == "failed":
            return result, [*tail, f"{kind} {name} ended in error: {message}"]
        time.sleep(poll_s)


def master_pod(kubectl: Kubectl, kind: str, name: str) -> tuple[str | None, str | None]:
    """The name and phase of node rank 0's pod of job ``name`` (None before it exists)."""
    pods = kubectl.json("get", "pods", "-l", manifests.master_selector(kind, name)).get("items") or []
    if not pods:
        return None, None
    newest = max(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp", ""))
    return newest["metadata"]["name"], (newest.get("status") or {}).get("phase")


class RenderCommand(KubernetesSettings):
    """Print the manifest of a training job (YAML) without submitting it: review it, or
    ``kubectl apply -f`` it yourself."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    args: CliPositionalArg[list[str]] = Field(default_factory=list)
    """Arguments of the workers' module (for llmflow.train: the run's resolved config, on the shared volume)."""
    name: str = "llmflow-train"
    """Name of the job (a DNS-1035 label)."""
    nnodes: int = Field(default=1, ge=1)
    """Nodes (pods) of the job."""
    nproc: int = Field(default=1, ge=1)
    """Worker processes per node (one per accelerator)."""
    module: str = "llmflow.train"
    """Module the workers run (python -m module args)."""

    def cli_cmd(self) -> None:
        job = self.training_job(self.name, self.module, self.args, self.nnodes, self.nproc)
        print(yaml.safe_dump(manifests.render(self.kind, job), sort_keys=False), end="")


class ClusterCommands(BaseModel):
    """Run training workers on a cluster."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    render: CliSubCommand[RenderCommand]
    """Print a Kubernetes training job's manifest (TrainJob, PyTorchJob or Volcano Job) without submitting it."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
