"""The one source of configuration: every option is a dataclass field, and its flag, `PDSPARK_*` variable and
keyword option are generated from it (`pdspark.options`). No model, no processes."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

import pdspark.config as config_module
from pdspark.cli import build_parser
from pdspark.config import (
    AdmissionConfig,
    CacheConfig,
    DiscoveryConfig,
    EngineConfig,
    GenerateConfig,
    HealthConfig,
    RouterConfig,
    SchedulerConfig,
    UpConfig,
    WorkerConfig,
)
from pdspark.errors import ConfigError
from pdspark.options import (
    OptionSpec,
    build,
    nested,
    option,
    parse_args,
    parse_options,
    replace_options,
    secret_env,
    specs,
    to_argv,
)

ROOTS = [EngineConfig, WorkerConfig, RouterConfig, UpConfig, GenerateConfig]
# What each root needs besides its options (the subcommand decides the worker's role; generate needs a model).
FIXED: dict[type, dict] = {WorkerConfig: {"role": "decode"}}
REQUIRED_ENV: dict[type, dict] = {GenerateConfig: {"PDSPARK_MODEL": "m"}}
# Options valid only together (a cross-field rule): setting one sets the others of its group too.
TOGETHER = [("tls_cert", "tls_key", "tls_ca"), ("ssl_certfile", "ssl_keyfile")]
NEEDS = {"tls_peer_name": ("tls_cert", "tls_key", "tls_ca")}  # options valid only beside others
ALL_CONFIGS = sorted(
    {c for _, c in inspect.getmembers(config_module, inspect.isclass) if dataclasses.is_dataclass(c)
     and c.__module__ == config_module.__name__}, key=lambda c: c.__name__)


def parse(cls, argv=(), env=None):
    return parse_args(cls, list(argv), {**REQUIRED_ENV.get(cls, {}), **(env or {})}, **FIXED.get(cls, {}))


def value_at(cfg, spec: OptionSpec):
    for part in spec.path:
        cfg = getattr(cfg, part)
    return cfg


def sample(spec: OptionSpec):
    """A valid value different from the default, and its flag text."""
    if spec.choices:
        value = next(c for c in spec.choices if c != spec.default)
    elif spec.base is bool:
        value = not spec.default
    elif spec.name.endswith("_addr"):
        value = "10.0.0.1:29500"  # host:port
    elif spec.base is tuple and spec.name.startswith("ray_") and spec.name.endswith("_resources"):
        value = ("CPU=1", "GPU=0.5")  # NAME=AMOUNT items
    elif spec.base is tuple:
        # Secret options (keys) of different kinds may not share a value.
        value = (1, 2) if spec.item is int else (f"{spec.flag}-1", f"{spec.flag}-2") if spec.secret else ("a:1", "b:2")
    elif spec.base is int:
        value = spec.default + 1 if isinstance(spec.default, int) else (spec.minimum or 0) + 7
    elif spec.base is float:
        value = (spec.default or 0.0) + 1.5
    elif spec.name == "tls_peer_name":
        value = "{ip}.pdspark-{role}.default.svc"  # a DNS name template
    else:
        value = f"x-{spec.name}"
    return value, text(value)


def text(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def cases():
    return [pytest.param(cls, s, id=f"{cls.__name__}-{s.flag}") for cls in ROOTS for s in specs(cls) if s.cli]


# ---- the generator covers every field --------------------------------------------------------------------------------


def test_every_config_is_a_frozen_dataclass():
    assert {c.__name__ for c in ALL_CONFIGS} >= {"CacheConfig", "SchedulerConfig", "EngineConfig", "WorkerConfig",
                                                 "RouterConfig", "UpConfig", "GenerateConfig"}
    for cls in ALL_CONFIGS:
        cfg = cls(**FIXED.get(cls, {}), **({"model": "m"} if cls is GenerateConfig else {}))
        first = dataclasses.fields(cls)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, first, getattr(cfg, first))


def test_every_field_has_help_text():
    missing = [f"{cls.__name__}.{f.name}" for cls in ALL_CONFIGS for f in dataclasses.fields(cls)
               if not str(f.metadata.get("help", "")).strip()]
    assert not missing, f"fields without help text: {missing}"


@pytest.mark.parametrize("cls", ROOTS)
def test_every_leaf_field_is_an_option_of_its_root(cls):
    """Walking the dataclass tree by hand finds exactly the generated options (minus what a parent skips)."""

    def leaves(c, prefix=()):
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            if f.metadata.get("nested"):
                yield from ((p, s) for p, s in leaves(hints[f.name], (*prefix, f.name)) if p[-1] not in
                            f.metadata["skip"])
            else:
                yield (*prefix, f.name), f

    assert {p for p, _ in leaves(cls)} == {s.path for s in specs(cls)}


@pytest.mark.parametrize("cls, spec", cases())
def test_every_option_has_a_flag_and_a_variable(cls, spec):
    value, text = sample(spec)
    flag = (["--" + spec.flag] if value else ["--no-" + spec.flag]) if spec.base is bool else ["--" + spec.flag, text]
    group = next((g for g in TOGETHER if spec.name in g), NEEDS.get(spec.name, ()))
    others = {s.env: f"x-{s.name}" for s in specs(cls) if s.name in group and s.name != spec.name}
    assert value_at(parse(cls, flag, env=others), spec) == value
    assert value_at(parse(cls, env={**others, spec.env: text}), spec) == value
    assert value_at(parse(cls), spec) == (spec.default if spec.default is not dataclasses.MISSING else "m")
    assert spec.env == "PDSPARK_" + spec.flag.upper().replace("-", "_")


def test_flags_are_kebab_case_of_the_field_unless_renamed():
    renamed = {s.name: s.flag for cls in ROOTS for s in specs(cls) if s.flag != s.name.replace("_", "-")}
    # Flags older than their fields keep their names.
    assert renamed == {"enable_prefix_cache": "prefix-cache", "transfer_timeout_s": "transfer-timeout",
                       "health_interval_s": "health-interval"}


@dataclasses.dataclass(frozen=True)
class _Inner:
    port: int = option(1, "an inner port")


@dataclasses.dataclass(frozen=True)
class _Outer:
    port: int = option(2, "an outer port")
    inner: _Inner = nested(_Inner, "inner")


@dataclasses.dataclass(frozen=True)
class _OuterSkipping:
    port: int = option(2, "an outer port")
    inner: _Inner = nested(_Inner, "inner", skip=("port",))


def test_a_flag_naming_two_fields_is_refused():
    # Flattening would make `--port` ambiguous; the tree is refused when first read, not parsed wrongly.
    with pytest.raises(AssertionError, match="inner.port and port share the name 'port'"):
        specs(_Outer)
    assert [s.path for s in specs(_OuterSkipping)] == [("port",)]


# ---- precedence and parsing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, env_text, cli_text, field, default, env_value, cli_value", [
    ("page-size", "32", "16", ("engine", "cache", "page_size"), 64, 32, 16),
    ("metrics-port", "none", "9100", ("metrics_port",), 0, None, 9100),
    ("max-model-len", "512", "none", ("engine", "scheduler", "max_model_len"), None, 512, None),
    ("speculative", "dspark", "none", ("engine", "speculative"), None, "dspark", None),
])
def test_command_line_beats_environment_beats_default(flag, env_text, cli_text, field, default, env_value,
                                                      cli_value):
    env = {"PDSPARK_" + flag.upper().replace("-", "_"): env_text}
    spec = next(s for s in specs(WorkerConfig) if s.path == field)
    assert value_at(parse(WorkerConfig), spec) == default
    assert value_at(parse(WorkerConfig, env=env), spec) == env_value
    assert value_at(parse(WorkerConfig, ["--" + flag, cli_text], env=env), spec) == cli_value


def test_bool_flags_and_variables():
    assert parse(WorkerConfig).engine.cache.enable_prefix_cache is True
    assert parse(WorkerConfig, ["--no-prefix-cache"]).engine.cache.enable_prefix_cache is False
    for word in ("0", "false", "No", "off"):
        assert parse(WorkerConfig, env={"PDSPARK_PREFIX_CACHE": word}).engine.cache.enable_prefix_cache is False
    for word in ("1", "true", "YES", "on"):
        assert parse(UpConfig, env={"PDSPARK_SPECULATIVE": word}).speculative is True
    # The flag beats the variable in both directions.
    assert parse(UpConfig, ["--speculative"], {"PDSPARK_SPECULATIVE": "0"}).speculative is True
    assert parse(UpConfig, ["--no-speculative"], {"PDSPARK_SPECULATIVE": "1"}).speculative is False
    with pytest.raises(ConfigError, match=r"`enable_prefix_cache` \(PDSPARK_PREFIX_CACHE\); allowed: true or false"):
        parse(WorkerConfig, env={"PDSPARK_PREFIX_CACHE": "maybe"})


def test_none_words_and_empty_variables():
    assert parse(WorkerConfig, ["--metrics-port", "off"]).metrics_port is None
    assert parse(WorkerConfig, ["--metrics-port", "None"]).metrics_port is None
    # An empty variable is unset, not "none": the default applies.
    assert parse(WorkerConfig, env={"PDSPARK_METRICS_PORT": ""}).metrics_port == 0
    # `none` is only a word for options that can be None.
    with pytest.raises(ConfigError, match=r"`port` \(--port\); allowed: an integer in \[0, 65535\]$"):
        parse(WorkerConfig, ["--port", "none"])


def test_tuples_are_comma_separated():
    cfg = parse(RouterConfig, ["--prefill", " a:1, b:2,"], {"PDSPARK_DECODE": "c:3"})
    assert cfg.prefill == ("a:1", "b:2") and cfg.decode == ("c:3",)
    assert parse(RouterConfig, ["--prefill", ""]).prefill == ()
    assert parse(GenerateConfig, ["--prompt-ids", "5,6,7"]).prompt_ids == (5, 6, 7)
    with pytest.raises(ConfigError, match=r"`prompt_ids` \(--prompt-ids\); allowed: comma-separated integers"):
        parse(GenerateConfig, ["--prompt-ids", "5,x"])
    # Keyword callers may pass lists; the frozen config holds a tuple.
    assert build(RouterConfig, {"prefill": ["a:1"]}).prefill == ("a:1",)


def test_old_variable_names_still_apply():
    cfg = parse(RouterConfig, env={"PDSPARK_TRANSFER_TIMEOUT": "5", "PDSPARK_HEALTH_INTERVAL": "0.5",
                                   "PDSPARK_PREFILL_POLICY": "round_robin", "PDSPARK_GRPC_PORT": "50050"})
    assert (cfg.transfer_timeout_s, cfg.health.health_interval_s, cfg.prefill_policy, cfg.grpc_port) == \
           (5.0, 0.5, "round_robin", 50050)


# ---- bad values name the field and what it allows --------------------------------------------------------------------


@pytest.mark.parametrize("argv, env, pattern", [
    (["--dtype", "int8"], {}, r"unsupported value 'int8' for `dtype`; allowed: 'float32', 'bfloat16', 'float16'"),
    ([], {"PDSPARK_TRANSFER_BACKEND": "nccl"}, r"`transfer_backend`; allowed: 'mooncake', 'inprocess'"),
    (["--page-size", "0"], {}, r"invalid value 0 for `page_size`; allowed: an integer >= 1$"),
    (["--page-size", "big"], {}, r"invalid value 'big' for `page_size` \(--page-size\); allowed: an integer >= 1"),
    ([], {"PDSPARK_PORT": "70000"}, r"`port`; allowed: an integer in \[0, 65535\]"),
    # -1 no longer means "off": the message says what does.
    (["--metrics-port", "-1"], {}, r"`metrics_port`; allowed: an integer in \[0, 65535\] or none"),
    (["--num-full-pages", "0"], {}, r"`num_full_pages`; allowed: an integer >= 1 or none"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], {},
     r"`max_num_batched_tokens` \(32\) must be >= `max_num_seqs` \(64\)"),
])
def test_bad_values_name_the_field_and_the_allowed_values(argv, env, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse(WorkerConfig, argv, env)


def test_keyword_options_are_validated_like_flags():
    with pytest.raises(ConfigError, match=r"invalid value '16' for `page_size`; allowed: an integer >= 1"):
        build(EngineConfig, {"page_size": "16"})
    with pytest.raises(ConfigError, match=r"`enable_prefix_cache`; allowed: true or false"):
        CacheConfig(enable_prefix_cache=1)
    with pytest.raises(ConfigError, match=r"`transfer_timeout_s`; allowed: a number > 0"):
        RouterConfig(transfer_timeout_s=0)
    # The router's sub-configs check their own fields, and name them, whichever way the value came in.
    with pytest.raises(ConfigError, match=r"invalid value 0 for `health_timeout_s`; allowed: a number > 0"):
        build(RouterConfig, {"health_timeout_s": 0})
    with pytest.raises(ConfigError, match=r"invalid value -1.0 for `request_timeout_s`; allowed: a number > 0"):
        AdmissionConfig(request_timeout_s=-1.0)
    with pytest.raises(ConfigError, match=r"`role`; allowed: 'prefill', 'decode'"):
        WorkerConfig(role="both")


def test_unknown_keyword_is_named_with_the_allowed_ones():
    with pytest.raises(ConfigError) as e:
        build(EngineConfig, {"page_sise": 16, "max_num_seqs": 4})
    assert "'page_sise'" in str(e.value)
    allowed = str(e.value).split("allowed: ")[1].split(", ")
    assert allowed == sorted(s.name for s in specs(EngineConfig) if s.cli)
    assert "max_draft_tokens" not in allowed  # set by the engine, not a user option


def test_create_engine_refuses_an_unknown_keyword_before_loading():
    from pdspark.engine.factory import create_engine

    with pytest.raises(ConfigError, match="unknown option 'max_batch_size'.*allowed: .*max_num_seqs"):
        create_engine("dsv4-tiny", max_batch_size=4)


def test_required_option():
    with pytest.raises(ConfigError, match=r"`model` is required \(--model or PDSPARK_MODEL\)"):
        parse_args(GenerateConfig, [], {})
    assert parse_args(GenerateConfig, [], {"PDSPARK_MODEL": "m"}).model == "m"


# ---- building, resolving, passing on ---------------------------------------------------------------------------------


def test_flat_keywords_reach_the_nested_configs():
    cfg = build(EngineConfig, {"page_size": 16, "max_num_seqs": 4, "enable_prefix_cache": False, "dtype": "bfloat16"})
    assert cfg == EngineConfig(cache=CacheConfig(page_size=16, enable_prefix_cache=False),
                               scheduler=SchedulerConfig(max_num_seqs=4), dtype="bfloat16")
    # Options given over a base config change only themselves.
    assert replace_options(cfg, seed=3) == dataclasses.replace(cfg, seed=3)


def test_max_model_len_resolves_against_the_model():
    assert EngineConfig().for_model(2048).scheduler.max_model_len == 2048
    assert EngineConfig().for_model(1 << 20).scheduler.max_model_len == config_module.DEFAULT_MAX_MODEL_LEN
    assert build(EngineConfig, {"max_model_len": 256}).for_model(2048).scheduler.max_model_len == 256


@pytest.mark.parametrize("cls", ROOTS)
def test_to_argv_parses_back_whatever_the_environment(cls):
    values = {s.name: sample(s)[0] for s in specs(cls) if s.cli}
    if "max_num_seqs" in values:
        values["max_num_seqs"] = 8  # keep the cross-field rule (batched tokens >= seqs) satisfied
    cfg = build(cls, values, fixed=FIXED.get(cls))
    # Variables holding the defaults (or anything else) must not change what the flags say.
    hostile = {s.env: "m" if s.default is dataclasses.MISSING else text(s.default) for s in specs(cls) if s.cli}
    # Secret options travel in the child's environment instead (`secret_env`).
    assert parse_args(cls, to_argv(cfg), {**hostile, **secret_env(cfg)}, **FIXED.get(cls, {})) == cfg
    assert parse_args(cls, to_argv(build(cls, {"model": "m"} if cls is GenerateConfig else {}, fixed=FIXED.get(cls))),
                      {}, **FIXED.get(cls, {})) == parse(cls)


def test_the_admin_port_is_a_port_of_its_own():
    assert parse(RouterConfig).admin_port is None
    assert parse(RouterConfig, ["--admin-port", "9001"]).admin_port == 9001
    assert parse(RouterConfig, env={"PDSPARK_ADMIN_PORT": "0"}).admin_port == 0  # any free port
    assert parse(RouterConfig, ["--admin-port", "none"], {"PDSPARK_ADMIN_PORT": "9001"}).admin_port is None
    for argv in (["--admin-port", "8000"], ["--admin-port", "9001", "--grpc-port", "9001"]):
        with pytest.raises(ConfigError, match="`admin_port` .* must differ"):
            parse(RouterConfig, argv)
    with pytest.raises(ConfigError, match="admin_port"):
        parse(RouterConfig, ["--admin-port", "65536"])


def test_keys_never_reach_a_command_line_a_repr_or_an_error_message():
    cfg = parse(RouterConfig, ["--api-key", "client-key-1,client-key-2"], {"PDSPARK_ADMIN_API_KEY": "admin-key-1"})
    assert (cfg.auth.api_key, cfg.auth.admin_api_key) == (("client-key-1", "client-key-2"), ("admin-key-1",))
    argv, shown = to_argv(cfg), repr(cfg)
    assert not [a for a in argv if "key-1" in a] and "key-1" not in shown and "--api-key" not in argv
    assert secret_env(cfg) == {"PDSPARK_API_KEY": "client-key-1,client-key-2", "PDSPARK_ADMIN_API_KEY": "admin-key-1"}
    # Unset keys are set to "" (unset) too, so a child's inherited environment cannot add one.
    assert secret_env(parse(RouterConfig)) == {"PDSPARK_API_KEY": "", "PDSPARK_ADMIN_API_KEY": ""}
    for bad in ([" padded-key-1 "], ["same-key-12345", "x"]):
        with pytest.raises(ConfigError) as e:
            build(RouterConfig, {"api_key": tuple(bad), "admin_api_key": ("same-key-12345",)})
        assert "padded-key-1" not in str(e.value) and "same-key-12345" not in str(e.value)
    with pytest.raises(ConfigError, match="hidden"):
        build(RouterConfig, {"api_key": "not-a-tuple-key"})


def test_up_sets_each_roles_group_size_and_decode_groups_run_dp_attention():
    from pdspark.launch.plan import worker_configs

    workers = worker_configs(parse(UpConfig, ["--prefill-ep-size", "2"]), has_draft=False)
    assert (workers["prefill"].engine.parallel.ep_size, workers["decode"].engine.parallel.ep_size) == (2, 1)
    assert not workers["decode"].engine.parallel.dp_attention  # (one process: nothing to split)
    for argv in (["--ep-size", "2"], ["--decode-ep-size", "2"], ["--ep-size", "2", "--dp-attention"]):
        workers = worker_configs(parse(UpConfig, argv), has_draft=False)
        decode, prefill = workers["decode"].engine.parallel, workers["prefill"].engine.parallel
        assert (decode.ep_size, decode.dp_attention) == (2, True)
        assert not prefill.dp_attention  # a prefill group runs replicated


def test_up_refuses_what_a_local_cluster_cannot_run_and_ray_actors_take_each_ranks_resources():
    """`pdspark up` (one machine) refuses groups across machines before anything starts; on Ray, a group's actor
    takes its role's resources once per rank."""
    from pdspark.launch.plan import plan_cluster, worker_configs
    from pdspark.launch.ray_backend import actor_resources

    with pytest.raises(ConfigError, match="`nnodes` is 2 for `pdspark up`; allowed: 1"):
        worker_configs(parse(UpConfig, ["--nnodes", "2"]), has_draft=False)
    cfg = parse(UpConfig, ["--prefill-ep-size", "2", "--ray-prefill-resources", "CPU=0.5,GPU=1"])
    plan = plan_cluster(cfg)
    (prefill,) = [w for w in plan.workers if w.role == "prefill"]
    (decode,) = [w for w in plan.workers if w.role == "decode"]
    assert (prefill.ranks, decode.ranks) == (2, 1)
    assert actor_resources(cfg, prefill) == {"CPU": 1.0, "GPU": 2.0}
    assert actor_resources(cfg, decode) == {"CPU": 0.25}


