"""How a Llama/Qwen-family decoder, dense or mixture-of-experts, lies in a megatron-core
GPTModel checkpoint, and the way to and from llmflow's (Hugging Face-named) tensors.

megatron-core's ``torch_dist`` format stores every tensor whole, with its global shape, so the
tensor-parallel layout is invisible in it. When every layer has the same modules (a dense
model, or a MoE model whose every layer routes: ``moe_layer_freq=1``) a block's layers are
stacked on a leading axis (``decoder.layers.self_attention.linear_qkv.weight`` is
``[layers, ...]``), whatever the pipeline split; when dense and MoE layers mix
(``moe_layer_freq`` a list) megatron-core stores each layer on its own
(``decoder.layers.{i}.self_attention.linear_qkv.weight``). The names are those of the
Transformer Engine layer spec, which the local spec maps its own to:

- ``linear_qkv``: the q, k and v projections fused, per query group: the group's query heads,
  then its key head, then its value head (``head_dim`` rows each);
- ``linear_fc1``: gate then up, each whole (``[gate; up]``);
- ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``: the input and
  post-attention RMSNorms;
- ``q_layernorm`` and ``k_layernorm`` (``qk_layernorm``, Qwen3): the per-head RMSNorms of
  queries and keys, ``[head_dim]``, the same on every tensor-parallel rank (the local spec
  names them so too);
- a MoE layer (``MoELayer``): ``mlp.router.weight`` ``[experts, hidden]``; the routed experts
  ``mlp.experts.experts.linear_fc1.weight`` ``[experts, 2 * moe_ffn, hidden]`` (each expert's
  gate then up) and ``mlp.experts.experts.linear_fc2.weight`` ``[experts, hidden, moe_ffn]``
  (megatron-core's SequentialMLP, TEGroupedMLP and GroupedMLP all store these keys, with
  ``experts`` twice); the shared expert ``mlp.shared_experts.linear_fc1``/``linear_fc2`` and
  its sigmoid gate ``mlp.shared_experts.gate_weight`` ``[1, hidden]``. Its post-attention
  RMSNorm is a module of its own, ``pre_mlp_layernorm``, in the Transformer Engine spec; the
  local spec renames it to ``mlp.linear_fc1.layer_norm_weight`` as in dense layers;
- ``embedding.word_embeddings`` and ``output_layer``: the vocabulary padded to a multiple of
  ``make_vocab_size_divisible_by`` times the tensor-parallel size (``output_layer`` absent
  when the embeddings are shared);
- ``<linear>._extra_state/shard_...``: Transformer Engine's per-layer (and per-expert) state
  (empty, ``[None]``, outside fp8 training), which megatron-core's loader requires.

Here each layer's tensors go by canonical names, the stacked key's name (``MLP_NORM`` for the
post-attention norm of every layer, ``EXPERT_FC1``/``EXPERT_FC2`` with every expert on dim 0);
``stored_name`` gives the name a layer spec stores one under.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmflow.models.config import ModelConfig

LAYERS = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
QKV, QKV_BIAS = "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"
Q_NORM, K_NORM = "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"
PROJ = "self_attention.linear_proj.weight"
FC1, FC2 = "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"
INPUT_NORM = "self_attention.linear_qkv.layer_norm_weight"
MLP_NORM = "mlp.linear_fc1.layer_norm_weight"
ROUTER = "mlp.router.weight"
EXPERT_FC1, EXPERT_FC2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
SHARED_FC1, SHARED_FC2 = "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"
SHARED_GATE = "mlp.shared_experts.gate_weight"
# The local layer spec's own norm modules (a legacy per-rank file keeps them; its torch_dist
# keys are renamed to the fused names), and the Transformer Engine spec's norm of a MoE layer.
LOCAL_INPUT_NORM, PRE_MLP_NORM = "input_layernorm.weight", "pre_mlp_layernorm.weight"
LOCAL_NORM_NAMES = {LOCAL_INPUT_NORM: INPUT_NORM, PRE_MLP_NORM: MLP_NORM}
EXPERT_MODULES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
"""The routed experts' linear layers, whose extra states are stored one per expert."""
EXPERTS = (EXPERT_FC1, EXPERT_FC2)

Spec = Literal["transformer_engine", "local"]
"""The layer spec a checkpoint's names follow: megatron-core's Transformer Engine spec
(Megatron-LM's default ``--transformer-impl``) or its local spec."""

