"""The download stage: a model or data set from the Hugging Face Hub, ModelScope or a local
directory into one output directory with a ``manifest.json`` written last.

The output directory is complete when its manifest exists. A rerun verifies the manifest
(sizes and sha256): when everything matches nothing is fetched; otherwise only the missing
or corrupt files are fetched again. Hub downloads go straight into the output directory
(huggingface_hub's ``local_dir`` mode keeps per-file metadata and partial ``.incomplete``
files under ``out/.cache``, so an interrupted download resumes); the manifest is removed
before any file changes and written again only once every file has been verified.

Credentials come from the environment only (``HF_TOKEN``, ``MODELSCOPE_API_TOKEN``): they are
never parameters, never logged and never written to the manifest. ``HF_ENDPOINT`` (a mirror)
and ``HF_HUB_OFFLINE`` are read by huggingface_hub itself.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils.sha import git_hash
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import CliPositionalArg

from llmflow.artifacts import (
    MANIFEST,
    atomic_file,
    file_record,
    manifest_payload,
    read_manifest,
    remove_empty,
    sha256_file,
    write_json_atomic,
)

STAGE = "download"
T = TypeVar("T")
SCHEMES = ("hf", "ms")
# Bookkeeping that lives inside the output directory but is not part of it.
_SKIP_DIRS = (".cache", ".git")


class DownloadError(RuntimeError):
    """A download that could not finish: names the repository and, for hub errors, the HTTP status."""


class DownloadConfig(BaseModel):
    """Download a model or data set into a directory with a manifest of every file."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    source: str
    """Where from: ``hf://org/name`` (Hugging Face Hub, or the mirror in HF_ENDPOINT),
    ``ms://org/name`` (ModelScope) or a local directory path."""
    out: Path
    """Output directory: the files plus manifest.json (written last)."""
    revision: str | None = None
    """Branch, tag or commit to download (hub default: main / master)."""
    include: list[str] = Field(default_factory=list)
    """Glob patterns of the files to download (e.g. '*.json' '*.safetensors'); empty: all files."""
    repo_type: Literal["model", "dataset"] = "model"
    """Kind of hub repository: model or dataset."""

    def params(self) -> dict[str, Any]:
        """The parameters recorded in the manifest and in MLflow (no credentials)."""
        return {
            "source": self.source,
            "revision": self.revision,
            "include": list(self.include),
            "repo_type": self.repo_type,
        }


def parse_source(source: str) -> tuple[str, str]:
    """``(scheme, repo_id or path)``: ``("hf", "org/name")``, ``("ms", "org/name")`` or
    ``("local", "/abs/dir")``; ValueError for anything else, before any work is done."""
    if "://" in source:
        scheme, _, rest = source.partition("://")
        if scheme not in SCHEMES:
            raise ValueError(
                f"source {source!r}: unknown scheme {scheme + '://'!r}; expected hf://org/name, "
                "ms://org/name or a local directory path"
            )
        repo_id = rest.strip().strip("/")
        if not repo_id:
            raise ValueError(f"source {source!r}: empty repository id; expected {scheme}://org/name")
        return scheme, repo_id
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"source {source!r}: local directory does not exist; expected hf://org/name, "
            "ms://org/name or an existing directory"
        )
    return "local", str(path.resolve())


def _included(paths: Iterable[T], include: list[str], key: Callable[[T], str] | None = None) -> list[T]:
    """The ``paths`` that ``include`` selects, matched as ``snapshot_download``'s
    ``allow_patterns`` are (a pattern ending in "/" means everything under that folder)."""
    return list(filter_repo_objects(paths, allow_patterns=include or None, key=key))


def _output_files(out: Path) -> list[Path]:
    """Every file of the output directory, without the manifest and hub bookkeeping."""
    files = []
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        if rel.parts[0] in _SKIP_DIRS or rel.as_posix() == MANIFEST or not path.is_file():
            continue
        files.append(path)
    return files


