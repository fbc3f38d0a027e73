"""The download stage against a loopback Hub server, a local directory and a stubbed ModelScope.

The server speaks the endpoints huggingface_hub's ``snapshot_download`` uses:
``GET /api/{models,datasets}/{repo}/revision/{rev}`` (repo info with ``sha``),
``GET /api/{models,datasets}/{repo}/tree/{rev}?recursive=True`` (files with size, git oid and
LFS sha256), and ``HEAD``/``GET /[datasets/]{repo}/resolve/{rev}/{file}`` (``X-Repo-Commit``,
``ETag``, ``X-Linked-Etag``/``X-Linked-Size`` for LFS files, ``Range`` requests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from llmflow.artifacts import MANIFEST, read_manifest, sha256_file
from llmflow.download import DownloadConfig, DownloadError, download, parse_source

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_SENTINELtokenNEVERprinted123"


def _repo_files() -> dict[str, bytes]:
    rng = random.Random(0)
    return {
        "config.json": json.dumps({"hidden_size": 64, "num_hidden_layers": 2}).encode(),
        "tokenizer.json": json.dumps({"vocab": {f"t{i}": i for i in range(500)}}).encode(),
        "model.safetensors": rng.randbytes(200_000),
        "sub/extra.bin": rng.randbytes(50_000),
    }


LFS = {"model.safetensors", "sub/extra.bin"}


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class FakeHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos = {("model", "org/tiny"): _repo_files(), ("dataset", "org/data"): {"train.jsonl": b'{"a": 1}\n' * 100}}
        self.requests: list[tuple[str, str]] = []
        self.auth: set[str | None] = set()
        self.drop_once: set[str] = set()  # file names whose next GET is cut off mid-body
        self.wrong: dict[str, bytes] = {}  # file names served with these bytes instead
        self.ranges: list[tuple[str, str | None]] = []  # (path, Range header) of every request
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def file_gets(self) -> list[str]:
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]


class HubHandler(BaseHTTPRequestHandler):
    server: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    def _json(self, payload, status=200, headers=None):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _not_found(self):
        self._json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})

    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    def _handle(self, head: bool):
        hub = self.server
        path = unquote(urlsplit(self.path).path)
        with hub.lock:
            hub.requests.append((self.command, path))
            hub.auth.add(self.headers.get("Authorization"))
            hub.ranges.append((path, self.headers.get("Range")))
        if path.startswith("/api/") and path.count("/") >= 3:
            kind, rest = path[len("/api/") :].split("/", 1)
            repo_type = kind.rstrip("s")
            for marker in ("/revision/", "/tree/", ""):
                if marker in rest:
                    repo_id = rest.split(marker, 1)[0] if marker else rest
                    files = hub.repos.get((repo_type, repo_id))
                    if files is None:
                        return self._not_found()
                    if marker != "/tree/":
                        return self._json(
                            {"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}
                        )
                    tree = []
                    for name, data in sorted(files.items()):
                        entry = {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                        if name in LFS:
                            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                        tree.append(entry)
                    return self._json(tree)
            return self._not_found()
        if "/resolve/" not in path:
            return self._not_found()
        left, name = path.split("/resolve/", 1)
        _, name = name.split("/", 1)
        repo_type, repo_id = ("dataset", left[len("/datasets/") :]) if left.startswith("/datasets/") else ("model", left[1:])
        files = hub.repos.get((repo_type, repo_id))
        if files is None or name not in files:
            return self._not_found()
        data = files[name]
        served = hub.wrong.get(name, data)
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_git_oid(data)}"', "Accept-Ranges": "bytes"}
        if name in LFS:
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(data))
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and not head:
            start = int(rng.split("=")[1].split("-")[0])
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(served) - 1}/{len(served)}"
        body = served[start:]
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        if name in hub.drop_once and start == 0:
            hub.drop_once.discard(name)
            self.wfile.write(body[: len(body) // 3])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A loopback Hub; huggingface_hub is pointed at it and put online for the test."""
    from huggingface_hub import constants

    server = FakeHub()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # huggingface_hub reads these at import time: set the environment and its constants.
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    yield server
    server.shutdown()
    server.server_close()


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
    assert manifest["commit"] == COMMIT and manifest["params"]["source"] == "hf://org/tiny"
    assert hub.auth == {f"Bearer {TOKEN}"}  # the token travels to the hub...

    hub.requests.clear()
    download(config)
    assert hub.file_gets() == []  # intact output: nothing fetched
    # ...and nowhere else.
    captured = capfd.readouterr()
    assert TOKEN not in (out / MANIFEST).read_text()
    assert TOKEN not in captured.out + captured.err + caplog.text


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
    assert hub.file_gets() == [f"/org/tiny/resolve/{COMMIT}/sub/extra.bin"]
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
    assert hub.file_gets() == [f"/org/tiny/resolve/{COMMIT}/model.safetensors"]
    _check(out, files)


def test_missing_repo_names_it_and_hides_token(hub, tmp_path, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "out"
    with pytest.raises(DownloadError, match=r"org/missing.*HTTP 404") as info:
        download(DownloadConfig(source="hf://org/missing", out=out))
    assert read_manifest(out) is None
    captured = capfd.readouterr()
    assert TOKEN not in str(info.value) + captured.out + captured.err + caplog.text


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
