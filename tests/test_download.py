"""The download stage against a loopback Hub server (the ``hub`` fixture in conftest), a local
directory and a stubbed ModelScope."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from llmflow.artifacts import MANIFEST, read_manifest, sha256_file
from llmflow.download import DownloadConfig, DownloadError, download, parse_source


def _check(out: Path, expected: dict[str, bytes]) -> dict:
    manifest = read_manifest(out)
    assert manifest is not None
    listed = {f["path"]: f for f in manifest["files"]}
    assert set(listed) == set(expected)
    for name, data in expected.items():
        assert (out / name).read_bytes() == data
        assert listed[name]["size"] == len(data)
        assert listed[name]["sha256"] == hashlib.sha256(data).hexdigest()
    return manifest


def test_hub_download_full_then_rerun_is_free(hub, tmp_path, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "out"
    config = DownloadConfig(source="hf://org/tiny", out=out)
    assert download(config) == out.resolve()
    manifest = _check(out, hub.repos[("model", "org/tiny")])
    assert manifest["commit"] == hub.commit and manifest["params"]["source"] == "hf://org/tiny"
    assert hub.auth == {f"Bearer {hub.token}"}  # the token travels to the hub...

    hub.requests.clear()
    download(config)
    assert hub.file_gets() == []  # intact output: nothing fetched
    # ...and nowhere else.
    captured = capfd.readouterr()
    assert hub.token not in (out / MANIFEST).read_text()
    assert hub.token not in captured.out + captured.err + caplog.text


def test_hub_include_and_dataset(hub, tmp_path):
    out = tmp_path / "out"
    download(DownloadConfig(source="hf://org/tiny", out=out, include=["*.json"]))
    files = hub.repos[("model", "org/tiny")]
    _check(out, {k: v for k, v in files.items() if k.endswith(".json")})
    assert not (out / "model.safetensors").exists()

    data_out = tmp_path / "data"
    download(DownloadConfig(source="hf://org/data", out=data_out, repo_type="dataset"))
    _check(data_out, hub.repos[("dataset", "org/data")])
    assert any(p.startswith("/datasets/org/data/resolve/") for p in hub.file_gets())


def test_corrupt_file_on_disk_is_refetched_alone(hub, tmp_path):
    out = tmp_path / "out"
    config = DownloadConfig(source="hf://org/tiny", out=out)
    download(config)
    target = out / "sub" / "extra.bin"
    data = bytearray(target.read_bytes())
    data[100] ^= 0xFF  # same size, different content
    target.write_bytes(bytes(data))

    hub.requests.clear()
    download(config)
    assert hub.file_gets() == [f"/org/tiny/resolve/{hub.commit}/sub/extra.bin"]
    _check(out, hub.repos[("model", "org/tiny")])


def test_dropped_connection_resumes(hub, tmp_path):
    hub.drop_once.add("model.safetensors")
    out = tmp_path / "out"
    download(DownloadConfig(source="hf://org/tiny", out=out))
    # Real behaviour: huggingface_hub retries the GET after the peer closes mid-body. Here the
    # cut comes before its first 10 MB chunk reaches the disk, so the retry starts at byte 0
    # (a Range request resumes only bytes already written); either way the file ends correct.
    gets = [p for p in hub.file_gets() if p.endswith("model.safetensors")]
    assert len(gets) == 2
    _check(out, hub.repos[("model", "org/tiny")])


def test_wrong_bytes_from_server_are_caught(hub, tmp_path):
    files = hub.repos[("model", "org/tiny")]
    bad = bytearray(files["model.safetensors"])
    bad[5] ^= 0xFF
    hub.wrong["model.safetensors"] = bytes(bad)
    out = tmp_path / "out"
    config = DownloadConfig(source="hf://org/tiny", out=out)
    with pytest.raises(DownloadError, match=r"model\.safetensors"):
        download(config)
    assert read_manifest(out) is None
    assert not (out / "model.safetensors").exists()  # removed so a rerun fetches it again

    hub.wrong.clear()
    hub.requests.clear()
    download(config)
    assert hub.file_gets() == [f"/org/tiny/resolve/{hub.commit}/model.safetensors"]
    _check(out, files)


def test_missing_repo_names_it_and_hides_token(hub, tmp_path, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "out"
    with pytest.raises(DownloadError, match=r"org/missing.*HTTP 404") as info:
        download(DownloadConfig(source="hf://org/missing", out=out))
    assert read_manifest(out) is None
    captured = capfd.readouterr()
    assert hub.token not in str(info.value) + captured.out + captured.err + caplog.text


def test_offline_without_complete_output_fails_clearly(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE"):
        download(DownloadConfig(source="hf://org/tiny", out=tmp_path / "out"))
    assert hub.requests == []


def test_local_directory_copy_and_rerun(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(os.urandom(1000))
    (src / "notes.txt").write_text("skip me")
    out = tmp_path / "out"
    config = DownloadConfig(source=str(src), out=out, include=["*.json", "sub/"])
    download(config)
    _check(out, {"a.json": b"{}", "sub/w.bin": (src / "sub" / "w.bin").read_bytes()})
    assert not (out / "notes.txt").exists()

    (out / "a.json").unlink()
    download(config)
    manifest = _check(out, {"a.json": b"{}", "sub/w.bin": (src / "sub" / "w.bin").read_bytes()})
    assert all(sha256_file(out / f["path"]) == f["sha256"] for f in manifest["files"])


@pytest.mark.parametrize(
    "source, message",
    [("s3://bucket/x", "unknown scheme"), ("hf://", "empty repository id"), ("/no/such/dir", "does not exist")],
)
def test_bad_source_raises_before_work(tmp_path, source, message):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message) as info:
        download(DownloadConfig(source=source, out=out))
    assert "source" in str(info.value)
    assert not out.exists()


def test_modelscope_routing(tmp_path, monkeypatch):
    import modelscope

    calls = []

    def fake_snapshot_download(model_id, **kwargs):
        calls.append((model_id, kwargs))
        Path(kwargs["local_dir"], "config.json").write_text("{}")
        return kwargs["local_dir"]

    monkeypatch.setattr(modelscope, "snapshot_download", fake_snapshot_download)
    assert parse_source("ms://qwen/Qwen2-0.5B") == ("ms", "qwen/Qwen2-0.5B")
    out = tmp_path / "out"
    download(DownloadConfig(source="ms://qwen/Qwen2-0.5B", out=out, revision="v1", include=["*.json"]))
    assert calls == [
        ("qwen/Qwen2-0.5B", {"revision": "v1", "allow_patterns": ["*.json"], "local_dir": str(out.resolve())})
    ]
    _check(out, {"config.json": b"{}"})

    download(DownloadConfig(source="ms://org/ds", out=tmp_path / "ds", repo_type="dataset"))
    assert calls[-1][1]["repo_type"] == "dataset"


def test_cli_help():
    from llmflow.cli import main

    with pytest.raises(SystemExit) as info:
        main(["download", "--help"])
    assert info.value.code == 0
