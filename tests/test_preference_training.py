"""Preference training (DPO, SimPO, ORPO) in the training loop: every parallel layout gives
one process's losses, the reference log-probs are computed once and read back by a resumed
run, and the loop's first step is the objective of ``llmflow.train.preference`` on the same
pairs (whose agreement with TRL is tests/test_preference_trl.py's)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import TOLERANCE, assert_close, run, train_in_subprocess

from llmflow.data.preference_dataset import PreferenceDataset
from llmflow.data.tokenize_preference import PreferenceTokenizeConfig, tokenize_preference
from llmflow.train.config import TrainConfig
from llmflow.train.pairs import sequence_targets
from llmflow.train.preference import PreferenceConfig, document_sums, pair_documents, pair_logps, pair_terms
from llmflow.train.reference import LOGPS, load_reference, reference_dir, reward_accuracy
from llmflow.weights import load_model

pytestmark = pytest.mark.slow
PAIRS = 64


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory) -> dict[str, Path]:
    sample = sample_assets()
    root = tmp_path_factory.mktemp("preference")
    # The first pairs only: every run computes its reference log-probs of all rows before step 1,
    # and the longest run here takes 40 rows.
    lines = (sample / "preference" / "preference_train.jsonl").read_text().splitlines(keepends=True)
    (root / "pairs.jsonl").write_text("".join(lines[:PAIRS]))
    tokenize_preference(PreferenceTokenizeConfig(
        input=[root / "pairs.jsonl"], tokenizer=sample / "model", out=root / "pairs",
        format="pairwise", seq_length=128, pack=True,
    ))
    return {"model": sample / "model", "pairs": root / "pairs", "root": root}


def config(assets, out: Path, method: str = "dpo", **overrides) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": str(assets["model"]), "out": str(out), "method": method,
        "data": {"kind": "preference", "paths": [str(assets["pairs"])]},
        "steps": 4, "micro_batch_size": 2, "global_batch_size": 8,
        "optim": {"lr": 3e-3, "warmup_steps": 1}, "log_interval": 1, **overrides,
    })


@pytest.fixture(scope="module")
def one_process(assets) -> dict[str, dict[int, float]]:
    """Each method's losses trained in one process (DPO's reference log-probs computed first)."""
    root = assets["root"]
    return {method: train_in_subprocess(config(assets, root / f"one-{method}", method, save_interval=2, keep_last=None))
            for method in ("dpo", "simpo", "orpo")}


LAYOUTS = {"dp2": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "cp2-ring": {"cp": 2, "cp_algo": "ring"}}


@pytest.mark.parametrize(("method", "layout"), [
    *(("dpo", layout) for layout in LAYOUTS), ("simpo", "dp2"), ("simpo", "pp2"), ("orpo", "tp2"), ("orpo", "cp2"),
])
def test_losses_match_one_process(assets, one_process, tmp_path, method, layout):
    assert_close(run(config(assets, tmp_path / "run", method, **LAYOUTS[layout]), 2), one_process[method])


def test_lora_dpo_matches_one_process(assets, tmp_path):
    lora = {"lora": {"rank": 4, "alpha": 8}}
    want = train_in_subprocess(config(assets, tmp_path / "one", **lora))
    assert_close(run(config(assets, tmp_path / "dp2", **lora), 2), want)


def test_resumed_run_takes_its_reference_from_the_initial_weights_once(assets, one_process, tmp_path):
    """A run resumed from step 2 without its cached reference log-probs computes them from
    the initial weights (not the checkpoint's) and continues with the uninterrupted run's
    losses; its next launch reads them back instead of computing them again."""
    step_2 = assets["root"] / "one-dpo" / "step_00000002"
    out = tmp_path / "run"
    shutil.copytree(step_2, out / step_2.name)
    (out / "latest").write_text(f"{step_2.name}\n")
    assert_close(run(config(assets, out), 2), {s: one_process["dpo"][s] for s in (3, 4)})
    cached = np.load(reference_dir(config(assets, out)) / LOGPS)
    assert np.array_equal(cached, np.load(assets["root"] / "one-dpo" / "reference" / LOGPS), equal_nan=True)
    manifest = reference_dir(config(assets, out)) / "manifest.json"
    written = manifest.stat().st_mtime_ns
    assert sorted(train_in_subprocess(config(assets, out, steps=5))) == [5]
    assert manifest.stat().st_mtime_ns == written


def test_stale_reference_is_computed_again(assets, tmp_path):
    cfg = config(assets, tmp_path / "run", steps=1)
    train_in_subprocess(cfg)
    logps = np.load(reference_dir(cfg) / LOGPS)
    shutil.copytree(assets["pairs"].parent, tmp_path / "data")
    moved = config({**assets, "pairs": tmp_path / "data" / assets["pairs"].name}, tmp_path / "run", steps=1)
    assert load_reference(moved, torch.float32) is None  # other data files: other inputs
    assert load_reference(moved.model_copy(update={"dtype": "fp32"}), torch.bfloat16) is None
    assert np.array_equal(np.load(reference_dir(cfg) / LOGPS), logps, equal_nan=True)


def test_first_step_is_the_objective_of_the_pairs(assets, one_process):
    """Step 1 of one process: all 8 of the first global batch's rows, whose DPO loss is ln 2
    (policy = reference) and whose SimPO and ORPO losses follow from the model's log-probs."""
    from llmflow.train.loop import data_source

    model, _ = load_model(assets["model"], torch.device("cpu"))
    for method in ("simpo", "orpo"):
        cfg = config(assets, assets["root"] / "unused", method)
        samples = data_source(cfg)
        rows = [samples[g] for g in range(cfg.global_batch_size)]
        ids = torch.from_numpy(np.stack([s.input_ids for s in rows]))
        documents = torch.from_numpy(np.stack([s.document_ids for s in rows]))
        targets = torch.from_numpy(np.stack([s.targets for s in rows]))
        full = sequence_targets(ids, documents)
        with torch.no_grad():
            nll = model(ids, labels=full, document_ids=documents, loss_reduction="none")
        count = pair_documents(documents)
        sums = document_sums(-nll, targets != -100, documents, count)
        tokens = document_sums(torch.ones_like(nll), targets != -100, documents, count)
        policy, real = pair_logps(sums, tokens)
        loss = pair_terms(method, PreferenceConfig(), policy, None).losses.mean()
        if method == "orpo":
            chosen = document_sums(nll, full != -100, documents, count)[:, 0::2][real]
            chosen_tokens = document_sums(torch.ones_like(nll), full != -100, documents, count)[:, 0::2][real]
            loss = loss + chosen.sum() / chosen_tokens.sum()
        assert abs(float(loss) - one_process[method][1]) <= TOLERANCE
    assert abs(one_process["dpo"][1] - float(np.log(2))) <= TOLERANCE


def test_reward_accuracy_of_held_out_pairs():
    policy = np.array([[[-2.0, -5.0, 2, 5], [-4.0, -1.0, 4, 2]]], dtype=np.float32)
    reference = np.array([[[-3.0, -3.0, 2, 5], [-3.0, -3.0, 4, 2]]], dtype=np.float32)
    assert reward_accuracy(policy, reference, "dpo", 0.1) == pytest.approx(
        {"reward_accuracy": 0.5, "reward_margin": 0.1 * ((1 + 2) + (-1 - 2)) / 2, "pairs": 2})
    assert reward_accuracy(policy, None, "simpo", 1.0)["reward_accuracy"] == 0.0  # -1 vs -1 and -1 vs -0.5


def test_preference_rows_pair_chosen_with_rejected(assets):
    data = PreferenceDataset(assets["pairs"])
    row = data[0]
    documents = row["document_ids"]
    pairs = data.pairs(0)
    assert pairs >= 1 and set(np.unique(documents[row["targets"] != -100])) == set(range(2 * pairs))


def test_mixture_of_experts_dpo_under_expert_parallelism_matches_one_process(assets, make_hf_model, tmp_path):
    """A tiny Qwen3-MoE (its auxiliary loss trained) aligned by two ranks that split its
    experts (dp=2, ep=2) trains what one process does."""
    import json

    from llmflow.weights.tokenizer_files import copy_tokenizer_files

    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    _, path = make_hf_model("qwen3_moe", vocab_size=vocab, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
                            router_aux_loss_coef=0.05)
    copy_tokenizer_files(assets["model"], path)
    moe = {**assets, "model": path}
    # The auxiliary loss is taken per micro-batch over the ranks' tokens: one process's micro-batch
    # holds what the two ranks' micro-batches hold together.
    want = train_in_subprocess(config(moe, tmp_path / "one", micro_batch_size=4))
    assert_close(run(config(moe, tmp_path / "ep2", ep=2), 2), want)
