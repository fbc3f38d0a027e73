"""How a Llama/Qwen-family decoder, dense or mixture-of-experts, and DeepSeek-V3's (Multi-head
Latent Attention, the sigmoid router) lie in a megatron-core GPTModel checkpoint, and the way
to and from llmflow's (Hugging Face-named) tensors.

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
  ``experts`` twice); the shared expert ``mlp.shared_experts.linear_fc1``/``linear_fc2`` and,
  when gated (Qwen2-MoE), its sigmoid gate ``mlp.shared_experts.gate_weight`` ``[1, hidden]``;
  the sigmoid router's correction bias ``mlp.router.expert_bias`` ``[experts]``, fp32
  (``moe_router_enable_expert_bias``). Its post-attention RMSNorm is a module of its own,
  ``pre_mlp_layernorm``, in the Transformer Engine spec; the local spec renames it to
  ``mlp.linear_fc1.layer_norm_weight`` as in dense layers;
- a Multi-head Latent Attention layer (``MLASelfAttention``, ``multi_latent_attention``):
  ``linear_q_down_proj`` and ``linear_q_up_proj`` (or one ``linear_q_proj`` without the
  query's bottleneck), ``linear_kv_down_proj`` (``[kv_lora_rank; qk_rope_head_dim]`` rows, as
  Hugging Face's ``kv_a_proj_with_mqa``), ``linear_kv_up_proj`` (per head its key part then its
  value), ``linear_proj``; the latent RMSNorms are fused into the up projections in the
  Transformer Engine spec (``linear_q_up_proj.layer_norm_weight``,
  ``linear_kv_up_proj.layer_norm_weight``) and modules of their own in the local spec
  (``q_layernorm``, ``kv_layernorm``); the input norm is ``input_layernorm`` in both, and the
  post-attention norm ``pre_mlp_layernorm`` in the local spec's every layer (its MLA layers
  have no renaming map) and the Transformer Engine spec's MoE layers. megatron-core's MLA
  always rotates the rotary part as pairs of adjacent dims (it gathers even dims before odd
  ones, as Hugging Face's ``rope_interleave``), so the rotary rows of a half-split model
  (``rope_interleave`` false) are reordered (``Attention.pairs``);
- ``embedding.word_embeddings`` and ``output_layer``: the vocabulary padded to a multiple of
  ``make_vocab_size_divisible_by`` times the tensor-parallel size (``output_layer`` absent
  when the embeddings are shared);
- ``<linear>._extra_state/shard_...``: Transformer Engine's per-layer (and per-expert) state
  (empty, ``[None]``, outside fp8 training), which megatron-core's loader requires.

Here each layer's tensors go by canonical names, the stacked key's name (``MLP_NORM`` for the
post-attention norm of every layer, ``EXPERT_FC1``/``EXPERT_FC2`` with every expert on dim 0;
MLA's latent norms by the local spec's names, ``Q_NORM`` being also Qwen3's per-head norm's);
``stored_name`` gives the name a layer spec stores one under.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from llmflow.models.blocks.mla import LATENT_NORM_EPS
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
ROUTER, EXPERT_BIAS = "mlp.router.weight", "mlp.router.expert_bias"
EXPERT_FC1, EXPERT_FC2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
SHARED_FC1, SHARED_FC2 = "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"
SHARED_GATE = "mlp.shared_experts.gate_weight"
Q_DOWN, Q_UP = "self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.weight"
Q_WHOLE = "self_attention.linear_q_proj.weight"
KV_DOWN, KV_UP = "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.weight"
KV_NORM = "self_attention.kv_layernorm.weight"
"""MLA's latent norm of keys and values (that of queries is ``Q_NORM``), the local spec's name."""
# The local layer spec's own norm modules (a legacy per-rank file keeps them, and so does the
# local spec's MLA layer in torch_dist; its other torch_dist keys are renamed to the fused
# names), the Transformer Engine spec's norm of a MoE layer, and its MLA latent norms, fused
# into the up projections.
LOCAL_INPUT_NORM, PRE_MLP_NORM = "input_layernorm.weight", "pre_mlp_layernorm.weight"
TE_Q_NORM = "self_attention.linear_q_up_proj.layer_norm_weight"
TE_KV_NORM = "self_attention.linear_kv_up_proj.layer_norm_weight"
NORM_ALIASES = {LOCAL_INPUT_NORM: INPUT_NORM, PRE_MLP_NORM: MLP_NORM, TE_Q_NORM: Q_NORM, TE_KV_NORM: KV_NORM}
"""The canonical name of each norm a layer spec stores under another name."""
EXPERT_MODULES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
"""The routed experts' linear layers, whose extra states are stored one per expert."""
EXPERTS = (EXPERT_FC1, EXPERT_FC2)
FP32 = (EXPERT_BIAS,)
"""Tensors megatron-core keeps in fp32 whatever the model's dtype (the router's expert bias)."""

