"""The adapters of a LoRA checkpoint (``...q_proj.lora_A.weight`` [r, in] and
``...q_proj.lora_B.weight`` [out, r] beside no other tensor), checked against the base
weights and merged into them: ``W + alpha / rank * B @ A``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmflow.weights.errors import CheckpointError
from llmflow.weights.tensor_source import Source
from llmflow.weights.training_checkpoint import META

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def lora_modules(source: Source) -> list[str]:
    """The adapted modules of a LoRA checkpoint (``model.layers.0.self_attn.q_proj``)."""
    others = sorted(n for n in source.tensors if not n.endswith((LORA_A, LORA_B)))
    if others:
        raise CheckpointError(f"{source.path}: LoRA checkpoint holds non-adapter tensors, e.g. {others[:5]}")
    modules = sorted({n.removesuffix(LORA_A).removesuffix(LORA_B) for n in source.tensors})
    unpaired = [m for m in modules if m + LORA_A not in source.tensors or m + LORA_B not in source.tensors]
    if unpaired:
        raise CheckpointError(f"{source.path}: adapters without both lora_A and lora_B: {unpaired[:5]}")
    if not modules:
        raise CheckpointError(f"{source.path}: LoRA checkpoint holds no adapter tensors")
    return modules


def lora_scale(source: Source) -> float:
    """alpha / rank of a LoRA checkpoint."""
    lora = source.meta.lora or {}
    if "rank" not in lora or "alpha" not in lora:
        raise CheckpointError(f"{source.path / META}: lora {lora} needs 'rank' and 'alpha'")
    return float(lora["alpha"]) / float(lora["rank"])


def check_adapter_shapes(lora: Source, weights: Source, names: list[str], modules: list[str]) -> None:
    """Every adapter belongs to a written weight W [out, in], with A [r, in] and B [out, r]."""
    for module in modules:
        a, b = lora.tensors[module + LORA_A].shape, lora.tensors[module + LORA_B].shape
        name = module + ".weight"
        weight = weights.tensors[name].shape if name in names else None
        if weight is None or len(a) != 2 or len(b) != 2 or a[0] != b[1] or (b[0], a[1]) != weight:
            raise CheckpointError(
                f"{lora.path}: adapter of {module} (A {a}, B {b}) does not fit a base weight "
                f"({'none written' if weight is None else weight}) in {weights.path}"
            )


def merge_adapters(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> None:
    """``W += scale * B @ A`` (computed in float32) for every adapted weight in ``weights``."""
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        if module + LORA_A in adapters:
            a, b = adapters[module + LORA_A].float(), adapters[module + LORA_B].float()
            weights[name] = (weight.float() + scale * (b @ a)).to(weight.dtype)


def merged_loader(lora: Source, weights: Source) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """Reads ``weights``' tensors by name with ``lora``'s adapters merged into each adapted one."""
    modules, scale = lora_modules(lora), lora_scale(lora)

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = weights.load(names)
        adapted = [m for m in modules if m + ".weight" in tensors]
        if adapted:
            merge_adapters(tensors, lora.load([m + s for m in adapted for s in (LORA_A, LORA_B)]), scale)
        return tensors

    return load