def test_up_passes_its_options_to_the_children():
    from pdspark.launch.plan import router_config, worker_configs

    up = parse(UpConfig, ["--model", "m", "--page-size", "16", "--max-model-len", "256", "--no-speculative",
                          "--router-processes", "2"])
    workers = worker_configs(up, has_draft=True)
    assert workers["prefill"].engine.speculative is None  # --no-speculative wins over the shipped draft
    assert worker_configs(parse(UpConfig), has_draft=True)["decode"].engine.speculative == "dspark"
    assert worker_configs(parse(UpConfig), has_draft=False)["decode"].engine.speculative is None
    assert workers["prefill"].engine.cache.enable_prefix_cache
    assert not workers["decode"].engine.cache.enable_prefix_cache
    parser = build_parser()
    for role, w in workers.items():
        assert w.engine.cache.page_size == 16 and w.engine.scheduler.max_model_len == 256
        args = parser.parse_args(["serve", role, *to_argv(w)])
        assert parse_options(WorkerConfig, args, {}, fixed={"role": role}) == w
    router = router_config(up, ["p:1"], ["d:2"])
    args = parser.parse_args(["serve", "router", *to_argv(router)])
    assert parse_options(RouterConfig, args, {}) == router
    assert router.max_model_len == 256 and router.prefill == ("p:1",) and router.model == "m"
    assert router.processes == 2 and "--processes" in to_argv(router)
    # The keys reach the router; the secret ones by its environment.
    keyed = parse(UpConfig, ["--api-key-file", "/k"], {"PDSPARK_API_KEY": "client-key-1",
                                                       "PDSPARK_ADMIN_API_KEY": "admin-key-1"})
    router = router_config(keyed, ["p:1"], ["d:2"])
    assert router.auth == keyed.auth and router.auth.api_key_file == "/k"
    args = parser.parse_args(["serve", "router", *to_argv(router)])
    assert parse_options(RouterConfig, args, secret_env(router)) == router


