"""Rung 5: DSpark speculative decoding is lossless: greedy and seeded tokens equal plain decoding, sampling keeps the
distribution, rolled-back state equals a plain run's, and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from conftest import HC4, MIXED, random_prompts
from helpers import GREEDY, assert_no_leaks, make_llm
from pdspark import SamplingParams
from pdspark.engine import drafter as drafter_module
from pdspark.engine.drafter import DraftProposal
from pdspark.engine.engine import Engine
from pdspark.engine.random_stream import Purpose, RandomStream
from pdspark.engine.sampler import Sampler, filter_logits
from pdspark.engine.spec_governor import SpecGovernor
from pdspark.engine.spec_verifier import accept
from pdspark.errors import CheckpointError, ConfigError
from pdspark.model.dspark_weights import draft_state_dict, load_draft_weights
from pdspark.model.loader import load_checkpoint, load_draft
from pdspark.testing.random_draft import add_random_draft

OPTS = dict(c128_page_size=2, max_model_len=512)
SEEDED = dict(temperature=0.8, top_k=40, top_p=0.95, seed=17, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_ckpt(checkpoints, tmp_path_factory):
    """`(path with a random draft, path without)` for MIXED and HC4."""
    out = {}
    for spec in (MIXED, HC4):
        path, _ = checkpoints(spec)
        dst = tmp_path_factory.mktemp("draft") / "ckpt"
        add_random_draft(path, dst, gamma=3, moe=spec is HC4)
        out[spec.seed] = (dst, path)
    return out


class OracleProposals:
    """Proposes the plain run's own continuation, corrupted at chosen offsets: exercises every acceptance length."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], corrupt_every: int):
        self.reference = reference
        self.corrupt_every = corrupt_every
        self.calls = 0

    def __call__(self, drafter, reqs, num_drafts):
        out = []
        for req, n in zip(reqs, num_drafts):
            full = self.reference[tuple(req.prompt_token_ids)]
            done = len(req.output_token_ids)
            tokens = list(full[done : done + n])
            tokens += [3] * (n - len(tokens))
            self.calls += 1
            cut = self.calls % self.corrupt_every
            if cut < n:
                tokens[cut] = (tokens[cut] + 1) % 256  # the target will reject this one
            out.append(DraftProposal(tokens))
        return out


def greedy_outputs(llm, prompts, n, sampling=GREEDY):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=n, **sampling))
    return [o.token_ids for o in outs], outs


@pytest.mark.parametrize("which", [MIXED.seed, HC4.seed], ids=["mixed", "hc4"])
def test_greedy_speculative_equals_plain_with_random_draft(draft_ckpt, which):
    path, _ = draft_ckpt[which]
    prompts = random_prompts(6, [9, 33, 70, 101], seed=20)
    plain, _ = greedy_outputs(make_llm(path, **OPTS), prompts, 40)
    spec_llm = make_llm(path, speculative="dspark", max_num_batched_tokens=64, **OPTS)
    spec, outs = greedy_outputs(spec_llm, prompts, 40)
    assert spec == plain
    assert all(o.spec_verify_steps > 0 for o in outs)
    assert_no_leaks(spec_llm)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("corrupt_every", [2, 3, 5])