LAYER_SOURCES: dict[str, tuple[str, ...]] = {
    INPUT_NORM: ("input_layernorm.weight",),
    QKV: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    QKV_BIAS: ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    Q_NORM: ("self_attn.q_norm.weight",),
    K_NORM: ("self_attn.k_norm.weight",),
    PROJ: ("self_attn.o_proj.weight",),
    MLP_NORM: ("post_attention_layernorm.weight",),
    FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    FC2: ("mlp.down_proj.weight",),
    ROUTER: ("mlp.gate.weight",),
    EXPERT_FC1: ("mlp.experts.gate_proj", "mlp.experts.up_proj"),
    EXPERT_FC2: ("mlp.experts.down_proj",),
    SHARED_FC1: ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    SHARED_FC2: ("mlp.shared_expert.down_proj.weight",),
    SHARED_GATE: ("mlp.shared_expert_gate.weight",),
}
"""Each Megatron layer tensor (in megatron-core's order) and the llmflow tensors of the same
layer (``model.layers.{i}.NAME``) it is made of, in the order they are fused."""
OTHER_SOURCES = {EMBEDDING: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight", OUTPUT: "lm_head.weight"}
"""The Megatron tensors outside the layers and the llmflow tensor each one is."""

GATED = (FC1, SHARED_FC1, EXPERT_FC1)
"""SwiGLU input projections: gate then up (each tensor-parallel rank holds its slice of both)."""
COLUMN_PARALLEL = (QKV, QKV_BIAS, *GATED)
"""Layer tensors split over tensor-parallel ranks on dim 0 (fc1 per half: see ``merge_shards``);
an expert's on its own dim 0."""
ROW_PARALLEL = (PROJ, FC2, SHARED_FC2, EXPERT_FC2)
"""Layer tensors split on dim 1 (an expert's own)."""
EXPERT_SLICE = {EXPERT_FC1: FC1, EXPERT_FC2: FC2}
"""How one expert's slice of the routed experts is split, by the dense tensor it is shaped like."""


def layer_key(name: str, layer: int) -> str:
    """The canonical key of one layer's tensor ``name``: ``decoder.layers.{layer}.{name}``."""
    return f"{LAYERS}{layer}.{name}"


def stacked(config: ModelConfig) -> bool:
    """Whether megatron-core stacks the layers of a model of ``config`` on a leading axis
    (every layer alike) rather than storing each layer under its own keys (dense and MoE
    layers mixed: ``moe_layer_freq`` a list)."""
    return not (config.num_experts and config.dense_layers)


def stored_name(name: str, config: ModelConfig, layer: int, spec: Spec, legacy: bool) -> str:
    """The name layer ``layer``'s tensor ``name`` is stored under by a model of the layer spec
    ``spec``, in a torch_dist checkpoint or a legacy per-rank file."""
    moe = config.is_moe_layer(layer)
    if legacy and spec == "local":
        return {INPUT_NORM: LOCAL_INPUT_NORM, MLP_NORM: PRE_MLP_NORM}.get(name, name)
    if name == MLP_NORM and moe and spec == "transformer_engine":
        return PRE_MLP_NORM
    return name


def moe_layer_freq(config: ModelConfig) -> int | list[int]:
    """Megatron-LM's ``moe_layer_freq`` for ``config``: 1 when every layer routes, else the
    pattern (1: a MoE layer, 0: dense). Megatron's integer N means layers 0, N, 2N, ...,
    which Hugging Face's ``decoder_sparse_step`` (layers N-1, 2N-1, ...) is not."""
    pattern = [int(config.is_moe_layer(i)) for i in range(config.num_hidden_layers)]
    return 1 if all(pattern) else pattern


def moe_pattern(freq: object, layers: int) -> list[int] | None:
    """Which layers are MoE layers by Megatron-LM's ``moe_layer_freq`` (an int N: layers 0, N,
    2N, ...; or a list), as megatron-core reads it; None when it is neither."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return [int(i % freq == 0) for i in range(layers)]
    if isinstance(freq, (list, tuple)) and all(v in (0, 1) for v in freq):
        return [int(v) for v in freq]
    return None


def extra_state_key(module: str, layer: int, layers: int, expert: int | None = None, experts: int = 0,
                    stack: bool = True) -> str:
    """The key of one layer's (and expert's) Transformer Engine extra state (a ShardedObject:
    ``shard_{offsets}_{shape}`` over the stacked axes, layers then experts)."""
    offsets, shape = ([layer], [layers]) if stack else ([], [])
    if expert is not None:
        offsets, shape = offsets + [expert], shape + [experts]
    if not offsets:
        offsets, shape = [0], [1]
    prefix = LAYERS if stack else f"{LAYERS}{layer}."
    return f"{prefix}{module}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def extra_state_modules(config: ModelConfig, layer: int) -> list[str]:
    """The linear layers of layer ``layer`` whose extra state megatron-core stores once per
    layer (the routed experts' are stored per expert: ``EXPERT_MODULES``)."""
    modules = ["self_attention.linear_proj", "self_attention.linear_qkv"]
    if not config.is_moe_layer(layer):
        return modules + ["mlp.linear_fc1", "mlp.linear_fc2"]
    if config.shared_expert_intermediate_size:
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    return modules


@dataclass(frozen=True)
class Attention:
    """The head layout that orders the fused QKV rows."""

    heads: int
    groups: int
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig) -> Attention:
        return cls(config.num_attention_heads, config.num_key_value_heads, config.head_dim)

    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v (weights or biases) from megatron's fused, group-interleaved tensor."""
        rest = qkv.shape[1:]
        grouped = qkv.reshape(self.groups, self.per_group + 2, self.head_dim, *rest)
        q = grouped[:, : self.per_group].reshape(self.heads * self.head_dim, *rest)
        k = grouped[:, self.per_group].reshape(self.groups * self.head_dim, *rest)
        v = grouped[:, self.per_group + 1].reshape(self.groups * self.head_dim, *rest)
        return q, k, v

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """megatron's fused tensor from q, k and v (weights or biases)."""
        rest = q.shape[1:]
        parts = (q.reshape(self.groups, self.per_group * self.head_dim, *rest),
                 k.reshape(self.groups, self.head_dim, *rest), v.reshape(self.groups, self.head_dim, *rest))
        return torch.cat(parts, dim=1).reshape(-1, *rest)


