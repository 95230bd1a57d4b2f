"""What one request's router -> worker calls cost in CPU, by transport, against the same instant stub servers.

A request is what the router's dispatcher sends: a prefill leg (`PrefillRequest` -> `PrefillResponse`) to a prefill
server and a decode leg (`GenerateRequest` -> one `GenerateChunk`, 1 token) to a decode server, concurrently. Both
servers run in one child process (its CPU is the "server" column); the calls are made from this process (its CPU,
all threads, is the "client" column: the router's share). Transports:

- `unary+stream`: today's path: a grpc.aio unary call (Prefill) and a unary-stream call (Generate) per request,
  each with a timeout, as `PairAttempt.chunks` makes them.
- `unary+unary`: the decode leg as a unary call too (a generic handler answering the one chunk): what a
  unary-stream call costs over a unary one.
- `mux`: one long-lived bidirectional stream per (client, server) channel; each request is a frame tagged with an
  id (request frames in, tagged response frames out), one frame per message; a writer task per stream, a reader
  task per stream resolving the request's future/queue; a per-request deadline timer on the client.
- `mux-batched`: `mux`, but each writer sends every frame queued when it wakes as one message (a repeated field),
  on both sides: under concurrency, one message carries several requests.
- `pdspark-multiplexed`: what the router's `--worker-calls multiplexed` runs: `MultiplexedClient` on the workers'
  `Calls` method served by `MultiplexedServer` (the `mux-batched` design with deadlines, cancels and statuses).
- `sync-threads`: grpc's synchronous stubs: Prefill as a `.future()` (resolved on the loop by a thread-safe
  callback), Generate iterated on an executor thread.

The frames are a protobuf envelope (`MuxFrame`: id + one of the worker messages; `MuxBatch`: repeated frames),
built here from a descriptor so the benchmark needs no generated code. Variants alternate in every round
(`--rounds`), so all meet the same contention on a shared machine; the table reports per-variant medians.

    python bench/bench_worker_rpc.py [--requests 3000] [--rounds 5] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from pdspark.rpc import convert
from pdspark.rpc.keepalive import CHANNEL_OPTIONS, SERVER_OPTIONS
from pdspark.rpc.multiplexed_client import MultiplexedClient
from pdspark.rpc.multiplexed_server import CallHandler, MultiplexedServer
from pdspark.types import SamplingParams
from pdspark.v1 import common_pb2, worker_pb2, worker_pb2_grpc

import grpc
import uvloop
from cpu_time import cpu_s, self_cpu_s
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from report import figure, save_figure, write_json

MUX_STREAM = "/pdspark.bench.Mux/Stream"
UNARY_GENERATE = "/pdspark.bench.Mux/GenerateUnary"
PROMPT = [11, 12, 13, 14, 15, 16]
TIMEOUT_S = 60.0
VARIANTS = ("unary+stream", "unary+unary", "mux", "mux-batched", "pdspark-multiplexed", "sync-threads")


def _envelope_classes():
    """`MuxFrame` {id, oneof body {prefill, generate, prefill_result, chunk}} and `MuxBatch` {repeated frames}."""
    f = descriptor_pb2.FileDescriptorProto(name="pdspark/bench/mux.proto", package="pdspark.bench",
                                           syntax="proto3", dependency=["pdspark/v1/worker.proto"])
    frame = f.message_type.add(name="MuxFrame")
    frame.oneof_decl.add(name="body")
    frame.field.add(name="id", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
                    label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    for number, (name, kind) in enumerate((("prefill", "PrefillRequest"), ("generate", "GenerateRequest"),
                                           ("prefill_result", "PrefillResponse"), ("chunk", "GenerateChunk")), 2):
        frame.field.add(name=name, number=number, type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
                        type_name=f".pdspark.v1.{kind}", label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
                        oneof_index=0)
    batch = f.message_type.add(name="MuxBatch")
    batch.field.add(name="frames", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
                    type_name=".pdspark.bench.MuxFrame", label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.Default()
    pool.Add(f)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("pdspark.bench.MuxFrame")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("pdspark.bench.MuxBatch")))


MuxFrame, MuxBatch = _envelope_classes()



# ---- the servers (child process) -------------------------------------------------------------------------------------
def _prefill_response(request) -> worker_pb2.PrefillResponse:
    return worker_pb2.PrefillResponse(result=worker_pb2.TransferResult(transfer_id=request.transfer_id,
                                                                       first_token_id=9))


def _chunk(request) -> worker_pb2.GenerateChunk:
    return worker_pb2.GenerateChunk(request_id=request.request_id, token_ids=[9], text="x", finished=True,
                                    finish_reason=common_pb2.FINISH_REASON_LENGTH)


class _Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self) -> None:
        self.calls = MultiplexedServer({"prefill": CallHandler(self.Prefill, "prefill", streaming=False)})

    async def Prefill(self, request, context):
        return _prefill_response(request)

    async def Calls(self, request_iterator, context):
        async with contextlib.aclosing(self.calls.serve(request_iterator, context)) as replies:
            async for message in replies:
                yield message


class _Decode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self) -> None:
        self.calls = MultiplexedServer({"generate": CallHandler(self.Generate, "chunk", streaming=True)})

    async def Generate(self, request, context):
        yield _chunk(request)

    async def Calls(self, request_iterator, context):
        async with contextlib.aclosing(self.calls.serve(request_iterator, context)) as replies:
            async for message in replies:
                yield message


async def _mux_handler(requests, context):
    """One stream's requests, each answered on a task of its own (a worker's requests run concurrently); a batch
    of frames in, frames out as the requests answer: one per message, or all that are queued (`batched`)."""
    out: asyncio.Queue = asyncio.Queue()
    batched = dict(context.invocation_metadata() or ()).get("batched") == "1"
    tasks: set[asyncio.Task] = set()

    async def answer(frame) -> None:
        if frame.HasField("prefill"):
            out.put_nowait(MuxFrame(id=frame.id, prefill_result=_prefill_response(frame.prefill)))
        else:
            out.put_nowait(MuxFrame(id=frame.id, chunk=_chunk(frame.generate)))

    async def read() -> None:
        async for batch in requests:
            for frame in batch.frames:
                t = asyncio.create_task(answer(frame))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        out.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while True:
            frames = [await out.get()]
            while batched and not out.empty():
                frames.append(out.get_nowait())
            if frames[-1] is None:
                frames.pop()
                if frames:
                    yield MuxBatch(frames=frames)
                return
            yield MuxBatch(frames=frames)
    finally:
        reader.cancel()


async def _unary_generate(request, context):
    return _chunk(request)


def _generic_handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("pdspark.bench.Mux", {
        "Stream": grpc.stream_stream_rpc_method_handler(_mux_handler, request_deserializer=MuxBatch.FromString,
                                                        response_serializer=MuxBatch.SerializeToString),
        "GenerateUnary": grpc.unary_unary_rpc_method_handler(
            _unary_generate, request_deserializer=worker_pb2.GenerateRequest.FromString,
            response_serializer=worker_pb2.GenerateChunk.SerializeToString),
    })


async def serve() -> None:
    servers, addresses = [], []
    for servicer, add in ((_Prefill(), worker_pb2_grpc.add_PrefillWorkerServicer_to_server),
                          (_Decode(), worker_pb2_grpc.add_DecodeWorkerServicer_to_server)):
        server = grpc.aio.server(options=SERVER_OPTIONS)
        add(servicer, server)
        server.add_generic_rpc_handlers((_generic_handler(),))
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    print(json.dumps({"prefill": addresses[0], "decode": addresses[1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await asyncio.gather(*(s.stop(0) for s in servers))


# ---- the clients (this process) --------------------------------------------------------------------------------------
def _requests() -> tuple[worker_pb2.PrefillRequest, worker_pb2.GenerateRequest]:
    """One request's two legs, built as the dispatcher builds them (fresh ids, the sampling message)."""
    sampling = convert.sampling_to_pb(SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, seed=7))
    rid, tid = uuid.uuid4().hex, uuid.uuid4().hex
    timeout_ms = convert.timeout_to_ms(TIMEOUT_S)
    return (worker_pb2.PrefillRequest(request_id=rid, transfer_id=tid, prompt_token_ids=PROMPT, sampling=sampling,
                                      timeout_ms=timeout_ms),
            worker_pb2.GenerateRequest(request_id=rid, transfer_id=tid, prompt_token_ids=PROMPT, sampling=sampling,
                                       prefill_address="127.0.0.1:1", timeout_ms=timeout_ms))


