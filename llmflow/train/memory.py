"""The per-device memory plan of a training or generation launch, computed from the model's
shape and the run's settings before any worker starts.

It counts what llmflow really keeps, term by term, on the busiest device:

- Loading: a training rank builds the model on the meta device, shards it, and reads only its
  own shards from a Hugging Face directory or a full-weight checkpoint
  (``weights/sharded_loading.py``): its shards in fp32 plus one stored tensor in flight (the
  largest; a checkpoint's stacked experts are one tensor, a Hugging Face file's one per
  expert). From a LoRA checkpoint it first builds the whole model in fp32 on its device
  (``load_model``: the base, the adapters merged), before pipeline stages are cut and tensor
  and data parallelism shard it, as a one-process generation does.
- Weights: fp32 (the master weights; the optimizer updates them). Tensor parallelism splits
  the decoder layers' matrices ``tp`` ways; the embedding and output projection stay whole
  on every rank of the group. FSDP2 shards everything over ``dp`` (over dp * cp ranks under
  context parallelism). Pipeline stages hold their layers (``num_layer_list``); stage 0 the
  embedding, the last the norm and output projection, and with tied embeddings the tied
  matrix as well.
- Mixtures of experts: a MoE layer holds its router and every routed expert (and Qwen2-MoE's
  shared expert); the title gives the total and the active parameters (those one token
  computes with: its top-k experts of each layer). With expert parallelism (``ep > 1``, ranks
  carved out of dp) each rank holds num_experts / ep experts of every MoE layer whole, with
  their fp32 gradients and AdamW state, outside FSDP2; everything else is sharded over dp as
  in a dense model. At ``ep = 1`` the experts are FSDP2-sharded with the rest of their layer.
- FSDP2 (``dp * cp > 1`` or a compute dtype other than fp32) all-gathers each layer in the
  compute dtype for its forward and backward: the root unit (embedding, norm, output
  projection) for the whole step, about two layers at a time, and, under pipeline stages
  (resharded only after the step's last backward), the whole stage. Under ``ep > 1`` a MoE
  layer's gather is its other weights, and its local experts are cast to the compute dtype.
- Gradients: fp32, sharded like the weights; only the trainable ones (LoRA: the adapters).
  Across the micro-batches of a step (gradient accumulation, and always under pp) FSDP2
  keeps each parameter's unsharded gradient in fp32 until the step's last backward.
- Optimizer: AdamW's exp_avg and exp_avg_sq, fp32, sharded like the weights.
- Activations: what autograd keeps of each decoder layer per token (measured on this code's
  kernels, see ``layer_activation_bytes``; a MoE layer's for its k routed rows per token),
  summed over the layers, times the micro-batches a pipeline schedule keeps in flight (1F1B:
  ``pp - stage``; GPipe: all; Interleaved1F1B: torch's warm-up count).
- Context parallelism (``cp > 1``): a rank computes seq_length / cp of every sample's tokens,
  and its activations, backward working set, expert dispatch and the loss's hidden-state
  gradient count those, except what attention holds of the whole sequence
  (``layer_activation_bytes``: Ulysses' document mask [B, 1, S, S]; ring's every rank's keys
  and values and the masks of its two chunks).
- Expert dispatch (``ep > 1``): the all-to-all's send and receive buffers, each a micro-batch's
  tokens x top-k rows of hidden in the compute dtype, planned for balanced routing (a rank
  receives as many rows as it sends; a step that favours its experts receives more).
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

LOAD, ALWAYS, FORWARD, BACKWARD, UPDATE, ROLLOUT = (
    "load", "always", "compute", "backward end", "optimizer step", "rollout")
"""When a term is held: while loading, always, while the model computes (training: from the
forward pass until backward frees it; generation: the prompt's pass), at the end of the
backward pass (the embedding's gradient), at the optimizer step, while GRPO samples."""
MOMENTS = (LOAD, FORWARD, BACKWARD, UPDATE, ROLLOUT)


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


DELTANET_COLUMN_PARALLEL = tuple(f"linear_attn.{name}" for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                                     "in_proj_qkvz", "in_proj_ba"))
LATENT_COLUMN_PARALLEL = ("self_attn.q_b_proj", "self_attn.kv_b_proj")
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
                   *DELTANET_COLUMN_PARALLEL, *LATENT_COLUMN_PARALLEL)
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj", "linear_attn.out_proj")
"""The Linears tensor parallelism splits, by their name in a decoder layer (a mixture of
experts' router, experts and shared expert stay whole; a Gated DeltaNet splits by key-head
groups; Multi-head Latent Attention by heads after its down projections ``q_a_proj`` and
``kv_a_proj_with_mqa``, which stay whole, ``models/parallelize.py``)."""
FUSED_DELTANET = ("qwen3_next",)
"""Families whose Gated DeltaNet fuses its projections (``in_proj_qkvz``, ``in_proj_ba``)."""
DELTANET_CHUNK = 64
"""Positions per chunk of the gated delta rule (``kernels/gated_delta.py``): its backward keeps
the fp32 state entering every chunk."""


def _deltanet_dims(model: ModelConfig) -> tuple[int, int, int]:
    """(key dim, value dim, conv channels) of a Gated DeltaNet layer: all heads' widths."""
    key = model.linear_num_key_heads * model.linear_key_head_dim
    value = model.linear_num_value_heads * model.linear_value_head_dim
    return key, value, 2 * key + value


def attention_widths(model: ModelConfig) -> tuple[int, int, int]:
    """(queries, keys, values): the widths of all heads of an attention layer; Multi-head Latent
    Attention's keys and values are those ``kv_b_proj`` expands the latent into, every query head
    with its own key (qk_nope_head_dim + qk_rope_head_dim) and value (v_head_dim)."""
    heads = model.num_attention_heads
    if model.kv_lora_rank:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        return heads * qk, heads * qk, heads * model.v_head_dim
    kv = model.num_key_value_heads * model.head_dim
    return heads * model.head_dim, kv, kv


def kv_cache_width(model: ModelConfig, tp: int = 1) -> int:
    """Elements of keys and values one attention layer caches per position on one of ``tp``
    ranks: each rank its own heads' keys and values; Multi-head Latent Attention its latent and
    rotary key part, which every head shares, whole on every rank (``models/blocks/mla.py``)."""
    if model.kv_lora_rank:
        return model.kv_lora_rank + model.qk_rope_head_dim
    _, k, v = attention_widths(model)
    return (k + v) // tp


def _latent_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of Multi-head Latent Attention's Linears: the queries' (``q_proj``, or
    ``q_a_proj`` and ``q_b_proj`` with a ``q_lora_rank``), the latent's (``kv_a_proj_with_mqa``:
    the latent and the shared rotary key part), its expansion into each head's key part and
    value (``kv_b_proj``) and ``o_proj``."""
    h, (q, _, v) = model.hidden_size, attention_widths(model)
    rank, heads = model.kv_lora_rank, model.num_attention_heads
    if model.q_lora_rank is None:
        query = {"self_attn.q_proj": (h, q)}
    else:
        query = {"self_attn.q_a_proj": (h, model.q_lora_rank), "self_attn.q_b_proj": (model.q_lora_rank, q)}
    return {**query, "self_attn.kv_a_proj_with_mqa": (h, rank + model.qk_rope_head_dim),
            "self_attn.kv_b_proj": (rank, heads * (model.qk_nope_head_dim + model.v_head_dim)),
            "self_attn.o_proj": (v, h)}


def latent_linear_params(model: ModelConfig) -> int:
    """The weights of Multi-head Latent Attention's Linears (``_latent_shapes``), one layer."""
    return sum(i * o for i, o in _latent_shapes(model).values())


