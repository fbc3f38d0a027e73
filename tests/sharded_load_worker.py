"""A rank of ``tests/test_sharded_loading.py``'s multi-rank check (``run_forked``): under each
layout, the model the training loop's sharded load gives against the whole model loaded in
one piece and then sharded, parameter by parameter, bitwise, from a Hugging Face directory
and from a training checkpoint. Prints one ``ok`` line per case and what the rank read, then
``refused ...`` for a directory whose NaN lies in rank 1's shard, and ``fused ...`` for the same
model with its experts fused (``mlp.experts.gate_up_proj``) loaded under dp=2 x ep=2."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llmflow.mesh import ParallelLayout, build_mesh
from llmflow.models import LoraConfig, apply_lora
from llmflow.models.parallelize import parallelize_decoder
from llmflow.weights import CheckpointError, load_model
from llmflow.weights.hf import index_hf_tensors
from llmflow.weights.hf_names import fused_experts
from llmflow.weights.sharded_loading import load_sharded, meta_model, sharded_source

LAYOUTS = {  # name: (tp, dp, ep, activation checkpointing, LoRA)
    "dp=2": (1, 2, 1, "none", False),
    "dp=2 lora": (1, 2, 1, "full", True),
    "tp=2": (2, 1, 1, "full", False),
    "dp=2 ep=2": (1, 2, 2, "selective", False),
}
SEED = 7
LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "o_proj"])


def local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def main(argv: list[str]) -> None:
    hf, checkpoint = Path(argv[0]), Path(argv[1])
    dist.init_process_group("gloo")
    stored_bytes = sum(t.nbytes for t in index_hf_tensors(hf).values())
    for name, (tp, dp, ep, ac, lora) in LAYOUTS.items():
        mesh = build_mesh(ParallelLayout.of_world(dist.get_world_size(), 1, tp, dp, ep), "cpu")
        for source_path in (hf, checkpoint):
            options = {"lora": lora, "activation_checkpointing": ac, "fsdp_dtype": torch.float32 if dp > 1 else None}
            torch.manual_seed(SEED)
            whole, _ = load_model(source_path)
            if lora:
                apply_lora(whole, LORA, generator=torch.Generator().manual_seed(SEED))
            parallelize_decoder(whole, mesh, **options)
            after_whole = torch.rand(4)

            torch.manual_seed(SEED)
            source = sharded_source(source_path)
            sharded = meta_model(source)
            if lora:
                apply_lora(sharded, LORA)
            parallelize_decoder(sharded, mesh, **options)
            report = load_sharded(sharded, [sharded], source, torch.device("cpu"), SEED if lora else None)
            # The default generator is where the whole-model path leaves it (LoRA dropout draws from it).
            assert torch.equal(torch.rand(4), after_whole)

            want, got = dict(whole.named_parameters()), dict(sharded.named_parameters())
            assert list(want) == list(got), (list(want), list(got))
            for key, param in got.items():
                assert type(param) is type(want[key]), key
                if isinstance(param, DTensor):
                    assert param.placements == want[key].placements, (key, param.placements, want[key].placements)
                assert torch.equal(local(param), local(want[key])), (name, source_path, key)
                assert param.requires_grad == want[key].requires_grad, key
            if source.config.tie_word_embeddings:
                assert sharded.lm_head.weight is sharded.model.embed_tokens.weight
            assert torch.equal(sharded.model.inv_freq, whole.model.inv_freq)
            print(f"ok {name} {'checkpoint' if source.checkpoint else 'hf'} bytes_read {report.bytes_read} "
                  f"largest_read {report.largest_read} stored {stored_bytes}", flush=True)
    if len(argv) > 3:  # the experts fused: each rank reads its own experts' slabs
        fused = Path(argv[3])
        mesh = build_mesh(ParallelLayout.of_world(2, 1, 1, 2, 2), "cpu")
        whole, _ = load_model(hf)
        parallelize_decoder(whole, mesh, fsdp_dtype=torch.float32)
        source = sharded_source(fused)
        sharded = meta_model(source)
        parallelize_decoder(sharded, mesh, fsdp_dtype=torch.float32)
        report = load_sharded(sharded, [sharded], source, torch.device("cpu"))
        want = dict(whole.named_parameters())
        for key, param in sharded.named_parameters():
            assert torch.equal(local(param), local(want[key])), ("fused", key)
        stored = index_hf_tensors(fused)
        experts = sum(t.nbytes for n, t in stored.items() if fused_experts(n, source.config))
        print(f"fused bytes_read {report.bytes_read} experts {experts} stored {sum(t.nbytes for t in stored.values())}",
              flush=True)
    # A NaN in rows only rank 1 holds under dp=2: both ranks refuse, naming the file and tensor.
    poisoned = Path(argv[2])
    source = sharded_source(poisoned)
    model = meta_model(source)
    parallelize_decoder(model, build_mesh(ParallelLayout.of_world(2, 1, 1, 2, 1), "cpu"), fsdp_dtype=torch.float32)
    try:
        load_sharded(model, [model], source, torch.device("cpu"))
    except CheckpointError as error:
        print(f"refused {error}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
