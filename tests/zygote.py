"""`python -m flaxlm.main` for the tests, forked from a Python that has imported its libraries.

Each start of `flaxlm.main` spends ~4-5 s of CPU importing TensorFlow, tensorflow_text,
seqio, JAX, Flax, optax and orbax, and the suite starts it about a hundred times. A zygote
(Android's name for the same trick) imports those libraries once per test process and forks
a child per run: the child takes its arguments, environment, working directory and standard
streams (passed over a Unix socket), then runs `flaxlm.main` as `python -m` would, and exits
as the interpreter would (threads joined, atexit handlers run). flaxlm itself is never
imported in the zygote, so each run imports, registers and parses as a fresh process does.

Only the libraries are shared, and only where that cannot change what a run sees: a start
whose environment differs from the zygote's in anything read at import time (JAX_*, TF_*,
a PYTHONPATH that could shadow a module, ...) is a real `subprocess.Popen`, as are the
tests that check what a user's terminal shows or what a process imports. Nothing is
initialised before the fork (no JAX backend, no TensorFlow runtime): each child creates its
own devices from its own XLA_FLAGS. `FLAXLM_TEST_ZYGOTE=0` turns the zygote off.

`start(args, cwd, env, stdout=, stderr=)` returns a `subprocess.Popen` or a `Forked` with the
same interface (pid, poll, wait, communicate, send_signal, kill, terminate, returncode);
`run(...)` is `subprocess.run`'s equivalent.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# What a `flaxlm.main` run imports before its first step (the rest is flaxlm's own).
PRELOAD = (
    "numpy",
    "tensorflow",
    "tensorflow_text",
    "seqio",
    "jax",
    "jax.numpy",
    "flax.linen",
    "optax",
    "orbax.checkpoint",
    "gin",
    "absl.app",
    "absl.flags",
    "absl.logging",
)
# flaxlm.data.library_start's (the zygote imports no flaxlm module; tests/test_zygote.py checks
# they agree).
HIDDEN_WHILE_TENSORFLOW_LOADS = ("sklearn", "pandas", "scipy")
# Environment variables a child may set differently from the zygote's: read after the fork
# (XLA_FLAGS when the child creates its backend; flaxlm's and the tests' own when flaxlm,
# which the zygote never imports, reads them; nor are transformers and torch, which set
# KMP_* and TORCHINDUCTOR_* when a test process imports them).
PER_RUN = ("XLA_FLAGS", "PYTHONPATH")
PER_RUN_PREFIXES = (
    "FLAXLM_",
    "PYTEST_",
    "HF_",
    "TRANSFORMERS_",
    "WANDB_",
    "KMP_",
    "TORCH",
    # read when a GPU backend starts (benchmarks/accelerator.py sets XLA_CLIENT_MEM_FRACTION;
    # XLA_PYTHON_CLIENT_MEM_FRACTION is its deprecated name)
    "XLA_CLIENT_",
    "XLA_PYTHON_CLIENT_",
    # set by jax.experimental.mosaic.gpu's import (tests compile the experts' Mosaic GPU
    # kernels for an H100 target), read only when such a kernel runs
    "MOSAIC_GPU_",
)
MAX_MESSAGE = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment the zygote imports in: the test process's once tests/conftest.py has set it
# up (it imports this module last), before any test changes it.
BASE_ENV = dict(os.environ)


def _command(module: str) -> list[str]:
    """What follows `python` before the arguments: a script (a path ending in .py), or
    `-m module`."""
    return [module] if module.endswith(".py") else ["-m", module]


def _path_head(module: str, cwd: str) -> str:
    """What Python puts first on sys.path: the script's directory for `python script.py`,
    the working directory for `python -m module`."""
    return os.path.dirname(os.path.abspath(module)) if module.endswith(".py") else cwd


# ------------------------------------------------------------------ the zygote (its own process)


def _serve(path: str) -> None:
    """Imports PRELOAD, then forks a child per request on the socket at `path` until stdin
    (a pipe from the test process) closes. A request is one JSON message with the child's
    stdin, stdout and stderr descriptors; the reply is the child's pid, then, on the same
    connection, its exit code (negative: the signal that ended it) once it has exited."""
    import importlib

    # As flaxlm.main imports TensorFlow: without what keras would import for nothing.
    hidden = [name for name in HIDDEN_WHILE_TENSORFLOW_LOADS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    for name in PRELOAD:
        importlib.import_module(name)
    for name in hidden:
        if sys.modules[name] is None:
            del sys.modules[name]
    # TensorFlow looks for its accelerators once per process (a failed cuInit, logged, where
    # CUDA is absent); a run does it while its stderr is hidden, a child would after.
    sys.modules["tensorflow"].config.list_physical_devices()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    # Ready, with the environment as the imports left it (TensorFlow sets a few variables).
    print("ready", json.dumps(dict(os.environ)), flush=True)
    waiting: dict[int, socket.socket] = {}  # child pid -> its requester's connection
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [], 0.1)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return  # the test process has gone
        if server in readable:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                for other in waiting.values():
                    other.close()
                _child(json.loads(message), fds, conn)  # never returns
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:
                    pass  # the test process stopped listening
                conn.close()


def _child(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become `python -m <module> <args>` (or `python <script> <args>`)
    in the request's directory, environment and streams, run it, and exit as the interpreter
    would."""
    import runpy
    import signal

    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    # As CPython starts: SIGPIPE ignored (a write to a closed socket or pipe raises
    # BrokenPipeError). Left at its default, a client that hangs up before the server
    # answered (the tests' /health polls time out after 2 s on a busy machine) killed the
    # served run with SIGPIPE, which `python -m flaxlm.main` never sees.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    module = request["module"]
    first = _path_head(module, request["cwd"])
    sys.path[:] = [first, *extra, *(p for p in sys.path[1:] if p not in extra)]
    sys.argv = [_command(module)[0], *request["args"]]
    code: Any = 0
    try:
        if module.endswith(".py"):
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # the interpreter's exit: join non-daemon threads,
        atexit._run_exitfuncs()  # then the atexit handlers (jax.distributed's)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# ------------------------------------------------------------------ the tests' side


