"""A model of real size through the finetune-and-eval flow: Qwen2.5-0.5B's exact published
configuration (494M parameters, a 151,936-token vocabulary, tied embeddings, qkv bias), with
random weights saved by transformers' own ``save_pretrained`` in bf16 as the published
model is, and its config.json as published.

The tokenizer is the built-in sample's (its ids are all below the model's vocabulary), so
the flow runs offline on the sample instruction and MMLU data; only the model is real-sized.
The run goes through every stage a user's run does (convert, tokenize, MMLU before,
finetune at dp=2 on two torchrun ranks with FSDP2 over gloo, export, generate, MMLU after,
register), sized down to what two CPU cores can afford: two steps of one 64-token row per
rank, one question per MMLU subject, one prompt. The checks are the ones size breaks: the
first loss of random weights near ln(151936) (the whole vocabulary in the softmax), finite
losses, a complete checkpoint and export, transformers loading the export with llmflow's
logits (fp32, within 1e-5), and the memory every process peaked at (printed; bounded).
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from prefect_helpers import flow_run_logs, mlflow_runs, task_states
from train_helpers import losses

from llmflow.flows.finetune_eval import FinetuneEvalParams, finetune_eval
from llmflow.sample.tokenizer import TOKENIZER_FILES
from llmflow.weights import latest_step_dir, read_meta
from llmflow.weights.dcp import check_dcp_files
from llmflow.weights.training_checkpoint import MODEL_KEY, stored_tensors

# Qwen/Qwen2.5-0.5B's config.json, as published on the Hub.
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
PARAMETERS = 494_032_768
VOCAB = QWEN2_5_0_5B["vocab_size"]
# What this run may take of the machine's 24 GiB, with room left for the system and the test
# process: the sum has measured 13.4-14.3 GiB, most of it two ranks' 6.1-6.4 GiB, whose heap
# keeps freed memory resident (each rank is also held to its memory plan below).
MEMORY_BUDGET_GIB = 16.0


@pytest.fixture(scope="module")
def real_size_model(tmp_path_factory, sample_assets) -> Path:
    """The model directory: random weights of Qwen2.5-0.5B's shape (normal with the config's
    initializer_range, norms one, biases zero, as transformers initialises them) written by
    ``save_pretrained`` in bf16, the published config.json and the sample's tokenizer files."""
    import transformers

    out = tmp_path_factory.mktemp("qwen2.5-0.5b-shaped")
    (out / "config.json").write_text(json.dumps(QWEN2_5_0_5B, indent=2))
    config = transformers.AutoConfig.from_pretrained(out)
    # Built on the meta device and filled here: transformers' own initialisation of 494M
    # parameters takes half a minute on two cores.
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module a tensor of its own
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS
    model.save_pretrained(out)
    del model
    (out / "config.json").write_text(json.dumps(QWEN2_5_0_5B, indent=2))  # as published, not re-serialised
    for name in TOKENIZER_FILES:
        shutil.copyfile(sample_assets() / "model" / name, out / name)
    return out


