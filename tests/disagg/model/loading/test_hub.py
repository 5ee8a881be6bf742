"""Hugging Face Hub ids as `--model` (`disagg.model.loading.hub`): the cache first, offline
mode, downloads of only the files we read. No test touches the network.

Each test builds a Hub cache under tmp_path laid out as huggingface_hub lays it out
(`models--owner--name/refs/main`, `snapshots/<commit>/` links into `blobs/`), points
`HF_HUB_CACHE` at it, and replaces `huggingface_hub.snapshot_download` by a wrapper that runs
the real one for cache look-ups (`local_files_only=True`) and, for a download, copies the
files matching `allow_patterns` from a local "remote" folder (or fails the test when the
network is off limits).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch

from disagg.errors import ModelLoadError
from disagg.model.loading.hub import hub_cache_dir, is_hub_id
from disagg.model.loading.registry import load_model, load_tokenizer, model_config
from disagg.model.loading.tokenizer import Tokenizer

MakeCheckpoint = Callable[..., Path]
REPO = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_snapshot(cache: Path, repo_id: str, files: list[Path]) -> Path:
    """Put `files` into `cache` as huggingface_hub does: content-named blobs, a snapshot of
    relative links, `refs/main` naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for file in files:
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


class FakeHub:
    """`snapshot_download` over a local "remote": cache look-ups are the real function;
    downloads copy matching files into the cache, or fail when `online` is False."""

    def __init__(self, cache: Path, remote: dict[str, Path], online: bool) -> None:
        self.cache, self.remote, self.online = cache, remote, online
        self.downloads: list[tuple[str, list[str]]] = []
        self._real = huggingface_hub.snapshot_download

    def __call__(self, repo_id: str, **kwargs: Any) -> str:  # noqa: ANN401
        if kwargs.get("local_files_only"):
            return self._real(repo_id, **kwargs)
        assert self.online, f"the network was asked for {repo_id} (offline test)"
        assert Path(kwargs["cache_dir"]) == self.cache
        patterns = list(kwargs["allow_patterns"])
        self.downloads.append((repo_id, patterns))
        if repo_id not in self.remote:
            raise huggingface_hub.errors.LocalEntryNotFoundError(f"404: {repo_id}\nmore")
        files = [f for f in self.remote[repo_id].iterdir()
                 if any(fnmatch.fnmatch(f.name, p) for p in patterns)]
        return str(cache_snapshot(self.cache, repo_id, files))


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        make_hf_llama_checkpoint: MakeCheckpoint, tiny_tokenizer: Tokenizer) -> FakeHub:
    """An empty Hub cache, offline by default, and a remote holding `REPO` (a checkpoint with
    a tokenizer, plus files we must never fetch: a .bin copy and a README)."""
    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    remote = make_hf_llama_checkpoint()
    tiny_tokenizer.save(remote / "tokenizer.json")
    shutil.copy(remote / "model.safetensors", remote / "pytorch_model.bin")
    (remote / "README.md").write_text("a model card")
    fake = FakeHub(cache, {REPO: remote}, online=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return fake


def go_online(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.online = True


def cached_names(hub: FakeHub) -> set[str]:
    return {p.name for p in hub.cache.glob("models--*/snapshots/*/*")}


def test_a_cached_hub_id_loads_offline(hub: FakeHub) -> None:
    """HF_HUB_OFFLINE=1 and the model in the cache: it loads from there, named by its id."""
    cache_snapshot(hub.cache, REPO, list(hub.remote[REPO].iterdir()))
    loaded = load_model(REPO)
    reference = load_model(str(hub.remote[REPO]))
    assert loaded.config.name == REPO
    assert loaded.tokenizer is not None
    assert all(torch.equal(loaded.state_dict[n], t) for n, t in reference.state_dict.items())
    assert hub.downloads == []


def test_a_cached_model_is_not_downloaded_again_online(hub: FakeHub,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, a model already cached starts without asking the Hub anything."""
    cache_snapshot(hub.cache, REPO, list(hub.remote[REPO].iterdir()))
    go_online(hub, monkeypatch)
    assert load_model(REPO).config.num_layers == 2
    assert load_tokenizer(REPO).tokenizer is not None
    assert hub.downloads == []


def test_a_missing_model_offline_is_one_line_naming_the_fix(hub: FakeHub) -> None:
    """Offline and not cached: one ModelLoadError line, saying where it looked and how to get
    the model; the network is never asked."""
    with pytest.raises(ModelLoadError) as info:
        load_model(REPO)
    message = str(info.value)
    assert "\n" not in message
    assert "not in the Hugging Face cache" in message
    assert str(hub.cache) in message
    assert f"hf download {REPO}" in message
    assert "HF_HUB_OFFLINE" in message


def test_a_partial_snapshot_is_not_taken_for_the_model(hub: FakeHub) -> None:
    """A snapshot holding config.json alone (what AutoConfig fetches) is not the checkpoint,
    yet it is enough for the front door."""
    cache_snapshot(hub.cache, REPO, [hub.remote[REPO] / "config.json"])
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        load_model(REPO)
    assert model_config(REPO).hidden_size == 64


def test_a_download_fetches_only_the_files_we_read(hub: FakeHub,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Online and not cached: one download, of config, tokenizer and safetensors files only."""
    go_online(hub, monkeypatch)
    loaded = load_model(REPO)
    assert loaded.config.name == REPO
    assert loaded.tokenizer is not None
    assert len(hub.downloads) == 1
    assert cached_names(hub) == {"config.json", "generation_config.json", "tokenizer.json",
                                 "model.safetensors"}


def test_the_front_door_fetches_no_weights(hub: FakeHub,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_tokenizer` of a Hub id downloads the config and tokenizer, no weight file."""
    go_online(hub, monkeypatch)
    loaded = load_tokenizer(REPO)
    assert loaded.config.vocab_size == 256
    assert loaded.tokenizer is not None
    [(_, patterns)] = hub.downloads
    assert not any(fnmatch.fnmatch("model.safetensors", p) for p in patterns)
    assert not any(name.endswith(".safetensors") for name in cached_names(hub))


def test_a_model_the_hub_lacks_is_one_line(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed download is a one-line ModelLoadError naming the id."""
    go_online(hub, monkeypatch)
    with pytest.raises(ModelLoadError, match="'acme/nothing': cannot download") as info:
        load_model("acme/nothing")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("spec", "expected"), [
    ("Qwen/Qwen3-0.6B", True), ("deepseek-ai/DeepSeek-R1", True), ("tiny", False),
    ("/abs/owner/name", False), ("a/b/c", False), ("./a/b", False), ("a/../b", False),
])
def test_what_is_a_hub_id(spec: str, expected: bool) -> None:
    """`owner/name` is a Hub id; a bare name, a deeper or absolute path is not."""
    assert is_hub_id(spec) is expected


def test_an_existing_directory_wins_over_a_hub_id(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`owner/name` that exists here is a path."""
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("owner/name")


def test_the_cache_directory_follows_the_environment(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_CACHE wins; else HF_HOME/hub; both read when asked, not at import."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"
