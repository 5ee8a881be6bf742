"""The model fingerprint peers compare at handshake (`disagg.model.loading.fingerprint`): the
same checkpoint gives the same one wherever it lies and however it is named; a changed weight,
config field or dtype changes it; it is computed from the files, remembered, and a Hub cache's
content-named blobs are not read at all.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.config import ModelConfig
from disagg.model.loading import fingerprint
from disagg.model.loading.fingerprint import model_fingerprint
from disagg.model.loading.gguf_cache import CACHE_ENV
from disagg.model.loading.registry import model_config
from tests.disagg.model.loading.test_hub import cache_snapshot

MakeCheckpoint = Callable[..., Path]


@pytest.fixture(autouse=True)
def model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model cache of this test's own, where file digests are remembered."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def checkpoint(make_hf_llama_checkpoint: MakeCheckpoint) -> Path:
    return make_hf_llama_checkpoint(max_shard_size="60KB")  # several files


def of(spec: str | Path, dtype: torch.dtype = torch.float32) -> str:
    return model_fingerprint(str(spec), model_config(str(spec)), dtype)


def no_file_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("a weight file was read")

    monkeypatch.setattr(hashlib, "file_digest", refuse)


def test_a_copy_elsewhere_agrees(checkpoint: Path, tmp_path: Path) -> None:
    """The same files in another directory (another name): the same fingerprint."""
    copy = shutil.copytree(checkpoint, tmp_path / "elsewhere")
    assert of(copy) == of(checkpoint)


def test_a_changed_weight_changes_it(checkpoint: Path, tmp_path: Path) -> None:
    """One element of one tensor changed: another fingerprint (same names, shapes, sizes)."""
    copy = shutil.copytree(checkpoint, tmp_path / "changed")
    [shard] = [f for f in sorted(copy.glob("*.safetensors"))
               if "model.norm.weight" in load_file(f)]
    weights = load_file(shard)
    weights["model.norm.weight"][0] += 1.0
    save_file(weights, str(shard), metadata={"format": "pt"})
    assert of(copy) != of(checkpoint)


def test_a_changed_config_changes_it(checkpoint: Path, tmp_path: Path) -> None:
    """rms_norm_eps changed in config.json, weights untouched: another fingerprint."""
    copy = shutil.copytree(checkpoint, tmp_path / "eps")
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(raw | {"rms_norm_eps": 1e-6}))
    assert of(copy) != of(checkpoint)


def test_the_dtype_is_part_of_it(checkpoint: Path) -> None:
    """The same weights run in bfloat16 and float32 do not agree (their KV differs)."""
    fingerprints = {of(checkpoint, dtype)
                    for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    assert len(fingerprints) == 3
    assert of(checkpoint, torch.bfloat16).startswith("llama-bfloat16-")


def test_a_digest_is_remembered(checkpoint: Path) -> None:
    """A second fingerprint of the same files reads none of them (a node restart)."""
    first = of(checkpoint)
    with pytest.MonkeyPatch.context() as patch:
        no_file_reads(patch)
        assert of(checkpoint) == first


def test_a_hub_id_agrees_with_its_files_unread(checkpoint: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint as a Hub id in the Hugging Face cache gives the fingerprint of its
    directory, and its blobs are named by their SHA-256, so none is read."""
    expected = of(checkpoint)
    cache = tmp_path / "hub-cache"
    cache_snapshot(cache, "acme/tiny", sorted(checkpoint.iterdir()))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "empty-cache"))  # nothing remembered
    no_file_reads(monkeypatch)
    assert of("acme/tiny") == expected


def test_presets_are_their_config_and_seed() -> None:
    """A preset agrees with itself; another preset does not."""
    assert of("tiny") == of("tiny")
    assert of("tiny") != of("small")


def test_smollm2_is_its_gguf_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's fingerprint changes with the GGUF file's content."""
    gguf_file = tmp_path / "smollm2.gguf"
    monkeypatch.setattr(fingerprint, "find_smollm2_gguf", lambda: gguf_file)
    config = ModelConfig.from_name("tiny")
    gguf_file.write_bytes(b"GGUF one")
    first = model_fingerprint("smollm2-135m", config, torch.float32)
    gguf_file.write_bytes(b"GGUF two")  # another size too: remembered digests do not apply
    assert model_fingerprint("smollm2-135m", config, torch.float32) != first
