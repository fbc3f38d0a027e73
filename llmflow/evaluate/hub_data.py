"""Benchmark data named by a hub source (``hf://cais/mmlu``, ``ms://org/name``): fetched by the
download stage into a cache directory, only the files the evaluation reads, then read from
disk like any local copy. A rerun checks the cached files against the download's manifest
and fetches nothing when they are intact."""

from __future__ import annotations

from pathlib import Path

from llmflow.download import DownloadConfig, download, parse_source


def is_hub_source(data: str | Path) -> bool:
    """Whether ``data`` names a hub repository rather than a local directory."""
    return "://" in str(data)


def local_data(data: str | Path, cache_dir: Path, include: list[str]) -> Path:
    """The local directory of ``data``: itself, or for a hub source its download (the files
    matching ``include``) under ``cache_dir/{hf,ms}/org/name``."""
    if not is_hub_source(data):
        return Path(data).expanduser()
    scheme, repo = parse_source(str(data))
    out = Path(cache_dir).expanduser() / scheme / repo
    return download(DownloadConfig(source=str(data), out=out, include=include, repo_type="dataset"))