class Forked:
    """A child of the zygote, with the part of `subprocess.Popen`'s interface the tests use."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, streams: dict) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = streams.get("stdin")
        self.stdout = streams.get("stdout")
        self.stderr = streams.get("stderr")
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None:
            readable, _, _ = select.select([self._conn], [], [], 0)
            if readable:
                self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            readable, _, _ = select.select([self._conn], [], [], timeout)
            if not readable:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def _collect(self) -> None:
        reply = self._conn.recv(64)
        self._conn.close()
        if not reply:
            raise RuntimeError("the test zygote stopped before its child did")
        self.returncode = int(reply)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Reads stdout and stderr (those that are pipes) to their end, then waits."""
        out: dict[str, Any] = {}

        def read(name: str) -> None:
            stream = getattr(self, name)
            out[name] = stream.read() if stream is not None else None
            if stream is not None:
                stream.close()

        readers = [threading.Thread(target=read, args=(n,)) for n in ("stdout", "stderr")]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out["stdout"], out["stderr"]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class _Zygote:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="flaxlm-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.env = dict(BASE_ENV)
        self.refusals: list[str] = []  # why each start it did not serve was a fresh process
        self.log = os.path.join(self.dir, "zygote.log")  # its imports' C++ start-up lines
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), self.path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                text=True,
            )
        ready, _, imported_env = self.proc.stdout.readline().partition(" ")
        self.ready = ready == "ready"
        # What the preloaded imports set (as they do in a fresh process that imports them).
        self.imported = {
            k: v for k, v in json.loads(imported_env or "{}").items() if self.env.get(k) != v
        }
        if not self.ready:
            with open(self.log) as log:
                print(f"tests/zygote.py did not start; fresh processes instead:\n{log.read()}")
        atexit.register(self.close)

    def close(self) -> None:
        import shutil

        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def serves(self, env: dict[str, str], cwd: str) -> bool:
        """Whether a child in `env` sees what a fresh process would: every variable read at
        import time as the zygote's, no PYTHONPATH entry beyond the repo's and the zygote's,
        and no package of a preloaded name in `cwd` (a script's directory) or the repo."""
        if not self.ready or self.proc.poll() is not None:
            return self._refuse("the zygote is not running")
        for key in set(env) | set(self.env) | set(self.imported):
            if key in PER_RUN or key.startswith(PER_RUN_PREFIXES):
                continue
            if key in self.imported:  # this process may have imported them too, or not
                if env.get(key) not in (None, self.imported[key]):
                    return self._refuse(f"{key}={env.get(key)!r}")
            elif env.get(key) != self.env.get(key):
                return self._refuse(f"{key}={env.get(key)!r}, not {self.env.get(key)!r}")
        known = {REPO, *BASE_ENV.get("PYTHONPATH", "").split(os.pathsep)}
        for entry in set(env.get("PYTHONPATH", "").split(os.pathsep)) - known - {""}:
            # Another directory may hold a sitecustomize (run at a fresh start, never in a
            # child) or a module of a preloaded package's name (tests/no_tensorflow).
            return self._refuse(f"PYTHONPATH has {entry}")
        tops = {name.split(".")[0] for name in PRELOAD}
        for entry in {cwd, REPO}:
            # A package of a preloaded name first on the path (a folder without __init__.py,
            # such as the repo's gin/, is not one).
            for top in tops:
                stems = (os.path.join(top, "__init__.py"), top + ".py")
                if any(os.path.exists(os.path.join(entry, s)) for s in stems):
                    return self._refuse(f"{entry} has its own {top}")
        return True

    def _refuse(self, why: str) -> bool:
        self.refusals.append(why)
        return False

    def fork(self, module: str, args: list[str], cwd: str, env: dict, streams: dict) -> Forked:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.path)
        env = {**self.imported, **env}
        message = json.dumps({"module": module, "args": args, "cwd": cwd, "env": env})
        fds, mine = [], {}
        null = os.open(os.devnull, os.O_RDWR)
        for name in ("stdin", "stdout", "stderr"):
            target = streams.get(name)
            if target == subprocess.PIPE:
                read, write = os.pipe()
                if name == "stdin":
                    fds.append(read)
                    mine[name] = os.fdopen(write, "w")
                else:
                    fds.append(write)
                    mine[name] = os.fdopen(read, "r")
            elif target == subprocess.STDOUT:
                fds.append(fds[1])
            elif target == subprocess.DEVNULL:
                fds.append(null)
            elif target is None:
                fds.append(null if name == "stdin" else (0, 1, 2)[len(fds)])
            else:
                fds.append(target if isinstance(target, int) else target.fileno())
        socket.send_fds(conn, [message.encode()], fds)
        for name, target in streams.items():  # the child holds its ends of the pipes now
            if target == subprocess.PIPE:
                os.close(fds[("stdin", "stdout", "stderr").index(name)])
        os.close(null)
        pid = int(conn.recv(64))
        return Forked([sys.executable, *_command(module), *args], conn, pid, mine)