class UnaryStream:
    def __init__(self, prefill: str, decode: str):
        self.channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in (prefill, decode)]
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self.channels[0])
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self.channels[1])

    async def one(self) -> None:
        p, g = _requests()
        call = asyncio.ensure_future(self.prefill.Prefill(p, timeout=TIMEOUT_S + 5, metadata=None))
        async for chunk in self.decode.Generate(g, timeout=TIMEOUT_S, metadata=None):
            assert chunk.token_ids
        await call

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels))


class UnaryUnary(UnaryStream):
    def __init__(self, prefill: str, decode: str):
        super().__init__(prefill, decode)
        self.generate = self.channels[1].unary_unary(UNARY_GENERATE,
                                                     request_serializer=worker_pb2.GenerateRequest.SerializeToString,
                                                     response_deserializer=worker_pb2.GenerateChunk.FromString)

    async def one(self) -> None:
        p, g = _requests()
        call = asyncio.ensure_future(self.prefill.Prefill(p, timeout=TIMEOUT_S + 5, metadata=None))
        chunk = await self.generate(g, timeout=TIMEOUT_S, metadata=None)
        assert chunk.token_ids
        await call


class _MuxStream:
    """One bidirectional stream: frames written by a writer task, answers routed by id by a reader task."""

    def __init__(self, channel: grpc.aio.Channel, batched: bool):
        self.batched = batched
        self.call = channel.stream_stream(MUX_STREAM, request_serializer=MuxBatch.SerializeToString,
                                          response_deserializer=MuxBatch.FromString)(
            metadata=(("batched", "1" if batched else "0"),))
        self.out: asyncio.Queue = asyncio.Queue()
        self.waiting: dict[int, asyncio.Queue] = {}
        self.tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    async def _write(self) -> None:
        while True:
            frames = [await self.out.get()]
            while self.batched and not self.out.empty():
                frames.append(self.out.get_nowait())
            await self.call.write(MuxBatch(frames=frames))

    async def _read(self) -> None:
        async for batch in self.call:
            for frame in batch.frames:
                q = self.waiting.get(frame.id)
                if q is not None:
                    q.put_nowait(frame)

    def send(self, frame) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.waiting[frame.id] = q
        self.out.put_nowait(frame)
        return q

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.call.cancel()


