"""The eval-target stage: held-out bits per byte at two context lengths, and a greedy sample checked against
decoding without the cache."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .console import log
from .corpus import load_split
from .model import check_hash_routing
from .recipe import EOS, PAD, SAMPLE_PROMPT
from .tokenizer import encode_docs, load_tokenizer, token_byte_lengths


@torch.inference_mode()
def heldout_bits_per_byte(model, windows: torch.Tensor, byte_lengths: torch.Tensor, batch: int) -> dict:
    """Sum of next-token NLL (nats) over `windows` / (ln 2 x UTF-8 bytes of the predicted tokens)."""
    nll, n_bytes, n_tokens = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        targets = x[:, 1:]
        nll += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        n_bytes += byte_lengths[targets].sum().item()
        n_tokens += targets.numel()
    return {
        "bits_per_byte": round(nll / (math.log(2) * n_bytes), 4),
        "nats_per_token": round(nll / n_tokens, 4),
        "predicted_tokens": n_tokens,
        "bytes": n_bytes,
    }


@torch.inference_mode()
def greedy_uncached(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by full recomputation, as a cross-check of `generate`'s compressor/KV cache path."""
    out = list(ids)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([out]), use_cache=False).logits
        out.append(int(logits[0, -1].argmax()))
        if out[-1] == EOS:
            break
    return out[len(ids) :]


def greedy_sample(model, tok, prompt: str, max_new_tokens: int) -> dict:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    with torch.inference_mode():
        generated = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=PAD
        )[0, len(ids) :].tolist()
    return {
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "completion": tok.decode(generated, skip_special_tokens=False),
        "cached_matches_uncached": generated == greedy_uncached(model, ids, max_new_tokens),
    }


def run_eval_stage(args, record: dict) -> None:
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(args.threads)
    start = time.time()
    tok = load_tokenizer(args.out)
    model = DeepseekV4ForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    check_hash_routing(model)
    docs = load_split("heldout")
    stream = encode_docs(tok, docs)
    byte_lengths = token_byte_lengths(tok)
    # The per-token byte lengths must add up to the held-out text, or the bits-per-byte denominator is wrong.
    if byte_lengths[stream].sum().item() != sum(len(d.encode()) for d in docs):
        raise RuntimeError("token byte lengths do not add up to the held-out text")
    n_tokens = min(args.eval_tokens, stream.numel())
    log(f"[eval] held-out split: {len(docs)} files, {stream.numel():,} tokens; scoring the first {n_tokens:,}")
    metrics = {}
    for seq_len, batch in ((args.seq_len, args.eval_batch), (args.long_seq_len, 1)):
        windows = stream[: n_tokens // seq_len * seq_len].view(-1, seq_len)
        metrics[f"seq{seq_len}"] = heldout_bits_per_byte(model, windows, byte_lengths, batch)
        log(f"[eval] seq {seq_len}: {metrics[f'seq{seq_len}']}")
    sample = greedy_sample(model, tok, SAMPLE_PROMPT, args.sample_tokens)
    log(
        f"[eval] greedy sample:\n{sample['prompt']}{sample['completion']}\n[eval] cache check: "
        f"{'cached and uncached greedy agree' if sample['cached_matches_uncached'] else 'MISMATCH'}"
    )
    record["eval"] = {
        "heldout_files": len(docs),
        "heldout_tokens": stream.numel(),
        "scored_tokens": n_tokens,
        "bits_per_byte": metrics[f"seq{args.seq_len}"]["bits_per_byte"],
        "by_context": metrics,
        "sample": sample,
        "wall_s": round(time.time() - start, 1),
    }
