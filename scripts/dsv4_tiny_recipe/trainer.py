"""One optimisation step of the target: LM loss plus the lightning indexer's distillation, clipped AdamW on a
warmup-cosine schedule, then the routed-MoE router-bias update."""

from __future__ import annotations

import math

import torch

from .recipe import CSA


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
