"""The bundled model's tokenizer names the end token generation stops on (``<|im_end|>``, id 2),
not the one transformers' GGUF conversion wrote (``<|im_start|>``, id 1): SGLang's
``min_new_tokens`` blocks the tokenizer's end token, so the wrong one let requests stop early."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from spexis_sglang.default_model import (
    SpecialTokenMismatch,
    ensure_default_model,
    fix_special_tokens,
    model_special_tokens,
)

# what transformers' GGUF conversion writes for SmolLM2-135M-Instruct
CONVERTED = {"eos_token": "<|im_start|>", "eos_token_id": 1, "pad_token_id": None}
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture
def converted(tmp_path) -> str:
    """The default model's configs and tokenizer (no weights) as the conversion left them."""
    src = ensure_default_model()
    model = tmp_path / "model"
    model.mkdir()
    for name in FILES:
        shutil.copy(os.path.join(src, name), model / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    config.update(CONVERTED)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return str(model)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_the_bundled_model_ends_on_im_end():
    tokens = model_special_tokens(ensure_default_model())
    assert (tokens["eos_token"], tokens["eos_token_id"]) == ("<|im_end|>", 2)
    tokenizer = _load_tokenizer(ensure_default_model())
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.pad_token_id == 2


def test_fix_names_generation_configs_end_token(converted):
    assert _load_tokenizer(converted).eos_token_id == 1  # the conversion's mistake
    assert fix_special_tokens(converted)
    assert not fix_special_tokens(converted)  # idempotent
    config = json.loads(open(os.path.join(converted, "tokenizer_config.json")).read())
    assert (config["eos_token"], config["eos_token_id"]) == ("<|im_end|>", 2)
    assert (config["pad_token"], config["pad_token_id"]) == ("<|im_end|>", 2)
    tokenizer = _load_tokenizer(converted)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (2, 2, 1)


def test_configs_that_disagree_on_the_end_token_are_refused(converted):
    path = os.path.join(converted, "generation_config.json")
    gen = json.loads(open(path).read())
    gen["eos_token_id"] = 1
    open(path, "w").write(json.dumps(gen))
    with pytest.raises(SpecialTokenMismatch, match=r"eos_token_id \[1\], config.json \[2\]"):
        fix_special_tokens(converted)


def test_an_end_token_outside_the_vocabulary_is_refused(converted):
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(converted, name)
        cfg = json.loads(open(path).read())
        cfg["eos_token_id"] = 10**6
        open(path, "w").write(json.dumps(cfg))
    with pytest.raises(SpecialTokenMismatch, match="1000000 is not in the vocabulary"):
        fix_special_tokens(converted)


def test_a_cache_converted_before_the_fix_is_repaired_and_its_weights_kept(converted):
    """What ``make model`` does to an existing cache: tokenizer files only, weights untouched."""
    src = ensure_default_model()
    marker = json.loads(open(os.path.join(src, ".spexis-converted")).read())
    marker.pop("special_tokens_from_generation_config")
    with open(os.path.join(converted, ".spexis-converted"), "w") as f:
        json.dump(marker, f)
    weights = os.path.join(converted, "model.safetensors")
    with open(weights, "wb") as f:
        f.write(b"weights stand-in")
    before = hashlib.sha256(open(weights, "rb").read()).hexdigest()
    assert ensure_default_model(converted) == converted
    assert _load_tokenizer(converted).eos_token_id == 2
    assert hashlib.sha256(open(weights, "rb").read()).hexdigest() == before
    marker = json.loads(open(os.path.join(converted, ".spexis-converted")).read())
    assert marker["special_tokens_from_generation_config"] is True
