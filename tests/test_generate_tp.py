"""Tensor-parallel generation: ``llmflow generate --nproc 2`` (torchrun, gloo) writes what one
process writes, both loaders (whole weights, sharded checkpoint) build the model of one
process, and an --nproc the model or machine cannot take is refused before any worker starts."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from llmflow.cli import main
from llmflow.infer import GenerateConfig

PROMPTS = ["The capital of", "The river", "Once upon a time in a land far away there lived"]


@pytest.fixture(scope="module")
def sample_model(sample_assets) -> Path:
    return sample_assets(instruct_rows=10, documents=5) / "model"


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def generate_cli(model: Path, prompts: Path, capsys, *options: str) -> list[dict]:
    main(["generate", "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "16", *options])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.slow
def test_two_ranks_generate_what_one_process_generates(sample_model, prompts_file, capsys, monkeypatch):
    from llmflow.data.tokenizer import load_tokenizer

    lengths = {len(load_tokenizer(sample_model).encode(p).ids) for p in PROMPTS}
    assert len(lengths) == len(PROMPTS)  # rows are left-padded by different amounts
    one = generate_cli(sample_model, prompts_file, capsys)
    assert [r["prompt"] for r in one] == PROMPTS and all(r["completion"] for r in one)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert generate_cli(sample_model, prompts_file, capsys, "--nproc", "2") == one


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "gemma3_text", "gpt_oss"])
def test_two_ranks_generate_what_one_process_generates_for_the_frontier_families(
        family, sample_tokenizer_model, prompts_file, capsys, monkeypatch):
    """Their own splits (``models/parallelize.py``): Multi-head Latent Attention's heads after its
    whole down projections, Gemma 3's four norms and two rotary tables on every rank, gpt-oss's
    sinks split with the heads; prompts longer than the sliding windows, the model sharded on
    the meta device and loaded shard by shard."""
    from test_frontier_flows import FAMILIES

    model = sample_tokenizer_model(family, **FAMILIES[family])
    one = generate_cli(model, prompts_file, capsys)
    assert all(r["completion"] for r in one)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert generate_cli(model, prompts_file, capsys, "--nproc", "2") == one


def _one_rank_group(monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)


def test_sharded_loaders_build_the_model_of_one_process(sample_model, tmp_path, monkeypatch):
    """Both loading paths of a worker (whole weights then shards; a checkpoint read shard by
    shard, here with vocabulary padding) on a one-rank tensor-parallel mesh."""
    from torch.distributed.tensor import DTensor

    from llmflow import runtime
    from llmflow.infer.__main__ import load_sharded_model
    from llmflow.infer.generator import load_generator, make_generator
    from llmflow.mesh import ParallelLayout, build_mesh
    from llmflow.weights.convert import ConvertConfig, convert

    ckpt = convert(ConvertConfig(hf=sample_model, out=tmp_path / "ckpt", pad_vocab_to_multiple=256))
    config = GenerateConfig(max_new_tokens=12)
    expected = [r.tokens for r in load_generator(sample_model).run(PROMPTS, config)]
    _one_rank_group(monkeypatch)
    env = runtime.init_distributed("cpu", timeout_s=60)
    try:
        mesh = build_mesh(ParallelLayout(), "cpu")["tp"]
        for path in (sample_model, ckpt):
            model, hf_config = load_sharded_model(path, env.device, mesh)
            assert isinstance(model.model.layers["0"].self_attn.q_proj.weight, DTensor)
            assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the sample model
            gen = make_generator(path, model, hf_config, group=mesh.get_group())
            assert [r.tokens for r in gen.run(PROMPTS, config)] == expected, path
    finally:
        runtime.destroy_distributed()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nproc", "3"], "num_attention_heads=4 is not divisible by tp=3; model num_key_value_heads=2"),
        (["--nproc", "4"], "num_key_value_heads=2 is not divisible by tp=4"),
        pytest.param(
            ["--nproc", "2", "--device", "cuda"], "only [01] cuda devices are visible",
            marks=pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs"),
        ),
    ],
)
def test_impossible_nproc_is_refused_before_spawning(sample_model, options, message, monkeypatch):
    from llmflow.infer import command

    def no_workers(*_args, **_kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr(command, "run_on_this_node", no_workers)
    with pytest.raises(SystemExit, match=rf"--nproc {options[1]} cannot run .*{message}"):
        main(["generate", "--model", str(sample_model), "--prompt", "hi", *options])


def test_a_hybrid_model_is_refused_tensor_parallel_generation_before_spawning(sample_tokenizer_model, monkeypatch):
    """Gated DeltaNet layers have no generation plan for tp: the command says so in one line
    before starting a worker (the workers' own check would fail each rank after loading)."""
    from llmflow.infer import command

    def no_workers(*_args, **_kwargs):
        raise AssertionError("workers were started")

    model = sample_tokenizer_model("qwen3_5_text", num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                   layer_types=["linear_attention", "full_attention"])
    monkeypatch.setattr(command, "run_on_this_node", no_workers)
    with pytest.raises(SystemExit, match=r"--nproc 2 cannot run .*tensor-parallel generation of Gated DeltaNet "
                                         r"\(linear attention\) layers is not supported; generate with one process \(tp=1\)"):
        main(["generate", "--model", str(model), "--prompt", "hi", "--nproc", "2"])
