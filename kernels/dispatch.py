"""Which implementation of each op runs on which device, decided once per device type."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from llmflow.kernels import cross_entropy, fused, gated_delta, reference


@dataclass(frozen=True)
class KernelSet:
    """One implementation of every op the decoder uses."""

    name: str
    rms_norm: Callable
    apply_rotary: Callable
    swiglu: Callable
    geglu: Callable
    attention: Callable
    linear_cross_entropy: Callable
    grouped_mm: Callable
    gated_delta_rule: Callable
    causal_conv1d: Callable


REFERENCE = KernelSet(
    "reference",
    reference.rms_norm,
    reference.apply_rotary,
    reference.swiglu,
    reference.geglu,
    reference.attention,
    reference.linear_cross_entropy,
    reference.grouped_mm,
    gated_delta.reference_gated_delta_rule,
    gated_delta.reference_causal_conv1d,
)
FUSED = KernelSet(
    "fused",
    fused.rms_norm,
    fused.apply_rotary,
    fused.swiglu,
    fused.geglu,
    fused.attention,
    cross_entropy.linear_cross_entropy,
    fused.grouped_mm,
    gated_delta.fused_gated_delta_rule,
    gated_delta.fused_causal_conv1d,
)


def _npu_kernels() -> KernelSet:
    from llmflow.kernels import npu

    return KernelSet(
        # The fused GeGLU: torch ops, which run on the NPU as they are.
        "npu", npu.rms_norm, npu.apply_rotary, npu.swiglu, fused.geglu, npu.attention,
        cross_entropy.linear_cross_entropy, npu.grouped_mm,
        # torch_npu documents no gated delta rule or causal conv1d operator: the torch paths.
        gated_delta.torch_gated_delta_rule, gated_delta.fused_causal_conv1d,
    )


_override: KernelSet | None = None


@functools.cache
def _default_for(device_type: str) -> KernelSet:
    requested = os.environ.get("LLMFLOW_KERNELS", "auto")
    if requested == "reference":
        return REFERENCE
    if requested not in ("auto", "fused"):
        raise ValueError(f"LLMFLOW_KERNELS={requested!r}: expected auto, fused or reference")
    if device_type == "npu":
        return _npu_kernels()
    return FUSED


def kernels_for(device_type: str) -> KernelSet:
    """The kernels used for tensors on ``device_type`` (npu -> torch_npu ops, cuda/cpu ->
    fused torch ops; ``LLMFLOW_KERNELS=reference`` forces the reference formulas)."""
    return _override or _default_for(device_type)


@contextlib.contextmanager
def use_kernels(kernels: KernelSet) -> Iterator[None]:
    """Run the enclosed code with ``kernels`` on every device (e.g. REFERENCE, to compare
    a run against the plain formulas)."""
    global _override
    previous, _override = _override, kernels
    try:
        yield
    finally:
        _override = previous
