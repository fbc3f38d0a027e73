"""msprobe's names of torch APIs: ``Functional.linear``, ``Torch.matmul``, ``Tensor.add``.

The prefixes are those of msprobe's dump documentation (Ascend/mstt,
``debug/accuracy_tools/msprobe/docs/05.data_dump_PyTorch.md``): Tensor for torch.Tensor,
Torch for torch, Functional for torch.nn.functional. The table maps the function objects
a TorchFunctionMode receives; an object that several namespaces export is named after the
first of Functional, Torch, Tensor. Operators arrive as the methods they call (``a + b``
as ``Tensor.add``).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F

_FUNCTIONS = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
)

# Autograd plumbing, not computation: passed through untouched.
SKIPPED = frozenset({"Tensor.backward", "Tensor.register_hook", "Tensor.register_post_accumulate_grad_hook", "Tensor.retain_grad"})

_INPLACE_DUNDERS = frozenset(
    f"Tensor.__{op}__"
    for op in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor",
               "ilshift", "irshift", "setitem")
)


@functools.cache
def _table() -> dict[Any, str]:
    table: dict[Any, str] = {}
    # Later namespaces overwrite earlier ones: Functional wins over Torch over Tensor.
    for prefix, namespace in (("Tensor", torch.Tensor), ("Torch", torch), ("Functional", F)):
        for attr in dir(namespace):
            if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                continue
            obj = getattr(namespace, attr, None)
            if isinstance(obj, _FUNCTIONS):
                table[obj] = f"{prefix}.{attr}"
    return table


def api_name(func: Any) -> str | None:
    """``Functional.linear`` for ``torch.nn.functional.linear``; None for what msprobe does
    not name (attribute access, private functions)."""
    try:
        return _table().get(func)
    except TypeError:  # unhashable callables
        return None


def is_inplace(name: str) -> bool:
    """Whether the API writes its first argument (``Tensor.add_``, ``Tensor.__setitem__``)."""
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
