"""The target stage: the packed windows it trains on, its phases, the timing probe that sizes the schedule, the
progress lines, the training loop, and the saved model with its record."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .console import hms, log
from .corpus import load_split
from .model import build_target, check_hash_routing, count_params, save_target, weights_dtype
from .recipe import TARGET_ARCH
from .tokenizer import encode_docs, load_tokenizer
from .trainer import Trainer, lr_at, optimizer_record


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
