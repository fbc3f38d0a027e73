"""``method: grpo`` end to end on the sample model (fp32, CPU, gloo): the sampler's log-probs
are the trainer's, sampling does not depend on the batch a completion is drawn in, data-,
tensor- and expert-parallel ranks train what one process does, and a run killed during a rollout or an
update resumes onto exactly the uninterrupted run.

The rollouts sample for real (temperature 1.0 in training) with a reward that differs
between the completions of a group (``grpo_rewards:parity``, which the reward workers import
by name from ``sys.path``: pytest's ``pythonpath`` puts ``tests/`` on it, and the killed
launches get it through PYTHONPATH). The models end completions at any of ``EARLY_EOS``
besides their own eos ids (their generation_config.json lists them), so that completions of
every length up to ``COMPLETION`` mix with truncated ones in a batch, and the loss types
that normalise by tokens and by completions tell them apart.

bnpo is not compared between layouts: it normalises by the tokens of each rank's
micro-batch (as TRL does, per device), so its loss depends on how completions are split
over the ranks, and is not expected to equal one process's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpo_rewards
import pytest
import torch
from forked_workers import train_forked
from train_helpers import SINGLE_THREAD, TOLERANCE

from llmflow.data.tokenizer import eos_token_ids
from llmflow.train.config import TrainConfig
from llmflow.train.grpo.prompts import read_prompt_rows, render_prompts
from llmflow.train.grpo.rollout import SamplerSettings, sample
from llmflow.train.objectives.grpo import completion_batch, completion_seed
from llmflow.weights import latest_step_dir, load_model
from llmflow.weights.tokenizer_files import copy_tokenizer_files

pytestmark = pytest.mark.slow

SEED = 1234
GENERATIONS = 4
BATCH = 8
"""Completions per optimizer step: 2 prompts x 4 generations."""
COMPLETION = 10
"""max_completion_length."""
STEPS = 5
"""Two generations: steps 1-4 train generation 0 (steps_per_generation 2 x num_iterations 2),
step 5 generation 1."""
PER_GENERATION = 4
"""Steps one generation serves: steps_per_generation x num_iterations."""
EARLY_EOS = list(range(101, 860, 9))
"""Ids that also end a completion (about one token in ten of the untrained sample model)."""
ADAM_EPS = 1e-4
"""AdamW's epsilon: at the default 1e-8 Adam's first steps move an element by about the
learning rate whatever its gradient's size, so the float32 noise of a gradient near zero
(two layouts add the ranks' shares in another order) moves it by 1e-5 or more."""
LOGP_ATOL = 1e-5
STEP_LINE = re.compile(r"^step (\d+)/\d+ \| (.*)")
COMPARED = {"loss": TOLERANCE, "grad_norm": 1e-4}
"""Step-line fields compared between layouts (the gradient norm is printed to 4 decimals)."""
RECORD_FIELDS = {"generation", "steps", "completion", "where", "prompt", "completion_ids", "text", "rewards",
                 "reward", "advantage", "truncated", "length"}


def ending_early(model: Path, eos: list[int]) -> Path:
    """``model`` whose generation_config.json ends completions at ``EARLY_EOS`` too."""
    path = model / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**generation, "eos_token_id": [*eos, *EARLY_EOS]}))
    return model


def ending_ids(model: Path) -> tuple[int, ...]:
    """The ids that end a completion of ``model`` (its generation_config.json's eos ids)."""
    return tuple(eos_token_ids(model, json.loads((model / "config.json").read_text())))


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory) -> dict[str, Path]:
    """The sample model (ending early) and its RL prompts."""
    sample = sample_assets()
    root = tmp_path_factory.mktemp("grpo-training")
    model = root / "model"
    shutil.copytree(sample / "model", model)
    ending_early(model, list(ending_ids(sample / "model")))
    return {"root": root, "model": model, "prompts": sample / "rl" / "rl_train.jsonl"}


