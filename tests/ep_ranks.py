"""Rank programs of expert-parallel tests: each runs in its own spawned process, joins a gloo group over loopback
and puts its results (or its error) on a queue. The parent compares them with one process holding every expert."""

from __future__ import annotations

import io
import os
import time
import traceback

import torch

from helpers import make_llm, prompt_logits
from pdspark import SamplingParams
from pdspark.parallel.rank_group import RankGroup
from pdspark.testing.time_scale import scaled

# Every rank computes on one intra-op thread (as the tests' own process does).
THREADS = 1


def spawn_ranks(size: int, init_method: str, target, *args) -> list:
    """Run `target(rank, size, init_method, *args)` in `size` spawned processes; their results in rank order.
    Raises with a rank's traceback when one fails; every wait is bounded (a rank that hangs is killed)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(results, target, r, size, init_method, *args), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    # Loading the model and running the jobs takes seconds; 300 s rules out only a hung group.
    deadline = time.monotonic() + scaled(300)
    try:
        while len(out) < size:
            try:
                # (A poll period, not a bound: a rank that died is noticed within it.)
                rank, ok, value = results.get(timeout=scaled(1.0))
            except queue.Empty:
                # A rank that died before reporting (it could not even start its target) fails the test now: its
                # peers would wait for it until their group's timeout.
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
                if gone and results.empty():
                    raise AssertionError(f"ranks {gone} exited ({[procs[r].exitcode for r in gone]}) without "
                                         "a result") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(size)) - set(out))} gave no result within "
                                         f"{scaled(300):.0f} s") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=scaled(30))  # a rank that reported exits at once; 30 s rules out a hung exit
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(size)]


def _rank_main(results, target, rank: int, size: int, init_method: str, *args) -> None:
    torch.set_num_threads(THREADS)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        value = target(rank, size, init_method, *args)
        # As bytes: a tensor put on a queue as is travels as a shared-memory handle the parent cannot open once
        # this process has exited.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 (reported to the parent, which fails the test with it)
        results.put((rank, False, traceback.format_exc()))
    # The result is on its way before this process ends, and it ends without running the process group's
    # destructors (a group whose collective failed may abort in them, which would lose an unsent result).
    results.close()
    results.join_thread()
    os._exit(0)


def logits_rank(rank: int, size: int, init_method: str, model: str, prompts: list[list[int]]) -> list:
    """Each rank's engine, driven alike by hand (no lockstep: every rank makes the same calls), gives the
    logits of a prefill of each prompt (the module path)."""
    from types import SimpleNamespace

    from pdspark.engine.factory import create_engine

    group = RankGroup.join(rank, size, init_method, timeout_s=60)
    try:
        engine = create_engine(model, page_size=16, max_model_len=256, ep_size=size, group=group)
        return [prompt_logits(SimpleNamespace(engine=engine), p) for p in prompts]
    finally:
        group.close()


def generate_job(model: str, prompts: list[list[int]], options: dict) -> dict:
    """Greedy and seeded generations with logprobs (prefill, the C decode and verify steps) from `LLM`."""
    with make_llm(model, **options) as llm:
        out: dict = {"decode_step_off": llm.engine.runner.model.decode_step_off}
        for name, params in (("greedy", SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)),
                             ("seeded", SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=64,
                                                       ignore_eos=True, logprobs=2))):
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            out[name] = [(o.token_ids, [(x.logprob, x.top) for x in o.logprobs]) for o in outs]
    return out


def probe_rank(rank: int, size: int, init_method: str) -> dict:
    """Each collective the worker groups use, on gloo: what every rank got back."""
    import torch.distributed as dist

    group = RankGroup.join(rank, size, init_method, timeout_s=30)
    try:
        got: dict = {}
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        got["all_reduce"] = t
        t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
        dist.broadcast(t, src=0)
        got["broadcast"] = t
        out = torch.empty(2 * size)
        dist.all_gather_single(out, torch.full((2,), float(rank)))
        got["all_gather_single"] = out
        out = torch.empty(2)
        dist.reduce_scatter_single(out, torch.arange(2.0 * size) + rank)
        got["reduce_scatter_single"] = out
        # Uneven splits (the dispatch of a MoE step where ranks hold different token counts): rank r sends r + 1
        # + j values to rank j.
        send = [rank + 1 + j for j in range(size)]
        recv = [j + 1 + rank for j in range(size)]
        data = torch.cat([torch.full((n,), float(10 * rank + j)) for j, n in enumerate(send)])
        out = torch.empty(sum(recv))
        dist.all_to_all_single(out, data, output_split_sizes=recv, input_split_sizes=send)
        got["all_to_all_single"] = out
        objs: list = [{"rank": rank}, None] if rank == 0 else [None, None]
        dist.broadcast_object_list(objs, src=0)
        got["broadcast_object_list"] = objs[0]
        if rank == 0:
            dist.send(torch.tensor([42.0]), dst=1)
        elif rank == 1:
            t = torch.zeros(1)
            dist.recv(t, src=0)
            got["send_recv"] = t
        dist.barrier()
        return got
    finally:
        group.close()


def silent_peer_rank(rank: int, size: int, init_method: str, timeout_s: float) -> float:
    """Rank 0 waits in an all-reduce that rank 1 never joins (rank 1 waits for a message rank 0 never sends): the
    seconds until each one's collective raised."""
    import time

    import torch.distributed as dist

    group = RankGroup.join(rank, size, init_method, timeout_s=timeout_s).collectives  # (the steps' group)
    start = time.monotonic()
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(1), group=group)
        else:
            dist.recv(torch.zeros(1), src=0, group=group)
    except RuntimeError:
        return time.monotonic() - start
    # (A group whose collective failed cannot be torn down cleanly; the process exits without closing it.)
    raise AssertionError(f"rank {rank}'s collective returned without its peer")


