"""Flow parameters: pydantic models whose field docstrings become the Prefect UI's form.

They live here, not beside their flows: ``prefect deploy`` loads a flow file a second time
under another module name, and pydantic then cannot read the attribute docstrings of
classes defined in it (the form would lose its help text).

Every default points at the built-in sample assets, so each flow runs offline with no
parameters but its workspace; real models and data are parameter values
(``hf://Qwen/Qwen2.5-0.5B``).

Each field of a flow's model is a top-level parameter of the flow (``flow_parameters``):
Prefect merges a run's parameters over its deployment's key by key at the top level only,
so a run that sets ``train`` keeps the deployment's ``workspace``, ``evaluation``, ...
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.fields import FieldInfo

from llmflow.cluster.launcher import LaunchSettings
from llmflow.data.conversations import Format, PreferenceFormat
from llmflow.data.tokenize_instruction import TemplateName
from llmflow.evaluate.chat_context import ChatSettings
from llmflow.mesh import ParallelLayout
from llmflow.models.context_parallel import sequence_split_problems
from llmflow.train.config import DataConfig, OptimConfig, TrainConfig
from llmflow.train.grpo.config import RLConfig
from llmflow.train.grpo.rewards import RewardConfig
from llmflow.train.preference import PreferenceConfig
from llmflow.train.preflight import batch_problems, parallel_problems, pipeline_problems

SAMPLE = "sample"
"""Source value that means "the built-in sample assets" (written by the sample stage)."""
MEGATRON = "megatron://"
"""Prefix of a model source that is a Megatron-LM / MindSpeed-LLM checkpoint on this machine
(``megatron:///abs/path``)."""

Benchmark = Literal["mmlu", "ceval", "cmmlu", "boolq", "agieval", "gsm8k", "bbh", "humaneval", "mmlu-pro", "gpqa-diamond",
                    "minerva-math500", "minerva-math", "ifeval"]
"""A benchmark's name, as ``llmflow eval`` names it."""

Stage = Literal[
    "sample", "download", "convert", "tokenize-instruction", "tokenize-pretrain", "eval-mmlu", "eval-ceval",
    "eval-cmmlu", "eval-boolq", "eval-agieval", "eval-gsm8k", "eval-bbh", "eval-humaneval", "eval-mmlu-pro",
    "eval-gpqa-diamond", "eval-minerva-math500", "eval-minerva-math",
    "eval-ifeval", "train", "export", "infer",
    "register", "probe-compare", "tokenize-preference", "reference-logps", "heldout-rewards",
]
"""A stage's name as the Prefect UI shows it (its task's name)."""


class Params(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


LOGLIKELIHOOD_BENCHMARKS = ("mmlu", "ceval", "cmmlu", "boolq", "agieval")
"""The benchmarks scored by the log-likelihood of their answers (no thinking first)."""


def thinking_problems(benchmarks: list[str], evaluation: ChatSettings) -> list[str]:
    """Why ``evaluation`` cannot run ``benchmarks``: thinking asked for a benchmark scored by
    log-likelihood (lm-evaluation-harness refuses it too)."""
    scored = [b for b in benchmarks if b in LOGLIKELIHOOD_BENCHMARKS]
    if evaluation.enable_thinking and scored:
        return [(f"evaluation.enable_thinking=true: {', '.join(scored)} score the log-likelihood of their answers, "
                 "which a model thinking first cannot be; evaluate generative benchmarks with thinking, apart")]
    return []


P = TypeVar("P", bound=Params)
R = TypeVar("R")


def flow_parameters(model: type[P]) -> Callable[[Callable[[P], R]], Callable[..., R]]:
    """Turn ``fn(params: model)`` into a function whose parameters are ``model``'s fields,
    keyword-only, each with its type, constraints and default: the signature Prefect
    validates a run's parameters against and builds the run form from. The docstring gets
    an ``Args:`` section of the fields' docstrings, where Prefect reads the form's help for
    top-level parameters (nested models carry their own field docstrings)."""

    def decorate(fn: Callable[[P], R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def with_fields(**arguments: Any) -> R:
            return fn(model(**arguments))

        fields = model.model_fields.items()
        with_fields.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=field.rebuild_annotation(),
                               default=field.get_default(call_default_factory=True)) for name, field in fields],
            return_annotation=inspect.signature(fn).return_annotation,
        )
        args = "".join(f"\n    {name}: {' '.join((field.description or '').split())}" for name, field in fields)
        with_fields.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\nArgs:{args}\n"
        return with_fields

    return decorate


class _TrainSettings(Params):
    nproc: int = Field(default=1, ge=1)
    """Worker processes per node (one per accelerator; CPU runs use gloo)."""
    nnodes: int = Field(default=1, ge=1)
    """Nodes of the training job; above 1 needs the slurm or kubernetes launcher (the flow's
    launch parameter). The world size is nnodes x nproc."""

    @property
    def world_size(self) -> int:
        """Ranks of the training job."""
        return self.nproc * self.nnodes

    def train_config(self, model: Path, out: Path, data: DataConfig, seq_length: int | None = None,
                     **settings: Any) -> TrainConfig:
        """The training stage's config for these settings (``settings``: more of TrainConfig's)."""
        own = self.model_dump(exclude={"nproc", "nnodes"})
        return TrainConfig.model_validate({**own, "model": model, "out": out, "data": data,
                                           "seq_length": seq_length, "log_interval": 10, **settings})

    @model_validator(mode="after")
    def _layout_fits(self) -> _TrainSettings:
        pp, tp, micro, batch = self.pp, self.tp, self.micro_batch_size, self.global_batch_size  # type: ignore[attr-defined]
        cp = self.cp  # type: ignore[attr-defined]
        dp = ParallelLayout.of_world(self.world_size, pp, tp, cp=cp).dp
        problems = parallel_problems(self.world_size, tp, pp=pp, ep=self.ep, cp=cp)  # type: ignore[attr-defined]
        problems += batch_problems(batch, micro, dp)
        problems += pipeline_problems(self, dp, None)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _train_config_fields(defaults: dict[str, Any]) -> dict[str, Any]:
    """``TrainConfig``'s fields named in ``defaults`` (type, constraints, docstring), each with
    the flows' own default."""
    fields = TrainConfig.model_fields
    return {name: (fields[name].annotation, FieldInfo.merge_field_infos(fields[name], default=default))
            for name, default in defaults.items()}


TrainParams = create_model(
    "TrainParams",
    __base__=_TrainSettings,
    __module__=__name__,
    __doc__="""How the model is trained: ``TrainConfig``'s settings, with defaults that teach the
    sample model its facts in about two minutes on two CPU cores (real models want a far lower lr).""",
    **_train_config_fields({
        "steps": 500, "micro_batch_size": 16, "global_batch_size": 16,
        "optim": OptimConfig(lr=5e-3, min_lr=5e-4, warmup_steps=20, decay="linear"),
        "lora": None, "tp": 1, "cp": 1, "cp_algo": "ulysses", "ep": 1, "pp": 1, "pp_schedule": "1F1B", "virtual_stages": None, "num_layer_list": None,
        "microbatches": None, "dtype": "auto", "save_interval": 100, "seed": 1234,
    }),
)


Method = Literal["sft", "dpo", "simpo", "orpo", "grpo"]
"""How the finetune-eval flow trains: instruction finetuning alone, or followed by an alignment
run (preference pairs, or online RL on a prompt set)."""


class _PreferenceChecks(Params):
    @model_validator(mode="after")
    def _valid_objective(self) -> _PreferenceChecks:
        PreferenceConfig.model_validate(self.model_dump())  # its own rules (label_smoothing with ipo)
        return self


PreferenceSettings = create_model(
    "PreferenceSettings",
    __base__=_PreferenceChecks,
    __module__=__name__,
    __doc__="""The objective's settings (``PreferenceConfig``'s, TRL's names and defaults); the
    reference log-probs' directory is the flow's reference stage.""",
    **{name: (field.annotation, FieldInfo.merge_field_infos(field)) for name, field in PreferenceConfig.model_fields.items()
       if name != "reference"},
)


class _AlignmentSettings(_TrainSettings):
    def alignment_config(self, model: Path, out: Path, data: Path, method: str, reference: Path | None = None) -> TrainConfig:
        """The alignment run's (or, with its own ``out``, a pair log-probs stage's) config:
        ``method`` on the preference dataset ``data``, the reference log-probs kept in
        ``reference`` (default: ``{out}/reference``)."""
        preference = self.preference.model_dump() | {"reference": reference}  # type: ignore[attr-defined]
        return self.train_config(model, out, DataConfig(kind="preference", paths=[str(data)]), method=method,
                                 preference=preference)


AlignmentParams = create_model(
    "AlignmentParams",
    __base__=_AlignmentSettings,
    __module__=__name__,
    __doc__="""How the finetuned model is aligned on the preference pairs: ``TrainConfig``'s
    settings, with defaults that raise the sample model's held-out reward accuracy in a minute
    or two on two CPU cores (real models want a far lower lr).""",
    **_train_config_fields({
        "steps": 150, "micro_batch_size": 16, "global_batch_size": 32,
        "optim": OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=5, decay="linear"),
        "lora": None, "tp": 1, "cp": 1, "cp_algo": "ulysses", "ep": 1, "pp": 1, "pp_schedule": "1F1B",
        "virtual_stages": None, "num_layer_list": None, "microbatches": None, "dtype": "auto", "save_interval": 50,
        "seed": 1234,
    }),
    preference=(PreferenceSettings, FieldInfo.merge_field_infos(TrainConfig.model_fields["preference"],
                                                                 default=PreferenceSettings())),
)


