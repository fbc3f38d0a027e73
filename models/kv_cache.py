"""The cache that generation threads through the decoder's layers: the keys and values of
attention layers, and the states of Gated DeltaNet (linear attention) layers."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of the positions processed so far, in buffers [B, Hkv, max_len, D]
    allocated on each layer's first write (so their shapes follow the weights, sharded or
    not; the values' D may differ from the keys', or be 0: Multi-head Latent Attention caches
    its latents and rotary key parts as one head of keys, their latent part its values), plus
    the keys' document ids when the batch has any (left padding as a document of its own
    keeps pad positions out of every real token's attention).

    A Gated DeltaNet layer keeps its state instead, replaced at each step: the last inputs of
    its causal convolution [B, D, K - 1] and its recurrent state [B, H, Dk, Dv]."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.filled = 0
        """Positions already written by every layer."""
        self._keys: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}
        self._documents: torch.Tensor | None = None
        self._linear: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    query_start = None
    """Where the new positions' queries sit among the returned keys: None, the last ones."""

    def advance(self, positions: int) -> None:
        """Count the positions every layer has just written."""
        self.filled += positions

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
        """Write the new k [B, Hkv, S, D] and v [B, Hkv, S, Dv] of ``layer``; its keys and
        values up to them."""
        if layer not in self._keys:
            rows = (k.shape[0], k.shape[1], self.max_len)
            self._keys[layer], self._values[layer] = k.new_empty(*rows, k.shape[3]), v.new_empty(*rows, v.shape[3])
        end = self.filled + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions cannot hold {end}")
        self._keys[layer][:, :, self.filled : end] = k
        self._values[layer][:, :, self.filled : end] = v
        return self._keys[layer][:, :, :end], self._values[layer][:, :, :end]

    def linear_state(self, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(convolution state, recurrent state) of linear-attention ``layer`` after the cached
        positions; (None, None) before its first write."""
        return self._linear.get(layer, (None, None))

    def set_linear_state(self, layer: str, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Replace ``layer``'s states with those after the positions it just processed."""
        self._linear[layer] = (conv, recurrent)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (indices, in their new order): generation drops the
        rows that have finished."""
        for layer in self._keys:
            self._keys[layer] = self._keys[layer].index_select(0, rows)
            self._values[layer] = self._values[layer].index_select(0, rows)
        self._linear = {layer: tuple(s.index_select(0, rows) for s in states) for layer, states in self._linear.items()}
        if self._documents is not None:
            self._documents = self._documents.index_select(0, rows)

    def repeat(self, batch: int, max_len: int) -> KVCache:
        """A cache of ``batch`` rows with room for ``max_len`` positions, each row starting
        with this one-row cache's positions (a prompt prefix computed once, shared by a batch)."""
        out = KVCache(max_len)
        for layer in self._keys:
            keys, values = self._keys[layer][:, :, : self.filled], self._values[layer][:, :, : self.filled]
            out.update(layer, keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1))
        for layer, states in self._linear.items():
            out.set_linear_state(layer, *(s.expand(batch, *s.shape[1:]).contiguous() for s in states))
        if self._documents is not None:
            out.documents(self._documents[:, : self.filled].expand(batch, -1))
        out.filled = self.filled
        return out
