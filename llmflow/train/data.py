"""Training samples addressed by a global sample index, so the data position of a run is
one number (consumed samples) that survives restarts and layout changes.

- ``PretrainSamples``: Megatron-style samples of ``seq_length + 1`` tokens cut from the
  concatenated documents of an indexed dataset (consecutive samples share one token, the
  target of the last position), visited in a seeded shuffled order that is redrawn every
  epoch;
- ``SftSamples``: the padded rows of an instruction dataset, in a seeded shuffled order;
- ``BlendedSamples``: several pretraining datasets mixed by weight, each sample assigned
  to the dataset whose share lags its weight most (Megatron's blending rule).

Every sample is ``input_ids``, ``targets`` (next-token labels, -100 where no loss is
taken) and ``document_ids`` (None when attention spans the whole sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmflow.data.indexed import IndexedDataset, IndexedDatasetError
from llmflow.data.instruction_dataset import InstructionDataset
from llmflow.models.blocks.rotary import positions_from_documents


@dataclass
class Sample:
    input_ids: np.ndarray
    targets: np.ndarray
    document_ids: np.ndarray | None
    source: str
    """Which dataset and sample this is, for error messages."""
    row: int | None = None
    """The dataset row (preference data: where its reference log-probs are kept)."""


def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class ShuffledEpochs:
    """Index ``g`` -> (epoch, item) with a fresh permutation of ``n`` items per epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._orders: dict[int, np.ndarray] = {}

    def item(self, g: int) -> int:
        epoch, i = divmod(g, self.n)
        if epoch not in self._orders:
            self._orders = {epoch: _epoch_order(self.n, self.seed, epoch)}
        return int(self._orders[epoch][i])


def pretrain_prefix(path: str | Path) -> Path:
    """``{prefix}_text_document`` for a tokenize-stage prefix, or the path as given."""
    path = Path(path)
    if Path(f"{path}.idx").is_file():
        return path
    return Path(f"{path}_text_document")


class PretrainSamples:
    """Samples of ``seq_length`` inputs (+1 target token) from one indexed dataset."""

    def __init__(self, path: str | Path, seq_length: int, seed: int, document_attention: bool = False) -> None:
        self.path = pretrain_prefix(path)
        self.data = IndexedDataset(self.path)
        self.seq_length = seq_length
        self.document_attention = document_attention
        tokens = self.data.num_tokens
        self.num_samples = (tokens - 1) // seq_length
        if self.num_samples < 1:
            raise IndexedDatasetError(
                f"{self.path}: {tokens} tokens cannot fill one sample of seq_length {seq_length} + 1"
            )
        self._order = ShuffledEpochs(self.num_samples, seed)
        # Token offset where each document starts, for document ids.
        self._doc_starts = np.concatenate([[0], np.cumsum(self.data.sequence_lengths, dtype=np.int64)])

    def __getitem__(self, g: int) -> Sample:
        i = self._order.item(g)
        start = i * self.seq_length
        tokens = self.data.tokens(start, self.seq_length + 1).astype(np.int64)
        docs = None
        if self.document_attention:
            positions = np.arange(start, start + self.seq_length)
            docs = np.searchsorted(self._doc_starts, positions, side="right") - 1
            docs = docs - docs[0]
        return Sample(tokens[:-1], tokens[1:], docs, f"{self.path} sample {i} (tokens {start}..{start + self.seq_length})")


class SftSamples:
    """Rows of an instruction dataset (or of a preference dataset: ``dataset``), shuffled per epoch."""

    def __init__(self, path: str | Path, seed: int, dataset: type[InstructionDataset] = InstructionDataset) -> None:
        self.path = Path(path)
        self.data = dataset(path)
        self.seq_length = self.data.seq_length
        self.num_samples = len(self.data)
        self._order = ShuffledEpochs(self.num_samples, seed)

    def __getitem__(self, g: int) -> Sample:
        return self.row(self._order.item(g))

    def row(self, i: int) -> Sample:
        """Row ``i`` of the dataset (in its stored order)."""
        row = self.data[i]
        return Sample(row["input_ids"], row["targets"], row["document_ids"], f"{self.path} row {i}", i)


def blend_assignments(weights: list[float], count: int) -> tuple[np.ndarray, np.ndarray]:
    """For global samples 0..count-1: the dataset each comes from and its index within that
    dataset. Each sample goes to the dataset furthest below its weighted share."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    chosen = np.empty(count, dtype=np.int64)
    within = np.empty(count, dtype=np.int64)
    taken = np.zeros(len(w), dtype=np.int64)
    for g in range(count):
        d = int(np.argmax(w * (g + 1) - taken))
        chosen[g], within[g] = d, taken[d]
        taken[d] += 1
    return chosen, within


class BlendedSamples:
    """Several pretraining datasets mixed by weight."""

    def __init__(self, parts: list[PretrainSamples], weights: list[float], total: int) -> None:
        self.parts = parts
        self.seq_length = parts[0].seq_length
        self.num_samples = total
        self._dataset, self._within = blend_assignments(weights, total)

    def __getitem__(self, g: int) -> Sample:
        return self.parts[int(self._dataset[g])][int(self._within[g])]


def collate(samples: list[Sample]) -> dict[str, torch.Tensor | None]:
    """Stack samples into a batch of tensors (document_ids None when no sample has them), with
    every token's position (restarting at each document when there are documents)."""
    input_ids = torch.from_numpy(np.stack([s.input_ids for s in samples]))
    batch: dict[str, torch.Tensor | None] = {
        "input_ids": input_ids,
        "targets": torch.from_numpy(np.stack([s.targets for s in samples])),
        "document_ids": None,
        "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids),
    }
    if all(s.row is not None for s in samples):
        batch["rows"] = torch.tensor([s.row for s in samples])
    if any(s.document_ids is not None for s in samples):
        documents = torch.from_numpy(
            np.stack([s.document_ids if s.document_ids is not None else np.zeros_like(s.input_ids) for s in samples])
        )
        batch["document_ids"] = documents
        batch["position_ids"] = positions_from_documents(documents)
    return batch


def check_token_ids(samples: list[Sample], vocab_size: int) -> None:
    """Raise naming the first sample with an id outside [0, vocab_size): caught here, it is
    an error message instead of a device-side assert inside the embedding."""
    for s in samples:
        ids = s.input_ids
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"{s.source}: token id {int(ids[pos])} at position {pos} is outside the model vocabulary "
                f"(vocab_size {vocab_size}); the data was tokenized for another model, or vocab_size is wrong"
            )
