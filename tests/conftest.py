"""Shared fixtures: tiny Hugging Face models saved to temporary checkpoint directories, an
isolated Prefect + MLflow backend, and a loopback Hugging Face Hub.

Nothing here reaches the network: the hub is forced offline before transformers is
imported (the ``hub`` fixture puts it online, pointed at a server on 127.0.0.1), and every
model is built from a config in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two pytest processes share the cores: one thread each
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import shared_prefect_server
import torch

pytest_plugins = ["suite_times"]  # the modules longest first; the time per module at the end of every run

# The small shapes every tiny model shares (override per test through the factory).
TINY = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}


def _hf_classes(family: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[family]


# Families whose RMSNorms store their weight zero-centred (applied as 1 + w), except the gated
# norm inside each Gated DeltaNet (``linear_attn.norm``).
ZERO_CENTERED = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "gemma3_text")


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> None:
    """Give every parameter non-trivial values: transformers initialises biases to zero and
    norm weights to one, which would let bias- or norm-handling bugs pass unnoticed. Norms
    stored zero-centred get 0.1 * randn (the same 1 + 0.1 * randn as applied)."""
    g = torch.Generator().manual_seed(seed)
    zero_centered = getattr(getattr(model, "config", None), "model_type", None) in ZERO_CENTERED
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            centre = 0.0 if zero_centered and "linear_attn" not in name else 1.0
            p.copy_(centre + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(std * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="session")
def make_hf_model(tmp_path_factory):
    """Factory: ``make_hf_model(family="llama", seed=0, save_kwargs=None, **config_overrides)``
    builds a tiny transformers model with seeded random weights (eager attention, fp32),
    saves it with ``save_pretrained`` and returns ``(hf_model.eval(), path)``."""

    def factory(family: str = "llama", seed: int = 0, save_kwargs: dict | None = None, **overrides):
        config_cls, model_cls = _hf_classes(family)
        kwargs = {**TINY, **overrides}
        if "text_config" in overrides:  # a multimodal model: the tiny shapes are its text model's
            kwargs = {**overrides, "text_config": {**TINY, **overrides["text_config"]}}
        config = config_cls(**kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = model_cls(config)
        randomize_(model, seed)
        if config.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        path = tmp_path_factory.mktemp(f"hf_{family}")
        model.save_pretrained(path, **(save_kwargs or {}))
        return model.eval(), path

    return factory


@pytest.fixture
def static_generate(monkeypatch):
    """``static_generate(model, tokenizer, prompts, config)``: each row's generated ids through
    the static KV cache that the compiled decode step runs over, the step itself run eagerly
    (tests/test_generate.py compiles it)."""
    from llmflow.infer import decode_step
    from llmflow.infer.generate import generate

    monkeypatch.setattr(decode_step, "compiled_last_logits", lambda device_type: decode_step.last_logits)

    def run(model, tokenizer, prompts, config) -> list[list[int]]:
        return [r.tokens for r in generate(model, tokenizer, prompts, config.model_copy(update={"decode": "compiled"}))]

    return run


@pytest.fixture
def tokens():
    """Factory: ``tokens(batch, seq, vocab, seed=0)`` -> random int64 ids."""

    def factory(batch: int, seq: int, vocab: int = TINY["vocab_size"], seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, seq), generator=g)

    return factory


# --- Prefect + MLflow: an isolated backend for tests of the task and flow layers ---------------


class PrefectBackend:
    """What ``prefect_server`` started: its settings and the MLflow store beside it."""

    def __init__(self, root, settings: dict, mlflow_uri: str):
        self.root = root
        self.settings = settings
        """Prefect settings (home, result storage, API URL of the harness server)."""
        self.mlflow_uri = mlflow_uri
        """sqlite:/// URI of the session's MLflow store."""