def test_speculative_equals_plain_across_acceptance_lengths(draft_ckpt, monkeypatch, corrupt_every, sampling):
    """Verify windows of every acceptance length cross C4 (4) and C128 (16) group boundaries; prefix cache on. A
    seeded draft that is the plain run's token is accepted, so sampled windows get every acceptance length too."""
    path, _ = draft_ckpt[MIXED.seed]
    (system,) = random_prompts(1, [64], seed=21)
    prompts = [system + s for s in random_prompts(5, [3, 14, 29], seed=22)]
    plain, _ = greedy_outputs(make_llm(path, **OPTS), prompts, 48, sampling)
    oracle = OracleProposals({tuple(p): o for p, o in zip(prompts, plain)}, corrupt_every)
    monkeypatch.setattr(drafter_module.DSparkDrafter, "propose", lambda self, r, n: oracle(self, r, n))
    spec_llm = make_llm(path, speculative="dspark", max_num_batched_tokens=64, **OPTS)
    spec, outs = greedy_outputs(spec_llm, prompts, 48, sampling)
    assert spec == plain
    stats = spec_llm.engine.spec
    assert stats.accepted_tokens > 0 and stats.accepted_per_position[0] > stats.accepted_per_position[-1] >= 0
    assert outs[1].num_cached_tokens > 0
    assert_no_leaks(spec_llm)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafting_only_when_faster_switches_modes_mid_request_and_keeps_plain_tokens(draft_ckpt, sampling):
    """`speculative_policy="when-faster"`: decode steps with and without drafts alternate within each request (a
    governor that probes the other mode after nearly every step), and the tokens are plain decoding's."""
    path, _ = draft_ckpt[MIXED.seed]
    prompts = random_prompts(4, [9, 40], seed=23)
    plain, _ = greedy_outputs(make_llm(path, **OPTS), prompts, 40, sampling)
    llm = make_llm(path, speculative="dspark", speculative_policy="when-faster", max_num_batched_tokens=64, **OPTS)
    engine = llm.engine
    assert isinstance(engine.governor, SpecGovernor)
    engine.governor = SpecGovernor(engine.governor.num_drafts, probe_share=0.9)
    modes = []
    record = engine.governor.record
    engine.governor.record = lambda b, speculated, s, n: (modes.append(speculated), record(b, speculated, s, n))
    for prompt, want in zip(prompts, plain):  # batch 1, then all four at once
        assert greedy_outputs(llm, [prompt], 40, sampling)[0] == [want]
    assert greedy_outputs(llm, prompts, 40, sampling)[0] == plain
    assert modes.count(True) > 4 and modes.count(False) > 4
    assert any(a != b for a, b in zip(modes, modes[1:]))
    assert_no_leaks(llm)
    with pytest.raises(ConfigError, match="speculative_policy"):
        make_llm(path, speculative="dspark", speculative_policy="sometimes", **OPTS)


def test_a_server_saturated_from_the_start_measures_and_probes_both_modes(draft_ckpt):
    """Every slot taken and more requests queued from the first step on: the decode steps of the running requests
    are still measured with drafts and without (the governor then explores within its probe share), and the
    tokens are plain decoding's."""
    path, _ = draft_ckpt[MIXED.seed]
    prompts = random_prompts(8, [9, 40], seed=25)
    opts = {**OPTS, "max_num_seqs": 2}
    plain, _ = greedy_outputs(make_llm(path, **opts), prompts, 80, GREEDY)
    llm = make_llm(path, speculative="dspark", speculative_policy="when-faster", **opts)
    engine = llm.engine
    saturated: list[bool] = []  # the mode of each decode step timed while requests were queued
    record = engine.governor.record

    def recorded(b, speculated, s, n):
        if engine.scheduler.waiting:
            saturated.append(speculated)
        record(b, speculated, s, n)

    engine.governor.record = recorded
    # All 8 queued at once, 6 waiting from the start; 80 tokens each: the governor settles each mode before it
    # counts a step (`SETTLE_S`), so a short run would measure plain decoding alone.
    assert greedy_outputs(llm, prompts, 80, GREEDY)[0] == plain
    assert saturated.count(True) >= 4 and saturated.count(False) >= 4, saturated
    assert_no_leaks(llm)


class _Plain:
    """A governor that never drafts (the draft context rows of every step are kept for later)."""

    num_drafts = 0

    def drafts(self, batch, steady=True):
        return 0

    def record(self, *args):
        pass

    def busy(self):
        pass


class _Alternating(_Plain):
    """A governor that drafts at every other step (each switch keeps, then writes, the rows of a plain step)."""

    def __init__(self, num_drafts):
        self.num_drafts, self.steps = num_drafts, 0

    def drafts(self, batch, steady=True):
        self.steps += 1
        return self.num_drafts if self.steps % 2 else 0


