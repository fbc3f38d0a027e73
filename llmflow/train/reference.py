"""The reference model's log-probs of a DPO run's pairs: computed once, by the run's own
workers in its parallel layout (the initial weights are the reference; under LoRA the base
with adapters that start at zero), kept in ``preference.reference`` (default
``{out}/reference``) and read by every later launch, so a retried or resumed run never
computes them again.

The directory holds ``logps.npy`` ([rows, pairs, 4]: each dataset row's chosen and rejected
response log-probs per pair, then their response tokens; NaN past a row's pairs) and ``manifest.json``, written last,
with the fingerprint of the inputs they were computed from: the model's and the dataset's
files (paths, sizes, modification times) and the compute dtype. Other inputs make them
stale: they are computed again and replace the old ones.

``torchrun ... -m llmflow.train.reference_worker CONFIG.json`` runs this stage alone (the
flows' cached reference stage); ``llmflow train`` runs it first when the log-probs are missing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from llmflow.artifacts import atomic_directory, file_stats, read_manifest
from llmflow.train.config import TrainConfig

STAGE = "reference-logps"
LOGPS = "logps.npy"


def reference_dir(config: TrainConfig) -> Path:
    """Where ``config``'s reference log-probs are kept."""
    return Path(config.preference.reference or Path(config.out) / "reference")


def fingerprint(config: TrainConfig, dtype: torch.dtype) -> str:
    """What the reference log-probs depend on: the model's and the data's files, the dtype."""
    payload = {"model": file_stats(Path(config.model)), "data": file_stats(Path(config.data.paths[0])),
               "dtype": str(dtype)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_reference(config: TrainConfig, dtype: torch.dtype) -> np.ndarray | None:
    """The cached log-probs when they were computed from ``config``'s inputs, else None."""
    directory = reference_dir(config)
    manifest = read_manifest(directory)
    if manifest is None or manifest.get("stage") != STAGE or manifest.get("fingerprint") != fingerprint(config, dtype):
        return None
    return np.load(directory / LOGPS)


def save_reference(config: TrainConfig, dtype: torch.dtype, logps: np.ndarray) -> Path:
    """Write the log-probs and then their manifest, replacing stale ones atomically."""
    directory = reference_dir(config)
    with atomic_directory(directory) as tmp:
        np.save(tmp / LOGPS, logps)
        manifest = {"stage": STAGE, "fingerprint": fingerprint(config, dtype), "rows": int(logps.shape[0]),
                    "pairs": int(np.isfinite(logps[..., 0]).sum()), "model": str(config.model),
                    "data": str(config.data.paths[0]), "dtype": str(dtype)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return directory


def stack_rows(rows: dict[int, np.ndarray], count: int) -> np.ndarray:
    """Per-row [pairs, k] arrays -> [count, most pairs, k], NaN where a row has fewer pairs."""
    missing = sorted(set(range(count)) - set(rows))
    if missing:
        raise RuntimeError(f"reference log-probs: rows {missing[:5]} were not computed")
    width = max(len(r) for r in rows.values())
    out = np.full((count, width, next(iter(rows.values())).shape[1]), np.nan, dtype=np.float32)
    for i, pairs in rows.items():
        out[i, :len(pairs)] = pairs
    return out


def gather_rows(rows: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Every rank's computed rows, on every rank (ranks that hold the same rows agree)."""
    if not dist.is_initialized():
        return rows
    gathered: list[dict[int, np.ndarray]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, rows)
    merged: dict[int, np.ndarray] = {}
    for part in gathered:
        merged.update(part)
    return merged


def reward_accuracy(policy: np.ndarray, reference: np.ndarray | None, method: str, beta: float) -> dict[str, float]:
    """The implicit reward's accuracy and mean margin on pairs whose log-probs under the
    trained model are ``policy`` and under the reference model ``reference`` ([rows, pairs,
    4] as ``logps.npy``): dpo's reward is beta times the response's log-ratio to the
    reference, simpo's and orpo's beta times its mean log-prob per token (TRL's rewards).
    A pair counts as correct when the chosen response's reward is the higher."""
    real = np.isfinite(policy[..., 0])
    chosen, rejected = policy[..., 0][real].astype(np.float64), policy[..., 1][real].astype(np.float64)
    if method == "dpo":
        if reference is None:
            raise ValueError("dpo's implicit reward needs the reference model's log-probs")
        chosen, rejected = chosen - reference[..., 0][real], rejected - reference[..., 1][real]
    else:
        chosen, rejected = chosen / policy[..., 2][real], rejected / policy[..., 3][real]
    margins = beta * (chosen - rejected)
    return {"reward_accuracy": float((margins > 0).mean()), "reward_margin": float(margins.mean()),
            "pairs": int(real.sum())}
