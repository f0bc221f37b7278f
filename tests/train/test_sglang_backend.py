"""The SGLang collect backend: answers given to collect make the same records as HF generate;
SGLang's stop handling as HF's; evaluation sets that are empty or partial are skipped. A real
server's greedy answers equal HF's on the default model: tests/e2e/test_collect_backend.py."""

import json
import os

import torch

from spexis_sglang.train import pipeline
from spexis_sglang.train.cli import build_parser
from spexis_sglang.train.collect import (
    CollectConfig,
    _answer_from_sglang,
    chat_ids,
    collect,
    generate_greedy,
    load_collected,
    sglang_answers,
)

from .tiny_base import EXIT_LAYER, prompt_for


def test_sglang_output_ends_as_hf_generate():
    """EOS kept once (SGLang may or may not list it), cut answers are unfinished."""
    eos = (2,)
    assert _answer_from_sglang({"output_ids": [5, 6, 2]}, eos) == ([5, 6, 2], True)
    stop = {"meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
    assert _answer_from_sglang({"output_ids": [5, 6], **stop}, eos) == ([5, 6, 2], True)
    length = {"meta_info": {"finish_reason": {"type": "length", "length": 3}}}
    assert _answer_from_sglang({"output_ids": [5, 6, 7], **length}, eos) == ([5, 6, 7], False)


def test_given_answers_record_what_hf_generate_records(base, tmp_path):
    """The sglang path (answers made beforehand, batches by full length) stores, per sequence,
    the same tokens / next / hidden states as the HF path: only the batching differs."""
    prompts = [prompt_for(s) for s in (0, 3, 7, 11, 15, 19)]
    cfg = CollectConfig(exits=(EXIT_LAYER,), max_new_tokens=8, batch_size=3)
    collect(base, prompts, str(tmp_path / "hf"), cfg, "t")
    hf = load_collected(str(tmp_path / "hf"))
    ids = [chat_ids(base, p.chat()) for p in prompts]
    gen = generate_greedy(base, ids, 8)
    answers = {
        p.uid: {"prompt_ids": i, "answer": a, "finished": f}
        for p, i, (a, f) in zip(prompts, ids, gen)
    }
    scfg = CollectConfig(exits=(EXIT_LAYER,), max_new_tokens=8, batch_size=4, backend="sglang")
    meta = collect(base, prompts, str(tmp_path / "sg"), scfg, "t", answers=answers)
    assert meta["gen_mismatches"] == 0 and meta["not_answered"] == 0
    sg = load_collected(str(tmp_path / "sg"))
    by_uid = {m["uid"]: i for i, m in enumerate(sg.meta)}
    for i, m in enumerate(hf.meta):
        j = by_uid[m["uid"]]
        assert {k: m[k] for k in ("prompt_len", "answer_len", "finished")} == {
            k: sg.meta[j][k] for k in ("prompt_len", "answer_len", "finished")
        }
        for key in ("tokens", "next"):
            assert torch.equal(hf.sequence(i, key), sg.sequence(j, key))
        torch.testing.assert_close(
            hf.sequence(i, f"hidden_{EXIT_LAYER}").float(),
            sg.sequence(j, f"hidden_{EXIT_LAYER}").float(),
            atol=2e-3,
            rtol=0,
        )


def test_unanswered_prompts_are_counted_and_the_cache_serves_a_merge(base, tmp_path):
    """A generation deadline leaves prompts out: collect counts them (not as too long), and a
    call without a server (the merge) reads the cached answers."""
    prompts = [prompt_for(s) for s in (0, 3, 7)]
    cfg = CollectConfig(exits=(EXIT_LAYER,), max_new_tokens=8, batch_size=4, backend="sglang")
    ids = chat_ids(base, prompts[0].chat())
    a, f = generate_greedy(base, [ids], 8)[0]
    answers = {prompts[0].uid: {"prompt_ids": ids, "answer": a, "finished": f}}
    path = str(tmp_path / "set" / "answers.json")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as fh:
        json.dump({"max_new_tokens": 8, "complete": False, "answers": answers}, fh)
    assert sglang_answers(base, None, prompts, cfg, path) == answers
    meta = collect(base, prompts, str(tmp_path / "set"), cfg, "t", answers=answers)
    assert len(meta["sequences"]) == 1 and meta["not_answered"] == 2
    assert meta["skipped_too_long"] == 0


def _fake_set(cfg, name, sequences, missing=0):
    d = pipeline._data_dir(cfg, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"sequences": sequences, "missing_shards": missing, "n_shards": 2}, f)


def test_empty_or_partial_evaluation_sets_are_skipped(tmp_path, caplog):
    """An empty other_test once crashed evaluate (KeyError 'hidden_15'): such sets are left out of
    evaluate / check-artifacts with a warning; a set never collected is silently absent."""
    cfg = pipeline.make_config("tiny", model_path="-", work_dir=str(tmp_path))
    _fake_set(cfg, "sharegpt_test", [{"uid": "a"}])
    _fake_set(cfg, "specbench", [{"uid": "b"}], missing=1)
    _fake_set(cfg, "other_test", [])
    with caplog.at_level("WARNING"):
        sets = pipeline._eval_sets(cfg)
    assert sets == {"ShareGPT": "sharegpt_test"}
    assert "specbench is partial" in caplog.text and "other_test is empty" in caplog.text
    os.remove(os.path.join(pipeline._data_dir(cfg, "other_test"), "meta.json"))
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert not pipeline.usable_eval_set(cfg, "other_test")
    assert "other_test" not in caplog.text


def test_cli_and_presets():
    a = build_parser().parse_args(
        [
            "collect",
            "--collect-backend",
            "sglang",
            "--collect-server-args=--attention-backend triton",
            "--length-source",
            "final",
        ]
    )
    assert a.collect_backend == "sglang" and a.collect_server_args == "--attention-backend triton"
    assert a.length_source == "final"
    assert pipeline.PRESETS["gpu-long"]["collect_backend"] == "sglang"
    assert pipeline.make_config("cpu", model_path="-", work_dir="-").collect_backend == "hf"
    cfg = pipeline.make_config("tiny", model_path="-", work_dir="-", length_source="final")
    assert pipeline._lkey(cfg) == "final"


def test_generation_deadline_leaves_slow_chunks_out():
    """The guard inside collect: chunks not answered by the deadline come back as None (the
    set is then collected from what was answered) instead of holding the call."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from spexis_sglang.train.collect import sglang_generate

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body["input_ids"][0][0] == 99:
                time.sleep(3)
            out = [{"output_ids": [7, 2]} for _ in body["input_ids"]]
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        got = sglang_generate(url, [[1], [99], [3]], 8, (2,), chunk=1, deadline=time.time() + 1)
    finally:
        httpd.shutdown()
    assert got == [([7, 2], True), None, ([7, 2], True)]