def test_draft_context_kept_by_steps_without_drafts_ends_as_written_at_every_step(draft_ckpt):
    """`when-faster` keeps a plain step's draft context rows and writes them before the next proposal or the finish:
    the draft pool then holds the bits that writing at every step leaves, and no proposal reads rows still kept."""
    path, _ = draft_ckpt[MIXED.seed]
    prompts = random_prompts(3, [9, 40], seed=24)

    def draft_pool(policy, governor=None, num_drafts=None):
        llm = make_llm(path, speculative="dspark", speculative_policy=policy, max_num_batched_tokens=64, **OPTS)
        if governor is not None:
            llm.engine.governor = governor
        if num_drafts is not None:
            llm.engine.scheduler.num_drafts = num_drafts
        engine, kept, waiting = llm.engine, [], []
        drafter = engine.drafter
        keep, base_logits = drafter.keep, drafter._base_logits
        drafter.keep = lambda *rows: (kept.append(rows[3]), keep(*rows))  # (rows[3]: how many)
        # (the context is read in `_base_logits`, after `propose` wrote what was kept)
        drafter._base_logits = lambda *a: (waiting.append(drafter.backlog.rows), base_logits(*a))[1]
        for prompt in prompts:
            greedy_outputs(llm, [prompt], 30)
        greedy_outputs(llm, prompts, 30)
        assert not drafter.backlog.rows and not any(waiting)  # every proposal read a written context
        assert_no_leaks(llm)
        return engine.kv.pools.draft_kv.clone(), len(kept), len(waiting)

    eager, kept, _ = draft_pool("always", num_drafts=0)  # plain steps, each writing its rows
    assert kept == 0
    deferred, kept, _ = draft_pool("when-faster", governor=_Plain())
    assert kept > 30 and torch.equal(deferred, eager)
    # (A run with verify steps lays its pool out otherwise: not compared.)
    _, kept, proposals = draft_pool("when-faster", governor=_Alternating(3))
    assert kept > 10 and proposals > 10


def test_kept_draft_context_of_a_request_whose_pages_are_freed_is_never_computed(draft_ckpt):
    """Without a prefix cache a finished request's pages go back free, unread: the rows its plain steps kept are
    dropped, not written (the draft's context projection is most of what a plain step under the governor pays
    over plain decoding); with the cache they are written before the cache takes the pages. Tokens as plain."""
    path, _ = draft_ckpt[MIXED.seed]
    prompts = random_prompts(3, [9, 40], seed=26)
    want, _ = greedy_outputs(make_llm(path, **OPTS), prompts, 30)

    def written_rows(enable_prefix_cache):
        llm = make_llm(path, speculative="dspark", speculative_policy="when-faster",
                       enable_prefix_cache=enable_prefix_cache, **OPTS)
        llm.engine.governor = _Plain()
        backlog, written = llm.engine.drafter.backlog, []
        take = backlog.take
        backlog.take = lambda: (lambda rows: (written.append(0 if rows is None else rows[0].shape[0]), rows)[1])(take())
        for prompt, tokens in zip(prompts, want):  # one at a time, then all three at once
            assert greedy_outputs(llm, [prompt], 30)[0] == [tokens]
        assert greedy_outputs(llm, prompts, 30)[0] == want
        assert not backlog.rows
        assert_no_leaks(llm)
        return sum(written)

    assert written_rows(enable_prefix_cache=False) == 0
    assert written_rows(enable_prefix_cache=True) >= 6 * 29  # every plain step's rows (the first token is prefill's)


def test_kept_draft_context_of_a_preempted_request_ends_as_written_at_every_step():
    """A request preempted while its draft context rows are kept hands its pages to the prefix cache (dsv4-tiny: a
    128-token unit, its window's SWA pages with it): the kept rows are still written to their slots, in commit
    order, so the cache holds what writing at every step leaves. A transfer reservation writes every kept row first
    (the transfer writes its pages next)."""
    prompts = random_prompts(2, [20, 37], seed=3, vocab=4096)

    def draft_pool(policy):
        llm = make_llm("dsv4-tiny", speculative="dspark", speculative_policy=policy)
        engine = llm.engine
        if policy == "when-faster":
            engine.governor = _Plain()
        else:
            engine.scheduler.num_drafts = 0  # plain steps, each writing its rows
        ids = [engine.add_request(p, SamplingParams(max_tokens=200, **GREEDY)) for p in prompts]
        for step in range(1, 111):
            engine.step()
            if step == 50 and policy == "when-faster":
                assert engine.drafter.backlog.rows
                pages = engine.reserve_transfer(prompts[0], SamplingParams(max_tokens=8, **GREEDY))
                assert pages is not None and not engine.drafter.backlog.rows
                engine.cancel_transfer(pages)
        # Rows kept since the write at step 50: positions inside the 128-token unit the cache takes.
        assert policy != "when-faster" or engine.drafter.backlog.rows > 100
        engine.scheduler.preempt(engine.scheduler.running[-1])
        while engine.has_unfinished:
            engine.step()
        tokens = [engine.requests[i].output_token_ids for i in ids]
        assert sum(engine.requests[i].num_preemptions for i in ids) == 1
        return engine.kv.pools.draft_kv.clone(), tokens

    eager, plain = draft_pool("always")
    deferred, tokens = draft_pool("when-faster")
    assert tokens == plain
    assert torch.equal(deferred, eager)


