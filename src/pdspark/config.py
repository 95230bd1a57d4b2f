"""Every serving option: frozen dataclasses, each field with its one default and help text, validated once.

The model architecture (`ModelConfig`) comes from the checkpoint; these are the knobs. `EngineConfig` composes the
cache and scheduler options, `AuthConfig` the router's API keys, `TLSConfig` the certificates of mutual TLS between
services, and `RouterConfig` composes `AdmissionConfig` (limits on requests), `HealthConfig` (watching the workers)
and `DiscoveryConfig` (workers found by DNS) beside those two. `WorkerConfig`, `RouterConfig`, `UpConfig` and
`GenerateConfig` are what `pdspark serve prefill|decode`, `serve router`, `up` and `generate` run on. Their flags,
`PDSPARK_*` variables and keyword options are generated from these fields by `pdspark.options` (the only place that
reads either); a nested config's options are flattened, so which sub-config holds a field never shows in a flag or
variable name.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pdspark.errors import ConfigError
from pdspark.options import build, nested, option, validate

# Defaults shared by several services, named once.
DEFAULT_MODEL = "dsv4-tiny"
LOOPBACK = "127.0.0.1"
ROUTER_HTTP_PORT = 8000
# With no --max-model-len, the context is the model's limit capped here: pools are sized for it, and a long-context
# checkpoint's full window would take far more memory than a default should.
DEFAULT_MAX_MODEL_LEN = 4096

Dtype = Literal["float32", "bfloat16", "float16"]
Quantization = Literal["auto", "modelslim", "none"]  # `pdspark.model.loader.QUANTIZATIONS`
WeightFormat = Literal["compact", "float32"]  # `pdspark.model.loader.WEIGHT_FORMATS`
KvCacheDtype = Literal["auto", "fp8_e4m3"]  # `pdspark.cache.kv_pools.KV_CACHE_DTYPES`
Policy = Literal["round_robin", "power_of_two", "cache_aware"]  # `pdspark.router.workers.policies.POLICIES`
TransferBackend = Literal["mooncake", "inprocess"]  # the names `pdspark.transfer.backend.create_backend` takes
UpBackend = Literal["process", "ray"]  # how `pdspark up` runs its services (`pdspark.launch.up`)
RayPlacement = Literal["pack", "spread"]  # how the Ray backend's placement group puts the services on nodes
# How the router's Prefill and Generate calls reach a worker: one gRPC call each, or multiplexed on one stream per
# worker (`pdspark.rpc.multiplexed_client`).
WorkerCalls = Literal["per-request", "multiplexed"]
Device = Literal["cpu", "cuda", "npu"]  # the names `pdspark.hardware.registry.select_backend` takes

_MODEL_HELP = "checkpoint directory (HF-format DSV4) or shipped model name"
_PORT: dict[str, Any] = {"minimum": 0, "maximum": 65535}
_OTLP_HELP = ("OTLP/gRPC endpoint spans are exported to (e.g. http://127.0.0.1:4317; https:// for TLS); none: "
              "tracing off")


def resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    """The context length served: the requested one, else the model's limit capped at `DEFAULT_MAX_MODEL_LEN`."""
    return requested if requested is not None else min(DEFAULT_MAX_MODEL_LEN, model_limit)


def _require_positive(config: Any, *names: str) -> None:
    """ConfigError naming the first of `config`'s fields `names` that is not > 0 (durations and intervals, where a
    bound of `minimum=0` would still let 0 through)."""
    for name in names:
        if getattr(config, name) <= 0:
            raise ConfigError(f"invalid value {getattr(config, name)!r} for `{name}`; allowed: a number > 0")


