"""Training a mixture of experts (a tiny Qwen3-MoE on the sample data): the load-balancing
auxiliary loss is trained and reported with the experts' load, and two data-parallel ranks,
each holding half of every micro-batch, train what one process does (fp32, 1e-5)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from forked_workers import train_forked
from train_helpers import TOLERANCE, config, losses, training_assets

from llmflow.weights.tokenizer_files import copy_tokenizer_files

AUX_LINE = re.compile(r"^step (\d+)/\d+ \| .*moe_aux_loss ([0-9.]+) \| max_expert_load ([0-9.]+)")
AUX_COEF = 0.05


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory, make_hf_model) -> dict[str, Path]:
    """The sample data tokenized, and a tiny Qwen3-MoE (the sample's vocabulary and tokenizer)
    whose config.json asks for its auxiliary loss, as transformers would train it."""
    assets = training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("moe"))
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    _, path = make_hf_model("qwen3_moe", vocab_size=vocab, num_key_value_heads=2, head_dim=16, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                   output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    copy_tokenizer_files(assets["model"], path)
    return {**assets, "model": path}


def routing(lines: list[str]) -> dict[int, tuple[float, float]]:
    return {int(m[1]): (float(m[2]), float(m[3])) for line in lines if (m := AUX_LINE.match(line))}


def train(assets, out: Path, nproc: int = 1, **overrides) -> tuple[dict[int, float], dict[int, tuple[float, float]]]:
    cfg = config(assets, out, steps=4, **overrides)
    lines = train_forked(cfg, nproc, env={"OMP_NUM_THREADS": "1"})
    return losses(lines), routing(lines)


@pytest.mark.slow
def test_two_data_parallel_ranks_train_the_auxiliary_loss_of_one_process(assets, tmp_path):
    one_loss, one_routing = train(assets, tmp_path / "one", micro_batch_size=4)
    two_loss, two_routing = train(assets, tmp_path / "two", nproc=2, dp=2, micro_batch_size=2)
    plain_loss, _ = train(assets, tmp_path / "plain", micro_batch_size=4, router_aux_loss_coef=0.0)
    assert sorted(one_loss) == sorted(two_loss) == [1, 2, 3, 4]
    for step in one_loss:
        assert abs(one_loss[step] - two_loss[step]) <= TOLERANCE, (step, one_loss, two_loss)
        for got, want in zip(two_routing[step], one_routing[step], strict=True):
            assert abs(got - want) <= TOLERANCE, (step, one_routing, two_routing)
    # Reported either way; trained only with its weight: the first step is the same, later ones differ.
    aux, load = one_routing[1]
    assert 1.0 <= aux and 1.0 <= load <= 4 / 2
    assert plain_loss[1] == one_loss[1] and abs(plain_loss[4] - one_loss[4]) > 1e-6
    assert torch.isfinite(torch.tensor(list(one_loss.values()))).all()