def test_abort_mid_verify_frees_everything(draft_ckpt):
    path, _ = draft_ckpt[HC4.seed]
    llm = make_llm(path, speculative="dspark", **OPTS)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=60, temperature=0.8, seed=i))
           for i, p in enumerate(random_prompts(4, [20, 50], seed=23))]
    for _ in range(4):
        engine.step()
    assert any(engine.requests[i].spec_verify_steps for i in ids)
    for i in ids[::2]:
        engine.abort(i)
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    assert_no_leaks(llm)


def target_tokens(logits, params, stream, first_position):
    """The target's token for each window row, drawn as the engine draws them: one plain sample per row."""
    n = logits.shape[0]
    return Sampler().sample(logits, [params] * n, [stream] * n, list(range(first_position, first_position + n)))


def gumbel_agreement(p, q) -> float:
    """P(argmax p / E == argmax q / E) for one Exp(1) noise vector E: token i wins both when every E_j exceeds
    E_i * max(p_j / p_i, q_j / q_i), which has probability 1 / sum_j max(p_j / p_i, q_j / q_i) over E_i."""
    live = (p > 0) & (q > 0)
    ratios = torch.maximum(p[None, :] / p[live, None], q[None, :] / q[live, None])  # [live, V]
    return float((1.0 / ratios.sum(-1)).sum())


def inverse_cdf_agreement(p, q) -> float:
    """The same for the inverse-CDF picks of p and q by one uniform: the overlap of each token's CDF intervals."""
    cp, cq = p.cumsum(-1), q.cumsum(-1)
    return float((torch.minimum(cp, cq) - torch.maximum(cp - p, cq - q)).clamp(min=0).sum())


def test_coupled_verification_keeps_the_target_distribution_and_accepts_by_gumbel_agreement():
    """Whatever the draft's distribution q, committed tokens follow the target's p (chi-square); one seed per trial,
    the draft raced against the position's SAMPLE noise as the drafter does. A draft is accepted as often as the two
    races agree: between the inverse-CDF coupling's rate and rejection sampling's sum(min(p, q)) for this q, whose
    mass sits on tokens later in vocabulary order than p's."""
    V = 6
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    q = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])
    params = SamplingParams(temperature=1.0)
    n = 8000
    counts, accepted = torch.zeros(V), 0
    for seed in range(n):
        stream = RandomStream(seed)
        d = stream.choice(q, 40, Purpose.SAMPLE)
        acc = accept([d], target_tokens(torch.stack([p_logits, p_logits]), params, stream, 40))
        counts[acc.tokens[0]] += 1
        accepted += acc.num_accepted
    p = p_logits.softmax(-1)
    expected = n * p
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom
    agreement = gumbel_agreement(p.double(), q.double())
    assert abs(accepted - n * agreement) < 4 * (n * agreement * (1 - agreement)) ** 0.5
    optimum = float(torch.minimum(p, q).sum())
    assert inverse_cdf_agreement(p.double(), q.double()) + 0.05 < agreement < optimum