# ---- today's command lines keep working ------------------------------------------------------------------------------


def cli_config(argv: list[str], env: dict | None = None):
    args = build_parser().parse_args(argv)
    return parse_options(args.config, args, env or {}, fixed={"role": args.role} if args.config is WorkerConfig
                         else None)


def test_existing_worker_flags():
    cfg = cli_config(["serve", "prefill", "--model", "m", "--host", "0.0.0.0", "--port", "0", "--metrics-port", "0",
                      "--advertise-host", "10.0.0.2", "--transfer-backend", "inprocess", "--transfer-protocol", "rdma",
                      "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                      "--page-size", "16", "--num-full-pages", "64", "--num-swa-pages", "8", "--dtype", "bfloat16",
                      "--seed", "3", "--speculative", "dspark", "--num-speculative-tokens", "2", "--no-prefix-cache"])
    e = cfg.engine
    assert (cfg.role, cfg.model, cfg.host, cfg.port, cfg.metrics_port, cfg.advertise_host, cfg.transfer_backend,
            cfg.transfer_protocol) == ("prefill", "m", "0.0.0.0", 0, 0, "10.0.0.2", "inprocess", "rdma")
    assert (e.scheduler.max_model_len, e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens) == (256, 4, 64)
    assert (e.cache.page_size, e.cache.num_full_pages, e.cache.num_swa_pages, e.cache.enable_prefix_cache) == \
           (16, 64, 8, False)
    assert (e.dtype, e.seed, e.speculative, e.num_speculative_tokens) == ("bfloat16", 3, "dspark", 2)