def unmapped_layers(config: ModelConfig) -> str | None:
    """Why this layout cannot hold a model of ``config`` whatever the options, or None: the
    hybrids' Gated DeltaNet layers and gated attention (Qwen3-Next, Qwen3.5), Multi-head
    Latent Attention (DeepSeek-V3), DeepSeek-V3's sigmoid router and ungated shared experts
    (GLM-4.5), and Gemma 3's norms after attention and the MLP, for which
    megatron-core 0.16.1's ``TransformerLayer`` has no place. megatron-core 0.16.1 has the first
    two (``ssm.gated_delta_net.GatedDeltaNet`` with its own fused ``in_proj``,
    ``attention_output_gate``; ``MLASelfAttention`` with ``linear_q_down_proj``,
    ``linear_kv_up_proj``, ...), but llmflow maps no tensor of theirs."""
    if config.kv_lora_rank:
        return (f"{config.model_type} has Multi-head Latent Attention layers, which llmflow's Megatron layout does "
                "not map (it holds attention with fused q/k/v and MLP layers only)")
    if config.router_scoring != "softmax" or (config.shared_expert_intermediate_size and not config.shared_expert_gated):
        return (f"{config.model_type} routes with DeepSeek-V3's sigmoid router (e_score_correction_bias, expert "
                "groups) and ungated shared experts, which llmflow's Megatron layout does not map (a softmax router "
                "and a gated shared expert only)")
    if config.sandwich_norms:
        return (f"{config.model_type}'s layers normalise attention's and the MLP's outputs too (post_attention_layernorm, "
                "post_feedforward_layernorm), which llmflow's Megatron layout does not map (one norm before each)")
    if not config.layer_types and not config.attention_output_gate:
        return None
    linear = sum(config.is_linear_layer(i) for i in range(config.num_hidden_layers))
    return (f"{config.model_type} has {linear} Gated DeltaNet (linear attention) layers and gated attention, "
            "which llmflow's Megatron layout does not map (it holds attention and MLP layers only)")


def missing_biases(config: ModelConfig) -> str | None:
    """The biases of a model of ``config`` that this layout has no place for (Megatron-LM's
    ``add_bias_linear=False``: q/k/v biases only), or None."""
    found = [name for name, present in (("o_proj", config.o_bias), ("MLP", config.mlp_bias)) if present]
    return f"biases on {' and '.join(found)} (config.json attention_bias/mlp_bias)" if found else None


def layer_tensors(config: ModelConfig, layer: int) -> list[str]:
    """The Megatron tensors of layer ``layer`` of a model of ``config``, in megatron-core's order."""
    moe, shared = config.is_moe_layer(layer), bool(config.shared_expert_intermediate_size)
    optional = {QKV_BIAS: config.qkv_bias, Q_NORM: config.qk_norm, K_NORM: config.qk_norm,
                FC1: not moe, FC2: not moe, ROUTER: moe, EXPERT_FC1: moe, EXPERT_FC2: moe,
                SHARED_FC1: moe and shared, SHARED_FC2: moe and shared, SHARED_GATE: moe and shared}
    return [name for name in LAYER_SOURCES if optional.get(name, True)]


