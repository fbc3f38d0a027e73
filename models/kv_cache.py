"""The key/value cache that generation threads through the decoder's attention layers."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of the positions processed so far, in buffers [B, Hkv, max_len, D]
    allocated on each layer's first write (so their shapes follow the weights, sharded or
    not), plus the keys' document ids when the batch has any (left padding as a document of
    its own keeps pad positions out of every real token's attention)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.filled = 0
        """Positions already written by every layer."""
        self._keys: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}
        self._documents: torch.Tensor | None = None

    def documents(self, document_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Store the new positions' document ids [B, S]; the ids of every key up to them."""
        if document_ids is None:
            return None
        if self._documents is None:
            self._documents = document_ids.new_zeros(document_ids.shape[0], self.max_len)
        end = self.filled + document_ids.shape[1]
        self._documents[:, self.filled : end] = document_ids
        return self._documents[:, :end]

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k/v [B, Hkv, S, D] of ``layer``; its keys and values up to them."""
        if layer not in self._keys:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self._keys[layer], self._values[layer] = k.new_empty(shape), v.new_empty(shape)
        end = self.filled + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions cannot hold {end}")
        self._keys[layer][:, :, self.filled : end] = k
        self._values[layer][:, :, self.filled : end] = v
        return self._keys[layer][:, :, :end], self._values[layer][:, :, :end]

    def repeat(self, batch: int, max_len: int) -> KVCache:
        """A cache of ``batch`` rows with room for ``max_len`` positions, each row starting
        with this one-row cache's positions (a prompt prefix computed once, shared by a batch)."""
        out = KVCache(max_len)
        for layer in self._keys:
            keys, values = self._keys[layer][:, :, : self.filled], self._values[layer][:, :, : self.filled]
            out.update(layer, keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1))
        if self._documents is not None:
            out.documents(self._documents[:, : self.filled].expand(batch, -1))
        out.filled = self.filled
        return out