def test_existing_router_flags():
    cfg = cli_config(["serve", "router", "--model", "m", "--served-model-name", "n", "--host", "0.0.0.0",
                      "--port", "0", "--grpc-port", "0", "--prefill", "a:1,b:2", "--decode", "c:3",
                      "--prefill-policy", "round_robin", "--decode-policy", "cache_aware", "--max-model-len", "512",
                      "--transfer-timeout", "5", "--health-interval", "0.5"])
    assert cfg == RouterConfig(model="m", served_model_name="n", host="0.0.0.0", port=0, grpc_port=0,
                               prefill=("a:1", "b:2"), decode=("c:3",), prefill_policy="round_robin",
                               decode_policy="cache_aware", max_model_len=512, transfer_timeout_s=5.0,
                               health=HealthConfig(health_interval_s=0.5))
    # The admission, health and discovery options live in sub-configs; their flags and variables are flat, as before.
    cfg = cli_config(["serve", "router", "--max-in-flight", "8", "--max-queued", "16", "--max-in-flight-per-key", "4",
                      "--max-body-bytes", "4096", "--request-timeout-s", "60", "--health-timeout-s", "0.25",
                      "--load-interval-s", "2", "--prefill-dns", "pf:1", "--decode-dns", "dc:2",
                      "--dns-interval-s", "3"], {"PDSPARK_HOSTS_FILE": "/h", "PDSPARK_HEALTH_INTERVAL": "0.75"})
    assert cfg == RouterConfig(
        admission=AdmissionConfig(max_in_flight=8, max_queued=16, max_in_flight_per_key=4, max_body_bytes=4096,
                                  request_timeout_s=60.0),
        health=HealthConfig(health_interval_s=0.75, health_timeout_s=0.25, load_interval_s=2.0),
        discovery=DiscoveryConfig(prefill_dns=("pf:1",), decode_dns=("dc:2",), dns_interval_s=3.0, hosts_file="/h"))


