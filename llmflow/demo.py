"""``llmflow demo``: the foundation end to end on a tiny model, offline.

Builds a small Qwen2-style decoder, writes it as a Hugging Face checkpoint, streams it back
in, trains it on packed synthetic documents (counting sequences, so the loss visibly
falls and next-token accuracy rises), and writes the trained model as a checkpoint that
transformers can load.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from llmflow import runtime
from llmflow.envinfo import environment_report
from llmflow.models import CausalLM, ModelConfig, load_hf_model, save_hf_model

VOCAB = 128


def tiny_config() -> ModelConfig:
    """A 2-layer Qwen2-style config with grouped-query attention and tied embeddings."""
    return ModelConfig.from_hf(
        {
            "model_type": "qwen2",
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
        }
    )


def counting_batch(
    batch: int, seq: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of packed documents, each counting up from a random start (mod VOCAB).
    Returns input_ids, labels (next token; -100 on each document's last token) and
    document_ids."""
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    docs = torch.empty(batch, seq + 1, dtype=torch.long)
    for row in range(batch):
        pos, doc = 0, 0
        while pos < seq + 1:
            length = int(torch.randint(4, 24, (1,), generator=generator))
            start = int(torch.randint(0, VOCAB, (1,), generator=generator))
            end = min(pos + length, seq + 1)
            tokens[row, pos:end] = (start + torch.arange(end - pos)) % VOCAB
            docs[row, pos:end] = doc
            pos, doc = end, doc + 1
    input_ids, labels, document_ids = tokens[:, :-1], tokens[:, 1:].clone(), docs[:, :-1]
    labels[docs[:, 1:] != document_ids] = -100
    return input_ids, labels, document_ids


@torch.no_grad()
def next_token_accuracy(model: CausalLM, batch: tuple[torch.Tensor, ...], device: torch.device) -> float:
    input_ids, labels, document_ids = (t.to(device) for t in batch)
    predictions = model(input_ids, document_ids=document_ids).argmax(-1)
    mask = labels != -100
    return (predictions[mask] == labels[mask]).float().mean().item()


class DemoCommand(BaseModel):
    """Run the built-in end-to-end demo on a tiny model (offline, CPU-friendly)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    out: Path = Path("workspace/demo")
    """Directory for the base and trained checkpoints."""
    steps: int = 80
    """Training steps."""
    batch_size: int = 8
    """Sequences per step."""
    seq_length: int = 128
    """Tokens per sequence (several packed documents each)."""
    lr: float = 3e-3
    """AdamW learning rate."""
    seed: int = 0
    """Seed for weights and data."""

    def cli_cmd(self) -> None:
        run_demo(self)


def run_demo(cfg: DemoCommand) -> dict:
    """Run the demo and return its headline numbers."""
    env = environment_report()
    print(f"device {env['device']} ({env['backend']}), dtype {env['dtype']}, kernels {env['kernels']}")
    device = runtime.dist_env_from_environ(env["device"]).device
    torch.manual_seed(cfg.seed)
    data_gen = torch.Generator().manual_seed(cfg.seed)

    model = CausalLM(tiny_config())
    model.init_weights(generator=torch.Generator().manual_seed(cfg.seed))
    base_dir = save_hf_model(model, cfg.out / "base-model")
    model = load_hf_model(base_dir, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote and reloaded {base_dir} ({n_params / 1e6:.2f}M parameters)")

    held_out = counting_batch(cfg.batch_size, cfg.seq_length, torch.Generator().manual_seed(cfg.seed + 1))
    acc_before = next_token_accuracy(model, held_out, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    t0 = time.perf_counter()
    model.train()
    for step in range(1, cfg.steps + 1):
        input_ids, labels, document_ids = (t.to(device) for t in counting_batch(cfg.batch_size, cfg.seq_length, data_gen))
        loss = model(input_ids, labels=labels, document_ids=document_ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1 or step % 20 == 0 or step == cfg.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - t0
    model.eval()
    acc_after = next_token_accuracy(model, held_out, device)
    trained_dir = save_hf_model(model, cfg.out / "trained-model")
    reloaded_acc = next_token_accuracy(load_hf_model(trained_dir, device=device), held_out, device)
    tokens_per_s = cfg.steps * cfg.batch_size * cfg.seq_length / elapsed
    print(f"trained {cfg.steps} steps in {elapsed:.1f}s ({tokens_per_s:.0f} tokens/s)")
    print(f"next-token accuracy on held-out documents: {acc_before:.1%} before, {acc_after:.1%} after")
    print(f"trained model (Hugging Face format): {trained_dir} (reloaded accuracy {reloaded_acc:.1%})")
    return {"accuracy_before": acc_before, "accuracy_after": acc_after, "reloaded_accuracy": reloaded_acc}
