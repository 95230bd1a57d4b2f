"""DSV4 mixture of experts: hash-routed (`tid2eid`) or score-routed top-k experts plus one shared expert.

Routing weights are the router scores of the chosen experts, renormalised and multiplied by
`routed_scaling_factor`; a score-routed layer picks experts by `score + e_score_correction_bias`.

One combine order everywhere (every path here, the C kernels, and expert-parallel groups): each token's expert
outputs are kept per top-k slot `[T, k, D]`, multiplied by their weights and summed in slot order, then the shared
expert's output is added. With expert parallelism (`ExpertShard`) a rank computes the slots of the experts it holds
and an exchange fills in the others before that sum, so a group gives one process's bits: a `SlotExchange` where
every rank runs the same tokens, a `TokenExchange` where each rank runs its own (DP-attention).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.compact_experts import CompactExperts
from pdspark.model.model_config import ModelConfig
from pdspark.parallel.expert_shard import ExpertShard
from pdspark.parallel.slot_exchange import SlotExchange, exchange_errors
from pdspark.parallel.token_exchange import TokenExchange
from pdspark.quant.fused_linear import FusedLinear
from pdspark.quant.quant_experts import QuantExperts
from pdspark.quant.quant_linear import linear

# Up to this many (token, expert) pairs, a loop over the pairs beats grouping tokens by expert.
_PAIR_LOOP_MAX = 8
# Models with few experts: for small multi-token steps (verify windows, small decode batches), running every
# expert on every token as one batched matmul pair beats grouping. The waste is n_experts / top_k times the
# routed work, so this applies only where that ratio is small, and only up to this many token x expert rows
# (measured on dsv4-tiny, 8 experts top-2: 2-32 tokens ~1.5-2.5x faster than the other paths).
_DENSE_MAX_WASTE = 4
_DENSE_MAX_ROWS = 256


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU-gated unit with DSV4's clamps: gate clipped from above, up clipped on both sides."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Routing(NamedTuple):
    """Where each token goes: its top-k experts and their weights (renormalised, times the scaling factor)."""

    expert_ids: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]


class SharedExpert(nn.Module):
    mm = staticmethod(F.linear)  # the float matmul (`DSV4Model.prepare_inference`: batch-invariant mode)

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(inter, hidden))  # gate
        self.w3 = nn.Parameter(torch.zeros(inter, hidden))  # up
        self.w2 = nn.Parameter(torch.zeros(hidden, inter))  # down
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(swiglu(linear(x, self.w1, self.mm), linear(x, self.w3, self.mm), self.limit), self.w2, self.mm)


class MoE(nn.Module):
    mm = staticmethod(F.linear)  # the float matmul (`DSV4Model.prepare_inference`: batch-invariant mode)

    def __init__(self, cfg: ModelConfig, is_hash: bool, shard: ExpertShard | None = None):
        super().__init__()
        d, inter, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        self.shard = shard if shard is not None else ExpertShard.whole(n_exp)  # the routed experts held here
        self.exchange: SlotExchange | TokenExchange | None = None  # expert parallelism: set with `use_exchange`
        self.is_hash = is_hash
        self.top_k = cfg.num_experts_per_tok
        self.n_experts = n_exp
        self.scaling = cfg.routed_scaling_factor
        self.limit = cfg.swiglu_limit
        self.scoring_func = cfg.scoring_func
        self.gate = nn.Parameter(torch.zeros(n_exp, d))  # router weight
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(n_exp))  # e_score_correction_bias (selection only)
        # Experts stored stacked: one gate+up matmul and one down matmul per expert; only the shard's experts
        # (expert e at index e - shard.first).
        held = self.shard.count
        self.w13 = nn.Parameter(torch.zeros(held, 2 * inter, d))  # [E_held, gate rows ; up rows, D]
        self.w2 = nn.Parameter(torch.zeros(held, d, inter))  # [E_held, D, I]
        self.shared = SharedExpert(d, inter, cfg.swiglu_limit)
        # Quantized checkpoints: the routed experts as int8 (ModelSlim) or as the released checkpoint stores them
        # (MXFP4/FP8, `CompactExperts`); the loader installs them and drops w13/w2.
        self.experts: QuantExperts | CompactExperts | None = None
        self.act_dtype = torch.float32  # the activations' dtype (the model's, set by `DSV4Model.prepare_inference`)
        # Laid out by `fuse` (inference only), once the weights are final; None until then.
        self.fused_in: FusedLinear | None = None  # the router and the shared expert's gate/up: one matmul
        self.c_decode: tuple[torch.Tensor, torch.Tensor] | None = None  # the C decode's fused input and shared down
        self._expert_w13: list[torch.Tensor] | None = None  # per-expert views: an expert is a list lookup
        self._expert_w2: list[torch.Tensor] | None = None
        self._dense_w13: torch.Tensor | None = None  # [E * 2I, D]: few experts, every one on every token
        self._dense_w2t: torch.Tensor | None = None  # [E, I, D]

    def use_exchange(self, exchange: SlotExchange | TokenExchange) -> None:
        """Expert parallelism: the other ranks' slots come through `exchange` (the shard holds part of the experts).
        A `SlotExchange`: every rank runs the same tokens through this layer, in step; a `TokenExchange`: each rank
        its own tokens (the one-call C form, which exchanges slots only, is then off)."""
        if isinstance(self.experts, QuantExperts):
            raise NotImplementedError("expert parallelism with quantized (ModelSlim) experts")
        self.exchange = exchange
        if isinstance(exchange, TokenExchange):
            self.c_decode = None

    def join_exchange(self) -> None:
        """DP-attention: join the other ranks' exchange at this layer with no tokens of this rank's own."""
        assert isinstance(self.exchange, TokenExchange)
        D = self.gate.shape[1]
        self.exchange.experts(torch.empty(0, D, dtype=self.act_dtype), torch.empty(0, self.top_k, dtype=torch.long),
                              self._held_slots)

    def fuse(self, stack: bool = True) -> None:
        """Inference only: the router and the shared expert's gate/up read the same input: one matmul. `stack`
        False (compact weights): no stacked or transposed copies of any weight."""
        self.fused_in = FusedLinear([self.gate, self.shared.w1, self.shared.w3], stack)
        if self.experts is not None:
            return
        # Float router, shared expert and experts: a decode token's whole MoE is one matmul and one C call.
        (_, w_in), *rest = self.fused_in.groups
        w2s = self.shared.w2
        self.c_decode = (w_in.detach(), w2s.detach()) if not rest and isinstance(w_in, torch.Tensor) and isinstance(
            w2s, torch.Tensor) and not isinstance(self.exchange, TokenExchange) else None
        # Per-expert views in Python lists: picking an expert is then a list lookup, not a tensor op.
        self._expert_w13 = list(self.w13.detach().unbind(0))
        self._expert_w2 = list(self.w2.detach().unbind(0))
        if stack and self.n_experts <= _DENSE_MAX_WASTE * self.top_k:
            E, I2, D = self.w13.shape  # (E: the held experts)
            self._dense_w13 = self.w13.detach().reshape(E * I2, D)  # [E * 2I, D] (a view)
            self._dense_w2t = self.w2.detach().transpose(1, 2).contiguous()  # [E, I, D]

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> Routing:
        """The experts each token of `x [T, D]` goes to."""
        return self._route_logits(linear(x, self.gate, self.mm), input_ids)

    def _route_logits(self, logits: torch.Tensor, input_ids: torch.Tensor) -> Routing:
        # Spelled with exp/log1p (as the C kernels' `route_token`), not F.softplus/torch.sigmoid: those run a row's
        # last `numel % vector width` elements through scalar libm, whose bits differ from the vector body's, so a
        # token's scores would depend on where its row falls in the batch (the last tokens of a step take the tail).
        # exp and log1p give every element the same bits wherever it sits.
        if self.scoring_func == "sqrtsoftplus":
            scores = torch.where(logits > 20.0, logits, torch.log1p(torch.exp(logits))).sqrt()
        else:
            scores = 1.0 / (1.0 + torch.exp(-logits))
        if self.is_hash:
            ids = self.get_buffer("tid2eid")[input_ids]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(ids, weights * self.scaling)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        fused = self.fused_in if not torch.is_grad_enabled() else None
        c_decode = self.c_decode if fused is not None else None
        if c_decode is not None and x.shape[0] * self.top_k <= _PAIR_LOOP_MAX and (
                x.shape[0] == 1 or self._dense_w13 is None):
            out = self._decode_in_c(x, input_ids, *c_decode)
            if out is not None:
                return out
        if fused is not None:
            logits, gate, up = fused(x)
            shared = linear(swiglu(gate, up, self.limit), self.shared.w2, self.mm)
            ids, weights = self._route_logits(logits, input_ids)
        else:
            shared = self.shared(x)
            ids, weights = self.route(x, input_ids)
        if isinstance(self.exchange, TokenExchange):
            slots = self.exchange.experts(x, ids, self._held_slots)
        else:
            slots = self._held_slots(x, ids)
            if self.exchange is not None:
                self.exchange.combine(slots)  # the other ranks' slots filled in
        return (self.combine(slots, weights) + shared).to(x.dtype)

    def _held_slots(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens `x [T, D]` routed to `ids [T, k]` -> their (token, slot) outputs `[T, k, D]` from the experts
        held here (zeros for the others), by the path that suits the step's size."""
        T = x.shape[0]
        if self.experts is not None:
            return self.experts(x, ids, partial(swiglu, limit=self.limit))
        if (self.fused_in is not None and not torch.is_grad_enabled() and self._dense_w13 is not None and T > 1
                and T * self.n_experts <= _DENSE_MAX_ROWS):
            return self._slots_dense(x, ids)
        if ids.numel() <= _PAIR_LOOP_MAX:
            return self._slots_by_pair(x, ids)
        return self._slots_by_expert(x, ids)

    def combine(self, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every slot's output `[T, k, D]` -> the routed term `[T, D]`: each slot times its weight, summed in slot
        order (as the C kernels' `moe_decode`)."""
        slots, w = slots.float(), weights.float()  # (fp32 models: no-ops; others sum in fp32 as the kernels do)
        out = slots[:, 0] * w[:, 0:1]
        for j in range(1, slots.shape[1]):
            out = out + slots[:, j] * w[:, j : j + 1]
        return out

    def _decode_in_c(self, x: torch.Tensor, input_ids: torch.Tensor, w_in: torch.Tensor,
                     w2s: torch.Tensor) -> torch.Tensor | None:
        """The pair loop's arithmetic (routing, routed experts in slot order, then the shared expert) as one C call
        after the fused router + shared gate/up matmul; None where the C path does not apply. With expert
        parallelism, the form that keeps each (token, slot) output and exchanges them (the same bits)."""
        ex = self.exchange
        assert not isinstance(ex, TokenExchange), "a DP-attention layer has no C form (`use_exchange`)"
        with exchange_errors(ex):
            return cpu_kernels.moe_decode(
                x, self.mm(x, w_in), input_ids, self.get_buffer("tid2eid") if self.is_hash else None,
                None if self.is_hash else self.bias, self.w13, self.w2, w2s, self.top_k,
                self.scoring_func == "sqrtsoftplus", self.scaling, self.limit,
                held=None if ex is None else (self.shard.first, self.shard.count),
                exchange=0 if ex is None else ex.c_pointer,
            )

    def _slots_by_pair(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Few (token, expert) pairs (decode): run each pair against its expert's weights in place -> `[T, k, D]`."""
        w13: list[torch.Tensor] | torch.Tensor = self.w13
        w2: list[torch.Tensor] | torch.Tensor = self.w2
        if self._expert_w13 is not None and self._expert_w2 is not None and not torch.is_grad_enabled():
            w13, w2 = self._expert_w13, self._expert_w2
        first, held = self.shard.first, self.shard.count
        zero = torch.zeros(1, x.shape[1], dtype=x.dtype)
        rows: list[torch.Tensor] = []
        for t, experts in enumerate(ids.tolist()):
            xt = x[t : t + 1]
            for e in experts:
                if not 0 <= e - first < held:
                    rows.append(zero)
                    continue
                gate, up = self.mm(xt, w13[e - first]).chunk(2, dim=-1)
                rows.append(self.mm(swiglu(gate, up, self.limit), w2[e - first]))
        return torch.cat(rows).view(ids.shape[0], ids.shape[1], x.shape[1])

    def _slots_dense(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every held expert on every token, then each slot's row picked -> `[T, k, D]` (the work of unrouted
        pairs is wasted: worth it only where experts are few, see `_DENSE_MAX_WASTE`)."""
        T, k = ids.shape
        assert self._dense_w13 is not None and self._dense_w2t is not None, "fuse() lays them out"
        held, inter = self._dense_w2t.shape[0], self._dense_w2t.shape[1]
        h = self.mm(x, self._dense_w13).view(T, held, 2 * inter)
        act = swiglu(h[..., :inter], h[..., inter:], self.limit)  # [T, E_held, I]
        y = torch.bmm(act.transpose(0, 1), self._dense_w2t)  # [E_held, T, D]
        first = self.shard.first
        local = (ids - first).clamp(0, held - 1)  # (rows of others' slots are zeroed below)
        slots = y[local, torch.arange(T)[:, None]]  # [T, k, D]
        if self.shard.is_whole:
            return slots
        return slots * ((ids >= first) & (ids < first + held))[..., None]  # experts held elsewhere: zero

    def _slots_by_expert(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Many pairs (prefill, large batches): one matmul pair per held expert over the tokens routed to it ->
        `[T, k, D]`."""
        T, k = ids.shape
        slots = torch.zeros(T * k, x.shape[1], dtype=x.dtype)
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.n_experts).tolist()
        first, held = self.shard.first, self.shard.count
        start = 0
        for e, n in enumerate(counts):
            if n == 0 or not 0 <= e - first < held:
                start += n
                continue
            pairs = order[start : start + n]  # token * k + slot
            gate, up = self.mm(x[pairs // k], self.w13[e - first]).chunk(2, dim=-1)
            slots.index_copy_(0, pairs, self.mm(swiglu(gate, up, self.limit), self.w2[e - first]).to(x.dtype))
            start += n
        return slots.view(T, k, x.shape[1])
