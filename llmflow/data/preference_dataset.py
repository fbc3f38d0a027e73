"""Training rows of a tokenized preference set (``tokenize_preference``), padded to its
sequence length: ``InstructionDataset`` reading the preference stage's output.

A row holds one pair, or (packed) several, each as two consecutive sequences: in
``PreferenceDataset[i]``, pair j of the row is ``document_ids`` 2j (chosen) and 2j + 1
(rejected), and the padding after them one more id. Every chosen and rejected sequence has
at least one next-token target, padding none.
"""

from __future__ import annotations

from llmflow.data.instruction_dataset import InstructionDataset
from llmflow.data.tokenize_preference import STAGE


class PreferenceDataset(InstructionDataset):
    """Padded rows of the ``{prefix}_packed_{input_ids,labels}_document`` datasets that
    ``tokenize_preference`` wrote; ``dataset[i]`` as ``InstructionDataset``'s."""

    stages = (STAGE,)
    kind = "preference"

    def pairs(self, i: int) -> int:
        """How many pairs row ``i`` holds."""
        return len(self.input_ids.document_sequences(i)) // 2
