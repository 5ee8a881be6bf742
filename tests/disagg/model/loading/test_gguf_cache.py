"""The on-disk cache of a loaded GGUF (`disagg.model.loading.gguf_cache`): a second load reads
the entry instead of the file, and gives exactly the first load's result; a changed file makes
a new entry; an unreadable entry is rebuilt; an unwritable cache still loads."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import ModelLoadError
from disagg.model.loading import gguf as gguf_loader
from disagg.model.loading import gguf_cache
from disagg.model.loading.gguf_cache import CACHE_ENV, load_gguf_cached
from tests.disagg.model.loading.test_gguf import (  # noqa: F401 (the fixture)
    _add,
    _write_gguf,
    tiny_hf_weights,
)

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
TEXT = "<|im_start|> the cat sat"


@pytest.fixture
def gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              tiny_hf_weights: Callable[..., dict], tiny_gguf_vocab: dict[str, Any]) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return _write_gguf(tmp_path / "t.gguf", tiny_hf_weights(), tiny_gguf_vocab,
                       extra=_add("tokenizer.chat_template", TEMPLATE))


@pytest.fixture
def file_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every load that went to the GGUF file itself."""
    reads: list[str] = []
    real = gguf_loader.load_gguf_with_chat_template

    def counted(path: Any, name: str = "custom") -> Any:  # noqa: ANN401
        reads.append(str(path))
        return real(path, name)

    monkeypatch.setattr(gguf_loader, "load_gguf_with_chat_template", counted)
    return reads


def _same(first: gguf_cache.Loaded, second: gguf_cache.Loaded) -> None:
    (config, weights, tokenizer, template), (config2, weights2, tokenizer2, template2) = (
        first, second)
    assert config2 == config and template2 == template == TEMPLATE
    assert weights2.keys() == weights.keys()
    assert all(weights2[name].equal(weights[name]) for name in weights)
    assert tokenizer2.encode(TEXT) == tokenizer.encode(TEXT)
    assert (tokenizer2.bos_token_id, tokenizer2.eos_token_ids) == (
        tokenizer.bos_token_id, tokenizer.eos_token_ids)


def test_a_second_load_reads_the_entry_and_equals_the_file(gguf_file: Path,
                                                           file_reads: list[str]) -> None:
    first = load_gguf_cached(gguf_file, name="t")
    second = load_gguf_cached(gguf_file, name="t")
    assert file_reads == [str(gguf_file)]
    _same(first, gguf_loader.load_gguf_with_chat_template(gguf_file, "t"))
    _same(second, first)


def test_a_changed_file_or_name_is_a_new_entry(gguf_file: Path, file_reads: list[str]) -> None:
    load_gguf_cached(gguf_file, name="t")
    load_gguf_cached(gguf_file, name="other")
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    load_gguf_cached(gguf_file, name="t")
    assert len(file_reads) == 3


def test_an_unreadable_entry_is_rebuilt(gguf_file: Path, file_reads: list[str],
                                        caplog: pytest.LogCaptureFixture) -> None:
    first = load_gguf_cached(gguf_file, name="t")
    [weights] = (Path(os.environ[CACHE_ENV]) / "gguf").glob("*/weights.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        _same(load_gguf_cached(gguf_file, name="t"), first)
    assert "unreadable" in caplog.text and len(file_reads) == 2
    _same(load_gguf_cached(gguf_file, name="t"), first)  # the rebuilt entry
    assert len(file_reads) == 2


def test_an_unwritable_cache_still_loads(gguf_file: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    with caplog.at_level(logging.WARNING):
        config, _, _, _ = load_gguf_cached(gguf_file, name="t")
    assert config.name == "t" and "cannot write the model cache" in caplog.text


def test_a_dead_loads_staging_is_swept_and_a_live_ones_kept(gguf_file: Path) -> None:
    root = Path(os.environ[CACHE_ENV]) / "gguf"
    root.mkdir(parents=True)
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead = root / f".0123abcd.{ended.pid}.feed"
    live = root / f".0123abcd.{os.getpid()}.beef"
    for staging in (dead, live):
        staging.mkdir()
        (staging / "weights.safetensors").write_bytes(b"half")
    load_gguf_cached(gguf_file, name="t")
    assert not dead.exists() and live.exists()


def test_a_concurrent_loads_complete_entry_is_kept(gguf_file: Path,
                                                   file_reads: list[str]) -> None:
    """Two loads that both missed: the second's write leaves the first's entry in place."""
    load_gguf_cached(gguf_file, name="t")
    [meta] = (Path(os.environ[CACHE_ENV]) / "gguf").glob("*/meta.json")
    first = meta.stat().st_ino
    loaded = gguf_loader.load_gguf_with_chat_template(gguf_file, "t")
    gguf_cache._write(meta.parent, loaded, str(gguf_file), replace=False)  # noqa: SLF001
    assert meta.stat().st_ino == first
    assert [p.name for p in meta.parent.parent.iterdir()] == [meta.parent.name]  # no staging


def test_a_missing_file_is_the_loaders_error(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_gguf_cached(tmp_path / "absent.gguf")