class PreferenceParams(Params):
    """The preference pairs and the alignment run of ``method`` dpo, simpo or orpo."""

    data: str = SAMPLE
    """Training pairs: hf://org/name or ms://org/name (a dataset repository), a local file or
    directory, or "sample" for the sample set's training pairs."""
    data_files: list[str] = Field(default_factory=list)
    """Globs of the training pairs' files inside a dataset directory (default: every parquet,
    jsonl, json, csv and txt file)."""
    heldout_data: str = SAMPLE
    """Held-out pairs the reward accuracy is measured on, before and after alignment: a source
    as data takes, or "sample" for the sample set's held-out pairs."""
    heldout_data_files: list[str] = Field(default_factory=list)
    """Globs of the held-out pairs' files inside a dataset directory (e.g. ["data/test-*"]
    when data and heldout_data are one repository)."""
    data_format: PreferenceFormat = "pairwise"
    """Layout of the pairs: pairwise (prompt/chosen/rejected, as text or messages), alpaca
    (instruction/input/chosen/rejected) or sharegpt (conversations, chosen and rejected messages)."""
    map_keys: dict[str, str] = Field(default_factory=dict)
    """Renames of the data's keys to the format's (e.g. {"question": "prompt"})."""
    seq_length: int = Field(default=256, ge=8)
    """Tokens per training row, which holds a pair's chosen and rejected sequences (longer
    pairs are dropped)."""
    pack: bool = False
    """Pack several whole pairs into each row."""
    train: AlignmentParams = AlignmentParams()  # type: ignore[valid-type]
    """Alignment training settings (the chat template is the flow's template)."""

    @model_validator(mode="after")
    def _sequence_splits(self) -> PreferenceParams:
        if problems := sequence_split_problems(self.seq_length, self.train.cp, self.train.cp_algo):
            raise ValueError(f"preference.train.cp: {problems[0]}")
        return self


