"""The CPU weight GEMMs by input rows, with the weights read next asked for ahead (spread) or as before.

The C decode step's weight GEMMs (every output exactly a `dot`, the same bits whatever rows share the call):
`linear_rows` over fp32 and bf16 weights, `linear_fp8` (V4's FP8 128x128-tile weights) and `linear_mxfp4` (its
MXFP4 experts), and the DSpark draft's own GEMM (`linear_rows_draft`, bf16: fused multiply-adds, its own order), one
call over a stack of weight rows a measurement, one core. The library as built (`ahead`: the
weights read next asked for into L2 a few cache lines at every step, gemm.c's `ahead_step`) against the same source
built with `-DPDSPARK_NO_WEIGHT_AHEAD` (`before`: `gemm_exact`'s next 16-row block asked for into L1 all at once when
a block begins, the compact GEMMs' not at all), alternating call by call, and PyTorch's fp32 GEMM (MKL/oneDNN, one
thread) over the fp32 weights for reference (2x the bytes of bf16, 4x of FP8, 8x of MXFP4), timed apart. Stacks:
one that fits a server core's L3 (`--l3-mib`; K = 192, dsv4-tiny's hidden size: its decode reads its weights from
there) and ones far past it (`--dram-mib`; K = 1,024, v4-shape's, and an MXFP4 stack at K = 4,096, V4-Flash's
hidden size). Both builds compute the same bits (checked on every case).

    python bench/bench_weight_gemm.py [--rows 1,6,8,12,16,48] [--repeats 9] [--l3-mib 6] [--dram-mib 256]
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pdspark.hardware.cpu import kernels
from pdspark.hardware.cpu.kernel_build import build_library
from pdspark.quant.release_formats import E2M1

import torch
from console import log
from report import figure, save_figure, write_json

BUILDS = {"ahead": (), "before": ("-DPDSPARK_NO_WEIGHT_AHEAD",)}
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "bf16-draft": 2.0, "fp8": 1.0, "mxfp4": 0.5}  # (MXFP4: +1/32 of scales)


@dataclass(frozen=True)
class Stack:
    """Weight rows [N, K] of one storage, `mib` MiB of it, read from `where` (a label)."""

    where: str
    dtype: str  # a key of BYTES_PER_WEIGHT
    K: int
    mib: int

    @property
    def rows(self) -> int:
        return int((self.mib << 20) / (self.K * BYTES_PER_WEIGHT[self.dtype]))


@dataclass(frozen=True)
class Point:
    where: str
    dtype: str
    K: int
    rows: int
    ahead_gflops: float
    before_gflops: float
    torch_gflops: float

    @property
    def ratio(self) -> float:
        return self.ahead_gflops / self.before_gflops


def open_builds() -> dict[str, ctypes.CDLL]:
    """The library as built (`ahead`) and with `-DPDSPARK_NO_WEIGHT_AHEAD` (`before`), its five GEMMs typed."""
    f, i = ctypes.c_void_p, ctypes.c_int
    builds = {}
    for name, flags in BUILDS.items():
        built = build_library(kernels.SOURCE, extra_flags=flags)
        if built is None:
            raise SystemExit("the C kernel library could not be built here (see the log above)")
        lib = built.lib
        for fn in (lib.linear_rows, lib.linear_rows_h):
            fn.argtypes, fn.restype = [f, f, i, i, i, f], None
        lib.linear_fp8.argtypes, lib.linear_fp8.restype = [f, f, f, i, i, f, i, i, i, f], i
        lib.linear_mxfp4.argtypes, lib.linear_mxfp4.restype = [f, f, f, f, f, i, i, i, f], i
        lib.linear_rows_draft.argtypes, lib.linear_rows_draft.restype = [f, f, i, i, i, i, f], None
        builds[name] = lib
    return builds


def gemm_of(stack: Stack, g: torch.Generator) -> tuple[Callable[[ctypes.CDLL, torch.Tensor, torch.Tensor], None],
                                                        torch.Tensor]:
    """`call(lib, x [T, K], out [T, N])` running the stack's GEMM in `lib`, and fp32 weights [N, K] of its shape for
    PyTorch (the stack's values for fp32 and bf16; any values for the compact formats: only the time is wanted)."""
    N, K = stack.rows, stack.K
    if stack.dtype in ("fp32", "bf16", "bf16-draft"):
        w = (torch.randn(N, K, generator=g) * 0.05).to(torch.float32 if stack.dtype == "fp32" else torch.bfloat16)

        def call(lib, x, out):
            if stack.dtype == "bf16-draft":
                lib.linear_rows_draft(x.data_ptr(), w.data_ptr(), 1, x.shape[0], N, K, out.data_ptr())
            else:
                fn = lib.linear_rows_h if stack.dtype == "bf16" else lib.linear_rows
                fn(x.data_ptr(), w.data_ptr(), x.shape[0], N, K, out.data_ptr())

        return call, w.float()
    if stack.dtype == "fp8":  # e4m3 bytes but the two NaNs, one scale per 128x128 tile
        q = (torch.randint(0, 0x7F, (N, K), generator=g) | (torch.randint(0, 2, (N, K), generator=g) << 7))
        q = q.to(torch.uint8)
        scale = torch.full((-(-N // 128), -(-K // 128)), 0.01)
        lut = kernels.e4m3_values()

        def call(lib, x, out):
            lib.linear_fp8(x.data_ptr(), q.data_ptr(), scale.data_ptr(), scale.shape[1], 0, lut.data_ptr(),
                           x.shape[0], N, K, out.data_ptr())
    else:  # MXFP4: two e2m1 codes a byte, a ue8m0 scale byte per 32 inputs
        packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
        sbytes = torch.randint(120, 134, (N, K // 32), generator=g, dtype=torch.uint8)
        e2m1, e8m0 = E2M1.float().contiguous(), torch.exp2(torch.arange(256, dtype=torch.float32) - 127)

        def call(lib, x, out):
            lib.linear_mxfp4(x.data_ptr(), packed.data_ptr(), sbytes.data_ptr(), e2m1.data_ptr(), e8m0.data_ptr(),
                             x.shape[0], N, K, out.data_ptr())
    return call, torch.rand(N, K, generator=g)


def measure(stack: Stack, rows: list[int], repeats: int, builds: dict[str, ctypes.CDLL]) -> list[Point]:
    g = torch.Generator().manual_seed(0)
    call, w32 = gemm_of(stack, g)
    N = stack.rows
    calls = max(1, 64 // stack.mib)  # a measurement of at least ~64 MiB read: a few ms where one call is 0.1
    points = []
    for T in rows:
        x = torch.randn(T, stack.K, generator=g)
        outs = {name: torch.empty(T, N) for name in builds}
        times: dict[str, list[float]] = {name: [] for name in (*builds, "torch")}
        for _ in range(repeats + 1):  # the first round warms up (page faults, the caches' first touch), not counted
            for name, lib in builds.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    call(lib, x, outs[name])
                times[name].append((time.perf_counter() - t0) / calls)
        for _ in range(repeats + 1):  # apart: its fp32 weights would push an L3 stack out between calls
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.nn.functional.linear(x, w32)
            times["torch"].append((time.perf_counter() - t0) / calls)
        if not torch.equal(outs["ahead"], outs["before"]):
            raise SystemExit(f"the two builds disagree on {stack} at {T} rows: asking ahead must not change results")
        flops = 2.0 * T * N * stack.K
        gflops = {name: flops / statistics.median(ts[1:]) / 1e9 for name, ts in times.items()}
        point = Point(stack.where, stack.dtype, stack.K, T, gflops["ahead"], gflops["before"], gflops["torch"])
        log(f"{stack.where} {stack.dtype} K={stack.K} rows={T}: ahead {point.ahead_gflops:.1f}, before "
            f"{point.before_gflops:.1f} GFLOP/s ({point.ratio:.2f}x), PyTorch fp32 {point.torch_gflops:.1f}")
        points.append(point)
    return points


def table(points: list[Point]) -> list[str]:
    lines = ["| weights from | storage | K | rows | ahead GFLOP/s | before GFLOP/s | ahead / before | weights GB/s "
             "(ahead) | PyTorch fp32 GFLOP/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        gbs = p.ahead_gflops / (2 * p.rows) * BYTES_PER_WEIGHT[p.dtype]  # GB/s of stored weights
        lines.append(f"| {p.where} | {p.dtype} | {p.K} | {p.rows} | {p.ahead_gflops:.1f} | {p.before_gflops:.1f} | "
                     f"**{p.ratio:.2f}x** | {gbs:.1f} | {p.torch_gflops:.1f} |")
    return lines


def plot(points: list[Point]) -> None:
    groups = list(dict.fromkeys((p.where, p.dtype, p.K) for p in points))
    fig, axes = figure(ncols=len(groups), width=3.2 * len(groups))
    for ax, (where, dtype, K) in zip(axes if len(groups) > 1 else [axes], groups, strict=True):
        mine = [p for p in points if (p.where, p.dtype, p.K) == (where, dtype, K)]
        rows = [p.rows for p in mine]
        for label, values in (("ahead (built)", [p.ahead_gflops for p in mine]),
                              ("before", [p.before_gflops for p in mine]),
                              ("PyTorch fp32", [p.torch_gflops for p in mine])):
            ax.plot(rows, values, marker="o", label=label)
        ax.set_title(f"{dtype} [N, {K}] from {where}", fontsize=8)
        ax.set_xlabel("input rows")
        ax.set_ylabel("GFLOP/s, one core")
        ax.legend(fontsize=7)
    save_figure(fig, "weight_gemm", "CPU weight GEMMs: weights read next asked for ahead vs as before")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,6,8,12,16,48")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--l3-mib", type=int, default=6, help="stacks that fit the L3 (K = 192)")
    parser.add_argument("--dram-mib", type=int, default=256, help="stacks far past the L3 (K = 1,024 and 4,096)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    builds = open_builds()
    stacks = [Stack("L3", "bf16", 192, args.l3_mib), Stack("L3", "fp32", 192, args.l3_mib),
              *(Stack("DRAM", dtype, 1024, args.dram_mib) for dtype in ("bf16", "fp32", "fp8", "mxfp4", "bf16-draft")),
              Stack("DRAM", "mxfp4", 4096, args.dram_mib)]
    points = [p for stack in stacks for p in measure(stack, rows, args.repeats, builds)]
    print("\n".join(table(points)))
    write_json("weight_gemm", {"args": vars(args), "host": platform.machine(),
                               "points": [asdict(p) | {"ratio": p.ratio} for p in points]})
    plot(points)


if __name__ == "__main__":
    main()
