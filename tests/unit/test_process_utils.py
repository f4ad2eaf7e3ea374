"""exit_with_parent: a child whose parent died before it armed its parent-death signal stops at once,
also when a subreaper (systemd, a container's init) rather than init took it over; a server's way out
on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# The grandchild: waits until its parent has exited (it has been taken over), then arms the signal,
# as a spawned engine or rank does after its imports; it must not reach the sleep's end.
_GRANDCHILD = textwrap.dedent(
    """
    import os, sys, time
    from splitserve.process_utils import exit_with_parent
    parent = int(sys.argv[1])
    while os.getppid() == parent:
        time.sleep(0.01)
    exit_with_parent(parent)
    time.sleep(30)
    """
)

# The parent: starts the grandchild and exits at once.
_PARENT = textwrap.dedent(
    """
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
    print(child.pid, flush=True)
    os._exit(0)
    """
)

# The subreaper: orphans of its descendants become its children; it reports how the grandchild ended.
_SUBREAPER = textwrap.dedent(
    """
    import ctypes, os, subprocess, sys
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    out = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], capture_output=True, text=True, check=True)
    _, status = os.waitpid(int(out.stdout), 0)
    print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status))
    """
)


def test_a_child_orphaned_before_arming_stops_under_a_subreaper():
    out = subprocess.run(
        [sys.executable, "-c", _SUBREAPER, _PARENT, _GRANDCHILD], capture_output=True, text=True, timeout=20
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 15  # SIGTERM, sent to itself when it found its parent gone


def test_sigterm_unwinds_once_then_is_ignored_while_leaving():
    """The first SIGTERM unwinds through `finally` (exit code 143); one more during the clean-up (the
    launcher stopping everything, the parent-death signal) neither interrupts it nor prints a traceback."""
    child = textwrap.dedent(
        """
        import os, signal, time
        from splitserve.process_utils import unwind_on_sigterm
        unwind_on_sigterm()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            print("cleaned up", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stderr
    assert done.stdout == "cleaned up\n" and "Traceback" not in done.stderr, done.stderr
