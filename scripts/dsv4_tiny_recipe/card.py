"""The model card (the asset directory's README.md), rendered from the run record."""

from __future__ import annotations

import json
from pathlib import Path

from .console import hms
from .recipe import CHAT_TEMPLATE, SIZE_BUDGET, SPECIAL_TOKENS, TARGET_ARCH, VOCAB_SIZE


def file_sizes(outdir: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(outdir.iterdir()) if f.is_file() and f.name != "README.md"}


def write_card(outdir: Path, record: dict) -> None:
    """README.md from the recorded run. Rendered twice so the total it states includes the card itself."""
    sizes = file_sizes(outdir)
    card = render_card(record, sizes, total=0)
    for _ in range(2):
        card = render_card(record, sizes, total=sum(sizes.values()) + len(card.encode()))
    (outdir / "README.md").write_text(card)


def render_card(record: dict, sizes: dict[str, int], total: int) -> str:
    target = record.get("target", {})
    reproduce = "python scripts/train_dsv4_tiny.py --stage all" + (f" --steps {target['steps']}" if target else "")
    sections = [
        ["# dsv4-tiny", "", *INTRO, "", f"Reproduce: `{reproduce}`"],
        ["## Config", "", *config_lines(target)],
        ["## Corpus", "", *[f"- {k}: {v}" for k, v in record.get("corpus", {}).items()]],
        ["## Tokenizer", "", *tokenizer_lines(record.get("tokenizer", {}))],
        ["## Training", "", *training_lines(target), *all_stage_lines(record)],
        ["## Evaluation", "", *eval_lines(record.get("eval", {}))],
        ["## Size", "", *size_lines(target, sizes, total)],
        ["## DSpark draft", "", *draft_lines(record.get("draft", {}))],
    ]
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


INTRO = [
    "A tiny DeepSeek-V4 model (transformers `DeepseekV4ForCausalLM`) trained from scratch on CPU on the Python",
    "standard library, shipped as pdspark's default model. Every V4 mechanism is present: sliding-window",
    "attention, CSA (compressed sparse attention with the lightning indexer), HCA (heavily compressed",
    "attention), mHC hyper-connections, hash-routed and learned-routed MoE with sqrtsoftplus scoring.",
    "It writes Python-looking text; it is a test fixture, not a useful model.",
]


def config_lines(target: dict) -> list[str]:
    cfg = target.get("config", TARGET_ARCH)
    return [
        *[f"- `{k}`: {json.dumps(v)}" for k, v in cfg.items()],
        "- `tid2eid` (hash routing): seeded random table, distinct experts per token, frozen",
    ]


def tokenizer_lines(tok: dict) -> list[str]:
    return [
        f"- {tok.get('type', 'byte-level BPE')}; vocab {VOCAB_SIZE}, trained on the train split only",
        f"- special tokens (ids 0-7): {', '.join(f'`{t}`' for t in SPECIAL_TOKENS)}; no post-processor",
        "- `<|mask|>` is reserved for the speculative drafter and never occurs in the training data",
        "- chat template: `" + json.dumps(CHAT_TEMPLATE) + "`",
    ]


def draft_lines(draft: dict) -> list[str]:
    """The speculative drafter's recipe and measured acceptance (written by scripts/train_dspark_draft.py)."""
    if not draft:
        return ["DSpark draft: (to be added)"]
    r = draft.get("recipe", {})
    ev = draft.get("eval", {})
    lines = [
        f"- reproduce: `python scripts/train_dspark_draft.py --steps {draft.get('steps')}` (after the target)",
        f"- {r.get('num_stages')} sliding-window DSV4 stages (mHC, dense SwiGLU of {r.get('intermediate_size')}), "
        f"features after target layers {r.get('target_layer_ids')}, gamma {r.get('gamma')}, Markov rank "
        f"{r.get('markov_rank')}, mask token `<|mask|>`; shares the target's embedding and LM head; "
        f"{draft.get('parameters', 0):,} parameters (`dspark.safetensors`, `mtp.*` names, bf16)",
        f"- data: {r.get('num_generated')} target continuations ({r.get('gen_len')} tokens after "
        f"{r.get('prompt_len')}-token train-split prompts; half greedy, half sampled at 0.8) + {r.get('num_raw')} raw "
        f"train-split windows; target features captured by pdspark's own forward ({draft.get('data_seconds', 0):.0f}s)",
        f"- objective: 0.1 CE + 0.9 L1 to the target distribution, position weights exp(-j/{r.get('decay')}), "
        f"{r.get('anchors_per_seq')} anchors per sequence, batch {r.get('batch_size')}, AdamW lr {r.get('lr')}, "
        f"cosine; {draft.get('steps')} steps in {hms(draft.get('seconds', 0))}; final loss "
        f"{draft.get('final_loss', 0):.4f}, teacher-forced expected acceptance length {draft.get('tau_prob', 0):.2f}",
    ]
    if ev:
        per_pos = ", ".join(f"{x:.2f}" for x in ev.get("acceptance_per_position", []))
        lines += [
            f"- measured (greedy speculative decoding, {ev.get('prompts')} held-out prompts of "
            f"{ev.get('prompt_len')} tokens, {ev.get('max_tokens')} new tokens each, batch 1): mean acceptance length "
            f"**{ev.get('mean_acceptance_length', 0):.2f}** tokens per verify step over {ev.get('verify_steps')} "
            f"steps; acceptance by draft position: {per_pos}",
        ]
    if "bench" in draft:
        lines.append(f"- {draft['bench']}")
    return lines