@pytest.fixture(scope="session")
def sample_assets(tmp_path_factory) -> Callable[..., Path]:
    """``sample_assets(**settings)``: the built-in sample assets for these ``SampleConfig``
    settings (all but ``out``), written once per session for each distinct setting. They are
    shared: a test that changes them works on a copy."""
    from llmflow.sample.assets import SampleConfig, write_sample

    built: dict[tuple, Path] = {}

    def assets(**settings: Any) -> Path:
        key = tuple(sorted(settings.items()))
        if key not in built:
            built[key] = write_sample(SampleConfig(out=tmp_path_factory.mktemp("sample") / "assets", **settings))
        return built[key]

    return assets


@pytest.fixture(scope="session")
def sample_tokenizer_model(sample_assets, make_hf_model) -> Callable[..., Path]:
    """Factory: ``sample_tokenizer_model(family, **config_overrides)``: the directory of a tiny
    random ``family`` model over the sample's vocabulary with the sample's tokenizer files, so
    that any family goes through the stages that tokenize the sample data."""
    from llmflow.weights.tokenizer_files import copy_tokenizer_files

    def factory(family: str, **overrides) -> Path:
        sample = sample_assets() / "model"
        vocab = json.loads((sample / "config.json").read_text())["vocab_size"]
        _, model = make_hf_model(family, vocab_size=vocab, **overrides)
        copy_tokenizer_files(sample, model)
        return model

    return factory


@pytest.fixture(scope="session")
def prefect_server(request, tmp_path_factory):
    """The session's Prefect server (``shared_prefect_server``: one for every pytest-xdist
    process, started on first use) with this process's PREFECT_HOME, result storage and
    MLflow store in a temporary directory. Nothing is set process-wide: tests use the
    ``prefect_env`` fixture, which applies the settings per test."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_ANALYTICS_ENABLED,
    )

    root = tmp_path_factory.mktemp("prefect")
    settings = {
        PREFECT_HOME: root / "home",
        PREFECT_RESULTS_LOCAL_STORAGE_PATH: root / "results",
        PREFECT_SERVER_ANALYTICS_ENABLED: False,
        PREFECT_API_URL: shared_prefect_server.api_url(shared_prefect_server.shared_root(request.config)),
    }
    return PrefectBackend(root, settings, f"sqlite:///{root / 'mlflow.db'}")


@pytest.fixture
def prefect_env(prefect_server, monkeypatch, request):
    """Run flows in this test against the session's Prefect server, with MLflow logging to the
    session's SQLite store in an experiment of this test's own (MLFLOW_EXPERIMENT_NAME).
    Everything is restored when the test ends."""
    import re

    import mlflow
    import mlflow.tracking._tracking_service.utils as mlflow_uri_state
    import mlflow.tracking.fluent
    from prefect.settings import temporary_settings

    experiment = "test-" + re.sub(r"[^\w.-]+", "-", request.node.nodeid)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", prefect_server.mlflow_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    # A tracking URI or experiment set in-process (tracking.configure in a flow) would win
    # over the environment of the tests that come after.
    monkeypatch.setattr(mlflow_uri_state, "_tracking_uri", None)
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID")
    # The experiment keeps its artifacts beside the store, not in ./mlruns of the test's cwd.
    client = mlflow.MlflowClient(prefect_server.mlflow_uri)
    if client.get_experiment_by_name(experiment) is None:
        client.create_experiment(experiment, artifact_location=(prefect_server.root / "mlartifacts" / experiment).as_uri())
    with temporary_settings(updates=prefect_server.settings):
        yield {"mlflow_uri": prefect_server.mlflow_uri, "experiment": experiment, "root": prefect_server.root}


# --- a loopback Hugging Face Hub -------------------------------------------------------------


COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_SENTINELtokenNEVERprinted123"


def _repo_files() -> dict[str, bytes]:
    rng = random.Random(0)
    return {
        "config.json": json.dumps({"hidden_size": 64, "num_hidden_layers": 2}).encode(),
        "tokenizer.json": json.dumps({"vocab": {f"t{i}": i for i in range(500)}}).encode(),
        "model.safetensors": rng.randbytes(200_000),
        "sub/extra.bin": rng.randbytes(50_000),
    }


LFS = {"model.safetensors", "sub/extra.bin"}


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class FakeHub(ThreadingHTTPServer):
    """A loopback Hugging Face Hub speaking the endpoints huggingface_hub's ``snapshot_download``
    uses: ``GET /api/{models,datasets}/{repo}/revision/{rev}`` (repo info with ``sha``),
    ``GET /api/{models,datasets}/{repo}/tree/{rev}?recursive=True`` (files with size, git oid
    and LFS sha256), and ``HEAD``/``GET /[datasets/]{repo}/resolve/{rev}/{file}``
    (``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``/``X-Linked-Size`` for LFS files, ``Range``
    requests). Tests add repositories to ``repos``: {(repo type, "org/name"): {path: bytes}}."""

    daemon_threads = True
    commit = COMMIT
    """The commit every repository is at."""
    token = TOKEN
    """The HF_TOKEN the ``hub`` fixture sets."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos = {("model", "org/tiny"): _repo_files(), ("dataset", "org/data"): {"train.jsonl": b'{"a": 1}\n' * 100}}
        self.requests: list[tuple[str, str]] = []
        self.auth: set[str | None] = set()
        self.drop_once: set[str] = set()  # file names whose next GET is cut off mid-body
        self.wrong: dict[str, bytes] = {}  # file names served with these bytes instead
        self.ranges: list[tuple[str, str | None]] = []  # (path, Range header) of every request
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def file_gets(self) -> list[str]:
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]


