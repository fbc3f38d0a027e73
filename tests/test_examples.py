"""The example configs (examples/): every one loads, its layout, batch sizes and pipeline
settings pass the checks ``llmflow train`` makes for its devices (1 node x 8, or N nodes x 8
for a ``-{N}nodes`` config, as the train command in its opening comment says), its memory plan
with the model's published config.json fits a 64 GB device, and examples/README.md's table
is that plan's; a long-sequence config's (``-32k``, context parallel) whole plan, as
``llmflow train`` prints it, is in examples/README.md too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmflow.mesh import ParallelLayout
from llmflow.models import ModelConfig
from llmflow.models.context_parallel import context_parallel_problems
from llmflow.train.config import TrainConfig, load_train_config
from llmflow.train.memory import (
    LOAD,
    MOMENTS,
    MemoryPlan,
    active_params,
    model_params,
    size,
    train_plan,
    train_shape,
)
from llmflow.train.preflight import batch_problems, memory_check, parallel_problems, pipeline_problems

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEVICES_PER_NODE = 8
DEVICE_BYTES = 64 * 10**9
QWEN3_5_9B_TEXT = 8_953_803_264
QWEN3_5_35B_A3B_TEXT = 34_660_610_688
GEMMA_3_27B_TEXT = 27_009_346_304
PUBLISHED_PARAMETERS = {  # the model cards' parameter counts
    "qwen1.5-0.5b": 463_987_712,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3.1-8b": 8_030_261_248,
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,  # "30.5B in total and 3.3B activated"
    # Qwen3.5's text models as llmflow builds them from transformers' documented defaults (the
    # published counts include the vision tower): computed, not a model card's figure.
    "qwen3.5-9b": QWEN3_5_9B_TEXT,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B_TEXT,
    # Gemma 3 27B's text decoder as llmflow builds it (the published count includes the vision tower).
    "gemma-3-27b": GEMMA_3_27B_TEXT,
    # DeepSeek-V3 and GLM-4.5-Air without their multi-token prediction layer (left out on loading):
    # computed, the model cards' 671B (37B activated) and 106B (12B active) rounded.
    "deepseek-v3": 671_026_404_352,
    "glm-4.5-air": 106_852_245_504,
    # The model cards' 1T (32B activated; computed here: 1026.41 B, 32.86 B) and gpt-oss's 20.91 B
    # and 116.83 B total, whose active 3.61 B and 5.13 B leave out the embedding (ours count it).
    "kimi-k2": 1_026_408_209_408,
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
}
KINDS = ("pretrain", "finetune", "lora")
ONE_NODE = {(kind, 1) for kind in KINDS}
BOTH = ONE_NODE | {(kind, 2) for kind in KINDS}
EXAMPLE_SETS = {  # (kind, nodes) of each model's configs
    "qwen1.5-0.5b": ONE_NODE,
    "qwen2.5-0.5b": ONE_NODE,
    "qwen2.5-7b": ONE_NODE | {("dpo", 1)},
    "llama-3.1-8b": ONE_NODE,
    "qwen3-8b": BOTH,
    # Full training holds 16 bytes a parameter (fp32 weights, gradients, AdamW's two moments):
    # 30.5B over 8 devices is 57 GiB of each 59.6 before any activation; it takes 16.
    "qwen3-30b-a3b": {("lora", 1), *((kind, 2) for kind in KINDS)},
    "qwen3.5-9b": ONE_NODE,
    # 35B parameters: the same 16 bytes a parameter leave 8 devices the LoRA example only.
    "qwen3.5-35b-a3b": {("lora", 1)},
    # 27B parameters and a 262,208-token vocabulary whole on every tensor-parallel rank: full
    # training takes 16 devices (tp=8 x dp=2).
    "gemma-3-27b": {("lora", 1), *((kind, 2) for kind in KINDS)},
    # 671B parameters at 16 bytes each for full training: 64 nodes (512 devices), and the 256
    # (2048 devices) of DeepSeek-V3's report; LoRA on 32.
    "deepseek-v3": {("finetune", 64), ("finetune", 256), ("lora", 32)},
    # 107B: full finetuning on 8 nodes (64 devices), LoRA on 2.
    "glm-4.5-air": {("finetune", 8), ("lora", 2)},
    # 1.03T: full finetuning on 96 nodes (768 devices, ep=384), LoRA on 32 (the smallest count,
    # 32 nodes, Kimi K2's report trains on).
    "kimi-k2": {("finetune", 96), ("lora", 32)},
    # 21B: both on one node.
    "gpt-oss-20b": {("finetune", 1), ("lora", 1)},
    # 117B: full finetuning on 8 nodes, LoRA on 2 (its bf16 weights and the 201k-token logits
    # leave one node's devices 61 GiB).
    "gpt-oss-120b": {("finetune", 8), ("lora", 2)},
}
LOAD_PEAKS = {"kimi-k2/lora-32nodes.yaml"}
"""Examples whose peak is loading: Kimi K2's 384 experts of a projection are one stored tensor
(21 GiB in fp32, which DCP reads whole), more than a LoRA step over frozen shards holds."""
LONG = "-32k"
LONG_EXAMPLES = {"qwen2.5-7b": {"finetune"}}
"""The kinds of each model's long-sequence configs (``{kind}-32k.yaml``, 32768 tokens a row)."""
CONFIGS = sorted(EXAMPLES.glob("*/*.yaml"))
COMMAND = re.compile(r"llmflow train --nproc (\d+)(?: --nnodes (\d+))?(?:[^\n]|\\\n#)*? examples/(\S+\.yaml)")


