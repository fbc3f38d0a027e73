"""Parallel layouts: checking a (pp, dp, cp, tp) split (with ep expert-parallel ranks carved
out of dp) against the world and the model, and building the device mesh for it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from llmflow.models.config import ModelConfig

MESH_DIMS = ("pp", "dp", "cp", "tp")
LAYOUT_FIELDS = (*MESH_DIMS, "ep")


class LayoutError(ValueError):
    """A parallel layout that cannot work for this world size or model."""


@dataclass(frozen=True)
class ParallelLayout:
    """How the ranks of a job are split. pp * dp * cp * tp must equal the number of ranks."""

    pp: int = 1
    """Pipeline stages: consecutive decoder layers on different ranks."""
    dp: int = 1
    """Data-parallel replicas (parameters sharded with FSDP2 across them)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and FFN columns are split this many ways."""
    cp: int = 1
    """Context-parallel degree: every sequence's positions are split over cp ranks, which
    reach each other's around attention (``models/context_parallel.py``)."""
    ep: int = 1
    """Expert-parallel degree (a mixture-of-experts model): each group of ep data-parallel
    ranks splits every MoE layer's experts among themselves and sends each token to the ranks
    holding its experts. ep divides dp; it adds no ranks."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @classmethod
    def of_world(cls, world_size: int, pp: int = 1, tp: int = 1, dp: int | None = None, ep: int = 1,
                 cp: int = 1) -> ParallelLayout:
        """The layout of ``world_size`` ranks split into ``pp`` stages of ``cp * tp`` ranks: dp
        is what remains (world_size / (pp * cp * tp), at least 1) unless given."""
        return cls(pp=pp, dp=dp or max(world_size // (pp * cp * tp), 1), cp=cp, tp=tp, ep=ep)


def product(factors: list[tuple[str, int]]) -> str:
    """Named degrees and what they multiply to: "pp*tp = 2*1 = 2", or "tp=3" for one alone."""
    if len(factors) == 1:
        return f"{factors[0][0]}={factors[0][1]}"
    names, values = zip(*factors, strict=True)
    return f"{'*'.join(names)} = {'*'.join(map(str, values))} = {math.prod(values)}"


def layout_problems(layout: ParallelLayout, world_size: int, config: ModelConfig | None = None) -> list[str]:
    """Every reason ``layout`` cannot run on ``world_size`` ranks with ``config`` (empty when it can)."""
    problems = []
    for name in LAYOUT_FIELDS:
        value = getattr(layout, name)
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be a positive integer")
    if problems:
        return problems
    if layout.world_size != world_size:
        factors = [(name, getattr(layout, name)) for name in MESH_DIMS if name != "cp" or layout.cp > 1]
        problems.append(f"{product(factors)} but the job has {world_size} ranks; they must be equal")
    if config is not None:
        tp = layout.tp
        for field, value in (
            ("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.num_key_value_heads),
            ("intermediate_size", config.intermediate_size),
        ):
            if value % tp:
                problems.append(f"model {field}={value} is not divisible by tp={tp}")
        if "linear_attention" in config.layer_types and config.linear_num_key_heads % tp:
            # Each rank holds whole key heads and the value heads they serve.
            problems.append(f"model linear_num_key_heads={config.linear_num_key_heads} (Gated DeltaNet key heads) "
                            f"is not divisible by tp={tp}")
        if layout.ep > 1 and not config.num_experts:
            problems.append(f"ep={layout.ep} needs a mixture-of-experts model; {config.model_type} has no experts")
        elif config.num_experts % layout.ep:
            problems.append(f"ep={layout.ep} does not divide the model's num_experts={config.num_experts}")
        if layout.pp > config.num_hidden_layers:
            problems.append(f"pp={layout.pp} stages but the model has {config.num_hidden_layers} layers; each stage needs one")
    if layout.dp % layout.ep:
        problems.append(f"ep={layout.ep} does not divide dp={layout.dp}: expert-parallel ranks are data-parallel ranks")
    return problems


def validate_layout(layout: ParallelLayout, world_size: int, config: ModelConfig | None = None) -> None:
    """Raise LayoutError listing every problem with ``layout``, before any work starts."""
    problems = layout_problems(layout, world_size, config)
    if problems:
        raise LayoutError("impossible parallel layout: " + "; ".join(problems))


def build_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """A DeviceMesh with dims ("pp", "dp", "tp"), and "cp" between dp and tp when cp > 1; tp
    innermost so tensor-parallel ranks are neighbours (same node, fastest links), cp next (its
    all-to-alls are the next heaviest), pp outermost (its point-to-point traffic is the
    lightest, so it may cross nodes). With ep > 1, dp is made of ("dp_replicate", "ep"): the
    ep ranks that share out the experts are neighbours, and the experts' gradients are
    summed over "dp_replicate" (the ranks holding the same experts). With cp > 1, "dp_cp"
    (dp and cp flattened) is what FSDP shards over: the cp ranks of a replica hold the same
    weights and each computes their gradients from its own positions."""
    import torch.distributed as dist

    validate_layout(layout, dist.get_world_size())
    data = (("dp", layout.dp),) if layout.ep == 1 else (("dp_replicate", layout.dp // layout.ep), ("ep", layout.ep))
    context = (("cp", layout.cp),) if layout.cp > 1 else ()
    dims = (("pp", layout.pp), *data, *context, ("tp", layout.tp))
    mesh = init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims))
    data_names = tuple(name for name, _ in data)
    if layout.ep > 1:
        mesh[data_names]._flatten("dp")
    if layout.cp > 1:
        mesh[(*data_names, "cp")]._flatten("dp_cp")
    return mesh
