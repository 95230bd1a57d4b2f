"""The C weight GEMM by input rows, with the next weights asked for spread over its steps or all at once.

`kernels.linear_rows` (the C decode step's weight GEMM: each output exactly a `dot`, the same bits whatever rows
share the call) over a stack of weight rows, one call a measurement, one core: the library as built (bf16 weights:
the next 16-row block asked for a few cache lines at every step of the tiles, `gemm.c`'s `ahead_plan`) against the
same source built with `-DPDSPARK_GEMM_BURST` (every block asked for at once, as before), alternating call by call,
beside PyTorch's fp32 GEMM (MKL/oneDNN, one thread) over the fp32 twin of the weights for reference (twice the bytes
of bf16). Two places the weights come from: a stack that fits a server core's L3 (`--l3-mib`; K = 192, dsv4-tiny's
hidden size: its decode steps read weights from there) and one that does not (`--dram-mib`; K = 1,024, v4-shape's
and a V4 expert's rows). Both builds compute the same bits (checked here on every case).

    python bench/bench_weight_gemm.py [--rows 1,6,8,12,16,48] [--repeats 9] [--l3-mib 6] [--dram-mib 256]
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from console import log
from report import figure, save_figure, write_json

from pdspark.hardware.cpu import kernels
from pdspark.hardware.cpu.kernel_build import build_library


@dataclass(frozen=True)
class Stack:
    """Weight rows [N, K] of one dtype, `mib` MiB of them, read from `where` (a label)."""

    where: str
    dtype: str  # "bf16" or "fp32"
    K: int
    mib: int


@dataclass(frozen=True)
class Point:
    where: str
    dtype: str
    K: int
    rows: int
    spread_gflops: float
    burst_gflops: float
    torch_gflops: float

    @property
    def ratio(self) -> float:
        return self.spread_gflops / self.burst_gflops


def open_builds() -> dict[str, ctypes.CDLL]:
    """The library as built (`spread`) and with `-DPDSPARK_GEMM_BURST` (`burst`), each with `linear_rows{,_h}` typed."""
    builds = {}
    for name, flags in (("spread", ()), ("burst", ("-DPDSPARK_GEMM_BURST",))):
        built = build_library(kernels.SOURCE, extra_flags=flags)
        if built is None:
            raise SystemExit("the C kernel library could not be built here (see the log above)")
        for fn in (built.lib.linear_rows, built.lib.linear_rows_h):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                           ctypes.c_void_p]
            fn.restype = None
        builds[name] = built.lib
    return builds


def measure(stack: Stack, rows: list[int], repeats: int, builds: dict[str, ctypes.CDLL]) -> list[Point]:
    dtype = torch.bfloat16 if stack.dtype == "bf16" else torch.float32
    N = (stack.mib << 20) // (stack.K * dtype.itemsize)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(N, stack.K, generator=g) * 0.05).to(dtype)
    w32 = w.float()
    points = []
    for T in rows:
        x = torch.randn(T, stack.K, generator=g)
        outs = {name: torch.empty(T, N) for name in builds}
        times: dict[str, list[float]] = {name: [] for name in (*builds, "torch")}
        calls = max(1, 64 // stack.mib)  # a measurement of at least ~64 MiB read: a few ms where one call is 0.1
        for _ in range(repeats + 1):  # the first round warms up (page faults, the caches' first touch), not counted
            for name, lib in builds.items():
                call = lib.linear_rows_h if dtype is torch.bfloat16 else lib.linear_rows
                t0 = time.perf_counter()
                for _ in range(calls):
                    call(x.data_ptr(), w.data_ptr(), T, N, stack.K, outs[name].data_ptr())
                times[name].append((time.perf_counter() - t0) / calls)
        for _ in range(repeats + 1):  # apart: its fp32 twin of the weights would push an L3 stack out between calls
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.nn.functional.linear(x, w32)
            times["torch"].append((time.perf_counter() - t0) / calls)
        if not torch.equal(outs["spread"], outs["burst"]):
            raise SystemExit(f"the two builds disagree on {stack} at {T} rows: the prefetch must not change results")
        flops = 2.0 * T * N * stack.K
        gflops = {name: flops / statistics.median(ts[1:]) / 1e9 for name, ts in times.items()}
        point = Point(stack.where, stack.dtype, stack.K, T, gflops["spread"], gflops["burst"], gflops["torch"])
        log(f"{stack.where} {stack.dtype} K={stack.K} rows={T}: spread {point.spread_gflops:.1f}, burst "
            f"{point.burst_gflops:.1f} GFLOP/s ({point.ratio:.2f}x), PyTorch fp32 {point.torch_gflops:.1f}")
        points.append(point)
    return points


def table(points: list[Point]) -> list[str]:
    lines = ["| weights from | dtype | K | rows | spread GFLOP/s | burst GFLOP/s | spread / burst | weights GB/s "
             "(spread) | PyTorch fp32 GFLOP/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        gbs = p.spread_gflops / (2 * p.rows) * (2 if p.dtype == "bf16" else 4)  # bytes a multiply-add of a row
        lines.append(f"| {p.where} | {p.dtype} | {p.K} | {p.rows} | {p.spread_gflops:.1f} | {p.burst_gflops:.1f} | "
                     f"**{p.ratio:.2f}x** | {gbs:.1f} | {p.torch_gflops:.1f} |")
    return lines


def plot(points: list[Point]) -> None:
    groups = sorted({(p.where, p.dtype, p.K) for p in points})
    fig, axes = figure(ncols=len(groups), width=3.6 * len(groups))
    for ax, (where, dtype, K) in zip(axes if len(groups) > 1 else [axes], groups, strict=True):
        mine = [p for p in points if (p.where, p.dtype, p.K) == (where, dtype, K)]
        rows = [p.rows for p in mine]
        for label, values in (("spread (built)", [p.spread_gflops for p in mine]),
                              ("burst", [p.burst_gflops for p in mine]),
                              ("PyTorch fp32", [p.torch_gflops for p in mine])):
            ax.plot(rows, values, marker="o", label=label)
        ax.set_title(f"{dtype} [N, {K}] from {where}", fontsize=8)
        ax.set_xlabel("input rows")
        ax.set_ylabel("GFLOP/s, one core")
        ax.legend(fontsize=7)
    save_figure(fig, "weight_gemm", f"C weight GEMM: next weights asked for spread vs at once ({platform.node()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,6,8,12,16,48")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--l3-mib", type=int, default=6, help="a stack that fits the L3 (K = 192)")
    parser.add_argument("--dram-mib", type=int, default=256, help="a stack far past the L3 (K = 1,024)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    builds = open_builds()
    stacks = [Stack(where, dtype, K, mib) for where, K, mib in (("L3", 192, args.l3_mib),
                                                                ("DRAM", 1024, args.dram_mib))
              for dtype in ("bf16", "fp32")]
    points = [p for stack in stacks for p in measure(stack, rows, args.repeats, builds)]
    print("\n".join(table(points)))
    write_json("weight_gemm", {"args": vars(args), "cpu": platform.processor() or platform.machine(),
                               "points": [asdict(p) | {"ratio": p.ratio} for p in points]})
    plot(points)


if __name__ == "__main__":
    main()
