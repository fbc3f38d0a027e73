"""Training rows of a tokenized instruction set, padded to its sequence length.

A row is a document of the indexed datasets ``tokenize_instruction`` wrote: one sample,
or (packed) several samples back to back. The preference tokenizer writes the same layout
(a row holds pairs of sequences; ``llmflow.data.preference_dataset``), which this class
reads when the stage it expects (``stages``) says so. ``InstructionDataset[i]`` gives numpy
arrays of ``seq_length`` entries:

- ``input_ids``: the tokens, then the pad id;
- ``labels``: aligned with the tokens (-100 on prompt tokens and padding);
- ``document_ids``: which sample of the row each position belongs to (padding is one more
  sample), from which the model derives block-diagonal attention and positions that
  restart at every sample;
- ``targets``: the next-token labels the loss reads (``labels`` shifted left within each
  sample, -100 at every sample's last position).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmflow.artifacts import read_manifest
from llmflow.data.indexed import IndexedDataset, IndexedDatasetError
from llmflow.data.tokenize_instruction import IGNORE_INDEX, STAGE, output_paths


def next_token_targets(labels: np.ndarray, document_ids: np.ndarray) -> np.ndarray:
    """``labels[..., t + 1]`` where position t + 1 is in the same sample as t, else -100."""
    targets = np.full_like(labels, IGNORE_INDEX, dtype=np.int64)
    same = document_ids[..., 1:] == document_ids[..., :-1]
    targets[..., :-1] = np.where(same, labels[..., 1:], IGNORE_INDEX)
    return targets


class InstructionDataset:
    """Padded rows of ``{prefix}_packed_{input_ids,labels}_document``; ``prefix`` is the
    tokenize stage's ``out``, whose manifest gives the sequence length and pad id."""

    stages: tuple[str, ...] = (STAGE,)
    """The tokenize stages whose output this reads (by default, the class's)."""
    kind = "instruction"
    """What the data is, in errors."""

    def __init__(self, prefix: str | Path, stages: tuple[str, ...] | None = None) -> None:
        stages = stages or self.stages
        manifest = read_manifest(prefix)
        if manifest is None or manifest.get("stage") not in stages:
            raise IndexedDatasetError(
                f"{prefix}: no finished {self.kind} dataset ({prefix}.manifest.json from {' or '.join(stages)})"
            )
        self.stage: str = manifest["stage"]
        paths = output_paths(prefix)
        self.input_ids = IndexedDataset(paths["input_ids"])
        self.labels = IndexedDataset(paths["labels"])
        if not np.array_equal(self.input_ids.sequence_lengths, self.labels.sequence_lengths) or not np.array_equal(
            self.input_ids.document_indices, self.labels.document_indices
        ):
            raise IndexedDatasetError(f"{prefix}: input_ids and labels datasets do not have the same layout")
        self.seq_length = int(manifest["seq_length"])
        self.pad_id = int(manifest["pad_id"])

    def __len__(self) -> int:
        return self.input_ids.num_documents

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        n = self.seq_length
        input_ids = np.full(n, self.pad_id, dtype=np.int64)
        labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
        document_ids = np.zeros(n, dtype=np.int64)
        pos = 0
        sequences = self.input_ids.document_sequences(i)
        for k, s in enumerate(sequences):
            length = int(self.input_ids.sequence_lengths[s])
            input_ids[pos : pos + length] = self.input_ids[s]
            labels[pos : pos + length] = self.labels[s]
            document_ids[pos : pos + length] = k
            pos += length
        document_ids[pos:] = len(sequences)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "document_ids": document_ids,
            "targets": next_token_targets(labels, document_ids),
        }
