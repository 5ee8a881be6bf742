"""The `disagg` command: --json output, streaming, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disagg.apps.cli import main
from disagg.engine.cuda_graphs import DecodeGraphs


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


COMMANDS = [["simulate"], ["plan-cluster"], ["calibrate"], ["figures"], ["generate"], ["demo"],
            ["plan"], ["topology"], ["bench"], ["bench", "transfer"], ["serve"],
            ["serve", "prefill"], ["serve", "decode"], ["serve", "mixed"], ["serve", "cluster"],
            ["serve", "router"]]


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`disagg --help` and `disagg serve --help` name each of their commands."""
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    assert all(name in out for [name, *rest] in COMMANDS if not rest)
    _, out, _ = run_cli(["serve", "--help"], capsys)
    assert all(rest[0] in out for [name, *rest] in COMMANDS if name == "serve" and rest)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_working_help(command: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each command's options parse and its help prints (an import or option error in any
    command shows here, not in a user's first run)."""
    code, out, err = run_cli([*command, "--help"], capsys)
    assert (code, err) == (0, "")
    assert "Usage:" in out


def test_generate_json_is_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    """With --json, stdout is exactly one JSON object with prompt and generated ids."""
    code, out, _ = run_cli(["generate", "--model", "tiny", "--prompt-token-ids", "1,2,3",
                            "--max-tokens", "5", "--json", "--kv-layout", "HND"], capsys)
    result = json.loads(out)
    assert code == 0
    assert out.count("\n") == 1
    assert result["prompt_token_ids"] == [1, 2, 3]
    assert len(result["token_ids"]) == 5


def test_generate_with_cuda_graph_gives_the_same_tokens(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--cuda-graph sends decode steps through the static buffers (eagerly on CPU): same ids."""
    argv = ["generate", "--model", "tiny", "--prompt-token-ids", "5,9,2,7,1", "--max-tokens",
            "12", "--json", "--page-size", "2"]
    _, plain, _ = run_cli(argv, capsys)
    static_steps = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run",
                        lambda self, *args: static_steps.append(1) or run(self, *args))
    code, graphed, _ = run_cli([*argv, "--cuda-graph"], capsys)
    assert code == 0
    assert json.loads(graphed)["token_ids"] == json.loads(plain)["token_ids"]
    assert len(static_steps) == 11  # every decode step after the prefill


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "no-such-model", "--prompt-token-ids", "1"], "unknown model 'no-such-model'"),
    (["--model", "tiny", "--prompt-token-ids", ""], "is not a token id"),
    (["--model", "tiny", "--prompt", "hi"], "has no tokenizer"),
    (["--model", "tiny", "--prompt-token-ids", "1,2,3", "--page-size", "2", "--num-pages", "2"],
     "the cache has 2"),
    (["--model", "tiny", "--prompt-token-ids", "1", "--page-size", "0"], "page_size must be"),
    (["--model", "tiny", "--prompt-token-ids", "1", "--page-size", "8192"], "does not fit"),
    (["--model", "tiny", "--prompt-token-ids", "1", "--kv-layout", "NDH"], "unknown kv_layout"),
    (["--model", "tiny", "--prompt-token-ids", "99999"], "outside the vocabulary"),
    (["--model", "tiny", "--prompt-token-ids", "1", "--device", "tpu"], "unknown device"),
])
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Each kind of bad input names the problem, exits 2 and prints no traceback."""
    code, _, err = run_cli(["generate", *argv], capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_malformed_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory that is not a checkpoint is refused with a message naming what is missing."""
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = run_cli(["generate", "--model", str(tmp_path), "--prompt-token-ids", "1"],
                           capsys)
    assert code == 2
    assert "config.json" in err
    assert "Traceback" not in err


def test_plan_json_counts_nhd_and_hnd(capsys: pytest.CaptureFixture[str]) -> None:
    """`disagg plan --json` reports the write counts of both layouts for the pair."""
    code, out, _ = run_cli(["plan", "--prefill-tp", "1", "--decode-tp", "4", "--model", "tiny",
                            "--page-size", "4", "--json"], capsys)
    report = json.loads(out)
    assert code == 0
    assert report["layouts"]["HND"]["writes_per_page"] == 8  # 4 ranks x (K, V)
    assert report["layouts"]["NHD"]["writes_per_page"] == 32  # 4 ranks x 2 x 4 tokens
    assert [p["dst_rank"] for p in report["pairs"]] == [0, 1, 2, 3]


def test_plan_of_an_mla_model_writes_one_latent_row_per_token(
        capsys: pytest.CaptureFixture[str]) -> None:
    """MLA's page is one part (the latent row), not K and V: `disagg plan` of `tiny-mla-moe`
    sends each page whole, 4 tokens x 40 values x 4 bytes, to each decoder rank."""
    code, out, _ = run_cli(["plan", "--prefill-tp", "2", "--decode-tp", "2", "--model",
                            "tiny-mla-moe", "--page-size", "4", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["prefill"]["replicated"]
    assert {p["bytes"] for p in report["pairs"]} == {4 * 40 * 4}
    assert report["layouts"]["HND"]["writes_per_page"] == 2  # one whole page per decoder rank


def test_unknown_deployment_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A deployment preset that does not exist is named in the error."""
    code, _, err = run_cli(["demo", "--model", "tiny", "--deployment", "gpt-5"], capsys)
    assert code == 2
    assert "unknown deployment 'gpt-5'" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "prefill", "--model", "tiny", "--kv-memory-path", "rdma"],
     "unknown KV memory path 'rdma'"),
    (["serve", "decode", "--model", "tiny", "--prefiller", "127.0.0.1:1", "--device", "tpu"],
     "unknown device 'tpu'"),
    (["serve", "mixed", "--model", "tiny", "--kv-memory-path", "hmem"],
     "'hmem' is impossible on cpu"),
    (["demo", "--model", "tiny", "--kv-memory-path", "hmem"], "'hmem' is impossible on cpu"),
])
def test_bad_memory_options_exit_2_with_one_line(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--device and --kv-memory-path are checked before any node starts."""
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """--device cuda on a machine without CUDA is refused before any node starts."""
    code, _, err = run_cli(["demo", "--model", "tiny", "--device", "cuda"], capsys)
    assert code == 2
    assert "torch sees no CUDA device" in err


def _prompts_file(tmp_path: Path, line: str) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    return str(path)


@pytest.mark.parametrize(("extra", "line", "message"), [
    (["--max-tokens", "0"], None, "--max-tokens must be at least 1, got 0"),
    (["--trace", "/no/such/dir/t.json"], None, "directory /no/such/dir does not exist"),
    (["--num-pages", "1", "--page-size", "4"], None, "do not fit a decoder's 4"),
    ([], '{"prompt_token_ids": [true, 2]}', "prompt_token_ids must be a list of integers"),
    ([], '{"prompt_token_ids": [1, 2], "max_tokens": "x"}', "max_tokens must be a whole number"),
    ([], '{"prompt_token_ids": [1, 2], "max_tokens": 0}', "max_tokens must be a whole number"),
    (["--routing", "round-robin"], None, "unknown routing policy 'round-robin'"),
])
def test_demo_input_that_cannot_work_exits_2_before_any_process(
        extra: list[str], line: str | None, message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of these used to start the cluster and end in a traceback after the work, in
    every request failing with exit 0, or in a dropped router connection."""
    import disagg.node.local_cluster as local_cluster

    def no_cluster(*_: object) -> None:
        raise AssertionError("a process was started for input that cannot work")

    monkeypatch.setattr(local_cluster.LocalCluster, "__enter__", no_cluster)
    prompts = ["--prompts-file", _prompts_file(tmp_path, line)] if line else []
    code, _, err = run_cli(["demo", "--model", "tiny", "--decoders", "1", *prompts, *extra],
                           capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_a_demo_whose_requests_failed_exits_1(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's JSON still comes out, and the exit code says that requests failed."""
    import disagg.apps.demo as demo

    result = {"requests": [], "totals": {"requests": 3, "failed": 2}}
    monkeypatch.setattr(demo, "run_demo", lambda *args, **kwargs: result)
    code, out, err = run_cli(["demo", "--model", "tiny", "--decoders", "1", "--json"], capsys)
    assert (code, json.loads(out)) == (1, result)
    assert "2 of 3 requests failed" in err


@pytest.mark.slow
@pytest.mark.fabric
def test_a_busy_metrics_port_is_one_line_and_exit_2() -> None:
    """It used to end in a traceback from http.server (with the node left open)."""
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "disagg.apps.cli", "serve", "mixed",
                               "--model", "tiny", "--metrics-port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"--metrics-port 127.0.0.1:{port}: cannot listen there" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # rank processes: about 3 s
def test_generate_at_tp_2_matches_tp_1(capsys: pytest.CaptureFixture[str]) -> None:
    """`disagg generate --tp 2` runs a rank process and decodes TP 1's tokens."""
    outputs = []
    for tp in ("1", "2"):
        code, out, _ = run_cli(["generate", "--model", "tiny", "--prompt-token-ids", "5,6,7,8,9",
                                "--max-tokens", "8", "--tp", tp, "--json"], capsys)
        assert code == 0
        outputs.append(json.loads(out)["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


@pytest.mark.parametrize(("extra", "message"), [
    (["--tp", "3"], "tp=3 and num_kv_heads=4: one must divide the other"),
    (["--tp", "2", "--speculative", "mtp"], "--speculative runs on one process: not with TP 2"),
    (["--tp", "2", "--cuda-graph"], "--cuda-graph runs decode graphs on one process")])
def test_generate_refuses_tp_it_cannot_run(extra: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """One line and exit 2, before any rank process starts."""
    code, _, err = run_cli(["generate", "--model", "tiny", "--prompt-token-ids", "5,6",
                            *extra], capsys)
    assert code == 2 and message in err
