"""Flags, `PDSPARK_*` environment variables and keyword options, generated from the config dataclasses.

A config field declared with `option(default, help, ...)` is, with nothing else written anywhere:
- a command-line flag `--<field-name>` (dashes for underscores; `flag=` renames it), typed from the annotation:
  `int`/`float`/`str` take one value; `bool` is `--x` / `--no-x`; `Literal[...]` takes one of its values;
  `X | None` also takes `none` (or `off`) for None; `tuple[X, ...]` takes comma-separated values, and its flag
  may be repeated (`--x a --x b,c` is `a,b,c`);
- an environment variable `PDSPARK_<FLAG>` (upper case, underscores) with the same syntax, bools as
  1/0, true/false, yes/no or on/off; an empty variable counts as unset;
- a keyword option of `build` (what `LLM(**options)` and `create_engine(**options)` take), under the field name.
The fields of a `nested(...)` config are flattened beside the parent's, so a flag, variable or keyword names one
field wherever it lives in the tree (a clash is an error when the tree is first read). Precedence: command line >
environment > the field's default, and the default is written only in the field. Validation lives in the
dataclasses' `__post_init__` (`validate` checks types, choices and ranges; cross-field rules are the class's own),
so a bad value is refused the same way whichever way it came in.

A `secret=True` option (an API key) never travels on a command line, where `ps` shows it to every user of the
machine: `to_argv` leaves it out and `secret_env` gives the variables that carry it to a child process instead. It
is left out of the config's repr too, and error messages never echo its value.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any, Literal

from pdspark.errors import ConfigError, check_choice

ENV_PREFIX = "PDSPARK_"
_NONE_WORDS = ("none", "off")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def option(default: Any = MISSING, help: str = "", *, flag: str | None = None, cli: bool = True,
           minimum: float | None = None, maximum: float | None = None, secret: bool = False) -> Any:
    """A config field with its default and help text.

    Args:
        default: the value when neither a flag nor a variable sets it; leave out for a required field.
        help: one line for `--help` (the default and the variable name are appended).
        flag: the flag's name without dashes when it is not the field name (kept for flags older than the field).
        cli: False for fields that code sets (the subcommand's role, values derived at run time): no flag,
            no variable, no keyword option.
        minimum, maximum: inclusive bounds, checked by `validate`.
        secret: key material: passed to child processes by `secret_env`, never by `to_argv`; not in the repr.
    """
    meta = {"help": help, "flag": flag, "cli": cli, "minimum": minimum, "maximum": maximum, "secret": secret}
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


def nested(cls: type, help: str, *, skip: tuple[str, ...] = ()) -> Any:
    """A config composed into its parent; `skip` names sub-options the parent sets itself (no flag for them)."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "nested": True, "skip": skip})


@dataclass(frozen=True)
class OptionSpec:
    """One leaf option of a config tree."""

    path: tuple[str, ...]  # attribute path from the root config, e.g. ("engine", "cache", "page_size")
    base: type  # int, float, str, bool or tuple (for tuple[item, ...])
    item: type | None  # the element type of a tuple option
    optional: bool  # `X | None`
    choices: tuple  # the values of a `Literal[...]`, else ()
    default: Any  # MISSING for a required option
    help: str
    flag: str  # without the leading dashes
    cli: bool
    minimum: float | None
    maximum: float | None
    group: str  # the help of the nested config it belongs to ("" at the root)
    secret: bool

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.upper().replace("-", "_")

    @property
    def expects(self) -> str:
        """What a valid value looks like, for error messages."""
        if self.choices:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
                    tuple: f"comma-separated {_PLURAL.get(self.item, 'values') if self.item else 'values'}"}[self.base]
        if self.minimum is not None or self.maximum is not None:
            text += " " + _range_text(self.minimum, self.maximum)
        return text + (" or none" if self.optional else "")


_PLURAL = {int: "integers", float: "numbers", str: "strings"}


