"""`ErrorCode`, `FinishReason` and `SamplingParams` on the wire: each code's meaning to every audience, and
protobuf conversions that keep every value (and tell an unset field from a zero)."""

from __future__ import annotations

import grpc
import pytest

from pdspark.errors import ErrorCode, InvalidRequestError, RequestFailed
from pdspark.rpc import convert, status
from pdspark.types import FinishReason, SamplingParams
from pdspark.v1 import common_pb2

# code: (HTTP status, gRPC status, retried by the router, OpenAI error type)
EXPECTED = {
    ErrorCode.INVALID_REQUEST: (400, grpc.StatusCode.INVALID_ARGUMENT, False, "invalid_request_error"),
    ErrorCode.CAPACITY: (400, grpc.StatusCode.INVALID_ARGUMENT, False, "invalid_request_error"),
    ErrorCode.INCOMPATIBLE: (503, grpc.StatusCode.FAILED_PRECONDITION, True, "server_error"),
    ErrorCode.DEADLINE: (504, grpc.StatusCode.DEADLINE_EXCEEDED, True, "server_error"),
    ErrorCode.TRANSFER: (502, grpc.StatusCode.INTERNAL, True, "server_error"),
    ErrorCode.ABORTED: (499, grpc.StatusCode.CANCELLED, False, "server_error"),
    ErrorCode.UNAVAILABLE: (503, grpc.StatusCode.UNAVAILABLE, True, "server_error"),
    ErrorCode.OVERLOADED: (429, grpc.StatusCode.RESOURCE_EXHAUSTED, True, "rate_limit_error"),
    ErrorCode.ALREADY_EXISTS: (409, grpc.StatusCode.ALREADY_EXISTS, False, "invalid_request_error"),
    ErrorCode.UNAUTHENTICATED: (401, grpc.StatusCode.UNAUTHENTICATED, False, "authentication_error"),
    ErrorCode.PERMISSION_DENIED: (403, grpc.StatusCode.PERMISSION_DENIED, False, "permission_error"),
}


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_error_code_maps_to_every_audience(code):
    http, grpc_status, retryable, openai_type = EXPECTED[code]
    assert (code.http_status, status.status_of(code), code.retryable, code.openai_type) == (
        http, grpc_status, retryable, openai_type)
    assert code.value == code.name.lower()  # the name in HTTP error bodies and metric labels


def test_error_codes_match_the_protobuf_enum_both_ways():
    pb_values = {v.number for v in common_pb2.ErrorCode.DESCRIPTOR.values} - {common_pb2.ERROR_CODE_UNSPECIFIED}
    assert set(convert.ERROR_CODE_TO_PB) == set(ErrorCode)
    assert set(convert.ERROR_CODE_TO_PB.values()) == pb_values
    for code in ErrorCode:
        assert common_pb2.ErrorCode.Name(convert.ERROR_CODE_TO_PB[code]) == f"ERROR_CODE_{code.name}"
        back = convert.failure_from_pb(convert.failure_to_pb(RequestFailed(code, "why")))
        assert (back.code, back.message) == (code, "why")


def test_an_unknown_or_unset_error_code_reads_as_unavailable():
    for value in (common_pb2.ERROR_CODE_UNSPECIFIED, 99):  # 99: a code a newer peer may send
        assert convert.failure_from_pb(common_pb2.ErrorDetail(code=value, message="m")).code == ErrorCode.UNAVAILABLE


def test_transport_statuses_map_to_codes():
    assert ErrorCode.of_transport("DEADLINE_EXCEEDED") == ErrorCode.DEADLINE
    assert ErrorCode.of_transport("CANCELLED") == ErrorCode.ABORTED
    assert ErrorCode.of_transport("UNAUTHENTICATED") == ErrorCode.UNAUTHENTICATED
    assert ErrorCode.of_transport("PERMISSION_DENIED") == ErrorCode.PERMISSION_DENIED
    for name in ("UNAVAILABLE", "UNKNOWN", "INTERNAL", "UNIMPLEMENTED"):
        assert ErrorCode.of_transport(name) == ErrorCode.UNAVAILABLE


