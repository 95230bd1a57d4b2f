"""Children spawned while other threads of this process are busy in gRPC start cleanly.

A `preexec_fn` makes `subprocess` fork (not vfork), and a fork runs gRPC's fork handlers: with gRPC busy in another
thread they are skipped and the child's copy of gRPC polls descriptors `close_fds` closed ("epoll_wait error: Bad
file descriptor"), so about one child in three died before exec (test_prefill_failover's "prefill did not become
ready" in CI). The tests spawn every worker from a process whose threads call gRPC."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import grpc

from pdspark.launch.service_process import spawn_process, wait_ready
from pdspark.testing.time_scale import scaled

SPAWNS = 30
READY = "import sys; print('{\"event\": \"ready\", \"ppid\": %d}' % __import__('os').getppid()); sys.stdout.flush()"


def _call_grpc_until(stop: threading.Event) -> None:
    async def calls():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.unary_unary("/absent.Service/Method")
            while not stop.is_set():
                try:
                    await method(b"", timeout=scaled(1))
                except grpc.aio.AioRpcError as e:
                    assert e.code() is grpc.StatusCode.UNIMPLEMENTED, e
        await server.stop(None)

    asyncio.run(calls())


def test_children_spawned_beside_busy_grpc_threads_all_start_with_nothing_on_stderr():
    stop = threading.Event()
    busy = threading.Thread(target=_call_grpc_until, args=(stop,))
    busy.start()
    try:
        for _ in range(SPAWNS):
            child = wait_ready(spawn_process("child", [sys.executable, "-c", READY], dict(os.environ)), scaled(30))
            assert child.proc.wait(scaled(10)) == 0
            child.drain()
            assert child.errors == []
            # orphan_guard exec'd the command in place: the child's parent is this process.
            assert child.info["ppid"] == os.getpid()
    finally:
        stop.set()
        busy.join(scaled(30))