@pytest.fixture(scope="module")
def moe_model(assets, make_hf_model) -> Path:
    """A tiny Qwen3-MoE over the sample's vocabulary and tokenizer (ending early), four
    experts, two per token."""
    hf = json.loads((assets["model"] / "config.json").read_text())
    _, path = make_hf_model("qwen3_moe", vocab_size=hf["vocab_size"], num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    copy_tokenizer_files(assets["model"], path)
    return ending_early(path, [hf["eos_token_id"]])


def grpo_config(assets, out: Path, loss_type: str = "dapo", **overrides) -> TrainConfig:
    """A GRPO run of ``STEPS`` steps over the sample prompts; ``overrides`` replace top-level settings."""
    return TrainConfig.model_validate({
        "model": str(assets["model"]), "out": str(out), "method": "grpo",
        "data": {"kind": "prompts", "paths": [str(assets["prompts"])]}, "steps": STEPS, "seed": SEED,
        "micro_batch_size": 4, "global_batch_size": BATCH, "log_interval": 1, "save_interval": 1,
        "optim": {"lr": 5e-3, "decay": "constant", "warmup_steps": 0, "eps": ADAM_EPS},
        "rl": {"loss_type": loss_type, "num_generations": GENERATIONS, "num_iterations": 2, "steps_per_generation": 2,
               "max_completion_length": COMPLETION, "temperature": 1.0, "template": "chatml", "reward_workers": 1,
               "rewards": [{"function": "grpo_rewards:parity"}]},
        **overrides,
    })


def step_fields(lines: list[str]) -> dict[int, dict[str, str]]:
    """Every field of every step line (``name value``), by step."""
    steps = {}
    for line in lines:
        if match := STEP_LINE.match(line):
            steps[int(match[1])] = dict(field.split(" ", 1) for field in match[2].split(" | "))
    return steps


def train(cfg: TrainConfig, nproc: int = 1) -> dict[int, dict[str, str]]:
    """``cfg`` trained on ``nproc`` forked gloo ranks, single-threaded; its step lines' fields."""
    return step_fields(train_forked(cfg, nproc, env=SINGLE_THREAD))


def assert_same_steps(got: dict[int, dict[str, str]], want: dict[int, dict[str, str]]) -> None:
    """The compared fields of every step of ``got`` within tolerance of ``want``'s."""
    assert got and set(got) <= set(want)
    for step, fields in got.items():
        for name, tolerance in COMPARED.items():
            assert abs(float(fields[name]) - float(want[step][name])) <= tolerance, (step, name, fields, want[step])


def records(out: Path, generation: int) -> list[dict]:
    """The rollouts' record of ``generation`` in run directory ``out``."""
    path = Path(out) / "rollouts" / f"generation_{generation:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def weights(out: Path) -> dict[str, torch.Tensor]:
    """The trained weights of the latest checkpoint in ``out``."""
    return load_model(out)[0].state_dict()


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture
def one_thread():
    """torch on one thread for the test (a few small forwards: faster than two threads on a
    busy machine, and the reductions' order fixed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_process(assets):
    """``one_process(loss_type)``: the one-process run of ``grpo_config`` (run once per module)."""
    runs: dict[str, tuple[Path, dict[int, dict[str, str]]]] = {}

    def reference(loss_type: str) -> tuple[Path, dict[int, dict[str, str]]]:
        if loss_type not in runs:
            out = assets["root"] / f"one-{loss_type}"
            runs[loss_type] = out, train(grpo_config(assets, out, loss_type))
        return runs[loss_type]

    return reference


# --- the sampler ----------------------------------------------------------------------------------


@pytest.mark.parametrize("filtering", [{"top_p": 1.0, "top_k": 0}, {"top_p": 0.9, "top_k": 50}],
                         ids=["unfiltered", "top-p-top-k"])
def test_sampler_log_probs_are_the_trainers_and_do_not_depend_on_the_batch(assets, one_thread, filtering):
    """Eight prompts (rendered with the tokenizer's own template) sampled one at a time and as
    one left-padded batch of 8 at temperature 0.7: the same completions (each seeded on its
    own), and every sampled token's log-prob as the trainer's forward scores it at that
    temperature (before top-p/top-k filtering, the distribution the loss scores), in fp32."""
    model, hf = load_model(assets["model"])
    model.eval()
    rows = read_prompt_rows(assets["prompts"])[:8]
    prompts = render_prompts(rows, assets["model"], "tokenizer")
    settings = SamplerSettings(max_new_tokens=12, temperature=0.7, eos_token_ids=ending_ids(assets["model"]),
                               vocab_size=hf["vocab_size"], **filtering)
    seeds = [completion_seed(SEED, 0, c) for c in range(len(prompts))]
    together = sample(model, prompts, seeds, settings)
    alone = [sample(model, [prompt], [seed], settings) for prompt, seed in zip(prompts, seeds, strict=True)]
    assert [one.tokens[0] for one in alone] == together.tokens
    assert [one.truncated[0] for one in alone] == together.truncated
    assert 0 < sum(together.truncated) < len(prompts), "no mix of ended and truncated completions"
    for i, one in enumerate(alone):
        assert_scored_alike(model, [prompts[i]], one.tokens, one.logps, settings.temperature)
    assert_scored_alike(model, prompts, together.tokens, together.logps, settings.temperature)


@torch.no_grad()
def assert_scored_alike(model, prompts: list[list[int]], completions: list[list[int]], logps: list[list[float]],
                        temperature: float) -> None:
    """The trainer's log-prob of every completion token (its forward over the completion
    batch) within ``LOGP_ATOL`` of the sampler's."""
    batch = completion_batch(prompts, completions)
    nll = model(batch["input_ids"], labels=batch["targets"], position_ids=batch["position_ids"],
                document_ids=batch["document_ids"], loss_reduction="none", temperature=temperature)
    for i, sampled in enumerate(logps):
        scored = -nll[i][batch["targets"][i] != -100]
        assert len(scored) == len(sampled) == len(completions[i])
        torch.testing.assert_close(scored, torch.tensor(sampled), atol=LOGP_ATOL, rtol=0)


# --- layouts ----------------------------------------------------------------------------------------


def test_the_rollouts_record_every_completion_and_the_step_lines_their_rewards(assets, one_process):
    """generation_000000.jsonl: one record per completion of the generation batch (8 x 2
    steps), its reward the parity reward of its ids, its advantage normalised in its group."""
    out, steps = one_process("dapo")
    assert sorted(steps) == list(range(1, STEPS + 1))
    for fields in steps.values():
        assert {"reward", "reward_std", "completion_len", "clip_region"} <= fields.keys()
    assert any(float(fields["clip_region"]) > 0 for fields in steps.values()), "no ratio was clipped"
    first = records(out, 0)
    assert [r["completion"] for r in first] == list(range(BATCH * 2))
    eos = ending_ids(assets["model"])
    for r in first:
        assert r.keys() == RECORD_FIELDS and r["generation"] == 0 and r["steps"] == [1, PER_GENERATION]
        assert r["length"] == len(r["completion_ids"]) <= COMPLETION
        assert r["truncated"] == (r["completion_ids"][-1] not in eos)
        assert r["rewards"] == {"grpo_rewards:parity": grpo_rewards.parity([], [], [r["completion_ids"]])[0]}
        assert r["reward"] == pytest.approx(r["rewards"]["grpo_rewards:parity"], abs=1e-6)  # summed in fp32
    assert len({r["length"] for r in first}) > 2 and any(r["truncated"] for r in first)
    for g in range(0, len(first), GENERATIONS):
        assert abs(sum(r["advantage"] for r in first[g:g + GENERATIONS])) < 1e-5
    assert float(steps[1]["reward"]) == pytest.approx(sum(r["reward"] for r in first) / len(first), abs=1e-4)
    assert (out / "rollouts" / "generation_000001.jsonl").is_file()


LAYOUTS = {"dp2": {"dp": 2, "micro_batch_size": 2}, "tp2": {"tp": 2}}
"""Two ranks: each sampling and training half of every micro-batch, or both sampling and
training all of it with the heads and feed-forward columns split between them (the residual
stream split along the sequence)."""


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_two_ranks_train_what_one_process_does(assets, one_process, tmp_path, loss_type, layout):
    """dp=2 or tp=2: the same completions, rewards and advantages as one process, the same
    losses and gradient norms, and the same weights after the 5 steps (clipping on the steps
    after the first of a generation)."""
    out, want = one_process(loss_type)
    got = train(grpo_config(assets, tmp_path / layout, loss_type, **LAYOUTS[layout]), nproc=2)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_same_steps(got, want)
    for generation in (0, 1):
        assert records(tmp_path / layout, generation) == records(out, generation)
    assert_same_weights(weights(tmp_path / layout), weights(out), atol=1e-5)


def test_expert_parallel_ranks_train_what_one_process_does(assets, moe_model, tmp_path):
    """A Qwen3-MoE at dp=2 x ep=2 on two ranks (each holding two of the four experts, the
    tokens exchanged by all-to-all while sampling too): dapo's losses, rollouts and weights
    of one process.

    Without the load-balancing auxiliary loss (the model's config.json does not ask for it):
    that loss counts every routed token, the padding of a micro-batch's completions too,
    whose amount depends on how the completions are split over the ranks, so with it the
    two layouts differ (by 3e-3 in step 1's moe_aux_loss)."""
    moe = {**assets, "model": moe_model}
    one = train(grpo_config(moe, tmp_path / "one"))
    ep = train(grpo_config(moe, tmp_path / "ep", dp=2, ep=2, micro_batch_size=2), nproc=2)
    assert sorted(ep) == sorted(one) == list(range(1, STEPS + 1))
    assert_same_steps(ep, one)
    for generation in (0, 1):
        assert records(tmp_path / "ep", generation) == records(tmp_path / "one", generation)
    assert_same_weights(weights(tmp_path / "ep"), weights(tmp_path / "one"), atol=1e-5)


def test_a_run_resumed_inside_a_generation_on_another_layout_samples_it_again(assets, tmp_path):
    """Stopped at step 2 (inside generation 0) by one process, resumed by two data-parallel
    ranks, and the other way round: the saved buffers hold another layout's completions (one
    rank's held all of them, or half), so every rank samples generation 0 again, from the
    step-2 weights, and both directions train alike."""
    layouts = {1: {}, 2: {"dp": 2, "micro_batch_size": 2}}
    resumed = {}
    for first, then in ((1, 2), (2, 1)):
        out = tmp_path / f"{first}-then-{then}"
        train(grpo_config(assets, out, steps=2, **layouts[first]), nproc=first)
        lines = train_forked(grpo_config(assets, out, **layouts[then]), then, env=SINGLE_THREAD)
        assert "rollouts: no buffer of generation 0 for this layout; sampling it again" in lines
        resumed[first] = step_fields(lines)
    assert sorted(resumed[1]) == sorted(resumed[2]) == list(range(3, STEPS + 1))
    assert_same_steps(resumed[1], resumed[2])


# --- SIGKILL and resume -----------------------------------------------------------------------------

KILLS = {
    "rollout": 4,
    "update": 2,
}
"""Where the run is killed: right after the checkpoint of this step is saved. After step 4
generation 1's rollout runs (step 5 starts it); after step 2 step 3 updates on generation 0
(its second pass), which the resumed run must read back from the rollouts' buffer."""


def kill_after_saving(cfg: TrainConfig, step: int, tmp_path: Path) -> None:
    """``python -m llmflow.train`` of ``cfg``, killed (SIGKILL) as soon as it says it saved step
    ``step``'s checkpoint."""
    path = tmp_path / "run.json"
    path.write_text(cfg.model_dump_json())
    tests = str(Path(__file__).parent)
    env = {**os.environ, **SINGLE_THREAD, "LLMFLOW_DEVICE": "cpu", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "llmflow.train", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    before = []
    with proc.stdout:
        for line in proc.stdout:
            before.append(line)
            if line.startswith("saved checkpoint") and line.rstrip().endswith(f"step_{step:08d}"):
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(before)


@pytest.mark.parametrize("during", KILLS)
def test_a_run_killed_during_a_rollout_or_an_update_resumes_exactly(assets, one_process, tmp_path, during):
    """Killed during generation 1's rollout (no record of it written yet) or during step 3's
    update (generation 0's second pass), the rerun resumes from the last checkpoint and
    trains exactly what the uninterrupted run did: the same step losses, the same rollouts
    record and bitwise the same weights."""
    reference, want = one_process("dapo")
    cfg = grpo_config(assets, tmp_path / "run")
    saved = KILLS[during]
    kill_after_saving(cfg, saved, tmp_path)
    out = Path(cfg.out)
    assert latest_step_dir(out).name == f"step_{saved:08d}"
    rollouts = out / "rollouts"
    assert not (rollouts / "generation_000001.jsonl").is_file()
    if during == "update":
        assert (rollouts / "generation_000000.rank00000.pt").is_file()

    lines = train_forked(cfg, 1, env=SINGLE_THREAD)
    assert not [line for line in lines if line.startswith("rollouts: no buffer")]
    got = step_fields(lines)
    assert sorted(got) == list(range(saved + 1, STEPS + 1))
    assert all(got[s]["loss"] == want[s]["loss"] and got[s]["grad_norm"] == want[s]["grad_norm"] for s in got)
    for generation in (0, 1):
        assert records(out, generation) == records(reference, generation)
    assert_same_weights(weights(out), weights(reference), atol=0.0)
