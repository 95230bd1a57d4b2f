"""Engine configuration: frozen dataclasses, validated once, composed by `EngineConfig`.

The model architecture (`ModelConfig`) comes from the checkpoint; these are the serving knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdspark.errors import ConfigError, check_choice

DTYPES = ("float32", "bfloat16", "float16")
SPECULATIVE = (None, "dspark")


@dataclass(frozen=True)
class CacheConfig:
    """Paged memory. Unset pool sizes are derived from the scheduler limits (see `PoolSizes.derive`)."""

    page_size: int = 64
    # C128 compressed entries per C128 page; one page covers `hca_ratio * c128_page_size` tokens. 0 = smallest
    # value whose token span is a multiple of `page_size`.
    c128_page_size: int = 0
    num_full_pages: int | None = None
    num_swa_pages: int | None = None
    num_c128_pages: int | None = None
    # Draft tokens a verify step may write past the committed length (sizes the compressor-state rings).
    max_draft_tokens: int = 0
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ConfigError("`page_size` must be positive")
        if self.max_draft_tokens < 0:
            raise ConfigError("`max_draft_tokens` must be >= 0")
        for name in ("num_full_pages", "num_swa_pages", "num_c128_pages"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"`{name}` must be positive when set")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Token budget of one step (prefill chunks + decode tokens).
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"`{name}` must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request must be able to decode in the same step.
            raise ConfigError("`max_num_batched_tokens` must be >= `max_num_seqs`")


@dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    speculative: str | None = None  # "dspark": speculative decoding with the checkpoint's DSpark draft
    num_speculative_tokens: int | None = None  # draft tokens per verify step (default: the draft's gamma)

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("speculative", self.speculative, SPECULATIVE)


def engine_config(
    model_max_len: int,
    *,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    page_size: int = 64,
    c128_page_size: int = 0,
    num_full_pages: int | None = None,
    num_swa_pages: int | None = None,
    num_c128_pages: int | None = None,
    enable_prefix_cache: bool = True,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    speculative: str | None = None,
    num_speculative_tokens: int | None = None,
) -> EngineConfig:
    """The one place flat engine options (LLM keyword arguments, worker flags) become an `EngineConfig`."""
    return EngineConfig(
        cache=CacheConfig(
            page_size=page_size,
            c128_page_size=c128_page_size,
            num_full_pages=num_full_pages,
            num_swa_pages=num_swa_pages,
            num_c128_pages=num_c128_pages,
            enable_prefix_cache=enable_prefix_cache,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len or min(4096, model_max_len),
        ),
        device=device,
        dtype=dtype,
        seed=seed,
        speculative=speculative,
        num_speculative_tokens=num_speculative_tokens,
    )


# ---- command line and environment (the only place flags and PDSPARK_* variables are read) ----------------------------
ENGINE_FLAGS = {
    # flag: (type, default, help)
    "max_model_len": (int, None, "longest prompt + output (default: min(4096, the model's limit))"),
    "max_num_seqs": (int, 64, "most requests in the running batch"),
    "max_num_batched_tokens": (int, 512, "token budget of one engine step"),
    "page_size": (int, 64, "tokens per KV page"),
    "num_full_pages": (int, None, "full-slot pages (default: sized from the scheduler limits)"),
    "num_swa_pages": (int, None, "SWA pages (default: sized from the scheduler limits)"),
    "dtype": (str, "float32", "compute dtype: float32 or bfloat16"),
    "seed": (int, 0, "sampling seed for requests without one"),
    "speculative": (str, None, "speculative decoding: dspark"),
    "num_speculative_tokens": (int, None, "draft tokens per verify step (default: the draft's gamma)"),
}


def add_engine_arguments(parser, env_prefix: str = "PDSPARK_") -> None:
    """Engine flags, each defaulting to its `PDSPARK_<NAME>` environment variable when set."""
    import os

    for name, (kind, default, help_text) in ENGINE_FLAGS.items():
        env = os.environ.get(env_prefix + name.upper())
        value = kind(env) if env not in (None, "") else default
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=value, help=help_text)
    env_cache = os.environ.get(env_prefix + "NO_PREFIX_CACHE", "") not in ("", "0")
    parser.add_argument("--no-prefix-cache", action="store_true", default=env_cache, help="disable the prefix cache")


def engine_options(args) -> dict:
    """Flat engine options (for `create_engine`) from parsed arguments."""
    options = {name: getattr(args, name) for name in ENGINE_FLAGS}
    options["enable_prefix_cache"] = not args.no_prefix_cache
    return options


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    model: str = "dsv4-tiny"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (reported on the ready line)
    metrics_port: int = 0  # 0: pick a free port; -1: no metrics server
    advertise_host: str = "127.0.0.1"  # the address peers use (gRPC and the transfer engine session)
    transfer_backend: str = "mooncake"
    transfer_protocol: str = "tcp"
    grpc_threads: int = 32
    engine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("role", self.role, ("prefill", "decode"))
        check_choice("transfer_backend", self.transfer_backend, ("mooncake", "inprocess"))
        check_choice("transfer_protocol", self.transfer_protocol, ("tcp", "rdma"))


def add_worker_arguments(parser) -> None:
    import os

    def env(name: str, default):
        return os.environ.get("PDSPARK_" + name.upper(), default)

    parser.add_argument("--model", default=env("model", "dsv4-tiny"), help="checkpoint path or shipped model name")
    parser.add_argument("--host", default=env("host", "127.0.0.1"), help="gRPC bind address")
    parser.add_argument("--port", type=int, default=int(env("port", 0)), help="gRPC port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=int(env("metrics_port", 0)),
                        help="Prometheus /metrics port (0: any free port, -1: off)")
    parser.add_argument("--advertise-host", default=env("advertise_host", "127.0.0.1"),
                        help="address peers reach this worker at (gRPC and transfer engine)")
    parser.add_argument("--transfer-backend", default=env("transfer_backend", "mooncake"),
                        choices=["mooncake", "inprocess"])
    parser.add_argument("--transfer-protocol", default=env("transfer_protocol", "tcp"), choices=["tcp", "rdma"])
    add_engine_arguments(parser)


def worker_config(role: str, args) -> WorkerConfig:
    return WorkerConfig(
        role=role,
        model=args.model,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        advertise_host=args.advertise_host,
        transfer_backend=args.transfer_backend,
        transfer_protocol=args.transfer_protocol,
        engine=engine_options(args),
    )


@dataclass(frozen=True)
class RouterConfig:
    model: str = "dsv4-tiny"
    served_model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 0
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_policy: str = "cache_aware"
    decode_policy: str = "power_of_two"
    max_model_len: int = 0  # 0: the model's (capped at 4096, as the workers default)
    transfer_timeout_s: float = 30.0
    health_interval_s: float = 2.0


def add_router_arguments(parser) -> None:
    import os

    def env(name: str, default):
        return os.environ.get("PDSPARK_" + name.upper(), default)

    def addresses(value: str) -> tuple[str, ...]:
        return tuple(a.strip() for a in value.split(",") if a.strip())

    parser.add_argument("--model", default=env("model", "dsv4-tiny"), help="checkpoint path or shipped model name")
    parser.add_argument("--served-model-name", default=env("served_model_name", ""))
    parser.add_argument("--host", default=env("host", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("port", 8000)), help="HTTP port (0: any free port)")
    parser.add_argument("--grpc-port", type=int, default=int(env("grpc_port", 0)), help="gRPC port (0: any)")
    parser.add_argument("--prefill", type=addresses, default=addresses(env("prefill", "")),
                        help="comma-separated prefill worker addresses (host:port)")
    parser.add_argument("--decode", type=addresses, default=addresses(env("decode", "")),
                        help="comma-separated decode worker addresses (host:port)")
    parser.add_argument("--prefill-policy", default=env("prefill_policy", "cache_aware"),
                        choices=["round_robin", "power_of_two", "cache_aware"])
    parser.add_argument("--decode-policy", default=env("decode_policy", "power_of_two"),
                        choices=["round_robin", "power_of_two", "cache_aware"])
    parser.add_argument("--max-model-len", type=int, default=int(env("max_model_len", 0)))
    parser.add_argument("--transfer-timeout", type=float, default=float(env("transfer_timeout", 30.0)),
                        help="seconds a request's cache transfer may take before the pair is failed")
    parser.add_argument("--health-interval", type=float, default=float(env("health_interval", 2.0)))


def router_config(args) -> RouterConfig:
    return RouterConfig(
        model=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
        grpc_port=args.grpc_port, prefill=tuple(args.prefill), decode=tuple(args.decode),
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy, max_model_len=args.max_model_len,
        transfer_timeout_s=args.transfer_timeout, health_interval_s=args.health_interval,
    )
