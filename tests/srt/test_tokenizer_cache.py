"""srt/tokenizer_cache.py: a pickled tokenizer is SGLang's own, and a changed file loads afresh."""

from __future__ import annotations

import importlib
import os
import shutil

import pytest

from spexis_sglang.default_model import ensure_default_model
from spexis_sglang.srt import tokenizer_cache

TEXTS = [
    "Hello world!",
    "  leading spaces\n\nand newlines\t tabs",
    "<|im_start|>user\nHi<|im_end|>",
    "émoji 🤖 unicode 中文",
    "</think> done.",
]


@pytest.fixture
def tokenizer_dir(tmp_path):
    """The default model's tokenizer files alone (no weights)."""
    src = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    return str(tmp_path)


def _sglang_get_tokenizer():
    from sglang.srt.utils.hf_transformers import tokenizer

    f = tokenizer.get_tokenizer
    return getattr(f, "spexis_uncached", f)


def _counted_cache(tmp_path_factory):
    """(a cached loader over SGLang's, the names it loaded through SGLang, the cache dir)."""
    cache = str(tmp_path_factory.mktemp("cache"))
    original = _sglang_get_tokenizer()
    loads = []

    def counted(name, *args, **kwargs):
        loads.append(name)
        return original(name, *args, **kwargs)

    return tokenizer_cache.cached(counted, cache), loads, cache


def test_a_pickled_tokenizer_is_the_one_sglang_loads(tokenizer_dir, tmp_path_factory):
    get, loads, cache = _counted_cache(tmp_path_factory)
    first, second = get(tokenizer_dir), get(tokenizer_dir)
    assert loads == [tokenizer_dir] and len(os.listdir(cache)) == 1
    assert first is not second and type(first) is type(second)
    assert second.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    assert second.chat_template == first.chat_template
    assert second.all_special_ids == first.all_special_ids
    assert (second.eos_token_id, second.bos_token_id) == (first.eos_token_id, first.bos_token_id)
    for text in TEXTS:
        ids = first.encode(text)
        assert second.encode(text) == ids
        assert second.decode(ids) == first.decode(ids)
    # other arguments, another pickle
    get(tokenizer_dir, trust_remote_code=True)
    assert len(loads) == 2 and len(os.listdir(cache)) == 2


def test_an_edited_file_or_a_torn_pickle_loads_afresh(tokenizer_dir, tmp_path_factory):
    get, loads, cache = _counted_cache(tmp_path_factory)
    original = _sglang_get_tokenizer()
    get(tokenizer_dir)
    key = tokenizer_cache.cache_key(tokenizer_dir, (), {})
    template = os.path.join(tokenizer_dir, "chat_template.jinja")
    with open(template, "a") as f:
        f.write("{# edited #}")
    assert tokenizer_cache.cache_key(tokenizer_dir, (), {}) != key
    assert "edited" in get(tokenizer_dir).chat_template and len(loads) == 2
    # a weight file is not part of the key
    key = tokenizer_cache.cache_key(tokenizer_dir, (), {})
    open(os.path.join(tokenizer_dir, "model.safetensors"), "wb").close()
    assert tokenizer_cache.cache_key(tokenizer_dir, (), {}) == key
    # a torn pickle: loaded through SGLang and written again
    with open(os.path.join(cache, key + ".pkl"), "wb") as f:
        f.write(b"\x80\x04torn")
    assert get(tokenizer_dir).encode("Hello") == original(tokenizer_dir).encode("Hello")
    assert len(loads) == 3
    get(tokenizer_dir)
    assert len(loads) == 3
    # not a local directory: straight to SGLang, nothing cached
    assert tokenizer_cache.cache_key(os.path.join(tokenizer_dir, "missing"), (), {}) is None


def test_install_rebinds_every_process_s_loader_once(monkeypatch, tmp_path):
    from spexis_sglang.srt.config import ENV_TOKENIZER_CACHE

    original = _sglang_get_tokenizer()
    for name in tokenizer_cache.TOKENIZER_USERS:  # restored after the test
        module = importlib.import_module(name)
        if hasattr(module, "get_tokenizer"):
            monkeypatch.setattr(module, "get_tokenizer", original)
    monkeypatch.delenv(ENV_TOKENIZER_CACHE, raising=False)
    assert not tokenizer_cache.install_tokenizer_cache()
    monkeypatch.setenv(ENV_TOKENIZER_CACHE, str(tmp_path))
    assert tokenizer_cache.install_tokenizer_cache()
    bound = {
        name: importlib.import_module(name).get_tokenizer
        for name in tokenizer_cache.TOKENIZER_USERS
        if hasattr(importlib.import_module(name), "get_tokenizer")
    }
    # the schedulers', workers', tokenizer manager's and detokenizer's loads all go through it
    for name in (
        "sglang.srt.managers.scheduler",
        "sglang.srt.managers.tp_worker",
        "sglang.srt.managers.tokenizer_manager",
        "sglang.srt.managers.detokenizer_manager",
    ):
        assert bound[name].spexis_uncached is original, name
    assert len({id(f) for f in bound.values()}) == 1
    assert tokenizer_cache.install_tokenizer_cache()  # again: nothing changes
    assert (
        importlib.import_module("sglang.srt.managers.scheduler").get_tokenizer
        is bound["sglang.srt.managers.scheduler"]
    )
