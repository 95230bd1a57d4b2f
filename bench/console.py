"""What a long benchmark run says and hears on its console: progress lines on stderr (`log`), and Ctrl-C or SIGTERM
raised as `Stopped` (`stop_on_signals`), so that the run stops what it started before it exits."""

from __future__ import annotations

import signal
import sys


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Stopped(BaseException):
    """Ctrl-C or SIGTERM (a BaseException, like KeyboardInterrupt: no `except Exception` may swallow it)."""


def _stopped(signum: int, _frame) -> None:
    raise Stopped(signum)


def stop_on_signals() -> None:
    """From now on, SIGINT and SIGTERM raise `Stopped(signum)` in the main thread."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
