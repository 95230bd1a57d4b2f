#!/usr/bin/env python
"""Train the DSpark draft of the shipped `dsv4-tiny` against its frozen target, and measure its acceptance.

Stages run in order (all by default):
  data   target-written training sequences: greedy continuations of train-split prompts by the target (through
         pdspark), plus raw train-split windows; the target's features (mean over mHC streams after each
         `target_layer_ids` layer) and final normed hidden states are captured by pdspark's own forward, so the
         draft trains on exactly the tensors it is fed at inference.
  train  DSpark objective: blocks `[x[a], MASK x (gamma-1)]` at random anchors, context = features of positions
         `a - W .. a - 1` (never the anchor's own), labels `x[a+1 .. a+gamma]`, teacher = target distribution at
         `a .. a+gamma-1`; loss `0.1 CE + 0.9 L1(p_draft, p_target)` with position weights `exp(-j/4)`, Markov
         bias teacher-forced with the ground-truth previous token.
  eval   real greedy speculative decoding on held-out prompts: mean acceptance length (output tokens / verify
         steps) and acceptance per draft position; written to train_log.json and the model card.

    python scripts/train_dspark_draft.py [--out src/pdspark/assets/dsv4-tiny] [--minutes 18]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from dsv4_tiny_recipe.card import write_card  # the target recipe's corpus, tokenizer and record (a sibling package)
from dsv4_tiny_recipe.console import hms, log
from dsv4_tiny_recipe.corpus import load_split
from dsv4_tiny_recipe.recipe import DEFAULT_OUT, MASK
from dsv4_tiny_recipe.record import read_record, write_record
from dsv4_tiny_recipe.tokenizer import encode_docs, load_tokenizer
from safetensors.torch import save_file

from pdspark import LLM, SamplingParams  # noqa: E402
from pdspark.engine.forward_batch import Chunk, build_forward_batch  # noqa: E402
from pdspark.model.dspark import DSparkDraft  # noqa: E402
from pdspark.model.dspark_config import DSparkConfig  # noqa: E402
from pdspark.model.dspark_weights import draft_state_dict  # noqa: E402

DRAFT_FILE = "dspark.safetensors"


@dataclass(frozen=True)
class DraftRecipe:
    gamma: int = 5
    num_stages: int = 2
    target_layer_ids: tuple[int, ...] = (1, 3, 5)
    markov_rank: int = 64
    intermediate_size: int = 384
    prompt_len: int = 64
    gen_len: int = 192
    num_generated: int = 512
    num_raw: int = 256
    anchors_per_seq: int = 24
    batch_size: int = 8
    lr: float = 2e-3
    warmup_frac: float = 0.05
    decay: float = 4.0
    seed: int = 0


# ------------------------------------------------------------------------------------------------------------ data


def train_windows(outdir: Path, recipe: DraftRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic prompt windows and raw windows from the packed train split."""
    tok = load_tokenizer(outdir)
    stream = encode_docs(tok, load_split("train"))
    g = torch.Generator().manual_seed(recipe.seed)
    seq = recipe.prompt_len + recipe.gen_len
    starts = torch.randint(0, len(stream) - seq, (recipe.num_generated + recipe.num_raw,), generator=g)
    prompts = torch.stack([stream[s : s + recipe.prompt_len] for s in starts[: recipe.num_generated]])
    raw = torch.stack([stream[s : s + seq] for s in starts[recipe.num_generated :]])
    return prompts, raw


def build_sequences(llm: LLM, recipe: DraftRecipe, prompts: torch.Tensor, raw: torch.Tensor):
    """Sequences `[N, S]` and loss masks: target continuations (loss on the continuation; half greedy, half
    sampled at temperature 0.8 with a per-sequence seed) and raw code."""
    t0 = time.perf_counter()
    continuations = []
    chunk = 64
    for i in range(0, len(prompts), chunk):
        params = [SamplingParams(temperature=0 if (i + j) % 2 == 0 else 0.8, seed=recipe.seed + i + j,
                                 max_tokens=recipe.gen_len, ignore_eos=True) for j in range(len(prompts[i:i + chunk]))]
        outs = llm.generate(prompt_token_ids=prompts[i : i + chunk].tolist(), sampling_params=params)
        continuations += [o.token_ids for o in outs]
        done = i + len(outs)
        log(f"[draft/data] generated {done}/{len(prompts)} continuations ({time.perf_counter() - t0:.0f}s)")
    gen = torch.cat([prompts, torch.tensor(continuations)], dim=1)
    seqs = torch.cat([gen, raw])
    mask = torch.ones_like(seqs, dtype=torch.bool)
    mask[: len(gen), : recipe.prompt_len] = False  # generated sequences: learn the target's continuation
    return seqs, mask


