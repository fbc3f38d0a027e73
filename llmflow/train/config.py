"""The training configuration: one typed model, read from YAML/JSON and ``key=value``
overrides, documented per field (the docstrings are the CLI help and the Prefect form)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmflow.models.lora import LoraConfig
from llmflow.train.grpo.config import RLConfig
from llmflow.train.preference import PreferenceConfig
from llmflow.validation import one_line


class DataConfig(BaseModel):
    """What the model trains on."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    kind: Literal["pretrain", "sft", "preference", "prompts"] = "pretrain"
    """pretrain: Megatron indexed datasets ({prefix}_text_document), samples of seq_length+1
    tokens cut from the concatenated documents; sft: instruction datasets written by
    ``llmflow tokenize instruction`` (their own seq_length, packed or padded rows);
    preference: chosen/rejected pairs written by ``llmflow tokenize preference`` (for
    method dpo, simpo or orpo); prompts: a JSON-lines or parquet file of prompts with their
    answers (GSM8K's question/answer, MATH's problem/solution, prompt/answer, or messages),
    rendered with rl.template (for method grpo)."""
    paths: list[str] = Field(min_length=1)
    """Dataset prefixes: for pretrain the {prefix} of {prefix}_text_document.bin/.idx (or the
    full ..._text_document path); for sft the --out of the tokenize stage; for prompts the file."""
    weights: list[float] | None = None
    """Blend weights, one per path (pretrain only); default: equal."""
    document_attention: bool = False
    """pretrain: keep attention and positions inside each document of a sample (Megatron's
    --reset-attention-mask --reset-position-ids). sft rows always keep samples apart."""

    @model_validator(mode="after")
    def _weights_match(self) -> DataConfig:
        if self.weights is not None:
            if len(self.weights) != len(self.paths):
                raise ValueError(f"data.weights has {len(self.weights)} entries for {len(self.paths)} data.paths")
            if any(w <= 0 for w in self.weights):
                raise ValueError(f"data.weights must be positive, got {self.weights}")
            if self.kind != "pretrain" and len(self.paths) > 1:
                raise ValueError(f"data.weights blends pretraining datasets; {self.kind} takes one dataset")
        if self.kind != "pretrain" and len(self.paths) != 1:
            raise ValueError(f"{self.kind} trains on one tokenized dataset, got {len(self.paths)} data.paths")
        return self


class OptimConfig(BaseModel):
    """AdamW with linear warmup and a decay schedule."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(default=0.0, ge=0)
    """Learning rate at the end of the decay."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to lr."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay from lr to min_lr over the steps after warmup."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay (not applied to norms and biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; null to only measure it."""


