"""The dry run's fork server (``gpu_check.sh --dry-run`` only; a GPU session never uses it).

A dry-run phase is a few seconds of interpreted work behind some four of Python start-up:
torch, Dynamo, transformers, torchao, matplotlib and tkern imported afresh by each of some twenty
processes, half the dry run. Here they are imported once (:data:`PRELOAD`, or the modules named)::

    python benchmarks/dry_run_forks.py serve SOCKET [MODULE,...]  # the imports, then a phase at a time
    python benchmarks/dry_run_forks.py run SOCKET -- ARGV...       # a phase: ARGV as `python ARGV...`

``run`` is the phase's command: it hands the server its argv, working directory,
environment and stdin/stdout/stderr; the server forks a child of its imported self, which
runs ``ARGV`` (``script.py ...``, ``-m module ...`` or ``-c code ...``) as ``python ARGV``
would, with ``sys.argv``, ``sys.path[0]``, the environment and the working directory of a
fresh process, and exits with the script's status, which ``run`` exits with (128 + N for a
signal N; a signal ``run`` gets, ``timeout``'s, goes to the child). Every phase still runs in
a process of its own, forked from the same state, so nothing one phase does reaches the next.

``run`` starts the phase as its own process instead (``os.execv`` of this interpreter, as
before) when the server cannot be reached, or when its environment differs from the
server's (bench_host's ``TKERN_AUTOTUNE=0``: tkern reads it at import).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import sys
import traceback

#: what the server imports once (each optional: a module that fails is left to the phase)
PRELOAD = (
    "torch",
    "torch._dynamo",
    "triton",
    "tkern",
    "tkern.kernels",
    "tkern.train.cli",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "torchao",
    "torchao.float8",
    "matplotlib.pyplot",
    "harness",
    "bench_models",
    "train_recipes",
    "train_profile",
)
#: sys.path before the imports (which may add to it): a phase gets it with its own first entry
_BASE_PATH = list(sys.path)
#: environment variables a shell sets per command, which no import reads
_VOLATILE = ("_", "SHLVL", "OLDPWD")


def _env_key(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _VOLATILE}


def _preload(names: tuple[str, ...] = PRELOAD) -> None:
    import importlib

    if "matplotlib.pyplot" in names:
        import matplotlib

        matplotlib.use("Agg")  # as every picture of the benchmarks draws (files only)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (the phase that needs it imports it, and fails there)
            print(f"dry_run_forks: preload {name}: {type(exc).__name__}: {exc}", file=sys.stderr)


def _recv(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        msg, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
        if not msg:
            raise ConnectionError("client went away")
        data += msg
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def _reseed() -> None:
    """Fresh seeds, as a process of its own draws them (a fork would share the server's)."""
    import random

    random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python ARGV`` and never return."""
    code = 1
    try:
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])  # the environment is the server's: the same as the request's
        _reseed()
        argv = request["argv"]
        import runpy

        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [request["cwd"], *_BASE_PATH[1:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *_BASE_PATH[1:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = os.path.abspath(argv[0])
            if not os.path.isfile(script):  # as the interpreter says it
                print(f"{sys.executable}: can't open file {script!r}: [Errno 2] No such file or directory",
                      file=sys.stderr)  # fmt: skip
                raise SystemExit(2)
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(script), *_BASE_PATH[1:]]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001  (as the interpreter would: the traceback, status 1)
        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> None:
    # listen first: a phase that connects while the imports run waits in the backlog
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    # the environment a phase must have to be forked: the server's before the imports
    # (tkern's import sets TRITON_INTERPRET=1 on a CPU, as it would in the phase's own process)
    env = _env_key(dict(os.environ))
    _preload(preload)
    parent = os.getppid()
    server.settimeout(2)
    while True:  # one phase at a time, as gpu_check.sh runs them
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # gpu_check.sh is gone (killed): so is the server
                return
            continue
        conn.settimeout(None)
        with conn:
            try:
                request, fds = _recv(conn)
            except (ConnectionError, ValueError):
                continue
            if _env_key(request["env"]) != env:
                diff = sorted(set(_env_key(request["env"]).items()) ^ set(env.items()))
                conn.sendall(json.dumps({"exec": sorted({k for k, _ in diff})}).encode() + b"\n")
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):  # the client went away (killed): nobody to tell
                conn.sendall(json.dumps({"status": code if code >= 0 else 128 - code}).encode() + b"\n")


def _own_process(argv: list[str], why: str) -> None:
    print(f"dry_run_forks: {why}; the phase runs in a process of its own", file=sys.stderr)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv])


def run(path: str, argv: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as exc:
        _own_process(argv, f"no server at {path} ({exc.strerror})")
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    fds = array.array("i", [0, 1, 2])
    conn.sendmsg([json.dumps(request).encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    pending, pid = [], None

    def forward(signum, _frame):  # timeout's signal goes to the phase
        if pid is None:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    reader = conn.makefile("r")
    reply = reader.readline()
    if not reply:
        _own_process(argv, "the server went away")
    reply = json.loads(reply)
    if "exec" in reply:
        _own_process(argv, f"its environment differs from the server's in {', '.join(reply['exec'])}")
    pid = reply["pid"]
    for sig in pending:
        forward(sig, None)
    done = reader.readline()
    if not done:
        return 1
    return json.loads(done)["status"]


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        serve(sys.argv[2], *([tuple(filter(None, sys.argv[3].split(",")))] if len(sys.argv) > 3 else []))
    elif len(sys.argv) >= 5 and sys.argv[1] == "run" and sys.argv[3] == "--":
        sys.exit(run(sys.argv[2], sys.argv[4:]))
    else:
        sys.exit("usage: dry_run_forks.py serve SOCKET [MODULE,...] | run SOCKET -- ARGV...")


if __name__ == "__main__":
    main()
