"""Stub prefill and decode workers (grpc.aio, no model): they answer at once, so a benchmark through them measures
only the router. `python bench/stub_workers.py --tokens 16` prints one JSON ready line with both addresses.

The stubs are the tests' (`pdspark.testing.worker_stubs`): asyncio servers, so hundreds of concurrent streams cost no
threads and the router's admission bounds, not the stubs, limit a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from pdspark.testing.worker_stubs import StubDecode, StubPrefill, serve_stub


async def main(tokens: int) -> None:
    prefill_server, _, prefill = await serve_stub(StubPrefill())
    decode_server, _, decode = await serve_stub(StubDecode(tokens))
    print(json.dumps({"event": "ready", "prefill": prefill, "decode": decode}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await asyncio.gather(prefill_server.stop(1), decode_server.stop(1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16)
    asyncio.run(main(parser.parse_args().tokens))