def all_stage_lines(record: dict) -> list[str]:
    if "all_wall_s" not in record:
        return []
    return [f"- `--stage all` wall time (tokenizer + target + eval): {hms(record['all_wall_s'])}"]


def size_lines(target: dict, sizes: dict[str, int], total: int) -> list[str]:
    lines = []
    if target:
        params = target["parameters"]
        lines += [
            f"- parameters: {params['total']:,} total, {params['active_per_token']:,} active per token",
            f"- weights dtype: {target['weights_dtype']} (norms, mHC, sinks, position biases and router bias: fp32)",
        ]
    lines += [f"- `{name}`: {size:,} bytes" for name, size in sizes.items()]
    return [*lines, f"- asset directory total (with this card): {total:,} bytes (budget {SIZE_BUDGET:,})"]


def training_lines(target: dict) -> list[str]:
    if not target:
        return ["(not yet trained)"]
    opt = target["optimizer"]
    phases = ", ".join(
        f"{p['name']}: {p['steps']} steps x {p['batch']} x {p['seq_len']} tokens" for p in target["phases"]
    )
    return [
        f"- steps: {target['steps']} ({phases}); {target['train_tokens_seen']:,} tokens seen of "
        f"{target['train_split_tokens']:,} in the train split",
        f"- AdamW lr {opt['lr']}, betas {opt['betas']}, weight decay {opt['weight_decay']} on matrices, "
        f"{opt['schedule']}, warmup {opt['warmup_frac']:.0%}, grad clip {opt['grad_clip']}, fp32 on CPU, "
        f"{target['threads']} threads, seed {target['seed']}",
        f"- lightning indexer trained by KL to the main attention (weight {opt['indexer_loss_weight']}); "
        f"routed-MoE router bias updated loss-free at rate {opt['router_bias_rate']}",
        f"- final train loss (nats/token, mean of the last {target['final_loss_window']} steps of each phase): "
        + ", ".join(f"{k} {v}" for k, v in target["final_train_loss"].items()),
        f"- wall time: {hms(target['train_wall_s'])} training, {hms(target['stage_wall_s'])} for the stage",
    ]


def eval_lines(ev: dict) -> list[str]:
    if not ev:
        return ["(not yet evaluated)"]
    lines = [
        f"- held-out bits per byte: **{ev['bits_per_byte']}** (first {ev['scored_tokens']:,} held-out tokens, "
        "windows of 512; NLL in nats / (ln 2 x UTF-8 bytes of the predicted tokens))",
    ]
    lines += [
        f"- windows of {name.removeprefix('seq')}: {m['bits_per_byte']} bits/byte, {m['nats_per_token']} nats/token "
        f"over {m['predicted_tokens']:,} predicted tokens ({m['bytes']:,} bytes)"
        for name, m in ev["by_context"].items()
    ]
    sample = ev["sample"]
    lines += [
        f"- greedy sample ({sample['max_new_tokens']} new tokens; cached and uncached decoding agree: "
        f"{sample['cached_matches_uncached']}):",
        "",
        "```python",
        sample["prompt"] + sample["completion"],
        "```",
    ]
    return lines