@dataclass(frozen=True)
class CacheConfig:
    """Paged memory. Unset pool sizes are derived from the scheduler limits (see `PoolSizes.derive`)."""

    page_size: int = option(64, "tokens per KV page", minimum=1)
    # One C128 page covers `hca_ratio * c128_page_size` tokens.
    c128_page_size: int | None = option(
        None, "C128 compressed entries per C128 page (default: the smallest whose token span is a multiple of "
        "the page size)", minimum=1)
    num_full_pages: int | None = option(None, "full-slot pages (default: sized from the scheduler limits)", minimum=1)
    num_swa_pages: int | None = option(None, "SWA pages (default: sized from the scheduler limits)", minimum=1)
    num_c128_pages: int | None = option(None, "C128 pages (default: sized from the scheduler limits)", minimum=1)
    kv_cache_dtype: KvCacheDtype = option(
        "auto", "KV cache rows: auto (the compute dtype) or fp8_e4m3 (SWA/C4/C128 rows as FP8 e4m3 + ue8m0 scales "
        "with bf16 rope channels, C4 indexer keys as FP8 + fp32 scales: ~1/3.5 of fp32's bytes; read and written "
        "in place by the C decode step)")
    # Set by the engine from the draft (not an option): draft tokens a verify step may write past the committed
    # length, which sizes the compressor-state rings.
    max_draft_tokens: int = option(0, "draft tokens a verify step may write ahead (set by the engine)", cli=False,
                                   minimum=0)
    # `--prefix-cache/--no-prefix-cache`: the flag older than the field is `--no-prefix-cache`.
    enable_prefix_cache: bool = option(True, "reuse the cache of earlier prompts' shared prefixes",
                                       flag="prefix-cache")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(64, "most requests in the running batch", minimum=1)
    max_num_batched_tokens: int = option(512, "token budget of one engine step (prefill chunks + decode tokens)",
                                         minimum=1)
    # None until the model is known: `EngineConfig.for_model` resolves it before the engine sees it.
    max_model_len: int | None = option(
        None, f"longest prompt + output (default: the model's limit, at most {DEFAULT_MAX_MODEL_LEN})", minimum=1)

    def __post_init__(self) -> None:
        validate(self)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request must be able to decode in the same step.
            raise ConfigError(f"`max_num_batched_tokens` ({self.max_num_batched_tokens}) must be >= `max_num_seqs` "
                              f"({self.max_num_seqs})")


@dataclass(frozen=True)
class ParallelConfig:
    """Worker groups: several rank processes acting as one engine over torch.distributed."""

    ep_size: int = option(
        1, "rank processes of an expert-parallel group: rank r holds routed experts [r*E/N, (r+1)*E/N), every rank "
        "runs the same batch in lockstep (with --dp-attention, each rank its own requests; a decode worker's group "
        "runs DP-attention)", minimum=1)
    dp_attention: bool = option(
        False, "with ep_size > 1: each rank owns whole requests (its own scheduler, pages and states) and the MoE "
        "layers exchange tokens between ranks, instead of every rank running the same batch (offline LLM, "
        "`pdspark generate` and decode workers; prefill workers run replicated groups)")
    # torch's default is 30 minutes: a hung rank would hang the whole group that long.
    dist_timeout_s: float = option(30.0, "seconds any collective of a worker group may wait before the group fails",
                                   minimum=0.1)
    dist_init_addr: str | None = option(
        None, "host:port where the ranks of a group meet (rank 0 listens there; default: a rendezvous file in a "
        "temporary directory of this machine)")

    # SGLang's flags: every machine runs the same command but for --node-rank; node 0 runs rank 0 (the worker, or the
    # offline LLM), the others only their ranks, which take rank 0's configuration over an authenticated channel.
    nnodes: int = option(1, "machines a worker group spans, each running ep_size / nnodes of its ranks (with "
                         "--node-rank, --dist-init-addr and --dist-secret-file)", minimum=1)
    node_rank: int = option(0, "this machine's place in a group that spans machines: 0 runs rank 0 (the worker or "
                            "the offline run), the others only their ranks", minimum=0)
    dist_secret_file: str | None = option(
        None, "file holding the secret the ranks of a group that spans machines authenticate their control channel "
        "with (the same content on every machine; the channel listens on the --dist-init-addr port + 1)")

    def __post_init__(self) -> None:
        validate(self)
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"`dist_init_addr` is {self.dist_init_addr!r}; allowed: host:port (port 1-65535)")


@dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = nested(CacheConfig, "cache")
    scheduler: SchedulerConfig = nested(SchedulerConfig, "scheduler")
    parallel: ParallelConfig = nested(ParallelConfig, "parallel")
    device: Device = option("cpu", "hardware backend the engine runs on (cuda and npu are untested: see "
                                   "docs/operations.md)")
    dtype: Dtype = option("float32", "compute dtype")
    # Read by `pdspark.hardware.extra_ops` at engine start (the variable is PDSPARK_EXTRA_OPS_SO).
    extra_ops_so: tuple[str, ...] = option(
        (), "operator libraries (.so) loaded and checked at engine start (comma- or os.pathsep-separated paths)")
    # auto: a ModelSlim checkpoint is recognised by its quant_model_description.json (no flag needed).
    quantization: Quantization = option(
        "auto", "checkpoint quantization: auto (detect), modelslim (ModelSlim W8A8/W8A8_DYNAMIC/W4A8_DYNAMIC on "
        "int8 CPU kernels; the description file must exist) or none (read as a float checkpoint)")
    weight_format: WeightFormat = option(
        "compact", "how a released (FP8/MXFP4) checkpoint's weights are held: compact (as stored, FP8/MXFP4 decoded a "
        "block at a time when they run; BF16 stays BF16) or float32 (decoded at load: ~4x the memory, the C decode "
        "step applies)")
    # Unset: each engine draws its unseeded requests' seeds from OS entropy, so "random" streams differ across
    # workers and runs; set: those seeds derive from it (reproducible runs, tests, benchmarks).
    seed: int | None = option(None, "seed for requests without one (unset: fresh entropy per process)")
    # SGLang's NPU path uses 64 (128 on Blackwell); off by default until measured on a device.
    multi_stream_rows: int = option(
        0, "decode/verify steps of at most this many token rows prepare attention on two side streams (cuda, npu; "
        "0: off; on cpu the same work in program order)", minimum=0)
    speculative: Literal["dspark"] | None = option(None, "speculative decoding with the checkpoint's DSpark draft")
    num_speculative_tokens: int | None = option(None, "draft tokens per verify step (default: the draft's gamma)",
                                                minimum=1)
    speculative_policy: Literal["always", "when-faster"] = option(
        "always", "with `speculative`: draft at every decode step (always), or only at the batch sizes where this "
        "machine measures more tokens per second with drafts than without (when-faster: both modes timed as it runs, "
        "the other one probed now and then; the same tokens either way)")

    def __post_init__(self) -> None:
        validate(self)

    def for_model(self, model_limit: int) -> EngineConfig:
        """This config with `max_model_len` resolved against the model's `max_position_embeddings`."""
        length = resolve_max_model_len(self.scheduler.max_model_len, model_limit)
        return build(EngineConfig, {"max_model_len": length}, base=self)


@dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS between the services (see `pdspark.rpc.tls_credentials`): this service's certificate and key, and
    the CA its peers' certificates must chain to. A worker with them serves gRPC only to peers presenting a
    certificate of that CA (the router, the other workers) and calls its peers with its own; the router calls the
    workers with its certificate. Paths only: the files are read at start, their contents never logged."""

    tls_cert: str | None = option(None, "PEM certificate (chain) this service presents to its peers (with "
                                  "--tls-key and --tls-ca: mutual TLS between services)")
    tls_key: str | None = option(None, "PEM private key of --tls-cert")
    tls_ca: str | None = option(None, "PEM CA certificate(s) the peers' certificates must chain to")
    tls_peer_name: str | None = option(
        None, "the name a worker's certificate must carry, checked instead of the address dialled: a DNS name, or a "
        "template of {role} (prefill, decode) and {ip} (the dialled IP, '-' for '.' and ':', as Kubernetes names a "
        "pod under a headless Service), e.g. '{ip}.pdspark-{role}.default.svc'; none: the dialled address")

    def __post_init__(self) -> None:
        validate(self)
        given = [name for name in ("tls_cert", "tls_key", "tls_ca") if getattr(self, name) is not None]
        if given and len(given) != 3:
            # Half a configuration would serve plain text (or TLS without checking peers) while looking secured.
            raise ConfigError(f"`tls_cert`, `tls_key` and `tls_ca` go together (mutual TLS); only "
                              f"{', '.join(f'`{n}`' for n in given)} given")
        if self.tls_peer_name is not None:
            if not given:
                raise ConfigError("`tls_peer_name` is given without `tls_cert`, `tls_key` and `tls_ca` (it names "
                                  "what mutual TLS checks)")
            _check_peer_name(self.tls_peer_name)

    @property
    def enabled(self) -> bool:
        return self.tls_cert is not None


PEER_NAME_FIELDS = ("role", "ip")  # what `tls_peer_name` may hold in braces


def _check_peer_name(template: str) -> None:
    """`tls_peer_name` formats (only the fields `PEER_NAME_FIELDS`) into a DNS name."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ConfigError(f"invalid value {template!r} for `tls_peer_name`: {e}") from None
    unknown = sorted(fields - set(PEER_NAME_FIELDS))
    if unknown:
        raise ConfigError(f"invalid value {template!r} for `tls_peer_name`: unknown field {{{unknown[0]}}}; allowed: "
                          + ", ".join(f"{{{f}}}" for f in PEER_NAME_FIELDS))
    example = template.format(role="prefill", ip="10-0-0-1")
    if not re.fullmatch(r"(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*",
                        example):
        raise ConfigError(f"invalid value {template!r} for `tls_peer_name`; allowed: a lower-case DNS name once "
                          f"{{role}} and {{ip}} are filled in ({example!r} is not one)")