def test_existing_up_and_generate_flags():
    up = cli_config(["up", "--model", "m", "--prefill", "2", "--decode", "3", "--host", "0.0.0.0", "--port", "0",
                     "--grpc-port", "0", "--no-speculative", "--page-size", "16", "--no-prefix-cache"])
    assert (up.prefill, up.decode, up.port, up.grpc_port, up.speculative) == (2, 3, 0, 0, False)
    assert up.engine.cache.page_size == 16 and not up.engine.cache.enable_prefix_cache
    gen = cli_config(["generate", "--model", "m", "--prompt-ids", "5,6", "--max-tokens", "6", "--temperature", "0.5",
                      "--top-k", "-1", "--top-p", "0.9", "--seed", "7", "--ignore-eos", "--max-model-len", "128",
                      "--dtype", "bfloat16", "--quiet", "hello"])
    assert (gen.prompt_ids, gen.max_tokens, gen.temperature, gen.top_k, gen.top_p, gen.ignore_eos, gen.quiet) == \
           ((5, 6), 6, 0.5, -1, 0.9, True, True)
    assert (gen.engine.seed, gen.engine.scheduler.max_model_len, gen.engine.dtype) == (7, 128, "bfloat16")


def test_choices_match_the_code_that_uses_them():
    from pdspark.router.workers.policies import POLICIES
    from pdspark.transfer.backend import BACKENDS

    assert typing.get_args(config_module.Policy) == POLICIES
    assert typing.get_args(config_module.TransferBackend) == BACKENDS


@pytest.mark.parametrize("bad", [("CPU",), ("=1",), ("CPU=lots",), ("GPU=-1",)])
def test_ray_resources_are_name_amount_pairs(bad):
    assert UpConfig(ray_decode_resources=("CPU=0.5", "GPU=1", "accel=2")).ray_resources("decode") == \
        {"CPU": 0.5, "GPU": 1.0, "accel": 2.0}
    with pytest.raises(ConfigError, match="NAME=AMOUNT"):
        UpConfig(ray_decode_resources=bad)
