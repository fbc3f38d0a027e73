"""LoRA: low-rank adapters on the decoder's Linear layers and on the routed experts' stacked
weights, named as PEFT names them.

An adapted Linear keeps its own ``weight`` and ``bias`` (``...q_proj.weight``, so a Hugging
Face checkpoint still loads into it) and gains ``lora_A`` (in -> r) and ``lora_B`` (r -> out)
children: ``y = x @ W.T + b + alpha / r * lora_B(lora_A(dropout(x)))``. An experts module
adapted by ``target_parameters`` gains ``lora.{gate_up_proj,down_proj}`` (``ExpertLora``), one
rank-r update per expert of the transformers weight it names (PEFT's ParamWrapper), which the
experts add to their own weights as they compute (``LORA_PARTS``). Adapters go on before
tensor or data parallelism; a tensor-parallel plan must then come from ``lora_tp_plan``
(``lora_parallel.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from llmflow.models.expert_adapters import adapted_expert_weight
from llmflow.models.local import local_part

ADAPTER_NAMES = ("lora_A", "lora_B")


ATTENTION_MLP_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DELTANET_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj")
"""The Linears of a Gated DeltaNet (``linear_attn``) the default adapts; its others are
``in_proj_b``, ``in_proj_a`` (Qwen3.5) and ``in_proj_ba`` (Qwen3-Next)."""
DEFAULT_TARGETS = (*ATTENTION_MLP_TARGETS, *DELTANET_TARGETS)


class LoraConfig(BaseModel):
    """Low-rank adapters (LoRA): the base weights stay frozen, only the adapters train."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    rank: int = Field(8, ge=1)
    """Rank r of the adapters: lora_A maps in_features -> r, lora_B maps r -> out_features."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability on the adapters' input during training."""
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Linear layers to adapt: a module matches when its name is, or ends with '.' plus, one of
    these (PEFT semantics), e.g. 'q_proj' or 'self_attn.q_proj'. The default adapts attention,
    the MLP (a mixture of experts' shared expert) and a Gated DeltaNet's projections of its
    heads' q, k, v, gate and output (Qwen3.5's in_proj_qkv, in_proj_z; Qwen3-Next's
    in_proj_qkvz; out_proj), leaving its per-head scalars b and a (in_proj_b, in_proj_a,
    in_proj_ba) frozen; a list naming those adapts them too."""
    target_parameters: list[str] = Field(default_factory=list)
    """The routed experts' stacked weights to adapt (PEFT's target_parameters), by transformers'
    names: 'experts.gate_up_proj' (every expert's gate and up projections together, gate rows
    first) and 'experts.down_proj'; a parameter matches when its name is, or ends with '.'
    plus, one of these. Each expert gets its own rank-r adapter, PEFT's ParamWrapper update
    (dropout does not apply to them). Empty: the routed experts stay frozen."""

    @model_validator(mode="after")
    def _adapts_something(self) -> LoraConfig:
        if not self.target_modules and not self.target_parameters:
            raise ValueError("lora: target_modules and target_parameters are both empty; name the Linears or the "
                             "expert weights to adapt")
        return self


class LoraLinear(nn.Linear):
    """A Linear with a LoRA adapter; ``weight`` and ``bias`` are the base Linear's own Parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        # Built on meta so nothing is allocated; the base's Parameters replace the placeholders.
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        self.scaling = alpha / rank
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **factory)

    active: bool = True
    """Whether the adapter adds its update (``adapters_off`` turns every adapter off for a while)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return super().forward(x)
        return super().forward(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scaling={self.scaling}"


EXPERT_TARGETS = ("gate_up_proj", "down_proj")
"""The expert weights ``target_parameters`` can name, as transformers names them."""


class _Factor(nn.Module):
    """One factor of an expert adapter, as a module holding ``weight`` (PEFT's names)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class ExpertLora(nn.Module):
    """A LoRA adapter on one stacked expert weight (PEFT's ``target_parameters``): expert e's
    weight W_e [out, in] computes as W_e + alpha / r * B_e @ A_e, with ``lora_A.weight``
    [experts, r, in] and ``lora_B.weight`` [experts, out, r], dim 0 split with the experts'
    weights under expert parallelism."""

    def __init__(self, experts: int, in_features: int, out_features: int, rank: int, alpha: float,
                 like: torch.Tensor) -> None:
        super().__init__()
        factory = {"device": like.device, "dtype": like.dtype}
        self.lora_A = _Factor(torch.empty(experts, rank, in_features, **factory))
        self.lora_B = _Factor(torch.zeros(experts, out_features, rank, **factory))
        self.scaling = alpha / rank

    active: bool = True
    """Whether the adapter adds its update (``adapters_off``)."""

    def delta(self, dtype: torch.dtype) -> torch.Tensor:
        """alpha / r * B_e @ A_e for this rank's experts, [experts, out, in] in ``dtype``."""
        a, b = local_part(self.lora_A.weight).to(dtype), local_part(self.lora_B.weight).to(dtype)
        return torch.bmm(b, a) * self.scaling


def effective_weight(linear: nn.Linear) -> torch.Tensor:
    """The weight ``linear`` computes with: a LoRA adapter's update (alpha / r * B @ A) added
    while the adapter is on, for code that uses a Linear's weight other than by calling it."""
    if isinstance(linear, LoraLinear) and linear.active:
        return linear.weight + (linear.lora_B.weight @ linear.lora_A.weight) * linear.scaling
    return linear.weight


def is_lora_param(name: str) -> bool:
    """Whether the parameter (or state-dict key) ``name`` belongs to a LoRA adapter."""
    return any(part in ADAPTER_NAMES for part in name.split("."))


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def adapted_modules(model: nn.Module, targets: list[str]) -> list[str]:
    """The names of the modules of ``model`` that ``targets`` match (``target_modules``)."""
    return [name for name, _ in model.named_modules() if name and _matches(name, targets)]


def apply_lora(model: nn.Module, config: LoraConfig, generator: torch.Generator | None = None) -> list[str]:
    """Replace every Linear that ``config.target_modules`` names by a ``LoraLinear``, in place,
    and freeze every other parameter. Returns the names of the adapted modules.

    Adapters are initialised at once (lora_A with ``generator``), or, on the meta device, left
    for ``init_lora_weights`` once the model has real storage.
    """
    if any(isinstance(m, (LoraLinear, ExpertLora)) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters")
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = _apply_linear_lora(model, config, generator) if config.target_modules else []
    return adapted + (_apply_expert_lora(model, config, generator) if config.target_parameters else [])


def _apply_linear_lora(model: nn.Module, config: LoraConfig, generator: torch.Generator | None) -> list[str]:
    matched = [(name, m) for name, m in model.named_modules() if name and _matches(name, config.target_modules)]
    not_linear = [f"{name} ({type(m).__name__})" for name, m in matched if not isinstance(m, nn.Linear)]
    if not_linear:
        raise ValueError(
            f"LoRA target_modules {config.target_modules} match modules that are not nn.Linear: {not_linear}"
        )
    if not matched:
        leaves = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"LoRA target_modules {config.target_modules} match no module of the model; "
            f"its nn.Linear leaf names are {leaves}"
        )
    for name, base in matched:
        parent_name, _, leaf = name.rpartition(".")
        adapted = LoraLinear(base, config.rank, config.alpha, config.dropout)
        setattr(model.get_submodule(parent_name), leaf, adapted)
        if not adapted.weight.is_meta:
            _init_adapter(adapted, generator)
    return [name for name, _ in matched]


def _apply_expert_lora(model: nn.Module, config: LoraConfig, generator: torch.Generator | None) -> list[str]:
    """Give every experts module (those with ``LORA_PARTS``) an ``ExpertLora`` per target of
    ``config.target_parameters`` it has; the names of the adapted weights."""
    adapted = []
    for name, module in model.named_modules():
        parts = getattr(module, "LORA_PARTS", None)
        if parts is None:
            continue
        features: dict[str, list[tuple[int, int]]] = {}
        for param_name, part in parts.items():
            features.setdefault(part.target, []).append(part.features(getattr(module, param_name).shape))
        targets = [t for t in features if _matches(f"{name}.{t}", config.target_parameters)]
        if not targets:
            continue
        like = next(iter(module.parameters()))
        experts = like.shape[0]
        module.lora = nn.ModuleDict({t: ExpertLora(experts, features[t][0][0], sum(o for _, o in features[t]),
                                                   config.rank, config.alpha, like) for t in targets})
        for adapter in module.lora.values():
            if not like.is_meta:
                _init_expert_adapter(adapter, generator)
        adapted += [f"{name}.{t}" for t in targets]
    if not adapted:
        raise ValueError(f"LoRA target_parameters {config.target_parameters} match no expert weight of the model; "
                         f"its routed experts' weights are {list(EXPERT_TARGETS)} under each layer's mlp.experts"
                         " (a model without routed experts has none)")
    return adapted


def init_lora_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """(Re-)initialise every adapter as PEFT does: lora_A kaiming-uniform(a=sqrt(5)), lora_B zero,
    so an adapted model starts out computing exactly what the base model does; the Linears'
    adapters first, then the experts', as ``apply_lora`` draws them.

    Works on tensor- or data-parallel (DTensor) adapters too, with the same values as in one process.
    """
    for module in model.modules():
        if isinstance(module, LoraLinear):
            _init_adapter(module, generator)
    for module in model.modules():
        if isinstance(module, ExpertLora):
            _init_expert_adapter(module, generator)


@torch.no_grad()
def _init_adapter(module: LoraLinear, generator: torch.Generator | None) -> None:
    _fill(module.lora_A.weight, lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator))
    module.lora_B.weight.zero_()