@dataclass(frozen=True)
class WorkerConfig:
    """`pdspark serve prefill|decode`."""

    role: Literal["prefill", "decode"] = option(help="which side of the pair this worker serves (the subcommand)",
                                                cli=False)
    model: str = option(DEFAULT_MODEL, _MODEL_HELP)
    host: str = option(LOOPBACK, "gRPC and /metrics bind address")
    port: int = option(0, "gRPC port (0: any free port, reported on the ready line)", **_PORT)
    metrics_port: int | None = option(0, "Prometheus /metrics port (0: any free port; none: no metrics server)",
                                      **_PORT)
    advertise_host: str = option(LOOPBACK, "address peers reach this worker at (gRPC and transfer engine)")
    transfer_backend: TransferBackend = option("mooncake", "how the cache moves from prefill to decode")
    transfer_protocol: Literal["tcp", "rdma"] = option("tcp", "transport of the mooncake transfer engine")
    transfer_device: str = option("", "the NIC(s) the mooncake transfer engine uses for RDMA, comma-separated (e.g. "
                                  "mlx5_0,mlx5_1); empty: Mooncake discovers them all")
    drain_timeout_s: float = option(5.0, "on SIGTERM: seconds running calls get to finish before the worker stops "
                                    "(streams still running then end and migrate); the pod's termination grace less "
                                    "its preStop and a margin", minimum=0.0)
    # Admission: beyond these bounds a worker refuses a request at once (OVERLOADED: gRPC RESOURCE_EXHAUSTED, HTTP
    # 429 at the router), never by a timeout. Sized so that one prefill + one decode worker queue several hundred
    # concurrent requests; each waiting request costs a coroutine and a little memory, no thread.
    max_waiting_streams: int = option(
        1024, "decode: Generate calls that may wait for destination pages beyond those the engine runs "
        "(max-num-seqs), fewer in proportion while request slots are quarantined; more are refused at once with "
        "OVERLOADED", minimum=1)
    max_pending_prefills: int = option(
        1024, "prefill: transfers in flight (queued, prefilling, waiting for their plan, writing); more are "
        "refused at once with OVERLOADED", minimum=1)
    early_prefills: int = option(
        1, "prefill: prompts that may start before the decode worker's transfer plan arrives, while the engine has "
        "nothing queued (hides the plan's round trip from the TTFT; 0: every prompt waits for its plan)", minimum=0)
    tls: TLSConfig = nested(TLSConfig, "mutual TLS between services")
    otlp_endpoint: str | None = option(None, _OTLP_HELP)
    engine: EngineConfig = nested(EngineConfig, "engine")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class AuthConfig:
    """Who may call the router (see `pdspark.router.auth.api_keys`): clients with an API key on `/v1/*` and `/generate`
    (HTTP `Authorization: Bearer`, gRPC `authorization` metadata), operators with an admin key on `/workers`. Several
    keys of each kind may be valid at once, so a key is rotated by adding the new one, moving its clients, then
    removing the old one. Keys in files are read again on SIGHUP."""

    # NOTE: secret options never reach a child's command line (`pdspark.options.secret_env`); a flag given to
    # `pdspark up` or `serve router` itself is visible in `ps`, which is why the variables and files come first.
    api_key: tuple[str, ...] = option(
        (), "API keys clients must present (comma-separated; none: the API is open). Prefer the variable or "
        "--api-key-file: a flag shows in `ps`", secret=True)
    api_key_file: str | None = option(None, "file of API keys, one per line (read again on SIGHUP)")
    admin_api_key: tuple[str, ...] = option(
        (), "admin keys for /workers (comma-separated; none: registering and removing workers is off)", secret=True)
    admin_api_key_file: str | None = option(None, "file of admin keys, one per line (read again on SIGHUP)")

    def __post_init__(self) -> None:
        validate(self)
        for name in ("api_key", "admin_api_key"):
            if any(not key or key != key.strip() for key in getattr(self, name)):
                raise ConfigError(f"`{name}`: a key may not be empty or start or end with whitespace")
        if set(self.api_key) & set(self.admin_api_key):
            # An API key that also administers workers is the mistake the admin key exists to prevent.
            raise ConfigError("a key is both an `api_key` and an `admin_api_key`; give the admin a key of its own")

    @property
    def configured(self) -> bool:
        """Whether any key (of either kind, inline or in a file) is configured."""
        return bool(self.api_key or self.api_key_file or self.admin_api_key or self.admin_api_key_file)


