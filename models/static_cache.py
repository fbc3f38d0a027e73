"""A KV cache of fixed shapes for a compiled decode step.

``KVCache`` returns the keys written so far, so every decode step attends over one more
position and has new shapes: ``torch.compile`` would recompile it each step and CUDA graphs
could not replay it. ``StaticKVCache`` keeps buffers of ``max_len`` positions at fixed
addresses, writes each step's keys and values in place at its cursor (a device tensor, so the
write position is data, not a constant of the compiled code) and returns the whole buffers;
attention masks the slots not yet written (``query_start``). A step then has the same shapes,
addresses and code every time, what ``mode="reduce-overhead"`` needs to capture it once as a
CUDA graph and replay it, as transformers' StaticCache and gpt-fast do.

Attention layers only: a Gated DeltaNet layer's recurrent state has no static form here, and
finished rows stay in the batch (dropping them would change the shapes).
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Keys and values of ``batch`` rows in buffers [B, Hkv, max_len, D] allocated (zeroed) at
    each layer's first write, plus the keys' document ids when the batch has any; the
    interface of ``KVCache`` that the decoder's attention layers use."""

    def __init__(self, max_len: int, device: torch.device | str) -> None:
        self.max_len = max_len
        self.cursor = torch.zeros((), dtype=torch.long, device=device)
        """Positions already written by every layer: where the next ones go."""
        torch._dynamo.mark_static_address(self.cursor)
        self._keys: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}
        self._documents: torch.Tensor | None = None

    @property
    def query_start(self) -> torch.Tensor:
        """Where the new positions' queries sit among the returned keys: at the cursor."""
        return self.cursor

    @property
    def filled(self) -> int:
        """Positions written (read from the device: for eager callers only)."""
        return int(self.cursor)

    def advance(self, positions: int) -> None:
        self.cursor += positions

    def _slots(self, count: int) -> torch.Tensor:
        return torch.arange(count, device=self.cursor.device) + self.cursor

    def _buffer(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        # Zeros, not empty memory: a masked slot's score must not be NaN before the mask applies.
        buffer = like.new_zeros(shape)
        torch._dynamo.mark_static_address(buffer)
        return buffer

    def documents(self, document_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Store the new positions' document ids [B, S]; the ids of every slot."""
        if document_ids is None:
            return None
        if self._documents is None:
            self._documents = self._buffer(document_ids, (document_ids.shape[0], self.max_len))
        self._documents.index_copy_(1, self._slots(document_ids.shape[1]), document_ids)
        return self._documents

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k [B, Hkv, S, D] and v [B, Hkv, S, Dv] of ``layer`` at the cursor;
        its whole buffers."""
        if layer not in self._keys:
            rows = (k.shape[0], k.shape[1], self.max_len)
            self._keys[layer] = self._buffer(k, (*rows, k.shape[3]))
            self._values[layer] = self._buffer(v, (*rows, v.shape[3]))
        slots = self._slots(k.shape[2])
        self._keys[layer].index_copy_(2, slots, k)
        self._values[layer].index_copy_(2, slots, v)
        return self._keys[layer], self._values[layer]

    def linear_state(self, layer: str) -> tuple[None, None]:
        raise NotImplementedError(f"layer {layer} is a linear-attention layer: a static KV cache holds attention "
                                  "layers only (generate such a model with the growing KVCache)")
