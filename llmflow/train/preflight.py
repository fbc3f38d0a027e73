"""Checks of a training config made before any worker starts: by ``llmflow train`` and by
the flows' train stage alike (both call ``check_training`` before they open their MLflow
run or the run directory), and piece by piece by the flows before their expensive stages.

Every problem is collected and reported at once, one line each, in a ``PreflightError``
(a ValueError, so the CLI prints it without a traceback):

- the parallel layout against the model (heads, KV heads, FFN width, layers) and nproc;
- the batch sizes against the data-parallel degree;
- the pipeline settings: schedule, virtual stages, layers per stage, micro-batches;
- the model and the data exist; the data's vocabulary (from its tokenize manifest) fits
  the model's embedding;
- enough devices of the type the workers will use;
- the per-device memory plan (``llmflow.train.memory``) against the device's memory: printed
  before every launch, and a plan that does not fit is refused with its largest term and the
  single changes of layout or settings that would make it fit;
- a run directory that already holds checkpoints is resumed only with the settings its
  weights depend on (``WEIGHT_SETTINGS``); the layout and a larger ``steps`` may change.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from llmflow import runtime
from llmflow.artifacts import MANIFEST, read_manifest, write_json_atomic
from llmflow.data.tokenize_instruction import STAGE as INSTRUCTION_STAGE
from llmflow.data.tokenize_preference import STAGE as PREFERENCE_STAGE
from llmflow.data.tokenize_pretrain import STAGE as PRETRAIN_STAGE
from llmflow.mesh import ParallelLayout, layout_problems, product
from llmflow.models import LoraConfig, ModelConfig
from llmflow.models.context_parallel import context_parallel_problems, sequence_split_problems
from llmflow.train.config import TrainConfig
from llmflow.train.data import pretrain_prefix
from llmflow.train.grpo.checks import longest_sequence, rl_problems
from llmflow.train.memory import (
    DEVICE_MEMORY_ENV,
    MemoryPlan,
    device_memory,
    refusal,
    suggestions,
    train_plan,
    train_shape,
)
from llmflow.train.objectives import objective_for
from llmflow.train.routing import aux_loss_coefficient
from llmflow.weights import hf_config_of, is_checkpoint, latest_step_dir, read_meta, resolve_step_dir

CONFIG_NAME = "train_config.json"
"""The resolved config of the run, in its run directory (written at every launch)."""

INPUTS_NAME = "train_inputs.json"
"""Fingerprints of the run's model and data content, in its run directory: a model or
dataset rewritten in place is another input, though its path is the same."""

WEIGHT_SETTINGS = ("model", "data", "method", "preference", "rl", "optim", "lora", "seed", "seq_length", "dtype",
                   "global_batch_size", "router_aux_loss_coef", "router_bias_update_rate", "router_seq_aux_loss_coef")
"""Settings the trained weights depend on: a run directory holding checkpoints resumes
only with the same values. Every other setting (pp, tp, dp, nproc, micro_batch_size, the
pipeline schedule and split, activation_checkpointing, compile, logging and saving) may
change between launches, and ``steps`` may grow (a continuation)."""


class PreflightError(ValueError):
    """A training config that cannot run; ``problems`` lists every reason, one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        super().__init__(f"{count} found before launch, nothing was started:\n" + "\n".join(f"  - {p}" for p in problems))


def parallel_problems(nproc: int, tp: int, dp: int | None = None, model: ModelConfig | None = None, pp: int = 1,
                      ep: int = 1, cp: int = 1) -> list[str]:
    """Every reason ``nproc`` ranks cannot split ``pp`` stages by ``cp * tp`` ways (and ``dp``
    ways, default nproc / (pp * cp * tp), of which ``ep`` share out the experts) for
    ``model``; empty when they can."""
    layout = ParallelLayout.of_world(nproc, pp, tp, dp, ep, cp)
    if dp is None and nproc % (pp * cp * tp):
        # The layout's own world-size complaint would say the same thing again.
        factors = [(name, value) for name, value in (("pp", pp), ("cp", cp), ("tp", tp)) if value > 1 or name == "tp"]
        return [f"nproc={nproc} is not a multiple of {product(factors)}", *layout_problems(layout, layout.world_size, model)]
    return layout_problems(layout, nproc, model)