@torch.inference_mode()
def capture_target(llm: LLM, seqs: torch.Tensor, layer_ids: tuple[int, ...], batch: int = 8):
    """pdspark's own target forward over every sequence: features `[N, S, D*L]`, final normed hidden `[N, S, D]`."""
    engine = llm.engine
    model, kv = engine.runner.model, engine.kv
    feats, finals = [], []
    t0 = time.perf_counter()
    for i in range(0, len(seqs), batch):
        rows = seqs[i : i + batch]
        pages = [kv.open() for _ in range(len(rows))]
        for p in pages:
            kv.grow(p, rows.shape[1])
        fb = build_forward_batch([Chunk(p.slot, 0, r.tolist(), num_logits=0) for p, r in zip(pages, rows)], kv)
        out = model(fb, kv.pools, layer_ids)
        for p in pages:
            kv.close(p)
        S = rows.shape[1]
        feats.append(out.features.view(len(rows), S, -1).to(torch.bfloat16))
        finals.append(model.norm(model.hc_head(out.hidden)).view(len(rows), S, -1).to(torch.bfloat16))
        if (i // batch) % 20 == 0:
            log(f"[draft/data] target features {i + len(rows)}/{len(seqs)} ({time.perf_counter() - t0:.0f}s)")
    return torch.cat(feats), torch.cat(finals)


# ----------------------------------------------------------------------------------------------------------- train


def make_draft(llm: LLM, recipe: DraftRecipe) -> DSparkDraft:
    target = llm.engine.runner.model
    dcfg = DSparkConfig(
        num_stages=recipe.num_stages,
        target_layer_ids=recipe.target_layer_ids,
        gamma=recipe.gamma,
        mask_token_id=MASK,
        markov_rank=recipe.markov_rank,
        intermediate_size=recipe.intermediate_size,
    )
    dcfg.check_target(target.cfg)
    draft = DSparkDraft(target.cfg, dcfg, max_len=4096)
    g = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(("norm.weight", "scale")):
                p.fill_(1.0)
            elif name.endswith(("base", "attn_sink")):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    draft.bind_target(target.embed, target.head)
    return draft


def sample_anchors(mask: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """`[B, n]` anchors per sequence among positions whose own and next token carry loss (redrawn every step)."""
    ok = mask[:, :-1] & mask[:, 1:]
    keys = torch.rand(ok.shape, generator=g).masked_fill(~ok, 2.0)
    return keys.topk(n, dim=1, largest=False).indices.sort(dim=1).values


def draft_loss(draft: DSparkDraft, head: torch.Tensor, seqs, mask, feats, finals, anchors, decay: float):
    """The DSpark objective for one batch; returns `(loss, stats)`."""
    B, S = seqs.shape
    G, W = draft.dcfg.gamma, draft.cfg.sliding_window
    positions = torch.arange(S).repeat(B)
    ctx = draft.context_kv(feats.reshape(B * S, -1).float(), positions).view(len(draft.stages), B, S, -1)
    a = anchors  # [B, N]
    N = a.shape[1]
    ctx_pos = a[..., None] - W + torch.arange(W)  # [B, N, W]: the W positions before the anchor
    valid = ctx_pos >= 0
    b_idx = torch.arange(B)[:, None, None]
    ctx_kv = ctx[:, b_idx, ctx_pos.clamp(min=0)].reshape(len(draft.stages), B * N, W, -1)
    anchor_tok = seqs.gather(1, a)
    h = draft.block_hidden(anchor_tok.flatten(), a.flatten(), ctx_kv, valid.reshape(B * N, W))
    j = torch.arange(G)
    tgt_pos = a[..., None] + j  # [B, N, G]: row j is at a+j and predicts a+j+1
    in_range = tgt_pos + 1 < S
    lbl_pos = (tgt_pos + 1).clamp(max=S - 1)
    labels = seqs[torch.arange(B)[:, None, None], lbl_pos]
    ok = (in_range & mask[torch.arange(B)[:, None, None], lbl_pos]).float().cumprod(dim=-1)
    prev = seqs[torch.arange(B)[:, None, None], tgt_pos.clamp(max=S - 1)]  # ground truth x[a+j]
    logits = draft.base_logits(h).view(B, N, G, -1) + draft.markov_bias(prev)
    with torch.no_grad():
        teacher_h = finals[torch.arange(B)[:, None, None], tgt_pos.clamp(max=S - 1)].float()
        p_t = F.linear(teacher_h, head).float().softmax(-1)
    w = torch.exp(-j.float() / decay) * ok
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(B, N, G)
    p_d = logits.softmax(-1)
    tv = (p_d - p_t).abs().sum(-1)
    denom = w.sum().clamp(min=1e-6)
    loss = (0.1 * (w * ce).sum() + 0.9 * (w * tv).sum()) / denom
    with torch.no_grad():
        accept_j = ((1 - tv / 2) * ok).sum((0, 1)) / ok.sum((0, 1)).clamp(min=1)
        tau = 1 + torch.cumprod(accept_j, 0).sum()
    return loss, {"ce": float((w * ce).sum() / denom), "tv": float((w * tv).sum() / denom), "tau_prob": float(tau),
                  "accept_prob": [round(float(x), 3) for x in accept_j]}


def train(draft: DSparkDraft, head: torch.Tensor, seqs, mask, feats, finals, recipe: DraftRecipe, steps: int):
    params = [p for n, p in draft.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(recipe.seed + 1)
    warmup = max(1, int(recipe.warmup_frac * steps))
    t0, stats = time.perf_counter(), {}
    for step in range(steps):
        lr = recipe.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(seqs), (recipe.batch_size,), generator=g)
        anchors = sample_anchors(mask[idx], recipe.anchors_per_seq, g)
        loss, stats = draft_loss(draft, head, seqs[idx], mask[idx], feats[idx], finals[idx], anchors, recipe.decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            el = time.perf_counter() - t0
            eta = el / (step + 1) * (steps - step - 1)
            log(f"[draft/train] step {step + 1}/{steps} loss {float(loss):.4f} ce {stats['ce']:.3f} "
                f"tv {stats['tv']:.3f} tau_prob {stats['tau_prob']:.2f} lr {lr:.2e} "
                f"elapsed {hms(el)} eta {hms(eta)}")
    return {"final_loss": float(loss), **stats, "steps": steps, "seconds": time.perf_counter() - t0}


def probe_steps(draft, head, seqs, mask, feats, finals, recipe: DraftRecipe, minutes: float) -> int:
    """Steps that fit in `minutes`, from the time of a few real (discarded) steps on a copy of the draft."""
    import copy

    probe = copy.deepcopy(draft)
    probe.bind_target(*draft.vocab)
    t0 = time.perf_counter()
    train(probe, head, seqs, mask, feats, finals, recipe, steps=4)
    per_step = (time.perf_counter() - t0) / 4
    return max(10, int(minutes * 60 / per_step))


# ------------------------------------------------------------------------------------------------------------ save


def save_draft(outdir: Path, draft: DSparkDraft) -> None:
    cfg = json.loads((outdir / "config.json").read_text())
    cfg["dspark"] = draft.dcfg.to_dict()
    (outdir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: v.to(torch.bfloat16) for k, v in draft_state_dict(draft).items()}
    save_file(tensors, outdir / DRAFT_FILE, metadata={"format": "pt"})
    (outdir / DRAFT_FILE).chmod(0o644)  # package data must be readable by every user


# ------------------------------------------------------------------------------------------------------------ eval


def heldout_prompts(outdir: Path, n: int, length: int, seed: int) -> list[list[int]]:
    tok = load_tokenizer(outdir)
    stream = encode_docs(tok, load_split("heldout"))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length, (n,), generator=g)
    return [stream[s : s + length].tolist() for s in starts]


def evaluate(outdir: Path, n_prompts: int = 16, prompt_len: int = 128, max_tokens: int = 128) -> dict:
    """Greedy speculative decoding on held-out prompts, one request at a time (batch 1)."""
    llm = LLM(str(outdir), speculative="dspark", max_model_len=1024, max_num_seqs=4)
    prompts = heldout_prompts(outdir, n_prompts, prompt_len, seed=123)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompts]
    stats = llm.engine.spec
    # The first token of each request comes from prefill, not from a verify step.
    verified = sum(len(o.token_ids) - 1 for o in outs)
    return {
        "prompts": n_prompts,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "verify_steps": stats.verify_steps,
        "mean_acceptance_length": verified / max(stats.verify_steps, 1),
        "acceptance_per_position": [round(c / max(stats.verify_steps, 1), 3) for c in stats.accepted_per_position],
    }


# ------------------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--minutes", type=float, default=18.0, help="training budget (sets --steps by a probe)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--stage", choices=["all", "eval", "heldout"], default="all",
                        help="heldout: print --prompts held-out prompts of --prompt-len tokens (JSON) and stop")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=123)
    args = parser.parse_args()
    if args.stage == "heldout":
        print(json.dumps(heldout_prompts(args.out, args.prompts, args.prompt_len, args.seed)))
        return
    torch.set_num_threads(2)
    torch.manual_seed(0)
    record = read_record(args.out)
    if args.stage == "all":
        recipe = DraftRecipe()
        t0 = time.perf_counter()
        llm = LLM(str(args.out), max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048,
                  enable_prefix_cache=False)
        prompts, raw = train_windows(args.out, recipe)
        seqs, mask = build_sequences(llm, recipe, prompts, raw)
        feats, finals = capture_target(llm, seqs, recipe.target_layer_ids)
        data_s = time.perf_counter() - t0
        draft = make_draft(llm, recipe)
        head = llm.engine.runner.model.head
        steps = args.steps or probe_steps(draft, head, seqs, mask, feats, finals, recipe, args.minutes)
        log(f"[draft/train] {steps} steps (reproduce with --steps {steps})")
        result = train(draft, head, seqs, mask, feats, finals, recipe, steps)
        save_draft(args.out, draft)
        params = sum(p.numel() for p in draft.parameters())
        record["draft"] = {"recipe": asdict(recipe), "data_seconds": data_s, "parameters": params, **result}
    record.setdefault("draft", {})["eval"] = evaluate(args.out)
    log(f"[draft/eval] {json.dumps(record['draft']['eval'])}")
    write_record(args.out, record)
    write_card(args.out, record)


if __name__ == "__main__":
    main()
