"""GGUF conversion: a SentencePiece-BPE vocabulary that transformers turns into a rank-scored
Unigram (Gemma's) is rebuilt as a BPE whose merges make whole words again."""

import json

from tokenizers import Tokenizer, models

from spexis_sglang.convert import _is_rank_scored_unigram, sentencepiece_bpe_tokenizer


def _unigram_dir(tmp_path, pieces):
    """tokenizer.json as transformers 5.12's GGUF converter writes it for Gemma."""
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=True))
    data = json.loads(tok.to_str())
    data["added_tokens"] = [
        {
            "id": i,
            "content": p,
            "special": True,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }
        for i, (p, _) in enumerate(pieces[:4])
    ]
    data["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GemmaTokenizer"})
    )
    return tmp_path


def test_rank_scored_unigram_becomes_a_bpe_with_merges(tmp_path):
    specials = [("<pad>", -1000.0), ("<eos>", -1000.0), ("<bos>", -1000.0), ("<unk>", -1000.0)]
    # a rank order: frequent merges first (higher score), single characters last
    merged = ["\u2581c", "ap", "it", "al", "ital", "apital", "\u2581capital", "\u2581of", "of"]
    chars = ["\u2581", "c", "a", "p", "i", "t", "l", "o", "f"]
    filler = [f"x{i}" for i in range(1200)]  # a vocabulary large enough to tell the score order
    ranked = merged + filler + chars
    pieces = specials + [(p, -float(r)) for r, p in enumerate(ranked)]
    d = _unigram_dir(tmp_path, pieces)
    assert _is_rank_scored_unigram(str(d))
    before = Tokenizer.from_file(str(d / "tokenizer.json")).encode(" capital of").tokens
    assert before != ["\u2581capital", "\u2581of"]  # Unigram on ranks splits the word
    sentencepiece_bpe_tokenizer(str(d), bos="<bos>")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.encode(" capital of").tokens == ["<bos>", "\u2581capital", "\u2581of"]
    assert tok.decode(tok.encode(" capital of").ids, skip_special_tokens=True) == " capital of"
    assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )
    assert not _is_rank_scored_unigram(str(d))  # a BPE now: left alone on a re-run
