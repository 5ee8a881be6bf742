"""How a benchmark hands over its result: the JSON to `--out`, then the JSON (`--json`) or the
script's own table on stdout. One place, so that every benchmark's `--out` and `--json` mean
the same."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def emit(args: argparse.Namespace, result: dict[str, Any],
         table: Callable[[dict[str, Any]], None]) -> None:
    """Write the JSON result to `--out`, then print it (`--json`) or its table."""
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
    else:
        table(result)
