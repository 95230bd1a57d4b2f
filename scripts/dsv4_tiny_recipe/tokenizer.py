"""The byte-level BPE tokenizer: trained on the train split, checked, saved with its config, loaded, and used to
encode documents into one token stream (the tokenizer stage)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from .console import hms, log
from .corpus import load_split
from .recipe import BOS, CHAT_TEMPLATE, EOS, MASK, PAD, SPECIAL_TOKENS, TARGET_ARCH, VOCAB_SIZE


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