def test_request_failed_takes_only_typed_codes():
    with pytest.raises(AssertionError):
        RequestFailed("DEADLINE", "a string is not a code")  # type: ignore[arg-type]


def test_finish_reasons_match_the_protobuf_enum_both_ways():
    pb_values = {v.number for v in common_pb2.FinishReason.DESCRIPTOR.values}
    assert set(convert.FINISH_REASON_TO_PB) == set(FinishReason)
    assert set(convert.FINISH_REASON_TO_PB.values()) | {common_pb2.FINISH_REASON_UNSPECIFIED} == pb_values
    for reason in FinishReason:
        assert convert.finish_reason_from_pb(convert.finish_reason_to_pb(reason)) is reason
    assert convert.finish_reason_to_pb(None) == common_pb2.FINISH_REASON_UNSPECIFIED
    assert convert.finish_reason_from_pb(common_pb2.FINISH_REASON_UNSPECIFIED) is None


def test_finish_reason_is_openais_string():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]
    assert FinishReason.LENGTH == "length" and str(FinishReason.STOP) == "stop"


# ---- SamplingParams ----------------------------------------------------------------------------------------------
def test_an_unset_sampling_message_means_the_api_defaults():
    params = convert.sampling_from_pb(common_pb2.SamplingParams())
    assert params == SamplingParams()
    # Not greedy: an unset temperature is OpenAI's default, 1. No top-k filter; top_p 1; 16 tokens.
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (1.0, None, 1.0, 16)


def test_zero_temperature_survives_the_wire_and_defaults_are_sent_explicitly():
    msg = convert.sampling_to_pb(SamplingParams(temperature=0.0))
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert convert.sampling_from_pb(msg).greedy
    # The sender's values, defaults included, are on the wire: the receiver's defaults decide nothing.
    default_msg = convert.sampling_to_pb(SamplingParams())
    assert all(default_msg.HasField(f) for f in ("temperature", "top_p", "max_tokens"))


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.5, top_k=7, top_p=0.75, seed=3, max_tokens=9, stop=("x", "yz"),
                   stop_token_ids=(4, 5), ignore_eos=True, logprobs=2),
])
def test_sampling_round_trip(params):
    msg = convert.sampling_to_pb(params)
    assert msg.HasField("top_k") == (params.top_k is not None)
    assert convert.sampling_from_pb(msg) == SamplingParams(**{**params.__dict__, "stop": params.stop_strings})


def test_top_k_off_is_none_and_zero_is_rejected_naming_the_field():
    assert SamplingParams().top_k is None
    for bad in (0, -1):
        with pytest.raises(InvalidRequestError, match="`top_k`") as e:
            SamplingParams(top_k=bad)
        assert e.value.field == "top_k"
    msg = common_pb2.SamplingParams(top_k=0)  # set to 0 explicitly: a bad value, not "unset"
    with pytest.raises(InvalidRequestError, match="`top_k`"):
        convert.sampling_from_pb(msg)


def test_transfer_stats_round_trip():
    from pdspark.transfer.plan import TransferStats

    stats = TransferStats(bytes=1 << 20, num_writes=8, transfer_s=0.004, prefill_s=0.8, plan_wait_s=0.01,
                          bytes_by_pool={"SWA_KV": 4096}, write_s=0.002)
    assert convert.stats_from_pb(convert.stats_to_pb(stats)) == stats


def test_the_sampling_controls_cross_the_wire_exactly_and_neutral_ones_stay_unset():
    params = SamplingParams(presence_penalty=0.1, frequency_penalty=-0.7, repetition_penalty=1.15, min_p=0.05,
                            min_tokens=3, logit_bias={5: -100.0, 9: 0.3}, banned_token_ids=(2, 8))
    assert convert.sampling_from_pb(convert.sampling_to_pb(params)) == params  # doubles: the sender's very values
    neutral = convert.sampling_to_pb(SamplingParams())
    assert not any(neutral.HasField(f) for f in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                                 "min_p", "min_tokens"))
    assert not neutral.logit_bias and not neutral.banned_token_ids
