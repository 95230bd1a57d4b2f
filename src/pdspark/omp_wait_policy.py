"""`apply`: OpenMP threads that sleep when their parallel region ends (`OMP_WAIT_POLICY=PASSIVE`) unless the
environment says otherwise; `check`: say so when it came too late.

Why: an engine process runs torch's OpenMP team beside threads of its own (the C kernels' GEMM helper, gRPC's,
Mooncake's). libgomp's default has every worker spin ~300,000 times after each parallel region before it sleeps, so
on a few cores a spinning worker holds a core that the main thread or the GEMM helper needs next, and once anything
else on the machine wants a core too, the kernel's millisecond time slices fall between a step's microsecond-apart
kernels. Measured on a 2-core Zen 4 VM (`bench/bench_cpu_contention.py`): beside one busy process, decode 1.7-2.3x
faster with sleeping workers at half the CPU per token (beside several, batch 8 collapsed to 60-240 tokens/s
spinning against 390-760); on an idle machine the same at batch 1 and 8-19% slower at batch 8, a wake-up (a futex,
microseconds) at each parallel region of the step's torch ops. A serving worker never has the machine to itself
(its router, gRPC and Mooncake threads, other pods), so the robust setting is the default.

libgomp reads the variable once, when torch loads it: `import pdspark` sets it first (the CLI, the workers and `from
pdspark import LLM` all import this package before torch). `OMP_WAIT_POLICY` set by the user is left alone;
`PDSPARK_OMP_WAIT_POLICY=default` leaves it unset (libgomp's own default).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

VARIABLE = "OMP_WAIT_POLICY"
OPT_OUT = "PDSPARK_OMP_WAIT_POLICY"  # "default": leave OMP_WAIT_POLICY unset
# What `apply` found: "set" (it set PASSIVE), "user" (already set), "opted-out", or "late" (torch was loaded first).
outcome = "unapplied"


def apply() -> str:
    """Set `OMP_WAIT_POLICY=PASSIVE` when nothing set it and torch is not loaded yet; returns what it found."""
    global outcome
    if VARIABLE in os.environ:
        outcome = "user"
    elif os.environ.get(OPT_OUT, "").lower() == "default":
        outcome = "opted-out"
    elif "torch" in sys.modules:
        outcome = "late"
    else:
        os.environ[VARIABLE] = "PASSIVE"
        outcome = "set"
    return outcome


def check() -> None:
    """At engine start: a process that loaded torch before pdspark has libgomp's spinning threads; say how to avoid
    them (once a process)."""
    global outcome
    if outcome == "late":
        outcome = "late, said"
        logger.warning("torch was imported before pdspark, so its OpenMP threads spin after each parallel region "
                       "(libgomp's default): on a machine shared with other work decode can slow down several "
                       "times; import pdspark first, or set %s=PASSIVE before starting Python", VARIABLE)
