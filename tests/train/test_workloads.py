"""Serving workloads (``spexis_sglang.data.workloads``): lengths, caps, the bench_serving file.

A whitespace tokenizer stands in for the model's (one token per word, no chat template), so
every length below is exact and no model is loaded.
"""

import json
import random

import pytest

from spexis_sglang.data import workloads as w


class WordTokenizer:
    chat_template = None

    def encode(self, text):
        return [hash(t) % 1000 for t in text.split()]


TOK = WordTokenizer()


def test_sharegpt_lengths_come_from_the_answer_capped():
    rows = w.build_workload("sharegpt", TOK, 40, max_input_len=200, max_output_len=50)
    assert len(rows) == 40 and len({r.uid for r in rows}) == 40
    for r in rows:
        assert r.category == "chat" and r.source == "sharegpt"
        assert r.prompt_len == len(r.prompt.split()) <= 200
        assert r.output_len == min(r.answer_len, 50) and r.answer_len >= 4
    assert any(r.answer_len < 50 for r in rows)  # real answer lengths, not all the cap
    again = w.build_workload("sharegpt", TOK, 40, max_input_len=200, max_output_len=50)
    assert again == rows  # deterministic for a seed
    other = w.build_workload("sharegpt", TOK, 40, seed=1, max_input_len=200, max_output_len=50)
    assert [r.uid for r in other] != [r.uid for r in rows]


def test_specbench_interleaves_the_six_categories_at_the_cap():
    rows = w.build_workload("specbench", TOK, 13, max_input_len=400, max_output_len=64)
    cats = [r.category for r in rows]
    assert cats[:6] == ["math", "qa", "summarization", "rag", "translation", "multi_turn"]
    assert len(rows) == 13 and cats[6:12] == cats[:6]
    assert all(r.output_len == 64 and r.prompt_len <= 400 for r in rows)


def test_long_workload_has_only_long_answers():
    rows = w.build_workload(
        "long", TOK, 10, max_input_len=300, max_output_len=5000, long_min_output_len=300
    )
    assert len(rows) == 10 and all(r.answer_len >= 300 for r in rows)
    assert all(r.output_len == r.answer_len for r in rows)


def test_bad_names_and_caps_are_refused():
    with pytest.raises(ValueError, match="unknown workload"):
        w.build_workload("mmlu", TOK, 2)
    with pytest.raises(ValueError, match="min_output_len"):
        w.build_workload("sharegpt", TOK, 2, max_output_len=3)


def test_lengths_document_round_trip_and_synthetic_file(tmp_path):
    rows = w.build_workload("sharegpt", TOK, 5, max_input_len=100, max_output_len=30)
    doc = json.loads(json.dumps(w.lengths_doc("sharegpt", rows, {"num": 5})))
    assert doc["summary"]["requests"] == 5
    back = w.rows_from_lengths_doc(doc)
    assert [(r.uid, r.prompt_len, r.output_len) for r in back] == [
        (r.uid, r.prompt_len, r.output_len) for r in rows
    ]
    with pytest.raises(ValueError, match="no prompt text"):
        w.sharegpt_file_rows(back, TOK)
    with_text = w.rows_from_lengths_doc(w.lengths_doc("sharegpt", rows, {}, with_text=True))
    assert with_text == rows
    (real,) = w.sharegpt_file_rows(with_text[:1], TOK)
    assert real["conversations"][0]["value"] == rows[0].prompt
    with pytest.raises(ValueError, match="not a serving workload"):
        w.rows_from_lengths_doc({"format": "x"})

    tok_dir = w.write_synthetic_tokenizer(str(tmp_path / "tok"), 500)
    from tokenizers import Tokenizer

    synth = Tokenizer.from_file(tok_dir + "/tokenizer.json")

    class Synth:
        chat_template = None

        def encode(self, text):
            return synth.encode(text).ids

    file_rows = w.sharegpt_file_rows(back, Synth(), synthetic_vocab=500)
    for r, f in zip(back, file_rows):
        human, gpt = f["conversations"]
        assert (human["from"], gpt["from"]) == ("human", "gpt")
        assert len(Synth().encode(human["value"])) == r.prompt_len
        assert len(Synth().encode(gpt["value"])) == r.output_len
        assert max(Synth().encode(human["value"])) < 500
    # every id decodes to a word: a dummy model's output always streams text
    assert synth.decode([0, 499]) == "t0 t499"


def test_filler_is_exact_for_the_default_tokenizer_shape():
    assert len(TOK.encode(w.filler(TOK, 37))) == 37
    rng = random.Random(0)
    assert len(w.synthetic_prompt(12, 100, rng).split()) == 12
