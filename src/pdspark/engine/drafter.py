"""`DSparkDrafter`: proposes draft tokens for verify steps and keeps the draft's context (injected features).

The drafter owns its context rows end to end: the engine hands it every committed row, to write now (`inject`) or
later (`keep`: a decode step without drafts, see `draft_backlog`), and calls `flush` where rows must be in the pool
before something outside the drafter reads or writes them (a finish or abort: the pages may be shipped; a transfer
reservation: the transfer writes its pages). Its own reads and writes put the kept rows first: `inject` writes them
before the new rows, `propose` before it reads the context.

A sampled draft is the race of the draft's q by its position's SAMPLE noise, the noise the target samples that position
with (coupled verification, see `spec_verifier`): the verifier needs the draft tokens only, not q.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdspark.cache.kv_cache import KVCache
from pdspark.engine.draft_backlog import DraftBacklog
from pdspark.engine.fast_path_fallbacks import FastPathFallbacks
from pdspark.engine.random_stream import RandomStream, exponentials, race
from pdspark.engine.request import Request
from pdspark.engine.sampler import filter_logits
from pdspark.model.cpu.draft_step import DraftStep
from pdspark.model.dspark import DSparkDraft

# Memory for cached Markov bias rows (fp32, one `[vocab]` row per previous token): 2,048 rows at dsv4-tiny's 4,096.
_MARKOV_CACHE_BYTES = 32 << 20


@dataclass(frozen=True)
class DraftProposal:
    tokens: list[int]  # d_1 .. d_g


class DSparkDrafter:
    def __init__(self, draft: DSparkDraft, kv: KVCache, fallbacks: FastPathFallbacks | None = None):
        self.draft = draft
        self.kv = kv
        self.gamma = draft.dcfg.gamma
        W = draft.cfg.sliding_window
        self._ctx_offsets = np.arange(-W, 0)  # context rows a - W .. a - 1
        # Markov bias rows `[V]` by previous token, computed once each (the same op on the same row as uncached, so
        # the same bits): a block picks gamma tokens one after another, each needing the row of the one before.
        self._markov: dict[int, torch.Tensor] = {}
        self._markov_max = max(1, _MARKOV_CACHE_BYTES // (4 * draft.cfg.vocab_size))
        # The whole draft forward as one C call where the draft and its pool allow it (else the module path, each
        # time logged once and counted in `fallbacks` under "draft").
        built = DraftStep.build(draft)
        self._step: DraftStep | None = None if isinstance(built, str) else built
        self.step_off: str | None = built if isinstance(built, str) else None  # why there is no C step
        self.fallbacks = fallbacks if fallbacks is not None else FastPathFallbacks()
        self._pools: tuple[int, np.ndarray | None] | None = None  # (the pool's address, its `pool_table`)
        self.backlog = DraftBacklog()  # context rows kept, not written yet (`keep`)

    def keep(self, features: torch.Tensor, positions: torch.Tensor, swa_slots: torch.Tensor, n: int,
             owners: list[int]) -> None:
        """Keep the draft context rows of the first `n` committed tokens of a step for later (copies: the step's
        buffers are reused), with each row's request slot (`owners`, for `forget`). Written by the next `inject`,
        `propose` or `flush`, or here once the backlog is full; at once where the features are not fp32 CPU rows."""
        keepable, width = features.dtype is torch.float32 and features.is_cpu, features.shape[1]
        if not (keepable and self.backlog.room(n, width)):
            self.flush()  # (the kept rows are older: written first)
            if not (keepable and self.backlog.room(n, width)):
                self._write(features[:n], positions[:n], swa_slots[:n])
                return
        self.backlog.keep(features, positions, swa_slots, n, owners)

    def forget(self, owner: int) -> None:
        """Drop the kept rows of request slot `owner`, whose pages are freed unread (`DraftBacklog.forget`)."""
        self.backlog.forget(owner)

    def flush(self) -> None:
        """Write every kept row (one call), before anything else reads or writes draft rows (`draft_backlog`)."""
        if not self.backlog.rows:
            return
        rows = self.backlog.take()
        if rows is not None:
            self._write(*rows)

    def inject(self, features: torch.Tensor, positions: torch.Tensor, swa_slots: torch.Tensor) -> None:
        """Write the draft context rows of committed tokens: `features [N, D*L]` at `positions` / `swa_slots` (the
        kept rows first: they are older)."""
        self.flush()
        self._write(features, positions, swa_slots)

    @torch.inference_mode()
    def _write(self, features: torch.Tensor, positions: torch.Tensor, swa_slots: torch.Tensor) -> None:
        if not features.shape[0]:
            return
        if self._step is not None and self._step.try_inject(features, positions, swa_slots, self._pool_table()):
            return  # one C call
        self._note_module_path("its context rows")
        self.kv.pools.draft_kv[:, swa_slots] = self.draft.context_kv(features, positions).to(
            self.kv.pools.draft_kv.dtype
        )

    @torch.inference_mode()
    def propose(self, reqs: list[Request], num_drafts: list[int]) -> list[DraftProposal]:
        """One draft block per request, anchored at its last (not yet computed) token (the kept context rows are
        written first)."""
        self.flush()
        anchors = [_last_token(r) for r in reqs]
        base = self._base_logits(anchors, reqs)  # [M, G, V]
        # Draft k (0-based) proposes position `num_tokens + k`, raced with that position's SAMPLE noise: the very noise
        # the target samples the position with. Every sampled row's noise in one call (it does not depend on the picks).
        sampled = [0 if r.params.greedy else n for r, n in zip(reqs, num_drafts)]
        if not any(sampled):
            return [self._pick(base[i], r, a, n, None) for i, (r, a, n) in enumerate(zip(reqs, anchors, num_drafts))]
        keys = [RandomStream(r.seed).key(r.num_tokens + k) for r, m in zip(reqs, sampled) for k in range(m)]
        noise = torch.split(exponentials(keys, base.shape[-1]), sampled)  # per request [sampled drafts, V]
        return [self._pick(base[i], r, a, n, noise[i])
                for i, (r, a, n) in enumerate(zip(reqs, anchors, num_drafts))]

    def _base_logits(self, anchors: list[int], reqs: list[Request]) -> torch.Tensor:
        """The draft blocks' base logits `[M, G, V]`. Context indices come from the host tables in NumPy (small
        NumPy ops cost a fraction of the same ops on tensors); the draft runs where the pools are: one C call
        (`DraftStep`) where it applies, else the modules."""
        tables = self.kv.host_tables()
        anchor_pos = np.array([r.num_tokens - 1 for r in reqs])  # [M]
        slots = np.array([r.slot for r in reqs])
        ctx_pos = anchor_pos[:, None] + self._ctx_offsets[None, :]  # [M, W]
        valid = ctx_pos >= 0
        full = tables.req_to_token[slots[:, None], np.maximum(ctx_pos, 0)]
        rows = np.where(valid, self.kv.full_to_swa(full, tables), self.kv.pools.swa_dummy_slot)
        if self._step is not None:
            fused = self._step.try_logits(np.array(anchors), anchor_pos, self._pool_table(), rows, valid)
            if fused is not None:
                return fused
        self._note_module_path("a proposal's draft blocks")
        pool = self.kv.pools.draft_kv
        dev = pool.device
        ctx_kv = pool[:, torch.from_numpy(rows.astype(np.int64)).to(dev)]  # [stages, M, W, d]
        h = self.draft.block_hidden(torch.tensor(anchors, device=dev), torch.from_numpy(anchor_pos).to(dev), ctx_kv,
                                    torch.from_numpy(valid).to(dev))
        return self.draft.base_logits(h)

    def _note_module_path(self, what: str) -> None:
        """`what` ran on the draft's module path: logged the first time, counted every time."""
        if self.step_off is not None:
            self.fallbacks.note("draft", lambda: f"the DSpark draft has no C step: {self.step_off}")
        else:
            self.fallbacks.note("draft", lambda: f"{what} are not what the C draft reads (no fp32 CPU pool table, "
                                                 "positions past the rotary table, a quantized main_proj)")

    def _pool_table(self) -> np.ndarray | None:
        """`DraftStep.pool_table` of the draft pool (None: no C path), built again only if the pool moved."""
        if self._step is None:
            return None
        pool = self.kv.pools.draft_kv
        if self._pools is None or self._pools[0] != pool.data_ptr():
            self._pools = (pool.data_ptr(), DraftStep.pool_table(pool))
        return self._pools[1]

    def _pick(self, base: torch.Tensor, req: Request, anchor: int, n: int, noise: torch.Tensor | None
              ) -> DraftProposal:
        """Left to right from the anchor: each row's base logits plus the Markov bias of the previous token;
        `noise [n, V]` for a sampled request (None or empty for a greedy one)."""
        prev = anchor
        tokens: list[int] = []
        output = req.controlled_output if req.grammar is not None else []
        for k in range(n):
            logits = base[k] + self._markov_row(prev)
            if req.grammar is not None:
                logits = _grammar_masked(logits, req, output + tokens, len(output))
            if req.params.greedy:
                prev = int(logits.argmax())
            else:
                # The target's filters too: a token p dropped can never be the target's, so q must not spend mass on it.
                q = filter_logits(logits, req.params).softmax(-1)
                assert noise is not None
                prev = int(race(q[None], noise[k : k + 1])[0])
            tokens.append(prev)
        return DraftProposal(tokens)

    def _markov_row(self, prev: int) -> torch.Tensor:
        """The Markov bias `[V]` after token `prev`, cached (least recently used evicted first when full)."""
        row = self._markov.pop(prev, None)
        if row is not None:
            self._markov[prev] = row  # most recent last
        else:
            if len(self._markov) >= self._markov_max:
                del self._markov[next(iter(self._markov))]
            row = self._markov[prev] = self.draft.markov_bias(torch.tensor(prev))
        return row


def _grammar_masked(logits: torch.Tensor, req: Request, output: list[int], committed: int) -> torch.Tensor:
    """A constrained request's draft row under its grammar, as the target's row will be: a draft the grammar refuses
    could never be accepted. (Left as it is where the mask leaves nothing: a row after a draft EOS.)"""
    assert req.grammar is not None
    masked = logits.clone()[None]  # [1, V]
    req.grammar.constrain(masked, output, committed)
    return masked[0] if bool(torch.isfinite(masked).any()) else logits


def _last_token(req: Request) -> int:
    """`req.all_token_ids[-1]` without building the whole list."""
    return req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