def write_wide_checkpoint(path, n_experts: int, inter: int) -> int:
    """dsv4-tiny's architecture with `n_experts` routed experts of `inter` rows: every tensor written (experts a
    constant, the rest zeros), one expert at a time, so that writing it never holds the model. Returns the routed
    experts' fp32 bytes."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from pdspark.assets import resolve_model
    from pdspark.model.dsv4 import DSV4Model
    from pdspark.model.model_config import ModelConfig
    from pdspark.model.weights import describe, expected_pieces
    from pdspark.parallel.expert_shard import ExpertShard

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(resolve_model("dsv4-tiny")) / "config.json").read_text())
    config.pop("dspark", None)
    config.update(n_routed_experts=n_experts, moe_intermediate_size=inter)
    (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(path)
    one = DSV4Model(cfg, 64, ExpertShard(0, n_experts, n_experts))  # (holds one expert: the shapes)
    params = dict(one.named_parameters()) | dict(one.named_buffers())
    tensors, expert_bytes = {}, 0
    for piece in sorted(expected_pieces(params, range(n_experts)), key=describe):
        if piece.expert is None:
            tensors[describe(piece)] = piece.view(params[piece.param]).detach().clone()
        else:
            t = torch.full(piece.view(params[piece.param], piece.expert).shape, 0.01)
            tensors[describe(piece)] = t
            expert_bytes += t.numel() * t.element_size()
    save_file(tensors, str(path / "model.safetensors"))
    return expert_bytes


def memory_rank(rank: int, size: int, init_method: str, model: str, one_of: int = 0) -> dict:
    """Resident memory before and after this rank builds its engine, with its parameter bytes. `one_of`: instead,
    a process holding one expert of `one_of` (the non-expert baseline; it runs no step, so it joins no group)."""
    from pdspark.engine.factory import create_engine

    if one_of:
        size, group = one_of, _Unjoined(rank=0, size=one_of, backend="gloo", timeout_s=1.0)
    else:
        group = RankGroup.join(rank, size, init_method, timeout_s=120)
    try:
        before = _settled_rss_bytes()
        engine = create_engine(model, page_size=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64,
                               enable_prefix_cache=False, ep_size=size, group=group)
        after = _settled_rss_bytes()
        named = list(engine.runner.model.named_parameters())
        expert = sum(p.numel() * p.element_size() for n, p in named if n.endswith(("ffn.w13", "ffn.w2")))
        other = sum(p.numel() * p.element_size() for _, p in named) - expert
        pools = sum(t.numel() * t.element_size() for t in vars(engine.kv.pools).values()
                    if isinstance(t, torch.Tensor))
        return {"before": before, "after": after, "expert": expert, "other": other, "pools": pools}
    finally:
        group.close()


def _settled_rss_bytes() -> int:
    """Resident memory once the C allocator has handed back the freed heap it keeps (`malloc_trim`): loading frees
    many expert-sized temporaries, and how much of that heap glibc keeps varied by 0-110 MB from run to run, which
    is noise next to what the memory test rules out (a rank holding the other half: 790 MB)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name is not None else None
    if libc is not None and hasattr(libc, "malloc_trim"):  # (glibc; another C library keeps what it keeps)
        libc.malloc_trim(0)
    return _rss_bytes()


def _rss_bytes() -> int:
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class _Unjoined(RankGroup):
    """A group of one process standing for rank 0 of `size` (memory baselines: it runs no step, so no collective);
    its start-up exchange returns this rank's value for every rank."""

    def all_gather(self, value: object) -> list:
        return [value] * self.size

    def close(self) -> None:
        pass
