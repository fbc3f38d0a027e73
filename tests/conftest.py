"""Shared fixtures: tiny Hugging Face models saved to temporary checkpoint directories.

Nothing here reaches the network: the hub is forced offline before transformers is
imported, and every model is built from a config in memory.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# The small shapes every tiny model shares (override per test through the factory).
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def _hf_classes(family: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> None:
    """Give every parameter non-trivial values: transformers initialises biases to zero and
    norm weights to one, which would let bias- or norm-handling bugs pass unnoticed."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(std * torch.randn(p.shape, generator=g))


@pytest.fixture
def make_hf_model(tmp_path_factory):
    """Factory: ``make_hf_model(family="llama", seed=0, save_kwargs=None, **config_overrides)``
    builds a tiny transformers model with seeded random weights (eager attention, fp32),
    saves it with ``save_pretrained`` and returns ``(hf_model.eval(), path)``."""

    def factory(family: str = "llama", seed: int = 0, save_kwargs: dict | None = None, **overrides):
        config_cls, model_cls = _hf_classes(family)
        kwargs = {**TINY, **overrides}
        config = config_cls(**kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = model_cls(config)
        randomize_(model, seed)
        if config.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        path = tmp_path_factory.mktemp(f"hf_{family}")
        model.save_pretrained(path, **(save_kwargs or {}))
        return model.eval(), path

    return factory


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
def prefect_server(tmp_path_factory):
    """One embedded Prefect server (``prefect_test_harness``) for the whole session, started
    on first use, with PREFECT_HOME and result storage in a temporary directory.

    The harness's settings are entered in a private ``contextvars`` context and the harness's
    process-global settings are put back at once, so nothing leaks into tests that do not ask
    for it: tests use the ``prefect_env`` fixture, which applies the settings per test.
    """
    import contextvars
    from contextlib import ExitStack

    import prefect.context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    root = tmp_path_factory.mktemp("prefect")
    settings = {
        PREFECT_HOME: root / "home",
        PREFECT_RESULTS_LOCAL_STORAGE_PATH: root / "results",
        PREFECT_SERVER_ANALYTICS_ENABLED: False,
        # The embedded server takes 15-25 s to start on a 2-core machine.
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 180,
    }
    context = contextvars.copy_context()
    stack = ExitStack()
    global_settings = prefect.context.GLOBAL_SETTINGS_CONTEXT
    try:
        # The server subprocess inherits these settings (home, storage, no analytics).
        context.run(stack.enter_context, temporary_settings(updates=settings))
        context.run(stack.enter_context, prefect_test_harness(server_startup_timeout=180))
        settings[PREFECT_API_URL] = context.run(PREFECT_API_URL.value)
    except BaseException:
        context.run(stack.close)
        raise
    finally:
        # The harness also swaps the process-global settings; keep them for prefect_env only.
        prefect.context.GLOBAL_SETTINGS_CONTEXT = global_settings
    try:
        yield PrefectBackend(root, settings, f"sqlite:///{root / 'mlflow.db'}")
    finally:
        context.run(stack.close)


@pytest.fixture
def prefect_env(prefect_server, monkeypatch, request):
    """Run flows in this test against the session's Prefect server, with MLflow logging to the
    session's SQLite store in an experiment of this test's own (MLFLOW_EXPERIMENT_NAME).
    Everything is restored when the test ends."""
    import re

    import mlflow.tracking._tracking_service.utils as mlflow_uri_state
    from prefect.settings import temporary_settings

    experiment = "test-" + re.sub(r"[^\w.-]+", "-", request.node.nodeid)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", prefect_server.mlflow_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    # A tracking URI set in-process (mlflow.set_tracking_uri) would win over the environment.
    monkeypatch.setattr(mlflow_uri_state, "_tracking_uri", None)
    with temporary_settings(updates=prefect_server.settings):
        yield {"mlflow_uri": prefect_server.mlflow_uri, "experiment": experiment, "root": prefect_server.root}
