"""Training for a user's own model: exit layers from the PP split, the user's prompts, one
command into a user directory that resumes, and never a write into the shipped artifacts."""

import hashlib
import json
import os

import pytest
import torch

from spexis_sglang.data.user import UserDataError, read_user_prompts, split_user_prompts
from spexis_sglang.models import load_draft_head, load_length_predictor
from spexis_sglang.train import cli, pipeline

from .tiny_base import answer_for, prompt_for


def test_stage0_layers_is_sglangs_split(monkeypatch):
    """The exit layer for --pp-size N is where SGLang ends stage 0, odd depths included."""
    from sglang.srt.distributed.utils import get_pp_indices

    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    for layers in range(2, 41):
        for pp in range(1, min(8, layers) + 1):
            assert pipeline.stage0_layers(layers, pp) == get_pp_indices(layers, 0, pp)[1]
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "7,6,5")
    assert pipeline.stage0_layers(18, 3) == get_pp_indices(18, 0, 3)[1] == 7
    with pytest.raises(ValueError, match="does not split 19 layers"):
        pipeline.stage0_layers(19, 3)
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION")
    part = pipeline.partition_for(18, 2, 5)
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", part)
    assert get_pp_indices(18, 0, 2) == (0, 5)


def test_exits_follow_the_split_of_the_models_depth(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 18}))
    cfg = pipeline.make_config("tiny", model_path=str(d), pp_sizes=(2, 4), out=str(tmp_path / "o"))
    assert cfg.exits == (9, 4) and cfg.length_exit == 9
    assert cfg.artifact_dir == cfg.results_dir == str(tmp_path / "o")
    assert cfg.work_dir == str(tmp_path / "o" / "work") and cfg.model_id == "m"
    cfg = pipeline.make_config("tiny", model_path=str(d), exits=(5,), length_exit=3, out="o")
    assert cfg.exits == (5,) and cfg.length_exit == 3
    assert any("SGLANG_PP_LAYER_PARTITION=5,13" in n for n in cfg.notes)
    with pytest.raises(ValueError, match="outside 1..17"):
        pipeline.make_config("tiny", model_path=str(d), exits=(18,), out="o")
    shipped = os.path.join(pipeline.SHIPPED_ARTIFACTS, pipeline.SHIPPED_SUBDIR)
    with pytest.raises(ValueError, match="only --update-shipped"):
        pipeline.make_config("tiny", model_path=str(d), artifact_dir=shipped)
    with pytest.raises(ValueError, match="is not SmolLM2-135M-Instruct"):
        pipeline.make_config("tiny", model_path=str(d), update_shipped=True)
    # without --out: the user's cache, not the package
    cfg = pipeline.make_config("tiny", model_path=str(d))
    assert not os.path.realpath(cfg.artifact_dir).startswith(pipeline.SHIPPED_ARTIFACTS)
    assert cfg.artifact_dir.endswith(os.path.join("heads", "m"))


