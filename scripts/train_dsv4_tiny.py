#!/usr/bin/env python
"""Train the shipped `dsv4-tiny` checkpoint: a byte-level BPE tokenizer and a small DeepSeek-V4 target model.

Stages (`--stage`):
  tokenizer    train the BPE tokenizer on the train split; write tokenizer.json and tokenizer_config.json
  target       train `DeepseekV4ForCausalLM` on the packed train split; save it with `save_pretrained`
  eval-target  held-out bits per byte, a greedy sample, the model card
  all          tokenizer, target, eval-target
The speculative draft is trained later by a separate stage; the model card keeps a line for it.

Corpus: the running interpreter's standard library (`*.py`, site-/dist-packages excluded), split into train and
held-out by a hash of each file's relative path. Everything is seeded. `--steps` pins the schedule; without it a
short timing probe picks the step count from `--target-minutes`, and the choice is printed and written to
`train_log.json`, so a run is reproduced with `--steps N`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "src" / "pdspark" / "assets" / "dsv4-tiny"
LOG_FILE = "train_log.json"

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS, EOS, PAD, MASK = 0, 1, 2, 3
VOCAB_SIZE = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HELDOUT_MODULUS = 20  # a file is held out iff sha256(relpath) % 20 == 0, about 5%
SIZE_BUDGET = 15_000_000  # bytes for the whole asset directory; the draft gets the rest of 25 MB later
SAMPLE_PROMPT = "def fibonacci(n):"

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = [SLIDING, CSA, HCA, CSA, HCA, CSA]
TARGET_ARCH = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 192,
    "num_hidden_layers": len(LAYER_TYPES),
    "layer_types": LAYER_TYPES,
    "compress_rates": {CSA: 4, HCA: 128},
    "sliding_window": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 16 / 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    # 512-token windows hold 128 CSA entries and 2048-token ones 512, so top-64 is a real selection.
    "index_topk": 64,
    "mlp_layer_types": ["hash_moe"] + ["moe"] * (len(LAYER_TYPES) - 1),
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "max_position_embeddings": 4096,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "num_nextn_predict_layers": 0,  # no MTP/draft weights in the target checkpoint
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# ---------------------------------------------------------------------------------------------------------- corpus


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative posix path, path) of every stdlib `*.py` file outside site-/dist-packages, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if path.is_file() and not {"site-packages", "dist-packages"} & set(rel.parts):
            files.append((rel.as_posix(), path))
    return sorted(files)


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def load_split(split: str) -> list[str]:
    """Whole files of one split ("train" or "heldout"), in relative-path order."""
    want_heldout = split == "heldout"
    return [
        path.read_text(encoding="utf-8", errors="replace")
        for rel, path in stdlib_files()
        if is_heldout(rel) == want_heldout
    ]


# ------------------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),  # the trainer gives them ids 0..7 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, no <unk>
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    check_tokenizer(tok)
    return tok


def check_tokenizer(tok) -> None:
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:
            raise RuntimeError(f"{token} has id {tok.token_to_id(token)}, expected {expected_id}")


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS],
        "eos_token": SPECIAL_TOKENS[EOS],
        "pad_token": SPECIAL_TOKENS[PAD],
        "mask_token": SPECIAL_TOKENS[MASK],
        "additional_special_tokens": list(SPECIAL_TOKENS[4:]),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TARGET_ARCH["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def load_tokenizer(outdir: Path):
    from tokenizers import Tokenizer

    path = outdir / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `--stage tokenizer` first")
    tok = Tokenizer.from_file(str(path))
    check_tokenizer(tok)
    return tok


def encode_docs(tok, docs: list[str]) -> torch.Tensor:
    """One int64 stream: each document's tokens followed by <|eos|>.

    Special-token text inside a source file is encoded as plain bytes, so the only special id in the data is the
    <|eos|> we add; in particular <|mask|>, reserved for the speculative drafter, never occurs.
    """
    tok.encode_special_tokens = True
    try:
        encodings = tok.encode_batch(docs, add_special_tokens=False)
    finally:
        tok.encode_special_tokens = False
    stream = torch.cat([torch.tensor([*enc.ids, EOS], dtype=torch.int64) for enc in encodings])
    stray = (stream < len(SPECIAL_TOKENS)) & (stream != EOS)
    if stray.any():
        raise RuntimeError(f"special token ids {sorted(set(stream[stray].tolist()))} leaked into the data")
    return stream


def token_byte_lengths(tok) -> torch.Tensor:
    """UTF-8 bytes each id decodes to. A byte-level token spells one byte per character; special tokens are 0."""
    lengths = torch.zeros(VOCAB_SIZE, dtype=torch.int64)
    for token, idx in tok.get_vocab().items():
        if idx >= len(SPECIAL_TOKENS):
            lengths[idx] = len(token)
    return lengths


def run_tokenizer_stage(args, record: dict) -> None:
    start = time.time()
    docs = load_split("train")
    log(f"[tokenizer] training byte-level BPE (vocab {VOCAB_SIZE}) on {len(docs)} train files")
    tok = train_tokenizer(docs)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    sha = hashlib.sha256((args.out / "tokenizer.json").read_bytes()).hexdigest()
    record["tokenizer"] = {
        "type": "byte-level BPE (HF tokenizers), ByteLevel pre-tokenizer add_prefix_space=False, ByteLevel decoder",
        "vocab_size": VOCAB_SIZE,
        "special_tokens": {token: i for i, token in enumerate(SPECIAL_TOKENS)},
        "min_frequency": 2,
        "tokenizer_json_sha256": sha,
        "wall_s": round(time.time() - start, 1),
    }
    log(f"[tokenizer] done in {hms(time.time() - start)}, tokenizer.json sha256 {sha[:16]}")


# ----------------------------------------------------------------------------------------------------------- model


def build_target(seed: int):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**TARGET_ARCH))
    init_hash_routing(model, seed)
    return model


def init_hash_routing(model, seed: int) -> None:
    """transformers initialises `tid2eid` to zeros (real tables come from checkpoints), which would send every token
    to expert 0 twice. Give each token `num_experts_per_tok` distinct experts from a seeded table; it is a buffer, so
    the optimizer never touches it."""
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            gate = layer.mlp.gate
            table = torch.rand(gate.tid2eid.shape[0], gate.num_experts, generator=gen).argsort(dim=-1)
            gate.tid2eid.copy_(table[:, : gate.top_k])


def check_hash_routing(model) -> None:
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            table = layer.mlp.gate.tid2eid
            if (table.sort(dim=-1).values.diff(dim=-1) == 0).any():
                raise RuntimeError("tid2eid routes some token to the same expert twice (zero-initialised table?)")


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    inactive = expert * (cfg.n_routed_experts - cfg.num_experts_per_tok) // cfg.n_routed_experts
    return {"total": total, "routed_experts": expert, "active_per_token": total - inactive}


# ----------------------------------------------------------------------------------------------- training helpers


class RouterBalancer:
    """DeepSeek's auxiliary-loss-free load balancing for the learned (`moe`) routers.

    transformers keeps `e_score_correction_bias` as a zero buffer; in DeepSeek training it is nudged after every step
    towards under-loaded experts. The bias only changes which experts are picked, not their weights.
    """

    def __init__(self, model, rate: float):
        self.rate = rate
        self.loads: dict = {}
        routers = [layer.mlp.gate for layer in model.model.layers if not layer.mlp.is_hash]
        self.handles = [router.register_forward_hook(self._record) for router in routers]

    def _record(self, router, inputs, output) -> None:
        indices = output[2]
        load = torch.bincount(indices.flatten(), minlength=router.num_experts)
        self.loads[router] = self.loads.get(router, 0) + load

    @torch.no_grad()
    def update(self) -> float:
        """Apply one bias step; returns the worst max/mean expert load of this step (1.0 = perfectly balanced)."""
        worst = 1.0
        for router, load in self.loads.items():
            load = load.float()
            router.e_score_correction_bias.add_(self.rate * torch.sign(load.mean() - load))
            worst = max(worst, (load.max() / load.mean()).item())
        self.loads.clear()
        return worst

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class IndexerDistiller:
    """Trains the lightning indexer of every CSA layer.

    The indexer's top-k is not differentiable, so the LM loss never reaches its weights. As in DeepSeek's sparse
    attention training, fit it to the main attention instead: per query, KL(main attention mass over the selected
    compressed entries || softmax of the indexer scores over the same entries). The indexer's inputs are detached, so
    this loss trains the indexer alone and the LM loss trains everything else.
    """

    def __init__(self, model):
        self.records: dict[int, dict] = {}
        self.handles = []
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.layer_type != CSA:
                continue
            record = self.records.setdefault(attn.layer_idx, {})
            indexer = attn.compressor.indexer
            self.handles += [
                indexer.register_forward_pre_hook(lambda _m, args: (args[0].detach(), args[1].detach(), *args[2:])),
                indexer.scorer.register_forward_hook(_store(record, "scores", lambda out: out)),
                attn.compressor.register_forward_hook(_store(record, "selected", lambda out: out[1][:, 0] == 0)),
                attn.register_forward_hook(_store(record, "attn", lambda out: out[1].detach())),
            ]

    def loss(self) -> torch.Tensor:
        losses = [_indexer_kl(**record) for record in self.records.values()]
        for record in self.records.values():
            record.clear()
        return torch.stack(losses).mean()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _store(record: dict, key: str, pick):
    def hook(_module, _inputs, output):
        record[key] = pick(output)

    return hook


def _indexer_kl(scores: torch.Tensor, selected: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """scores, selected: [B, S, T] over the T compressed entries; attn: [B, H, S, window + T] attention weights."""
    n_entries = scores.shape[-1]
    target = attn[..., -n_entries:].sum(dim=1).float()  # head-summed attention mass on the compressed entries
    rows = selected.any(dim=-1)  # the earliest queries see no compressed entry yet
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    # Rows without any selected entry keep all logits finite so log_softmax (and its backward) stays NaN-free.
    logits = scores.masked_fill(~selected & rows.unsqueeze(-1), float("-inf"))
    log_q = logits.log_softmax(dim=-1)
    kl = torch.special.xlogy(target, target) - torch.where(selected, target * log_q, 0.0)
    return kl.sum(dim=-1)[rows].mean()


class PackedBatches:
    """Non-overlapping `seq_len` windows of the token stream in a seeded random order, `batch` windows per call."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch: int, seed: int):
        n = stream.numel() // seq_len
        self.windows = stream[: n * seq_len].view(n, seq_len)
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self.batch = batch
        self.cursor = 0
        self.epochs = 0

    def next(self) -> torch.Tensor:
        if self.cursor + self.batch > len(self.order):
            self.cursor, self.epochs = 0, self.epochs + 1
        idx = self.order[self.cursor : self.cursor + self.batch]
        self.cursor += self.batch
        return self.windows[idx]


