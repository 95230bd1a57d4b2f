"""`pdspark` command line. `pdspark generate --model PATH "prompt"` runs the offline engine once."""

from __future__ import annotations

import argparse
import sys
import time

from pdspark.config import add_router_arguments, add_worker_arguments, router_config, worker_config
from pdspark.errors import PdsparkError
from pdspark.launcher import add_up_arguments


def _generate(args: argparse.Namespace) -> int:
    from pdspark.llm import LLM
    from pdspark.types import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        seed=args.seed,
        progress=not args.quiet,
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed if args.temperature > 0 else None,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    if args.prompt_ids is not None:
        ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        outs = llm.generate(prompt_token_ids=[ids], sampling_params=params)
    else:
        outs = llm.generate(args.prompt, params)
    gen_s = time.perf_counter() - t0 - load_s
    for out in outs:
        if out.text is not None:
            print((out.prompt or "") + out.text)
        else:
            print(" ".join(str(t) for t in out.token_ids))
        if not args.quiet:
            n = len(out.token_ids)
            print(
                f"[{n} tokens, finish_reason={out.finish_reason}, load {load_s:.1f}s, "
                f"generate {gen_s:.2f}s, {n / max(gen_s, 1e-9):.1f} tok/s]",
                file=sys.stderr,
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion with the offline engine")
    gen.add_argument("prompt", nargs="*", help="prompt text (one completion per argument)")
    gen.add_argument("--model", required=True, help="checkpoint directory (HF-format DSV4)")
    gen.add_argument("--prompt-ids", help="comma-separated prompt token ids (for checkpoints without a tokenizer)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--quiet", action="store_true", help="no progress bar or timing line")
    gen.set_defaults(func=_generate)

    up = sub.add_parser("up", help="start a local cluster: router + prefill and decode workers")
    add_up_arguments(up)
    up.set_defaults(func=_up)

    serve = sub.add_parser("serve", help="run one service of the cluster")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ("prefill", "decode"):
        worker = roles.add_parser(role, help=f"a {role} worker (gRPC + /metrics)")
        add_worker_arguments(worker)
        worker.set_defaults(func=_serve_worker)
    router = roles.add_parser("router", help="the router (OpenAI HTTP + gRPC)")
    add_router_arguments(router)
    router.set_defaults(func=_serve_router)
    return parser


def _up(args: argparse.Namespace) -> int:
    from pdspark.launcher import engine_flags, launch

    args.engine_flags = engine_flags(args)
    return launch(args)


def _serve_router(args: argparse.Namespace) -> int:
    from pdspark.router.router_server import run_router

    return run_router(router_config(args))


def _serve_worker(args: argparse.Namespace) -> int:
    from pdspark.serving.worker_server import run_worker

    return run_worker(worker_config(args.role, args))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and not args.prompt and args.prompt_ids is None:
        parser.error("generate needs a prompt or --prompt-ids")
    try:
        return args.func(args)
    except PdsparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
