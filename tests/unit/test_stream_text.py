"""The text a decode worker's `Generate` stream sends: a stop string never reaches it, not even in part, and its
pieces concatenate to the request's final text, also across a migration.

The decode worker's servicer (the one place that turns a request's outputs into chunks) runs here over a scripted
worker: each output adds the next tokens of a script and goes through the engine's real `StopChecker`, as the engine
appends tokens; a token is a word piece of a small tokenizer, so a stop string can start inside one token and end
inside another.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdspark.engine.request import Request
from pdspark.engine.stop_checker import StopChecker
from pdspark.rpc import convert
from pdspark.serving.decode_worker import DecodeWorker
from pdspark.serving.grpc_services import DecodeServicer
from pdspark.testing.waiting import run_within
from pdspark.types import FinishReason, RequestOutput, SamplingParams
from pdspark.v1 import worker_pb2

EOS = "<eos>"  # the scripts' end-of-sequence token; decodes to nothing, as a special token does


class PieceTokenizer:
    """Token i decodes to `pieces[i]` (EOS to nothing); not byte-level, so the engine decodes the output whole."""

    decodes_bytewise = False

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if self.pieces[i] == EOS else self.pieces[i] for i in ids)


class ScriptedDecodeWorker:
    """Answers `generate` with one output per step of `steps` (a piece, or a tuple of pieces: several tokens in
    one output, as a DSpark verify step commits), each token checked by the engine's `StopChecker`. With
    `generated` (a migrated stream), the tokens already generated are the script's first ones and it goes on after
    them, as a decode worker continues a migrated request."""

    transfers_in_flight = 0
    stable_text_of = DecodeWorker.stable_text_of  # the real decode worker's: what a migrated stream had sent

    def __init__(self, steps: list[str | tuple[str, ...]]):
        steps = [s if isinstance(s, tuple) else (s,) for s in steps]
        pieces = sorted({p for step in steps for p in step})
        self.tokenizer = PieceTokenizer(pieces)
        self.engine = SimpleNamespace(tokenizer=self.tokenizer)
        self.eos = pieces.index(EOS) if EOS in pieces else len(pieces)
        self.steps = [[pieces.index(p) for p in step] for step in steps]

    def ids(self, *pieces: str) -> list[int]:
        return [self.tokenizer.pieces.index(p) for p in pieces]

    async def generate(self, request_id, transfer_id, prompt_ids, params, prefill_address, deadline, prompt=None,
                       generated=()):
        checker = StopChecker(self.tokenizer, (self.eos,), max_model_len=10_000)
        req = Request(request_id, list(prompt_ids), params, output_token_ids=list(generated))
        skip = len(generated)
        for step in self.steps:
            tokens, skip = step[skip:], max(0, skip - len(step))
            if not tokens:
                continue
            for token in tokens:
                req.output_token_ids.append(token)
                if checker.check(req):
                    break
            yield RequestOutput(request_id, None, req.prompt_token_ids, list(req.output_token_ids), req.text,
                                req.finish_reason is not None, req.finish_reason, req.stop_reason)
            if req.finish_reason is not None:
                return
        raise AssertionError("the script ended before the request")

    def abort(self, request_id):
        return False


class CallContext:
    """The servicer context of a call without a deadline or metadata."""

    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()


def stream(worker: ScriptedDecodeWorker, params: SamplingParams, generated: list[int] | None = None
           ) -> list[worker_pb2.GenerateChunk]:
    """The chunks of one `Generate` call of the decode worker's servicer."""
    request = worker_pb2.GenerateRequest(request_id="r", transfer_id="t", prompt_token_ids=[0], prefill_address="p",
                                         sampling=convert.sampling_to_pb(params), generated_token_ids=generated or [])

    async def collect():
        return [chunk async for chunk in DecodeServicer(worker).Generate(request, CallContext())]

    return run_within(collect(), 10)


def final_output(worker: ScriptedDecodeWorker, params: SamplingParams) -> RequestOutput:
    """The request's last output: its non-streamed text."""

    async def last():
        return [out async for out in worker.generate("r", "t", [0], params, "p", None)][-1]

    return run_within(last(), 10)


def texts(chunks) -> list[str]:
    return [c.text for c in chunks]


