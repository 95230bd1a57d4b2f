"""`pdspark up` passes on what its services write on stderr as they write it, each line prefixed with the service's
name: a live worker's warnings and tracebacks reach the terminal (before, only the last lines of one that exited)."""

from __future__ import annotations

import os
import sys

from pdspark.launch.plan import Service
from pdspark.launch.process_backend import ProcessBackend
from pdspark.launch.service_process import echo_prefixed, spawn_process, wait_ready
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until

# Writes a warning on stderr, says it is ready, then stays alive until stopped.
WARN_THEN_RUN = ("import sys, time; sys.stderr.write('warning: pages low\\n'); sys.stderr.flush(); "
                 "print('{\"event\": \"ready\"}', flush=True); time.sleep(600)")


def test_a_running_child_s_stderr_line_is_passed_on_while_it_runs():
    seen: list[str] = []
    child = wait_ready(spawn_process("decode-0", [sys.executable, "-c", WARN_THEN_RUN], dict(os.environ),
                                     echo=seen.append), scaled(30))
    try:
        wait_until(lambda: seen == ["warning: pages low\n"], 10, what="the child's stderr line passed on")
        assert child.alive  # passed on as written, not when the child ended
        assert child.errors == ["warning: pages low\n"]  # and still kept for the exit report
    finally:
        child.stop()


def test_each_line_is_written_whole_with_the_service_s_name(capsys):
    echo = echo_prefixed("prefill-1")
    echo("Traceback (most recent call last):\n")
    echo("last line without a newline")
    assert capsys.readouterr().err == ("[prefill-1] Traceback (most recent call last):\n"
                                       "[prefill-1] last line without a newline\n")


def test_the_process_backend_passes_a_real_service_s_stderr_on_under_its_name(capfd):
    # A real `pdspark serve` refusing a bad flag: argparse's message comes on stderr.
    run = ProcessBackend().start(Service("prefill-0", "prefill", ["serve", "prefill", "--no-such-flag"], {}))
    assert run.proc.wait(scaled(60)) != 0
    run.drain()
    err = capfd.readouterr().err
    assert run.errors, "the service wrote nothing on stderr"
    assert all(f"[prefill-0] {line.rstrip()}" in err for line in run.errors), err