def batch_problems(global_batch_size: int, micro_batch_size: int, dp: int) -> list[str]:
    """Why the global batch cannot be cut into micro-batches over ``dp`` ranks, if it cannot."""
    if global_batch_size % (micro_batch_size * dp):
        return [(
            f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size * dp = "
            f"{micro_batch_size} * {dp}"
        )]
    return []


class PipelineSettings(Protocol):
    """The settings a pipeline layout is checked by (TrainConfig's, and the flows' TrainParams)."""

    pp: int
    pp_schedule: str
    virtual_stages: int | None
    num_layer_list: list[int] | None
    microbatches: int | None
    micro_batch_size: int
    global_batch_size: int


def pipeline_problems(config: PipelineSettings, dp: int, num_layers: int | None) -> list[str]:
    """Why ``config``'s pipeline settings cannot run with ``dp`` data-parallel ranks on a model
    of ``num_layers`` layers (None: unknown), if they cannot."""
    pp, schedule, virtual, layer_list = config.pp, config.pp_schedule, config.virtual_stages, config.num_layer_list
    problems = []
    if pp == 1:
        if virtual is not None or layer_list is not None:
            given = "virtual_stages" if virtual is not None else "num_layer_list"
            problems.append(f"{given} splits pipeline stages, but pp=1; set pp > 1 or leave {given} out")
        return problems
    if schedule == "Interleaved1F1B" and virtual is None:
        problems.append("pp_schedule Interleaved1F1B needs virtual_stages (model chunks per rank, at least 2)")
    if schedule != "Interleaved1F1B" and virtual is not None:
        problems.append(f"virtual_stages={virtual} needs pp_schedule Interleaved1F1B ({schedule} runs one stage per rank)")
    stages = pp * (virtual or 1)
    what = f"pp={pp}" if virtual is None else f"pp * virtual_stages = {pp}*{virtual} = {stages}"
    if layer_list is not None:
        if len(layer_list) != stages:
            problems.append(f"num_layer_list has {len(layer_list)} entries for {what} stages; give one per stage")
        elif min(layer_list) < 1:
            problems.append(f"num_layer_list {layer_list}: every stage needs at least one layer")
        elif num_layers is not None and sum(layer_list) != num_layers:
            problems.append(f"num_layer_list {layer_list} sums to {sum(layer_list)} layers but the model has {num_layers}")
    elif num_layers is not None and virtual is not None and stages > num_layers:
        problems.append(f"{what} stages but the model has {num_layers} layers; each stage needs one")
    if not batch_problems(config.global_batch_size, config.micro_batch_size, dp):
        count = config.global_batch_size // (config.micro_batch_size * dp)
        formula = f"global_batch_size / (micro_batch_size * dp) = {config.global_batch_size} / ({config.micro_batch_size} * {dp}) = {count}"
        if config.microbatches is not None and config.microbatches != count:
            problems.append(f"microbatches={config.microbatches} but {formula}; they must be equal")
        elif schedule == "1F1B" and count < pp:
            problems.append(f"pp_schedule 1F1B needs at least pp={pp} micro-batches per step, but {formula}")
        elif schedule == "Interleaved1F1B" and count % pp:
            problems.append(f"pp_schedule Interleaved1F1B needs micro-batches per step in multiples of pp={pp}, but {formula}")
    return problems


def device_problems(nproc: int, device_type: str | None = None) -> list[str]:
    """Why ``nproc`` workers cannot each have a device of ``device_type`` (default: the
    detected or LLMFLOW_DEVICE-forced type) on this machine, if they cannot."""
    try:
        device_type = runtime.device_spec(device_type).type
    except ValueError as error:
        return [str(error)]
    try:
        available = runtime.device_count(device_type)
    except (RuntimeError, AttributeError):  # torch_npu absent: torch has no npu module
        available = 0
    if available is not None and nproc > available:
        return [f"nproc={nproc} but this machine has {available} {device_type} device(s)"]
    return []


