"""How a Llama/Qwen2-family decoder lies in a megatron-core GPTModel checkpoint, and the way
to and from llmflow's (Hugging Face-named) tensors.

megatron-core's ``torch_dist`` format stores every tensor whole, with its global shape, so the
tensor-parallel layout is invisible in it; the layers of a block are stacked on a leading axis
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[layers, ...]``), whatever the
pipeline split. The names are those of the Transformer Engine layer spec, which the local spec
maps its own to, so both read the same:

- ``linear_qkv``: the q, k and v projections fused, per query group: the group's query heads,
  then its key head, then its value head (``head_dim`` rows each);
- ``linear_fc1``: gate then up, each whole (``[gate; up]``);
- ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``: the input and
  post-attention RMSNorms;
- ``q_layernorm`` and ``k_layernorm`` (``qk_layernorm``, Qwen3): the per-head RMSNorms of
  queries and keys, ``[head_dim]``, the same on every tensor-parallel rank (the local spec
  names them so too);
- ``embedding.word_embeddings`` and ``output_layer``: the vocabulary padded to a multiple of
  ``make_vocab_size_divisible_by`` times the tensor-parallel size (``output_layer`` absent
  when the embeddings are shared);
- ``<linear>._extra_state/shard_{layer}_{layers}``: Transformer Engine's per-layer state
  (empty, ``[None]``, outside fp8 training), which megatron-core's loader requires.
"""

from __future__ import annotations

from dataclasses import dataclass

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
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
# The local layer spec's own names (a legacy per-rank file keeps them; torch_dist renames them).
LOCAL_NORM_NAMES = {"input_layernorm.weight": INPUT_NORM, "pre_mlp_layernorm.weight": MLP_NORM}

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
}
"""Each Megatron layer tensor (in megatron-core's order) and the llmflow tensors of the same
layer (``model.layers.{i}.NAME``) it is made of, in the order they are fused."""
OTHER_SOURCES = {EMBEDDING: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight", OUTPUT: "lm_head.weight"}
"""The Megatron tensors outside the layers and the llmflow tensor each one is."""

COLUMN_PARALLEL = (QKV, QKV_BIAS, FC1)
"""Layer tensors split over tensor-parallel ranks on dim 0 (fc1 per half: see ``merge_shards``)."""
ROW_PARALLEL = (PROJ, FC2)
"""Layer tensors split on dim 1."""


def layer_key(name: str) -> str:
    """The stacked torch_dist key of a layer tensor."""
    return LAYERS + name


def extra_state_key(module: str, layer: int, layers: int) -> str:
    """The key of one layer's Transformer Engine extra state (a ShardedObject)."""
    return f"{LAYERS}{module}._extra_state/shard_{layer}_{layers}"


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


def missing_biases(config: ModelConfig) -> str | None:
    """The biases of a model of ``config`` that this layout has no place for (Megatron-LM's
    ``add_bias_linear=False``: q/k/v biases only), or None."""
    found = [name for name, present in (("o_proj", config.o_bias), ("MLP", config.mlp_bias)) if present]
    return f"biases on {' and '.join(found)} (config.json attention_bias/mlp_bias)" if found else None


def layer_tensors(config: ModelConfig) -> list[str]:
    """The Megatron layer tensors of a model of ``config``, in megatron-core's order."""
    optional = {QKV_BIAS: config.qkv_bias, Q_NORM: config.qk_norm, K_NORM: config.qk_norm}
    return [name for name in LAYER_SOURCES if optional.get(name, True)]


def other_tensors(config: ModelConfig) -> list[str]:
    """The Megatron tensors outside the layers of a model of ``config``."""
    return [EMBEDDING, FINAL_NORM, *([] if config.tie_word_embeddings else [OUTPUT])]


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of one layer of each Megatron layer tensor of a model of ``config``."""
    a, hidden, ffn = Attention.of(config), config.hidden_size, config.intermediate_size
    qkv_rows = (a.heads + 2 * a.groups) * a.head_dim
    return {INPUT_NORM: (hidden,), QKV: (qkv_rows, hidden), QKV_BIAS: (qkv_rows,), Q_NORM: (a.head_dim,),
            K_NORM: (a.head_dim,), PROJ: (hidden, a.heads * a.head_dim), MLP_NORM: (hidden,), FC1: (2 * ffn, hidden),
            FC2: (hidden, ffn)}


def fuse(name: str, parts: list[torch.Tensor], attention: Attention) -> torch.Tensor:
    """The Megatron layer tensor ``name`` from its llmflow parts (``LAYER_SOURCES[name]``)."""
    if name in (QKV, QKV_BIAS):
        return attention.fuse(*parts)
    return torch.cat(parts) if name == FC1 else parts[0]


def unfuse(name: str, tensor: torch.Tensor, attention: Attention) -> tuple[torch.Tensor, ...]:
    """The llmflow parts of the Megatron layer tensor ``name``, the inverse of ``fuse``."""
    if name in (QKV, QKV_BIAS):
        return attention.split(tensor)
    return tensor.chunk(2, dim=0) if name == FC1 else (tensor,)


def merge_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """One layer (or vocabulary) tensor whole from its tensor-parallel shards in rank order (a
    legacy per-rank checkpoint): each rank's fc1 holds its slice of gate then its slice of up."""
    if len(shards) == 1:
        return shards[0]
    if name == FC1:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    if name in COLUMN_PARALLEL or name in (EMBEDDING, OUTPUT):
        return torch.cat(shards, dim=0)
    if name in ROW_PARALLEL:
        return torch.cat(shards, dim=1)
    return shards[0]  # norms: the same on every rank


def split_shards(name: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """A layer (or vocabulary) tensor cut into its tensor-parallel shards, the inverse of
    ``merge_shards``; embedding and output rows split on dim 0."""
    if tp == 1:
        return [tensor]
    if name == FC1:
        gates, ups = (half.chunk(tp, dim=0) for half in tensor.chunk(2, dim=0))
        return [torch.cat([g, u], dim=0) for g, u in zip(gates, ups)]
    if name in COLUMN_PARALLEL or name in (EMBEDDING, OUTPUT):
        return list(tensor.chunk(tp, dim=0))
    if name in ROW_PARALLEL:
        return list(tensor.chunk(tp, dim=1))
    return [tensor] * tp
