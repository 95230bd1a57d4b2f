"""Run as a script (`python -I -S orphan_guard.py PARENT_PID ARGV...`): ask the kernel to SIGTERM this process when
its parent dies (Linux `PR_SET_PDEATHSIG`), then become ARGV (exec: same pid, same parent, the setting kept).

Why a separate exec rather than a `preexec_fn`: Python code between fork and exec makes `subprocess` fork instead
of vfork, and a fork runs gRPC's fork handlers (pthread_atfork) in a process whose gRPC threads are busy: gRPC then
skips them and the child's copy of gRPC polls file descriptors that `close_fds` closed before exec ("epoll_wait
error: Bad file descriptor", "Check failed"), and the child dies before exec — one spawn in three while other
threads call gRPC. Without a `preexec_fn` `subprocess` uses vfork, which runs no fork handlers.

Imports nothing from pdspark (a package import would load torch): the interpreter runs with `-S`, stdlib only.
"""

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent_pid, command = int(argv[1]), argv[2:]
    with contextlib.suppress(OSError):  # not Linux: the launcher's own signal handling still stops children
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect: nobody is left to stop us
        os._exit(1)
    os.execvp(command[0], command)  # a bare name is looked up on PATH, as subprocess would


if __name__ == "__main__":
    main(sys.argv)
