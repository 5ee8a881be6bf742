"""`disagg config show COMMAND... [FLAGS]`: the effective options of a command as the YAML
file `--config` reads back (`config_file.py`). Nothing runs: the command line is only parsed,
its `--config` file merged under its flags (S2, X1, X7c)."""

from __future__ import annotations

import sys

import typer

config_app = typer.Typer(help="Config files: what a command would run with.",
                         no_args_is_help=True)


@config_app.command("show", context_settings={"allow_extra_args": True,
                                              "ignore_unknown_options": True})
def config_show(ctx: typer.Context) -> None:
    """Print COMMAND's effective configuration (its --config file under its flags, then the
    defaults) as YAML, e.g. `disagg config show serve cluster --config c.yaml --decoders 2`."""
    from disagg.apps.config_file import show_config

    root = ctx.find_root().command
    assert isinstance(root, typer.core.TyperGroup)
    sys.stdout.write(show_config(root, list(ctx.args)))


def register(app: typer.Typer) -> None:
    """Add `disagg config` to the app."""
    app.add_typer(config_app, name="config")