def _mixer_shapes(model: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of the token mixer's Linears: attention's four (a gated attention's
    q_proj also emits the gate, as wide as the queries), Multi-head Latent Attention's
    (``_latent_shapes``) or a Gated DeltaNet's projections."""
    h = model.hidden_size
    if model.kv_lora_rank:
        return _latent_shapes(model)
    if model.is_linear_layer(layer):
        key, value, conv = _deltanet_dims(model)
        heads = model.linear_num_value_heads
        if model.model_type in FUSED_DELTANET:
            shapes = {"linear_attn.in_proj_qkvz": (h, 2 * key + 2 * value), "linear_attn.in_proj_ba": (h, 2 * heads)}
        else:
            shapes = {"linear_attn.in_proj_qkv": (h, conv), "linear_attn.in_proj_z": (h, value),
                      "linear_attn.in_proj_b": (h, heads), "linear_attn.in_proj_a": (h, heads)}
        return {**shapes, "linear_attn.out_proj": (value, h)}
    q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    gate = 2 if model.attention_output_gate else 1
    return {"self_attn.q_proj": (h, gate * q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h)}


def _linear_shapes(model: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
    """(in, out) features of each nn.Linear of decoder layer ``layer``, by its name in the
    layer: the token mixer's (``_mixer_shapes``) and a dense layer's SwiGLU; a
    mixture-of-experts layer's shared expert and its gate (Qwen2-MoE, Qwen3-Next, Qwen3.5) or
    its ungated shared experts (DeepSeek-V3, GLM-4.5), its router and stacked experts being no
    Linears."""
    h = model.hidden_size
    shapes = _mixer_shapes(model, layer)
    if not model.is_moe_layer(layer):
        mlp, width = "mlp", model.intermediate_size
    elif model.shared_expert_intermediate_size:
        mlp, width = _shared_expert(model), model.shared_expert_intermediate_size
        if model.shared_expert_gated:
            shapes["mlp.shared_expert_gate"] = (h, 1)
    else:
        return shapes
    shapes.update({f"{mlp}.gate_proj": (h, width), f"{mlp}.up_proj": (h, width), f"{mlp}.down_proj": (width, h)})
    return shapes


def _shared_expert(model: ModelConfig) -> str:
    """The module name of a mixture-of-experts layer's shared expert: ``mlp.shared_expert`` when
    gated, ``mlp.shared_experts`` when not."""
    return "mlp.shared_expert" if model.shared_expert_gated else "mlp.shared_experts"


def _split(name: str, tp: int) -> tuple[int, int]:
    """How tensor parallelism divides the (in, out) features of the Linear ``name``."""
    return (1, tp) if name in COLUMN_PARALLEL else (tp, 1) if name in ROW_PARALLEL else (1, 1)


def _targets(lora: LoraConfig | None, model: ModelConfig, layer: int = 0) -> set[str]:
    """The Linears of layer ``layer`` that ``lora`` adapts (PEFT's matching on the full module
    name: in a mixture-of-experts layer ``gate_proj`` names the shared expert's)."""
    if lora is None:
        return set()
    found = set()
    for name in _linear_shapes(model, layer):
        full = f"model.layers.{layer}.{name}"
        if _matches_any(full, lora.target_modules):
            found.add(name)
    return found


def expert_params(model: ModelConfig) -> int:
    """Parameters of one routed expert: its gate, up and down projections (with
    ``biased_experts``, their biases too)."""
    width, h = model.moe_intermediate_size, model.hidden_size
    return 3 * width * h + (2 * width + h) * model.biased_experts


def layer_experts(model: ModelConfig, layer: int) -> int:
    """Parameters of the routed experts of layer ``layer`` (0 for a dense layer)."""
    return model.num_experts * expert_params(model) if model.is_moe_layer(layer) else 0


def layer_params(model: ModelConfig, tp: int = 1, layer: int = 0) -> int:
    """Parameters of decoder layer ``layer`` on one tensor-parallel rank (norms whole: the two of
    the residual stream, four with ``sandwich_norms``, and, with ``qk_norm``, the per-head ones of
    queries and keys; ``attention_sinks``, one per head; Multi-head Latent Attention's
    ``_latent_extras``). A
    mixture-of-experts layer holds its router [experts, hidden] (and its bias, with
    ``biased_experts``), every routed expert and the
    shared expert with its gate, which tensor parallelism does not split (the sigmoid router's
    fp32 ``e_score_correction_bias`` is a buffer, ``layer_buffers``). A Gated DeltaNet
    holds, beside its Linears, its convolution [channels, 1, kernel], A_log and dt_bias per
    value head (split with its heads) and its gated norm [value head dim] (whole)."""
    h = model.hidden_size
    total = 0
    for name, (i, o) in _linear_shapes(model, layer).items():
        cut_in, cut_out = _split(name, tp)
        total += i * o // (cut_in * cut_out)
    if model.is_linear_layer(layer):
        conv = _deltanet_dims(model)[2]
        total += (conv * model.linear_conv_kernel_dim + 2 * model.linear_num_value_heads) // tp
        total += model.linear_value_head_dim
    elif model.kv_lora_rank:
        total += _latent_extras(model)
    else:
        q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
        gate = 2 if model.attention_output_gate else 1
        # Column-parallel biases split with their weights; row-parallel ones stay whole.
        total += (gate * q + 2 * kv) * model.qkv_bias // tp + h * model.o_bias
        total += 2 * model.head_dim * model.qk_norm
        total += model.num_attention_heads // tp * model.attention_sinks  # split with the heads
    if model.is_moe_layer(layer):
        total += model.num_experts * (h + model.biased_experts) + layer_experts(model, layer)
    else:
        total += 2 * model.intermediate_size * model.mlp_bias // tp + h * model.mlp_bias
    return total + _layer_norms(model) * h


def _latent_extras(model: ModelConfig) -> int:
    """Multi-head Latent Attention's parameters beside its Linears' weights, all whole under tp:
    the latent norms (``q_a_layernorm`` [q_lora_rank], ``kv_a_layernorm`` [kv_lora_rank]) and,
    with ``attention_bias``, the biases of ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``
    (``q_proj`` and ``q_b_proj`` have none)."""
    query = model.q_lora_rank or 0
    norms = query + model.kv_lora_rank
    return norms + (query + model.kv_lora_rank + model.qk_rope_head_dim) * model.qkv_bias + \
        model.hidden_size * model.o_bias


def layer_buffers(model: ModelConfig, layer: int) -> int:
    """Elements of the fp32 buffers of decoder layer ``layer`` that every rank holds whole
    (FSDP2 shards parameters only): the sigmoid router's ``e_score_correction_bias`` [experts]."""
    return model.num_experts * (model.router_scoring == "sigmoid" and model.is_moe_layer(layer))


def _layer_norms(model: ModelConfig) -> int:
    """RMSNorms of [hidden] weights in a decoder layer: before attention and the MLP, and with
    ``sandwich_norms`` (Gemma 3) after them too."""
    return 4 if model.sandwich_norms else 2


def expert_lora_params(model: ModelConfig, lora: LoraConfig, layer: int) -> int:
    """The parameters of the adapters ``lora.target_parameters`` puts on layer ``layer``'s routed
    experts: r (in + out) per expert of each weight it names (``gate_up_proj``: hidden ->
    2 moe_intermediate_size; ``down_proj``: back)."""
    if not model.is_moe_layer(layer):
        return 0
    h, width = model.hidden_size, model.moe_intermediate_size
    features = {"gate_up_proj": h + 2 * width, "down_proj": width + h}
    return sum(model.num_experts * lora.rank * size for target, size in features.items()
               if _matches_any(f"model.layers.{layer}.mlp.experts.{target}", lora.target_parameters))


def _matches_any(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_layer_params(model: ModelConfig, lora: LoraConfig, tp: int = 1, layer: int = 0) -> int:
    """LoRA adapter parameters of decoder layer ``layer`` on one tensor-parallel rank: lora_A
    [r, in] and lora_B [out, r]; the side a column- (row-) parallel weight splits is split.
    The routed experts' adapters (``expert_lora_params``), which tensor parallelism does not
    split, count too."""
    total = expert_lora_params(model, lora, layer)
    shapes = _linear_shapes(model, layer)
    for name in _targets(lora, model, layer):
        (i, o), (cut_in, cut_out) = shapes[name], _split(name, tp)
        total += lora.rank * (i // cut_in + o // cut_out)
    return total


def largest_stored_tensor(model: ModelConfig, source: str = "checkpoint") -> int:
    """Elements of the largest tensor a loading rank reads at once: the embedding (or output
    projection), a layer's largest Linear, or the routed experts of a layer's projection,
    stored stacked in a checkpoint ([experts, out, in], which DCP reads whole) and one per
    expert in a Hugging Face directory."""
    largest = model.vocab_size * model.hidden_size
    for layer in range(model.num_hidden_layers):
        largest = max([largest, *(i * o for i, o in _linear_shapes(model, layer).values())])
        if model.is_moe_layer(layer):
            experts = model.num_experts if source == "checkpoint" else 1
            largest = max(largest, experts * model.moe_intermediate_size * model.hidden_size)
    return largest


def root_params(model: ModelConfig) -> int:
    """The embedding, the final norm and the output projection (the tied matrix once)."""
    return model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2) + model.hidden_size


def model_params(model: ModelConfig) -> int:
    """Every parameter of the model (the tied matrix counted once)."""
    return sum(layer_params(model, 1, i) for i in range(model.num_hidden_layers)) + root_params(model)


def active_params(model: ModelConfig) -> int:
    """The parameters one token computes with: everything but the routed experts it is not
    sent to (its ``num_experts_per_tok`` of each mixture-of-experts layer count); all of a
    dense model's."""
    unused = (model.num_experts - model.num_experts_per_tok) * expert_params(model)
    return model_params(model) - unused * sum(model.is_moe_layer(i) for i in range(model.num_hidden_layers))


def layer_activation_bytes(model: ModelConfig, dtype_bytes: int, checkpointing: str = "none", tp: int = 1,
                           lora: LoraConfig | None = None, seq_length: int = 0, documents: bool = False,
                           layer: int = 0, cp: int = 1, cp_algo: str = "ulysses", batch: int = 1) -> float:
    """Bytes autograd keeps per token of decoder layer ``layer`` after its forward pass, on one
    tensor-parallel rank (sequence parallel: norms and the residual stream hold 1/tp of the
    tokens; the all-gathered inputs of q/k/v and gate/up, whole), per token of the rank's
    sequence shard under context parallelism (``cp``).

    none: the fp32 input of each RMSNorm (4 h) and its normalised output (d h, when the norm
    trains), the inputs of q/k/v and gate/up (d h each), rotated q, k, v, attention output
    and its row-major copy for o_proj (d (3 q + 2 kv)), attention's fp32 log-sum-exp, gate,
    up and the SwiGLU output (3 d f; a GeGLU keeps the same); with packed documents, or a
    layer's sliding window shorter than the sequence, the attention mask (d s per token; a
    window's alone is [1, 1, s, s], d s / B); the four norms of ``sandwich_norms`` (Gemma 3) as
    the two; with per-head q/k norms (Qwen3) their fp32 input, normalised output (when they
    train) and fp32 rstd per head. A frozen Linear keeps no input unless its LoRA adapter
    needs it. A mixture-of-experts layer keeps, in place of the SwiGLU, ``_moe_bytes``.
    selective: the layer's input, the outputs of every matrix multiplication (o_proj's and
    down_proj's before their reduce-scatter: whole) and attention's output and log-sum-exp.
    A mixture-of-experts layer's router logits and shared expert are matrix multiplications;
    its experts' grouped matmuls are not among the operations selective checkpointing keeps
    (``SAVED_OPS``): they are recomputed.
    full: the layer's input only.

    Qwen3-Next and Qwen3.5: their zero-centred norms keep an fp32 normalised output (4 h, when
    they train); a gated attention also keeps the sigmoid of its gate and the attention
    output it scales (2 d q); a Gated DeltaNet layer keeps ``_deltanet_bytes`` in place of
    attention's terms.

    Context parallelism (``models/context_parallel.py``), per token of the rank's S/cp
    (``batch`` rows of S = ``seq_length``), without checkpointing:

    - ulysses: attention keeps q, k, v and its output as [B, H/cp, S, D] after the all-to-all,
      as many elements as [B, H, S/cp, D], so the same bytes per token; but when cp does not
      divide the key/value heads (of a tp rank) they are repeated to one per query head first,
      and k and v are kept as wide as q. The document mask is built over the whole sequence,
      [B, 1, S, S] on every cp rank: d s cp per token.
    - ring: attention keeps every rank's keys and values, the whole sequence's (2 d kv cp per
      token), and each of the rank's two query chunks of L = S/2cp positions attends over the
      keys up to its end with an explicit mask, [B, 1, L, end] with documents, [1, 1, L, end]
      causal alone (a first chunk attending to itself alone takes none): the two ends add up
      to (2 cp + 1) L on the busiest rank.

    Selective and full checkpointing keep the same per token as at cp = 1 (attention's output
    and log-sum-exp are as many elements either way).
    """
    d, h, f = dtype_bytes, model.hidden_size, model.intermediate_size
    heads = model.num_attention_heads
    q, kv = heads * model.head_dim, model.num_key_value_heads * model.head_dim
    moe = model.is_moe_layer(layer)
    linear = model.is_linear_layer(layer)
    gated = model.attention_output_gate
    shapes = _linear_shapes(model, layer)
    targets = _targets(lora, model, layer)
    trains = (lambda name: name in shapes) if lora is None else (lambda name: name in targets)
    r = lora.rank if lora is not None else 0
    if checkpointing == "full":
        return d * h / tp
    if checkpointing == "selective":
        if linear:
            kept = d * h / tp + _deltanet_selective_bytes(model, d, tp)
        elif model.kv_lora_rank:
            kept = d * h / tp + _latent_selective_bytes(model, d, tp)
        else:
            kept = d * h / tp + d * ((1 + gated) * q + 2 * kv) / tp + d * q / tp + 4 * heads / tp + d * h
        if moe:  # the router's logits (the sigmoid router's fp32); the shared expert's gate, up, down (and gate) outputs
            s, gate = model.shared_expert_intermediate_size, model.shared_expert_gated
            kept += (4 if model.router_scoring == "sigmoid" else d) * model.num_experts
            kept += d * (2 * s + h + gate) if s else 0
        else:
            kept += d * h + 2 * d * f / tp
        for name in targets:  # lora_A's and lora_B's outputs are matmuls too
            out = shapes[name][1]
            kept += d * r + d * (out / tp if name in COLUMN_PARALLEL else out)
        return kept
    norm_trains = lora is None
    normalised = 4 if model.zero_centered_norms else d  # the normalised output the weight's gradient needs
    norms = _layer_norms(model)
    kept = norms * ((4 + normalised * norm_trains) * h + 4) / tp  # the fp32 input, output and rstd of each
    if linear:
        kept += _deltanet_bytes(model, d, tp, norm_trains, trains)
    else:
        ring = cp > 1 and cp_algo == "ring"
        if model.kv_lora_rank:
            kept += _latent_bytes(model, d, tp, norm_trains, trains)
        else:
            kept += d * h * any(trains(f"self_attn.{p}_proj") for p in "qkv")
            if ring:  # every rank's keys and values
                attended = kv * cp
            elif model.num_key_value_heads // tp % cp:  # repeated to the query heads before Ulysses' all-to-all
                attended = q
            else:
                attended = kv
            kept += d * (2 * q + 2 * attended) / tp + 4 * heads / tp  # rotated q, k; v; attention output; lse
            kept += d * q / tp * trains("self_attn.o_proj")
            kept += 2 * d * q / tp * gated  # the gate's sigmoid and the output it scales
            # In fp32 the q norm's input is a view of q_proj's output, which keeps the gate's half too.
            kept += d * q / tp * (gated and model.qk_norm and d == 4)
            kept += ((4 + normalised * norm_trains) * (q + kv) + 4 * (heads + model.num_key_value_heads)) / tp \
                * model.qk_norm
        if ring:  # masks of (2 cp + 1) L x L elements, one row of them without documents, over the B 2L tokens
            kept += d * seq_length / (2 * cp) * (2 * cp + 1) / 2 / (1 if documents else batch)
        elif documents:
            kept += d * seq_length * cp
        elif (window := model.layer_window(layer)) is not None and seq_length > window:
            kept += d * seq_length * cp / batch
    if moe:
        kept += _moe_bytes(model, d, lora, trains)
    else:
        kept += d * h * (trains("mlp.gate_proj") or trains("mlp.up_proj"))
        kept += 2 * d * f / tp + d * f / tp * trains("mlp.down_proj")
    kept += d * r * len(targets)
    return kept


def _latent_bytes(model: ModelConfig, d: int, tp: int, norm_trains: bool, trains: Callable[[str], bool]) -> float:
    """Bytes per token Multi-head Latent Attention (``models/blocks/mla.py``) keeps for its
    backward pass, no checkpointing, on one tensor-parallel rank (its heads / tp; the down
    projections and their norms computed whole on every rank):

    - its input (d h), when ``q_a_proj`` (``q_proj``), ``kv_a_proj_with_mqa`` or an adapter
      trains;
    - ``q_a_layernorm`` and ``kv_a_layernorm``: their fp32 input (4 q_lora_rank, 4 kv_lora_rank;
      in fp32 the latent's is a view of ``kv_a_proj_with_mqa``'s output, which keeps its rotary
      part too), rstd (4 each) and normalised output (d each, when they train), and their
      outputs, the inputs of ``q_b_proj`` and ``kv_b_proj`` (d each, when these train);
    - q and k, every head's no-rotary part and rotated part (2 d H qk_head_dim), v as a view of
      ``kv_b_proj``'s output, which keeps each head's key part too (d H (qk_nope_head_dim +
      v_head_dim)), the attention output (d H v_head_dim), its fp32 log-sum-exp (4 H) and its
      row-major copy for ``o_proj`` (d H v_head_dim, when it trains).

    Measured on CPU with v_head_dim = qk_head_dim: there attention takes its fused kernel only
    when the two are equal (DeepSeek-V3's 128 and 192 take the math path, which keeps the
    [H, S, S] probabilities; accelerators' memory-efficient kernels take different widths)."""
    h, (q, k, v) = model.hidden_size, attention_widths(model)
    heads, rank, query = model.num_attention_heads, model.kv_lora_rank, model.q_lora_rank or 0
    expanded = heads * (model.qk_nope_head_dim + model.v_head_dim)
    down = ("self_attn.q_a_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa")
    kept = d * h * any(trains(name) for name in down)
    latent_input = 4 * rank + 4 * model.qk_rope_head_dim * (d == 4)
    kept += 4 * query + latent_input + 4 * (1 + (query > 0)) + d * (query + rank) * norm_trains
    kept += d * query * trains("self_attn.q_b_proj") + d * rank * trains("self_attn.kv_b_proj")
    kept += (d * (q + k + expanded + v) + 4 * heads) / tp
    kept += d * v / tp * trains("self_attn.o_proj")
    return kept


def _latent_selective_bytes(model: ModelConfig, d: int, tp: int) -> float:
    """Bytes per token selective checkpointing keeps of Multi-head Latent Attention: the outputs
    of its projections (``q_a_proj``'s and ``kv_a_proj_with_mqa``'s whole, ``q_b_proj``'s or
    ``q_proj``'s and ``kv_b_proj``'s of this rank's heads), attention's output and log-sum-exp,
    and ``o_proj``'s output (d h, before its reduce-scatter)."""
    h, (q, _, v) = model.hidden_size, attention_widths(model)
    heads = model.num_attention_heads
    down = (model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_rope_head_dim
    expanded = heads * (model.qk_nope_head_dim + model.v_head_dim)
    return d * down + (d * (q + expanded + v) + 4 * heads) / tp + d * h


def _deltanet_bytes(model: ModelConfig, d: int, tp: int, norm_trains: bool, trains: Callable[[str], bool]) -> float:
    """Bytes per token a Gated DeltaNet (``models/blocks/gated_deltanet.py``) keeps for its
    backward pass, no checkpointing, on one tensor-parallel rank (its heads / tp):

    - its input (d h), when a projection or an adapter trains;
    - the convolution's input and output and the SiLU's output (3 d C, C = 2 Dk Hk + Dv Hv
      channels; the gated delta rule keeps v as a view of the last);
    - q and k repeated to the value heads (2 d Hv Dk), beta (d Hv), the decay's fp32 softplus
      input and output and the decay itself (12 Hv);
    - the gated delta rule's state entering every chunk of 64 positions, fp32 [Hv, Dk, Dv]:
      4 Hv Dk Dv / 64 per token (``kernels/gated_delta.py``; its inputs are the tensors above);
    - the gated norm: its fp32 input and rstd (4 Dv Hv + 4 Hv), the normalised output (d Dv Hv,
      when its weight trains), the weighted output, the gate in fp32 and its SiLU
      ((d + 8) Dv Hv);
    - out_proj's input (d Dv Hv, when it trains).

    The recurrent state between layers and the generation cache are no part of training."""
    h, (_, value, conv) = model.hidden_size, _deltanet_dims(model)
    heads, dk = model.linear_num_value_heads, model.linear_key_head_dim
    kept = d * h * any(trains(name) for name in DELTANET_COLUMN_PARALLEL)
    kept += (3 * d * conv + 2 * d * heads * dk + d * heads + 12 * heads) / tp
    kept += 4 * heads * dk * model.linear_value_head_dim / DELTANET_CHUNK / tp
    kept += (4 * value + 4 * heads + d * value * norm_trains + (d + 8) * value) / tp
    kept += d * value / tp * trains("linear_attn.out_proj")
    return kept


def _deltanet_selective_bytes(model: ModelConfig, d: int, tp: int) -> float:
    """Bytes per token selective checkpointing keeps of a Gated DeltaNet: the outputs of its
    projections (d (C + Dv Hv + 2 Hv) / tp) and of out_proj (d h, before its reduce-scatter).
    The matrix multiplications inside the gated delta rule's forward run with grad mode off
    and are not kept (``_keep_heavy_ops``, ``models/parallelize.py``)."""
    h, (_, value, conv) = model.hidden_size, _deltanet_dims(model)
    return d * (conv + value + 2 * model.linear_num_value_heads) / tp + d * h


def _moe_bytes(model: ModelConfig, d: int, lora: LoraConfig | None, trains: Callable[[str], bool]) -> float:
    """Bytes per token a mixture-of-experts block keeps for its backward pass (no
    checkpointing; ``models/blocks/moe.py``), its k (token, choice) rows counted as routed,
    each token to k experts:

    - its input (d h), when the router, a shared-expert Linear or its adapter trains; the
      sigmoid router (DeepSeek-V3, GLM-4.5) computes its logits in fp32 and keeps, when it
      trains, the input's fp32 copy too (4 h in bf16; in fp32 it is the input itself);
    - the router's fp32 probabilities (4 E; the sigmoid router's scores), the top-k indices (8 k) and, when the top-k
      weights are renormalised, their fp32 values and sum (4 k + 4); the rows' order and
      source token (16 k, int64); the routing weights gathered per row (d k);
    - per row: the token's hidden state gathered for the experts (d h, when the experts
      train), gate and up (2 d I), the SwiGLU output the routing weight multiplies (d I) and
      their product, the down projection's input (d I, when the experts train), and the down
      projection's output, which index_add keeps (d h);
    - the shared expert as a dense SwiGLU of its width; a gated one's (Qwen2-MoE) output (d h)
      and its sigmoid gate (d), which scales it (DeepSeek-V3's and GLM-4.5's are added as they
      are).
    """
    h, k, width = model.hidden_size, model.num_experts_per_tok, model.moe_intermediate_size
    experts_train = lora is None
    shared, gated = _shared_expert(model), model.shared_expert_gated
    s = model.shared_expert_intermediate_size
    inputs = lora is None or any(trains(name) for name in (f"{shared}.gate_proj", f"{shared}.up_proj", f"{shared}_gate"))
    kept = d * h * inputs + 4 * model.num_experts + 8 * k + (4 * k + 4) * model.norm_topk_prob + 16 * k + d * k
    kept += 4 * h * (d != 4 and model.router_scoring == "sigmoid" and experts_train)
    kept += k * (d * h * experts_train + 3 * d * width + d * width * experts_train + d * h)
    if s:
        kept += 2 * d * s + d * s * trains(f"{shared}.down_proj") + (d * h + d) * gated
    return kept


# --- training ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutShape:
    """What a GRPO run's rollouts hold on one rank (``seq_length`` is the longest prompt plus
    max_completion_length)."""

    rows: int
    """Completions sampled at once (the KV cache's rows)."""
    buffered: int
    """Completions of the generation batch this rank keeps (ids, old and reference log-probs)."""
    reference: bool
    """Whether a frozen reference model is held (beta > 0 with full weights)."""
    kl: bool
    """Whether reference log-probs are kept (beta > 0)."""


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
    ep: int = 1
    """Expert-parallel degree of a mixture of experts, carved out of the dp ranks: each rank
    holds num_experts / ep experts of every MoE layer whole (weights, gradients, optimizer
    state), outside FSDP2, and exchanges its tokens' rows with the others by all-to-all.
    1: the experts are FSDP2-sharded over dp with the rest of their layer."""
    source: str = "checkpoint"
    """What ``config.model`` is: "checkpoint" (a full-weight training checkpoint) or "hf" (a
    Hugging Face directory), whose shards each rank loads alone; "lora" (a LoRA checkpoint),
    whose base every rank loads whole before sharding."""
    cp: int = 1
    """Context-parallel degree: each rank holds seq_length / cp of every sample's tokens; FSDP2
    shards over dp * cp ranks."""
    cp_algo: str = "ulysses"
    """How attention reaches the other cp ranks' positions: "ulysses" or "ring" (TrainConfig's)."""
    per_token_loss: bool = False
    """Whether the objective takes every token's cross-entropy (dpo, simpo, orpo, grpo), computed a
    chunk of rows at a time and recomputed in backward, instead of the fused summed loss."""
    rollout: RolloutShape | None = None
    """GRPO: what its rollouts and generation buffer hold."""

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 wraps the model (as ``llmflow.train.loop.setup`` decides for a torchrun
        launch, which ``llmflow train`` always is)."""
        return self.dp * self.cp > 1 or self.dtype_bytes != 4

    @property
    def fsdp_ranks(self) -> int:
        """The ranks FSDP2 shards the weights, gradients and optimizer state over: dp * cp."""
        return self.dp * self.cp

    @property
    def fsdp_label(self) -> str:
        """``fsdp_ranks`` as the plan names it."""
        return f"dp={self.dp}" if self.cp == 1 else f"dp*cp={self.dp}*{self.cp}={self.fsdp_ranks}"

    @property
    def tokens(self) -> int:
        """Tokens of a micro-batch on one rank: its 1/cp of every sample's."""
        return self.micro_batch_size * self.seq_length // self.cp


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
    d, tp, ep = shape.dtype_bytes, shape.tp, shape.ep
    h, vh = model.hidden_size, model.vocab_size * model.hidden_size
    stages = shape.pp * (shape.virtual_stages or 1)
    split = layer_split(model.num_hidden_layers, stages, shape.num_layer_list)
    held = rank_stages(pp_rank, shape.pp, shape.virtual_stages or 1)
    indices = [i for stage in held for i in split[stage]]
    layers = len(indices)
    first, last = 0 in held, stages - 1 in held
    tied = model.tie_word_embeddings
    root = vh * (first or (last and tied)) + (h + vh * (not tied)) * last
    sharded = shape.sharded
    shard = shape.fsdp_ranks if sharded else 1
    lora = shape.lora
    # Under expert parallelism (ep > 1) each rank holds 1/ep of every MoE layer's experts whole,
    # outside FSDP2; everything else (and at ep = 1 the experts too) is sharded over dp * cp.
    # The experts' adapters go with their experts.
    experts = [layer_experts(model, i) if ep > 1 else 0 for i in indices]
    adapters = [lora_layer_params(model, lora, tp, i) if lora is not None else 0 for i in indices]
    expert_adapters = [expert_lora_params(model, lora, i) if lora is not None and ep > 1 else 0 for i in indices]
    local = [(e + x) // ep for e, x in zip(experts, expert_adapters, strict=True)]
    unit = [layer_params(model, tp, i) - e + a - x
            for i, e, a, x in zip(indices, experts, adapters, expert_adapters, strict=True)]
    params = sum(unit) + root  # sharded over dp * cp
    trainable = params if lora is None else sum(adapters) - sum(expert_adapters)
    local_trainable = sum(local) if lora is None else sum(expert_adapters) // ep
    all_adapters = sum(lora_layer_params(model, lora, 1, i) for i in range(model.num_hidden_layers)) if lora else 0
    over = f"sharded over {shape.fsdp_label}" if sharded else "whole"
    if sum(local):
        over += f"; this rank's {model.num_experts // ep} of {model.num_experts} experts whole (ep={ep})"
    weights = 4 * params // shard + 4 * sum(local) + 4 * sum(layer_buffers(model, i) for i in indices)
    if shape.source == "lora":
        load = Term("model load: whole model, fp32, before sharding (a LoRA checkpoint's base)",
                    4 * (model_params(model) + all_adapters), LOAD)
    else:
        load = Term(f"model load: this rank's shards, fp32, + the largest stored tensor in flight "
                    f"({'a checkpoint' if shape.source == 'checkpoint' else 'a Hugging Face directory'})",
                    weights + 4 * largest_stored_tensor(model, shape.source), LOAD)
    terms = [
        load,
        Term(f"weights: fp32, {over}", weights, ALWAYS),
        Term(f"optimizer: AdamW exp_avg + exp_avg_sq, fp32, {over}", 8 * trainable // shard + 8 * local_trainable,
             ALWAYS),
        Term(f"gradients: fp32, {over}", 4 * trainable // shard + 4 * local_trainable, UPDATE),
    ]
    # The local experts need a copy in the compute dtype for their forward and backward (none in fp32).
    cast = d if d != 4 else 0
    if sharded:
        if shape.pp > 1:
            gathered, what = d * params + cast * sum(local), "the whole stage (pp keeps it gathered)"
        else:
            gathered, what = d * root + 2 * max(d * u + cast * e for u, e in zip(unit, local, strict=True)), \
                "root unit + 2 layers"
        if sum(local):
            what += ", this rank's experts cast, not gathered"
        terms.append(Term(f"weights gathered by FSDP2, {'bf16' if d == 2 else 'fp32'}: {what}", gathered, FORWARD))
        if shape.accumulation > 1 or shape.pp > 1:
            terms.append(Term("gradients held unsharded across micro-batches, fp32", 4 * (trainable + local_trainable),
                              FORWARD))
    elif shape.accumulation > 1:
        terms.append(Term("gradients accumulated across micro-batches, fp32", 4 * trainable, FORWARD))
    flight = in_flight(shape, pp_rank)
    tokens = shape.tokens

    def activation(mode: str, layer: int) -> float:
        return layer_activation_bytes(model, d, mode, tp, lora, shape.seq_length, shape.documents, layer, shape.cp,
                                      shape.cp_algo, shape.micro_batch_size)

    # A pipeline rank's in-flight chunks each hold one stage's layers.
    chunk_layers = layers / len(held)
    activations = sum(activation(shape.activation_checkpointing, i) for i in indices) / len(held) * tokens * flight
    tables = 1 + (model.sliding_rope_theta is not None)  # the sliding-window layers' own cos and sin (Gemma 3)
    rotary = 2 * d * model.head_dim * tokens * flight * tables
    boundaries = d * h * tokens / tp * flight * ((not first) + (not last)) if shape.pp > 1 else 0
    ac = shape.activation_checkpointing
    part = f" (1/{shape.cp} of {shape.micro_batch_size * shape.seq_length})" if shape.cp > 1 else ""
    terms.append(Term(f"activations: {chunk_layers:g} layers x {flight} micro-batch(es) x {tokens} tokens{part}, "
                      f"AC {ac}", int(activations + rotary + boundaries), FORWARD))
    working = 0.0
    for i, u, e in zip(indices, unit, local, strict=True):
        layer_working = activation("none", i) * tokens
        if sharded:  # a layer's gradient, its fp32 reduce-scatter in and out; the local experts' in d and fp32
            layer_working += (d + 4 + 4 / shard) * u + (cast + 4) * e * (lora is None)
        working = max(working, layer_working)
    if shape.cp > 1 and shape.cp_algo == "ring":
        whole = ", every cp rank's keys and values"
    elif shape.cp > 1 and shape.documents:
        whole = f", the document mask over all {shape.seq_length} positions"
    else:
        whole = ""
    terms.append(Term(f"backward working set: one layer recomputed / its gradients{whole}", int(working), FORWARD))
    linear = sum(model.is_linear_layer(i) for i in indices)
    if tp > 1 and linear:
        # Under tp a Gated DeltaNet gathers in_proj_qkv and conv1d whole and computes with this
        # rank's rows (models/parallelize.py, HeadGroupRows): one layer's gathered weights and
        # their gradient before its reduce-scatter; without checkpointing each layer's rows stay
        # for backward.
        conv = _deltanet_dims(model)[2]
        whole = d * conv * (h + model.linear_conv_kernel_dim)
        kept = whole / tp * linear / len(held) * flight if ac == "none" else 0
        what = "one layer's and its gradient" + (", each layer's rows kept for backward" if kept else "")
        terms.append(Term(f"Gated DeltaNet in_proj_qkv and conv1d gathered under tp: {what}", int(2 * whole + kept),
                          FORWARD))
    if ep > 1 and any(model.is_moe_layer(i) for i in indices):
        rows = tokens * model.num_experts_per_tok
        terms.append(Term(f"expert dispatch: all-to-all send and receive buffers, {rows} rows x hidden "
                          f"(balanced routing), {'bf16' if d == 2 else 'fp32'}", 2 * d * rows * h, FORWARD))
    if last and shape.per_token_loss:
        # One chunk's logits, fp32 copy, log-softmax and its gradient; the hidden states' and
        # the output projection's gradients.
        rows = min(max(1, CHUNK_LOGIT_ELEMENTS // model.vocab_size), tokens)
        loss = rows * model.vocab_size * (d + 12 + _soft_cap_bytes(model)) + d * tokens * h + d * vh * (lora is None)
        terms.append(Term("loss: per-token cross-entropy of a sequence objective (dpo, simpo, orpo, grpo), one "
                          "chunk of logits recomputed in backward", int(loss), FORWARD))
    elif last:
        head_trains = lora is None
        held_losses = shape.accumulation if shape.pp > 1 and shape.pp_schedule == "GPipe" else 1
        rows = min(max(1, CHUNK_LOGIT_ELEMENTS // model.vocab_size), tokens)
        loss = held_losses * (4 * vh * head_trains + d * tokens * h)
        loss += rows * model.vocab_size * (d + 4 + (2 if d == 2 else 0) + _soft_cap_bytes(model))
        loss += d * vh * head_trains * (d != 4)
        terms.append(Term(f"loss: fused cross-entropy buffers x {held_losses} micro-batch(es)", int(loss), FORWARD))
    if first and lora is None:
        terms += _backward_end(model, shape, sum(unit), sum(local), root, last)
    if shape.rollout is not None:
        terms += _rollout_terms(model, shape, indices, weights, over)
    where = f"pipeline rank {pp_rank} of {shape.pp}: " if shape.pp > 1 else ""
    desc = f"{where}{layers} layers{', embedding' if first else ''}{', output projection' if last else ''}"
    return terms, desc


def _soft_cap_bytes(model: ModelConfig) -> int:
    """Bytes per element of a chunk of logits the final-logit soft cap adds: the capped logits
    and one temporary, fp32."""
    return 8 if model.final_logit_softcapping is not None else 0


def _rollout_terms(model: ModelConfig, shape: TrainShape, indices: list[int], weights: int, over: str) -> list[Term]:
    """What GRPO adds: the rollout's KV cache and logits (while it samples, the weights
    gathered layer by layer as in a forward pass), the generation buffer of this rank's
    completions (ids, targets, masks, old and reference log-probs) and, with beta > 0 and
    full weights, the frozen reference model sharded as the policy."""
    r, d, length = shape.rollout, shape.dtype_bytes, shape.seq_length
    attention = sum(not model.is_linear_layer(i) for i in indices)
    kv = kv_cache_width(model, shape.tp)  # a tensor-parallel rank caches its own heads
    dtype = "bf16" if d == 2 else "fp32"
    terms = [
        Term(f"rollout KV cache: {dtype}, {r.rows} completions x {length} positions x {attention} layers",
             d * attention * r.rows * kv * length, ROLLOUT),
        Term("rollout logits and sampling: fp32 [completions, vocab]", 4 * 4 * r.rows * model.vocab_size, ROLLOUT),
        Term(f"generation buffer: {r.buffered} completions x {length} positions (ids, targets, masks, "
             f"old{' and reference' if r.kl else ''} log-probs)", r.buffered * length * (8 * 3 + 4 * (2 + r.kl)),
             ALWAYS),
    ]
    if r.reference:
        terms.append(Term(f"reference model (beta > 0): fp32 weights, {over}", weights, ALWAYS))
    if shape.sharded:
        layer = max(layer_params(model, shape.tp, i) for i in indices)
        terms.append(Term(f"weights gathered by FSDP2 while sampling, {dtype}: one layer", d * layer, ROLLOUT))
    return terms


def _backward_end(model: ModelConfig, shape: TrainShape, body: int, local: int, root: int, last: bool) -> list[Term]:
    """What the rank holding the embedding keeps at the end of its backward pass (full
    training): the layers' gradients (each layer's reduce-scattered by then under FSDP2; the
    ``local`` experts' whole), the root unit's gradients held across micro-batches, and
    either the embedding's backward (the gathered root unit, the output projection's gradient
    from the fused cross-entropy, which with tied embeddings waits in the same autograd
    buffer, and the embedding's dense gradient) or, when larger, FSDP2's reduce-scatter of the
    root unit (its gradients in the compute dtype, gathered weights freed, an fp32 input and
    output). ``body``: the parameters of the layers FSDP2 shards."""
    d, shards, vh = shape.dtype_bytes, shape.fsdp_ranks, model.vocab_size * model.hidden_size
    dtype = "bf16" if d == 2 else "fp32"
    held = shape.accumulation > 1 or shape.pp > 1
    terms = []
    if shape.sharded:
        experts = ", this rank's experts whole" if local else ""
        terms.append(Term(f"gradients of the layers: fp32, sharded over {shape.fsdp_label} (reduce-scattered by then)"
                          f"{experts}", 4 * body // shards + 4 * local, BACKWARD))
        if held:
            terms.append(Term("root unit's gradients held unsharded across micro-batches, fp32", 4 * root, BACKWARD))
    elif held:
        terms.append(Term("gradients accumulated across micro-batches, fp32", 4 * body + 4 * root, BACKWARD))
    else:
        terms.append(Term("gradients of the layers, fp32", 4 * body, BACKWARD))
    head = d * vh if last and (not held or (model.tie_word_embeddings and shape.pp == 1)) else 0
    gathered = d * root if shape.sharded else 0
    reduce = (0 if held else d * root) + 4 * root + 4 * root // shards
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
    count = f"{_count(model_params(model))} parameters"
    context = f" cp={shape.cp}{' (ring)' if shape.cp_algo == 'ring' else ''}" if shape.cp > 1 else ""
    layout = f"pp={shape.pp} dp={shape.dp}{context} tp={shape.tp}"
    if model.num_experts:
        count += f", {_count(active_params(model))} active"
        layout += f" ep={shape.ep}"
        if shape.ep > 1:
            plan.notes.append(f"expert dispatch planned for balanced routing: each rank receives as many (token, expert) "
                              f"rows as it sends ({shape.tokens} tokens x top-"
                              f"{model.num_experts_per_tok}); a step whose routing favours this rank's experts "
                              f"receives more")
    plan.title = (
        f"memory plan per device ({name}, {count}, {mode} training in {dtype}; "
        f"{layout}, micro batch {shape.micro_batch_size} x {shape.seq_length} tokens, "
        f"{shape.accumulation} micro-batch(es) per step; busiest device: {plan.title})"
    )
    return plan


# --- generation --------------------------------------------------------------------------


def generation_plan(model: ModelConfig, tp: int, batch: int, prompt_tokens: int, max_new_tokens: int,
                    padded: bool = False, device_bytes: int | None = None, device_label: str = "",
                    name: str = "model", whole_on_host: bool = False) -> MemoryPlan:
    """The memory plan of one device generating for ``batch`` prompts of up to
    ``prompt_tokens`` tokens plus ``max_new_tokens``: fp32 weights (decoder layers split
    ``tp`` ways, a mixture of experts' router and experts whole, embedding and output
    projection whole), the KV cache [batch, kv heads / tp,
    prompt + new, head_dim] per attention layer for keys and values (Multi-head Latent
    Attention: each head's key and value, ``kv_cache_width``; a Gated DeltaNet layer
    keeps instead its convolution's last inputs [batch, channels, kernel - 1] and its
    recurrent state [batch, value heads, Dk, Dv], whatever the length; generation does not
    split them, ``apply_tp_inference`` refusing these layers), the prompt's forward pass (one
    layer's working set, the padding mask when prompts differ in length) and the logits.
    ``whole_on_host``: the device is host memory (CPU) and each of the ``tp`` workers first
    loads the whole model there (a Hugging Face directory or a LoRA checkpoint)."""
    h, f = model.hidden_size, model.intermediate_size
    qkv = sum(attention_widths(model))
    length = prompt_tokens + max_new_tokens
    layers = range(model.num_hidden_layers)
    weights = sum(layer_params(model, tp, i) + layer_buffers(model, i) for i in layers) + root_params(model)
    tokens = batch * prompt_tokens
    per_token = 2 * h + qkv / tp + 3 * f / tp
    if model.num_experts:  # a mixture-of-experts layer (whole on every rank): probabilities, its k rows, shared expert
        k, s = model.num_experts_per_tok, model.shared_expert_intermediate_size
        moe = 3 * h + qkv / tp + model.num_experts + k * (2 * h + 3 * model.moe_intermediate_size) + 3 * s
        per_token = moe if not model.dense_layers else max(per_token, moe)
    prefill = 4 * tokens * per_token
    linear = sum(model.is_linear_layer(i) for i in range(model.num_hidden_layers))
    attention = model.num_hidden_layers - linear
    terms = [
        Term(f"weights: fp32{f', layers split tp={tp}' if tp > 1 else ''}", 4 * weights, ALWAYS),
        Term(f"KV cache: fp32, {batch} x {length} positions x {attention} layers",
             4 * attention * batch * kv_cache_width(model, tp) * length, ALWAYS),
        Term(f"prompt forward: one layer's working set ({tokens} tokens)", int(prefill), FORWARD),
        Term("logits and sampling: fp32 [batch, vocab]", 3 * 4 * batch * model.vocab_size, FORWARD),
    ]
    if linear:  # whatever the length: the convolution's last inputs and the recurrent state
        conv = _deltanet_dims(model)[2]
        state = conv * (model.linear_conv_kernel_dim - 1) + model.linear_num_value_heads * model.linear_key_head_dim \
            * model.linear_value_head_dim
        terms.insert(2, Term(f"Gated DeltaNet states: fp32, {batch} x {linear} layers (convolution inputs, "
                             f"recurrent state)", 4 * linear * batch * state, ALWAYS))
    if whole_on_host and tp > 1:
        terms.insert(0, Term("model load: whole model, fp32, beside this worker's shard", 4 * model_params(model)
                             + 4 * weights, LOAD))
    count = f"{_count(model_params(model))} parameters" + (f", {_count(active_params(model))} active"
                                                          if model.num_experts else "")
    title = (f"memory plan per device ({name}, {count}, generation in fp32, "
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
    """The smallest change of each setting that makes the plan fit (a larger tp, a larger pp, a
    larger cp at the same world size (fewer dp ranks), a larger ep for a mixture of experts
    when ``current`` has one, activation checkpointing, a smaller micro batch, LoRA), each
    with its peak: ``plan_of(settings)`` plans ``current`` updated with the settings (None
    where the layout cannot run: ``plan_of`` refuses the cp that the heads or the sequence
    length do not allow)."""
    modes = ("none", "selective", "full")
    tp, pp, cp = current["tp"], current["pp"], current["cp"]
    groups: list[list[tuple[str, dict]]] = [
        [(f"ep={ep}", {"ep": ep}) for ep in (2, 4, 8, 16, 32, 64, 128, 256)
         if "ep" in current and ep > current["ep"] and model.num_experts % ep == 0 and world_size % ep == 0],
        [(f"tp={more}", {"tp": more}) for more in (2, 4, 8, 16, 32, 64)
         if more > tp and world_size % (more * pp * cp) == 0],
        [(f"pp={more}", {"pp": more, "num_layer_list": None}) for more in (2, 4, 8, 16)
         if more > pp and world_size % (more * tp * cp) == 0 and more <= model.num_hidden_layers],
        [(f"cp={more}", {"cp": more}) for more in range(cp + 1, world_size // (pp * tp) + 1)
         if world_size % (more * pp * tp) == 0],
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
    if fixes:
        fix = f"fits with {', or '.join(fixes)}"
    elif plan.peak_moment == LOAD:
        fix = ("no setting changes it: every rank loads a LoRA checkpoint's base whole before sharding; export it "
               "merged (llmflow export --merge-lora) and convert that, so that each rank loads its shards, or use "
               "devices with more memory")
    else:
        fix = "no single change fits; combine them or use more devices"
    return (f"memory: the plan needs {size(plan.peak)} per device ({plan.peak_moment}) but a device has "
            f"{size(plan.device_bytes)} ({plan.device_label}); largest term: {big.name}, {size(big.bytes)}; {fix}")


def train_shape(config: TrainConfig, world_size: int, seq_length: int, device_type: str) -> TrainShape:
    """The plan's view of ``config`` on ``world_size`` ranks of ``device_type`` (its compute
    dtype resolved as the workers resolve it)."""
    from llmflow import runtime
    from llmflow.mesh import ParallelLayout

    layout = ParallelLayout.of_world(world_size, config.pp, config.tp, config.dp, cp=config.cp)
    dtype = runtime.resolve_dtype(config.dtype, device_type)
    return TrainShape(
        pp=layout.pp, dp=layout.dp, tp=layout.tp, micro_batch_size=config.micro_batch_size, seq_length=seq_length,
        dtype_bytes=dtype.itemsize, accumulation=config.global_batch_size // (config.micro_batch_size * layout.dp),
        activation_checkpointing=config.activation_checkpointing, lora=config.lora, pp_schedule=config.pp_schedule,
        virtual_stages=config.virtual_stages, num_layer_list=config.num_layer_list,
        documents=config.data.kind != "pretrain" or config.data.document_attention,
        ep=config.ep, source=model_source(config.model), cp=layout.cp,
        cp_algo=config.cp_algo, per_token_loss=config.method != "next_token", rollout=rollout_shape(config, layout.dp),
    )


def rollout_shape(config: TrainConfig, dp: int) -> RolloutShape | None:
    """A GRPO run's ``RolloutShape`` on each of ``dp`` ranks (None for the other methods)."""
    if config.method != "grpo":
        return None
    rl = config.rl
    buffered = config.global_batch_size * rl.steps_per_generation // dp
    return RolloutShape(rows=min(rl.rollout_batch_size or buffered, buffered), buffered=buffered,
                        reference=bool(rl.beta) and config.lora is None, kl=bool(rl.beta))


def model_source(path: str | os.PathLike) -> str:
    """What the plan loads from ``path`` (``TrainShape.source``): "lora" for a LoRA checkpoint,
    "hf" for a Hugging Face directory, else "checkpoint" (a path not there yet is planned as
    a converted checkpoint, whose stacked experts are the larger tensor in flight)."""
    from pathlib import Path

    from llmflow.weights.training_checkpoint import is_checkpoint, read_meta, resolve_step_dir

    path = Path(path)
    if is_checkpoint(path):
        try:
            return "lora" if read_meta(resolve_step_dir(path)).lora is not None else "checkpoint"
        except (OSError, ValueError):  # a damaged checkpoint: the training checks name it
            return "checkpoint"
    return "hf" if (path / "config.json").is_file() else "checkpoint"