class Mux:
    def __init__(self, prefill: str, decode: str, batched: bool = False):
        self.channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in (prefill, decode)]
        self.streams = [_MuxStream(c, batched) for c in self.channels]
        self.ids = itertools.count()

    async def one(self) -> None:
        p, g = _requests()
        n = next(self.ids)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        deadline = loop.call_later(TIMEOUT_S, task.cancel)  # the request's deadline, as the router keeps it
        try:
            pq = self.streams[0].send(MuxFrame(id=n, prefill=p))
            dq = self.streams[1].send(MuxFrame(id=n, generate=g))
            while True:
                frame = await dq.get()
                if frame.chunk.finished:
                    break
            await pq.get()
        finally:
            deadline.cancel()
            del self.streams[0].waiting[n], self.streams[1].waiting[n]

    async def close(self) -> None:
        for s in self.streams:
            await s.close()
        await asyncio.gather(*(c.close() for c in self.channels))


class MuxBatched(Mux):
    def __init__(self, prefill: str, decode: str):
        super().__init__(prefill, decode, batched=True)


class PdsparkMultiplexed:
    """The router's `--worker-calls multiplexed`, called as `PairAttempt.chunks` calls it."""

    def __init__(self, prefill: str, decode: str):
        self.channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in (prefill, decode)]
        self.prefill = MultiplexedClient(self.channels[0], "/pdspark.v1.PrefillWorker/Calls")
        self.decode = MultiplexedClient(self.channels[1], "/pdspark.v1.DecodeWorker/Calls")

    async def one(self) -> None:
        p, g = _requests()
        response = self.prefill.call("prefill", p, TIMEOUT_S + 5).response()
        async for chunk in self.decode.call("generate", g, TIMEOUT_S):
            assert chunk.token_ids
        await response

    async def close(self) -> None:
        await self.prefill.close()
        await self.decode.close()
        await asyncio.gather(*(c.close() for c in self.channels))


class SyncThreads:
    def __init__(self, prefill: str, decode: str):
        self.channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in (prefill, decode)]
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self.channels[0])
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self.channels[1])
        self.pool = ThreadPoolExecutor(32)

    def _generate(self, g) -> int:
        return sum(len(c.token_ids) for c in self.decode.Generate(g, timeout=TIMEOUT_S))

    async def one(self) -> None:
        p, g = _requests()
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        call = self.prefill.Prefill.future(p, timeout=TIMEOUT_S + 5)
        call.add_done_callback(lambda c: loop.call_soon_threadsafe(done.set_result, c))
        assert await loop.run_in_executor(self.pool, self._generate, g)
        (await done).result()

    async def close(self) -> None:
        self.pool.shutdown()
        for c in self.channels:
            c.close()


CLIENTS: dict[str, Callable] = {"unary+stream": UnaryStream, "unary+unary": UnaryUnary, "mux": Mux,
                                "mux-batched": MuxBatched, "pdspark-multiplexed": PdsparkMultiplexed,
                                "sync-threads": SyncThreads}


