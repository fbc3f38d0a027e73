"""Tensor parallelism for a model with LoRA adapters: the plan's styles made to shard each
adapter the way its base weight is sharded."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from llmflow.models.lora import LoraLinear


class LoraParallel(ParallelStyle):
    """Any parallel style ``base`` made safe for a model with LoRA adapters.

    On a ``LoraLinear`` under ColwiseParallel or RowwiseParallel, the adapters are sharded to
    match the base weight. Colwise base (W sharded on out): lora_A replicated, lora_B sharded on
    out. Rowwise base (W sharded on in): lora_A sharded on in, lora_B replicated, so the
    adapter's output is partial like the base's and both go through the one reduction of ``base``.
    Frozen parameters stay frozen (SequenceParallel, for one, makes new trainable Parameters).
    """

    def __init__(self, base: ParallelStyle) -> None:
        super().__init__()
        self.base = base

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.base.src_data_rank = self.src_data_rank
        frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
        if isinstance(module, LoraLinear) and isinstance(self.base, (ColwiseParallel, RowwiseParallel)):
            self._apply_to_lora_linear(module, device_mesh)
        else:
            self.base._apply(module, device_mesh)
        for name, param in module.named_parameters():
            param.requires_grad_(name not in frozen)
        return module

    def _apply_to_lora_linear(self, module: LoraLinear, device_mesh: DeviceMesh) -> None:
        # The stock styles treat every submodule as a Linear to shard their way: hide the children.
        children = dict(module._modules)
        module._modules.clear()
        try:
            self.base._apply(module, device_mesh)
        finally:
            module._modules.update(children)
        colwise = isinstance(self.base, ColwiseParallel)
        placements = {"lora_A": Replicate() if colwise else Shard(1), "lora_B": Shard(0) if colwise else Replicate()}
        for name, placement in placements.items():
            adapter = module.get_submodule(name)
            weight = distribute_tensor(adapter.weight, device_mesh, [placement], src_data_rank=self.src_data_rank)
            adapter.weight = nn.Parameter(weight)

    def __repr__(self) -> str:
        return f"LoraParallel({self.base!r})"


def lora_tp_plan(base_plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan for a model with LoRA adapters: every entry of ``base_plan``
    wrapped in ``LoraParallel``. Use it in place of ``base_plan``
    (``parallelize_module(layer, mesh, lora_tp_plan(plan))``): the stock Colwise/Rowwise styles
    fail on an adapted Linear, and SequenceParallel unfreezes the frozen norms.
    """
    return {key: LoraParallel(style) for key, style in base_plan.items()}