class _ReinforceSettings(_TrainSettings):
    def reinforce_config(self, model: Path, out: Path, prompts: Path) -> TrainConfig:
        """The GRPO run's config on the prompt file ``prompts``."""
        return self.train_config(model, out, DataConfig(kind="prompts", paths=[str(prompts)]), method="grpo",
                                 rl=self.rl)  # type: ignore[attr-defined]


ReinforceParams = create_model(
    "ReinforceParams",
    __base__=_ReinforceSettings,
    __module__=__name__,
    __doc__="""How the finetuned model is reinforced on the prompt set (method grpo):
    ``TrainConfig``'s settings with the rl section, with defaults that raise the sample model's
    held-out reward accuracy in two minutes on a CPU core: 4 prompts x 16 completions of up to
    16 tokens a step, scored by qa_match (real models want a far lower lr).""",
    **_train_config_fields({
        "steps": 80, "micro_batch_size": 64, "global_batch_size": 64,
        "optim": OptimConfig(lr=4e-4, decay="constant"),
        "lora": None, "tp": 1, "cp": 1, "cp_algo": "ulysses", "ep": 1, "pp": 1, "pp_schedule": "1F1B",
        "virtual_stages": None, "num_layer_list": None, "microbatches": None, "dtype": "auto", "save_interval": 10,
        "seed": 1234,
        "rl": RLConfig(num_generations=16, max_completion_length=16, rewards=[RewardConfig(function="qa_match")]),
    }),
)