async def _run(one: Callable[[], Awaitable[None]], requests: int, concurrency: int) -> float:
    """`requests` requests, `concurrency` at a time (workers pulling from one counter); returns seconds."""
    left = iter(range(requests))

    async def worker() -> None:
        for _ in left:
            await one()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def measure(server_pid: int, addresses: dict, variants: list[str], requests: int, rounds: int,
                  concurrency: int) -> dict[str, list[dict]]:
    clients = {v: CLIENTS[v](addresses["prefill"], addresses["decode"]) for v in variants}
    for c in clients.values():
        await _run(c.one, 200, concurrency)  # warm-up: connections, streams
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for n in range(rounds):
        for v in variants:  # alternating: every variant meets the same contention
            c0, s0 = self_cpu_s(), cpu_s(server_pid)
            elapsed = await _run(clients[v].one, requests, concurrency)
            c1, s1 = self_cpu_s(), cpu_s(server_pid)
            runs[v].append({"client_cpu_ms": (c1 - c0) / requests * 1e3, "server_cpu_ms": (s1 - s0) / requests * 1e3,
                            "rps": requests / elapsed})
            print(f"  round {n + 1} {v} c={concurrency}: client {runs[v][-1]['client_cpu_ms']:.3f} ms, server "
                  f"{runs[v][-1]['server_cpu_ms']:.3f} ms, {runs[v][-1]['rps']:.0f} req/s", file=sys.stderr)
    for c in clients.values():
        await c.close()
    return runs


def summary(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    return {v: {k: statistics.median(r[k] for r in rs) for k in ("client_cpu_ms", "server_cpu_ms", "rps")}
            for v, rs in runs.items()}


def table(results: dict[int, dict[str, dict[str, float]]], args) -> list[str]:
    lines = [f"router -> worker RPC CPU per request (prefill leg + 1-token decode leg), instant stub servers in one "
             f"child process, {args.requests} requests per run, medians of {args.rounds} alternating rounds "
             f"(2 shared cores: contended)", "",
             "| concurrency | transport | client CPU ms/req | server CPU ms/req | total | client vs unary+stream "
             "| total vs unary+stream | req/s |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for conc, s in results.items():
        base = s["unary+stream"]
        base_total = base["client_cpu_ms"] + base["server_cpu_ms"]
        for v, r in s.items():
            total = r["client_cpu_ms"] + r["server_cpu_ms"]
            lines.append(f"| {conc} | {v} | {r['client_cpu_ms']:.3f} | {r['server_cpu_ms']:.3f} | {total:.3f} | "
                         f"{base['client_cpu_ms'] / r['client_cpu_ms']:.2f}x | {base_total / total:.2f}x | "
                         f"{r['rps']:.0f} |")
    return lines


def plot(results: dict[int, dict[str, dict[str, float]]], title: str) -> None:
    fig, axes = figure(ncols=len(results), width=5 * len(results))
    axes = axes if len(results) > 1 else [axes]
    for ax, (conc, s) in zip(axes, results.items(), strict=True):
        names = list(s)
        xs = range(len(names))
        ax.bar(xs, [s[v]["client_cpu_ms"] for v in names], 0.6, label="client (router)")
        ax.bar(xs, [s[v]["server_cpu_ms"] for v in names], 0.6, bottom=[s[v]["client_cpu_ms"] for v in names],
               label="server (workers)")
        ax.set_xticks(list(xs), names, fontsize=7, rotation=20)
        ax.set_ylabel("CPU ms per request")
        ax.set_title(f"concurrency {conc}", fontsize=8)
        ax.legend(fontsize=7)
    save_figure(fig, "worker_rpc", title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child: the stub servers
    parser.add_argument("--requests", type=int, default=3000, help="requests per run")
    parser.add_argument("--rounds", type=int, default=5, help="alternating runs of every transport")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 1], help="requests in flight at once")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--no-save", action="store_true", help="print the table only (no JSON/PNG)")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
        return
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        addresses = json.loads(child.stdout.readline())
        results: dict[int, dict[str, dict[str, float]]] = {}
        raw = {}
        for conc in args.concurrency:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # the router's loop
                runs = runner.run(measure(child.pid, addresses, args.variants, args.requests, args.rounds, conc))
            raw[conc] = runs
            results[conc] = summary(runs)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    lines = table(results, args)
    print("\n".join(lines))
    if not args.no_save:
        write_json("worker_rpc", {"args": vars(args), "medians": results, "runs": raw})
        plot(results, textwrap.fill(lines[0], 140))


if __name__ == "__main__":
    main()
