"""`disagg demo --deployment NAME`: the two deployments of S9 as presets of the local cluster.

A preset gives the defaults of the options it names (in the words of
`ClusterConfig.from_options`, from which the demo then builds its cluster); an option the user
also gave must agree with it. Overriding either way silently would run something other than
what was asked for (and the demo would describe one cluster while starting another), so a
conflict is a `ConfigError` naming the flag, the value given and the preset's value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg.errors import ConfigError

if TYPE_CHECKING:
    import typer

# The two deployments of S9, each with its model's architecture at toy size (random weights).
DEPLOYMENTS: dict[str, dict[str, object]] = {
    # S9b, Qwen3-Coder: a Qwen3-MoE (GQA, 4 KV heads), TP 4 on both sides, HND, rank i ->
    # rank i, 3 decoders per prefiller.
    "qwen3-coder": {"model": "tiny-qwen3-moe", "prefill_tp": 4, "decode_tp": 4,
                    "kv_layout": "HND", "num_decoders": 3, "replicated_kv": False},
    # S9a, DeepSeek-R1 with DP decoders: an MLA + MoE model, whose latent cache is the same on
    # every rank by construction, so any prefiller rank may send (chosen at random per
    # request); each decoder rank is its own engine.
    "deepseek-r1": {"model": "tiny-mla-moe", "prefill_tp": 4, "decode_tp": 1,
                    "kv_layout": "HND", "num_decoders": 3},
}

# The `disagg demo` flag behind each field a preset sets: errors name what the user typed.
FLAGS: dict[str, str] = {"model": "--model", "prefill_tp": "--prefill-tp",
                         "decode_tp": "--decode-tp", "kv_layout": "--kv-layout",
                         "num_decoders": "--decoders", "replicated_kv": "--replicated-kv"}

# demo's parameters (python names) -> the option each sets. --decode-dp comes after --decoders
# because it overrides it, as in the demo.
DEMO_PARAMS: dict[str, str] = {"model": "model", "prefill_tp": "prefill_tp",
                               "decode_tp": "decode_tp", "kv_layout": "kv_layout",
                               "decoders": "num_decoders", "decode_dp": "num_decoders",
                               "replicated_kv": "replicated_kv"}

# Parameter sources of a value the user left alone, so a preset may replace it. By name:
# recent typer versions carry their own copy of click, whose ParameterSource enum is not
# click's, so comparing members would silently treat every default as given.
_DEFAULT_SOURCES = frozenset({"DEFAULT"})  # a --config file's values count as given


def _flag(field: str, value: object) -> str:
    """How a user writes `field = value` on the command line: `--decode-tp 4`, `--replicated-kv`."""
    flag = FLAGS.get(field, field)
    if isinstance(value, bool):
        return flag if value else f"--no-{flag.removeprefix('--')}"
    return f"{flag} {value}"


def apply_deployment(options: dict[str, Any], name: str, explicit: dict[str, object]
                     ) -> dict[str, Any]:
    """`options` with the preset `name` applied; `explicit` maps the options the user set to
    the values given. A given value equal to the preset's is fine; a different one raises
    `ConfigError`, as does an unknown preset name."""
    preset = DEPLOYMENTS.get(name)
    if preset is None:
        raise ConfigError(f"unknown deployment {name!r}: expected one of {sorted(DEPLOYMENTS)}")
    for field, value in explicit.items():
        if field in preset and value != preset[field]:
            raise ConfigError(f"{_flag(field, value)} conflicts with --deployment {name}, which "
                              f"sets {_flag(field, preset[field])}: drop one of them")
    return {**options, **preset}


def explicit_fields(ctx: typer.Context) -> dict[str, object]:
    """The cluster options the user gave `disagg demo` (on the command line or in the
    environment, not left at their defaults), with the values given."""
    explicit: dict[str, object] = {}
    for param, field in DEMO_PARAMS.items():
        source = ctx.get_parameter_source(param)
        if source is None or source.name in _DEFAULT_SOURCES:
            continue
        value = ctx.params[param]
        if param == "decode_dp" and not value:
            continue  # --decode-dp 0 means "use --decoders", as in the demo
        explicit[field] = value
    return explicit