def bad_files(out: Path, manifest: dict[str, Any]) -> list[str]:
    """Paths listed in ``manifest`` that are missing, or differ in size or sha256."""
    bad = []
    for record in manifest.get("files", []):
        path = out / record["path"]
        if not path.is_file() or path.stat().st_size != record["size"] or sha256_file(path) != record["sha256"]:
            bad.append(record["path"])
    return bad


def _holds_data(out: Path) -> bool:
    """Whether ``out`` holds any downloaded bytes (a partial file an interrupted download
    resumes from counts), beyond the hub client's empty bookkeeping and lock files."""
    return any(
        p.is_file() and p.stat().st_size > 0 and p.suffix != ".lock" and p.name != ".gitignore" for p in out.rglob("*")
    )


def _unlink(out: Path, rel: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (out / rel).unlink()


# --------------------------------------------------------------------------- hub


def _hub_error(repo: str, error: BaseException) -> DownloadError:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    what = f"HTTP {status}, {type(error).__name__}" if status is not None else type(error).__name__
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return DownloadError(f"download of {repo} failed ({what}): {first_line}")


def _download_hf(config: DownloadConfig, repo_id: str, out: Path) -> dict[str, Any]:
    """Fetch what is missing into ``out`` and verify every file against the hub's listing."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    label = f"hf://{repo_id}" + (f"@{config.revision}" if config.revision else "")
    if constants.is_offline_mode():
        raise DownloadError(
            f"download of {label}: HF_HUB_OFFLINE is set and {out} is not complete "
            "(no valid manifest); unset HF_HUB_OFFLINE or provide the files"
        )
    include = list(config.include)
    try:
        # The token (HF_TOKEN or the saved login) is picked up by huggingface_hub itself.
        api = HfApi()
        info = api.repo_info(repo_id, repo_type=config.repo_type, revision=config.revision)
        commit = info.sha
        tree = api.list_repo_tree(repo_id, recursive=True, revision=commit, repo_type=config.repo_type)
        expected = {entry.path: entry for entry in _included(tree, include, key=lambda entry: entry.path)
                    if isinstance(entry, RepoFile)}
        if include and not expected:
            raise DownloadError(f"download of {label}: no file matches include={include}")
        snapshot_download(
            repo_id,
            repo_type=config.repo_type,
            revision=commit,
            allow_patterns=include or None,
            local_dir=str(out),
        )
    except DownloadError:
        raise
    except Exception as error:  # hub errors, connection errors, size consistency errors
        raise _hub_error(label, error) from error

    # The hub advertises each file's size and hash: sha256 for LFS files, the git blob id otherwise.
    corrupt = []
    for rel, entry in sorted(expected.items()):
        path = out / rel
        size = entry.lfs.size if entry.lfs is not None else entry.size
        if not path.is_file() or path.stat().st_size != size:
            corrupt.append(rel)
        elif entry.lfs is not None:
            if sha256_file(path) != entry.lfs.sha256:
                corrupt.append(rel)
        elif entry.blob_id and git_hash(path.read_bytes()) != entry.blob_id:  # files outside LFS are small
            corrupt.append(rel)
    if corrupt:
        for rel in corrupt:  # so that a rerun fetches them again
            _unlink(out, rel)
        raise DownloadError(
            f"download of {label}: {len(corrupt)} file(s) do not match the hub's size/sha256 and were removed: "
            + ", ".join(corrupt)
        )
    return {"files": sorted(expected), "commit": commit}


def _download_ms(config: DownloadConfig, repo_id: str, out: Path) -> dict[str, Any]:
    """Fetch from ModelScope into ``out`` (its own resume and integrity checks apply)."""
    try:
        from modelscope import snapshot_download
    except ImportError as error:
        raise DownloadError("ms:// sources need the modelscope package (pip install modelscope)") from error

    label = f"ms://{repo_id}" + (f"@{config.revision}" if config.revision else "")
    kwargs: dict[str, Any] = {
        "revision": config.revision,
        "allow_patterns": list(config.include) or None,
        "local_dir": str(out),
    }
    if config.repo_type == "dataset":
        kwargs["repo_type"] = "dataset"
    try:
        snapshot_download(repo_id, **kwargs)
    except Exception as error:
        raise _hub_error(label, error) from error
    files = [p.relative_to(out).as_posix() for p in _output_files(out)]
    return {"files": _included([f for f in files if not f.startswith(".")], config.include), "commit": None}


def _download_local(config: DownloadConfig, source: Path, out: Path) -> dict[str, Any]:
    """Link (same filesystem) or copy the matching files that are missing or differ."""
    files = (path.relative_to(source).as_posix() for path in sorted(source.rglob("*")) if path.is_file())
    wanted = _included([rel for rel in files if not rel.startswith(".") and rel != MANIFEST], config.include)
    if config.include and not wanted:
        raise DownloadError(f"download of {source}: no file matches include={config.include}")
    for rel in wanted:
        src, dst = source / rel, out / rel
        if dst.is_file() and dst.stat().st_size == src.stat().st_size and sha256_file(dst) == sha256_file(src):
            continue
        # A copy, not a hard link: editing the output must never change the source.
        with open(src, "rb") as reader, atomic_file(dst) as writer:
            shutil.copyfileobj(reader, writer, 1 << 20)
    return {"files": wanted, "commit": None}


# --------------------------------------------------------------------------- stage


def download(config: DownloadConfig) -> Path:
    """Run the download stage; returns the output directory (complete, with its manifest)."""
    scheme, ref = parse_source(config.source)
    out = Path(config.out).expanduser().resolve()
    if scheme == "local" and (out == Path(ref) or Path(ref) in out.parents):
        raise ValueError(f"out {out}: must not be inside the local source directory {ref}")

    manifest = read_manifest(out) if out.is_dir() else None
    if manifest is not None and manifest.get("params") == config.params():
        bad = bad_files(out, manifest)
        if not bad and scheme != "local":  # a local source may have changed in place: compare it
            return out
        for rel in bad:  # huggingface_hub's local_dir mode re-fetches only what is missing
            _unlink(out, rel)

    # From here on files change: the output must not look complete until the new manifest.
    created = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    _unlink(out, MANIFEST)

    try:
        if scheme == "hf":
            result = _download_hf(config, ref, out)
        elif scheme == "ms":
            result = _download_ms(config, ref, out)
        else:
            result = _download_local(config, Path(ref), out)
    except BaseException:
        if created and not _holds_data(out):  # a failure before any byte arrived leaves nothing behind
            shutil.rmtree(out, ignore_errors=True)
            remove_empty(created[1:])
        raise

    files = [file_record(out / rel, out) for rel in result["files"]]
    write_json_atomic(
        out / MANIFEST,
        manifest_payload(STAGE, config.params(), files, commit=result["commit"]),
    )
    return out


def summary(out: Path) -> dict[str, float]:
    """Files and bytes listed in a finished download's manifest."""
    manifest = read_manifest(out) or {}
    files = manifest.get("files", [])
    return {"files": len(files), "bytes": sum(f["size"] for f in files)}


class DownloadCommand(DownloadConfig):
    """Download a model or data set (hf://org/name, ms://org/name or a local directory) into
    a directory with a manifest of every file; a rerun fetches only what is missing or corrupt."""

    source: CliPositionalArg[str]
    """Where from: ``hf://org/name`` (Hugging Face Hub, or the mirror in HF_ENDPOINT),
    ``ms://org/name`` (ModelScope) or a local directory path."""

    def cli_cmd(self) -> None:
        start = time.monotonic()
        config = DownloadConfig(**self.model_dump())
        out = download(config)
        stats = summary(out)
        print(f"{out}: {stats['files']} files, {stats['bytes']} bytes, {time.monotonic() - start:.1f} s")