def model_problems(model: Path) -> tuple[ModelConfig | None, list[str]]:
    """The model's config, or the reason it cannot be read."""
    if not is_checkpoint(model) and not (model / "config.json").is_file():
        return None, [f"model {model}: neither a Hugging Face model directory (config.json) nor a checkpoint (latest)"]
    try:
        return ModelConfig.from_hf(hf_config_of(model), source=str(model)), []
    except (ValueError, OSError) as error:
        return None, [f"model {model}: {error}"]


def _data_manifest(path: str, kind: str) -> tuple[dict[str, Any] | None, str | None]:
    """The tokenize manifest of one data path, or why the data is not there."""
    if kind != "pretrain":
        stage, what = (INSTRUCTION_STAGE, "instruction") if kind == "sft" else (PREFERENCE_STAGE, "preference")
        manifest = read_manifest(path)
        if manifest is None or manifest.get("stage") != stage:
            return None, f"data {path}: no finished {what} dataset ({path}.manifest.json from {stage})"
        return manifest, None
    prefix = pretrain_prefix(path)
    missing = [f for f in (Path(f"{prefix}.bin"), Path(f"{prefix}.idx")) if not f.is_file()]
    if missing:
        return None, f"data {path}: no pretraining dataset ({missing[0]} does not exist)"
    manifest = read_manifest(str(prefix).removesuffix("_text_document"))
    return (manifest if manifest is not None and manifest.get("stage") == PRETRAIN_STAGE else None), None


def data_problems(config: TrainConfig, model: ModelConfig | None) -> list[str]:
    """Why the data cannot train the model: missing datasets, a vocabulary larger than the
    model's (from the tokenize manifest), too few tokens for one sample; for prompts (grpo)
    the file's rows, prompts too long for a completion, rewards that do not import."""
    if config.data.kind == "prompts":
        return rl_problems(config.rl, config.data.paths[0], config.model, model)
    problems = []
    if config.data.kind == "pretrain" and config.seq_length is None:
        problems.append("seq_length is required for pretraining")
    for path in config.data.paths:
        manifest, problem = _data_manifest(path, config.data.kind)
        if problem is not None:
            problems.append(problem)
        if manifest is None:
            continue  # data from elsewhere: the workers check every id against the model
        vocab = manifest.get("vocab_size")
        if model is not None and vocab is not None and vocab > model.vocab_size:
            tokenizer = manifest.get("params", {}).get("tokenizer")
            problems.append(
                f"data {path} was tokenized for a vocabulary of {vocab} ids (tokenizer {tokenizer}), but model "
                f"{config.model} has vocab_size {model.vocab_size}; tokenize the data with the model's tokenizer"
            )
        tokens = manifest.get("tokens")
        if config.data.kind == "pretrain" and config.seq_length and tokens is not None and tokens - 1 < config.seq_length:
            problems.append(f"data {path}: {tokens} tokens cannot fill one sample of seq_length {config.seq_length} + 1")
    return problems


def weight_settings(config: TrainConfig) -> dict[str, Any]:
    """The settings of ``config`` the weights depend on, paths resolved, flattened to
    dotted names (``optim.lr``)."""
    resolved = recorded_config(config).model_dump(mode="json", include=set(WEIGHT_SETTINGS))
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        else:
            flat[prefix] = value

    walk("", resolved)
    return flat


def recorded_config(config: TrainConfig) -> TrainConfig:
    """``config`` with its model and data paths made absolute: what the run directory records."""
    data = config.data.model_copy(update={"paths": [str(Path(p).resolve()) for p in config.data.paths]})
    return config.model_copy(update={"model": Path(config.model).resolve(), "data": data})


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _file_stats(directory: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (p.name, st.st_size, st.st_mtime_ns) for p in directory.iterdir() if p.is_file() and p.name != MANIFEST
        for st in [p.stat()]
    )