def test_acceptance_follows_gumbel_agreement_with_filters():
    """A draft close to the target, both filtered by top-k and top-p as the engine filters them: over many seeds
    the acceptance rate is the predicted agreement of the filtered p and q."""
    V = 64
    g = torch.Generator().manual_seed(9)
    p_logits = torch.randn(V, generator=g) * 2
    q_logits = p_logits + torch.randn(V, generator=g) * 0.7
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    p, q = (filter_logits(x, params).softmax(-1) for x in (p_logits, q_logits))
    n = 4000
    accepted = 0
    for seed in range(n):
        stream = RandomStream(seed)
        d = stream.choice(q, 7, Purpose.SAMPLE)
        accepted += accept([d], target_tokens(torch.stack([p_logits, p_logits]), params, stream, 7)).num_accepted
    agreement = gumbel_agreement(p.double(), q.double())
    assert abs(accepted - n * agreement) < 4 * (n * agreement * (1 - agreement)) ** 0.5
    assert 0.5 < agreement < float(torch.minimum(p, q).sum())


def test_speculative_chains_over_several_verify_steps_equal_plain_sampling():
    """Three tokens of a Markov 'model' over V=4 produced by verify steps of two drafts, exactly as the engine draws
    them: a step that ends in a rejection leaves draws of later positions unused, and the next step draws its drafts
    for the same positions again. Every seed gives plain sampling's tokens, and the joint of the three tokens is the
    target's (chi-square, 63 dof)."""
    V, gamma, length, first = 4, 2, 3, 17
    g = torch.Generator().manual_seed(5)
    P = torch.randn(V, V, generator=g) * 0.5  # [prev, next] target logits (every one of the 64 cells >= 0.3%)
    Q = P + torch.randn(V, V, generator=g) * 0.5  # [prev, next] draft logits, near P: most windows accept some
    params = SamplingParams(temperature=1.0)
    anchor = 2

    def speculative(stream: RandomStream) -> tuple[list[int], int]:
        tokens, prev, position, accepted = [], anchor, first, 0
        while len(tokens) < length:
            drafts, d = [], prev
            for k in range(gamma):
                d = stream.choice(Q[d].softmax(-1), position + k, Purpose.SAMPLE)
                drafts.append(d)
            window = [prev, *drafts]  # target row j predicts the token after window row j
            acc = accept(drafts, target_tokens(P[window], params, stream, position))
            tokens += acc.tokens
            accepted += acc.num_accepted
            position += len(acc.tokens)
            prev = tokens[-1]
        return tokens[:length], accepted

    def plain(stream: RandomStream) -> list[int]:
        tokens, prev = [], anchor
        for position in range(first, first + length):
            prev = target_tokens(P[[prev]], params, stream, position)[0]
            tokens.append(prev)
        return tokens

    n = 4000
    runs = [speculative(RandomStream(seed)) for seed in range(n)]
    outs = [tokens for tokens, _ in runs]
    assert outs == [plain(RandomStream(seed)) for seed in range(n)]
    assert sum(a for _, a in runs) > n  # drafts were accepted, not just every first draft rejected
    cells = torch.tensor([(a * V + b) * V + c for a, b, c in outs])
    counts = torch.bincount(cells, minlength=V**length).double()
    p = P.softmax(-1).double()  # [prev, next]
    expected = n * (p[anchor][:, None, None] * p[:, :, None] * p[None, :, :]).flatten()  # p(a) p(b|a) p(c|b)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 103.4  # 99.9% quantile of chi-square with 63 degrees of freedom


def test_rolled_back_state_equals_plain_run(draft_ckpt, monkeypatch):
    """After many rejections, compressed KV, compressor rings and C128 rings equal a plain run at the same length."""
    path, _ = draft_ckpt[MIXED.seed]
    prompt = random_prompts(1, [37], seed=25)[0]
    n_out = 41
    snapshots = {}

    def snapshotting_finish(name):
        def finish(self, req):
            if req.pages is not None:
                snapshots[name] = snapshot(self.kv, req)
            return original_finish(self, req)
        return finish

    from pdspark.engine.scheduler import Scheduler

    original_finish = Scheduler.finish
    monkeypatch.setattr(Scheduler, "finish", snapshotting_finish("plain"))
    plain, _ = greedy_outputs(make_llm(path, enable_prefix_cache=False, **OPTS), [prompt], n_out)
    monkeypatch.setattr(Scheduler, "finish", snapshotting_finish("spec"))
    oracle = OracleProposals({tuple(prompt): plain[0]}, corrupt_every=2)  # a rejection in most windows
    monkeypatch.setattr(drafter_module.DSparkDrafter, "propose", lambda self, r, n: oracle(self, r, n))
    cleared = []
    original_clear = Engine._clear_rejected_c128_rows

    def checked_clear(self, p):
        original_clear(self, p)
        first = p.chunk.start + p.committed
        rows = self.kv.c128_state_rows(torch.tensor(p.chunk.request.pages.slot),
                                       torch.arange(first, p.chunk.start + p.chunk.num_tokens))
        half = self.kv.pools.c128_state.shape[-1] // 2
        assert torch.isneginf(self.kv.pools.c128_state[:, rows, half:]).all()
        assert not self.kv.pools.c128_state[:, rows, :half].any()
        cleared.append(len(rows))

    monkeypatch.setattr(Engine, "_clear_rejected_c128_rows", checked_clear)
    spec_llm = make_llm(path, speculative="dspark", enable_prefix_cache=False, **OPTS)
    spec, _ = greedy_outputs(spec_llm, [prompt], n_out)
    assert spec == plain and spec_llm.engine.spec.verify_steps > 0
    assert sum(cleared) > 0, "rejected drafts wrote C128 ring rows that had to be cleared"
    a, b = snapshots["plain"], snapshots["spec"]
    assert a["computed"] == b["computed"]
    for key in a:
        if key != "computed":
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=key)


