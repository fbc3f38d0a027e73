"""User errors through the real ``llmflow`` command line: a non-zero exit and exactly one line
on stderr naming the file, source or parameter (the traceback only with LLMFLOW_DEBUG=1);
nothing half-written left behind; outputs created with the user's umask; Ctrl-C in chat."""

from __future__ import annotations

import os
import pty
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmflow.cli import main
from llmflow.weights.convert import ConvertConfig, convert

pytestmark = pytest.mark.slow  # every test but the umask one starts the CLI (torch, transformers) at least once


@pytest.fixture(scope="module")
def sample(sample_assets) -> Path:
    return sample_assets()


@pytest.fixture(scope="module")
def checkpoint(sample, tmp_path_factory) -> Path:
    return convert(ConvertConfig(hf=sample / "model", out=tmp_path_factory.mktemp("user_errors") / "ckpt"))


def llmflow(*args: object, env: dict[str, str] | None = None, wrap: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m llmflow.cli ARGS`` (inside ``wrap`` when given) and capture its output."""
    command = [*(wrap or []), sys.executable, "-m", "llmflow.cli", *map(str, args)]
    environment = {k: v for k, v in os.environ.items() if k != "LLMFLOW_DEBUG"} | {"OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, check=False, capture_output=True, text=True, env=environment, timeout=600)


def one_line_error(result: subprocess.CompletedProcess, *named: object) -> str:
    """The single stderr line of a failed command, which names each of ``named``."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for thing in named:
        assert str(thing) in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- file system


def test_output_below_a_file_is_one_line_and_debug_shows_the_traceback(sample, tmp_path):
    # A path whose parent is a regular file: mkdir fails as on any unwritable place (root, which
    # runs the tests, ignores permission bits, so a chmod 0o555 directory would not fail).
    blocker = tmp_path / "afile"
    blocker.write_text("")
    out = blocker / "ckpt"
    line = one_line_error(llmflow("convert", "--hf", sample / "model", "--out", out), blocker)
    assert line.startswith("llmflow convert: ")
    debug = llmflow("convert", "--hf", sample / "model", "--out", out, env={"LLMFLOW_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "FileExistsError" in debug.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.fixture(scope="module")
def mount_namespace(tmp_path_factory) -> None:
    """Skip unless this machine lets the tests mount a tmpfs in a private mount namespace."""
    target = tmp_path_factory.mktemp("mount_probe")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {target}"],
                           check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")


@pytest.mark.parametrize(
    ("options", "stage", "expected"),
    [
        ("ro", "convert", "Read-only file system"),  # a read-only file system (root cannot write it either)
        ("size=200k", "convert", "No space left on device"),  # a full disk, DCP files
        ("size=200k", "sample", "No space left on device"),  # a full disk, safetensors files
    ],
)
def test_read_only_or_full_disk_is_one_line_and_leaves_nothing(mount_namespace, sample, tmp_path, options, stage,
                                                              expected):
    mount = tmp_path / "mnt"
    mount.mkdir()
    # A tmpfs mounted for this command only; after it the script lists what stayed on it.
    wrap = ["unshare", "-m", "sh", "-c",
            f'mount -t tmpfs -o {options} tmpfs "$0" && "$@"; status=$?; ls -A "$0"; exit $status', str(mount)]
    out = mount / "runs" / "out"
    args = ["convert", "--hf", sample / "model", "--out", out] if stage == "convert" else ["sample", "--out", out]
    result = llmflow(*args, wrap=wrap)
    line = one_line_error(result, mount, expected)
    assert line.startswith(f"llmflow {stage}: cannot write ")
    assert result.stdout == ""  # nothing left on the mount: no runs/, no temporary directory


# --------------------------------------------------------------------------- downloads


def test_offline_hub_data_leaves_no_out_or_cache_directory(sample, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    area = tmp_path / "area"
    area.mkdir()
    result = llmflow("download", "hf://org/tiny", "--out", area / "new" / "tiny", env=offline)
    one_line_error(result, "hf://org/tiny", "HF_HUB_OFFLINE")
    result = llmflow("eval", "mmlu", "--model", sample / "model", "--data", "hf://cais/mmlu",
                     "--out", area / "eval", "--cache-dir", area / "cache", env=offline)
    assert one_line_error(result, "hf://cais/mmlu", "HF_HUB_OFFLINE").startswith("llmflow eval mmlu: ")
    assert list(area.iterdir()) == []


def test_hub_errors_leave_no_out_or_cache_directory(hub, sample, tmp_path):
    home = {"HF_HOME": str(tmp_path / "hf_home")}
    area = tmp_path / "area"
    area.mkdir()
    result = llmflow("download", "hf://org/missing", "--out", area / "new" / "missing", env=home)
    one_line_error(result, "hf://org/missing", "404")
    result = llmflow("eval", "mmlu", "--model", sample / "model", "--data", "hf://org/missing",
                     "--out", area / "eval", "--cache-dir", area / "cache", env=home)
    one_line_error(result, "hf://org/missing", "404")
    assert list(area.iterdir()) == []


# --------------------------------------------------------------------------- checkpoints


def test_truncated_safetensors_is_one_line_naming_the_file(sample, tmp_path):
    model = Path(shutil.copytree(sample / "model", tmp_path / "model"))
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    one_line_error(llmflow("convert", "--hf", model, "--out", tmp_path / "ckpt"), weights, "truncated")
    assert not (tmp_path / "ckpt").exists()
    one_line_error(llmflow("generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "2"), weights)


@pytest.mark.parametrize("damaged", ["data", "metadata"])
def test_truncated_dcp_checkpoint_is_one_line_naming_the_file(checkpoint, tmp_path, damaged):
    copy = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
    step = copy / "step_00000000"
    victim = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size) if damaged == "data" else step / ".metadata"
    os.truncate(victim, victim.stat().st_size // 3)
    result = llmflow("generate", "--model", copy, "--prompt", "hi", "--max-new-tokens", "2")
    one_line_error(result, victim, "truncated" if damaged == "data" else "metadata")


# --------------------------------------------------------------------------- devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["generate", "eval mmlu"])
def test_cuda_on_a_machine_without_it_is_one_line(sample, tmp_path, command):
    args = ["--prompt", "hi"] if command == "generate" else ["--data", sample / "mmlu" / "hf", "--out", tmp_path / "e"]
    result = llmflow(*command.split(), "--model", sample / "model", "--device", "cuda", *args)
    one_line_error(result, "'cuda'", "no cuda device")
    assert not (tmp_path / "e").exists()


# --------------------------------------------------------------------------- umask


def test_outputs_follow_the_umask(sample, tmp_path):
    """The commands run by the command line's ``main`` in this process, under umask 022."""
    runs = [
        ("sample", "--out", tmp_path / "sample"),
        ("convert", "--hf", sample / "model", "--out", tmp_path / "ckpt"),
        ("tokenize", "pretrain", "--input", sample / "pretrain" / "corpus.parquet",
         "--tokenizer", sample / "tokenizer", "--out", tmp_path / "data" / "corpus"),
    ]
    previous = os.umask(0o022)
    try:
        for args in runs:
            main([str(arg) for arg in args])
    finally:
        os.umask(previous)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert {"sample/manifest.json", "sample/model/model.safetensors", "ckpt/manifest.json",
            "ckpt/step_00000000/.metadata", "data/corpus_text_document.idx", "data/corpus.manifest.json"} <= set(modes)
    wrong = {path: oct(mode) for path, mode in modes.items()
             if mode != (0o755 if (tmp_path / path).is_dir() else 0o644)}
    assert wrong == {}


# --------------------------------------------------------------------------- chat


def _chat(model: Path, finish) -> tuple[int, str]:
    """``llmflow chat`` on a pseudo-terminal: wait for its first prompt, ``finish(pid, fd)``,
    then return its exit status and everything it printed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI, with the terminal as stdin, stdout and stderr
        # As started from a shell on a terminal: a runner that started the tests in the
        # background may have left SIGINT ignored, and exec keeps that.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ.pop("LLMFLOW_DEBUG", None)
        os.execv(sys.executable, [sys.executable, "-m", "llmflow.cli", "chat", "--model", str(model)])
    output = b""

    def read_until(done, seconds: float = 300) -> None:
        nonlocal output
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            if select.select([fd], [], [], 1)[0]:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # the child closed the terminal
                    return
                if not chunk:
                    return
                output += chunk

    read_until(lambda: b"> " in output)
    assert b"> " in output, output.decode(errors="replace")
    finish(pid, fd)
    read_until(lambda: False, 120)
    reaped, status = os.waitpid(pid, os.WNOHANG)
    if reaped == 0:  # still running: it ignored what it was sent
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}
"""read(2)'s number in /proc/PID/syscall, by machine."""


def _interrupt_once_reading(pid: int, fd: int) -> None:
    """Ctrl-C as a person gives it, at a chat waiting on the terminal: a signal that lands
    between the prompt's write and the read(2) after it interrupts no system call, and Python
    raises KeyboardInterrupt only once the blocked read returns."""
    machine = os.uname().machine
    assert machine in READ_SYSCALL, f"read(2)'s system call number on {machine} is not listed"
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}/syscall").read_text().split()[:2] != [READ_SYSCALL[machine], "0x0"]:
        assert time.monotonic() < deadline, "the chat never waited on its terminal"
        time.sleep(0.05)
    os.kill(pid, signal.SIGINT)


def test_chat_ctrl_c_at_the_prompt_ends_quietly_and_ctrl_d_too(sample):
    code, output = _chat(sample / "model", _interrupt_once_reading)
    assert (code, "Traceback" in output, "KeyboardInterrupt" in output) == (130, False, False), output
    code, output = _chat(sample / "model", lambda pid, fd: os.write(fd, b"\x04"))  # Ctrl-D: end of input
    assert (code, "Traceback" in output) == (0, False), output


def test_chat_ctrl_c_during_a_reply_returns_to_the_prompt(sample):
    import io

    from llmflow.data.templates import load_template
    from llmflow.infer import GenerateConfig
    from llmflow.infer.command import chat_loop
    from llmflow.infer.generator import load_generator

    gen = load_generator(sample / "model")
    template = load_template(sample / "model", None)
    config = GenerateConfig(max_new_tokens=8)

    class Terminal(io.StringIO):
        """Output on which the user presses Ctrl-C (a real SIGINT) as the first reply arrives."""

        interrupted = False

        def write(self, text: str) -> int:
            written = super().write(text)
            if not self.interrupted and self.getvalue().startswith("> ") and text != "> ":
                self.interrupted = True
                signal.raise_signal(signal.SIGINT)
            return written

    out = Terminal()
    # Ctrl-C raises KeyboardInterrupt, as in any Python started from a terminal (a runner that
    # started the tests in the background may have left SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        history = chat_loop(gen, template, config, io.StringIO("first question\nsecond question\n/exit\n"), out)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C during a reply ended the chat loop")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert out.interrupted
    # The interrupted turn is forgotten: the next one is answered as if it were the first.
    expected = chat_loop(gen, template, config, io.StringIO("second question\n"), io.StringIO())
    assert [m["role"] for m in expected] == ["user", "assistant"]
    assert history == expected
    assert out.getvalue().endswith(f"\n> {expected[1]['content']}\n> ")