def _model_fingerprint(model: Path) -> str | None:
    """What the model's content is known by, without reading its weights: the file records
    of the manifest of the stage that wrote it (download, convert: what the flows name their
    run directories by); else, as the stages' cache keys, the names, sizes and modification
    times of its files (of its step directory for a checkpoint)."""
    try:
        manifest = read_manifest(model)
        if manifest is not None and "files" in manifest:
            return _digest(manifest["files"])
        if is_checkpoint(model):
            step_dir = resolve_step_dir(model)
            return _digest([step_dir.name, _file_stats(step_dir)])
        return _digest(_file_stats(model))
    except (OSError, ValueError):
        return None


def input_fingerprints(config: TrainConfig) -> dict[str, str | None]:
    """Fingerprints of the model and of every dataset (its tokenize manifest's file records,
    sha256 included; None for data without a manifest)."""
    fingerprints = {f"model {config.model}": _model_fingerprint(Path(config.model))}
    for path in config.data.paths:
        manifest, _ = _data_manifest(path, config.data.kind)
        fingerprints[f"data {path}"] = _digest(manifest["files"]) if manifest and "files" in manifest else None
    return fingerprints


def record_run(config: TrainConfig) -> Path:
    """Write the run's resolved config (CONFIG_NAME) and its inputs' fingerprints
    (INPUTS_NAME) into its run directory; returns the config's path."""
    out = Path(config.out)
    recorded = recorded_config(config)
    write_json_atomic(out / INPUTS_NAME, input_fingerprints(recorded))
    return write_json_atomic(out / CONFIG_NAME, recorded.model_dump(mode="json"))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def resume_problems(config: TrainConfig, model: ModelConfig | None) -> list[str]:
    """Why the checkpoints in ``config.out`` cannot continue under ``config``: settings the
    weights depend on that differ from the run's record (CONFIG_NAME, INPUTS_NAME) or from
    the checkpoint's own (model shape, LoRA), or fewer steps than the checkpoint has taken."""
    out = Path(config.out)
    try:
        step_dir = latest_step_dir(out) if out.is_dir() else None
        meta = read_meta(step_dir) if step_dir is not None else None
    except ValueError as error:
        return [f"run directory {out}: {error}"]
    if meta is None:
        return []
    problems = []
    if config.steps < meta.step:
        problems.append(
            f"steps={config.steps} but run directory {out} already holds step {meta.step}: a run continues, "
            "it cannot go back (choose another out)"
        )
    differing: dict[str, str] = {}
    lora = config.lora.model_dump(mode="json") if config.lora is not None else None
    if (meta.lora is None) != (lora is None) or (lora is not None and not _same_lora(meta.lora, lora, model)):
        differing["lora"] = f"lora {meta.lora!r} -> {lora!r}"
    if model is not None and ModelConfig.from_hf(meta.hf_config) != model:
        differing["model"] = f"model: the config.json of {config.model} is not the one the checkpoints were trained from"
    try:
        saved = TrainConfig.model_validate_json((out / CONFIG_NAME).read_text())
    except (OSError, ValidationError):
        saved = None  # a run started without launch_training: the checkpoint's record only
    if saved is not None:
        before, now = weight_settings(saved), weight_settings(config)
        for name in sorted(before.keys() | now.keys()):
            if name == "lora.target_modules" and _same_targets(before.get(name), now.get(name), model):
                continue
            if before.get(name) != now.get(name) and name.split(".")[0] not in differing:
                differing[name] = f"{name} {before.get(name)!r} -> {now.get(name)!r}"
    recorded = _read_json(out / INPUTS_NAME)
    if isinstance(recorded, dict):
        for name, fingerprint in input_fingerprints(recorded_config(config)).items():
            old = recorded.get(name)
            if old is not None and fingerprint is not None and old != fingerprint and name.split(" ")[0] not in differing:
                differing[name.split(" ")[0]] = f"{name}: its content changed since the checkpoints were made"
    if differing:
        problems.append(
            f"run directory {out} holds checkpoints (step {meta.step}) trained with other settings the weights "
            f"depend on: {'; '.join(differing.values())}. Resume with the run's settings, or choose another out"
        )
    return problems