@dataclass
class Phase:
    name: str
    seq_len: int
    batch: int
    steps: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch


def make_optimizer(model, args) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only. `position_bias` is 2-D but is an additive bias, so it is spared."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.ndim >= 2 and "position_bias" not in name else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, total: int, args) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak at the last step."""
    warmup = max(1, round(args.warmup_frac * total))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup - 1)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """One optimisation step = LM loss + indexer distillation, clipped AdamW, then the router-bias update."""

    def __init__(self, model, args):
        self.model = model
        self.args = args
        self.optimizer = make_optimizer(model, args)
        self.distiller = IndexerDistiller(model)
        self.balancer = RouterBalancer(model, args.router_bias_rate)
        model.train()

    def step(self, batch: torch.Tensor, lr: float) -> dict:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        lm_loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        index_loss = self.distiller.loss()
        (lm_loss + self.args.indexer_loss_weight * index_loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        imbalance = self.balancer.update()
        return {"loss": lm_loss.item(), "index_kl": index_loss.item(), "grad_norm": grad_norm.item(), "imb": imbalance}

    def close(self) -> None:
        self.distiller.close()
        self.balancer.close()


# ---------------------------------------------------------------------------------------------------------- target


def make_phases(args) -> list[Phase]:
    """Mostly 512-token windows; a final phase of long windows so HCA (one entry per 128 tokens) and long-range
    positions get trained too."""
    return [Phase("main", args.seq_len, args.batch_size), Phase("long", args.long_seq_len, args.long_batch_size)]


def probe_step_seconds(stream: torch.Tensor, phases: list[Phase], args) -> dict[str, float]:
    """Median seconds of a training step per phase shape, measured on a throwaway model."""
    model = build_target(args.seed + 1000)
    trainer = Trainer(model, args)
    seconds = {}
    for phase in phases:
        batches = PackedBatches(stream, phase.seq_len, phase.batch, args.seed + 1000)
        times = []
        for _ in range(args.probe_steps + 1):  # the first step warms up allocators and is dropped
            start = time.time()
            trainer.step(batches.next(), lr=0.0)
            times.append(time.time() - start)
        seconds[phase.name] = statistics.median(times[1:])
        log(f"[target] probe: {phase.name} step ({phase.batch}x{phase.seq_len}) takes {seconds[phase.name]:.2f}s")
    trainer.close()
    return seconds


def plan_steps(phases: list[Phase], args, probe: dict[str, float] | None) -> None:
    """Split the total step count between the phases; with a probe, pick the total that fits `--target-minutes`."""
    main, long = phases
    total = args.steps
    if total is None:
        per_step = (1 - args.long_frac) * probe["main"] + args.long_frac * probe["long"]
        total = max(10, int(args.target_minutes * 60 / per_step))
    long.steps = round(args.long_frac * total)
    main.steps = total - long.steps


class Progress:
    """Step / loss / throughput / ETA lines on stderr. The ETA weighs remaining steps by the probed (or, with
    `--steps`, assumed) per-phase step cost."""

    def __init__(self, phases: list[Phase], probe: dict[str, float] | None, every: int):
        cost = probe or {"main": 1.0, "long": 2.5}
        self.cost = [cost[p.name] for p in phases for _ in range(p.steps)]
        self.total_cost = sum(self.cost)
        self.every = every
        self.start = time.time()
        self.window: list[dict] = []
        self.tokens = 0

    def update(self, step: int, phase: Phase, lr: float, stats: dict) -> dict | None:
        self.window.append(stats)
        self.tokens += phase.tokens_per_step
        last = step + 1 == len(self.cost)
        if (step + 1) % self.every and not last:
            return None
        elapsed = time.time() - self.start
        done = sum(self.cost[: step + 1])
        eta = elapsed / done * (self.total_cost - done)
        mean = {k: statistics.fmean(s[k] for s in self.window) for k in stats}
        log(
            f"[target] step {step + 1}/{len(self.cost)} {phase.name} {phase.batch}x{phase.seq_len} "
            f"loss {mean['loss']:.4f} idx-kl {mean['index_kl']:.3f} gnorm {mean['grad_norm']:.2f} "
            f"moe-imb {mean['imb']:.2f} lr {lr:.2e} {self.tokens / elapsed:.0f} tok/s "
            f"elapsed {hms(elapsed)} ETA {hms(eta)}"
        )
        self.window.clear()
        return {"step": step + 1, "phase": phase.name, "lr": lr, **{k: round(v, 5) for k, v in mean.items()}}


def train_target(model, stream: torch.Tensor, phases: list[Phase], args, probe) -> dict:
    trainer = Trainer(model, args)
    total = sum(p.steps for p in phases)
    progress = Progress(phases, probe, args.log_every)
    curve, phase_losses, step = [], {}, 0
    for offset, phase in enumerate(phases):
        batches = PackedBatches(stream, phase.seq_len, phase.batch, args.seed + offset)
        losses = []
        for _ in range(phase.steps):
            lr = lr_at(step, total, args)
            stats = trainer.step(batches.next(), lr)
            losses.append(stats["loss"])
            point = progress.update(step, phase, lr, stats)
            if point:
                curve.append(point)
            step += 1
        tail = losses[-args.final_loss_window :]
        phase_losses[phase.name] = round(statistics.fmean(tail), 4) if tail else None
    trainer.close()
    model.eval()
    return {"curve": curve, "final_loss_by_phase": phase_losses, "train_tokens": progress.tokens}


def save_target(model, outdir: Path, dtype: torch.dtype) -> None:
    """`save_pretrained` in `dtype`, except the modules DSV4 keeps in fp32 (norms, mHC, sinks, compressor position
    bias, router bias): transformers upcasts them on load anyway, so storing them rounded would only lose accuracy."""
    keep_fp32 = set(model._keep_in_fp32_modules_strict)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not keep_fp32 & set(name.split(".")):
                tensor.data = tensor.data.to(dtype)
    model.save_pretrained(outdir)
    # safetensors writes the file owner-only; package data must be readable by whoever installs pdspark.
    (outdir / "model.safetensors").chmod(0o644)


def weights_dtype(model, outdir: Path) -> torch.dtype:
    """fp32 when the whole directory fits the size budget that way, else bf16."""
    fp32_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    other = sum(f.stat().st_size for f in outdir.iterdir() if f.name.startswith("tokenizer"))
    return torch.float32 if fp32_bytes + other + 100_000 <= SIZE_BUDGET else torch.bfloat16


def run_target_stage(args, record: dict) -> None:
    torch.set_num_threads(args.threads)
    start = time.time()
    tok = load_tokenizer(args.out)
    stream = encode_docs(tok, load_split("train"))
    log(f"[target] train split: {stream.numel():,} tokens (encoded in {hms(time.time() - start)})")
    phases = make_phases(args)
    probe = None if args.steps is not None else probe_step_seconds(stream, phases, args)
    plan_steps(phases, args, probe)
    total = sum(p.steps for p in phases)
    log(f"[target] schedule: {total} steps = " + " + ".join(f"{p.steps} x {p.batch}x{p.seq_len}" for p in phases))
    log(f"[target] reproduce with: --steps {total}")

    model = build_target(args.seed)
    params = count_params(model)
    log(f"[target] {params['total']:,} parameters ({params['active_per_token']:,} active per token)")
    train_start = time.time()
    result = train_target(model, stream, phases, args, probe)
    train_wall = time.time() - train_start
    check_hash_routing(model)

    dtype = weights_dtype(model, args.out)
    save_target(model, args.out, dtype)
    record["target"] = {
        "config": TARGET_ARCH,
        "parameters": params,
        "weights_dtype": str(dtype).removeprefix("torch."),
        "seed": args.seed,
        "steps": total,
        "phases": [asdict(p) for p in phases],
        "probe_step_seconds": probe,
        "target_minutes": None if args.steps is not None else args.target_minutes,
        "optimizer": optimizer_record(args),
        "train_split_tokens": stream.numel(),
        "train_tokens_seen": result["train_tokens"],
        "final_train_loss": result["final_loss_by_phase"],
        "final_loss_window": args.final_loss_window,
        "loss_curve": result["curve"],
        "train_wall_s": round(train_wall, 1),
        "stage_wall_s": round(time.time() - start, 1),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    log(f"[target] saved {dtype} weights to {args.out}; training took {hms(train_wall)}")


def optimizer_record(args) -> dict:
    return {
        "name": "AdamW",
        "lr": args.lr,
        "betas": [0.9, 0.95],
        "weight_decay": args.weight_decay,
        "warmup_frac": args.warmup_frac,
        "schedule": f"linear warmup, cosine decay to {args.min_lr_ratio} x peak",
        "grad_clip": args.grad_clip,
        "indexer_loss_weight": args.indexer_loss_weight,
        "router_bias_rate": args.router_bias_rate,
        "precision": "fp32",
    }


# ------------------------------------------------------------------------------------------------------------ eval


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


# ------------------------------------------------------------------------------------------------- log and card


def read_record(outdir: Path) -> dict:
    path = outdir / LOG_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_record(outdir: Path, record: dict) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / LOG_FILE).write_text(json.dumps(record, indent=2) + "\n")


def corpus_record() -> dict:
    files = stdlib_files()
    heldout = sum(is_heldout(rel) for rel, _ in files)
    return {
        "source": f"Python {sys.version.split()[0]} standard library: {sysconfig.get_paths()['stdlib']}",
        "files": len(files),
        "train_files": len(files) - heldout,
        "heldout_files": heldout,
        "rule": "all *.py recursively, excluding site-packages/dist-packages; sorted by relative path; "
        f"held out iff int(sha256(relpath).hexdigest(), 16) % {HELDOUT_MODULUS} == 0; "
        'whole files read as UTF-8 with errors="replace"',
        "packing": "documents joined with <|eos|> (each file followed by <|eos|>), cut into fixed-length windows",
    }


def file_sizes(outdir: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(outdir.iterdir()) if f.is_file() and f.name != "README.md"}


def write_card(outdir: Path, record: dict) -> None:
    """README.md from the recorded run. Rendered twice so the total it states includes the card itself."""
    sizes = file_sizes(outdir)
    card = render_card(record, sizes, total=0)
    for _ in range(2):
        card = render_card(record, sizes, total=sum(sizes.values()) + len(card.encode()))
    (outdir / "README.md").write_text(card)


def render_card(record: dict, sizes: dict[str, int], total: int) -> str:
    target = record.get("target", {})
    reproduce = "python scripts/train_dsv4_tiny.py --stage all" + (f" --steps {target['steps']}" if target else "")
    sections = [
        ["# dsv4-tiny", "", *INTRO, "", f"Reproduce: `{reproduce}`"],
        ["## Config", "", *config_lines(target)],
        ["## Corpus", "", *[f"- {k}: {v}" for k, v in record.get("corpus", {}).items()]],
        ["## Tokenizer", "", *tokenizer_lines(record.get("tokenizer", {}))],
        ["## Training", "", *training_lines(target), *all_stage_lines(record)],
        ["## Evaluation", "", *eval_lines(record.get("eval", {}))],
        ["## Size", "", *size_lines(target, sizes, total)],
        ["## DSpark draft", "", *draft_lines(record.get("draft", {}))],
    ]
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


INTRO = [
    "A tiny DeepSeek-V4 model (transformers `DeepseekV4ForCausalLM`) trained from scratch on CPU on the Python",
    "standard library, shipped as pdspark's default model. Every V4 mechanism is present: sliding-window",
    "attention, CSA (compressed sparse attention with the lightning indexer), HCA (heavily compressed",
    "attention), mHC hyper-connections, hash-routed and learned-routed MoE with sqrtsoftplus scoring.",
    "It writes Python-looking text; it is a test fixture, not a useful model.",
]


def config_lines(target: dict) -> list[str]:
    cfg = target.get("config", TARGET_ARCH)
    return [
        *[f"- `{k}`: {json.dumps(v)}" for k, v in cfg.items()],
        "- `tid2eid` (hash routing): seeded random table, distinct experts per token, frozen",
    ]


def tokenizer_lines(tok: dict) -> list[str]:
    return [
        f"- {tok.get('type', 'byte-level BPE')}; vocab {VOCAB_SIZE}, trained on the train split only",
        f"- special tokens (ids 0-7): {', '.join(f'`{t}`' for t in SPECIAL_TOKENS)}; no post-processor",
        "- `<|mask|>` is reserved for the speculative drafter and never occurs in the training data",
        "- chat template: `" + json.dumps(CHAT_TEMPLATE) + "`",
    ]


def draft_lines(draft: dict) -> list[str]:
    """The speculative drafter's recipe and measured acceptance (written by scripts/train_dspark_draft.py)."""
    if not draft:
        return ["DSpark draft: (to be added)"]
    r = draft.get("recipe", {})
    ev = draft.get("eval", {})
    lines = [
        f"- reproduce: `python scripts/train_dspark_draft.py --steps {draft.get('steps')}` (after the target)",
        f"- {r.get('num_stages')} sliding-window DSV4 stages (mHC, dense SwiGLU of {r.get('intermediate_size')}), "
        f"features after target layers {r.get('target_layer_ids')}, gamma {r.get('gamma')}, Markov rank "
        f"{r.get('markov_rank')}, mask token `<|mask|>`; shares the target's embedding and LM head; "
        f"{draft.get('parameters', 0):,} parameters (`dspark.safetensors`, `mtp.*` names, bf16)",
        f"- data: {r.get('num_generated')} target continuations ({r.get('gen_len')} tokens after "
        f"{r.get('prompt_len')}-token train-split prompts; half greedy, half sampled at 0.8) + {r.get('num_raw')} raw "
        f"train-split windows; target features captured by pdspark's own forward ({draft.get('data_seconds', 0):.0f}s)",
        f"- objective: 0.1 CE + 0.9 L1 to the target distribution, position weights exp(-j/{r.get('decay')}), "
        f"{r.get('anchors_per_seq')} anchors per sequence, batch {r.get('batch_size')}, AdamW lr {r.get('lr')}, "
        f"cosine; {draft.get('steps')} steps in {hms(draft.get('seconds', 0))}; final loss "
        f"{draft.get('final_loss', 0):.4f}, teacher-forced expected acceptance length {draft.get('tau_prob', 0):.2f}",
    ]
    if ev:
        per_pos = ", ".join(f"{x:.2f}" for x in ev.get("acceptance_per_position", []))
        lines += [
            f"- measured (greedy speculative decoding, {ev.get('prompts')} held-out prompts of "
            f"{ev.get('prompt_len')} tokens, {ev.get('max_tokens')} new tokens each, batch 1): mean acceptance length "
            f"**{ev.get('mean_acceptance_length', 0):.2f}** tokens per verify step over {ev.get('verify_steps')} "
            f"steps; acceptance by draft position: {per_pos}",
        ]
    if "bench" in draft:
        lines.append(f"- {draft['bench']}")
    return lines


def all_stage_lines(record: dict) -> list[str]:
    if "all_wall_s" not in record:
        return []
    return [f"- `--stage all` wall time (tokenizer + target + eval): {hms(record['all_wall_s'])}"]


def size_lines(target: dict, sizes: dict[str, int], total: int) -> list[str]:
    lines = []
    if target:
        params = target["parameters"]
        lines += [
            f"- parameters: {params['total']:,} total, {params['active_per_token']:,} active per token",
            f"- weights dtype: {target['weights_dtype']} (norms, mHC, sinks, position biases and router bias: fp32)",
        ]
    lines += [f"- `{name}`: {size:,} bytes" for name, size in sizes.items()]
    return [*lines, f"- asset directory total (with this card): {total:,} bytes (budget {SIZE_BUDGET:,})"]


def training_lines(target: dict) -> list[str]:
    if not target:
        return ["(not yet trained)"]
    opt = target["optimizer"]
    phases = ", ".join(
        f"{p['name']}: {p['steps']} steps x {p['batch']} x {p['seq_len']} tokens" for p in target["phases"]
    )
    return [
        f"- steps: {target['steps']} ({phases}); {target['train_tokens_seen']:,} tokens seen of "
        f"{target['train_split_tokens']:,} in the train split",
        f"- AdamW lr {opt['lr']}, betas {opt['betas']}, weight decay {opt['weight_decay']} on matrices, "
        f"{opt['schedule']}, warmup {opt['warmup_frac']:.0%}, grad clip {opt['grad_clip']}, fp32 on CPU, "
        f"{target['threads']} threads, seed {target['seed']}",
        f"- lightning indexer trained by KL to the main attention (weight {opt['indexer_loss_weight']}); "
        f"routed-MoE router bias updated loss-free at rate {opt['router_bias_rate']}",
        f"- final train loss (nats/token, mean of the last {target['final_loss_window']} steps of each phase): "
        + ", ".join(f"{k} {v}" for k, v in target["final_train_loss"].items()),
        f"- wall time: {hms(target['train_wall_s'])} training, {hms(target['stage_wall_s'])} for the stage",
    ]


def eval_lines(ev: dict) -> list[str]:
    if not ev:
        return ["(not yet evaluated)"]
    lines = [
        f"- held-out bits per byte: **{ev['bits_per_byte']}** (first {ev['scored_tokens']:,} held-out tokens, "
        "windows of 512; NLL in nats / (ln 2 x UTF-8 bytes of the predicted tokens))",
    ]
    lines += [
        f"- windows of {name.removeprefix('seq')}: {m['bits_per_byte']} bits/byte, {m['nats_per_token']} nats/token "
        f"over {m['predicted_tokens']:,} predicted tokens ({m['bytes']:,} bytes)"
        for name, m in ev["by_context"].items()
    ]
    sample = ev["sample"]
    lines += [
        f"- greedy sample ({sample['max_new_tokens']} new tokens; cached and uncached decoding agree: "
        f"{sample['cached_matches_uncached']}):",
        "",
        "```python",
        sample["prompt"] + sample["completion"],
        "```",
    ]
    return lines


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True, choices=("tokenizer", "target", "eval-target", "all"))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="asset directory (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="total target steps; skips the timing probe")
    p.add_argument("--target-minutes", type=float, default=32.0, help="target training-loop budget for the probe")
    p.add_argument("--probe-steps", type=int, default=5, help="timed probe steps per phase (after one warmup)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--long-seq-len", type=int, default=2048)
    p.add_argument("--long-batch-size", type=int, default=1)
    p.add_argument("--long-frac", type=float, default=0.1, help="fraction of the steps in the long phase (at the end)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-frac", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--indexer-loss-weight", type=float, default=1.0)
    p.add_argument("--router-bias-rate", type=float, default=1e-2, help="DeepSeek uses 1e-3 over far more steps")
    p.add_argument("--final-loss-window", type=int, default=20)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=204_800)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--sample-tokens", type=int, default=64)
    return p.parse_args(argv)


STAGES = {"tokenizer": run_tokenizer_stage, "target": run_target_stage, "eval-target": run_eval_stage}
# A rerun stage invalidates what later stages recorded (a new tokenizer means a new model, and so on).
STALE_AFTER = {"tokenizer": ("target", "eval", "draft"), "target": ("eval", "draft"), "eval-target": ()}


def main(argv=None) -> None:
    args = parse_args(argv)
    names = list(STAGES) if args.stage == "all" else [args.stage]
    start = time.time()
    record = read_record(args.out)
    record["corpus"] = corpus_record()
    for name in names:
        for key in STALE_AFTER[name]:
            record.pop(key, None)
        STAGES[name](args, record)
        write_record(args.out, record)
        write_card(args.out, record)
    if args.stage == "all":
        record["all_wall_s"] = round(time.time() - start, 1)
        write_record(args.out, record)
        write_card(args.out, record)
    log(f"[{args.stage}] finished in {hms(time.time() - start)}; outputs in {args.out}")


if __name__ == "__main__":
    main()