_zygote: _Zygote | None = None
_lock = threading.Lock()


def _get() -> _Zygote | None:
    global _zygote
    if os.environ.get("FLAXLM_TEST_ZYGOTE", "1") == "0" or not hasattr(socket, "send_fds"):
        return None
    with _lock:
        if _zygote is None:
            _zygote = _Zygote()
    return _zygote


def start(
    args: list[str],
    cwd: str,
    env: dict[str, str],
    *,
    module: str = "flaxlm.main",
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
) -> Any:
    """`python -m <module> <args>` (`python <module> <args>` for a path ending in .py) in
    `cwd` with `env`: forked from the zygote where it serves that environment, else a
    `subprocess.Popen`. stdin/stdout/stderr: None (this process's), subprocess.PIPE (text),
    DEVNULL, STDOUT (stderr only), or an open file."""
    zygote = _get()
    if zygote is not None and zygote.serves(env, _path_head(module, cwd)):
        streams = {"stdin": stdin, "stdout": stdout, "stderr": stderr}
        return zygote.fork(module, list(args), str(cwd), env, streams)
    return subprocess.Popen(
        [sys.executable, *_command(module), *args],
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def run(
    args: list[str], cwd: str, env: dict[str, str], *, module: str = "flaxlm.main", timeout=None
) -> subprocess.CompletedProcess:
    """`subprocess.run([python, -m, module, *args], capture_output=True, text=True)` (a
    script for a `module` ending in .py)."""
    proc = start(args, cwd, env, module=module, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


if __name__ == "__main__":
    _serve(sys.argv[1])