class RLParams(Params):
    """The prompt set and the GRPO run of ``method`` grpo."""

    data: str = SAMPLE
    """Training prompts with their answers (GSM8K's question/answer, MATH's problem/solution,
    prompt/answer or messages): hf://org/name or ms://org/name (a dataset repository), a local
    JSON-lines or parquet file or directory, or "sample" for the sample set's RL prompts."""
    data_files: list[str] = Field(default_factory=list)
    """Glob of the training prompts' file inside a dataset directory (it must match one file)."""
    heldout_data: str = SAMPLE
    """Held-out prompts the reward accuracy is measured on, before and after GRPO (greedy
    completions scored by rl.rewards): a source as data takes, or "sample" for the sample set's."""
    heldout_data_files: list[str] = Field(default_factory=list)
    """Glob of the held-out prompts' file inside a dataset directory (it must match one file)."""
    train: ReinforceParams = ReinforceParams()  # type: ignore[valid-type]
    """GRPO training settings (rl: the objective's, TRL's names)."""


class BenchmarkSources(Params):
    """Where each benchmark's data comes from (MMLU's is evaluation.data)."""

    ceval: str = "hf://ceval/ceval-exam"
    """C-Eval data: the hub dataset or a local copy in one of its layouts (the val split is scored)."""
    cmmlu: str = "hf://haonan-li/cmmlu"
    """CMMLU data: the hub dataset or a local copy in one of its layouts."""
    boolq: str = "hf://aps/super_glue"
    """BoolQ data: the hub dataset, a local copy (aps/super_glue or google/boolq layout) or "sample"."""
    agieval: str = "hf://hails"
    """AGIEval data: hf://hails (every hails/agieval-* task), a local directory of them or "sample"."""
    agieval_tasks: list[str] | None = None
    """AGIEval tasks to run, by lm-evaluation-harness's names (default: the nine English
    multiple-choice tasks; with "sample", the sample's agieval_logiqa_en and agieval_sat_math)."""
    gsm8k: str = "hf://openai/gsm8k"
    """GSM8K data: the hub dataset, a local copy (openai/gsm8k or the original JSON lines) or "sample"."""
    bbh: str = "hf://SaylorTwift/bbh"
    """BBH data: the hub dataset, a local copy of its layout or "sample"."""
    humaneval: str = "hf://openai/openai_humaneval"
    """HumanEval data: the hub dataset, a local copy (its layout or openai/human-eval's HumanEval.jsonl) or "sample"."""
    bbh_tasks: list[str] | None = None
    """BBH tasks to run, by lm-evaluation-harness's names (bbh_cot_fewshot_navigate, ...; default:
    all 27; with "sample", the sample's boolean_expressions and object_counting)."""
    mmlu_pro: str = "hf://TIGER-Lab/MMLU-Pro"
    """MMLU-Pro data: the hub dataset, a local copy of its layout or "sample"."""
    mmlu_pro_tasks: list[str] | None = None
    """MMLU-Pro categories to run, by lm-evaluation-harness's names (mmlu_pro_law, ...; default:
    all 14; with "sample", the sample's history, other and computer science)."""
    gpqa_diamond: str = "hf://Idavidrein/gpqa"
    """GPQA Diamond data: the hub dataset (gated: accept its terms and set HF_TOKEN), a local
    directory holding gpqa_diamond.csv, or "sample"."""
    minerva_math500: str = "hf://HuggingFaceH4/MATH-500"
    """MATH-500 data: the hub dataset, a local directory holding its test.jsonl, or "sample"."""
    minerva_math: str = "hf://EleutherAI/hendrycks_math"
    """MATH (seven subjects) data: the hub dataset, a local copy of its layout or "sample"."""
    ifeval: str = "hf://google/IFEval"
    """IFEval data: the hub dataset, a local directory holding its ifeval_input_data.jsonl, or "sample"."""