def snapshot(kv, req) -> dict:
    """The request's live DSV4 cache state at its computed length L."""
    L, slot = req.num_computed_tokens, req.pages.slot
    model, pools = kv.model, kv.pools
    R4, R128 = model.csa_ratio, model.hca_ratio
    full = kv.req_to_token[slot]
    c4_rows = full[torch.arange(L // R4) * R4] // R4
    g = torch.arange(L // R128)
    cps = kv.sizes.c128_page_size
    c128_rows = kv.req_to_c128[slot, g // cps] * cps + g % cps
    open_c4 = torch.arange((L // R4) * R4 - R4, L)
    open_c128 = torch.arange((L // R128) * R128, L)
    return {
        "computed": L,
        "c4_kv": pools.c4_kv[:, c4_rows],
        "c4_index": pools.index_rows(c4_rows),
        "c128_kv": pools.c128_kv[:, c128_rows],
        "c4_state": pools.c4_state[:, kv.c4_state_rows(full[open_c4], open_c4)],
        "c4_index_state": pools.c4_index_state[:, kv.c4_state_rows(full[open_c4], open_c4)],
        "c128_state": pools.c128_state[:, kv.c128_state_rows(torch.tensor(slot), open_c128)],
    }


@pytest.mark.parametrize("own_vocab, moe", [(False, False), (True, True)])
def test_draft_weights_round_trip(checkpoints, tmp_path, own_vocab, moe):
    path, _ = checkpoints(MIXED)
    draft = add_random_draft(path, tmp_path / "ckpt", own_vocab=own_vocab, moe=moe, seed=3)
    loaded = load_draft(load_checkpoint(tmp_path / "ckpt", 64), 64)
    for name, p in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    load_draft_weights(loaded, draft_state_dict(draft))  # names are stable both ways
    # A checkpoint trained with the confidence head carries it; it is left out, and only it.
    with_head = {**draft_state_dict(draft), "mtp.confidence_head.weight": torch.ones(3, 8)}
    load_draft_weights(loaded, with_head)
    with pytest.raises(CheckpointError, match="mtp.confidence_heads.weight"):
        load_draft_weights(loaded, {**draft_state_dict(draft), "mtp.confidence_heads.weight": torch.ones(3, 8)})


def test_cached_markov_rows_equal_the_uncached_bias_and_stay_bounded(draft_ckpt, monkeypatch):
    """The drafter's Markov rows come from a cache: bit for bit the uncached bias; the least recently used row
    goes first when full."""
    monkeypatch.setattr(drafter_module, "_MARKOV_CACHE_BYTES", 3 * 4 * 256)  # 3 rows of a 256-token vocabulary
    drafter = make_llm(draft_ckpt[MIXED.seed][0], speculative="dspark", **OPTS).engine.drafter
    with torch.inference_mode():
        for prev in (5, 9, 5, 200, 7, 9):
            assert torch.equal(drafter._markov_row(prev), drafter.draft.markov_bias(torch.tensor(prev)))
    assert list(drafter._markov) == [200, 7, 9]