class MemoryWatch:
    """Peak resident memory of this process (where the flow and its in-process stages run),
    of the training ranks and of torchrun, sampled every ``interval_s`` by a thread; and the
    peak of their sum at one instant."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.peaks: dict[str, float] = {}
        self.peak_total = 0.0
        self.at_peak: dict[str, float] = {}
        """Each process's share of ``peak_total``."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _role(process: psutil.Process, me: psutil.Process) -> str | None:
        if process.pid == me.pid:
            return "flow process"
        arguments = process.cmdline()
        if "torch.distributed.run" in " ".join(arguments):
            return "torchrun"
        if "llmflow.train" in arguments:  # -m llmflow.train: not the test's worker server, which preloads it
            return f"rank pid {process.pid}"
        return None  # the Prefect test server and other helpers are not the run's

    def _watch(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(self.interval_s):
            now: dict[str, float] = {}
            for process in [me, *me.children(recursive=True)]:
                try:
                    role = self._role(process, me)
                    if role is None:
                        continue
                    gib = process.memory_info().rss / 2**30
                except psutil.Error:
                    continue  # ended between listing and reading
                self.peaks[role] = max(self.peaks.get(role, 0.0), gib)
                now[role] = gib
            if sum(now.values()) > self.peak_total:
                self.peak_total, self.at_peak = sum(now.values()), now

    def report(self) -> str:
        rows = [f"  {role}: {gib:.2f} GiB" for role, gib in sorted(self.peaks.items())]
        shares = ", ".join(f"{role} {gib:.2f}" for role, gib in sorted(self.at_peak.items()))
        return "\n".join(["peak RSS:", *rows, f"  at once (sum): {self.peak_total:.2f} GiB ({shares})"])


def manifest_files_present(root: Path) -> dict:
    """The manifest of a stage output, after checking every file it lists is there at its size."""
    manifest = json.loads((root / "manifest.json").read_text())
    for record in manifest["files"]:
        assert (root / record["path"]).stat().st_size == record["size"], record
    return manifest


@pytest.mark.slow
@pytest.mark.timeout(1800)  # under 10 minutes even on 2 busy cores
def test_a_qwen2_5_0_5b_shaped_model_runs_the_finetune_eval_flow(prefect_env, real_size_model, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LLMFLOW_DEVICE", "cpu")
    params = FinetuneEvalParams.model_validate({
        "workspace": str(tmp_path / "ws"),
        "version": "test",
        "model": str(real_size_model),
        "seq_length": 64,
        "train": {"nproc": 2, "steps": 2, "micro_batch_size": 1, "global_batch_size": 2,
                  "optim": {"lr": 1e-5, "min_lr": 1e-6, "warmup_steps": 1}},
        "evaluation": {"limit": 1, "shots": 1},
        "prompts": ["What is the capital of Stavalstan?"],
        "max_new_tokens": 4,
        "registered_model": "real-size",
        "register_min_gain": None,
    })
    start = time.monotonic()
    memory = MemoryWatch()
    memory.start()
    try:
        state = finetune_eval(**dict(params), return_state=True)
    finally:
        memory.stop()
    seconds = time.monotonic() - start
    print(f"\nfinetune_eval on the 0.5B model: {seconds:.0f} s\n{memory.report()}")
    assert state.is_completed(), state.message
    result = state.result()
    states = task_states(state.state_details.flow_run_id)
    assert {name: set(runs) for name, runs in states.items()} == {
        stage: {"Completed"} for stage in ("sample", "convert", "tokenize-instruction", "eval-mmlu", "train", "export",
                                           "infer", "register")
    }

    # Convert: the whole vocabulary (already a multiple of 128: no padding), every file there.
    convert_run, = mlflow_runs(prefect_env, "convert")
    checkpoint = Path(convert_run.data.params["out"])
    converted = manifest_files_present(checkpoint)
    assert (converted["vocab_size"], converted["padded_vocab_size"]) == (VOCAB, VOCAB)

    # Training: finite losses, the first one that of random weights over the whole vocabulary.
    # Weights of std 0.02 against the final norm's unit-RMS output give logits of std ~0.6, so
    # the loss starts a little above ln(vocab) (12.27 and 12.48 seen); a softmax over the wrong
    # vocabulary (the tokenizer's 1.5k entries: ln 1539 = 7.3) would miss by far more.
    steps = losses(flow_run_logs(state.state_details.flow_run_id))
    print(f"losses: {steps}")
    assert sorted(steps) == [1, 2] and all(math.isfinite(loss) for loss in steps.values())
    assert abs(steps[1] - math.log(VOCAB)) < 1.0, steps
    step_dir = latest_step_dir(result["checkpoint"])
    assert step_dir.name == "step_00000002"
    meta = read_meta(step_dir)
    assert (meta.step, meta.layout, meta.padded_vocab_size) == (2, {"pp": 1, "dp": 2, "cp": 1, "tp": 1, "ep": 1}, VOCAB)
    check_dcp_files(step_dir)  # every data file the metadata names, at its size
    stored = stored_tensors(step_dir, MODEL_KEY)
    assert tuple(stored["model.embed_tokens.weight"].size) == (VOCAB, 896)
    assert sum(math.prod(md.size) for name, md in stored.items() if name != "lm_head.weight") == PARAMETERS

    # Export: complete, the published config back (fp32 now), and transformers computes
    # llmflow's logits from it.
    exported = Path(result["model"])
    manifest_files_present(exported)
    config = json.loads((exported / "config.json").read_text())
    assert config["torch_dtype"] == "float32"  # the dtype the weights were written in: the fp32 master weights
    assert {k: config[k] for k in QWEN2_5_0_5B if k != "torch_dtype"} == {
        k: v for k, v in QWEN2_5_0_5B.items() if k != "torch_dtype"}
    assert_transformers_logits(exported)

    # Generation and both evaluations ran on the real-sized model.
    (answer,) = [json.loads(line) for line in (Path(result["answers"]) / "generations.jsonl").open()]
    assert answer["prompt"] == params.prompts[0] and 1 <= answer["generated_tokens"] <= 4
    for run in mlflow_runs(prefect_env, "eval-mmlu"):
        assert run.data.metrics["questions"] == 3  # one per sample subject
    assert 0 <= result["mmlu_before"] <= 1 and 0 <= result["mmlu_after"] <= 1
    assert result["registered"]["source"] == result["model"]

    assert memory.peak_total < MEMORY_BUDGET_GIB, memory.report()
    # Each rank's peak against the memory plan the train stage printed (4.95 GiB, at the end of
    # the backward pass): resident memory is at least the planned tensors and at most 1.4 x
    # them, the rest being each process's own ~0.3 GiB and what glibc's heap keeps of freed
    # memory at its default settings (6.1-6.4 GiB measured; docs/training.md, Memory plan).
    from llmflow.models import ModelConfig
    from llmflow.train.memory import GIB, TrainShape, train_plan

    plan = train_plan(ModelConfig.from_hf(QWEN2_5_0_5B), TrainShape(
        pp=1, dp=2, tp=1, micro_batch_size=1, seq_length=64, dtype_bytes=4, accumulation=1, documents=True))
    ranks = [gib for role, gib in memory.peaks.items() if role.startswith("rank")]
    assert len(ranks) == 2 and all(plan.peak / GIB <= gib <= 1.4 * plan.peak / GIB for gib in ranks), (
        plan.table(), memory.report())


def assert_transformers_logits(model_dir: Path) -> None:
    """transformers' Qwen2ForCausalLM and llmflow's decoder, both fp32 from ``model_dir``,
    give the same logits (max abs difference at most 1e-5) on ids from the whole vocabulary."""
    import transformers

    from llmflow.weights import load_model

    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
        expected = theirs(ids).logits
        del theirs
        ours, _ = load_model(model_dir)
        got = ours(ids)
    difference = (got - expected).abs().max().item()
    print(f"logits: max abs difference {difference:.2e} over {tuple(got.shape)}")
    assert difference <= 1e-5
