"""`--config FILE`: a command's flags read from a YAML or TOML file, and `disagg config show`
(X7c).

A config file is one mapping whose keys are the command's flag names (`page-size` or
`page_size`; `prefix-caching: false` for `--no-prefix-caching`) and whose values have the
flag's type (a list for a repeatable flag). It becomes click's `default_map` before any other
flag is read, so a flag given on the command line overrides the file, and the file overrides
the built-in default. An unknown key or a value of the wrong type is a `ConfigError` naming
the file and the key. Not a second config format: it holds exactly what the flags hold, for
the commands that build node and cluster configs (S2, X1).
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, get_args

import typer
import typer.core
import yaml

from disagg.errors import ConfigError

CONFIG = "config"  # the parameter `--config` fills; never a key of the file itself
SECRETS = ("api_key",)  # never printed by `config show`

_EXPECTED = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}
Option = typer.core.TyperOption


def flag_key(param: Option) -> str:
    """The key of an option in a config file: its first long flag without the dashes
    (`prefillers` for `--prefillers`, which fills `num_prefillers`)."""
    long = next(opt for opt in param.opts if opt.startswith("--"))
    return long.removeprefix("--")


def _options(command: typer.core.TyperCommand) -> dict[str, Option]:
    """The command's options a file may set, keyed by `flag_key` in its `_` spelling."""
    return {flag_key(p).replace("-", "_"): p for p in command.params
            if isinstance(p, Option) and p.name != CONFIG and not p.is_eager}


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping in a `.yaml`/`.yml` (pyyaml) or `.toml` (tomllib) file."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"--config {path}: expected a .yaml, .yml or .toml file")
    try:
        text = file.read_text()
    except OSError as error:
        raise ConfigError(f"--config {path}: {error.strerror or error}") from None
    try:
        data = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        reason = " ".join(str(error).split())  # pyyaml's message spans lines: keep one
        raise ConfigError(f"--config {path}: not valid {suffix[1:].upper()}: {reason}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, "
                          f"got {type(data).__name__}")
    return data


def _check_type(param: Option, value: object) -> str | None:
    """What the flag expects, if `value` is not that (a YAML `8` for an int flag is, "8" not)."""
    if value is None:
        return None if param.default is None and not param.required else "a value, not null"
    kind = param.type_descriptor.annotation
    if param.multiple:
        [kind] = get_args(kind) or (str,)
        if not isinstance(value, list):
            return f"a list, each {_EXPECTED.get(kind, 'a value')}"
        return next((f"a list, each {_EXPECTED[kind]}" for item in value
                     if not _is(kind, item)), None)
    return None if _is(kind, value) else _EXPECTED[kind]


def _is(kind: object, value: object) -> bool:
    """Whether `value`, as YAML or TOML read it, is of the flag type `kind`."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind) if kind in (int, str) else True


def config_defaults(ctx: typer.Context, path: str, data: dict[str, Any]) -> dict[str, Any]:
    """The file's values as click's `default_map` of `ctx.command` (parameter name -> value),
    each key known and each value of its flag's type, else a one-line `ConfigError`."""
    options = _options(ctx.command)
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        param = options.get(str(key).replace("-", "_"))
        if param is None:
            close = difflib.get_close_matches(str(key).replace("-", "_"), options, n=1)
            hint = f"; did you mean {close[0].replace('_', '-')!r}?" if close else ""
            raise ConfigError(f"--config {path}: unknown key {key!r} for "
                              f"`{ctx.command_path}`{hint} (see --help for its flags)")
        expected = _check_type(param, value)
        if expected is not None:
            raise ConfigError(f"--config {path}: {key}: expected {expected}, got {value!r}")
        assert param.name is not None
        defaults[param.name] = value
    return defaults


def apply_config_file(ctx: typer.Context, value: str | None) -> str | None:
    """The `--config` callback (eager: before any other flag is read): the file's values
    become the defaults the command line overrides."""
    if value:
        defaults = config_defaults(ctx, value, read_config_file(value))
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def effective_config(ctx: typer.Context) -> dict[str, Any]:
    """A parsed command's every option by its config key, as a file `--config` reads back:
    lists for repeatable flags; hidden flags only where set, secrets never."""
    config = {}
    for param in ctx.command.params:
        if not isinstance(param, Option) or param.name in (CONFIG, *SECRETS) or param.is_eager:
            continue
        value = ctx.params.get(param.name)
        if param.hidden and value == param.default:
            continue
        config[flag_key(param)] = list(value) if isinstance(value, tuple) else value
    return config


def show_config(root: typer.core.TyperGroup, argv: list[str]) -> str:
    """`disagg config show COMMAND... [FLAGS]`: the YAML of COMMAND's effective options, as
    `--config` and FLAGS leave them (nothing runs)."""
    command: typer.core.TyperCommand | typer.core.TyperGroup = root
    words = []
    parent = typer.Context(root, info_name="disagg")
    while isinstance(command, typer.core.TyperGroup) and argv and argv[0] in command.commands:
        words.append(argv.pop(0))
        command = command.commands[words[-1]]
    if isinstance(command, typer.core.TyperGroup):
        choices = ", ".join(sorted(command.commands))
        raise ConfigError(f"config show: name a command ({choices}), e.g. "
                          "`disagg config show serve cluster --config cluster.yaml`")
    ctx = command.make_context(" ".join(words), argv, parent=parent)
    header = f"# disagg {' '.join(words)}: pass this file back with --config\n"
    if any(p.name in SECRETS for p in command.params):
        header += "# api-key is never shown: give it by DISAGG_API_KEY\n"
    return header + yaml.safe_dump(effective_config(ctx), sort_keys=False)
