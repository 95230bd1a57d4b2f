"""The one module that converts between protobuf messages (`pdspark.v1`) and engine-side types."""

from __future__ import annotations

from typing import cast

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.transfer.compat import CompatDescriptor
from pdspark.transfer.plan import BufferDesc, PoolKind, TransferPlan, TransferResult, TransferStats
from pdspark.types import FinishReason, SamplingParams, StructuredOutputs, TokenLogprobs
from pdspark.v1 import common_pb2, worker_pb2

# The engine's enums and their protobuf twins. Unit tests check both directions are complete.
ERROR_CODE_TO_PB: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: common_pb2.ERROR_CODE_INVALID_REQUEST,
    ErrorCode.INCOMPATIBLE: common_pb2.ERROR_CODE_INCOMPATIBLE,
    ErrorCode.DEADLINE: common_pb2.ERROR_CODE_DEADLINE,
    ErrorCode.CAPACITY: common_pb2.ERROR_CODE_CAPACITY,
    ErrorCode.TRANSFER: common_pb2.ERROR_CODE_TRANSFER,
    ErrorCode.ABORTED: common_pb2.ERROR_CODE_ABORTED,
    ErrorCode.UNAVAILABLE: common_pb2.ERROR_CODE_UNAVAILABLE,
    ErrorCode.OVERLOADED: common_pb2.ERROR_CODE_OVERLOADED,
    ErrorCode.ALREADY_EXISTS: common_pb2.ERROR_CODE_ALREADY_EXISTS,
    ErrorCode.UNAUTHENTICATED: common_pb2.ERROR_CODE_UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: common_pb2.ERROR_CODE_PERMISSION_DENIED,
}
ERROR_CODE_FROM_PB = {pb: code for code, pb in ERROR_CODE_TO_PB.items()}
FINISH_REASON_TO_PB: dict[FinishReason, common_pb2.FinishReason] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_FROM_PB: dict[int, FinishReason] = {pb: reason for reason, pb in FINISH_REASON_TO_PB.items()}
_POOL_KINDS = frozenset(k.value for k in PoolKind)
# `optional` fields of the SamplingParams message: unset means the engine's default, which may differ from 0.
_OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "seed", "max_tokens", "logprobs", "prompt_logprobs",
                      "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")
# The controls sent only away from their neutral value (an older receiver then refuses nothing it cannot do).
_NEUTRAL_CONTROLS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
                     "min_tokens": 0}


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    """Every value the sender means is set explicitly (defaults included), so the receiver's defaults never
    decide; only `None` (no top-k filter, no seed, no logprobs) is sent as an unset field."""
    msg = common_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        max_tokens=p.max_tokens,
        stop=list(p.stop_strings),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
    )
    if p.top_k is not None:
        msg.top_k = p.top_k
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    for name, neutral in _NEUTRAL_CONTROLS.items():
        if getattr(p, name) != neutral:
            setattr(msg, name, getattr(p, name))
    if p.logit_bias:
        msg.logit_bias.update(p.logit_bias)
    msg.banned_token_ids.extend(p.banned_token_ids)
    if p.structured_outputs is not None:
        msg.structured_outputs.kind = p.structured_outputs.kind
        msg.structured_outputs.spec = p.structured_outputs.spec
    return msg


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take `SamplingParams`' defaults (temperature 1, as OpenAI's; no top-k filter; top_p 1;
    16 tokens). Raises `InvalidRequestError` (naming the field) for bad values."""
    given = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING if msg.HasField(name)}
    return SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias) or None,
        banned_token_ids=tuple(msg.banned_token_ids),
        structured_outputs=(StructuredOutputs(msg.structured_outputs.kind, msg.structured_outputs.spec)
                            if msg.HasField("structured_outputs") else None),
        **given,
    )


def finish_reason_to_pb(reason: FinishReason | None) -> common_pb2.FinishReason:
    return FINISH_REASON_TO_PB[reason] if reason is not None else common_pb2.FINISH_REASON_UNSPECIFIED


def finish_reason_from_pb(value: int) -> FinishReason | None:
    """None while the generation runs (UNSPECIFIED)."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    # A reason this version does not know (a newer peer's) still ends the generation: report it as an abort.
    return FINISH_REASON_FROM_PB.get(value, FinishReason.ABORT)


