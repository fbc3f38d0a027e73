"""The adapters of a LoRA checkpoint (``...q_proj.lora_A.weight`` [r, in] and
``...q_proj.lora_B.weight`` [out, r] beside no other tensor; on the routed experts
``...mlp.experts.lora.{gate_up_proj,down_proj}.lora_A.weight`` [experts, r, in] and
``lora_B.weight`` [experts, out, r]), checked against the base weights and merged into them:
``W + alpha / rank * B @ A``, each expert's into its part of the stacked weights
(``LORA_PARTS`` of the experts modules)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmflow.models.blocks.biased_moe import ClampedSwiGLUExperts
from llmflow.models.blocks.moe import GroupedExperts
from llmflow.models.expert_adapters import ExpertAdapterPart
from llmflow.models.lora import EXPERT_TARGETS
from llmflow.weights.errors import CheckpointError
from llmflow.weights.tensor_source import Source
from llmflow.weights.training_checkpoint import META

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
EXPERT_PARTS: dict[str, ExpertAdapterPart] = {**GroupedExperts.LORA_PARTS, **ClampedSwiGLUExperts.LORA_PARTS}
"""The stacked expert weights an expert adapter updates, by their last name."""


def adapter_of(name: str) -> tuple[str, ExpertAdapterPart | None] | None:
    """The adapter module that would update the checkpoint tensor ``name`` (a Linear's
    ``.weight``; a stacked expert weight, with its part of the adapter's update), or None."""
    if name.endswith(".weight"):
        return name.removesuffix(".weight"), None
    parent, _, leaf = name.rpartition(".")
    if parent.endswith(".experts") and (part := EXPERT_PARTS.get(leaf)) is not None:
        return f"{parent}.lora.{part.target}", part
    return None


def is_expert_adapter(module: str) -> bool:
    """Whether the adapter module ``module`` is on the routed experts (``...experts.lora.*``)."""
    return ".experts.lora." in module


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
    """Every adapter belongs to a written weight W [out, in], with A [r, in] and B [out, r]; an
    expert adapter to the stacked weights it updates, with A [experts, r, in] and B [experts,
    out, r] (out: the rows of its parts together)."""
    bases: dict[str, list[tuple[str, ExpertAdapterPart | None]]] = {}
    for name in names:
        if (found := adapter_of(name)) is not None and found[0] in modules:
            bases.setdefault(found[0], []).append((name, found[1]))
    for module in modules:
        a, b = tuple(lora.tensors[module + LORA_A].shape), tuple(lora.tensors[module + LORA_B].shape)
        written = bases.get(module, [])
        shapes = [tuple(weights.tensors[name].shape) for name, _ in written]
        if is_expert_adapter(module):
            rows = [part.features(shape)[1] for (_, part), shape in zip(written, shapes, strict=True)]
            expected = written and len(a) == len(b) == 3 and a[:2] == (b[0], b[2]) and all(
                (s[0], part.features(s)[0]) == (a[0], a[2]) for (_, part), s in zip(written, shapes, strict=True)) \
                and sum(rows) == b[1]
        else:
            expected = written and len(a) == len(b) == 2 and a[0] == b[1] and (b[0], a[1]) == shapes[0]
        if not expected:
            raise CheckpointError(
                f"{lora.path}: adapter of {module} (A {a}, B {b}) does not fit a base weight "
                f"({shapes or 'none written'}) in {weights.path}"
            )


def merge_adapters(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> None:
    """``W += scale * B @ A`` (computed in float32) for every adapted weight in ``weights``, a
    stacked expert weight's part of each expert's update into it."""
    for name, weight in weights.items():
        found = adapter_of(name)
        if found is None or found[0] + LORA_A not in adapters:
            continue
        module, part = found
        a, b = adapters[module + LORA_A].float(), adapters[module + LORA_B].float()
        delta = scale * (b @ a)
        weights[name] = (weight.float() + (delta if part is None else part.of(delta))).to(weight.dtype)


def merged_loader(lora: Source, weights: Source) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """Reads ``weights``' tensors by name with ``lora``'s adapters merged into each adapted one."""
    modules, scale = lora_modules(lora), lora_scale(lora)

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = weights.load(names)
        adapted = sorted({found[0] for name in tensors if (found := adapter_of(name)) and found[0] in modules})
        if adapted:
            merge_adapters(tensors, lora.load([m + s for m in adapted for s in (LORA_A, LORA_B)]), scale)
        return tensors

    return load


def expert_targets(modules: list[str]) -> list[str]:
    """The expert weights (``EXPERT_TARGETS``, in that order) that ``modules``' expert adapters update."""
    present = {m.rpartition(".")[2] for m in modules if is_expert_adapter(m)}
    return [t for t in EXPERT_TARGETS if t in present]


def peft_expert_tensor(name: str, tensor: torch.Tensor, targets: list[str]) -> tuple[str, torch.Tensor]:
    """An expert adapter's factor (``...experts.lora.{target}.lora_A.weight`` [experts, r, in] or
    ``lora_B.weight`` [experts, out, r]) as PEFT's ParamWrapper saves it: lora_A [experts r, in]
    (rows expert-major), lora_B [out, r experts] (columns rank-major), under the experts module,
    one ``base_layer.`` deeper for each target after this one in ``targets`` (PEFT wraps a module's
    targeted parameters one inside the other, the first innermost)."""
    module, _, factor = name.rpartition(".lora_")  # factor: "A.weight" or "B.weight"
    experts_module, _, target = module.rpartition(".lora.")
    depth = len(targets) - 1 - targets.index(target)
    if factor.startswith("A"):
        value = tensor.reshape(-1, tensor.shape[-1])
    else:
        value = tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)
    return f"{experts_module}.{'base_layer.' * depth}lora_{factor}", value
