"""Child processes that never outlive their parent, their names, a server's way out on SIGTERM and its
quick exit, telling whether a process still runs or runs native threads, and a free loopback port for
a process to listen on."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket


def main_and_exit(main, *args, **kwargs) -> None:
    """Run a command-line entry point (`main(*args, **kwargs)`) as this process's whole life, then leave
    without the interpreter's teardown: once main has returned or raised SystemExit, the exit handlers
    run (temporary files, multiprocessing's) and the logs and output are flushed, but the modules are
    not torn down one by one, which takes a process holding torch, transformers and a web stack about
    0.8 s of CPU for nothing. Any other exception unwinds as usual (traceback, exit code 1)."""
    import atexit
    import logging
    import sys

    try:
        main(*args, **kwargs)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel send this process SIGTERM when the process that started it dies, however it
    dies (SIGKILL, a crash): a server's engine and API workers never outlive it. Linux only; a
    no-op elsewhere.

    `parent_pid`: the process that started this one (default: a spawned process's multiprocessing
    parent). If that parent died before the signal was armed, this process stops now: it has been
    handed to init, or to a subreaper (systemd, a container's init), and no signal would come."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None else None
    if os.getppid() == 1 or (parent_pid is not None and os.getppid() != parent_pid):
        os.kill(os.getpid(), signal.SIGTERM)


def unwind_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, so that a server unwinds through its `finally`
    blocks and stops the processes it started; SIGHUP (the terminal went away) becomes a SIGTERM.
    uvicorn handles SIGTERM itself while it serves and, once it has shut down, raises the signal again
    for this handler.

    Once the process is leaving, a further SIGTERM is ignored (`leaving()`): one from its launcher
    stopping everything, or the parent-death signal, would otherwise raise inside the clean-up or in
    an interpreter-exit finalizer and print a traceback for a shutdown that went well."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))


def leaving() -> None:
    """This process is on its way out (its clean-up runs): SIGTERM has nothing more to stop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _exit_on_sigterm(signum, frame) -> None:
    leaving()
    raise SystemExit(128 + signum)


def native_threads() -> int:
    """This process's OS threads that are not Python threads: native pools (OpenMP's once a parallel op
    ran, OpenBLAS's, ZeroMQ's) whose state a forked child inherits without their threads; OpenMP's,
    for one, hangs the child's next parallel region. 0 where /proc is missing (nothing to fork from)."""
    import threading

    return len(os_threads() - {t.native_id for t in threading.enumerate()})


def nvidia_driver_present() -> bool:
    """Whether this host has NVIDIA's driver (its control device), without importing torch: where it has
    none, no CUDA device can be visible, and the CPU paths need not ask torch (a second of import)."""
    return os.path.exists("/dev/nvidiactl")


def os_threads() -> set[int]:
    """The ids of this process's OS threads (empty where /proc is missing)."""
    return {int(t) for t in os.listdir("/proc/self/task")} if os.path.isdir("/proc/self/task") else set()


def set_process_name(name: str) -> None:
    """The name `ps`, `top` and /proc/PID/comm show for this process (at most 15 characters), so that
    an operator tells the engine from the API workers and the ranks. Linux only; a no-op elsewhere."""
    try:
        import ctypes

        pr_set_name = 15
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