class HubHandler(BaseHTTPRequestHandler):
    server: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    def _json(self, payload, status=200, headers=None):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _not_found(self):
        self._json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})

    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    def _handle(self, head: bool):
        hub = self.server
        path = unquote(urlsplit(self.path).path)
        with hub.lock:
            hub.requests.append((self.command, path))
            hub.auth.add(self.headers.get("Authorization"))
            hub.ranges.append((path, self.headers.get("Range")))
        if path.startswith("/api/") and path.count("/") >= 3:
            kind, rest = path[len("/api/") :].split("/", 1)
            repo_type = kind.rstrip("s")
            for marker in ("/revision/", "/tree/", ""):
                if marker in rest:
                    repo_id = rest.split(marker, 1)[0] if marker else rest
                    files = hub.repos.get((repo_type, repo_id))
                    if files is None:
                        return self._not_found()
                    if marker != "/tree/":
                        return self._json(
                            {"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}
                        )
                    tree = []
                    for name, data in sorted(files.items()):
                        entry = {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                        if name in LFS:
                            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                        tree.append(entry)
                    return self._json(tree)
            return self._not_found()
        if "/resolve/" not in path:
            return self._not_found()
        left, name = path.split("/resolve/", 1)
        _, name = name.split("/", 1)
        repo_type, repo_id = ("dataset", left[len("/datasets/") :]) if left.startswith("/datasets/") else ("model", left[1:])
        files = hub.repos.get((repo_type, repo_id))
        if files is None or name not in files:
            return self._not_found()
        data = files[name]
        served = hub.wrong.get(name, data)
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_git_oid(data)}"', "Accept-Ranges": "bytes"}
        if name in LFS:
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(data))
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and not head:
            start = int(rng.split("=")[1].split("-")[0])
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(served) - 1}/{len(served)}"
        body = served[start:]
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        if name in hub.drop_once and start == 0:
            hub.drop_once.discard(name)
            self.wfile.write(body[: len(body) // 3])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A loopback Hub; huggingface_hub is pointed at it and put online for the test."""
    from huggingface_hub import constants

    server = FakeHub()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # huggingface_hub reads these at import time: set the environment and its constants.
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    yield server
    server.shutdown()
    server.server_close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that selects no test is a failure (exit status 1), never a quiet success: a marker
    expression or path that matches nothing (``-m "not slow"`` after a rename) must show. The
    process that started the others stops the session's Prefect server."""
    if not hasattr(session.config, "workerinput"):
        shared_prefect_server.stop(shared_prefect_server.shared_root(session.config))
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("error: no test was selected (pytest exit status 5)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