def _same_lora(before: dict[str, Any], now: dict[str, Any], model: ModelConfig | None) -> bool:
    """Whether two recorded LoRA settings train the same adapters of ``model``: equal but for
    target lists that adapt the same modules (a run recorded with an older default list
    resumes under the current default) and for settings recorded before they existed, read
    as their defaults (``target_parameters``)."""
    rest = [{k: v for k, v in LoraConfig.model_validate(settings).model_dump().items() if k != "target_modules"}
            for settings in (before, now)]
    return rest[0] == rest[1] and _same_targets(before.get("target_modules"), now.get("target_modules"), model)


def _same_targets(before: list[str] | None, now: list[str] | None, model: ModelConfig | None) -> bool:
    if before == now:
        return True
    if before is None or now is None or model is None:
        return False
    import torch

    from llmflow.models import CausalLM
    from llmflow.models.lora import adapted_modules

    with torch.device("meta"):
        built = CausalLM(model)
    return adapted_modules(built, before) == adapted_modules(built, now)


def settings_problems(config: TrainConfig, world: int, model: ModelConfig | None) -> list[str]:
    """Every reason ``config``'s layout, batch sizes and pipeline settings cannot run on
    ``world`` ranks for ``model``."""
    problems = parallel_problems(world, config.tp, config.dp, model, config.pp, config.ep, config.cp)
    dp = ParallelLayout.of_world(world, config.pp, config.tp, config.dp, cp=config.cp).dp
    seq_length = training_seq_length(config)
    if model is not None:
        problems += context_parallel_problems(model, config.cp, seq_length, config.tp, config.cp_algo)
    elif seq_length is not None:
        problems += sequence_split_problems(seq_length, config.cp, config.cp_algo)
    problems += batch_problems(config.global_batch_size, config.micro_batch_size, dp)
    problems += moe_problems(config, model)
    problems += objective_for(config.method).problems(config, ParallelLayout.of_world(
        world, config.pp, config.tp, config.dp, cp=config.cp), model) if not problems else []
    return problems + pipeline_problems(config, dp, model.num_hidden_layers if model is not None else None)


def moe_problems(config: TrainConfig, model: ModelConfig | None) -> list[str]:
    """Why ``config`` cannot train the mixture of experts ``model`` (empty when it can)."""
    if model is None:
        return []
    problems = routing_option_problems(config, model)
    if not model.num_experts or config.pp == 1:
        return problems
    coef = aux_loss_coefficient(config.router_aux_loss_coef, model.hf_config)
    if coef:
        problems.append(f"router_aux_loss_coef={coef}: a mixture of experts' auxiliary loss is not trained under "
                        f"pp={config.pp}; set router_aux_loss_coef=0 (the default unless config.json sets "
                        "output_router_logits), or pp=1")
    return problems


def routing_option_problems(config: TrainConfig, model: ModelConfig) -> list[str]:
    """Why ``model`` cannot train with the auxiliary-loss-free bias update or the
    sequence-wise auxiliary loss ``config`` asks for (the training loop applies both with
    the routing log, which pipeline stages do not keep)."""
    problems = []
    rate, seq_coef = config.router_bias_update_rate, config.router_seq_aux_loss_coef
    if rate and model.router_scoring != "sigmoid":
        problems.append(f"router_bias_update_rate={rate}: {model.model_type} has no router correction bias "
                        "(e_score_correction_bias) to update; set it to 0")
    if rate and config.lora is not None:
        problems.append(f"router_bias_update_rate={rate} with lora: a LoRA checkpoint stores only the adapters, "
                        "not the updated biases; set it to 0")
    if seq_coef and not model.num_experts:
        problems.append(f"router_seq_aux_loss_coef={seq_coef}: {model.model_type} has no experts; set it to 0")
    for key, value in (("router_bias_update_rate", rate), ("router_seq_aux_loss_coef", seq_coef)):
        if value and config.pp > 1:
            problems.append(f"{key}={value} is not supported under pp={config.pp}; set it to 0, or pp=1")
    return problems