class DnsTarget(NamedTuple):
    """One `--prefill-dns`/`--decode-dns` entry: every address `name` resolves to, on `port`, is a `role` worker."""

    role: str
    name: str
    port: int


def split_dns_target(target: str, field: str) -> tuple[str, int]:
    """`name:port` -> (name, port); ConfigError naming `field` otherwise."""
    name, _, port = target.rpartition(":")
    if not name or not port.isdigit() or not 0 < int(port) <= 65535 or ":" in name or "/" in name:
        raise ConfigError(f"invalid value {target!r} for `{field}`; allowed: name:port (a DNS name, a port in "
                          "[1, 65535])")
    return name, int(port)


@dataclass(frozen=True)
class DiscoveryConfig:
    """Workers found by DNS (`pdspark.router.workers.dns_discovery`), beside the fixed `--prefill`/`--decode`
    addresses: Kubernetes headless Services, or any name with several A/AAAA records; no API access needed."""

    prefill_dns: tuple[str, ...] = option(
        (), "DNS names (name:port, comma-separated or repeated) whose addresses are prefill workers, re-resolved "
        "every --dns-interval-s: a new address is admitted, a vanished one retired; beside --prefill")
    decode_dns: tuple[str, ...] = option(
        (), "DNS names (name:port) whose addresses are decode workers, as --prefill-dns; beside --decode")
    dns_interval_s: float = option(5.0, "seconds between resolutions of --prefill-dns/--decode-dns")
    # NOTE: a test/dev hook (tests, and a rendered Helm chart run as local processes), not for production.
    hosts_file: str | None = option(
        None, "test/dev hook: a file in /etc/hosts format consulted before DNS by --prefill-dns/--decode-dns (a "
        "name on several lines has several addresses); re-read at every resolution")

    def __post_init__(self) -> None:
        validate(self)
        _require_positive(self, "dns_interval_s")
        # Parsed once here so a malformed target stops the router at start, not at its first resolution.
        for name in ("prefill_dns", "decode_dns"):
            for target in getattr(self, name):
                split_dns_target(target, name)

    @property
    def dns_targets(self) -> tuple[DnsTarget, ...]:
        """`prefill_dns` and `decode_dns`, parsed."""
        return tuple(DnsTarget(role, *split_dns_target(target, f"{role}_dns"))
                     for role in ("prefill", "decode") for target in getattr(self, f"{role}_dns"))