@torch.no_grad()
def _init_expert_adapter(module: ExpertLora, generator: torch.Generator | None) -> None:
    # As PEFT's lora_A Linear [experts * r, in]: each row's fan-in is in_features.
    _fill(module.lora_A.weight,
          lambda t: nn.init.kaiming_uniform_(t.view(-1, t.shape[-1]), a=math.sqrt(5), generator=generator))
    module.lora_B.weight.zero_()


def _fill(param: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor  # only training needs DTensor (a second to import)

    if isinstance(param, DTensor):
        # Initialise the full tensor and hand each rank its shard, so values match one process.
        full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        init(full)
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
    else:
        init(param)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors only, keyed like ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return {name: tensor for name, tensor in model.state_dict().items() if is_lora_param(name)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (W += alpha / r * B @ A) and turn each
    ``LoraLinear`` back into a plain ``nn.Linear`` with the same parameter names."""
    for module in list(model.modules()):
        if isinstance(adapters := getattr(module, "lora", None), nn.ModuleDict):
            deltas = {t: adapter.delta(torch.float32) for t, adapter in adapters.items()}
            for param_name in module.LORA_PARTS:
                weight = getattr(module, param_name)
                weight.copy_(adapted_expert_weight(module, param_name, weight.float(), deltas).to(weight.dtype))
            module.lora = None
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoraLinear):
            continue
        delta = module.lora_B.weight.float() @ module.lora_A.weight.float()
        module.weight.add_((delta * module.scaling).to(module.weight.dtype))
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        plain.weight, plain.bias = module.weight, module.bias
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, plain)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base inside the block: every LoRA adapter left out (a GRPO run's
    reference model under LoRA, as PEFT's ``disable_adapter``)."""
    adapted = [m for m in model.modules() if isinstance(m, (LoraLinear, ExpertLora))]
    for module in adapted:
        module.active = False
    try:
        yield
    finally:
        for module in adapted:
            module.active = True