def training_seq_length(config: TrainConfig) -> int | None:
    """Tokens per sample: ``seq_length`` for pretraining, the tokenized dataset's (its
    tokenize manifest) for sft and preference data, the longest prompt and completion for
    prompts; None when unknown."""
    if config.data.kind == "pretrain":
        return config.seq_length
    if config.data.kind == "prompts":
        return longest_sequence(config.rl, config.data.paths[0], config.model)
    manifest, _ = _data_manifest(config.data.paths[0], config.data.kind)
    return (manifest or {}).get("seq_length") or config.seq_length


def memory_check(config: TrainConfig, model: ModelConfig, world: int, nproc: int, device_type: str,
                 seq_length: int, measure: bool = True, name: str | None = None) -> tuple[MemoryPlan, list[str]]:
    """The memory plan of ``config`` on ``world`` ranks (``nproc`` per node) of
    ``device_type`` and, when it does not fit one device, the line refusing it (naming the
    largest term and the single changes that fit). ``measure``: read the device's memory
    from this machine when neither ``device_memory_gb`` nor LLMFLOW_DEVICE_MEMORY_GB gives it."""
    if config.device_memory_gb is not None or measure or os.environ.get(DEVICE_MEMORY_ENV):
        device_bytes, label = device_memory(device_type, nproc, config.device_memory_gb)
    else:
        device_bytes, label = None, ""
    name = name or Path(config.model).name

    def plan_of(change: dict[str, Any]) -> MemoryPlan | None:
        changed = config.model_copy(update=change)
        if settings_problems(changed, world, model):
            return None
        shape = train_shape(changed, world, seq_length, device_type)
        if shape.ep > 1 and (not model.num_experts or model.num_experts % shape.ep or shape.dp % shape.ep):
            return None  # the experts cannot be split ep ways over these dp ranks
        return train_plan(model, shape, device_bytes, label, name)

    plan = plan_of({})
    if plan is None or plan.fits:
        return plan, []
    current = {"tp": config.tp, "pp": config.pp, "cp": config.cp, "micro_batch_size": config.micro_batch_size,
               "activation_checkpointing": config.activation_checkpointing, "lora": config.lora}
    if model.num_experts:
        current["ep"] = config.ep
    return plan, [refusal(plan, suggestions(plan_of, current, model, world))]


def check_training(config: TrainConfig, nproc: int, env: Mapping[str, str] | None = None, nnodes: int = 1,
                   local: bool = True, report: Callable[[str], None] = print) -> MemoryPlan | None:
    """Raise PreflightError listing every reason ``config`` cannot run on ``nproc`` workers on
    each of ``nnodes`` nodes (whose environment adds ``env``: its LLMFLOW_DEVICE forces the
    device type); ``local``: the workers run on this machine, whose devices are then counted
    and whose device memory the memory plan is checked against (elsewhere only against
    ``device_memory_gb`` or LLMFLOW_DEVICE_MEMORY_GB). The memory plan goes to ``report``
    (when the layout can run at all) and is returned."""
    model, problems = model_problems(Path(config.model))
    world = nproc * nnodes
    layout = settings_problems(config, world, model)
    problems += layout + data_problems(config, model)
    device_type = (env or {}).get(runtime.DEVICE_ENV)
    if local:
        problems += device_problems(nproc, device_type)
    plan = None
    seq_length = training_seq_length(config)
    if model is not None and not layout and seq_length:
        try:
            device_type = runtime.device_spec(device_type).type
        except ValueError as error:  # an unknown device type (device_problems names it when local)
            device_type, memory = None, [] if local else [str(error)]
        if device_type is not None:
            try:
                plan, memory = memory_check(config, model, world, nproc, device_type, seq_length, measure=local)
            except ValueError as error:  # a bad LLMFLOW_DEVICE_MEMORY_GB
                memory = [str(error)]
        if plan is not None:
            report(plan.table())
        problems += memory
    problems += resume_problems(config, model)
    if problems:
        raise PreflightError(problems)
    return plan
