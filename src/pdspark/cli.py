"""`pdspark` command line. `pdspark generate --model PATH "prompt"` runs the offline engine once."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from pdspark.config import GenerateConfig, RouterConfig, UpConfig, WorkerConfig
from pdspark.engine_extra import require_engine
from pdspark.errors import PdsparkError
from pdspark.options import add_arguments, parse_options


def _generate(args: argparse.Namespace, cfg: GenerateConfig) -> int:
    require_engine("`pdspark generate`")
    if cfg.engine.parallel.node_rank > 0:  # this machine runs only its ranks of machine 0's group
        from pdspark.engine.group_nodes import join_engine_group

        return join_engine_group(cfg.model, cfg.engine, {})
    from pdspark.llm import LLM
    from pdspark.types import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(cfg.model, config=cfg.engine, progress=not cfg.quiet)
    load_s = time.perf_counter() - t0
    # Unset top_k/top_p stay out, so SamplingParams' own defaults apply.
    params = SamplingParams(
        temperature=cfg.temperature,
        seed=cfg.engine.seed if cfg.temperature > 0 else None,
        max_tokens=cfg.max_tokens,
        ignore_eos=cfg.ignore_eos,
    )
    params = replace(params, top_k=cfg.top_k) if cfg.top_k is not None else params
    params = replace(params, top_p=cfg.top_p) if cfg.top_p is not None else params
    if cfg.prompt_ids is not None:
        outs = llm.generate(prompt_token_ids=[list(cfg.prompt_ids)], sampling_params=params)
    else:
        outs = llm.generate(args.prompt, params)
    gen_s = time.perf_counter() - t0 - load_s
    for out in outs:
        if out.text is not None:
            print((out.prompt or "") + out.text)
        else:
            print(" ".join(str(t) for t in out.token_ids))
        if not cfg.quiet:
            n = len(out.token_ids)
            print(
                f"[{n} tokens, finish_reason={out.finish_reason}, load {load_s:.1f}s, "
                f"generate {gen_s:.2f}s, {n / max(gen_s, 1e-9):.1f} tok/s]",
                file=sys.stderr,
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every flag but the prompt is generated from the config dataclasses (`pdspark.options`)."""
    parser = argparse.ArgumentParser(prog="pdspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion with the offline engine")
    gen.add_argument("prompt", nargs="*", help="prompt text (one completion per argument)")
    add_arguments(gen, GenerateConfig)
    gen.set_defaults(func=_generate, config=GenerateConfig)

    up = sub.add_parser("up", help="start a local cluster: router + prefill and decode workers")
    add_arguments(up, UpConfig)
    up.set_defaults(func=_up, config=UpConfig)

    serve = sub.add_parser("serve", help="run one service of the cluster")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ("prefill", "decode"):
        worker = roles.add_parser(role, help=f"a {role} worker (gRPC + /metrics)")
        add_arguments(worker, WorkerConfig)
        worker.set_defaults(func=_serve_worker, config=WorkerConfig)
    router = roles.add_parser("router", help="the router (OpenAI HTTP + gRPC)")
    add_arguments(router, RouterConfig)
    router.set_defaults(func=_serve_router, config=RouterConfig)

    inspect = sub.add_parser("inspect", help="what a checkpoint (or a config) asks of a deployment: its tensors' "
                             "coverage, bytes per rank, KV per token, context in a memory budget (reads no weight)")
    inspect.add_argument("path", nargs="?", help="a checkpoint directory (or a shipped model's name: dsv4-tiny)")
    inspect.add_argument("--config", dest="config_file", help="a config.json alone (the released format's tensors "
                         "are predicted from it)")
    inspect.add_argument("--ep-size", type=int, action="append", dest="ep_sizes",
                         help="expert-parallel group sizes to size a rank for (repeatable; default 1)")
    inspect.add_argument("--dp-attention", action="store_true", help="ranks that each hold their own requests' KV "
                         "(the group's context is then ep times a rank's)")
    inspect.add_argument("--kv-cache-dtype", default="bfloat16", help="bfloat16 (default), float32 or fp8_e4m3")
    inspect.add_argument("--memory-gib", type=float, help="memory per rank: how many tokens of context fit")
    inspect.set_defaults(func=_inspect, config=None)
    return parser


def _inspect(args: argparse.Namespace, cfg: None) -> int:
    require_engine("`pdspark inspect`")
    from pdspark.assets import resolve_model
    from pdspark.model.checkpoint_inspection import inspect_model, render

    path = resolve_model(args.path) if args.path is not None else None
    print(render(inspect_model(path, args.config_file, tuple(args.ep_sizes or (1,)), args.kv_cache_dtype,
                               args.memory_gib, args.dp_attention)))
    return 0


def _up(args: argparse.Namespace, cfg: UpConfig) -> int:
    require_engine("`pdspark up` (its workers)")
    from pdspark.launch.up import launch

    return launch(cfg)


def _serve_router(args: argparse.Namespace, cfg: RouterConfig) -> int:
    if cfg.processes > 1:
        from pdspark.router.router_group import run_router_group

        return run_router_group(cfg)
    from pdspark.router.router_server import run_router

    return run_router(cfg)


def _serve_worker(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    require_engine(f"`pdspark serve {cfg.role}`")
    if cfg.engine.parallel.node_rank > 0:  # this machine runs only its ranks of machine 0's worker group
        from pdspark.engine.group_nodes import join_engine_group

        service = None
        if cfg.role == "decode":  # this machine's ranks receive their requests' caches at this machine's address
            from pdspark.serving.transfer_destinations import DestinationService

            service = DestinationService(cfg.transfer_backend, cfg.advertise_host, cfg.transfer_protocol,
                                         cfg.transfer_device)
        return join_engine_group(cfg.model, cfg.engine, {}, rank_service=service)
    from pdspark.serving.worker_server import run_worker

    return run_worker(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # Flags, then PDSPARK_* variables, then defaults; a bad value is a ConfigError naming the option.
        if args.config is None:  # (`inspect`: its own few flags)
            return args.func(args, None)
        fixed = {"role": args.role} if args.config is WorkerConfig else None
        cfg = parse_options(args.config, args, fixed=fixed)
        if (args.command == "generate" and not args.prompt and cfg.prompt_ids is None
                and cfg.engine.parallel.node_rank == 0):
            parser.error("generate needs a prompt or --prompt-ids")
        return args.func(args, cfg)
    except PdsparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