NODES = re.compile(r"-(\d+)nodes$")


def nodes(path: Path) -> int:
    """N for a ``-{N}nodes`` config (N nodes x 8 devices), else 1."""
    found = NODES.search(path.stem)
    return int(found[1]) if found else 1


def devices(path: Path) -> int:
    return DEVICES_PER_NODE * nodes(path)


def kind(path: Path) -> str:
    return NODES.sub("", path.stem).removesuffix(LONG)


def load(path: Path) -> TrainConfig:
    """The config in ``path``, as ``llmflow train`` reads it."""
    return load_train_config(path)


def seq_length(path: Path, config: TrainConfig) -> int:
    """Pretraining: the config's seq_length; sft: the --seq-length of the tokenize command
    the example's comment gives."""
    if config.seq_length is not None:
        return config.seq_length
    return int(re.search(r"--seq-length (\d+)", path.read_text())[1])


def plan(path: Path) -> tuple[TrainConfig, MemoryPlan]:
    config = load(path)
    model = ModelConfig.from_file(path.parent / "config.json")
    shape = train_shape(config, devices(path), seq_length(path, config), "npu")
    return config, train_plan(model, shape, DEVICE_BYTES, "64 GB", name=path.parent.name)


def after_loading(p: MemoryPlan) -> tuple[int, str]:
    """The largest moment once the model is sharded, and which."""
    moment = max((m for m in MOMENTS if m != LOAD), key=p.moment)
    return p.moment(moment), moment


def printed_plan(path: Path) -> str:
    """The plan ``llmflow train --nproc 8 {path} device_memory_gb=64`` prints before launch (on
    CUDA as on Ascend: bf16, fused AdamW)."""
    config = load(path).model_copy(update={"device_memory_gb": 64})
    model = ModelConfig.from_file(path.parent / "config.json")
    plan, _ = memory_check(config, model, devices(path), DEVICES_PER_NODE, "npu", seq_length(path, config),
                           measure=False)
    return plan.table()


def layout(config: TrainConfig, world: int) -> str:
    parts = [f"{name}={value}" for name, value in (("tp", config.tp), ("pp", config.pp), ("cp", config.cp))
             if value > 1]
    dp = ParallelLayout.of_world(world, config.pp, config.tp, config.dp, cp=config.cp).dp
    text = " x ".join(parts + ([f"dp={dp}"] if dp > 1 else []))
    return f"{text}, ep={config.ep}" if config.ep > 1 else text


def parameters(model: ModelConfig) -> str:
    total, active = model_params(model), active_params(model)
    return f"{total / 1e9:.2f} B" + (f" ({active / 1e9:.2f} B active)" if active != total else "")