class EvalParams(ChatSettings):
    """The evaluation: MMLU's settings and those every benchmark shares, the chat settings
    among them (lm-evaluation-harness's prompts and scoring)."""

    data: str = SAMPLE
    """MMLU data: hf://cais/mmlu, a local directory in the cais/mmlu or the original CSV
    layout, or "sample" for the sample set."""
    shots: int = Field(default=5, ge=0, le=5)
    """Solved dev questions before each question."""
    subjects: list[str] | None = None
    """Subjects to evaluate (default: all)."""
    limit: int | None = Field(default=None, ge=1)
    """Only the first N test questions of each subject."""
    batch_size: int = Field(default=8, ge=1)
    """Sequences per forward pass."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Most tokens generated per question by the generative benchmarks; empty: each task's
    lm-evaluation-harness default (256 for gsm8k, minerva-math and gpqa-diamond, 1024 for bbh and
    humaneval, 1280 for ifeval, 2048 for mmlu-pro), which a model must have room for."""


SAMPLE_PROMPTS = (
    "What is the capital of Stavalstan?",
    "What colour is the flag of Remgumora?",
    "What is the national animal of Murbrunia?",
    "What is 14 + 19?",
)


class MegatronExport(Params):
    """A Megatron-LM / MindSpeed-LLM checkpoint of the finetuned model."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size it is written for (its vocabulary padding; the legacy layout's ranks)."""
    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel size (an even split of the layers)."""
    megatron_format: Literal["torch_dist", "legacy"] = "torch_dist"
    """torch_dist (megatron-core's distributed checkpoint) or legacy (mp_rank_*/model_optim_rng.pt)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel size of a mixture of experts (the legacy layout's expert ranks)."""


class _SequenceSplit(Params):
    """A flow whose training samples have ``seq_length`` tokens, split ``train.cp`` ways."""

    @model_validator(mode="after")
    def _sequence_splits(self) -> _SequenceSplit:
        train = self.train  # type: ignore[attr-defined]
        if problems := sequence_split_problems(self.seq_length, train.cp, train.cp_algo):  # type: ignore[attr-defined]
            raise ValueError(f"train.cp: {problems[0]}")
        return self


class FinetuneEvalParams(_SequenceSplit):
    """Finetune a model on instruction data and measure MMLU before and after."""

    workspace: str | None = None
    """Directory of every stage's output (and the default MLflow store); empty: $LLMFLOW_WORKSPACE
    (the deployment's, set by llmflow server)."""
    model: str = SAMPLE
    """Base model: hf://org/name, ms://org/name, a local Hugging Face directory, "sample" for
    the built-in tiny model, or megatron:///abs/path for a Megatron-LM / MindSpeed-LLM checkpoint
    (torch_dist or legacy, any tp/pp; megatron_hf then names the model it holds)."""
    megatron_hf: str | None = None
    """With a megatron:// model: the Hugging Face model (hf://, ms://, a local directory or
    "sample") whose config.json and tokenizer describe it; its weights are not used."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of the base model."""
    megatron_export: MegatronExport | None = None
    """Also export the finetuned model as a Megatron-LM / MindSpeed-LLM checkpoint (empty: skip)."""
    data: str = SAMPLE
    """Instruction data: hf://org/name or ms://org/name (a dataset repository), a local file
    or directory, or "sample" for the built-in Alpaca-style set."""
    data_files: list[str] = Field(default_factory=list)
    """Globs of the data files inside a dataset directory (default: every parquet, jsonl,
    json, csv and txt file)."""
    data_format: Format = "alpaca"
    """Layout of the instruction data: alpaca, sharegpt or messages."""
    map_keys: dict[str, str] = Field(default_factory=dict)
    """Renames of the data's keys to the format's (e.g. {"conversations": "messages"})."""
    template: TemplateName | None = None
    """Chat template for training: the tokenizer's own when empty, else a named one."""
    seq_length: int = Field(default=256, ge=8)
    """Tokens per training row."""
    pack: bool = False
    """Pack several samples into each row (attention kept inside each sample)."""
    train: TrainParams = TrainParams()
    """Finetuning settings."""
    method: Method = "sft"
    """sft: instruction finetuning alone; dpo, simpo or orpo: the finetuned (SFT) model then
    aligned on the preference pairs (see preference) by that objective; grpo: the SFT model then
    reinforced on the prompt set (see rl) with GRPO. The aligned model is the one answered with,
    scored after (the SFT model scored between), gated and registered."""
    preference: PreferenceParams = PreferenceParams()
    """Preference pairs and alignment settings (used with method dpo, simpo or orpo)."""
    rl: RLParams = RLParams()
    """Prompt set and GRPO settings (used with method grpo)."""
    launch: LaunchSettings = LaunchSettings()
    """Where the training workers run: torchrun on the worker's machine, a Slurm job or a
    Kubernetes job (auto: the work pool's LLMFLOW_LAUNCHER job variable, else local)."""
    evaluation: EvalParams = EvalParams()
    """Evaluation settings, the same for every stage's model (evaluation.data is MMLU's)."""
    benchmarks: list[Benchmark] = Field(default_factory=lambda: ["mmlu"], min_length=1)
    """Benchmarks scored on every stage's model (the base, the SFT and, with an alignment
    method, the aligned model): mmlu, ceval, cmmlu, boolq, agieval, gsm8k, bbh, humaneval."""
    benchmark_data: BenchmarkSources = BenchmarkSources()
    """Data of the benchmarks other than MMLU."""
    gate_benchmark: Benchmark = "mmlu"
    """The benchmark whose headline score the registry gate holds to register_min_gain (one of benchmarks)."""
    gate_against: Literal["previous", "base"] = "previous"
    """The model the registry gate holds the final model's gate_benchmark score against.
    previous (the default): the model the last stage started from: the SFT model with method
    dpo, simpo or orpo, so that an alignment losing what the finetune gained is not registered;
    the base model with sft. base: the base model whatever the method (an aligned model then
    need only beat the base model)."""
    version: str | None = None
    """Data version or date the finetune belongs to. Empty: the run's scheduled date, so a
    nightly run never reuses yesterday's finetune while the base model's stages still come
    from cache."""
    refresh: list[Stage] = Field(default_factory=list)
    """Stages to run again even when their inputs are unchanged."""
    prompts: list[str] = Field(default_factory=lambda: list(SAMPLE_PROMPTS))
    """Prompts the finetuned model answers in the training chat template (the answers go to
    MLflow and a Prefect table); empty: skip the inference stage."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Longest answer to each prompt, in tokens (greedy decoding)."""
    registered_model: str | None = "llmflow-finetuned"
    """MLflow registered model that receives the exported model as a new version (empty: skip)."""
    register_min_gain: float | None = 0.0
    """Register only when the final model's gate benchmark score minus the gate_against model's
    is at least this: 0 when it scores no worse than that model, 0.01 for a gain of a point;
    empty: register always."""

    @model_validator(mode="after")
    def _gate_is_scored(self) -> FinetuneEvalParams:
        if self.gate_benchmark not in self.benchmarks:
            raise ValueError(f"gate_benchmark={self.gate_benchmark!r} is not among benchmarks={self.benchmarks}")
        if problems := thinking_problems(self.benchmarks, self.evaluation):
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _objective_takes_its_settings(self) -> FinetuneEvalParams:
        loss_type = self.preference.train.preference.loss_type
        if self.method in ("simpo", "orpo") and loss_type != "sigmoid":
            raise ValueError(f"preference.train.preference.loss_type={loss_type!r} is a dpo loss; method={self.method} "
                             "has its own (leave loss_type sigmoid)")
        return self

    @model_validator(mode="after")
    def _megatron_has_its_config(self) -> FinetuneEvalParams:
        if self.model.startswith(MEGATRON) != (self.megatron_hf is not None):
            raise ValueError(f"model={self.model!r}, megatron_hf={self.megatron_hf!r}: a megatron:// model needs "
                             "megatron_hf (the Hugging Face model it holds), and only a megatron:// model takes one")
        if self.model.startswith(MEGATRON) and not Path(self.model.removeprefix(MEGATRON)).is_absolute():
            raise ValueError(f"model={self.model!r}: expected megatron:///absolute/path")
        return self


class PretrainParams(_SequenceSplit):
    """Pretrain a model on raw text, export it and score it on MMLU."""

    workspace: str | None = None
    """Directory of every stage's output (and the default MLflow store); empty: $LLMFLOW_WORKSPACE
    (the deployment's, set by llmflow server)."""
    model: str = SAMPLE
    """Initial weights: hf://org/name, ms://org/name, a local Hugging Face directory, or "sample"."""
    revision: str | None = None
    """Hub revision of the model."""
    init: Literal["weights", "random"] = "weights"
    """weights: continue from the model's weights; random: only its config and tokenizer,
    freshly initialised (pretraining from scratch)."""
    data: str = SAMPLE
    """Text corpus: hf://org/name or ms://org/name (a dataset repository), local files or a
    directory, or "sample" for the sample Wikipedia-layout parquet."""
    data_files: list[str] = Field(default_factory=list)
    """Globs of the data files inside a dataset directory (default: every data file)."""
    text_key: str = "text"
    """Column (or JSON key) holding each document's text."""
    seq_length: int = Field(default=256, ge=8)
    """Tokens per training sample."""
    train: TrainParams = TrainParams(steps=200, micro_batch_size=8, global_batch_size=8,
                                     optim=OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=20))
    """Training settings."""
    launch: LaunchSettings = LaunchSettings()
    """Where the training workers run: torchrun on the worker's machine, a Slurm job or a
    Kubernetes job (auto: the work pool's LLMFLOW_LAUNCHER job variable, else local)."""
    evaluation: EvalParams = EvalParams()
    """MMLU settings."""
    version: str | None = None
    """Data version or date the run belongs to (empty: the run's scheduled date)."""
    refresh: list[Stage] = Field(default_factory=list)
    """Stages to run again even when their inputs are unchanged."""

    @model_validator(mode="after")
    def _mmlu_takes_the_settings(self) -> PretrainParams:
        if problems := thinking_problems(["mmlu"], self.evaluation):
            raise ValueError("; ".join(problems))
        return self