def test_user_prompt_formats(tmp_path):
    p = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a b c", "category": "alpha"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "d e f"}]},
        {
            "id": "sg",
            "conversations": [
                {"from": "human", "value": "g h i"},
                {"from": "gpt", "value": "recorded answer (not a target)"},
                {"from": "human", "value": "later turn"},
            ],
        },
        {"conversations": [{"from": "gpt", "value": "no user turn"}]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = read_user_prompts(str(p))
    assert [g.messages for g in got] == [
        (("user", "a b c"),),
        (("system", "s"), ("user", "d e f")),
        (("user", "g h i"),),
    ]
    assert got[0].category == "alpha" and got[1].category == "user" and got[2].uid == "sg"
    arr = tmp_path / "sharegpt.json"
    arr.write_text(json.dumps(rows[2:3]))
    assert read_user_prompts(str(arr))[0].messages == (("user", "g h i"),)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(UserDataError, match="line 2 is not JSON"):
        read_user_prompts(str(bad))
    bad.write_text('{"answer": "x"}\n')
    with pytest.raises(UserDataError, match="no prompts found"):
        read_user_prompts(str(bad))
    many = [prompt_for(0, uid=f"u{i}") for i in range(40)]
    split = split_user_prompts(many)
    assert [len(split[k]) for k in ("train", "val", "user_test")] == [32, 4, 4]
    assert {p.uid for v in split.values() for p in v} == {p.uid for p in many}
    # adding prompts keeps the earlier ones where they were (hash, not position)
    more = split_user_prompts(many + [prompt_for(1, uid=f"x{i}") for i in range(10)])
    assert {p.uid for p in split["val"]} <= {p.uid for p in more["val"] + more["train"]}


def _tree_digest(root: str) -> str:
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for fn in sorted(files):
            path = os.path.join(dirpath, fn)
            h.update(path.encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def model_dir(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("usermodel") / "tiny-user-llama"
    base.model.save_pretrained(str(d))
    base.tokenizer.save_pretrained(str(d))
    return str(d)


def test_one_command_trains_a_servable_head_into_the_users_directory(model_dir, tmp_path, caplog):
    """``all --model-path DIR --pp-size 2 --out OUT --data FILE``: artifacts at stage 0's exit
    that load for the model, a report beside them, a resumed run that trains nothing, and the
    package's shipped artifacts untouched."""
    data = tmp_path / "mine.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"id": f"p{i}", "prompt": prompt_for(i % 23).messages[0][1]})
            for i in range(30)
        )
    )
    out = tmp_path / "heads"
    shipped = _tree_digest(pipeline.SHIPPED_ARTIFACTS)
    argv = ["all", "--preset", "tiny", "--model-path", model_dir, "--pp-size", "2"]
    argv += ["--out", str(out), "--data", str(data), "--threads", "1"]
    argv += ["--n-train", "24", "--max-new-tokens", "24", "--draft-epochs", "2"]
    assert cli.main(argv) == 0
    assert _tree_digest(pipeline.SHIPPED_ARTIFACTS) == shipped
    head_dir, length_dir = out / "draft-exit2", out / "length"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head, hcfg = load_draft_head(str(head_dir), config, exit_layer=2)
    _, lcfg = load_length_predictor(str(length_dir), config, exit_layer=2)
    assert hcfg.base_model == lcfg.base_model == "tiny-user-llama"
    report = json.loads((out / "report.json").read_text())
    acc = report["draft"]["exit2"]["acceptance"]
    assert set(acc) == {"user", "avg"}
    # the pattern model is easy to draft: far above chance (1/29 tokens)
    assert acc["avg"]["acceptance"] > 0.5
    assert "Your prompts" in report["length"]["eval"]
    assert (out / "report.md").read_text().startswith("# Draft head and length predictor")
    assert hcfg.extra["report"] == "report.md"
    ckpt = out / "work" / "checkpoints" / "draft-exit2.pt"
    before = os.path.getmtime(ckpt)
    caplog.clear()
    with caplog.at_level("INFO"):
        assert cli.main(argv) == 0
    assert os.path.getmtime(ckpt) == before
    assert "is current (same settings and data); skipped" in caplog.text
    # the exported head drafts what the checkpoint drafts
    ck = torch.load(ckpt, map_location="cpu")
    for k, v in ck["state"].items():
        torch.testing.assert_close(head.state_dict()[k], v.half().float())
    assert answer_for(0)  # the fixture's pattern is what the prompts ask for


def test_cli_refuses_bad_paths(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["all", "--model-path", str(tmp_path / "missing"), "--out", str(tmp_path)])
    assert "neither a model directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "architecture, extra",
    [
        ("Qwen3ForCausalLM", {}),
        ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
        (
            "Qwen3MoeForCausalLM",
            {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        ),
    ],
)
def test_a_random_qwen_of_odd_depth_trains_at_its_split(architecture, extra, tmp_path):
    """Qwen3 (q/k norms), Qwen2 (q/k/v biases, tied embedding) or Qwen3-MoE, 5 layers, 4:1
    GQA, --pp-size 3: the head exits after layer 1 (5 // 3)."""
    import transformers

    from .tiny_base import make_tokenizer

    tok = make_tokenizer()
    torch.manual_seed(0)
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=128,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        **extra,
    )
    model_dir = str(tmp_path / "qwen-odd")
    getattr(transformers, architecture)(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "p.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": prompt_for(i).messages[0][1]}) for i in range(12))
    )
    out = tmp_path / "out"
    argv = ["all", "--preset", "tiny", "--model-path", model_dir, "--pp-size", "3"]
    argv += ["--out", str(out), "--data", str(data), "--threads", "1", "--max-new-tokens", "6"]
    assert cli.main(argv) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["draft-exit1", "length", "work"]
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(model_dir)
    _, cfg = load_draft_head(str(out / "draft-exit1"), base, exit_layer=1)
    assert cfg.base_architecture_name == architecture
    assert cfg.extra["pp_sizes"] == [3]
    load_length_predictor(str(out / "length"), base, exit_layer=1)


def test_collect_does_not_resume_from_shards_of_other_settings(base, tmp_path, caplog):
    """A re-run with another storage dtype (or answer cap, exits) collects again instead of
    reading the old shards (a Gemma run's float16 shards held inf)."""
    from spexis_sglang.train.collect import CollectConfig, collect, load_collected

    prompts = [prompt_for(s, uid=f"s{s}") for s in range(4)]
    kw = dict(exits=(2,), max_prompt_tokens=64, max_new_tokens=8, batch_size=2)
    d = str(tmp_path / "set")
    collect(base, prompts, d, CollectConfig(**kw), "x")
    assert load_collected(d).tensors["hidden_2"].dtype == torch.float16
    with caplog.at_level("WARNING"):
        collect(base, prompts, d, CollectConfig(**kw, store_dtype="bfloat16"), "x")
    assert "collected with other settings" in caplog.text
    assert load_collected(d).tensors["hidden_2"].dtype == torch.bfloat16
