"""`disagg models`: what each attention costs on the wire, per architecture and dtype (S6, S9).

One row per model: the runnable presets and the deployments' published shapes
(`disagg.model_catalog`). The bytes a token adds to one layer's cache are what a prefiller
ships per token and layer: grouped-query attention stores K and V of each KV head, MLA one
latent row that no head count multiplies (S9a). The simulator uses the same numbers
(`disagg.sim.models.from_model_config`). `disagg.apps.cli` adds it with `register(app)`.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from disagg.model_catalog import PUBLISHED
from disagg.model_config import PRESETS, ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def attention_of(config: ModelConfig) -> str:
    """The attention in words: ``GQA 8 KV x 128`` or ``MLA 512 + 64``."""
    if config.mla is not None:
        return f"MLA {config.mla.kv_lora_rank} + {config.mla.qk_rope_head_dim}"
    kind = "MHA" if config.num_kv_heads == config.num_heads else "GQA"
    return f"{kind} {config.num_kv_heads} KV x {config.head_dim}"


def model_row(name: str, config: ModelConfig, source: str) -> dict:
    """One model's attention, feed-forward and KV bytes per token, per layer and in all."""
    values = config.kv_values_per_token_layer
    moe = config.moe
    return {"model": name, "source": source, "architecture": config.architecture,
            "attention": attention_of(config), "layers": config.num_layers,
            "experts": f"{moe.num_experts} top-{moe.num_experts_per_tok}" if moe else "dense",
            "kv_values_per_token_layer": values,
            "kv_bytes_per_token_layer": {d: values * b for d, b in DTYPE_BYTES.items()},
            "kv_bytes_per_token": {d: values * b * config.num_layers
                                   for d, b in DTYPE_BYTES.items()}}


def models_report() -> list[dict]:
    """Every preset, then every published shape."""
    return ([model_row(name, config, "random preset") for name, config in PRESETS.items()]
            + [model_row(name, config, "published shape")
               for name, config in PUBLISHED.items()])


def register(app: typer.Typer) -> None:
    """Add `disagg models` to `app`."""

    @app.command("models")
    def models(as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False
               ) -> None:
        """KV bytes per token and layer for each architecture and dtype (what moves, S9)."""
        rows = models_report()
        if as_json:
            sys.stdout.write(json.dumps(rows) + "\n")
            return
        table = Table(title="KV cache per token: what a prefiller ships (bytes)")
        for column in ("model", "architecture", "attention", "experts", "layers",
                       "fp32/layer", "bf16/layer", "bf16 all"):
            table.add_column(column, justify="left" if column in (
                "model", "architecture", "attention", "experts") else "right")
        for row in rows:
            per_layer = row["kv_bytes_per_token_layer"]
            table.add_row(row["model"], row["architecture"], row["attention"], row["experts"],
                          str(row["layers"]), f"{per_layer['float32']:,}",
                          f"{per_layer['bfloat16']:,}",
                          f"{row['kv_bytes_per_token']['bfloat16']:,}")
        Console().print(table)