@dataclass(frozen=True)
class AdmissionConfig:
    """Which requests the router lets in, and for how long: beyond these bounds a request waits in the router's
    queue or is refused at once (`pdspark.router.admission_queue`, `pdspark.router.auth.key_quota`)."""

    # A default 1 prefill + 1 decode cluster runs 64 sequences per engine (max_num_seqs): twice that in flight keeps
    # the decode batch full while the next requests are in prefill and transfer; the queue holds bursts of hundreds
    # of requests, which wait for a turn instead of being refused.
    max_in_flight: int = option(128, "requests at the workers at once; more wait in the router's queue", minimum=1)
    max_queued: int = option(1024, "requests waiting for a turn; beyond them a request is refused at once (HTTP 429 "
                             "+ Retry-After, gRPC RESOURCE_EXHAUSTED)", minimum=0)
    # Limits against one client starving the rest, or the router itself. Per key: half the router's room by default,
    # so one key cannot fill the router alone, while a benchmark at concurrency 256 still fits.
    max_in_flight_per_key: int | None = option(
        None, "requests one API key may have in the router at once, queued or at the workers (default: half of "
        "max-in-flight + max-queued); more are refused at once (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED). "
        "Requests without a key (an open API) are not counted", minimum=1)
    # A prompt of DSV4's full 1M-token context fits, as text or as token ids in JSON (about 7 bytes each); anything
    # larger cannot be served anyway.
    max_body_bytes: int = option(8 << 20, "largest HTTP request body and gRPC request message read (HTTP 413, gRPC "
                                 "RESOURCE_EXHAUSTED beyond)", minimum=1024)
    request_timeout_s: float = option(600.0, "a request's timeout when its caller sets none, and the longest one a "
                                      "caller may set (queueing, every attempt and the whole stream)")

    def __post_init__(self) -> None:
        validate(self)
        _require_positive(self, "request_timeout_s")

    @property
    def key_in_flight_limit(self) -> int:
        """`max_in_flight_per_key`, resolved."""
        if self.max_in_flight_per_key is not None:
            return self.max_in_flight_per_key
        return max(1, (self.max_in_flight + self.max_queued) // 2)


@dataclass(frozen=True)
class HealthConfig:
    """How the router watches its workers (`pdspark.router.workers.worker_registry`). A worker that misses 2 health
    checks in a row is skipped, so a dead or hung one is detected within about interval + 2 x timeout (1.5 s by
    default). Load reports are polled apart and never count against health."""

    health_interval_s: float = option(0.5, "seconds between liveness checks (gRPC health) of each worker",
                                      flag="health-interval")
    health_timeout_s: float = option(0.5, "seconds a worker's health check may take before it counts as missed")
    load_interval_s: float = option(1.0, "seconds between load reports (GetLoad) polled from each worker")

    def __post_init__(self) -> None:
        validate(self)
        _require_positive(self, "health_interval_s", "health_timeout_s", "load_interval_s")


@dataclass(frozen=True)
class RouterConfig:
    """`pdspark serve router`."""

    model: str = option(DEFAULT_MODEL, _MODEL_HELP + " (the router loads only its tokenizer and config)")
    served_model_name: str | None = option(
        None, "model name the API reports (default: --model, or its directory's name for a path)")
    host: str = option(LOOPBACK, "HTTP and gRPC bind address")
    port: int = option(ROUTER_HTTP_PORT, "HTTP port (0: any free port)", **_PORT)
    grpc_port: int = option(0, "gRPC port (0: any free port)", **_PORT)
    # Several routers (replicas behind one Service) each name themselves and their own address in their Prometheus
    # service discovery, instead of one `router` at whatever address the scraper called.
    instance_name: str = option("router", "this router's `instance` label in /prometheus/targets (a pod's name)")
    advertise_host: str | None = option(
        None, "the address this router's own /metrics target is listed at in /prometheus/targets (a pod's IP; "
        "default: the address the scraper called)")
    # Worker administration on a listener of its own, so that a firewall or network policy can keep it from the
    # clients the main port faces (its keys still apply there, and its TLS).
    admin_port: int | None = option(
        None, "HTTP port of the admin routes (/workers, /prometheus/targets), which then answer 404 on --port; same "
        "host, TLS and keys (0: any free port; none: on --port)", **_PORT)
    auth: AuthConfig = nested(AuthConfig, "API keys")
    # The public ports (HTTP and gRPC) and the calls to the workers are secured apart: clients may trust a public
    # CA, the workers only the cluster's own.
    ssl_certfile: str | None = option(None, "PEM certificate (chain) of HTTPS on --port and TLS on --grpc-port "
                                      "(with --ssl-keyfile; none: plain text)")
    ssl_keyfile: str | None = option(None, "PEM private key of --ssl-certfile")
    tls: TLSConfig = nested(TLSConfig, "mutual TLS to the workers")
    prefill: tuple[str, ...] = option((), "prefill worker addresses (host:port, comma-separated)")
    decode: tuple[str, ...] = option((), "decode worker addresses (host:port, comma-separated)")
    discovery: DiscoveryConfig = nested(DiscoveryConfig, "workers discovered by DNS")
    prefill_policy: Policy = option("cache_aware", "how a request's prefill worker is picked")
    decode_policy: Policy = option("power_of_two", "how a request's decode worker is picked")
    max_model_len: int | None = option(
        None, f"longest prompt + output admitted (default: the model's limit, at most {DEFAULT_MAX_MODEL_LEN}, as "
        "the workers)", minimum=1)
    transfer_timeout_s: float = option(30.0, "seconds a request's cache transfer may take before the pair is failed",
                                       flag="transfer-timeout")
    # Multiplexed: 'Calls' streams (worker.proto), several times less CPU per request on both sides under load
    # (bench/bench_worker_rpc.py); the workers must serve `Calls` (every pdspark worker of this version does; a
    # router in front of older workers takes per-request).
    worker_calls: WorkerCalls = option(
        "multiplexed", "how Prefill and Generate calls reach the workers: multiplexed on one long-lived stream per "
        "worker, every call queued meanwhile in one message, or one gRPC call each (per-request: workers that do "
        "not serve the Calls stream)")
    # Failure handling (`Dispatcher`): how far a request already let in may go after failed pairs. Not admission,
    # which decides whether and how long a request is let in at all.
    max_attempts: int = option(3, "pairs a request tries before its first token (and after each migration) before "
                               "it fails", minimum=1)
    max_migrations: int = option(3, "times a stream whose decode worker failed mid-stream is moved to another pair "
                                 "(prompt + tokens so far) before it fails; 0: never", minimum=0)
    # A whole role down (`--decode 1` and its worker crashed) is usually a restart away: the launcher or Kubernetes
    # brings the worker back in seconds, and the requests in flight have minutes of deadline.
    max_role_outage_wait_s: float = option(
        60.0, "seconds a request already let in waits, when no other worker of the role it failed on is healthy "
        "(its worker crashed or is unreachable), for one to answer health checks again before it is retried or "
        "migrated (bounded by the request's deadline; 0: fail at once)", minimum=0.0)
    admission: AdmissionConfig = nested(AdmissionConfig, "admission: limits on requests in the router")
    health: HealthConfig = nested(HealthConfig, "worker liveness checks and load reports")
    otlp_endpoint: str | None = option(None, _OTLP_HELP)
    # Off by default: a line per request costs the router about a tenth of its per-request time at load (formatting
    # and a write to stderr on the event loop); the metrics count every request anyway.
    access_log: bool = option(False, "log one line per HTTP request (aiohttp's access log, level INFO)")
    # One Python process serves about one core's worth of requests; several share the ports by SO_REUSEPORT (the
    # kernel spreads connections), under a supervisor (`pdspark.router.router_group`, which says what they share).
    processes: int = option(1, "router processes serving the same HTTP and gRPC ports (SO_REUSEPORT), as many as "
                            "the cores the router may use; max-in-flight and max-queued are divided between them, "
                            "the per-key limit and /metrics are over all", minimum=1, maximum=256)

    def __post_init__(self) -> None:
        validate(self)
        if self.processes > self.admission.max_in_flight:
            raise ConfigError(f"`processes` ({self.processes}) may be at most `max_in_flight` "
                              f"({self.admission.max_in_flight}): each process holds a share of the admission slots")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("`ssl_certfile` and `ssl_keyfile` go together (HTTPS and TLS on the public ports)")
        _require_positive(self, "transfer_timeout_s")
        if self.admin_port and self.admin_port in (self.port, self.grpc_port):
            raise ConfigError(f"`admin_port` ({self.admin_port}) must differ from `port` ({self.port}) and "
                              f"`grpc_port` ({self.grpc_port})")


@dataclass(frozen=True)
class UpConfig:
    """`pdspark up`: a local cluster; the engine options reach every worker."""

    model: str = option(DEFAULT_MODEL, _MODEL_HELP)
    prefill: int = option(1, "prefill workers", minimum=1)
    decode: int = option(1, "decode workers", minimum=1)
    host: str = option(LOOPBACK, "router bind address")
    port: int = option(ROUTER_HTTP_PORT, "router HTTP port (0: any free port)", **_PORT)
    grpc_port: int = option(50050, "router gRPC port (0: any free port)", **_PORT)
    admin_port: int | None = option(
        None, "router HTTP port of the admin routes (/workers, /prometheus/targets), off --port (0: any free port; "
        "none: on --port; the router's --admin-port)", **_PORT)
    speculative: bool = option(True, "decode with DSpark when the checkpoint ships a draft")
    # Passed to the router by environment, never on its command line.
    auth: AuthConfig = nested(AuthConfig, "API keys of the router")
    tls: bool = option(False, "mutual TLS between the services and HTTPS/TLS on the router's ports, with "
                       "certificates of a throwaway CA made for this run (its path is printed for clients)")
    # Supervision (see `pdspark.launch.supervisor`): a service that exits is restarted on the same ports.
    restart: bool = option(True, "restart a service that exits, on the same ports (off: any exit stops the cluster)")
    restart_backoff_s: float = option(1.0, "seconds before restarting a service that exited; doubled per "
                                      "consecutive failure", minimum=0.1)
    max_restart_backoff_s: float = option(30.0, "longest wait between a service's restarts", minimum=0.1)
    crash_loop_restarts: int = option(5, "consecutive failures of one service reported as a crash loop (restarts "
                                      "go on at the longest backoff)", minimum=1)
    otlp_endpoint: str | None = option(None, _OTLP_HELP + " (passed to the router and every worker)")
    transfer_timeout_s: float = option(30.0, "seconds a request's cache transfer may take before the pair is "
                                       "failed (the router's --transfer-timeout)", flag="transfer-timeout")
    router_processes: int = option(1, "router processes on the router's ports (the router's --processes)", minimum=1,
                                   maximum=256)
    # Where the services run: child processes of `up`, or Ray actors (`pdspark.launch.ray_backend`; the
    # `pdspark[ray]` extra).
    backend: UpBackend = option("process", "run the services as child processes, or as Ray actors")
    ray_address: str | None = option(None, "with --backend ray: join this Ray cluster (`auto` or HOST:PORT) instead "
                                     "of starting a local one")
    ray_placement: RayPlacement = option(
        "pack", "with --backend ray: the services' placement group packs them on one node (the launcher's when they "
        "fit), or spreads them across nodes; every service keeps its node across restarts (the addresses are picked "
        "on the launcher's machine: spread serves where every node reaches them there, e.g. nodes of one machine)")
    ray_num_cpus: int | None = option(None, "with --backend ray: CPUs of the local Ray started (default: the "
                                      "machine's)", minimum=1)
    ray_router_resources: tuple[str, ...] = option(("CPU=0.25",), "with --backend ray: Ray resources the router "
                                                   "actor takes (NAME=AMOUNT, comma-separated: CPU, GPU or custom)")
    ray_prefill_resources: tuple[str, ...] = option(("CPU=0.25",), "with --backend ray: Ray resources each prefill "
                                                    "worker actor takes per rank of its group (e.g. CPU=1,GPU=1)")
    ray_decode_resources: tuple[str, ...] = option(("CPU=0.25",), "with --backend ray: Ray resources each decode "
                                                   "worker actor takes (e.g. CPU=1,GPU=1)")
    # Worker groups per role (`--ep-size` sets both).
    prefill_ep_size: int | None = option(None, "rank processes of each prefill worker's group (default: --ep-size)",
                                         minimum=1)
    decode_ep_size: int | None = option(None, "rank processes of each decode worker's group, which runs "
                                        "DP-attention (default: --ep-size)", minimum=1)
    # `speculative` is decided above (from the checkpoint), not passed through.
    engine: EngineConfig = nested(EngineConfig, "engine options passed to every worker", skip=("speculative",))

    def __post_init__(self) -> None:
        validate(self)
        for role in ("router", "prefill", "decode"):
            self.ray_resources(role)  # raises ConfigError on a malformed one
        _require_positive(self, "transfer_timeout_s")
        if self.admin_port and self.admin_port in (self.port, self.grpc_port):
            raise ConfigError(f"`admin_port` ({self.admin_port}) must differ from `port` ({self.port}) and "
                              f"`grpc_port` ({self.grpc_port})")
        if self.max_restart_backoff_s < self.restart_backoff_s:
            raise ConfigError(f"`max_restart_backoff_s` ({self.max_restart_backoff_s}) must be >= "
                              f"`restart_backoff_s` ({self.restart_backoff_s})")

    def ray_resources(self, role: str) -> dict[str, float]:
        """A role's `--ray-*-resources` as a name -> amount map (`CPU`, `GPU` or a custom resource)."""
        out: dict[str, float] = {}
        for item in getattr(self, f"ray_{role}_resources"):
            name, sep, amount = item.partition("=")
            try:
                value = float(amount)
            except ValueError:
                value = -1.0
            if not sep or not name.strip() or value < 0:
                raise ConfigError(f"`ray_{role}_resources`: {item!r} is not NAME=AMOUNT (e.g. CPU=0.5, GPU=1)")
            out[name.strip()] = value
        return out


@dataclass(frozen=True)
class GenerateConfig:
    """`pdspark generate`: one offline run. Sampling options left unset take `SamplingParams`' defaults."""

    model: str = option(help=_MODEL_HELP)
    prompt_ids: tuple[int, ...] | None = option(
        None, "prompt token ids, comma-separated (for checkpoints without a tokenizer)")
    max_tokens: int = option(64, "tokens to generate per prompt", minimum=1)
    temperature: float = option(0.0, "sampling temperature (0: greedy)", minimum=0)
    top_k: int | None = option(None, "sample among the k most likely tokens only")
    top_p: float | None = option(None, "sample among the most likely tokens holding this much probability only")
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token")
    quiet: bool = option(False, "no progress bar or timing line")
    engine: EngineConfig = nested(EngineConfig, "engine")

    def __post_init__(self) -> None:
        validate(self)
