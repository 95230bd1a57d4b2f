"""lm-evaluation-harness against a pdspark cluster, side by side with lm-eval's own `hf` backend on the same model.

One `pdspark up` (random free loopback ports) serves lm-eval's `local-completions` backend (`tokenizer_backend=remote`:
the router's /tokenizer_info, /tokenize and /detokenize) and is stopped by PID; then lm-eval's `hf` backend loads the
same checkpoint in transformers (float32, CPU). Each task of make_data.py runs once per backend, as its own lm-eval
process (each task has its own --limit), with --log_samples. The report: a table of every metric (pdspark, hf,
ratio); for the loglikelihood tasks, the per-sample agreement (relative difference of each sample's loglikelihood
between the two backends; target 1e-3); bits per byte against the model card's held-out figure; HumanEval pass@1
and how many generations are identical. bench/results/evals.json and evals.png; lm-eval's own output and logs in
bench/results/evals/ (git-ignored).

lm-eval runs from its own venv (`make bench-evals` creates .venv-evals/); this script runs with the project's
python. dsv4-tiny is a 7M-parameter model trained on the standard library: its HumanEval pass@1 is ~0, and the
task is there to drive the generation path (stop strings, greedy decoding), not to rank the model.

    python bench/evals/run_evals.py [--lm-eval .venv-evals/bin/lm_eval] [--data ~/.cache/pdspark/evals]
        [--ppl-limit 46] [--next-line-limit 200] [--humaneval-limit 20] [--backends pdspark,hf]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))  # the benches' shared helpers (console, report) live in bench/

from pdspark.assets import resolve_model  # noqa: E402
from pdspark.launch.service_process import ServiceProcess, spawn_service, wait_ready  # noqa: E402

from console import Stopped, log, stop_on_signals  # noqa: E402
from report import RESULTS, figure, paired_bars, save_figure, write_json  # noqa: E402

ROOT = BENCH.parent
RAW = RESULTS / "evals"  # lm-eval's output directories and console logs (large; git-ignored)
PPL, NEXT_LINE, HUMANEVAL = "pdspark_stdlib_ppl", "pdspark_stdlib_next_line", "pdspark_humaneval"
TASKS = (PPL, NEXT_LINE, HUMANEVAL)
METRICS = {PPL: ("bits_per_byte", "byte_perplexity", "word_perplexity"), NEXT_LINE: ("acc", "acc_norm"),
           HUMANEVAL: ("pass@1",)}
AGREEMENT_TARGET = 1e-3  # largest relative difference of a sample's loglikelihood we call agreement
# lm-eval reaches no network: the datasets are local JSON files and the model a local directory.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_cluster(args: argparse.Namespace) -> tuple[ServiceProcess, str]:
    """`pdspark up` on free ports (the machine is shared; a fixed port may be someone else's), ready and healthy."""
    cmd = ["up", "--model", args.model, "--port", "0", "--grpc-port", "0", *shlex.split(args.up_args)]
    log(f"starting pdspark {' '.join(cmd)}")
    t0 = time.monotonic()
    service = spawn_service("pdspark up", cmd)
    wait_ready(service, timeout=args.start_timeout)  # stops the child and raises if it never gets ready
    http = service.info["http"]
    wait_health(http, args.start_timeout)
    log(f"cluster ready at {http} in {time.monotonic() - t0:.1f}s (pid {service.pid})")
    return service, http


def wait_health(http: str, timeout: float) -> None:
    """The ready line means the services started; /health says a prefill and a decode worker serve (200)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{http}/health", timeout=5) as resp:
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{http}/health not 200 after {timeout:.0f}s")
        time.sleep(0.5)


def served_model(http: str) -> str:
    """The `model` every request must name: the served model's id from /v1/models."""
    with urllib.request.urlopen(f"{http}/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def task_limit(args: argparse.Namespace, task: str) -> int:
    return {PPL: args.ppl_limit, NEXT_LINE: args.next_line_limit, HUMANEVAL: args.humaneval_limit}[task]


def max_length(args: argparse.Namespace, backend: str, task: str) -> int:
    """lm-eval's `max_length` model argument that gives both backends the same windows and truncation.

    Rolling windows predict `max_length` tokens on hf but `max_length - 2` on the API backends (one position is
    kept for the generated token, one for the context token), so the API gets 2 more. A multiple-choice request
    is cut to its last max_length + 1 tokens on hf and max_length - 1 on the API: the same 2. Generation has its own,
    longer limit: a HumanEval prompt must not be truncated.
    """
    if task == HUMANEVAL:
        return args.gen_max_length
    return args.window + 2 if backend == "pdspark" else args.window


def model_args(args: argparse.Namespace, backend: str, task: str, http: str | None, model: str | None) -> str:
    # The prefix token of a document's first window: <|eos|> (id 1) on both, the separator the model was trained
    # after (the corpus is files joined with <|eos|>). Left to lm-eval, hf would take <|bos|> (id 0, never trained
    # on) and the API backend <|eos|> (its `bos_token_id or eos_token_id` skips an id of 0): different first tokens.
    length = max_length(args, backend, task)
    if backend == "pdspark":
        return (f"model={model},base_url={http}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
                f"num_concurrent={args.num_concurrent},max_length={length},"
                f"custom_prefix_token_id={args.prefix_token_id},max_retries=1,timeout={args.request_timeout}")
    return (f"pretrained={resolve_model(args.model)},dtype=float32,max_length={length},"
            f"prefix_token_id={args.prefix_token_id}")


def lm_eval_command(args: argparse.Namespace, backend: str, task: str, out: Path, http: str | None = None,
                    model: str | None = None) -> list[str]:
    cmd = [args.lm_eval, "--model", "local-completions" if backend == "pdspark" else "hf",
           "--model_args", model_args(args, backend, task, http, model), "--tasks", task,
           "--include_path", str(args.data), "--limit", str(task_limit(args, task)),
           "--log_samples", "--output_path", str(out)]
    # device and batch size go as CLI flags: lm-eval passes its own values for them besides model_args.
    if backend == "hf":
        cmd += ["--device", "cpu", "--batch_size", str(args.hf_batch_size)]
    else:
        cmd += ["--batch_size", str(args.batch_size)]
    return cmd


def last_progress(log_path: Path) -> str:
    """lm-eval's latest progress: the last state of each of its (at most 2) tqdm bars, else its last log line.

    tqdm redraws with \\r and moves between nested bars with ANSI cursor codes; a rolling task draws an outer bar
    (documents) and an inner one (one document's windows), and the outer one is the useful count.
    """
    with log_path.open("rb") as f:
        f.seek(max(0, log_path.stat().st_size - 8192))
        tail = _ANSI.sub("", f.read().decode("utf-8", errors="replace"))
    pieces = [p.strip() for p in re.split(r"[\r\n]", tail) if p.strip()]
    bars: dict[str, str] = {}  # total -> its latest piece, newest first
    for piece in reversed(pieces):
        m = _BAR.search(piece)
        if m and len(bars) < 2:
            bars.setdefault(m.group(1), piece[:110])
    if bars:
        return " || ".join(reversed(bars.values()))
    return pieces[-1][:160] if pieces else ""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_BAR = re.compile(r"\d+/(\d+) \[")  # tqdm's "n/total [elapsed<remaining"


def run_lm_eval(cmd: list[str], log_path: Path, label: str, timeout: float) -> tuple[int | None, float]:
    """(exit status or None when it ran past `timeout`, seconds), with a progress line every 15 s."""
    log(f"{label}: {shlex.join(cmd)}")
    t0 = time.monotonic()
    with log_path.open("w") as out:
        # A session of its own: on timeout or Ctrl-C its whole group (lm-eval and its workers) is stopped.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **OFFLINE_ENV}, start_new_session=True)
        try:
            next_note = t0 + 15
            while proc.poll() is None:
                time.sleep(0.5)
                now = time.monotonic()
                if now - t0 > timeout:
                    log(f"{label}: ran past {timeout:.0f}s, stopped")
                    return None, now - t0
                if now >= next_note:
                    log(f"  {label} {now - t0:5.0f}s | {last_progress(log_path)}")
                    next_note = now + 15
        finally:
            stop_group(proc)
    seconds = time.monotonic() - t0
    log(f"{label}: exit {proc.returncode} in {seconds:.1f}s (log {log_path})")
    return proc.returncode, seconds


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def read_output(out: Path, task: str) -> tuple[dict, list[dict]]:
    """(lm-eval's results entry for `task`, its logged samples in doc order) from one run's output directory."""
    results_files = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    samples_files = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
    if not results_files or not samples_files:
        return {}, []
    results = json.loads(Path(results_files[-1]).read_text())["results"].get(task, {})
    with open(samples_files[-1]) as f:
        samples = sorted((json.loads(line) for line in f if line.strip()), key=lambda s: s["doc_id"])
    return results, samples


def sample_logliks(sample: dict) -> list[float]:
    """A sample's loglikelihoods: one per document (rolling) or one per choice (multiple choice)."""
    values = []
    for resp in sample["filtered_resps"]:
        value = resp[0] if isinstance(resp, list) else resp  # multiple choice: [loglik, is_greedy]
        values.append(float(value))
    return values


def agreement(pd_samples: list[dict], hf_samples: list[dict]) -> dict:
    """Relative differences |pdspark - hf| / |hf| of every loglikelihood of the samples both runs have."""
    hf_by_id = {s["doc_id"]: s for s in hf_samples}
    rel: list[float] = []
    same_choice = compared = 0
    for s in pd_samples:
        other = hf_by_id.get(s["doc_id"])
        if other is None:
            continue
        a, b = sample_logliks(s), sample_logliks(other)
        rel += [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)]
        compared += 1
        same_choice += max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
    if not rel:
        return {}
    return {"samples": compared, "values": len(rel), "max_rel": max(rel), "median_rel": statistics.median(rel),
            "over_target": sum(x > AGREEMENT_TARGET for x in rel), "within_target": max(rel) <= AGREEMENT_TARGET,
            "same_argmax": same_choice / compared, "rel": rel}


def generation_agreement(pd_samples: list[dict], hf_samples: list[dict]) -> dict:
    """How many greedy generations are the same text on both backends."""
    hf_by_id = {s["doc_id"]: s for s in hf_samples}
    pairs = [(s["filtered_resps"][0], hf_by_id[s["doc_id"]]["filtered_resps"][0])
             for s in pd_samples if s["doc_id"] in hf_by_id]
    return {"samples": len(pairs), "identical": sum(a == b for a, b in pairs)}


def card_bits_per_byte(model_dir: str) -> float | None:
    """The held-out bits per byte the model card reports (README.md, section Evaluation)."""
    card = Path(model_dir) / "README.md"
    if not card.exists():
        return None
    m = re.search(r"held-out bits per byte: \*\*([0-9.]+)\*\*", card.read_text())
    return float(m.group(1)) if m else None


def run_backend(args: argparse.Namespace, backend: str, http: str | None, model: str | None) -> dict:
    """Every task on one backend: {task: {"results", "samples", "seconds", "exit"}}."""
    runs = {}
    for k, task in enumerate(TASKS, 1):
        out = RAW / backend / task
        shutil.rmtree(out, ignore_errors=True)  # one run's files only: read_output takes what it finds there
        out.mkdir(parents=True)
        label = f"[{backend} {k}/{len(TASKS)}] {task} (limit {task_limit(args, task)})"
        cmd = lm_eval_command(args, backend, task, out, http, model)
        rc, seconds = run_lm_eval(cmd, out / "lm_eval.log", label, args.task_timeout)
        results, samples = read_output(out, task)
        if rc != 0 or not results:
            log(f"{label}: no result; last lines of {out / 'lm_eval.log'}:\n{tail_text(out / 'lm_eval.log')}")
        runs[task] = {"results": results, "samples": samples, "seconds": seconds, "exit": rc}
    return runs


def read_backend(backend: str) -> dict:
    """A backend's tasks as an earlier run left them in bench/results/evals/ (--report-only; no timings)."""
    runs = {}
    for task in TASKS:
        results, samples = read_output(RAW / backend / task, task)
        runs[task] = {"results": results, "samples": samples, "seconds": None, "exit": 0 if results else None}
    return runs


def tail_text(path: Path, n: int = 20) -> str:
    lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
    return "\n".join(lines[-n:])


def run_pdspark(args: argparse.Namespace) -> dict:
    service, http = start_cluster(args)
    try:
        model = served_model(http)
        return run_backend(args, "pdspark", http, model)
    finally:
        rc = service.stop()  # by PID: SIGTERM to `pdspark up`, which stops its services
        log(f"pdspark up (pid {service.pid}) stopped (rc {rc})")


def metric(run: dict | None, task: str, name: str) -> float | None:
    value = (run or {}).get(task, {}).get("results", {}).get(f"{name},none")
    return float(value) if isinstance(value, int | float) else None


def metric_rows(runs: dict) -> list[dict]:
    rows = []
    for task in TASKS:
        for name in METRICS[task]:
            pd, hf = metric(runs.get("pdspark"), task, name), metric(runs.get("hf"), task, name)
            ratio = pd / hf if pd is not None and hf else None
            rows.append({"task": task, "metric": name, "pdspark": pd, "hf": hf, "ratio": ratio})
    return rows


def _fmt(v: float | None, digits: int = 4) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def report_lines(args: argparse.Namespace, rows: list[dict], agree: dict, gen: dict, card_bpb: float | None,
                 runs: dict) -> list[str]:
    lines = ["| task | metric | pdspark | hf | pdspark / hf |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['task']} | {r['metric']} | {_fmt(r['pdspark'])} | {_fmt(r['hf'])} | {_fmt(r['ratio'])} |"
              for r in rows]
    lines += ["", "| task | samples compared | loglikelihoods | max rel. diff | median rel. diff | "
              f"over {AGREEMENT_TARGET:g} | same argmax |", "|---|---:|---:|---:|---:|---:|---:|"]
    for task, a in agree.items():
        if a:
            lines.append(f"| {task} | {a['samples']} | {a['values']} | {a['max_rel']:.2e} | {a['median_rel']:.2e} | "
                         f"{a['over_target']} | {a['same_argmax']:.0%} |")
    if gen:
        lines += ["", f"HumanEval: {gen['identical']}/{gen['samples']} greedy generations identical on both "
                  "backends (a 7M-parameter model's pass@1 is ~0 by design)."]
    lines += ["", bpb_note(args, rows, card_bpb, runs)]
    lines += ["", "seconds per lm-eval run: " + ", ".join(
        f"{b} {t.removeprefix('pdspark_')} {_fmt(runs[b][t]['seconds'], 0)}" for b in runs for t in runs[b])]
    return lines


def bpb_note(args: argparse.Namespace, rows: list[dict], card_bpb: float | None, runs: dict) -> str:
    bpb = {r["task"]: r for r in rows if r["metric"] == "bits_per_byte"}.get(PPL, {})
    docs = max((len(tasks[PPL]["samples"]) for tasks in runs.values()), default=0)
    return (f"bits per byte over the first {docs} held-out files: pdspark {_fmt(bpb.get('pdspark'))}, hf "
            f"{_fmt(bpb.get('hf'))}; model card {_fmt(card_bpb)} (first 204,800 tokens of the packed held-out "
            f"stream, windows of 512). lm-eval scores each file on its own, from an <|eos|> prefix, in windows that "
            f"each predict {args.window} tokens with one token of context carried over from the window before; the "
            "card cuts the stream of files joined by <|eos|> into independent 512-token windows (511 predictions "
            "each, windows cross file boundaries, <|eos|> predictions counted).")


def plot(rows: list[dict], agree: dict, title: str) -> None:
    fig, (ax_m, ax_a) = figure(ncols=2, width=11)
    shown = [r for r in rows if r["metric"] in ("bits_per_byte", "acc", "acc_norm", "pass@1")]
    paired_bars(ax_m, [f"{r['task'].removeprefix('pdspark_')}\n{r['metric']}" for r in shown],
                [r["pdspark"] or 0.0 for r in shown], [r["hf"] or 0.0 for r in shown], ("pdspark", "hf"), "value")
    for task, a in agree.items():
        if a:
            rel = sorted(max(x, 1e-12) for x in a["rel"])
            ax_a.plot(rel, [(i + 1) / len(rel) for i in range(len(rel))], label=task.removeprefix("pdspark_"))
    ax_a.axvline(AGREEMENT_TARGET, color="grey", linestyle="--", label=f"target {AGREEMENT_TARGET:g}")
    ax_a.set_xscale("log")
    ax_a.set_xlabel("|pdspark - hf| / |hf| per loglikelihood")
    ax_a.set_ylabel("fraction of loglikelihoods")
    ax_a.legend(fontsize=8)
    save_figure(fig, "evals", title)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm-eval", default=str(ROOT / ".venv-evals" / "bin" / "lm_eval"), help="lm-eval's CLI")
    p.add_argument("--data", type=Path, default=Path.home() / ".cache" / "pdspark" / "evals",
                   help="make_data.py's output directory (task YAMLs and JSONL)")
    p.add_argument("--model", default="dsv4-tiny", help="shipped model name or checkpoint directory")
    p.add_argument("--backends", type=lambda s: s.split(","), default=["pdspark", "hf"],
                   help="comma-separated: pdspark, hf")
    p.add_argument("--ppl-limit", type=int, default=46,
                   help="held-out files scored (relative-path order; 46 files are ~209k tokens, the span of the "
                        "card's 204,800)")
    p.add_argument("--next-line-limit", type=int, default=200, help="next-line items (4 loglikelihoods each)")
    p.add_argument("--humaneval-limit", type=int, default=20, help="HumanEval problems (HumanEval/0 onwards)")
    p.add_argument("--window", type=int, default=512, help="tokens predicted per rolling window (the card's 512)")
    p.add_argument("--gen-max-length", type=int, default=2048, help="HumanEval: prompt + generation limit, tokens")
    p.add_argument("--prefix-token-id", type=int, default=1, help="token before a document's first window (<|eos|>)")
    p.add_argument("--num-concurrent", type=int, default=4, help="pdspark: requests lm-eval keeps in flight")
    p.add_argument("--batch-size", type=int, default=1, help="pdspark: prompts per /v1/completions request")
    p.add_argument("--hf-batch-size", type=int, default=1, help="hf: batch size (1: no padding in the comparison)")
    p.add_argument("--request-timeout", type=int, default=600, help="pdspark: seconds per request")
    p.add_argument("--task-timeout", type=float, default=1800, help="limit of one lm-eval run, s")
    p.add_argument("--start-timeout", type=float, default=300, help="limit for `pdspark up` to be healthy, s")
    p.add_argument("--up-args", default="", help="extra `pdspark up` flags")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: report (table, JSON, plot) from lm-eval's output of the last run")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if shutil.which(args.lm_eval) is None:
        log(f"lm-eval not found at {args.lm_eval!r}: run `make bench-evals` (it creates .venv-evals/)")
        return 2
    if not (args.data / f"{PPL}.yaml").exists():
        log(f"no task YAMLs in {args.data}: run `.venv-evals/bin/python bench/evals/make_data.py --out {args.data}`")
        return 2
    stop_on_signals()  # Ctrl-C and SIGTERM unwind through the finally blocks that stop lm-eval and the cluster
    t0 = time.monotonic()
    runs: dict[str, dict] = {}
    if args.report_only:
        runs = {b: read_backend(b) for b in args.backends}
    else:
        if "pdspark" in args.backends:
            runs["pdspark"] = run_pdspark(args)
        if "hf" in args.backends:  # after the cluster is gone: the two never share the CPUs
            runs["hf"] = run_backend(args, "hf", None, None)
    both = "pdspark" in runs and "hf" in runs
    agree = {t: agreement(runs["pdspark"][t]["samples"], runs["hf"][t]["samples"]) for t in (PPL, NEXT_LINE)} \
        if both else {}
    gen = generation_agreement(runs["pdspark"][HUMANEVAL]["samples"], runs["hf"][HUMANEVAL]["samples"]) \
        if both else {}
    rows = metric_rows(runs)
    card_bpb = card_bits_per_byte(resolve_model(args.model))
    print("\n".join(report_lines(args, rows, agree, gen, card_bpb, runs)))
    total = time.monotonic() - t0
    log(f"total {total:.0f}s")
    write_json("evals", {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cpu": cpu_name(), "total_seconds": None if args.report_only else round(total, 1), "rows": rows,
        "card_bits_per_byte": card_bpb,
        "agreement": {t: {k: v for k, v in a.items() if k != "rel"} for t, a in agree.items()},
        "humaneval_generations": gen,
        "runs": {b: {t: {"seconds": r["seconds"] and round(r["seconds"], 1), "exit": r["exit"],
                         "samples": len(r["samples"])}
                     for t, r in tasks.items()} for b, tasks in runs.items()}})
    plot(rows, agree, f"lm-eval 0.4.13 on {args.model}: pdspark (local-completions) vs hf; files {args.ppl_limit}, "
                      f"next-line {args.next_line_limit}, HumanEval {args.humaneval_limit}")
    failed = [f"{b}/{t}" for b, tasks in runs.items() for t, r in tasks.items() if r["exit"] != 0 or not r["results"]]
    if failed:
        log(f"runs without a result: {', '.join(failed)}")
    return 1 if failed else 0


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Stopped as e:
        log(f"stopped by signal {e.args[0]}; lm-eval and the cluster stopped, no results written")
        sys.exit(128 + e.args[0])
