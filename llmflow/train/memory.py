"""The per-device memory plan of a training or generation launch, computed from the model's
shape and the run's settings before any worker starts.

It counts what llmflow really keeps, term by term, on the busiest device:

- Loading: every training rank (and a one-process generation) first builds the whole model
  in fp32 on its device (``load_model``), before pipeline stages are cut and tensor and
  data parallelism shard it.
- Weights: fp32 (the master weights; the optimizer updates them). Tensor parallelism splits
  the decoder layers' matrices ``tp`` ways; the embedding and output projection stay whole
  on every rank of the group. FSDP2 shards everything over ``dp``. Pipeline stages hold
  their layers (``num_layer_list``); stage 0 the embedding, the last the norm and output
  projection, and with tied embeddings the tied matrix as well.
- FSDP2 (``dp > 1`` or a compute dtype other than fp32) all-gathers each layer in the
  compute dtype for its forward and backward: the root unit (embedding, norm, output
  projection) for the whole step, about two layers at a time, and, under pipeline stages
  (resharded only after the step's last backward), the whole stage.
- Gradients: fp32, sharded like the weights; only the trainable ones (LoRA: the adapters).
  Across the micro-batches of a step (gradient accumulation, and always under pp) FSDP2
  keeps each parameter's unsharded gradient in fp32 until the step's last backward.
- Optimizer: AdamW's exp_avg and exp_avg_sq, fp32, sharded like the weights.
- Activations: what autograd keeps of each decoder layer per token (measured on this code's
  kernels, see ``layer_activation_bytes``), times the layers, times the micro-batches a
  pipeline schedule keeps in flight (1F1B: ``pp - stage``; GPipe: all; Interleaved1F1B:
  torch's warm-up count).
- Loss: the fused cross-entropy (``kernels/cross_entropy.py``) computes the output
  projection's gradient during the forward pass into an fp32 [vocab, hidden] buffer and the
  hidden states' gradient, and holds both until backward; logits exist one chunk of rows at
  a time.
- The end of the backward pass: the embedding's backward (the last op of the pass) makes a
  dense [vocab, hidden] gradient while the output projection's gradient (in the same buffer
  with tied embeddings) and every layer's gradient (reduce-scattered by then under FSDP2)
  are held, and under FSDP2 the root unit is still gathered; then FSDP2 reduce-scatters the
  root unit's gradients through an fp32 input and output buffer.
- The optimizer step: weights, gradients and optimizer state; on CPU (AdamW's for-loop
  implementation) also two temporaries the size of the largest parameter (shard), which the
  fused kernels of CUDA and Ascend do not make.

The peak is the largest of four moments: loading, the end of the forward pass (weights,
optimizer state, gathered copies, activations, the loss's buffers, one layer's backward
working set), the end of the backward pass and the optimizer step. The optimizer state is
held at every moment after loading: the first step creates it and every later step's
forward and backward pass run beside it. Sizes are in bytes; the table prints GiB.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from llmflow.models.config import ModelConfig
from llmflow.models.lora import LoraConfig
from llmflow.models.pipeline import layer_split, rank_stages
from llmflow.train.config import TrainConfig

GIB = 2**30
DEVICE_MEMORY_ENV = "LLMFLOW_DEVICE_MEMORY_GB"
"""Environment variable giving the memory of one device in GB (10^9 bytes), to plan for
another machine than this one (a config's ``device_memory_gb`` takes precedence)."""

CHUNK_LOGIT_ELEMENTS = 2**26
"""Elements of one chunk of logits in the fused cross-entropy (kernels/cross_entropy.py)."""

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")

LOAD, ALWAYS, FORWARD, BACKWARD, UPDATE = "load", "always", "compute", "backward end", "optimizer step"
"""When a term is held: while loading, always, while the model computes (training: from the
forward pass until backward frees it; generation: the prompt's pass), at the end of the
backward pass (the embedding's gradient), at the optimizer step."""
MOMENTS = (LOAD, FORWARD, BACKWARD, UPDATE)


@dataclass(frozen=True)
class Term:
    """One thing a device holds."""

    name: str
    bytes: int
    when: str


@dataclass
class MemoryPlan:
    """What one device holds at its peak: ``terms`` and the device's memory."""

    title: str
    terms: list[Term]
    device_bytes: int | None = None
    """Memory of one device (None: unknown, nothing is checked)."""
    device_label: str = ""
    """Where ``device_bytes`` comes from."""
    notes: list[str] = field(default_factory=list)

    def moment(self, when: str) -> int:
        """Bytes held at moment ``when`` (LOAD, FORWARD, BACKWARD or UPDATE)."""
        return sum(t.bytes for t in self.terms if t.when == when or (when != LOAD and t.when == ALWAYS))

    @property
    def peak_moment(self) -> str:
        return max(MOMENTS, key=self.moment)

    @property
    def peak(self) -> int:
        return self.moment(self.peak_moment)

    @property
    def fits(self) -> bool:
        return self.device_bytes is None or self.peak <= self.device_bytes

    def largest(self) -> Term:
        """The largest term held at the peak."""
        moment = self.peak_moment
        held = [t for t in self.terms if t.when == moment or (moment != LOAD and t.when == ALWAYS)]
        return max(held, key=lambda t: t.bytes)

    def table(self) -> str:
        """The plan as a table: term, when it is held, GiB per device, then the peak."""
        width = max(len(t.name) for t in self.terms) + 2
        lines = [self.title, f"  {'term':<{width}}{'held':<16}{'per device':>12}"]
        lines += [f"  {t.name:<{width}}{t.when:<16}{size(t.bytes):>12}" for t in self.terms]
        device = (f"of {size(self.device_bytes)} ({self.device_label})" if self.device_bytes is not None
                  else "(device memory unknown: not checked)")
        verdict = "" if self.device_bytes is None else (": fits" if self.fits else ": DOES NOT FIT")
        lines.append(f"  peak ({self.peak_moment}): {size(self.peak)} {device}{verdict}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def size(count: int) -> str:
    """Bytes in GiB (MiB, KiB below one of those)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


# --- shapes ------------------------------------------------------------------------------


def _linear_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear of a decoder layer."""
    h, f = model.hidden_size, model.intermediate_size
    q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def _targets(lora: LoraConfig | None) -> set[str]:
    """The Linears of a layer ``lora`` adapts (PEFT's matching on the full module name)."""
    if lora is None:
        return set()
    parents = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    found = set()
    for name in COLUMN_PARALLEL + ROW_PARALLEL:
        full = f"model.layers.0.{parents.get(name, 'mlp')}.{name}"
        if any(full == t or full.endswith("." + t) for t in lora.target_modules):
            found.add(name)
    return found


def layer_params(model: ModelConfig, tp: int = 1) -> int:
    """Parameters of one decoder layer on one tensor-parallel rank (norms whole: the two of the
    residual stream and, with ``qk_norm``, the per-head ones of queries and keys)."""
    shapes = _linear_shapes(model)
    weights = sum(i * o for i, o in shapes.values()) // tp
    q, kv, h, f = shapes["q_proj"][1], shapes["k_proj"][1], model.hidden_size, model.intermediate_size
    # Column-parallel biases split with their weights; row-parallel ones stay whole.
    biases = ((q + 2 * kv) * model.qkv_bias + 2 * f * model.mlp_bias) // tp + h * (model.o_bias + model.mlp_bias)
    return weights + biases + 2 * h + 2 * model.head_dim * model.qk_norm


def lora_layer_params(model: ModelConfig, lora: LoraConfig, tp: int = 1) -> int:
    """LoRA adapter parameters of one decoder layer on one tensor-parallel rank: lora_A
    [r, in] and lora_B [out, r]; the side a column- (row-) parallel weight splits is split."""
    total = 0
    for name in _targets(lora):
        i, o = _linear_shapes(model)[name]
        total += lora.rank * (i + o // tp) if name in COLUMN_PARALLEL else lora.rank * (i // tp + o)
    return total


def model_params(model: ModelConfig) -> int:
    """Every parameter of the model (the tied matrix counted once)."""
    vh = model.vocab_size * model.hidden_size
    return model.num_hidden_layers * layer_params(model) + vh * (1 if model.tie_word_embeddings else 2) + model.hidden_size


def layer_activation_bytes(model: ModelConfig, dtype_bytes: int, checkpointing: str = "none", tp: int = 1,
                           lora: LoraConfig | None = None, seq_length: int = 0, documents: bool = False) -> float:
    """Bytes autograd keeps per token of one decoder layer after its forward pass, on one
    tensor-parallel rank (sequence parallel: norms and the residual stream hold 1/tp of the
    tokens; the all-gathered inputs of q/k/v and gate/up, whole).

    none: the fp32 input of each RMSNorm (4 h) and its normalised output (d h, when the norm
    trains), the inputs of q/k/v and gate/up (d h each), rotated q, k, v, attention output
    and its row-major copy for o_proj (d (3 q + 2 kv)), attention's fp32 log-sum-exp, gate,
    up and the SwiGLU output (3 d f); with packed documents the attention mask (d s per
    token); with per-head q/k norms (Qwen3) their fp32 input, normalised output (when they
    train) and fp32 rstd per head. A frozen Linear keeps no input unless its LoRA adapter
    needs it.
    selective: the layer's input, the outputs of every matrix multiplication (o_proj's and
    down_proj's before their reduce-scatter: whole) and attention's output and log-sum-exp.
    full: the layer's input only.
    """
    d, h, f = dtype_bytes, model.hidden_size, model.intermediate_size
    heads = model.num_attention_heads
    q, kv = heads * model.head_dim, model.num_key_value_heads * model.head_dim
    targets = _targets(lora)
    trains = (lambda name: True) if lora is None else (lambda name: name in targets)
    r = lora.rank if lora is not None else 0
    if checkpointing == "full":
        return d * h / tp
    if checkpointing == "selective":
        kept = d * h / tp + d * (q + 2 * kv) / tp + d * q / tp + 4 * heads / tp + 2 * d * h + 2 * d * f / tp
        for name in targets:  # lora_A's and lora_B's outputs are matmuls too
            out = _linear_shapes(model)[name][1]
            kept += d * r + d * (out / tp if name in COLUMN_PARALLEL else out)
        return kept
    norm_trains = lora is None
    kept = 2 * (4 + d * norm_trains) * h / tp + 8 / tp  # two norms (and their fp32 rstd)
    kept += d * h * (trains("q_proj") or trains("k_proj") or trains("v_proj"))
    kept += d * h * (trains("gate_proj") or trains("up_proj"))
    kept += d * (2 * q + 2 * kv) / tp + 4 * heads / tp  # rotated q, k; v; attention output; lse
    kept += d * q / tp * trains("o_proj")
    kept += 2 * d * f / tp + d * f / tp * trains("down_proj")
    kept += d * r * len(targets)
    kept += ((4 + d * norm_trains) * (q + kv) + 4 * (heads + model.num_key_value_heads)) / tp * model.qk_norm
    if documents:
        kept += d * seq_length
    return kept


# --- training ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainShape:
    """The settings of a training run the plan depends on (TrainConfig's, resolved)."""

    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    seq_length: int
    dtype_bytes: int
    """Bytes of the compute dtype: 2 (bf16, fp16) or 4 (fp32)."""
    accumulation: int
    """Micro-batches per step on each rank (the pipeline's micro-batches under pp)."""
    activation_checkpointing: str = "none"
    lora: LoraConfig | None = None
    pp_schedule: str = "1F1B"
    virtual_stages: int | None = None
    num_layer_list: list[int] | None = None
    documents: bool = False
    """Whether the batches carry document ids (sft, or pretrain with document_attention):
    attention then takes an explicit mask."""
    fused_optimizer: bool = True
    """Whether AdamW runs fused (CUDA, NPU: no temporaries) or, on CPU, as a loop over the
    parameters that makes two temporaries the size of each parameter (shard) in turn."""

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 wraps the model (as ``llmflow.train.loop.setup`` decides for a torchrun
        launch, which ``llmflow train`` always is)."""
        return self.dp > 1 or self.dtype_bytes != 4


def in_flight(shape: TrainShape, pp_rank: int) -> int:
    """Micro-batch-chunks whose activations pipeline rank ``pp_rank`` holds at once at its
    peak (torch.distributed.pipelining's 1F1B, GPipe, Interleaved1F1B warm-ups, plus one)."""
    m = shape.accumulation
    if shape.pp == 1:
        return 1
    if shape.pp_schedule == "GPipe":
        return m
    if shape.pp_schedule == "Interleaved1F1B":
        v = shape.virtual_stages or 1
        warmup = (v - 1) * shape.pp + 2 * (shape.pp - 1 - pp_rank)
        return min(warmup + 1, m * v)
    return min(shape.pp - pp_rank, m)


def _stage_plan(model: ModelConfig, shape: TrainShape, pp_rank: int) -> tuple[list[Term], str]:
    d, tp, dp = shape.dtype_bytes, shape.tp, shape.dp
    h, vh = model.hidden_size, model.vocab_size * model.hidden_size
    stages = shape.pp * (shape.virtual_stages or 1)
    split = layer_split(model.num_hidden_layers, stages, shape.num_layer_list)
    held = rank_stages(pp_rank, shape.pp, shape.virtual_stages or 1)
    layers = sum(len(split[i]) for i in held)
    first, last = 0 in held, stages - 1 in held
    tied = model.tie_word_embeddings
    root = vh * (first or (last and tied)) + (h + vh * (not tied)) * last
    base = layers * layer_params(model, tp) + root
    if shape.lora is None:
        trainable = base
        adapters = 0
    else:
        adapters = layers * lora_layer_params(model, shape.lora, tp)
        trainable = adapters
    params = base + adapters
    all_adapters = model.num_hidden_layers * lora_layer_params(model, shape.lora) if shape.lora is not None else 0
    sharded = shape.sharded
    over = f"sharded over dp={dp}" if sharded else "whole"
    terms = [
        Term("model load: whole model, fp32, before sharding", 4 * (model_params(model) + all_adapters), LOAD),
        Term(f"weights: fp32, {over}", 4 * params // (dp if sharded else 1), ALWAYS),
        Term(f"optimizer: AdamW exp_avg + exp_avg_sq, fp32, {over}", 8 * trainable // (dp if sharded else 1), ALWAYS),
        Term(f"gradients: fp32, {over}", 4 * trainable // (dp if sharded else 1), UPDATE),
    ]
    layer_local = layer_params(model, tp) + (lora_layer_params(model, shape.lora, tp) if shape.lora else 0)
    if sharded:
        if shape.pp > 1:
            gathered, what = d * params, "the whole stage (pp keeps it gathered)"
        else:
            gathered, what = d * (root + 2 * layer_local), "root unit + 2 layers"
        terms.append(Term(f"weights gathered by FSDP2, {'bf16' if d == 2 else 'fp32'}: {what}", gathered, FORWARD))
        if shape.accumulation > 1 or shape.pp > 1:
            terms.append(Term("gradients held unsharded across micro-batches, fp32", 4 * trainable, FORWARD))
    elif shape.accumulation > 1:
        terms.append(Term("gradients accumulated across micro-batches, fp32", 4 * trainable, FORWARD))
    flight = in_flight(shape, pp_rank)
    tokens = shape.micro_batch_size * shape.seq_length
    per_layer = layer_activation_bytes(model, d, shape.activation_checkpointing, tp, shape.lora, shape.seq_length,
                                       shape.documents)
    # A pipeline rank's in-flight chunks each hold one stage's layers.
    chunk_layers = layers / len(held)
    activations = per_layer * tokens * chunk_layers * flight
    rotary = 2 * d * model.head_dim * tokens * flight
    boundaries = d * h * tokens / tp * flight * ((not first) + (not last)) if shape.pp > 1 else 0
    ac = shape.activation_checkpointing
    terms.append(Term(f"activations: {chunk_layers:g} layers x {flight} micro-batch(es) x {tokens} tokens, AC {ac}",
                      int(activations + rotary + boundaries), FORWARD))
    working = layer_activation_bytes(model, d, "none", tp, shape.lora, shape.seq_length, shape.documents) * tokens
    if sharded:
        working += (d + 4 + 4 / dp) * layer_local  # a layer's gradient, its fp32 reduce-scatter in and out
    terms.append(Term("backward working set: one layer recomputed / its gradients", int(working), FORWARD))
    if last:
        head_trains = shape.lora is None
        held_losses = shape.accumulation if shape.pp > 1 and shape.pp_schedule == "GPipe" else 1
        rows = min(max(1, CHUNK_LOGIT_ELEMENTS // model.vocab_size), tokens)
        loss = held_losses * (4 * vh * head_trains + d * tokens * h)
        loss += rows * model.vocab_size * (d + 4 + (2 if d == 2 else 0))
        loss += d * vh * head_trains * (d != 4)
        terms.append(Term(f"loss: fused cross-entropy buffers x {held_losses} micro-batch(es)", int(loss), FORWARD))
    if first and shape.lora is None:
        terms += _backward_end(model, shape, layers, root, last)
    if not shape.fused_optimizer:
        largest = _largest_trainable(model, shape, first or last)
        terms.append(Term(f"temporaries of AdamW on CPU: 2 x the largest parameter{' shard' if sharded else ''}, fp32",
                          2 * 4 * largest // (dp if sharded else 1), UPDATE))
    where = f"pipeline rank {pp_rank} of {shape.pp}: " if shape.pp > 1 else ""
    desc = f"{where}{layers} layers{', embedding' if first else ''}{', output projection' if last else ''}"
    return terms, desc


def _backward_end(model: ModelConfig, shape: TrainShape, layers: int, root: int, last: bool) -> list[Term]:
    """What the rank holding the embedding keeps at the end of its backward pass (full
    training): the layers' gradients (each layer's reduce-scattered by then under FSDP2), the
    root unit's gradients held across micro-batches, and either the embedding's backward
    (the gathered root unit, the output projection's gradient from the fused cross-entropy,
    which with tied embeddings waits in the same autograd buffer, and the embedding's dense
    gradient) or, when larger, FSDP2's reduce-scatter of the root unit (its gradients in the
    compute dtype, gathered weights freed, an fp32 input and output)."""
    d, dp, vh = shape.dtype_bytes, shape.dp, model.vocab_size * model.hidden_size
    dtype = "bf16" if d == 2 else "fp32"
    body = 4 * layers * layer_params(model, shape.tp)
    held = shape.accumulation > 1 or shape.pp > 1
    terms = []
    if shape.sharded:
        terms.append(Term(f"gradients of the layers: fp32, sharded over dp={dp} (reduce-scattered by then)",
                          body // dp, BACKWARD))
        if held:
            terms.append(Term("root unit's gradients held unsharded across micro-batches, fp32", 4 * root, BACKWARD))
    elif held:
        terms.append(Term("gradients accumulated across micro-batches, fp32", body + 4 * root, BACKWARD))
    else:
        terms.append(Term("gradients of the layers, fp32", body, BACKWARD))
    head = d * vh if last and (not held or (model.tie_word_embeddings and shape.pp == 1)) else 0
    gathered = d * root if shape.sharded else 0
    reduce = (0 if held else d * root) + 4 * root + 4 * root // dp
    if shape.sharded and reduce > gathered + head + d * vh:
        terms.append(Term("root unit's reduce-scatter: its gradients, the fp32 input and output", reduce, BACKWARD))
        return terms
    if gathered:
        terms.append(Term(f"root unit gathered by FSDP2, {dtype}", gathered, BACKWARD))
    if head:
        tied = " (with the tied embedding's)" if model.tie_word_embeddings else ""
        terms.append(Term(f"output projection's gradient{tied}: [vocab, hidden], {dtype}", head, BACKWARD))
    terms.append(Term(f"embedding's gradient: dense [vocab, hidden], {dtype}", d * vh, BACKWARD))
    return terms


def _largest_trainable(model: ModelConfig, shape: TrainShape, holds_vocab: bool) -> int:
    """Elements of the largest trainable parameter on a tensor-parallel rank (before FSDP2)."""
    shapes = _linear_shapes(model)
    if shape.lora is not None:
        return max(shape.lora.rank * max(shapes[name]) for name in _targets(shape.lora)) if _targets(shape.lora) else 0
    largest = max(i * o for i, o in shapes.values()) // shape.tp
    return max(largest, model.vocab_size * model.hidden_size if holds_vocab else 0)


def train_plan(model: ModelConfig, shape: TrainShape, device_bytes: int | None = None, device_label: str = "",
               name: str = "model") -> MemoryPlan:
    """The memory plan of the busiest device of a training run of ``model`` in ``shape``."""
    plans = []
    for pp_rank in range(shape.pp):
        terms, desc = _stage_plan(model, shape, pp_rank)
        plans.append(MemoryPlan("", terms, device_bytes, device_label))
        plans[-1].title = desc
    plan = max(plans, key=lambda p: p.peak)
    dtype = {2: "bf16", 4: "fp32"}[shape.dtype_bytes]
    mode = "LoRA" if shape.lora is not None else "full"
    plan.title = (
        f"memory plan per device ({name}, {_count(model_params(model))} parameters, {mode} training in {dtype}; "
        f"pp={shape.pp} dp={shape.dp} tp={shape.tp}, micro batch {shape.micro_batch_size} x {shape.seq_length} tokens, "
        f"{shape.accumulation} micro-batch(es) per step; busiest device: {plan.title})"
    )
    return plan


# --- generation --------------------------------------------------------------------------


def generation_plan(model: ModelConfig, tp: int, batch: int, prompt_tokens: int, max_new_tokens: int,
                    padded: bool = False, device_bytes: int | None = None, device_label: str = "",
                    name: str = "model", whole_on_host: bool = False) -> MemoryPlan:
    """The memory plan of one device generating for ``batch`` prompts of up to
    ``prompt_tokens`` tokens plus ``max_new_tokens``: fp32 weights (decoder layers split
    ``tp`` ways, embedding and output projection whole), the KV cache [batch, kv heads / tp,
    prompt + new, head_dim] per layer for keys and values, the prompt's forward pass (one
    layer's working set, the padding mask when prompts differ in length) and the logits.
    ``whole_on_host``: the device is host memory (CPU) and each of the ``tp`` workers first
    loads the whole model there (a Hugging Face directory or a LoRA checkpoint)."""
    h, f, vh = model.hidden_size, model.intermediate_size, model.vocab_size * model.hidden_size
    q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    length = prompt_tokens + max_new_tokens
    weights = model.num_hidden_layers * layer_params(model, tp) + vh * (1 if model.tie_word_embeddings else 2) + h
    tokens = batch * prompt_tokens
    prefill = 4 * tokens * (2 * h + (q + 2 * kv) / tp + 3 * f / tp)
    if padded:
        prefill += 5 * batch * prompt_tokens * prompt_tokens  # boolean mask and its float form
    terms = [
        Term(f"weights: fp32{f', layers split tp={tp}' if tp > 1 else ''}", 4 * weights, ALWAYS),
        Term(f"KV cache: fp32, {batch} x {length} positions x {model.num_hidden_layers} layers",
             2 * 4 * model.num_hidden_layers * batch * (kv // tp) * length, ALWAYS),
        Term(f"prompt forward: one layer's working set ({tokens} tokens)", int(prefill), FORWARD),
        Term("logits and sampling: fp32 [batch, vocab]", 3 * 4 * batch * model.vocab_size, FORWARD),
    ]
    if whole_on_host and tp > 1:
        terms.insert(0, Term("model load: whole model, fp32, beside this worker's shard", 4 * model_params(model)
                             + 4 * weights, LOAD))
    title = (f"memory plan per device ({name}, {_count(model_params(model))} parameters, generation in fp32, "
             f"tp={tp}, {batch} prompt(s) of up to {prompt_tokens} tokens + {max_new_tokens} new)")
    return MemoryPlan(title, terms, device_bytes, device_label)


# --- devices -----------------------------------------------------------------------------


def device_memory(device_type: str, local_ranks: int = 1, override_gb: float | None = None) -> tuple[int | None, str]:
    """(bytes of one device's memory, where that figure comes from): ``override_gb``, else
    the LLMFLOW_DEVICE_MEMORY_GB variable, else the device's total memory (CUDA, NPU), else
    (CPU) the available system memory divided among the ``local_ranks`` workers; None when
    it cannot be found."""
    if override_gb is None and os.environ.get(DEVICE_MEMORY_ENV):
        value = os.environ[DEVICE_MEMORY_ENV]
        try:
            override_gb = float(value)
        except ValueError:
            raise ValueError(f"{DEVICE_MEMORY_ENV}={value!r}: expected a number of GB") from None
        source = DEVICE_MEMORY_ENV
    else:
        source = "device_memory_gb"
    if override_gb is not None:
        if override_gb <= 0:
            raise ValueError(f"{source}={override_gb}: expected a positive number of GB")
        return int(override_gb * 1e9), f"{source}={override_gb:g} GB"
    if device_type == "cpu":
        import psutil

        return psutil.virtual_memory().available // local_ranks, f"available system memory / {local_ranks} worker(s)"
    import torch

    from llmflow import runtime

    if device_type == "npu" and not runtime.npu_available():
        return None, "no NPU visible"
    try:
        props = torch.get_device_module(device_type).get_device_properties(0)
    except (RuntimeError, AssertionError, AttributeError):
        return None, f"no {device_type} device visible"
    return int(props.total_memory), f"{props.name} total memory"


# --- what would fit ----------------------------------------------------------------------


def suggestions(plan_of: Callable[[dict], MemoryPlan | None], current: dict, model: ModelConfig,
                world_size: int) -> list[str]:
    """The smallest change of each setting that makes the plan fit (a larger tp, a larger pp,
    activation checkpointing, a smaller micro batch, LoRA), each with its peak:
    ``plan_of(settings)`` plans ``current`` updated with the settings (None where the layout
    cannot run)."""
    modes = ("none", "selective", "full")
    groups: list[list[tuple[str, dict]]] = [
        [(f"tp={tp}", {"tp": tp}) for tp in (2, 4, 8, 16, 32, 64)
         if tp > current["tp"] and world_size % (tp * current["pp"]) == 0],
        [(f"pp={pp}", {"pp": pp, "num_layer_list": None}) for pp in (2, 4, 8, 16)
         if pp > current["pp"] and world_size % (pp * current["tp"]) == 0 and pp <= model.num_hidden_layers],
        [(f"activation_checkpointing={mode}", {"activation_checkpointing": mode}) for mode in modes
         if modes.index(mode) > modes.index(current["activation_checkpointing"])],
        [(f"micro_batch_size={micro}", {"micro_batch_size": micro})
         for micro in range(current["micro_batch_size"] - 1, 0, -1) if current["micro_batch_size"] % micro == 0],
        [("LoRA (lora: {rank: 8})", {"lora": LoraConfig()})] if current["lora"] is None else [],
    ]
    found = []
    for group in groups:
        for label, change in group:
            plan = plan_of(change)
            if plan is not None and plan.fits:
                found.append(f"{label} ({size(plan.peak)})")
                break
    return found


def generation_suggestions(plan_of: Callable[[int, int, int], MemoryPlan], model: ModelConfig, tp: int, batch: int,
                           max_new_tokens: int) -> list[str]:
    """Single changes that make a generation plan fit: more tensor-parallel workers (dividing
    the heads, KV heads and FFN width), one prompt at a time, fewer new tokens.
    ``plan_of(tp, batch, max_new_tokens)`` plans a variant."""
    found = []
    for more in (2, 4, 8, 16, 32):
        divides = all(n % more == 0 for n in (model.num_attention_heads, model.num_key_value_heads,
                                               model.intermediate_size))
        if more > tp and divides and (plan := plan_of(more, batch, max_new_tokens)).fits:
            found.append(f"--nproc {more} in all ({size(plan.peak)})")
            break
    if batch > 1 and (plan := plan_of(tp, 1, max_new_tokens)).fits:
        found.append(f"--stream, one prompt at a time ({size(plan.peak)})")
    new = max_new_tokens // 2
    while new >= 1:
        if (plan := plan_of(tp, batch, new)).fits:
            found.append(f"--max-new-tokens {new} ({size(plan.peak)})")
            break
        new //= 2
    return found


def refusal(plan: MemoryPlan, fixes: list[str]) -> str:
    """The one line refusing ``plan``: the peak, its largest term and what would fit."""
    big = plan.largest()
    fix = f"fits with {', or '.join(fixes)}" if fixes else "no single change fits; combine them or use more devices"
    return (f"memory: the plan needs {size(plan.peak)} per device ({plan.peak_moment}) but a device has "
            f"{size(plan.device_bytes)} ({plan.device_label}); largest term: {big.name}, {size(big.bytes)}; {fix}")


def train_shape(config: TrainConfig, world_size: int, seq_length: int, device_type: str) -> TrainShape:
    """The plan's view of ``config`` on ``world_size`` ranks of ``device_type`` (its compute
    dtype resolved as the workers resolve it)."""
    from llmflow import runtime
    from llmflow.mesh import ParallelLayout

    layout = ParallelLayout.of_world(world_size, config.pp, config.tp, config.dp)
    dtype = runtime.resolve_dtype(config.dtype, device_type)
    return TrainShape(
        pp=layout.pp, dp=layout.dp, tp=layout.tp, micro_batch_size=config.micro_batch_size, seq_length=seq_length,
        dtype_bytes=dtype.itemsize, accumulation=config.global_batch_size // (config.micro_batch_size * layout.dp),
        activation_checkpointing=config.activation_checkpointing, lora=config.lora, pp_schedule=config.pp_schedule,
        virtual_stages=config.virtual_stages, num_layer_list=config.num_layer_list,
        documents=config.data.kind == "sft" or config.data.document_attention,
        fused_optimizer=device_type in ("cuda", "npu"),
    )
