"""The decoder's configuration, read from (and written back to) a Hugging Face config.json,
and the registry of model families by HF ``model_type``.

The keys every family shares (shape, rotary, dtype, token ids) are read here; the keys of
one family (biases, sliding window, ...) by that family's ``read_options``. Both key
spellings are read: ``rope_theta``/``rope_scaling`` (transformers 4) and ``rope_parameters``
(transformers 5; one per layer type for Gemma 3, whose 'full_attention' entry is the shared
rotary), ``torch_dtype`` and ``dtype``. A multimodal config.json whose family names a
``text_config_key`` (Qwen3.5's ``text_config``) is read from that nested config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
YARN_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate")
"""The keys of a 'yarn' rope scaling, those transformers' ``_compute_yarn_parameters`` reads."""
ROPE_SHAPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
"""``rope_parameters`` keys that are not a scaling: the rotary part of each head, and the
multimodal sections (text positions are equal on all three, which makes them ordinary rotary)."""
LAYER_TYPES = ("full_attention", "linear_attention")


class ConfigError(ValueError):
    """A config.json the decoder cannot represent."""


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder of any registered family."""

    model_type: str
    """HF model_type, the key of the model's family in ``FAMILIES``."""
    vocab_size: int
    """Rows of the embedding and output matrices (may exceed the tokenizer's length)."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU feed-forward layer."""
    num_hidden_layers: int
    """Number of decoder blocks."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (fewer than query heads = grouped-query attention)."""
    head_dim: int
    """Width of one attention head."""
    max_position_embeddings: int = 4096
    """Longest sequence the model was trained for."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    rope_scaling: dict[str, Any] | None = None
    """Rotary scaling: None, or a dict with rope_type 'linear', 'llama3' or 'yarn' and its factors
    (YaRN's ``original_max_position_embeddings`` always present, resolved as transformers does)."""
    tie_word_embeddings: bool = False
    """Whether the output projection shares the embedding matrix."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (always on in Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before rotary (Qwen3)."""
    o_bias: bool = False
    """Bias on the attention output projection."""
    mlp_bias: bool = False
    """Bias on the feed-forward projections."""
    sliding_window: int | None = None
    """Attention window (Mistral v0.1); None attends to the whole prefix."""
    num_experts: int = 0
    """Routed experts of each mixture-of-experts layer; 0: every feed-forward block is dense."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert's SwiGLU."""
    norm_topk_prob: bool = False
    """Renormalise each token's top-k routing weights to sum to one (always in Mixtral)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert every token also goes through (Qwen2-MoE; DeepSeek-V3 and
    GLM-4.5: ``n_shared_experts`` x ``moe_intermediate_size``); 0: none."""
    shared_expert_gated: bool = True
    """The shared expert's output is scaled by sigmoid(``shared_expert_gate``(x)) (Qwen2-MoE,
    Qwen3-Next: HF's ``mlp.shared_expert``); False: added as it is (DeepSeek-V3, GLM-4.5: HF's
    ``mlp.shared_experts``)."""
    dense_layers: tuple[int, ...] = ()
    """Layers of a MoE model whose feed-forward block is dense (``mlp_only_layers``, the
    layers ``decoder_sparse_step`` skips, the first ``first_k_dense_replace``), of width
    ``intermediate_size``."""
    router_scoring: str = "softmax"
    """How a MoE layer's router scores the experts: 'softmax' (``TopKRouter``: the k largest
    softmax probabilities) or 'sigmoid' (``GroupLimitedRouter``, DeepSeek-V3, Kimi K2, GLM-4.5:
    sigmoid scores, ``e_score_correction_bias`` added to choose the experts only, top-k among
    the best ``topk_group`` of ``n_group`` groups, weights times ``routed_scaling_factor``)."""
    n_group: int = 1
    """Groups of consecutive experts the sigmoid router splits each layer's experts into."""
    topk_group: int = 1
    """Groups the sigmoid router keeps for a token (the largest sums of their two best biased
    scores); its k experts are chosen among theirs."""
    routed_scaling_factor: float = 1.0
    """Factor on the sigmoid router's routing weights, after their renormalisation."""
    layer_types: tuple[str, ...] = ()
    """Each layer's token mixer: 'full_attention' or 'linear_attention' (a Gated DeltaNet,
    Qwen3-Next and Qwen3.5), or 'sliding_attention' (attention within ``sliding_window``, Gemma
    3, whose 'full_attention' layers have no window); empty: attention on every layer."""
    linear_num_key_heads: int = 0
    """Query/key heads of a Gated DeltaNet layer."""
    linear_num_value_heads: int = 0
    """Value heads of a Gated DeltaNet layer (a multiple of its key heads, each query/key head
    serving that many consecutive value heads)."""
    linear_key_head_dim: int = 0
    """Width of a Gated DeltaNet layer's query/key head."""
    linear_value_head_dim: int = 0
    """Width of a Gated DeltaNet layer's value head (and of its recurrent state's columns)."""
    linear_conv_kernel_dim: int = 0
    """Width of the depthwise causal convolution over a Gated DeltaNet layer's q, k and v."""
    partial_rotary_factor: float = 1.0
    """Share of each attention head's dims that rotary rotates (its first ones; Qwen3-Next and
    Qwen3.5: 0.25)."""
    attention_output_gate: bool = False
    """Attention's q_proj also emits one gate value per output dim; the attention output is
    scaled by their sigmoid before o_proj (Qwen3-Next, Qwen3.5)."""
    q_lora_rank: int | None = None
    """Rank of a Multi-head Latent Attention (MLA) layer's query compression (q_a_proj ->
    q_a_layernorm -> q_b_proj); None: one q_proj (DeepSeek-V3)."""
    kv_lora_rank: int = 0
    """Width of MLA's compressed keys and values (kv_a_proj_with_mqa's latent part); 0: the
    model has no MLA layers."""
    qk_nope_head_dim: int = 0
    """Width of the part of an MLA query/key head that rotary leaves alone."""
    qk_rope_head_dim: int = 0
    """Width of the rotary part of an MLA query/key head (one key part shared by every head);
    ``head_dim``, the width of the rotary frequencies, is set to it."""
    v_head_dim: int = 0
    """Width of an MLA value head."""
    rope_interleave: bool = False
    """Rotary turns adjacent pairs of dims (DeepSeek's layout) instead of the two halves of the
    rotary part."""
    zero_centered_norms: bool = False
    """Every RMSNorm weight (the layers', q/k and final norms) is stored zero-centred and
    applied as (1 + weight) (Qwen3-Next, Qwen3.5, Gemma 3)."""
    sandwich_norms: bool = False
    """Each layer also normalises attention's and the MLP's outputs before adding them to the
    residual stream (``post_attention_layernorm``, ``post_feedforward_layernorm``) and the MLP's
    input by ``pre_feedforward_layernorm`` (Gemma 3); False: ``post_attention_layernorm`` is the
    MLP's input norm."""
    hidden_act: str = "silu"
    """The gated feed-forward block's activation: 'silu' (SwiGLU) or 'gelu_pytorch_tanh' (GELU's
    tanh approximation, Gemma 3's ``hidden_activation``)."""
    attention_scale: float | None = None
    """Softmax scale of the attention scores; None: head_dim ** -0.5 (Gemma 3:
    ``query_pre_attn_scalar`` ** -0.5)."""
    sliding_rope_theta: float | None = None
    """Rotary base of the 'sliding_attention' layers, which no scaling changes (Gemma 3's
    ``rope_local_base_freq``); None: every layer rotates by ``rope_theta`` and ``rope_scaling``."""
    embedding_scale: float | None = None
    """Factor on the embedding's output, rounded to the embedding's dtype first (Gemma 3:
    sqrt(hidden_size)); None: none."""
    embedding_padding_idx: int | None = None
    """The embedding row its lookup passes no gradient to (nn.Embedding's ``padding_idx``: Gemma
    3's ``pad_token_id``, as its transformers model builds the embedding); None: every row's."""
    attention_sinks: bool = False
    """Each attention head has a learned logit (``sinks``) that joins every query's softmax as a
    column whose probability is dropped (gpt-oss)."""
    biased_experts: bool = False
    """The router and both projections of every routed expert have biases (gpt-oss)."""
    expert_swiglu_alpha: float = 1.702
    """Sigmoid gain of the clamped SwiGLU of gpt-oss's experts (``swiglu_alpha``)."""
    expert_swiglu_limit: float = 7.0
    """Clamp of that SwiGLU's gate (above) and up projection (both sides) (``swiglu_limit``)."""
    final_logit_softcapping: float | None = None
    """The logits are capped to ``c * tanh(logits / c)``, in the loss too (Gemma 3's
    ``final_logit_softcapping``); None: no cap."""
    torch_dtype: str = "float32"
    """dtype the weights were saved in."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id(s)."""
    unpadded_vocab_size: int | None = None
    """The model's own vocabulary when vocab_size was padded (for tensor parallelism): the
    padded rows are left out of the logits and the loss, so a checkpoint computes what the
    unpadded model does whatever its padding. None: vocab_size rows, all real."""
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The original config.json, kept so that export writes back every key it had."""

    def padded_to(self, rows: int) -> ModelConfig:
        """This config with embedding and output matrices of ``rows`` rows, the extra rows
        padding outside the vocabulary."""
        real = self.unpadded_vocab_size or self.vocab_size
        return dataclasses.replace(self, vocab_size=rows, unpadded_vocab_size=real if rows != real else None)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` routes its tokens to experts."""
        return self.num_experts > 0 and index not in self.dense_layers

    def is_linear_layer(self, index: int) -> bool:
        """Whether layer ``index`` mixes tokens with a Gated DeltaNet instead of attention."""
        return bool(self.layer_types) and self.layer_types[index] == "linear_attention"

    def is_sliding_layer(self, index: int) -> bool:
        """Whether ``layer_types`` calls layer ``index`` a 'sliding_attention' layer (Gemma 3)."""
        return bool(self.layer_types) and self.layer_types[index] == "sliding_attention"

    def layer_window(self, index: int) -> int | None:
        """The attention window of layer ``index``: ``sliding_window`` on every layer when
        ``layer_types`` has no 'sliding_attention' layer, else on those only."""
        if "sliding_attention" not in self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.is_sliding_layer(index) else None

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config.json; ``source`` names it in error messages."""
        family = family_of(hf.get("model_type"), source)
        original, hf = hf, text_config(hf, family, source)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r}; the Llama/Qwen2 decoder uses 'silu'")
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
            if k not in hf
        ]
        if missing:
            raise ConfigError(f"{source}: missing required keys {missing}")
        heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(hf, source)
        shared = cls(
            model_type=family.model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 0),
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            partial_rotary_factor=float(_rope_shape(hf).get("partial_rotary_factor", 1.0)),
            hf_config=dict(original),
        )
        config = dataclasses.replace(shared, **family.read_options(hf, source))
        if not config.intermediate_size and not all(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
            raise ConfigError(f"{source}: missing required keys ['intermediate_size']")
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``path`` (a config.json, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json found")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(hf, source=str(path))


def inference_tp_problems(config: ModelConfig, tp: int) -> list[str]:
    """Why ``config`` cannot generate at ``tp`` beyond the head and width splits: the
    generation plan shards attention heads and the KV cache with them; a Gated DeltaNet
    layer's heads and recurrent state have no generation plan yet (training's has)."""
    if tp > 1 and "linear_attention" in config.layer_types:
        return [(f"{config.model_type}: tensor-parallel generation of Gated DeltaNet (linear attention) layers is "
                 "not supported; generate with one process (tp=1)")]
    return []


@dataclass(frozen=True)
class Family:
    """A model family: the HF ``model_type`` it reads, its own config.json keys and the
    decoder layer it assembles from shared blocks (``models/blocks``)."""

    model_type: str
    read_options: Callable[[dict[str, Any], str], dict[str, Any]]
    """(config.json, its name for error messages) -> the ``ModelConfig`` fields this family
    sets from its own keys, replacing the shared reading where the family's transformers
    config defaults differently (Qwen3's ``head_dim``); raises ``ConfigError`` for what it
    cannot represent."""
    build_layer: Callable[[ModelConfig, int], nn.Module]
    """(config, layer index) -> that decoder layer: called as ``layer(hidden, cos, sin, document_ids[, (kv_cache, name)])``,
    returning the hidden states, with Hugging Face's module names inside."""
    architecture: str
    """The transformers class config.json's ``architectures`` names (``LlamaForCausalLM``)."""
    write_options: Callable[[ModelConfig], dict[str, Any]]
    """The inverse of ``read_options``: this family's own config.json keys for an export."""
    hf_renames: tuple[tuple[str, str], ...] = ()
    """(our name part, the checkpoint's) pairs where the Hub's tensor names differ from the
    module names (Mixtral's ``.mlp.`` is ``.block_sparse_moe.``)."""
    hf_expert_projections: tuple[tuple[str, str], ...] = (
        ("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj"))
    """(our stacked expert projection, the checkpoint's per-expert module name)."""
    text_config_key: str | None = None
    """config.json nests the decoder's keys under this key (a multimodal model's
    ``text_config``); None: they are at the top level."""
    hf_left_out: tuple[tuple[str, str], ...] = ()
    """(checkpoint name prefix, what it holds) of tensors that are no part of the decoder (a
    vision tower, multi-token prediction layers): loading leaves them out and says so; convert,
    training and export carry them bit for bit (``llmflow/weights/carried.py``). A tensor under
    no prefix that has no place in the decoder is refused."""
    hf_fused_experts: bool = True
    """The checkpoint's ``experts.gate_up_proj``/``experts.down_proj`` are transformers' fused
    experts, read into ``GroupedExperts``' stacked projections; False: the family's experts hold
    those tensors as they are (gpt-oss, under ``hf_renames``)."""
    hf_extra_layers: str | None = None
    """What the checkpoint's layers numbered from ``num_hidden_layers`` on hold (the
    multi-token prediction layer of GLM-4.5, as ``model.layers.{num_hidden_layers}``): left
    out as ``hf_left_out``'s prefixes are; None: such layers are refused as any tensor with no
    place in the decoder."""


FAMILIES: dict[str, Family] = {}
"""Every family by model_type, registered by ``llmflow.models.families`` (which
``llmflow.models`` imports, so the registry is full before any config is read)."""


def register_family(family: Family) -> None:
    FAMILIES[family.model_type] = family


def family_of(model_type: str | None, source: str = "config.json") -> Family:
    """The registered family of ``model_type``; ``ConfigError`` naming the supported ones."""
    if model_type not in FAMILIES:
        raise ConfigError(f"{source}: model_type={model_type!r} is not supported; expected one of {tuple(FAMILIES)}")
    return FAMILIES[model_type]


def text_config(hf: dict[str, Any], family: Family | None = None, source: str = "config.json") -> dict[str, Any]:
    """The decoder's keys of config.json: itself, or (a family with a ``text_config_key``) its
    nested text config, with the top level's ``tie_word_embeddings`` (transformers ties the
    output projection by the top-level key) and its dtype and token ids where the nested
    config has none (or null, as transformers writes a sub-config's unset dtype)."""
    family = family or family_of(hf.get("model_type"), source)
    key = family.text_config_key
    if key is None:
        return hf
    nested = hf.get(key)
    if not isinstance(nested, dict):
        raise ConfigError(f"{source}: model_type={hf.get('model_type')!r} needs a {key!r} object")
    merged = dict(nested)
    if "tie_word_embeddings" in hf:
        merged["tie_word_embeddings"] = hf["tie_word_embeddings"]
    for k in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id"):
        if hf.get(k) is not None and merged.get(k) is None:
            merged[k] = hf[k]
    return merged


def _rope_shape(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``ROPE_SHAPE_KEYS`` config.json has, from rope_parameters or the top level."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    return {k: params.get(k, hf.get(k)) for k in ROPE_SHAPE_KEYS if k in params or k in hf}


def _read_rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling with a 'rope_type' key or None), from either spelling."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # one per layer type (transformers 5's Gemma 3): the full-attention layers'
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta" and k not in ROPE_SHAPE_KEYS}
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_type={rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "yarn":
        scaling = _read_yarn(scaling, hf, source)
    return float(theta), (scaling if rope_type != "default" else None)


def _read_yarn(scaling: dict[str, Any], hf: dict[str, Any], source: str) -> dict[str, Any]:
    """A 'yarn' scaling checked key by key, with ``original_max_position_embeddings`` where
    transformers takes it from: config.json's top-level key first, then the scaling's own, then
    ``max_position_embeddings``."""
    unknown = sorted(set(scaling) - set(YARN_KEYS))
    if unknown:
        raise ConfigError(f"{source}: rope scaling key {unknown[0]!r} is not one of YaRN's {YARN_KEYS}")
    numbers = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim")
    for key in numbers:
        value = scaling.get(key)
        required = key == "factor"
        if (value is not None or required) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{source}: rope scaling {key}={value!r}; YaRN needs a number")
    if not isinstance(scaling.get("truncate", True), bool):
        raise ConfigError(f"{source}: rope scaling truncate={scaling['truncate']!r}; expected true or false")
    original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    return {**scaling, "original_max_position_embeddings": original or hf.get("max_position_embeddings", 4096)}