Spec = Literal["transformer_engine", "local"]
"""The layer spec a checkpoint's names follow: megatron-core's Transformer Engine spec
(Megatron-LM's default ``--transformer-impl``) or its local spec."""

ATTENTION_SOURCES: dict[str, tuple[str, ...]] = {
    INPUT_NORM: ("input_layernorm.weight",),
    QKV: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    QKV_BIAS: ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    Q_NORM: ("self_attn.q_norm.weight",),
    K_NORM: ("self_attn.k_norm.weight",),
    PROJ: ("self_attn.o_proj.weight",),
}
MLA_SOURCES: dict[str, tuple[str, ...]] = {
    INPUT_NORM: ("input_layernorm.weight",),
    Q_WHOLE: ("self_attn.q_proj.weight",),
    Q_DOWN: ("self_attn.q_a_proj.weight",),
    Q_UP: ("self_attn.q_b_proj.weight",),
    KV_DOWN: ("self_attn.kv_a_proj_with_mqa.weight",),
    KV_UP: ("self_attn.kv_b_proj.weight",),
    Q_NORM: ("self_attn.q_a_layernorm.weight",),
    KV_NORM: ("self_attn.kv_a_layernorm.weight",),
    PROJ: ("self_attn.o_proj.weight",),
}
MLP_SOURCES: dict[str, tuple[str, ...]] = {
    MLP_NORM: ("post_attention_layernorm.weight",),
    FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    FC2: ("mlp.down_proj.weight",),
    ROUTER: ("mlp.gate.weight",),
    EXPERT_BIAS: ("mlp.gate.e_score_correction_bias",),
    EXPERT_FC1: ("mlp.experts.gate_proj", "mlp.experts.up_proj"),
    EXPERT_FC2: ("mlp.experts.down_proj",),
    SHARED_FC1: ("{shared}.gate_proj.weight", "{shared}.up_proj.weight"),
    SHARED_FC2: ("{shared}.down_proj.weight",),
    SHARED_GATE: ("mlp.shared_expert_gate.weight",),
}
"""Each Megatron layer tensor (in megatron-core's order) and the llmflow tensors of the same
layer (``model.layers.{i}.NAME``) it is made of, in the order they are fused: attention's of
``ATTENTION_SOURCES`` or, for Multi-head Latent Attention, ``MLA_SOURCES``, then the MLP's;
``{shared}`` is the shared expert's module, gated (``mlp.shared_expert``) or not
(``mlp.shared_experts``). ``layer_sources`` picks those of one layer."""
OTHER_SOURCES = {EMBEDDING: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight", OUTPUT: "lm_head.weight"}
"""The Megatron tensors outside the layers and the llmflow tensor each one is."""

GATED = (FC1, SHARED_FC1, EXPERT_FC1)
"""SwiGLU input projections: gate then up (each tensor-parallel rank holds its slice of both)."""
COLUMN_PARALLEL = (QKV, QKV_BIAS, Q_WHOLE, Q_UP, KV_UP, *GATED)
"""Layer tensors split over tensor-parallel ranks on dim 0 (fc1 per half: see ``merge_shards``);
an expert's on its own dim 0."""
ROW_PARALLEL = (PROJ, FC2, SHARED_FC2, EXPERT_FC2)
"""Layer tensors split on dim 1 (an expert's own)."""
DOWN_PROJECTIONS = (Q_DOWN, KV_DOWN)
"""MLA's projections from the hidden state into the latents: split on dim 0 in the local spec
(ColumnParallelLinear, the latents gathered after), whole on every rank in the Transformer
Engine spec (TELinear, ``parallel_mode='duplicated'``)."""
ATTENTION_LINEARS = (QKV, Q_WHOLE, Q_DOWN, Q_UP, KV_DOWN, KV_UP, PROJ)
"""Attention's linear layers (each with a Transformer Engine extra state), either kind."""
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
    latent = bool(config.kv_lora_rank)
    if spec == "local" and (legacy or latent):  # the local spec's own norm modules
        return {INPUT_NORM: LOCAL_INPUT_NORM, MLP_NORM: PRE_MLP_NORM}.get(name, name)
    if spec == "transformer_engine" and name == MLP_NORM and config.is_moe_layer(layer):
        return PRE_MLP_NORM
    if spec == "transformer_engine" and latent:
        return {INPUT_NORM: LOCAL_INPUT_NORM, Q_NORM: TE_Q_NORM, KV_NORM: TE_KV_NORM}.get(name, name)
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


def grouped_routing(config: ModelConfig) -> bool:
    """Whether the sigmoid router limits a token's experts to the best groups (fewer groups kept
    than there are)."""
    return config.router_scoring == "sigmoid" and config.topk_group < config.n_group


def router_args(config: ModelConfig) -> dict[str, Any]:
    """megatron-core's router settings (Megatron-LM's argument names) that route as llmflow's
    router of ``config`` does.

    The softmax router (``TopKRouter``): softmax over every expert, the top k, renormalised
    only with norm_topk_prob. megatron-core with moe_router_pre_softmax=True computes the
    softmax over all experts and takes the top k (no renormalisation); with False it takes
    the top k logits and softmaxes them, which is the top k probabilities renormalised.

    The sigmoid router (``GroupLimitedRouter``): ``moe_router_score_function=sigmoid`` with the
    correction bias as megatron-core's expert bias (added to choose the experts only), the
    groups as ``moe_router_num_groups``/``moe_router_group_topk`` and routed_scaling_factor as
    ``moe_router_topk_scaling_factor``; megatron-core renormalises the chosen scores whenever
    more than one expert is chosen, whatever moe_router_pre_softmax says."""
    sigmoid, grouped = config.router_scoring == "sigmoid", grouped_routing(config)
    scaling = config.routed_scaling_factor if sigmoid and config.routed_scaling_factor != 1.0 else None
    return {
        "moe_router_score_function": config.router_scoring,
        "moe_router_pre_softmax": not sigmoid and not config.norm_topk_prob,
        "moe_router_topk_scaling_factor": scaling,
        "moe_router_num_groups": config.n_group if grouped else None,
        "moe_router_group_topk": config.topk_group if grouped else None,
        "moe_router_enable_expert_bias": sigmoid,
    }


def mla_args(config: ModelConfig) -> dict[str, Any]:
    """megatron-core's ``MLATransformerConfig`` fields (Megatron-LM's argument names) for the
    Multi-head Latent Attention of ``config``, rotary included (empty without MLA).

    megatron-core's MLA scales the softmax by mscale(factor, mscale_all_dim)² and cos and sin
    by mscale(factor, mscale) / mscale(factor, mscale_all_dim), plain rotary included (so
    ``rotary_scaling_factor`` 1 there). transformers scales the softmax by
    mscale(factor, mscale_all_dim)² only when mscale_all_dim is set, and cos and sin by the
    ratio only when both are set, else by mscale(factor): mscale_all_dim unset is 0 here
    (mscale 1 for any factor) and mscale then 1. What cannot be matched is refused
    (``mla_problem``)."""
    if not config.kv_lora_rank:
        return {}
    scaling = config.rope_scaling or {}
    yarn = config.rope_type == "yarn"
    all_dims = scaling.get("mscale_all_dim") or 0.0
    rotary = {
        "rope_type": "yarn" if yarn else "rope",
        "rotary_scaling_factor": float(scaling["factor"]) if yarn else 1.0,
        "mscale": float(scaling["mscale"]) if yarn and scaling.get("mscale") and all_dims else 1.0,
        "mscale_all_dim": float(all_dims) if yarn else 0.0,
        "original_max_position_embeddings": scaling.get(
            "original_max_position_embeddings", config.max_position_embeddings
        ),
        "beta_fast": float(scaling.get("beta_fast") or 32),
        "beta_slow": float(scaling.get("beta_slow") or 1),
    }
    return {
        "multi_latent_attention": True,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_head_dim": config.qk_nope_head_dim,
        "qk_pos_emb_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        **rotary,
    }


def mla_problem(config: ModelConfig) -> str | None:
    """What of the Multi-head Latent Attention of ``config`` megatron-core 0.16.1's
    ``MLASelfAttention`` computes otherwise, or None."""
    scaling = config.rope_scaling or {}
    what = None
    if config.rope_type not in ("default", "yarn"):
        what = f"rotates with rope_type {config.rope_type!r} (megatron-core's MLA: plain rotary or yarn)"
    elif config.rope_type == "yarn" and not scaling.get("truncate", True):
        what = "has YaRN's truncate=false (megatron-core's MLA rounds the correction range to whole dims)"
    elif config.rope_type == "yarn" and scaling.get("attention_factor") is not None:
        what = "sets YaRN's attention_factor (megatron-core's MLA computes it from mscale and mscale_all_dim)"
    elif config.rope_type == "yarn" and scaling.get("mscale_all_dim") and not scaling.get("mscale"):
        what = (
            "sets YaRN's mscale_all_dim without mscale (megatron-core's MLA then scales cos and sin by "
            "1 / mscale(factor, mscale_all_dim), transformers by mscale(factor))"
        )
    elif config.rms_norm_eps != LATENT_NORM_EPS:
        what = (
            f"normalises its latents with eps {LATENT_NORM_EPS} and its layers with rms_norm_eps="
            f"{config.rms_norm_eps} (megatron-core's MLA: one eps, layernorm_epsilon, for both)"
        )
    return f"{config.model_type}'s Multi-head Latent Attention {what}" if what else None


def router_problem(config: ModelConfig) -> str | None:
    """What of the sigmoid router of ``config`` megatron-core 0.16.1's ``TopKRouter`` computes
    otherwise (``topk_routing_with_score_function``, ``group_limited_topk``), or None."""
    if config.router_scoring != "sigmoid":
        return None
    what = None
    if grouped_routing(config) and config.num_experts_per_tok // config.topk_group != 2:
        what = (
            f"scores a group of experts by its best 2 (megatron-core: by its best num_experts_per_tok // "
            f"topk_group = {config.num_experts_per_tok} // {config.topk_group})"
        )
    elif config.norm_topk_prob != (config.num_experts_per_tok > 1):
        what = (
            f"{'renormalises' if config.norm_topk_prob else 'does not renormalise'} the weights of its "
            f"{config.num_experts_per_tok} chosen experts (norm_topk_prob={config.norm_topk_prob}; "
            "megatron-core renormalises them whenever more than one is chosen)"
        )
    return f"{config.model_type}'s sigmoid router {what}" if what else None


def extra_state_key(
    module: str, layer: int, layers: int, expert: int | None = None, experts: int = 0, stack: bool = True
) -> str:
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
    sources = layer_sources(config, layer)
    modules = [name.removesuffix(".weight") for name in ATTENTION_LINEARS if name in sources]
    if not config.is_moe_layer(layer):
        return modules + ["mlp.linear_fc1", "mlp.linear_fc2"]
    if config.shared_expert_intermediate_size:
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    return modules


@dataclass(frozen=True)
class Attention:
    """The head layout that orders the fused QKV rows, and for Multi-head Latent Attention the
    rotary rows megatron-core expects in pairs."""

    heads: int
    groups: int
    head_dim: int
    pairs: tuple[tuple[str, int], ...] = ()
    """MLA tensors whose rotary rows are reordered (a half-split model's), each with the width
    of its blocks of rows (a query head, or kv_a's whole output) whose last ``rope`` rows rotate."""
    rope: int = 0

    @classmethod
    def of(cls, config: ModelConfig) -> Attention:
        if not config.kv_lora_rank or config.rope_interleave:
            return cls(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        head = config.qk_nope_head_dim + config.qk_rope_head_dim
        pairs = ((Q_WHOLE, head), (Q_UP, head), (KV_DOWN, config.kv_lora_rank + config.qk_rope_head_dim))
        return cls(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, pairs, config.qk_rope_head_dim
        )

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
        parts = (
            q.reshape(self.groups, self.per_group * self.head_dim, *rest),
            k.reshape(self.groups, self.head_dim, *rest),
            v.reshape(self.groups, self.head_dim, *rest),
        )
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def rotary_pairs(self, name: str, tensor: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``tensor`` with each block's rotary rows in megatron-core's order (row 2i the first
        half's row i, row 2i + 1 the second half's: its gather of even rows before odd ones
        gives the halves back), or with ``inverse`` back in halves; unchanged for a tensor
        that needs no reordering."""
        width = dict(self.pairs).get(name)
        if width is None:
            return tensor
        blocks = tensor.reshape(-1, width, *tensor.shape[1:])
        kept, rotary = blocks.split([width - self.rope, self.rope], dim=1)
        if inverse:
            rotary = torch.cat([rotary[:, 0::2], rotary[:, 1::2]], dim=1)
        else:
            rotary = torch.stack(rotary.chunk(2, dim=1), dim=2).flatten(1, 2)
        return torch.cat([kept, rotary], dim=1).reshape(tensor.shape)


def unmapped_layers(config: ModelConfig) -> str | None:
    """Why this layout cannot hold a model of ``config`` whatever the options, or None: the
    hybrids' Gated DeltaNet layers and gated attention (Qwen3-Next, Qwen3.5), for which
    megatron-core 0.16.1 has modules (``ssm.gated_delta_net.GatedDeltaNet`` with its own fused
    ``in_proj``, ``attention_output_gate``) that llmflow maps no tensor of; Gemma 3's norms
    after attention and the MLP, for which megatron-core 0.16.1's ``TransformerLayer`` has no
    place; attention rotating by a scaling other than Llama 3's (linear, YaRN: Megatron-LM's
    arguments for a GPT model carry ``use_rope_scaling`` alone); and what megatron-core's MLA and
    sigmoid router compute otherwise
    (``mla_problem``, ``router_problem``: YaRN without truncation or with a given
    attention_factor, latent norms of another eps than the layers', groups not scored by
    their best 2 experts, weights renormalised other than megatron-core does)."""
    if config.kv_lora_rank and (problem := mla_problem(config)):
        return problem
    if not config.kv_lora_rank and config.rope_type not in ("default", "llama3"):
        return (f"{config.model_type} rotates with rope_type {config.rope_type!r}, which llmflow's Megatron "
                "arguments do not carry (plain rotary, or Llama 3's scaling as use_rope_scaling)")
    if problem := router_problem(config):
        return problem
    if config.sandwich_norms:
        return (
            f"{config.model_type}'s layers normalise attention's and the MLP's outputs too (post_attention_layernorm, "
            "post_feedforward_layernorm), which llmflow's Megatron layout does not map (one norm before each)"
        )
    if not config.layer_types and not config.attention_output_gate:
        return None
    linear = sum(config.is_linear_layer(i) for i in range(config.num_hidden_layers))
    return (
        f"{config.model_type} has {linear} Gated DeltaNet (linear attention) layers and gated attention, "
        "which llmflow's Megatron layout does not map (it holds attention and MLP layers only)"
    )


def missing_biases(config: ModelConfig) -> str | None:
    """The biases of a model of ``config`` that this layout has no place for (Megatron-LM's
    ``add_bias_linear=False``: q/k/v biases only, none in MLA), or None."""
    found = [
        name
        for name, present in (
            ("q_a_proj and kv_a_proj_with_mqa", config.qkv_bias and config.kv_lora_rank),
            ("o_proj", config.o_bias),
            ("MLP", config.mlp_bias),
        )
        if present
    ]
    return f"biases on {' and '.join(found)} (config.json attention_bias/mlp_bias)" if found else None


def layer_sources(config: ModelConfig, layer: int) -> dict[str, tuple[str, ...]]:
    """The Megatron tensors of layer ``layer`` of a model of ``config`` (megatron-core's order),
    each with the llmflow tensors of that layer (``model.layers.{layer}.NAME``) it is made of."""
    moe, shared = config.is_moe_layer(layer), bool(config.shared_expert_intermediate_size)
    if config.kv_lora_rank:
        low_rank = config.q_lora_rank is not None
        attention = {
            name: parts
            for name, parts in MLA_SOURCES.items()
            if name not in ((Q_WHOLE,) if low_rank else (Q_DOWN, Q_UP, Q_NORM))
        }
    else:
        optional = {QKV_BIAS: config.qkv_bias, Q_NORM: config.qk_norm, K_NORM: config.qk_norm}
        attention = {name: parts for name, parts in ATTENTION_SOURCES.items() if optional.get(name, True)}
    optional = {
        FC1: not moe,
        FC2: not moe,
        ROUTER: moe,
        EXPERT_BIAS: moe and config.router_scoring == "sigmoid",
        EXPERT_FC1: moe,
        EXPERT_FC2: moe,
        SHARED_FC1: moe and shared,
        SHARED_FC2: moe and shared,
        SHARED_GATE: moe and shared and config.shared_expert_gated,
    }
    module = "mlp.shared_expert" if config.shared_expert_gated else "mlp.shared_experts"
    mlp = {
        name: tuple(part.format(shared=module) for part in parts)
        for name, parts in MLP_SOURCES.items()
        if optional.get(name, True)
    }
    return attention | mlp


def layer_tensors(config: ModelConfig, layer: int) -> list[str]:
    """The Megatron tensors of layer ``layer`` of a model of ``config``, in megatron-core's order."""
    return list(layer_sources(config, layer))


def other_tensors(config: ModelConfig) -> list[str]:
    """The Megatron tensors outside the layers of a model of ``config``."""
    return [EMBEDDING, FINAL_NORM, *([] if config.tie_word_embeddings else [OUTPUT])]


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of one layer of each Megatron layer tensor of a model of ``config``."""
    a, hidden, ffn = Attention.of(config), config.hidden_size, config.intermediate_size
    experts, moe_ffn, shared = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    qkv_rows = (a.heads + 2 * a.groups) * a.head_dim
    shapes = {
        INPUT_NORM: (hidden,),
        QKV: (qkv_rows, hidden),
        QKV_BIAS: (qkv_rows,),
        Q_NORM: (a.head_dim,),
        K_NORM: (a.head_dim,),
        PROJ: (hidden, a.heads * a.head_dim),
        MLP_NORM: (hidden,),
        FC1: (2 * ffn, hidden),
        FC2: (hidden, ffn),
        ROUTER: (experts, hidden),
        EXPERT_BIAS: (experts,),
        EXPERT_FC1: (experts, 2 * moe_ffn, hidden),
        EXPERT_FC2: (experts, hidden, moe_ffn),
        SHARED_FC1: (2 * shared, hidden),
        SHARED_FC2: (hidden, shared),
        SHARED_GATE: (1, hidden),
    }
    if not config.kv_lora_rank:
        return shapes
    q_rows = a.heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    latent = config.kv_lora_rank
    return shapes | {
        Q_WHOLE: (q_rows, hidden),
        Q_DOWN: (config.q_lora_rank, hidden),
        Q_UP: (q_rows, config.q_lora_rank),
        Q_NORM: (config.q_lora_rank,),
        KV_DOWN: (latent + config.qk_rope_head_dim, hidden),
        KV_UP: (a.heads * (config.qk_nope_head_dim + config.v_head_dim), latent),
        KV_NORM: (latent,),
        PROJ: (hidden, a.heads * config.v_head_dim),
    }


def fuse(name: str, parts: list[torch.Tensor], attention: Attention) -> torch.Tensor:
    """The Megatron layer tensor ``name`` from its llmflow parts (``layer_sources``)."""
    if name in (QKV, QKV_BIAS):
        return attention.fuse(*parts)
    if name in GATED:
        return torch.cat(parts, dim=1 if name == EXPERT_FC1 else 0)
    return attention.rotary_pairs(name, parts[0])


def unfuse(name: str, tensor: torch.Tensor, attention: Attention) -> tuple[torch.Tensor, ...]:
    """The llmflow parts of the Megatron layer tensor ``name``, the inverse of ``fuse``."""
    if name in (QKV, QKV_BIAS):
        return attention.split(tensor)
    if name in GATED:
        return tensor.chunk(2, dim=1 if name == EXPERT_FC1 else 0)
    return (attention.rotary_pairs(name, tensor, inverse=True),)


def merge_shards(name: str, shards: list[torch.Tensor], spec: Spec = "local") -> torch.Tensor:
    """One layer (or vocabulary) tensor whole from its tensor-parallel shards in rank order (a
    legacy per-rank checkpoint of the layer spec ``spec``): each rank's fc1 holds its slice of
    gate then its slice of up. A routed expert's shards merge as the dense tensor of its shape
    (``EXPERT_SLICE``)."""
    name = EXPERT_SLICE.get(name, name)
    if len(shards) == 1:
        return shards[0]
    if name in GATED:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    if name in column_parallel(spec) or name in (EMBEDDING, OUTPUT):
        return torch.cat(shards, dim=0)
    if name in ROW_PARALLEL:
        return torch.cat(shards, dim=1)
    return shards[0]  # norms, the router and the shared expert's gate: the same on every rank


def split_shards(name: str, tensor: torch.Tensor, tp: int, spec: Spec = "local") -> list[torch.Tensor]:
    """A layer (or vocabulary, or one expert's) tensor cut into its tensor-parallel shards, the
    inverse of ``merge_shards``; embedding and output rows split on dim 0."""
    name = EXPERT_SLICE.get(name, name)
    if tp == 1:
        return [tensor]
    if name in GATED:
        gates, ups = (half.chunk(tp, dim=0) for half in tensor.chunk(2, dim=0))
        return [torch.cat([g, u], dim=0) for g, u in zip(gates, ups)]
    if name in column_parallel(spec) or name in (EMBEDDING, OUTPUT):
        return list(tensor.chunk(tp, dim=0))
    if name in ROW_PARALLEL:
        return list(tensor.chunk(tp, dim=1))
    return [tensor] * tp


def column_parallel(spec: Spec) -> tuple[str, ...]:
    """The layer tensors split on dim 0 in a legacy file of the layer spec ``spec``."""
    return COLUMN_PARALLEL + (DOWN_PROJECTIONS if spec == "local" else ())


def legacy_expert_name(name: str, expert: int, grouped: bool) -> str:
    """Where a legacy per-rank file keeps its local expert ``expert``'s slice of ``name``
    (``EXPERT_FC1``/``EXPERT_FC2``): megatron-core's SequentialMLP
    (``mlp.experts.local_experts.{j}.linear_fc1.weight``) or, with ``moe_grouped_gemm``, the
    Transformer Engine GroupedLinear of TEGroupedMLP (``mlp.experts.linear_fc1.weight{j}``)."""
    linear = "linear_fc1" if name == EXPERT_FC1 else "linear_fc2"
    return f"mlp.experts.{linear}.weight{expert}" if grouped else f"mlp.experts.local_experts.{expert}.{linear}.weight"