def _range_text(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def _shape(tp: Any) -> tuple[type, type | None, bool, tuple]:
    """(base, tuple item, optional, choices) of a field annotation."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        assert len(args) == 1, f"only `X | None` unions are options, not {tp}"
        optional, tp = True, args[0]
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), None, optional, choices
    if typing.get_origin(tp) is tuple:
        item, ellipsis = typing.get_args(tp)
        assert ellipsis is Ellipsis and item in _PLURAL, f"tuple options are tuple[int|float|str, ...], not {tp}"
        return tuple, item, optional, ()
    assert tp in (int, float, str, bool), f"unsupported option type {tp}"
    return tp, None, optional, ()


@cache
def field_specs(cls: type) -> tuple[OptionSpec, ...]:
    """The options of `cls`'s own (not nested) fields."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("nested"):
            continue
        assert "help" in f.metadata, f"{cls.__name__}.{f.name} is not declared with option()"
        base, item, optional, choices = _shape(hints[f.name])
        m = f.metadata
        out.append(OptionSpec((f.name,), base, item, optional, choices, f.default, m["help"],
                              m["flag"] or f.name.replace("_", "-"), m["cli"], m["minimum"], m["maximum"], "",
                              m.get("secret", False)))
    return tuple(out)


@cache
def specs(cls: type) -> tuple[OptionSpec, ...]:
    """Every leaf option of the config tree rooted at `cls`, nested configs flattened (minus what they skip)."""
    hints = typing.get_type_hints(cls)
    own = {s.name: s for s in field_specs(cls)}
    out: list[OptionSpec] = []
    for f in dataclasses.fields(cls):
        if f.name in own:
            out.append(own[f.name])
            continue
        skip = f.metadata["skip"]
        for s in specs(hints[f.name]):
            if s.name not in skip:
                out.append(dataclasses.replace(s, path=(f.name, *s.path), group=s.group or f.metadata["help"]))
    for key in ("name", "flag"):
        seen: dict[str, OptionSpec] = {}
        for s in out:
            other = seen.setdefault(getattr(s, key), s)
            assert other is s, f"{cls.__name__}: {'.'.join(s.path)} and {'.'.join(other.path)} share the {key} " \
                               f"{getattr(s, key)!r}"
    return tuple(out)


# ---- reading values --------------------------------------------------------------------------------------------------


def parse_text(spec: OptionSpec, text: str, source: str) -> Any:
    """The typed value of a flag's or variable's text; raises ConfigError naming the option and what it takes."""
    word = text.strip()
    if spec.optional and word.lower() in _NONE_WORDS:
        return None
    try:
        if spec.base is bool:
            if word.lower() in _TRUE_WORDS:
                return True
            if word.lower() in _FALSE_WORDS:
                return False
            raise ValueError(word)
        if spec.base is tuple:
            assert spec.item is not None  # a tuple option knows its element type
            return tuple(spec.item(part.strip()) for part in word.split(",") if part.strip())
        return spec.base(word)
    except ValueError:
        shown = "(hidden)" if spec.secret else repr(text)
        raise ConfigError(f"invalid value {shown} for `{spec.name}` ({source}); allowed: {spec.expects}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add a flag for every option of `cls` (grouped by nested config in `--help`). Flags left out stay absent
    from the parsed namespace, which is how `parse_options` tells 'not given' from 'given the default'."""
    groups: dict[str, Any] = {"": parser}
    for spec in specs(cls):
        if not spec.cli:
            continue
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        kw = dict(dest=spec.name, default=argparse.SUPPRESS, help=f"{spec.help} ({_default_text(spec)}env {spec.env})")
        if spec.base is bool and not spec.optional:
            groups[spec.group].add_argument("--" + spec.flag, action=argparse.BooleanOptionalAction, **kw)
        elif spec.base is tuple:
            groups[spec.group].add_argument("--" + spec.flag, metavar=_metavar(spec), action="append", **kw)
        else:
            groups[spec.group].add_argument("--" + spec.flag, metavar=_metavar(spec), **kw)


def _default_text(spec: OptionSpec) -> str:
    if spec.default is MISSING:
        return "required; "
    if "default:" in spec.help:  # the help already says what an unset value means
        return ""
    if spec.base is bool and not spec.optional:
        return f"default: --{'' if spec.default else 'no-'}{spec.flag}; "
    return f"default: {_show(spec.default)}; "


def _metavar(spec: OptionSpec) -> str:
    if spec.choices:
        return "{" + ",".join(str(c) for c in spec.choices) + "}"
    return {int: "N", float: "X", str: "TEXT", tuple: "A,B,..."}[spec.base]


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "(empty)"
    return str(value)


def parse_options(cls: type, namespace: argparse.Namespace, environ: Mapping[str, str] | None = None,
                  fixed: Mapping[str, Any] | None = None) -> Any:
    """The frozen `cls` config from parsed flags (`add_arguments`), then `PDSPARK_*` variables, then defaults.

    `fixed` sets options the caller decides (e.g. the worker's role from the subcommand), flags or not."""
    environ = os.environ if environ is None else environ
    values = {}
    for spec in specs(cls):
        if not spec.cli:
            continue
        if hasattr(namespace, spec.name):
            raw, source = getattr(namespace, spec.name), "--" + spec.flag
            if isinstance(raw, list):  # a repeatable (tuple) flag: every occurrence, in order
                raw = ",".join(raw)
        elif environ.get(spec.env, "") != "":
            raw, source = environ[spec.env], spec.env
        else:
            continue
        # BooleanOptionalAction already gives a bool; everything else arrives as text.
        values[spec.name] = raw if isinstance(raw, bool) else parse_text(spec, raw, source)
    return build(cls, values, fixed=fixed)


def parse_args(cls: type, argv: list[str], environ: Mapping[str, str] | None = None, **fixed: Any) -> Any:
    """`parse_options` on a parser holding only `cls`'s flags (scripts, tests)."""
    parser = argparse.ArgumentParser(prog=cls.__name__)
    add_arguments(parser, cls)
    return parse_options(cls, parser.parse_args(argv), environ, fixed)


# ---- building configs from flat options ------------------------------------------------------------------------------


def build(cls: type, options: Mapping[str, Any], *, base: Any = None, fixed: Mapping[str, Any] | None = None) -> Any:
    """A `cls` config from flat keyword options (field names, nested configs flattened), on top of `base` (or the
    defaults). Unknown names raise ConfigError listing the allowed ones; `fixed` may also set `cli=False` fields."""
    public = {s.name: s for s in specs(cls) if s.cli}
    unknown = sorted(set(options) - set(public))
    if unknown:
        raise ConfigError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                          f"{cls.__name__}; allowed: {', '.join(sorted(public))}")
    every = {s.name: s for s in specs(cls)}
    values = {**options, **(fixed or {})}
    assert set(values) <= set(every), sorted(set(values) - set(every))
    if base is None:
        missing = [s for s in specs(cls) if s.default is MISSING and s.name not in values]
        if missing:
            s = missing[0]
            raise ConfigError(f"`{s.name}` is required" + (f" (--{s.flag} or {s.env})" if s.cli else ""))
    tree: dict = {}
    for name, value in values.items():
        spec = every[name]
        if spec.base is tuple and isinstance(value, list):
            value = tuple(value)  # keyword callers may pass lists; the frozen config holds tuples
        node = tree
        for part in spec.path[:-1]:
            node = node.setdefault(part, {})
        node[spec.name] = value
    return _construct(cls, tree, base)


def _construct(cls: type, tree: dict, base: Any) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            value = _construct(hints[name], value, getattr(base, name) if base is not None else None)
        kwargs[name] = value
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def replace_options(config: Any, **options: Any) -> Any:
    """`config` with some flat options changed (nested configs included); validated again."""
    return build(type(config), options, base=config)


def _value_at(config: Any, spec: OptionSpec) -> Any:
    value = config
    for part in spec.path:
        value = getattr(value, part)
    return value


def to_argv(config: Any) -> list[str]:
    """Flags that parse back to `config` (every option, so a child process's environment cannot change it), except
    the secret ones: `secret_env` carries those."""
    argv: list[str] = []
    cls: type = type(config)
    for spec in specs(cls):
        if not spec.cli or spec.secret:
            continue
        value = _value_at(config, spec)
        if spec.base is bool and not spec.optional:
            argv.append(("--" if value else "--no-") + spec.flag)
        else:
            argv += ["--" + spec.flag, _flag_text(value)]
    return argv


def secret_env(config: Any) -> dict[str, str]:
    """The `PDSPARK_*` variables that give a child process `config`'s secret options: with `to_argv`, what parses
    back to `config`. Every secret option is set, unset ones to "" (unset), so the child's inherited environment
    cannot add a key the parent did not mean."""
    cls: type = type(config)
    return {spec.env: "" if (value := _value_at(config, spec)) is None else _flag_text(value)
            for spec in specs(cls) if spec.cli and spec.secret}


def _flag_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)  # an empty tuple is "", which parses back to ()
    return str(value)


# ---- validation (called from each config's __post_init__) ------------------------------------------------------------


def validate(config: Any) -> None:
    """Check every own field of `config` against its annotation, choices and bounds; ConfigError names the field
    and the allowed values."""
    cls: type = type(config)
    for spec in field_specs(cls):
        value = getattr(config, spec.name)
        if value is None and spec.optional:
            continue
        if spec.choices:
            check_choice(spec.name, value, spec.choices + ((None,) if spec.optional else ()))
            continue
        ok = _is_a(value, spec.base) and (spec.base is not tuple or all(_is_a(v, spec.item) for v in value))
        lo, hi = spec.minimum, spec.maximum
        if ok and spec.base in (int, float):
            ok = (lo is None or value >= lo) and (hi is None or value <= hi)
        if not ok:
            shown = "(hidden)" if spec.secret else repr(value)
            raise ConfigError(f"invalid value {shown} for `{spec.name}`; allowed: {spec.expects}")


def _is_a(value: Any, kind: type | None) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and not isinstance(value, bool)  # type: ignore[arg-type]
