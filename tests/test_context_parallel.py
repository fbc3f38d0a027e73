"""Context parallelism (``models/context_parallel.py``) against one process: two gloo ranks,
each holding half of every sequence (Ulysses: a contiguous half; ring: two of four chunks,
load-balanced), give the whole sequence's logits (each rank its positions), loss and
gradients (summed over the ranks) within 1e-5 in fp32, for grouped-query attention whose
key/value heads split over the ranks and for one key/value head repeated to them, with q/k
norms, Qwen3.5's gated attention, a mixture of experts, packed documents crossing the ranks'
boundaries and a sliding window, DeepSeek-V3's Multi-head Latent Attention (values narrower
than keys) and gpt-oss's attention sinks; and the layouts they cannot split are named before any work."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from llmflow.models.config import ModelConfig
from llmflow.models.context_parallel import CP_ALGOS, context_parallel_problems

TOLERANCE = 1e-5  # fp32
SEQ = 32
SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "head_dim": 16}
CASES = {
    "qwen2, 2 kv heads split over the ranks": {"model_type": "qwen2", "num_key_value_heads": 2},
    "llama, 1 kv head repeated": {"model_type": "llama", "num_key_value_heads": 1},
    "qwen3 q/k norms, packed documents": {"model_type": "qwen3", "num_key_value_heads": 2, "documents": True},
    "mistral, sliding window 8": {"model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 8},
    "qwen3_moe, 4 experts top-2": {"model_type": "qwen3_moe", "num_key_value_heads": 2, "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    # Qwen3.5's gated attention (output gate, partial rotary) without its Gated DeltaNet layers.
    "qwen3_5 gated attention, packed documents": {
        "model_type": "qwen3_5_text", "num_key_value_heads": 2, "layer_types": ["full_attention"] * 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "documents": True},
    # Keys and queries 8 + 8 wide, values 12; a dense layer, then experts under group-limited routing.
    "deepseek_v3 latent attention, packed documents": {
        "model_type": "deepseek_v3", "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "documents": True},
    # Random sinks (set by the worker), a sliding layer then a full one, biased experts.
    "gpt_oss sinks, sliding window 8, packed documents": {
        "model_type": "gpt_oss", "num_key_value_heads": 2, "sliding_window": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "documents": True},
}


def _config(case: dict) -> ModelConfig:
    return ModelConfig.from_hf({**SHAPE, **{key: value for key, value in case.items() if key != "documents"}})


def _batch(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, SEQ), generator=generator)
    labels = torch.randint(0, 96, (2, SEQ), generator=generator)
    labels[0, :5] = -100  # a prompt without loss, across the first rank's half only
    documents = None
    if case.get("documents"):  # documents that cross the ranks' boundary (position 16)
        documents = torch.tensor([[0] * 10 + [1] * 12 + [2] * 10, [0] * 20 + [1] * 12])
    return ids, labels, documents


def cp_worker(argv: list[str]) -> None:
    """One rank: every case's largest differences from the one-process run, written by rank 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from llmflow.models.context_parallel import apply_cp, shard_sequence
    from llmflow.models.decoder import CausalLM

    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("cp",))
    differences = {}
    for (name, case), algo in itertools.product(CASES.items(), CP_ALGOS):
        model = CausalLM(_config(case))
        model.init_weights(generator=torch.Generator().manual_seed(0))
        for param_name, param in model.named_parameters():
            if param_name.endswith(".sinks"):  # init_weights starts them at zero
                param.data.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(2))
        parallel = CausalLM(_config(case))
        parallel.load_state_dict(model.state_dict())
        apply_cp(parallel, mesh, algo)
        ids, labels, documents = _batch(case)

        logits = model(ids, document_ids=documents).detach()
        loss = model(ids, labels, document_ids=documents)
        loss.backward()

        inputs = shard_sequence(ids, labels, None, documents, rank, ranks, algo)
        local = shard_sequence(torch.arange(SEQ)[None], None, None, None, rank, ranks, algo)["input_ids"][0]
        shard_logits = parallel(inputs["input_ids"], position_ids=inputs["position_ids"],
                                document_ids=inputs["document_ids"]).detach()
        shard_loss = parallel(**inputs, loss_reduction="sum")
        tokens = int((labels != -100).sum())
        (shard_loss / tokens).backward()
        total = shard_loss.detach().clone()
        dist.all_reduce(total)
        worst_grad = 0.0
        for (param_name, param), (reference_name, reference) in zip(parallel.named_parameters(),
                                                                    model.named_parameters(), strict=True):
            assert param_name == reference_name
            grad = param.grad.clone()
            dist.all_reduce(grad)
            worst_grad = max(worst_grad, (grad - reference.grad).abs().max().item())
        worst = torch.tensor([(shard_logits - logits[:, local]).abs().max().item(),
                              abs(total.item() / tokens - loss.item()), worst_grad], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the logits of every rank's half
        differences[f"{algo}: {name}"] = dict(zip(("logits", "loss", "gradients"), worst.tolist(), strict=True))
    if rank == 0:
        Path(argv[0]).write_text(json.dumps(differences))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ulysses_and_ring_at_cp2_equal_one_process(tmp_path):
    from forked_workers import run_forked

    out = tmp_path / "differences.json"
    run_forked(f"{Path(__file__).stem}:cp_worker", [str(out)], 2, tmp_path / "cp", {"OMP_NUM_THREADS": "1"})
    differences = json.loads(out.read_text())
    print(json.dumps(differences, indent=1))
    assert set(differences) == {f"{algo}: {name}" for name in CASES for algo in CP_ALGOS}
    for name, worst in differences.items():
        assert max(worst.values()) <= TOLERANCE, (name, worst)


def test_layouts_context_parallelism_cannot_split_are_named():
    dense = _config(CASES["qwen2, 2 kv heads split over the ranks"])
    assert context_parallel_problems(dense, 1, 33) == []
    assert context_parallel_problems(dense, 2, 64) == []
    assert context_parallel_problems(dense, 2, 33) == [
        ("seq_length=33 is not divisible by cp=2: each rank holds seq_length/cp positions; "
        "use a seq_length that is a multiple of 2")]
    assert context_parallel_problems(dense, 8, 64) == [
        ("model num_attention_heads=4 is not divisible by cp=8: Ulysses gives each rank 1/cp of the attention heads; "
        "use a cp that divides them, or cp_algo=ring")]
    assert context_parallel_problems(dense, 4, tp=2) == [
        ("model num_attention_heads/tp = 4/2 = 2 is not divisible by cp=4: Ulysses gives each rank 1/cp of the "
        "attention heads; use a cp that divides them, or cp_algo=ring")]
    assert context_parallel_problems(dense, 8, 64, algo="ring") == []  # ring splits no heads
    assert context_parallel_problems(dense, 2, 34, algo="ring") == [
        ("seq_length=34 is not divisible by 2*cp=4: each rank holds 2 chunks of seq_length/(2 cp); "
        "use a seq_length that is a multiple of 4")]
    hybrid = _config({**CASES["qwen3_5 gated attention, packed documents"],
                      "layer_types": ["linear_attention", "full_attention"]})
    (problem,) = context_parallel_problems(hybrid, 2, 64)
    assert problem.startswith("cp=2 cannot split qwen3_5_text's Gated DeltaNet layers")