def logprob_to_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top)


def logprob_from_pb(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, dict(msg.top))


def timeout_to_ms(seconds: float) -> int:
    """A relative timeout as the wire's `timeout_ms`: whole milliseconds, at least 1 (0 means "none given"), at
    most what a uint32 holds."""
    return min(max(1, int(seconds * 1000)), 2**32 - 1)


def timeout_from_ms(ms: int) -> float:
    """Seconds of a wire `timeout_ms`; 0 (none given) stays 0."""
    return ms / 1000


def compat_to_pb(c: CompatDescriptor) -> common_pb2.CompatDescriptor:
    return common_pb2.CompatDescriptor(
        schema_version=c.schema_version,
        model_fingerprint=c.model_fingerprint,
        layer_types=list(c.layer_types),
        csa_ratio=c.csa_ratio,
        hca_ratio=c.hca_ratio,
        head_dim=c.head_dim,
        index_head_dim=c.index_head_dim,
        kv_dtype=c.kv_dtype,
        state_dtype=c.state_dtype,
        page_size=c.page_size,
        c128_page_size=c.c128_page_size,
        csa_ring=c.csa_ring,
        hca_ring=c.hca_ring,
        sliding_window=c.sliding_window,
        draft_config=c.draft_config,
        prefix_cache=c.prefix_cache,
    )


def compat_from_pb(msg: common_pb2.CompatDescriptor) -> CompatDescriptor:
    return CompatDescriptor(
        schema_version=msg.schema_version,
        model_fingerprint=msg.model_fingerprint,
        layer_types=tuple(msg.layer_types),
        csa_ratio=msg.csa_ratio,
        hca_ratio=msg.hca_ratio,
        head_dim=msg.head_dim,
        index_head_dim=msg.index_head_dim,
        kv_dtype=msg.kv_dtype,
        state_dtype=msg.state_dtype,
        page_size=msg.page_size,
        c128_page_size=msg.c128_page_size,
        csa_ring=msg.csa_ring,
        hca_ring=msg.hca_ring,
        sliding_window=msg.sliding_window,
        draft_config=msg.draft_config,
        prefix_cache=msg.prefix_cache,
    )


def plan_to_pb(plan: TransferPlan) -> worker_pb2.TransferPlan:
    return worker_pb2.TransferPlan(
        transfer_id=plan.transfer_id,
        request_id=plan.request_id,
        session=plan.session,
        compat=compat_to_pb(plan.compat),
        buffers=[
            worker_pb2.BufferDescriptor(
                pool=cast("worker_pb2.PoolKind", int(b.pool)), layer=b.layer, base_addr=b.base_addr,
                item_bytes=b.item_bytes, num_items=b.num_items,
            )
            for b in plan.buffers
        ],
        prompt_len=plan.prompt_len,
        full_pages=list(plan.full_pages),
        swa_pages=list(plan.swa_pages),
        swa_first_page=plan.swa_first_page,
        c128_pages=list(plan.c128_pages),
        req_slot=plan.req_slot,
        timeout_ms=timeout_to_ms(plan.timeout_s),
        destination_rank=plan.destination_rank,
    )


