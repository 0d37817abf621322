"""Stage commands forked from a process that has already imported their libraries.

A stage process spends about a second importing torch, transformers, h5py, sklearn and the rest
before its work starts: the world's 85 stages pay about 80 s of CPU for it (`python -c "import
stages.<name>"` of each). `halludetect repro --jobs N` (parallel_repro.py) therefore starts one
process that pins the stages' numerics (it imports the `stages` package), imports those libraries
and waits; a command of the form `python -m stages.<name> <args>` is then run by forking it (the
"zygote" of Android and of Chromium), in the command's own directory, environment, arguments and
output pipe. What the stage computes is what a fresh `python -m stages.<name>` computes: the same
interpreter, the same pinned kernels (chosen at torch's import, which both do under the same
environment), the stage's own module run as `__main__`.

A command is forked only when that holds by construction, and run as DVC runs it otherwise:

- it is exactly `python -m stages.<name>` and plain words (no shell syntax: no variables,
  redirections, pipes, globs, quotes around other meanings);
- `python` is, on the command's PATH, the interpreter the zygote runs;
- its environment is the zygote's, but for the variables read while it runs, never at import:
  DVC's own (`DVC_*`, e.g. DVC_STAGE) and `HALLUDETECT_CORES` / `HALLUDETECT_GPU_LOCK`
  (parallel_repro.command_env);
- torch is a CPU build (a CUDA context does not survive a fork: with CUDA, every command runs as
  DVC runs it).

Nothing is imported that starts a thread (polars starts three at import, so it is left to the
stage): a fork copies only the thread that forks. `HALLUDETECT_ZYGOTE=0` turns it off.

The protocol, over a Unix socket: the runner sends the argv, directory and environment as JSON
with the command's output pipe as a passed descriptor; the zygote forks, answers the child's pid,
and once the child exits its exit code (negative: the signal that ended it, as Popen reports it).
The zygote is single-threaded (a selector over its socket, its connections, its stdin and SIGCHLD);
it ignores Ctrl-C (the terminal's Ctrl-C reaches the stages, which restore Python's handler), kills
a child whose runner closed the connection, and kills every child and exits when its stdin closes:
the runner's end, or its death.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback

ENV = "HALLUDETECT_ZYGOTE"
PACKAGE = "stages"  # the repository's entry points: importing it pins the numerics (stages/__init__.py)
# Read by a stage while it runs, never at import: a command may differ from the zygote in these.
RUNTIME_ENV = ("HALLUDETECT_CORES", "HALLUDETECT_GPU_LOCK")
RUNTIME_PREFIXES = ("DVC_",)
# Imported once, before any fork. None of them starts a thread at import (polars does: left out).
PRELOAD = (
    "torch",
    "numpy",
    "h5py",
    "safetensors.torch",
    "sklearn.metrics",
    "scipy.stats",
    "matplotlib",
    "transformers",
    "transformers.models.llama.modeling_llama",
)
SHELL_SYNTAX = set("$`*?[]{}~!#;&|<>()\\\"'\n")
_HEADER = struct.Struct("!I")


# ---------------------------------------------------------------------------- the runner's side
class Zygote:
    """The runner's handle: `start` it, `spawn` eligible commands, `close` it at the end."""

    def __init__(self, python: str, env: dict, cwd: str):
        self.python, self.env, self.cwd = python, dict(env), cwd
        self.path = os.path.join(tempfile.mkdtemp(prefix="halludetect-zygote-"), "socket")
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.failed = False

    @classmethod
    def for_run(cls, env: dict, cwd: str) -> Zygote | None:
        """A zygote for a run in `cwd` with environment `env`, or None where it would not apply
        (turned off, not Linux: fork with torch loaded is tested there only, no `python` on PATH, no
        stages package). A zygote that finds a GPU build of torch answers so, and every command then
        runs as DVC runs it."""
        if env.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
            return None
        python = shutil.which("python", path=env.get("PATH"))
        if python is None or not os.path.isfile(os.path.join(cwd, PACKAGE, "__init__.py")):
            return None
        return cls(os.path.abspath(python), env, cwd)

    def start(self) -> None:
        """Start the zygote; `ready` is set once it has imported everything (in the background)."""
        self.proc = subprocess.Popen(  # noqa: S603
            [self.python, "-m", "halludetect.runner.zygote", self.path, PACKAGE],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=False,  # the terminal's Ctrl-C reaches its children, the stages
        )
        threading.Thread(target=self._await_ready, daemon=True).start()

    def _await_ready(self) -> None:
        line = self.proc.stdout.readline()
        self.failed = line.strip() != b"ready"
        self.ready.set()

    def accepts(self, cmd: str, env: dict, cwd: str) -> list[str] | None:
        """The argv to fork for `cmd`, or None when it must run as DVC runs it (module docstring)."""
        if SHELL_SYNTAX & set(cmd):
            return None
        argv = cmd.split()
        if len(argv) < 3 or argv[:2] != ["python", "-m"] or not argv[2].startswith(PACKAGE + "."):
            return None
        if os.path.abspath(cwd) != os.path.abspath(self.cwd):
            return None
        python = shutil.which("python", path=env.get("PATH"))
        if python is None or os.path.abspath(python) != self.python:
            return None
        keys = set(env) | set(self.env)
        if any(env.get(k) != self.env.get(k) for k in keys if not _runtime(k)):
            return None
        self.ready.wait()
        return None if self.failed else argv

    def spawn(self, argv: list[str], env: dict, cwd: str, out_fd: int) -> Forked:
        """Fork `argv` with its output on `out_fd` (the zygote takes a copy of it)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        body = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        socket.send_fds(conn, [_HEADER.pack(len(body)) + body], [out_fd])
        reply = conn.makefile("rb")
        first = json.loads(reply.readline() or b"{}")
        if "pid" not in first:
            conn.close()
            raise OSError(f"the stage zygote could not start {' '.join(argv)}: {first.get('error', 'no reply')}")
        return Forked(first["pid"], conn, reply)

    def close(self) -> None:
        """End the zygote (it kills any child still running) and remove its socket."""
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))


def _runtime(key: str) -> bool:
    return key in RUNTIME_ENV or key.startswith(RUNTIME_PREFIXES)


class Forked:
    """A forked command, as much of subprocess.Popen as the runner uses: wait, poll, kill."""

    def __init__(self, pid: int, conn: socket.socket, reply):
        self.pid, self._conn, self._reply = pid, conn, reply
        self.returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            line = self._reply.readline()
            self.returncode = json.loads(line)["code"] if line else -signal.SIGKILL  # the zygote went away
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


# ---------------------------------------------------------------------------- the zygote
def serve(path: str, package: str) -> None:
    """Import `package` (the repository's stages, found in the working directory as `python -m`
    finds them; it pins the numerics before torch loads, as every stage process does) and the
    libraries, then fork a child per request until stdin closes (module docstring)."""
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    before = dict(os.environ)
    importlib.import_module(package)

    # what importing the stages set (numerics.pin: the kernels, MKL's branch, the threads): a stage process
    # sets it in its own environment, which its child processes inherit; a forked child gets it too
    pinned = {k: v for k, v in os.environ.items() if before.get(k) != v}
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    torch = sys.modules.get("torch")
    if torch is not None and (torch.version.cuda or getattr(torch.version, "hip", None)):
        sys.stdout.write("unavailable: a GPU build of torch (a CUDA context does not survive a fork)\n")
        sys.stdout.flush()
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                pid = _fork(conn, pinned, [listener.fileno(), wake_r, wake_w, sys.stdin.fileno(), *children.values()])
                if pid is None:
                    conn.close()
                    continue
                children[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(children, sel)
            elif key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):  # the runner ended, or died
                    for pid in children:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    return
            else:  # a runner thread's connection: readable only when it closed it
                pid = key.data
                if not key.fileobj.recv(1):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    sel.unregister(key.fileobj)


def _reap(children: dict, sel) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        conn.close()


def _fork(conn: socket.socket, pinned: dict, close: list) -> int | None:
    """Read one request from `conn`, fork its child, answer its pid; None if the request was bad."""
    try:
        head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 1)
        (size,) = _HEADER.unpack(head)
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise OSError("cut request")
            body += chunk
        request = json.loads(body)
        (out_fd,) = fds
    except (OSError, ValueError, struct.error) as e:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd if isinstance(fd, int) else fd.fileno())
        _child(request["argv"], {**request["env"], **pinned}, request["cwd"], out_fd)  # never returns
    os.close(out_fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _child(argv: list[str], env: dict, cwd: str, out_fd: int) -> None:
    """Become `python -m <module> <args>`: its streams, directory, environment and arguments, then
    the module run as __main__, exiting as the interpreter would."""
    import runpy

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(devnull)
        os.close(out_fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[0] = os.getcwd()
        sys.argv = [argv[0], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # ended by SIGINT, as Python ends on it
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it, exit 1
        traceback.print_exc()
    _finish()
    os._exit(code)


def _finish() -> None:
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