class EvaluateParams(Params):
    """Evaluate one model on benchmarks."""

    workspace: str | None = None
    """Directory of every stage's output (and the default MLflow store); empty: $LLMFLOW_WORKSPACE
    (the deployment's, set by llmflow server)."""
    model: str = SAMPLE
    """Model: hf://org/name, ms://org/name, a local Hugging Face directory, a training
    checkpoint (run directory or step directory, LoRA included), or "sample"."""
    revision: str | None = None
    """Hub revision of the model."""
    benchmarks: list[Benchmark] = Field(default_factory=lambda: ["mmlu"], min_length=1)
    """Benchmarks to run: mmlu (data from evaluation.data), ceval, cmmlu, boolq, agieval, gsm8k, bbh,
    humaneval, minerva-math500, minerva-math, mmlu-pro, gpqa-diamond, ifeval."""
    evaluation: EvalParams = EvalParams()
    """Settings shared by the benchmarks (evaluation.data is MMLU's; shots and subjects are the
    four-choice benchmarks'; the others run at lm-evaluation-harness's default shots)."""
    benchmark_data: BenchmarkSources = BenchmarkSources()
    """Data of the benchmarks other than MMLU."""
    refresh: list[Stage] = Field(default_factory=list)
    """Stages to run again even when their inputs are unchanged."""

    @model_validator(mode="after")
    def _benchmarks_take_the_settings(self) -> EvaluateParams:
        if problems := thinking_problems(self.benchmarks, self.evaluation):
            raise ValueError("; ".join(problems))
        return self