def table() -> list[str]:
    """examples/README.md's table, from the plans."""
    rows = [("| example | devices | layout | parameters | micro batch x tokens | activation checkpointing | "
             "peak per device | at | after loading |"),
            "|---|---|---|---|---|---|---|---|---|"]
    for path in CONFIGS:
        config, p = plan(path)
        model = ModelConfig.from_file(path.parent / "config.json")
        tokens = seq_length(path, config)
        later, moment = after_loading(p)
        after = f"{size(later)} ({moment})" if p.peak_moment == LOAD else "same"
        rows.append(f"| `{path.relative_to(EXAMPLES)}` | {devices(path)} | {layout(config, devices(path))} | "
                    f"{parameters(model)} | {config.micro_batch_size} x {tokens} | {config.activation_checkpointing} | "
                    f"{size(p.peak)} | {p.peak_moment} | {after} |")
    return rows


def test_every_model_has_its_examples_and_published_config():
    assert {p.parent.name for p in CONFIGS} == set(PUBLISHED_PARAMETERS) == set(EXAMPLE_SETS)
    for name, count in PUBLISHED_PARAMETERS.items():
        assert model_params(ModelConfig.from_file(EXAMPLES / name / "config.json")) == count
        assert {(kind(p), nodes(p)) for p in CONFIGS if p.parent.name == name} == EXAMPLE_SETS[name]
        assert {kind(p) for p in CONFIGS if p.parent.name == name and p.stem.endswith(LONG)} == \
            LONG_EXAMPLES.get(name, set())
    assert {NODES.sub("-Nnodes", p.stem) for p in CONFIGS} <= {f"{k}{s}" for k in (*KINDS, "dpo")
                                                                for s in ("", "-Nnodes", LONG)}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_passes_the_checks_and_fits_64_gb(path):
    config = load(path)
    model = ModelConfig.from_file(path.parent / "config.json")
    world = devices(path)
    dp = ParallelLayout.of_world(world, config.pp, config.tp, config.dp, cp=config.cp).dp
    assert parallel_problems(world, config.tp, config.dp, model, config.pp, config.ep, config.cp) == []
    assert context_parallel_problems(model, config.cp, seq_length(path, config), config.tp, config.cp_algo) == []
    assert (config.cp > 1) == path.stem.endswith(LONG) == (seq_length(path, config) == 32768)
    assert batch_problems(config.global_batch_size, config.micro_batch_size, dp) == []
    assert pipeline_problems(config, dp, model.num_hidden_layers) == []
    ep = config.ep
    if model.num_experts:  # experts split over ep ranks carved out of dp
        assert ep > 1 and dp % ep == 0 and model.num_experts % ep == 0
    else:
        assert ep == 1
    assert (config.lora is not None) == (kind(path) == "lora")
    assert (config.data.kind == "pretrain") == (kind(path) == "pretrain")
    assert (config.method == "dpo") == (config.data.kind == "preference") == (kind(path) == "dpo")
    _, p = plan(path)
    # Each rank loads its shards of the converted checkpoint: loading is the peak only where a
    # stored tensor read whole outweighs the step (LOAD_PEAKS).
    assert p.fits and (p.peak_moment == LOAD) == (str(path.relative_to(EXAMPLES)) in LOAD_PEAKS), p.table()
    text = path.read_text()
    command = COMMAND.search(text)
    assert command, "no llmflow train command for the config"
    assert (int(command[1]), int(command[2] or 1), command[3]) == (DEVICES_PER_NODE, nodes(path),
                                                                  f"{path.parent.name}/{path.name}")
    assert f"--tokenizer workspace/models/{path.parent.name}" in text and "llmflow convert" in text


def test_readme_table_is_the_plan():
    readme = (EXAMPLES / "README.md").read_text().splitlines()
    start = readme.index(table()[0])
    assert readme[start:start + len(CONFIGS) + 2] == table()


def test_readme_shows_the_plan_each_long_sequence_example_prints():
    readme = (EXAMPLES / "README.md").read_text()
    for path in [p for p in CONFIGS if p.stem.endswith(LONG)]:
        assert f"```text\n{printed_plan(path)}\n```" in readme, printed_plan(path)
