"""Constrained decoding on CPU: SGLang's xgrammar backend allocates and applies its vocabulary
bitmask here (``cpu_support/grammar.py``), and the default model's tokenizer is one xgrammar
reads correctly (``default_model.fix_tokenizer_decoder``)."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from spexis_sglang.cpu_support.grammar import apply_token_bitmask_cpu
from spexis_sglang.default_model import ensure_default_model, fix_tokenizer_decoder

VOCAB = 100


def _bitmask(allowed_rows):
    from xgrammar import bitmask_dtype, get_bitmask_shape

    mask = torch.zeros(get_bitmask_shape(len(allowed_rows), VOCAB), dtype=bitmask_dtype)
    for i, allowed in enumerate(allowed_rows):
        for j in allowed:
            word, bit = divmod(j, 32)
            value = int(mask[i, word]) | (1 << bit)
            mask[i, word] = value - (1 << 32) if value >= 1 << 31 else value
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_bitmask_apply_sets_exactly_the_forbidden_logits_to_minus_inf(dtype):
    rng = random.Random(0)
    allowed = [set(rng.sample(range(VOCAB), 7)), set(range(VOCAB)), {31, 32, 99}]
    logits = torch.randn(3, VOCAB, dtype=dtype)
    before = logits.clone()
    apply_token_bitmask_cpu(logits, _bitmask(allowed))
    for i, ok in enumerate(allowed):
        for j in range(VOCAB):
            if j in ok:
                assert logits[i, j] == before[i, j]
            else:
                assert logits[i, j] == float("-inf")


@pytest.fixture(scope="module")
def xgrammar_backend():
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoConfig, AutoTokenizer

    model = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    return XGrammarGrammarBackend(tokenizer, vocab_size=vocab, model_eos_token_ids=[2]), tokenizer


def test_sglang_xgrammar_backend_masks_logits_on_cpu(xgrammar_backend):
    """The stock mask path: allocate (no pinned memory here), fill, apply (no GPU kernel)."""
    from sglang.srt.constrained.base_grammar_backend import GrammarMask

    backend, tokenizer = xgrammar_backend
    grammar = backend.dispatch_regex(r"(yes|no), because [a-z ]+\.")
    for token in tokenizer.encode("no,", add_special_tokens=False):
        grammar.accept_token(token)
    mask = grammar.allocate_vocab_mask(backend.vocab_size, 2, "cpu")
    grammar.fill_vocab_mask(mask, 1)
    logits = torch.zeros(2, backend.vocab_size)
    GrammarMask(grammar, grammar.move_vocab_mask(mask, "cpu")).apply(logits)
    backend.apply_vocab_mask(logits, mask)  # the backend's own entry point as well
    assert bool((logits[0] == 0).all())  # row 0 was not filled: unconstrained
    allowed = {tokenizer.decode([t]) for t in (logits[1] == 0).nonzero().flatten().tolist()}
    # the default model's tokenizer is read as byte-level: tokens with a leading space exist
    assert " because" in allowed and allowed <= {" ", " b", " be", " bec", " because"}


def test_tokenizer_decoder_fix_changes_no_decoded_text(tmp_path):
    from tokenizers import Tokenizer

    src = os.path.join(ensure_default_model(), "tokenizer.json")
    with open(src, encoding="utf-8") as f:
        data = json.load(f)
    assert data["decoder"]["type"] == "ByteLevel"  # ensure_default_model applied it
    # what transformers' GGUF conversion writes
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            dict(data["decoder"]),
        ],
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    converted = Tokenizer.from_file(str(path))
    assert fix_tokenizer_decoder(str(tmp_path))
    assert not fix_tokenizer_decoder(str(tmp_path))  # idempotent
    fixed = Tokenizer.from_file(str(path))
    assert json.loads(path.read_text(encoding="utf-8"))["decoder"]["type"] == "ByteLevel"
    vocab = converted.get_vocab_size()
    assert [converted.decode([i]) for i in range(vocab)] == [
        fixed.decode([i]) for i in range(vocab)
    ]
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        assert converted.decode(ids, skip_special_tokens=False) == fixed.decode(
            ids, skip_special_tokens=False
        )


def test_a_model_converted_before_the_fix_is_repaired_in_place(tmp_path):
    src = ensure_default_model()
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", ".spexis-converted"):
        shutil.copy(os.path.join(src, name), model / name)
    data = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
    data["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, data["decoder"]]}
    (model / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    marker = json.loads((model / ".spexis-converted").read_text())
    marker.pop("byte_level_decoder", None)
    (model / ".spexis-converted").write_text(json.dumps(marker))
    assert ensure_default_model(str(model)) == str(model)
    assert json.loads((model / "tokenizer.json").read_text())["decoder"]["type"] == "ByteLevel"
    assert json.loads((model / ".spexis-converted").read_text())["byte_level_decoder"] is True
