"""`--speculative` on the command line: same tokens, acceptance counts, one-line errors."""

from __future__ import annotations

import json

import pytest

from disagg.apps.cli import main

ARGS = ["generate", "--model", "tiny", "--prompt-token-ids", "5,6,7,8,9", "--max-tokens", "12",
        "--json"]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


@pytest.mark.parametrize("kind", ["early-exit", "mtp"])
def test_generate_speculative_gives_the_same_tokens(kind: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --speculative` prints the plain run's tokens, plus its draft counts."""
    _, plain, _ = run_cli(ARGS, capsys)
    code, out, _ = run_cli([*ARGS, "--speculative", kind, "--num-draft-tokens", "2"], capsys)
    result = json.loads(out)
    assert code == 0
    assert result["token_ids"] == json.loads(plain)["token_ids"]
    assert result["draft_tokens"] > 0
    assert 0 <= result["accepted_tokens"] <= result["draft_tokens"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--speculative", "medusa"], "unknown draft 'medusa'"),
    (["--speculative", "mtp", "--num-draft-tokens", "0"], "num_draft_tokens must be >= 1"),
    (["--speculative", "early-exit", "--draft-layers", "2"], "shallower than the 2-layer"),
])
def test_bad_speculative_options_are_one_line_errors(extra: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong draft kind, count or depth: exit code 2 and the reason on stderr."""
    code, _, err = run_cli([*ARGS, *extra], capsys)
    assert code == 2
    assert message in " ".join(err.split())