def plan_from_pb(msg: worker_pb2.TransferPlan) -> TransferPlan:
    """Raises `RequestFailed` (INCOMPATIBLE) for a buffer of a payload kind this version does not know (a newer
    peer's, or none): we could neither write it nor leave it out without the decode side missing part of its
    cache."""
    for i, b in enumerate(msg.buffers):
        if b.pool not in _POOL_KINDS:
            known = ", ".join(k.name for k in PoolKind)
            raise RequestFailed(ErrorCode.INCOMPATIBLE, f"TransferPlan.buffers[{i}].pool: unknown payload kind "
                                f"{b.pool}; this worker moves {known}")
    return TransferPlan(
        transfer_id=msg.transfer_id,
        request_id=msg.request_id,
        session=msg.session,
        compat=compat_from_pb(msg.compat),
        buffers=tuple(
            BufferDesc(PoolKind(b.pool), b.layer, b.base_addr, b.item_bytes, b.num_items) for b in msg.buffers
        ),
        prompt_len=msg.prompt_len,
        full_pages=tuple(msg.full_pages),
        swa_pages=tuple(msg.swa_pages),
        swa_first_page=msg.swa_first_page,
        c128_pages=tuple(msg.c128_pages),
        req_slot=msg.req_slot,
        timeout_s=timeout_from_ms(msg.timeout_ms),
        destination_rank=msg.destination_rank,
    )


def failure_to_pb(e: RequestFailed) -> common_pb2.ErrorDetail:
    return common_pb2.ErrorDetail(code=ERROR_CODE_TO_PB[e.code], message=e.message)  # type: ignore[arg-type]


def failure_from_pb(msg: common_pb2.ErrorDetail) -> RequestFailed:
    # UNSPECIFIED, or a code this version does not know (a newer peer's): the peer failed, say so retryably.
    return RequestFailed(ERROR_CODE_FROM_PB.get(msg.code, ErrorCode.UNAVAILABLE), msg.message)


def stats_to_pb(s: TransferStats) -> worker_pb2.TransferStats:
    return worker_pb2.TransferStats(
        bytes=s.bytes, num_writes=s.num_writes, transfer_s=s.transfer_s, prefill_s=s.prefill_s,
        plan_wait_s=s.plan_wait_s, bytes_by_pool=s.bytes_by_pool or {}, write_s=s.write_s,
        source_rank=s.source_rank, destination_rank=s.destination_rank,
    )


def stats_from_pb(msg: worker_pb2.TransferStats) -> TransferStats:
    return TransferStats(msg.bytes, msg.num_writes, msg.transfer_s, msg.prefill_s, msg.plan_wait_s,
                         dict(msg.bytes_by_pool), msg.write_s, msg.source_rank, msg.destination_rank)


def result_to_pb(r: TransferResult | None, error: RequestFailed | None, transfer_id: str) -> worker_pb2.TransferResult:
    if error is not None or r is None:
        failure = error or RequestFailed(ErrorCode.UNAVAILABLE, "no result")
        return worker_pb2.TransferResult(transfer_id=transfer_id, error=failure_to_pb(failure))
    msg = worker_pb2.TransferResult(
        transfer_id=r.transfer_id, first_token_id=r.first_token, num_cached_tokens=r.num_cached_tokens,
        stats=stats_to_pb(r.stats), checksum=r.checksum,
    )
    if r.first_logprob is not None:
        msg.first_logprob.CopyFrom(logprob_to_pb(r.first_logprob))
    msg.prompt_logprobs.extend(logprob_to_pb(lp) for lp in r.prompt_logprobs)
    return msg


def result_from_pb(msg: worker_pb2.TransferResult) -> TransferResult:
    """Raises the `RequestFailed` the prefill side reported, if any."""
    if msg.HasField("error"):
        raise failure_from_pb(msg.error)
    return TransferResult(
        transfer_id=msg.transfer_id, first_token=msg.first_token_id, num_cached_tokens=msg.num_cached_tokens,
        checksum=msg.checksum, stats=stats_from_pb(msg.stats),
        first_logprob=logprob_from_pb(msg.first_logprob) if msg.HasField("first_logprob") else None,
        prompt_logprobs=tuple(logprob_from_pb(x) for x in msg.prompt_logprobs),
    )
