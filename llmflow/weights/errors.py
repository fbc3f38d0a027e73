"""What reading or writing weights refuses."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory that does not hold what the model needs."""


class NonFiniteError(RuntimeError):
    """Training produced NaN or ±Inf (a loss, a gradient norm, or a value about to be saved)."""