def other_tensors(config: ModelConfig) -> list[str]:
    """The Megatron tensors outside the layers of a model of ``config``."""
    return [EMBEDDING, FINAL_NORM, *([] if config.tie_word_embeddings else [OUTPUT])]


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of one layer of each Megatron layer tensor of a model of ``config``."""
    a, hidden, ffn = Attention.of(config), config.hidden_size, config.intermediate_size
    experts, moe_ffn, shared = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    qkv_rows = (a.heads + 2 * a.groups) * a.head_dim
    return {INPUT_NORM: (hidden,), QKV: (qkv_rows, hidden), QKV_BIAS: (qkv_rows,), Q_NORM: (a.head_dim,),
            K_NORM: (a.head_dim,), PROJ: (hidden, a.heads * a.head_dim), MLP_NORM: (hidden,), FC1: (2 * ffn, hidden),
            FC2: (hidden, ffn), ROUTER: (experts, hidden), EXPERT_FC1: (experts, 2 * moe_ffn, hidden),
            EXPERT_FC2: (experts, hidden, moe_ffn), SHARED_FC1: (2 * shared, hidden), SHARED_FC2: (hidden, shared),
            SHARED_GATE: (1, hidden)}


def fuse(name: str, parts: list[torch.Tensor], attention: Attention) -> torch.Tensor:
    """The Megatron layer tensor ``name`` from its llmflow parts (``LAYER_SOURCES[name]``)."""
    if name in (QKV, QKV_BIAS):
        return attention.fuse(*parts)
    if name in GATED:
        return torch.cat(parts, dim=1 if name == EXPERT_FC1 else 0)
    return parts[0]


def unfuse(name: str, tensor: torch.Tensor, attention: Attention) -> tuple[torch.Tensor, ...]:
    """The llmflow parts of the Megatron layer tensor ``name``, the inverse of ``fuse``."""
    if name in (QKV, QKV_BIAS):
        return attention.split(tensor)
    if name in GATED:
        return tensor.chunk(2, dim=1 if name == EXPERT_FC1 else 0)
    return (tensor,)


def merge_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """One layer (or vocabulary) tensor whole from its tensor-parallel shards in rank order (a
    legacy per-rank checkpoint): each rank's fc1 holds its slice of gate then its slice of up.
    A routed expert's shards merge as the dense tensor of its shape (``EXPERT_SLICE``)."""
    name = EXPERT_SLICE.get(name, name)
    if len(shards) == 1:
        return shards[0]
    if name in GATED:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    if name in COLUMN_PARALLEL or name in (EMBEDDING, OUTPUT):
        return torch.cat(shards, dim=0)
    if name in ROW_PARALLEL:
        return torch.cat(shards, dim=1)
    return shards[0]  # norms, the router and the shared expert's gate: the same on every rank


def split_shards(name: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """A layer (or vocabulary, or one expert's) tensor cut into its tensor-parallel shards, the
    inverse of ``merge_shards``; embedding and output rows split on dim 0."""
    name = EXPERT_SLICE.get(name, name)
    if tp == 1:
        return [tensor]
    if name in GATED:
        gates, ups = (half.chunk(tp, dim=0) for half in tensor.chunk(2, dim=0))
        return [torch.cat([g, u], dim=0) for g, u in zip(gates, ups)]
    if name in COLUMN_PARALLEL or name in (EMBEDDING, OUTPUT):
        return list(tensor.chunk(tp, dim=0))
    if name in ROW_PARALLEL:
        return list(tensor.chunk(tp, dim=1))
    return [tensor] * tp


def legacy_expert_name(name: str, expert: int, grouped: bool) -> str:
    """Where a legacy per-rank file keeps its local expert ``expert``'s slice of ``name``
    (``EXPERT_FC1``/``EXPERT_FC2``): megatron-core's SequentialMLP
    (``mlp.experts.local_experts.{j}.linear_fc1.weight``) or, with ``moe_grouped_gemm``, the
    Transformer Engine GroupedLinear of TEGroupedMLP (``mlp.experts.linear_fc1.weight{j}``)."""
    linear = "linear_fc1" if name == EXPERT_FC1 else "linear_fc2"
    return f"mlp.experts.{linear}.weight{expert}" if grouped else f"mlp.experts.local_experts.{expert}.{linear}.weight"