class TrainConfig(BaseModel):
    """One training run: model, data, parallel layout, optimizer, checkpoints, logging."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: Path
    """Initial weights: a Hugging Face model directory (config.json + safetensors) or a
    checkpoint written by ``llmflow convert`` / a previous run."""
    out: Path
    """Checkpoint directory of this run. When it holds a checkpoint, training resumes from it,
    but only with the settings the weights depend on unchanged (model, data, method,
    preference, rl, optim, lora, seed, seq_length, dtype, global_batch_size, router_aux_loss_coef,
    router_bias_update_rate, router_seq_aux_loss_coef; a launch that changes one is refused, naming
    it). The parallel layout (nproc, pp, tp, dp, cp, ep, the pipeline schedule and split),
    micro_batch_size and the settings of recomputation, compilation, logging and saving may
    change between launches, and steps may grow."""
    data: DataConfig
    """Training data."""
    method: Literal["next_token", "dpo", "simpo", "orpo", "grpo"] = "next_token"
    """Training objective. next_token: cross-entropy of every target token (pretraining and
    instruction data); dpo: Direct Preference Optimization against the reference model (the
    initial weights; their log-probs of the pairs are computed once and cached, see
    preference.reference); simpo: SimPO, reference-free, on length-normalised log-probs;
    orpo: ORPO, the chosen sequences' cross-entropy plus an odds-ratio term. dpo, simpo and
    orpo train on data.kind preference; grpo: online reinforcement learning on verifiable
    rewards (GRPO, DAPO, Dr. GRPO, GSPO: see rl), sampling completions of data.kind prompts."""
    preference: PreferenceConfig = PreferenceConfig()
    """Settings of the dpo, simpo and orpo objectives."""
    rl: RLConfig = RLConfig()
    """Settings of the grpo objective (TRL's GRPOConfig names and defaults)."""
    steps: int = Field(ge=1)
    """Optimizer steps to train for (in total, across resumes). A resume may raise it to
    continue a finished run (the decay then spans the new total); it cannot go below the
    step of the run's checkpoint."""
    seq_length: int | None = Field(default=None, ge=1)
    """Tokens per sample for pretraining (sft rows take the dataset's seq_length)."""
    micro_batch_size: int = Field(default=1, ge=1)
    """Samples (grpo: completions) per rank per forward/backward."""
    global_batch_size: int = Field(default=8, ge=1)
    """Samples per optimizer step over all data-parallel ranks (grpo: completions, a multiple
    of rl.num_generations); a multiple of micro_batch_size * dp (the quotient is the
    gradient accumulation)."""
    optim: OptimConfig = OptimConfig()
    """Optimizer and learning-rate schedule."""
    lora: LoraConfig | None = None
    """Train LoRA adapters on frozen base weights instead of every weight."""
    router_aux_loss_coef: float | None = Field(default=None, ge=0)
    """Weight of a mixture-of-experts model's load-balancing auxiliary loss in the training
    loss (transformers' router_aux_loss_coef). Default: as transformers trains the checkpoint,
    its config.json's router_aux_loss_coef when it sets output_router_logits, else 0. The loss
    and the tokens each expert received are logged either way (not under pp, where a nonzero
    weight is refused)."""
    router_bias_update_rate: float = Field(default=0.0, ge=0)
    """Auxiliary-loss-free load balancing (DeepSeek-V3; megatron-core's
    moe_router_enable_expert_bias with moe_router_bias_update_rate, whose default is 1e-3):
    after each optimizer step every MoE layer's e_score_correction_bias moves by this rate
    times sign(mean load - the expert's load), the loads counted over the step's
    micro-batches and every rank's tokens. 0: the biases stay as loaded. Needs a router with
    a correction bias (router_scoring 'sigmoid': glm4_moe); refused under pp and with lora."""
    router_seq_aux_loss_coef: float = Field(default=0.0, ge=0)
    """Weight of DeepSeek-V3's sequence-wise auxiliary loss in the training loss
    (megatron-core's moe_router_load_balancing_type 'seq_aux_loss' with moe_aux_loss_coeff;
    DeepSeek-V3 trained with 1e-4): for each MoE layer and sequence, the sum over experts of
    f_e P_e (f_e: experts / (k T) times the number of the sequence's T tokens whose k most
    probable experts include e; P_e: e's mean probability over them), averaged over the
    sequences and summed over the layers; logged as moe_seq_aux_loss. 0: not computed.
    Refused under pp."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree (heads, KV heads and FFN width must divide by it)."""
    dp: int | None = Field(default=None, ge=1)
    """Data-parallel degree; default: world size / (pp * cp * tp)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree of a mixture-of-experts model: each group of ep data-parallel
    ranks splits every MoE layer's experts among themselves (num_experts / ep each) and sends
    each token to the ranks holding its experts. It divides dp and num_experts and adds no
    ranks (nproc = pp * dp * cp * tp still)."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel degree for long sequences: every sample's tokens are split over cp
    ranks (see cp_algo), so activations per rank fall to about 1/cp. seq_length must divide
    by it (ring: by 2*cp); packed documents keep their own attention. It adds ranks: nproc =
    pp * dp * cp * tp."""
    cp_algo: Literal["ulysses", "ring"] = "ulysses"
    """How attention reaches the other context-parallel ranks' positions. ulysses: each rank
    holds a contiguous 1/cp of the sequence and trades it for 1/cp of the heads by all-to-all
    (the attention heads per tensor-parallel rank must divide by cp). ring: torch's ring
    attention with its all-gather rotation and causal load balancing: each rank holds 2 of the
    sequence's 2*cp chunks (r and 2*cp-1-r) and gathers every rank's keys and values to
    attend over them; any head count, seq_length a multiple of 2*cp."""
    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel stages: the decoder layers are split into pp consecutive groups on
    different ranks (stage 0 also holds the embedding, the last the norm, output projection
    and loss). The ranks form a (pp, dp, cp, tp) mesh: nproc = pp * dp * cp * tp."""
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe"] = "1F1B"
    """Pipeline schedule (pp > 1): 1F1B (one forward, one backward; needs microbatches >= pp),
    Interleaved1F1B (virtual_stages model chunks per rank, a smaller bubble; needs
    microbatches a multiple of pp), or GPipe (all forwards, then all backwards)."""
    virtual_stages: int | None = Field(default=None, ge=2)
    """Model chunks per pipeline rank for Interleaved1F1B (Megatron's
    --num-layers-per-virtual-pipeline-stage, as a count): pp * virtual_stages stages in all,
    placed round-robin over the ranks."""
    num_layer_list: list[int] | None = None
    """Decoder layers of each pipeline stage, in order (MindSpeed's --num-layer-list, e.g.
    [16, 16]); pp * virtual_stages entries summing to the model's layers. Default: an even
    split, earlier stages taking one more layer when it is uneven."""
    microbatches: int | None = Field(default=None, ge=1)
    """Micro-batches each pipeline runs per optimizer step. It is global_batch_size /
    (micro_batch_size * dp), the default; a value given must equal it."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Compute dtype: auto = bf16 on accelerators, fp32 on CPU. Master weights, optimizer
    state and gradient reduction stay fp32."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward to save memory. full: keep only each layer's input
    and recompute the whole layer (least memory, about one more forward of compute);
    selective: keep the outputs of the matrix multiplications and attention, recompute the
    cheap rest (norms, activations, rotary, element-wise ops). true and false, as older
    configs say, mean full and none."""
    compile: bool = False
    """torch.compile each decoder layer (slow to start on CPU)."""
    seed: int = 1234
    """Seed of the data order, LoRA initialisation and dropout."""
    deterministic: bool = False
    """Deterministic mode for precision debugging: seed every generator (Python, numpy,
    torch, device) with ``seed`` and switch on deterministic kernels and collectives
    (``llmflow.probe.seed_all``), so two runs are bitwise identical. Slower."""
    probe: str | None = None
    """Dump the steps a probe config lists (msprobe's config.json schema: task, dump_path,
    rank, step, level, ...) into its dump_path, on every rank it lists. Probe steps count from
    0: probe step s is training step s + 1. Nothing is hooked outside the listed steps."""
    save_interval: int | None = Field(default=None, ge=1)
    """Save a checkpoint every this many steps (and always at the end)."""
    keep_last: int | None = Field(default=2, ge=1)
    """Checkpoints to keep (older ones are deleted); null keeps all."""
    log_interval: int = Field(default=1, ge=1)
    """Print and log metrics every this many steps."""
    device_memory_gb: float | None = Field(default=None, gt=0)
    """Memory of one device in GB (10^9 bytes) for the memory plan checked before launch;
    default: the LLMFLOW_DEVICE_MEMORY_GB variable, else what the device reports (CPU: the
    available system memory divided among this node's workers). Set it to plan for another
    machine."""
    mlflow_run_id: str | None = None
    """MLflow run to log metrics to (rank 0); default: the LLMFLOW_MLFLOW_RUN_ID variable."""

    @model_validator(mode="after")
    def _objective_fits_data(self) -> TrainConfig:
        expected = {"next_token": ("pretrain", "sft"), "grpo": ("prompts",)}.get(self.method, ("preference",))
        if self.data.kind not in expected:
            raise ValueError(f"method={self.method} trains on data.kind {' or '.join(expected)}, "
                             f"got data.kind={self.data.kind}")
        if self.method == "grpo" and self.global_batch_size % self.rl.num_generations:
            raise ValueError(f"global_batch_size={self.global_batch_size} must be a multiple of rl.num_generations="
                             f"{self.rl.num_generations} (completions per prompt)")
        return self

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _boolean_checkpointing(cls, value: Any) -> Any:
        return {True: "full", False: "none"}[value] if isinstance(value, bool) else value


def _set(tree: dict[str, Any], dotted: str, value: str) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ValueError(f"override {dotted}={value}: {key} is not a section")
        node = child
    node[keys[-1]] = _yaml_value(f"override {dotted}={value}", value) if value.strip() else value


def _yaml_value(source: str, text: str) -> Any:
    """``text`` read as YAML; a ValueError naming ``source`` in one line when it is not YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error)
        raise ValueError(f"{source}: not valid YAML ({' '.join(problem.split())})") from None


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """The config in ``path`` (YAML or JSON) with ``key=value`` overrides (dotted keys
    for sections: ``optim.lr=1e-4``; values read as YAML: ``data.paths=[a, b]``)."""

    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"training config {path}: no such file")
        loaded = _yaml_value(f"training config {path}", path.read_text(encoding="utf-8")) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"training config {path}: expected a mapping of options, got {type(loaded).__name__}")
        tree = loaded
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value (dotted keys for sections, e.g. optim.lr=1e-4)")
        _set(tree, key, value)
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as error:
        raise ValueError(f"training config{f' {path}' if path is not None else ''}: {one_line(error)}") from None
