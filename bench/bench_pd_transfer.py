"""Prefill -> decode cache transfer over Mooncake (TCP, loopback) vs a raw loopback TCP copy, the share of TTFT
spent in the transfer, and P/D TTFT vs a colocated engine's, for 512- and 2,048-token prompts.

One run starts a prefill and a decode worker (separate processes), sends requests with the router's dual
dispatch, and reads each transfer's bytes, writes and seconds from the prefill worker's result: the whole transfer
(planning the writes, the writes, the source checksum computed meanwhile, thread hops) and the seconds inside the
transfer engine's write calls alone. The raw copy moves the same number of bytes between two processes over a
loopback socket (recv_into a preallocated buffer), with as much idle time before each copy as the transfers have
(a TTFT: Mooncake's TCP transport is several times slower after idle than back to back, a socket is not), and back
to back; bare Mooncake writes of the same bytes are measured both ways too. The colocated engine (`colocated.py`,
one process, the same engine options and one torch thread like each worker) gets the same prompts, interleaved
request by request with the P/D pair so that both see the same load on a shared machine. What P/D adds to a
prompt's compute is also reported on its own: the TTFT less the prefill worker's prefill seconds (from queuing
the prompt in its engine to its first token), i.e. the legs' hops, the plan, the transfer and the first token's
way out; it moves far less from one request to the next than the prefill itself.

    python bench/bench_pd_transfer.py [--model dsv4-tiny] [--lengths 512,2048] [--requests 6]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
import uuid

from pdspark import SamplingParams
from pdspark.llm import resolve_model
from pdspark.model.model_config import ModelConfig
from pdspark.rpc import convert
from pdspark.testing.services import start_worker  # (worker processes started and stopped by PID)
from pdspark.v1 import worker_pb2, worker_pb2_grpc

import grpc
import torch
from colocated import ColocatedWorker
from report import figure, paired_bars, save_figure, write_json


def _receiver(port_q: mp.Queue, nbytes: int, rounds: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        conn.sendall(b"k")  # ack: the copy is complete on the receiving side


def raw_tcp_gbps(nbytes: int, rounds: int = 5, gap_s: float = 0.0) -> float:
    """Median GB/s of moving `nbytes` between two processes over a loopback socket, `gap_s` idle before each
    round (0: back to back)."""
    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=_receiver, args=(q, nbytes, rounds + 1))
    proc.start()
    sock = socket.create_connection(("127.0.0.1", q.get(timeout=10)))
    payload = bytes(nbytes)
    rates = []
    for i in range(rounds + 1):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        sock.sendall(payload)
        sock.recv(1)
        if i:  # the first round warms the connection up
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    sock.close()
    proc.join(10)
    return statistics.median(rates)


def _mooncake_peer(q: mp.Queue, done: mp.Queue, nbytes: int) -> None:
    import numpy as np
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(nbytes, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, buf.nbytes) == 0
    q.put((f"127.0.0.1:{te.get_rpc_port()}", buf.ctypes.data))
    done.get(timeout=600)


def mooncake_floor_gbps(nbytes: int, entries: tuple[int, ...], rounds: int = 12,
                        gap_s: float = 0.0) -> dict[int, float]:
    """Median GB/s of bare Mooncake batch writes of `nbytes` split into n equal entries, between two fresh
    processes (no pools, no checksum), `gap_s` idle before each (0: back to back): what the transfer engine itself
    does for a payload this size."""
    import numpy as np
    from mooncake.engine import TransferEngine

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_mooncake_peer, args=(q, done, nbytes))
    proc.start()
    try:
        session, dst = q.get(timeout=60)
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = np.ones(nbytes, dtype=np.uint8)
        assert te.register_memory(src.ctypes.data, src.nbytes) == 0
        out = {}
        for n in entries:
            size = nbytes // n
            srcs = [src.ctypes.data + i * size for i in range(n)]
            dsts = [dst + i * size for i in range(n)]
            times = []
            for _ in range(rounds + 1):
                time.sleep(gap_s)
                t0 = time.perf_counter()
                assert te.batch_transfer_sync_write(session, srcs, dsts, [size] * n) == 0
                times.append(time.perf_counter() - t0)
            out[n] = size * n / statistics.median(times[1:]) / 1e9  # the first round connects
        return out
    finally:
        done.put(None)
        proc.join(10)


def dual_dispatch(p_stub, d_stub, prefill_addr: str, prompt: list[int], params: SamplingParams) -> dict:
    tid, rid = uuid.uuid4().hex, uuid.uuid4().hex
    timeout_ms = 120_000  # relative: each worker times it from receipt
    sampling = convert.sampling_to_pb(params)
    out: dict = {}
    t0 = time.perf_counter()

    def prefill() -> None:
        req = worker_pb2.PrefillRequest(request_id=rid, transfer_id=tid, prompt_token_ids=prompt, sampling=sampling,
                                        timeout_ms=timeout_ms)
        out["result"] = p_stub.Prefill(req, timeout=150).result

    thread = threading.Thread(target=prefill)
    thread.start()
    req = worker_pb2.GenerateRequest(request_id=rid, transfer_id=tid, prompt_token_ids=prompt, sampling=sampling,
                                     prefill_address=prefill_addr, timeout_ms=timeout_ms)
    for _ in d_stub.Generate(req, timeout=150):
        out.setdefault("ttft", time.perf_counter() - t0)
    thread.join(150)
    return out


def colocated_ttft(worker: ColocatedWorker, prompt: list[int], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    ttft = None
    for event in worker.generate(uuid.uuid4().hex, prompt, params):
        ttft = ttft if ttft is not None else event.at - t0
    assert ttft is not None
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--requests", type=int, default=6, help="requests per prompt length (medians)")
    args = parser.parse_args()
    path = resolve_model(args.model)
    vocab = ModelConfig.from_dir(path).vocab_size
    lengths = [int(x) for x in args.lengths.split(",")]
    common = ["--max-model-len", str(max(lengths) + 64), "--max-num-seqs", "4", "--max-num-batched-tokens", "2048",
              "--no-prefix-cache"]
    options = dict(max_model_len=max(lengths) + 64, max_num_seqs=4, max_num_batched_tokens=2048,
                   enable_prefix_cache=False)
    print("starting workers...", file=sys.stderr, flush=True)
    prefill = start_worker("prefill", path, *common)
    decode = start_worker("decode", path, *common)
    colocated = ColocatedWorker(str(path), options, threads=1)
    try:
        p_stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(prefill.address))
        d_stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(decode.address))
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        warm = torch.randint(8, vocab, (64,)).tolist()
        dual_dispatch(p_stub, d_stub, prefill.address, warm, params)  # warm-up
        colocated_ttft(colocated, warm, params)
        rows = []
        for length in lengths:
            runs = []
            for i in range(args.requests):
                prompt = torch.randint(8, vocab, (length,), generator=g).tolist()
                r = dual_dispatch(p_stub, d_stub, prefill.address, prompt, params)
                s = r["result"].stats
                runs.append({"ttft": r["ttft"], "bytes": s.bytes, "transfer_s": s.transfer_s, "write_s": s.write_s,
                             "writes": s.num_writes,
                             "prefill_s": s.prefill_s, "colocated_ttft": colocated_ttft(colocated, prompt, params)})
                print(f"  prompt {length}: request {i + 1}/{args.requests} TTFT {r['ttft'] * 1e3:.0f} ms "
                      f"(colocated {runs[-1]['colocated_ttft'] * 1e3:.0f} ms), transfer {s.bytes / 1e6:.2f} MB "
                      f"in {s.num_writes} writes, {s.transfer_s * 1e3:.2f} ms (writes {s.write_s * 1e3:.2f} ms); "
                      f"prefill {s.prefill_s * 1e3:.0f} ms, plan wait {s.plan_wait_s * 1e3:.0f} ms",
                      file=sys.stderr, flush=True)
            nbytes = int(statistics.median(x["bytes"] for x in runs))
            mooncake = statistics.median(x["bytes"] / x["transfer_s"] / 1e9 for x in runs)
            engine = statistics.median(x["bytes"] / x["write_s"] / 1e9 for x in runs)
            ttft = statistics.median(x["ttft"] for x in runs)
            writes = int(statistics.median(x["writes"] for x in runs))
            # The workers' transfers come one per request, a TTFT apart, not back to back: both floors are also
            # measured with that much idle time before each copy (Mooncake's TCP transport is much slower after
            # idle than back to back; a plain socket barely changes).
            gap = min(1.0, max(0.05, ttft))
            print(f"  floors: raw TCP and bare Mooncake, back to back and {gap * 1e3:.0f} ms apart...",
                  file=sys.stderr, flush=True)
            raw = raw_tcp_gbps(nbytes, rounds=8, gap_s=gap)
            raw_hot = raw_tcp_gbps(nbytes)
            floor = mooncake_floor_gbps(nbytes, (1, writes, 43))
            floor_idle = mooncake_floor_gbps(nbytes, (1, writes), rounds=8, gap_s=gap)
            share = statistics.median(x["transfer_s"] / x["ttft"] for x in runs)
            rows.append({"prompt_len": length, "bytes": nbytes, "writes": writes, "mooncake_gbps": mooncake,
                         "gap_s": gap, "raw_tcp_gbps": raw, "raw_tcp_back_to_back_gbps": raw_hot,
                         "ratio": mooncake / raw, "write_gbps": engine, "write_ratio": engine / raw,
                         "bare_mooncake_gbps_by_entries": floor, "bare_mooncake_spaced_gbps_by_entries": floor_idle,
                         "bare_mooncake_spaced_ratio": floor_idle[1] / raw,
                         "write_ms": statistics.median(x["write_s"] for x in runs) * 1e3,
                         "ttft_ms": ttft * 1e3, "transfer_ms": statistics.median(x["transfer_s"] for x in runs) * 1e3,
                         "transfer_share": share,
                         "colocated_ttft_ms": statistics.median(x["colocated_ttft"] for x in runs) * 1e3,
                         # what P/D adds to the prompt's compute: the legs' hops, the plan, the transfer
                         "beyond_prefill_ms": statistics.median(x["ttft"] - x["prefill_s"] for x in runs) * 1e3,
                         "ttft_vs_colocated": statistics.median(x["ttft"] / x["colocated_ttft"] for x in runs)})
    finally:
        colocated.stop()
        decode.stop()
        prefill.stop()
    lines = [
        f"model {args.model}: prefill and decode workers on loopback, Mooncake TCP, {args.requests} requests per "
        "length (medians)",
        "",
        "| prompt | bytes moved | writes | transfer GB/s (all of it) | Mooncake write GB/s | raw TCP GB/s (same bytes; "
        "spaced as the requests, back to back) | ratio: transfer / raw, write / raw | bare Mooncake, 1 entry, spaced: "
        "GB/s, / raw | transfer ms | transfer share of TTFT | P/D TTFT ms | of which beyond the prefill ms | "
        "colocated TTFT ms | P/D / colocated |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['prompt_len']} | {r['bytes'] / 1e6:.2f} MB | {r['writes']} | {r['mooncake_gbps']:.2f} | "
                     f"{r['write_gbps']:.2f} | {r['raw_tcp_gbps']:.2f}, {r['raw_tcp_back_to_back_gbps']:.2f} | "
                     f"{r['ratio']:.2f}, {r['write_ratio']:.2f} | "
                     f"{r['bare_mooncake_spaced_gbps_by_entries'][1]:.2f}, {r['bare_mooncake_spaced_ratio']:.2f} | "
                     f"{r['transfer_ms']:.2f} | "
                     f"{r['transfer_share']:.1%} | {r['ttft_ms']:.0f} | {r['beyond_prefill_ms']:.1f} | "
                     f"{r['colocated_ttft_ms']:.0f} | "
                     f"{r['ttft_vs_colocated']:.2f} |")
    for key, how in (("bare_mooncake_gbps_by_entries", "back to back"),
                     ("bare_mooncake_spaced_gbps_by_entries", "spaced as the requests")):
        lines += ["", f"Bare Mooncake batch writes of the same bytes between two fresh processes, {how} (GB/s, by "
                  "entries per batch): " + "; ".join(f"{r['prompt_len']} tokens: " + ", ".join(
                      f"{n} -> {g:.2f}" for n, g in r[key].items()) for r in rows)]
    print("\n".join(lines))
    write_json("pd_transfer", {"args": vars(args), "rows": rows})
    fig, (a1, a2) = figure(ncols=2, width=10)
    labels = [f"{r['prompt_len']} tokens" for r in rows]
    paired_bars(a1, labels, [r["write_gbps"] for r in rows], [r["raw_tcp_gbps"] for r in rows],
                ("Mooncake TCP writes", "raw loopback socket, spaced as the requests"), "GB/s")
    paired_bars(a2, labels, [r["ttft_ms"] for r in rows], [r["colocated_ttft_ms"] for r in rows],
                ("P/D (prefill + transfer + decode)", "colocated engine"), "TTFT (ms)")
    save_figure(fig, "pd_transfer", lines[0])


if __name__ == "__main__":
    main()
