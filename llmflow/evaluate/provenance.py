"""What makes an evaluation's numbers comparable from one night to the next: a hash of the
exact prompts scored, the model's identity and llmflow's version, recorded in results.json."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import llmflow
from llmflow.artifacts import MANIFEST, sha256_file


def prompts_sha256(contexts: Sequence[str], continuations: Sequence[Sequence[str]]) -> str:
    """sha256 of every (context, continuations) pair in order: equal hashes, equal prompts."""
    pairs = [[context, list(conts)] for context, conts in zip(contexts, continuations, strict=True)]
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


def model_identity(path: Path) -> dict[str, str]:
    """The model's path and a sha256 naming its weights: of its manifest when it has one (the
    manifest lists every file's own sha256), else of every file's relative path and sha256."""
    path = Path(path).expanduser().resolve()
    manifest = path / MANIFEST
    if manifest.is_file():
        return {"path": str(path), "manifest_sha256": sha256_file(manifest)}
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path.parent).as_posix()}\0{sha256_file(file)}\n".encode())
    return {"path": str(path), "files_sha256": digest.hexdigest()}


def llmflow_version() -> str:
    """The installed llmflow's version."""
    return llmflow.__version__