def ids(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def params(stop, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop)


@pytest.mark.parametrize("steps, stop, text", [
    (["Hello", " wor", "ld", "!"], "lo w", "Hel"),  # over 2 tokens, starting inside the first
    (["x = ", "fo", "o", "(", "bar)"], "foo(", "x = "),  # over 3 tokens
    (["x = ", ("fo", "o"), "(", "bar)"], "foo(", "x = "),  # over 3 tokens, 2 of them in one output
])
def test_a_stop_string_spanning_tokens_never_reaches_the_stream(steps, stop, text):
    worker = ScriptedDecodeWorker(steps)
    chunks = stream(worker, params([stop]))
    final = final_output(worker, params([stop]))
    assert (final.text, final.finish_reason, final.stop_reason) == (text, FinishReason.STOP, stop)
    assert "".join(texts(chunks)) == text
    # Every token id is sent as generated, the stop string's too.
    assert ids(chunks) == final.token_ids
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])


def test_a_partial_match_is_held_back_until_it_can_no_longer_start_the_stop_string():
    worker = ScriptedDecodeWorker(["x", "ab", "c", "yz"])
    chunks = stream(worker, params(["abd"], max_tokens=4))
    assert texts(chunks) == ["x", "", "abc", "yz"]
    assert ids(chunks) == worker.ids("x", "ab", "c", "yz")
    assert "".join(texts(chunks)) == final_output(worker, params(["abd"], max_tokens=4)).text == "xabcyz"


@pytest.mark.parametrize("steps, stop, sent, text", [
    # The longest suffix that starts any of them is held: "abc" starts two.
    (["1", "a", "b", "c", "d", "e"], ["abX", "abcY", "abcd"], ["1", "", "", "", ""], "1"),
    (["1", "a", "b", "c", "Z", "e"], ["abX", "abcY", "abcd"], ["1", "", "", "", "abcZ"], "1abcZ"),
    # "ab" (of "abcd") is held though "b" alone starts "bc"; "bc" then ends the request inside it.
    (["x", "a", "b", "c"], ["bc", "abcd"], ["x", "", "", "a"], "xa"),
    # A stop string that overlaps itself: "aa" stays held while "a" after "a" comes.
    (["x", "a", "a", "a", "b"], ["aab"], ["x", "", "", "a", ""], "xa"),
])
def test_stop_strings_with_shared_prefixes(steps, stop, sent, text):
    worker = ScriptedDecodeWorker(steps)
    chunks = stream(worker, params(stop, max_tokens=5))
    assert texts(chunks) == sent
    assert "".join(sent) == final_output(worker, params(stop, max_tokens=5)).text == text


@pytest.mark.parametrize("steps, finish, sent", [
    (["a", "st", "o"], (FinishReason.LENGTH, None), ["a", "", "sto"]),  # max_tokens
    (["a", "st", EOS], (FinishReason.STOP, "eos"), ["a", "", "st"]),  # EOS
])
def test_an_end_for_another_reason_releases_the_held_text(steps, finish, sent):
    worker = ScriptedDecodeWorker(steps)
    chunks = stream(worker, params(["stop"], max_tokens=3))
    final = final_output(worker, params(["stop"], max_tokens=3))
    reason, stop_reason = finish
    assert (final.finish_reason, final.stop_reason) == (reason, worker.eos if stop_reason == "eos" else None)
    assert texts(chunks) == sent
    assert "".join(sent) == final.text


def test_the_earliest_stop_string_in_the_text_ends_it_whatever_their_order():
    worker = ScriptedDecodeWorker(["x", "abcd", "e"])  # one token completes both, "ab" first in the text
    final = final_output(worker, params(["cd", "ab"]))
    assert (final.text, final.stop_reason) == ("x", "ab")
    assert "".join(texts(stream(worker, params(["cd", "ab"])))) == "x"


@pytest.mark.parametrize("stop, text", [
    (["abc"], "x"),  # the held "ab" turns out to start the stop string after the migration: never sent
    (["abd"], "xabcy"),  # ... or not: released by the next worker, once
])
def test_a_migrated_stream_goes_on_from_the_text_sent_before(stop, text):
    """The router migrates a stream with the tokens it has received; the text the first worker held back with
    them is sent by the next one, exactly once."""
    worker = ScriptedDecodeWorker(["x", "a", "b", "c", "y"])
    p = params(stop, max_tokens=5)
    before = stream(worker, p)[:3]  # the first worker failed after 3 outputs: "x", "a", "b"
    assert texts(before)[1:] == ["", ""]  # "ab" was held
    after = stream(worker, p, generated=ids(before))
    assert "".join(texts(before) + texts(after)) == final_output(worker, p).text == text
    assert ids(before) + ids(after) == final_output(worker, p).token_ids
