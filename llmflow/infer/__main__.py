"""``torchrun ... -m llmflow.infer CONFIG.json``: one rank of ``llmflow generate --nproc N``.

Every rank builds the model sharded for tensor parallelism over all N ranks (attention
heads and FFN columns split, see ``apply_tp_inference``) and runs the same generation;
rank 0 picks the tokens (``generate``'s ``group``) and alone writes the output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from llmflow import runtime
from llmflow.infer.command import GenerateCommand, run_generate
from llmflow.infer.generator import make_generator
from llmflow.mesh import ParallelLayout, build_mesh
from llmflow.models import CausalLM, ModelConfig
from llmflow.models.parallelize import apply_tp_inference
from llmflow.weights import is_checkpoint, load_checkpoint, load_model, read_meta, resolve_step_dir


def _empty_sharded_model(config: ModelConfig, mesh: DeviceMesh, device: torch.device) -> CausalLM:
    """The model with uninitialised weights, each rank allocating only its own shards."""
    with torch.device("meta"):
        model = CausalLM(config)
    apply_tp_inference(model, mesh)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module a tensor of its own
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.reset_rope(device)
    return model


def load_sharded_model(path: str | Path, device: torch.device, mesh: DeviceMesh) -> tuple[CausalLM, dict[str, Any]]:
    """The model in ``path`` sharded over the tensor-parallel ``mesh``, on ``device``, with
    its HF config dict.

    A full-weight checkpoint is read shard by shard (DCP reshards into the DTensors), so no
    rank ever holds the whole model. A Hugging Face directory or a LoRA checkpoint is first
    loaded whole into host memory on every rank (a first version: N copies in host memory),
    then each rank copies only its shards to the device.
    """
    path = Path(path)
    step_dir = resolve_step_dir(path) if is_checkpoint(path) else None
    meta = read_meta(step_dir) if step_dir is not None else None
    if meta is not None and meta.lora is None:
        config = ModelConfig.from_hf(meta.hf_config).padded_to(meta.padded_vocab_size)
        model = _empty_sharded_model(config, mesh, device)
        state = model.state_dict()
        if config.tie_word_embeddings:
            del state["lm_head.weight"]
        load_checkpoint(step_dir, {"model": state})
        return model, meta.hf_config
    whole, hf_config = load_model(path, "cpu")
    model = _empty_sharded_model(whole.config, mesh, device)
    set_model_state_dict(model, whole.state_dict(), options=StateDictOptions(full_state_dict=True))
    return model, hf_config


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: torchrun ... -m llmflow.infer CONFIG.json")
    command = GenerateCommand.model_validate_json(Path(args[0]).read_text(encoding="utf-8"))
    env = runtime.init_distributed(command.device)
    try:
        mesh = build_mesh(ParallelLayout(tp=env.world_size), env.device.type)["tp"]
        model, hf_config = load_sharded_model(command.model, env.device, mesh)
        gen = make_generator(command.model, model, hf_config, group=mesh.get_group())
        with open(os.devnull, "w", encoding="utf-8") as devnull:
            run_generate(command, sys.stdout if env.is_main else devnull, gen)
        dist.barrier()  # no rank tears the group down while another may still use it
    finally:
        runtime.destroy_distributed()


if __name__ == "__main__":
    main()
