"""Rewrite a float DeepSeek-V4 checkpoint in the released format (FP8 e4m3 128x128 weights, MXFP4 routed experts,
ue8m0 scales, native names, sharded with an index) and write its dequantized twin beside it:

    .venv/bin/python scripts/write_release_checkpoint.py SRC DST [--twin DIR] [--shards N]

SRC is any checkpoint pdspark loads (the shipped `dsv4-tiny` by name); `pdspark.testing.release_checkpoint` says
which tensor goes in which format. The twin loads to the same weights as DST, so the two generate the same tokens.
"""

from __future__ import annotations

import argparse

from pdspark.assets import resolve_model
from pdspark.testing.release_checkpoint import write_release_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a float checkpoint directory (or a shipped model's name: dsv4-tiny)")
    parser.add_argument("dst", help="where the released-format checkpoint goes")
    parser.add_argument("--twin", help="where its dequantized twin goes")
    parser.add_argument("--shards", type=int, default=2, help="safetensors files to split it into (default 2)")
    args = parser.parse_args()
    fixture = write_release_checkpoint(resolve_model(args.src), args.dst, args.twin, args.shards)
    print(f"{fixture.path}: {len(fixture.fp8)} FP8 weights, {len(fixture.fp4)} MXFP4 experts, "
          f"{len(fixture.shards)} shards" + (f"; twin {fixture.twin}" if fixture.twin else ""))


if __name__ == "__main__":
    main()