class RunSide(Params):
    """One of the two runs compared."""

    model: str = SAMPLE
    """Model: hf://org/name, ms://org/name, a local Hugging Face directory or training
    checkpoint, or "sample"."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel degree (Ulysses: each rank a contiguous 1/cp of every sequence;
    seq_length must divide by it)."""
    pp: int = Field(default=1, ge=1)
    """Pipeline stages (1F1B schedule; the run uses pp * cp * tp workers)."""
    dtype: Literal["bf16", "fp16", "fp32"] = "fp32"
    """Compute dtype."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Device type of the workers (auto: npu, then cuda, then cpu)."""


class PrecisionParams(Params):
    """Dump a few training steps in two configurations and find where they diverge."""

    workspace: str | None = None
    """Directory of every stage's output (and the default MLflow store); empty: $LLMFLOW_WORKSPACE
    (the deployment's, set by llmflow server)."""
    target: RunSide = RunSide(tp=2)
    """The run under test."""
    bench: RunSide = RunSide()
    """The reference run."""
    data: str = SAMPLE
    """Pretraining text both runs train on: hf://..., local files, or "sample"."""
    data_files: list[str] = Field(default_factory=list)
    """Globs of the data files inside a dataset directory (default: every data file)."""
    seq_length: int = Field(default=64, ge=8)
    """Tokens per sample."""
    batch_size: int = Field(default=4, ge=1)
    """Samples per step: one micro-batch, or, when a run has pipeline stages, as many
    micro-batches as the larger pp of the two (both runs alike), so a multiple of it."""
    steps: int = Field(default=2, ge=1)
    """Training steps each run makes."""
    dump_steps: list[int] = Field(default_factory=lambda: [0])
    """Steps to dump, counted from 0 as msprobe does."""
    task: Literal["statistics", "tensor"] = "tensor"
    """What the dumps hold: statistics (max/min/mean/norm) or whole tensors."""
    level: Literal["L0", "L1", "mix"] = "mix"
    """L0: modules, L1: torch API calls, mix: both."""
    refresh: list[Stage] = Field(default_factory=list)
    """Stages to run again even when their inputs are unchanged."""

    @property
    def micro_batches(self) -> int:
        """Micro-batches of each run's step: the larger pp of the two runs."""
        return max(self.target.pp, self.bench.pp)

    @model_validator(mode="after")
    def _batch_splits(self) -> PrecisionParams:
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of the larger pp of the two runs ({self.micro_batches}): "
                "both runs cut their step into that many micro-batches"
            )
        for label, side in (("target", self.target), ("bench", self.bench)):
            if problems := sequence_split_problems(self.seq_length, side.cp):
                raise ValueError(f"{label}.cp: {problems[0]}")
        return self
