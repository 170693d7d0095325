"""The `Option` row (one flag, the config field it sets, its converters) and what reads the
rows: argparse declarations, Namespace -> field values -> configs."""

from __future__ import annotations

import argparse
import operator
from dataclasses import dataclass, fields
from functools import reduce
from typing import Any, Callable

from hearth.config import EngineConfig
from hearth.models.rope_scaling import parse_rope_scaling
from hearth.router.router_config import RouterConfig, UpConfig
from hearth.server.server_config import ServerConfig


# ---- Option: one row per flag, read three ways -----------------------------------------------

FROM_CONFIG = "<the field's default>"  # an Option's default: the config field's, via to_flag


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Option:
    """One flag and the config field it sets (hearth serve's, the router's, hearth up's)."""

    flag: str  # "--max-num-seqs"; its Namespace attribute is `dest`
    # The field, as ROOT.PATH: ROOT is engine (EngineConfig), server (ServerConfig), router
    # (RouterConfig) or up (UpConfig), PATH the field's dotted path in it.
    path: str
    type: Callable[[str], Any] = str  # argparse's type=; bool: a switch (store_true)
    help: str | None = None
    choices: tuple[str, ...] | None = None
    default: Any = FROM_CONFIG  # the flag's default when not the field's
    metavar: str | None = None
    nargs: str | None = None  # "+": a list of values
    action: str | None = None  # "append": a list, one value per use of the flag
    aliases: tuple[str, ...] = ()  # "-tp"
    to_config: Callable[[Any], Any] = _same  # the flag's value -> the field's
    to_flag: Callable[[Any], Any] = _same  # the field's value -> the flag's (serve_argv)
    also: tuple[str, Callable[[Any], Any]] | None = None  # another field it sets: path, to_config
    file_help: str | None = None  # a secret: has a FLAG-file twin (read_secrets); never on an argv
    always: bool = False  # serve_argv writes it even at its default (the worker's address)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _off_switch(flag: str, path: str, help: str | None = None) -> Option:
    """`--no-X`: given, the boolean field X is False."""
    return Option(flag, path, bool, help, to_config=operator.not_, to_flag=operator.not_)


def _rope_scaling_json(text: str) -> str:
    """--rope-scaling's value, checked here so a bad one fails before any process starts."""
    try:
        parse_rope_scaling(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _first(values: list[str] | None) -> str | None:
    return values[0] if values else None


def _names(values: list[str] | None) -> tuple[str, ...]:
    return tuple(values or ())


def _names_flag(names: tuple[str, ...]) -> list[str] | None:
    return list(names) or None


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(p for p in text.split(",") if p.strip())


def _mb_to_bytes(mb: float) -> int:
    return int(mb * 2**20)


def _bytes_to_mb(num_bytes: int) -> float:
    return num_bytes / 2**20


def _options(groups) -> tuple[Option, ...]:
    return tuple(o for _, options in groups for o in options)


def _default_configs() -> dict[str, Any]:
    """Every config an Option may set, at its defaults, by the root of the Option's path."""
    return {"engine": EngineConfig(), "server": ServerConfig(), "router": RouterConfig(),
            "up": UpConfig()}


def _get(configs: dict[str, Any], path: str) -> Any:
    root, *names = path.split(".")
    return reduce(getattr, names, configs[root])


def _flag_default(o: Option) -> Any:
    if o.default is not FROM_CONFIG:
        return o.default
    return o.to_flag(_get(_default_configs(), o.path))


def _add_options(g, options) -> None:
    """argparse declarations of `options` in group (or parser) `g`."""
    for o in options:
        if o.file_help is not None:
            add_secret_args(g, o.flag, o.help, o.file_help)
        elif o.type is bool:
            g.add_argument(o.flag, *o.aliases, action="store_true", help=o.help)
        else:
            extra = {key: getattr(o, key) for key in ("choices", "metavar", "nargs", "action")
                     if getattr(o, key) is not None}
            if o.type is not str:
                extra["type"] = o.type
            g.add_argument(o.flag, *o.aliases, default=_flag_default(o), help=o.help, **extra)


def _add_groups(p: argparse.ArgumentParser, groups) -> None:
    for title, options in groups:
        _add_options(p.add_argument_group(title), options)


def add_secret_args(g, flag: str, help: str | None, file_help: str) -> None:
    """A secret flag and its `FLAG-file` twin, the pair `read_secrets` reads (with the
    environment variable of SECRET_ENV as the third source)."""
    g.add_argument(flag, default=None, help=help)
    g.add_argument(flag + "-file", default=None, metavar="PATH", help=file_help)


def _field_values(options, a: argparse.Namespace) -> dict[str, Any]:
    """The value each of `options` gives its field(s) in `a`, by config path."""
    values = {}
    for o in options:
        given = getattr(a, o.dest)
        values[o.path] = o.to_config(given)
        if o.also is not None:
            path, to_config = o.also
            values[path] = to_config(given)
    return values


def _kwargs(cls: type, values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """`cls`'s keyword arguments from the `values` whose paths start with `prefix`; a nested
    config is built whole from its own paths (its other fields keep their defaults)."""
    kwargs, nested = {}, set()
    for path, value in values.items():
        if path.startswith(prefix):
            name, _, rest = path[len(prefix):].partition(".")
            if rest:
                nested.add(name)
            else:
                kwargs[name] = value
    factories = {f.name: f.default_factory for f in fields(cls)}
    for name in nested:
        kwargs[name] = factories[name](**_kwargs(factories[name], values, f"{prefix}{name}."))
    return kwargs
