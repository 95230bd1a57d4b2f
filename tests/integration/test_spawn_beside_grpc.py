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


def test_a_child_that_exits_right_after_its_ready_line_is_ready(monkeypatch):
    """`wait_ready` can see the child's exit before the reader thread has parsed its ready line (the flake this test
    pins down: "child did not become ready" with the ready line in its own report). Here the readers wait until
    `wait_ready` has seen the exit before they read: the readers are drained, the line found."""
    import subprocess

    from pdspark.launch.service_process import ServiceProcess

    exit_seen = threading.Event()
    poll, read = subprocess.Popen.poll, ServiceProcess._read

    def poll_noting_the_exit(self):
        code = poll(self)
        if code is not None:
            exit_seen.set()
        return code

    def read_once_the_exit_is_seen(self, stream, is_stdout):
        exit_seen.wait(scaled(30))
        read(self, stream, is_stdout)

    monkeypatch.setattr(subprocess.Popen, "poll", poll_noting_the_exit)
    monkeypatch.setattr(ServiceProcess, "_read", read_once_the_exit_is_seen)
    child = wait_ready(spawn_process("child", [sys.executable, "-c", READY], dict(os.environ)), scaled(30))
    assert child.ready and child.proc.returncode == 0
