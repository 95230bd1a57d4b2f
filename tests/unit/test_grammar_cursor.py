"""`StructuredOutputs` and the grammar cursor (`engine/grammar.py`), on dsv4-tiny's tokenizer: a cursor asked about
drafts beyond its committed output (a verify window, the drafter's rows, drafts it refuses) gives exactly the mask a
fresh cursor gives after the same output; a token budget ends where it ends in plain decoding; special tokens never
stand for their text; bad specs are refused naming the field; the wire form round-trips."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pdspark.assets import resolve_model
from pdspark.engine.grammar import Grammars
from pdspark.errors import InvalidRequestError
from pdspark.model.tokenizer import Tokenizer
from pdspark.rpc import convert
from pdspark.types import SamplingParams, StructuredOutputs

EOS = 1
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = Tokenizer.from_dir(resolve_model("dsv4-tiny"), (EOS,))
    return Grammars(tok, tok.vocab_size, (EOS,))


def _allowed(cursor, output: list[int], vocab: int, committed: int | None = None) -> torch.Tensor:
    logits = torch.zeros(1, vocab)
    cursor.constrain(logits, output, len(output) if committed is None else committed)
    return logits[0] > float("-inf")


def _walk(grammars: Grammars, so: StructuredOutputs, rng: random.Random, steps: int) -> list[int]:
    """A random output the grammar accepts (each token drawn among the allowed ones)."""
    cursor, out = grammars.cursor(so), []
    for _ in range(steps):
        allowed = _allowed(cursor, out, grammars.vocab_size).nonzero().flatten().tolist()
        token = rng.choice(allowed)
        if token == EOS:
            break
        out.append(token)
    return out


BUDGETED = StructuredOutputs.of(structural_tag={"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "tag", "begin": "", "end": "</think>", "content": {"type": "any_text", "excludes": ["</think>"],
                                                                 "max_tokens": 5}},
    {"type": "regex", "pattern": "[0-9]{1,3}"}]}})


@pytest.mark.parametrize("so", [StructuredOutputs.of(json=SCHEMA), StructuredOutputs.of(regex=r"[a-z]{2,5}-[0-9]+"),
                                StructuredOutputs.of(grammar='root ::= ("ab" | "cd")+ "!"'), BUDGETED],
                         ids=["json", "regex", "grammar", "token_budget"])
def test_rows_with_drafts_get_a_fresh_cursors_mask(grammars, so):
    """Verify-like queries: the committed output grows along a valid path; each step asks about up to 4 drafts past
    it (some replaced by a random token, which the grammar may refuse), row by row, as a verify window and the
    drafter do; every row's mask is a fresh cursor's after the same output, all of it committed."""
    rng = random.Random(7)
    path = _walk(grammars, so, rng, 40)
    assert len(path) >= 4
    cursor, committed = grammars.cursor(so), 0
    while committed < len(path):
        drafts = path[committed : committed + rng.randint(0, 4)]
        if drafts and rng.random() < 0.3:
            drafts[rng.randrange(len(drafts))] = rng.randrange(grammars.vocab_size)
        for j in range(len(drafts) + 1):
            target = path[:committed] + drafts[:j]
            want = _allowed(grammars.cursor(so), target, grammars.vocab_size)
            assert torch.equal(_allowed(cursor, target, grammars.vocab_size, committed), want)
        committed += rng.randint(1, 3)


def test_special_tokens_never_stand_for_their_text_and_eos_ends_a_complete_output(grammars):
    so = StructuredOutputs.of(json=SCHEMA)
    cursor = grammars.cursor(so)
    start = _allowed(cursor, [], grammars.vocab_size)
    assert not start[:8].any()  # `<|bos|>` .. `<|end|>`: never inside the JSON
    text = json.dumps({"name": "ab", "n": 7})
    done = grammars._tokenizer.encode(text, add_special_tokens=False)
    end = _allowed(cursor, done, grammars.vocab_size)
    assert end[EOS] and end.sum() == 1  # complete: only EOS


def test_bad_specs_are_refused_naming_the_field(grammars):
    for so, field in [(StructuredOutputs.of(regex="[a-"), "structured_outputs.regex"),
                      (StructuredOutputs.of(json={"type": "objec"}), "structured_outputs.json"),
                      (StructuredOutputs.of(grammar='root ::= "a" |'), "structured_outputs.grammar")]:
        with pytest.raises(InvalidRequestError) as e:
            grammars.compile(so)
        assert e.value.field == field and f"invalid `{field}`" in str(e.value)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs.of(regex="a", grammar="root ::= \"a\"")
    with pytest.raises(InvalidRequestError, match="non-empty JSON array"):
        StructuredOutputs.of(choice=[])
    with pytest.raises(InvalidRequestError, match="a JSON object"):
        StructuredOutputs("json", "[1, 2]")
    with pytest.raises(InvalidRequestError, match="one of json"):
        StructuredOutputs("yaml", "")


def test_a_compiled_grammar_is_cached_per_constraint(grammars):
    so = StructuredOutputs.of(choice=["yes", "no"])
    assert grammars.compile(so) is grammars.compile(StructuredOutputs.of(choice=["yes", "no"]))
    assert grammars.compile(so) is not grammars.compile(StructuredOutputs.of(choice=["no", "yes"]))


@pytest.mark.parametrize("so", [StructuredOutputs.of(json=SCHEMA), StructuredOutputs.of(json_object=True),
                                StructuredOutputs.of(choice=["a|b", "c"]), None])
def test_the_constraint_round_trips_the_wire(so):
    params = SamplingParams(temperature=0, structured_outputs=so)
    assert convert.sampling_from_pb(convert.sampling_to_pb(params)).structured_outputs == so
