"""Bad ``--spexis-*`` input fails before any process starts, with a message naming the problem."""

from __future__ import annotations

import os

import pytest

from spexis_sglang.default_model import ensure_default_model
from spexis_sglang.srt import launch as launch_server
from spexis_sglang.srt.bundled import ARTIFACTS_DIR, bundled_draft_head

HEADS = os.path.join(ARTIFACTS_DIR, "smollm2-135m-instruct")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pp-size", "1", "--spexis-draft-head", "random:0"], "needs --pp-size >= 2"),
        (["--pp-size", "2", "--spexis-draft-head", "random:x"], "expected random:<integer seed>"),
        (
            ["--pp-size", "2", "--spexis-draft-head", "/nonexistent/head"],
            "no such artifact directory",
        ),
        (["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-alpha", "1.5"], "[0, 1]"),
        (["--pp-size", "2", "--spexis-alpha", "0.2"], "needs --spexis-draft-head"),
        (["--pp-size", "2", "--spexis-alpha", "auto"], "needs --spexis-draft-head"),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-alpha", "often"],
            "--spexis-alpha must be a number in [0, 1] or 'auto', got 'often'",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-alpha", "nan"],
            "--spexis-alpha must be a number in [0, 1] or 'auto'",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-alpha", "0.2"]
            + ["--spexis-alpha-interval", "10"],
            "--spexis-alpha-interval and --spexis-alpha-explore need --spexis-alpha auto",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-alpha", "auto"]
            + ["--spexis-alpha-interval", "0"],
            "--spexis-alpha-interval must be >= 1, got 0",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-alpha", "auto"]
            + ["--spexis-alpha-explore", "-1"],
            "--spexis-alpha-explore must be >= 0, got -1",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-alpha", "auto"]
            + ["--spexis-alpha-observe", "4"],
            "--spexis-alpha-observe needs a fixed --spexis-alpha",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-alpha-observe", "0"],
            "--spexis-alpha-observe must be >= 1, got 0",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", os.path.join(HEADS, "draft-exit7")],
            "'exit_layer' is 7 in the artifact but the server's stage 0 ends after layer 15",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", os.path.join(HEADS, "length")],
            "kind is 'length_predictor', expected 'draft_head'",
        ),
        (
            [
                "--pp-size",
                "2",
                "--spexis-draft-head",
                "bundled",
                "--spexis-benchmark-force-accept",
                "0.5",
            ],
            "refused unless the weights are random",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--pp-async-batch-depth", "1"],
            "needs --pp-async-batch-depth 0 (got 1): stock PP processes a micro-batch's result",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--scheduler-recv-interval", "4"],
            "needs --scheduler-recv-interval 1 (got 4): SGLang's receive skipper reads requests",
        ),
        (
            ["--pp-size", "3", "--spexis-draft-head", "bundled"],
            "no bundled draft head at exit layer 10",
        ),
        (
            [
                "--pp-size",
                "2",
                "--spexis-draft-head",
                "bundled",
                "--speculative-algorithm",
                "NGRAM",
            ],
            "--spexis-draft-head with --speculative-algorithm NGRAM: speculative parallelism is",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "bundled", "--spexis-lookahead-admission"],
            "--spexis-lookahead-admission needs --spexis-length-predictor",
        ),
        (
            ["--pp-size", "2", "--spexis-length-predictor", "bundled"],
            "--spexis-length-predictor needs --spexis-draft-head",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "bundled"]
            + ["--spexis-length-predictor", "/nonexistent/lp"],
            "--spexis-length-predictor /nonexistent/lp: no such artifact directory",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "bundled"]
            + ["--spexis-length-predictor", os.path.join(HEADS, "draft-exit15")],
            "kind is 'draft_head', expected 'length_predictor'",
        ),
        (
            ["--pp-size", "3", "--spexis-draft-head", "random:0"]
            + ["--spexis-length-predictor", "bundled"],
            "'exit_layer' is 15 in the artifact but the server's stage 0 ends after layer 10",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "bundled"]
            + ["--spexis-length-predictor", "bundled", "--spexis-admission-pdr", "0"],
            "--spexis-admission-pdr must be > 0",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-vocab", "1000"],
            "--spexis-draft-vocab needs --spexis-draft-head",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-draft-vocab", "0"],
            "--spexis-draft-vocab must be between 1 and the model's vocabulary (49152 ids), got 0",
        ),
        (
            ["--pp-size", "2", "--spexis-draft-head", "random:0", "--spexis-draft-vocab=49153"],
            "--spexis-draft-vocab must be between 1 and the model's vocabulary (49152 ids)",
        ),
        (["--spexis-max-n", "0"], "--spexis-max-n must be >= 1, got 0"),
        (
            ["--spexis-max-request-sequences", "-1"],
            "--spexis-max-request-sequences must be >= 1, got -1",
        ),
        (["--max-queued-requests", "0"], "--max-queued-requests must be >= 1, got 0"),
    ],
)
def test_bad_spexis_flags_are_refused(argv, message, capsys):
    assert launch_server.main(["--model-path", ensure_default_model(), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize(
    "architecture, refused",
    [
        ("PhiForCausalLM", True),
        ("Gemma3ForConditionalGeneration", True),
        ("Qwen2ForCausalLM", False),
    ],
)
def test_a_draft_head_for_an_architecture_sp_does_not_serve_is_refused(
    architecture, refused, tmp_path, capsys
):
    """SGLang would build its own class there, which makes no drafts: the launch stops first
    and names the architectures SP serves."""
    import json
    import shutil

    from spexis_sglang.srt.launch_config import check_sp_architecture
    from spexis_sglang.srt.model_registry import sp_architectures

    model = tmp_path / "model"
    shutil.copytree(ensure_default_model(), model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = [architecture]
    (model / "config.json").write_text(json.dumps(config))
    if not refused:
        check_sp_architecture(str(model))
        return
    argv = ["--model-path", str(model), "--pp-size", "2", "--spexis-draft-head", "random:0"]
    assert launch_server.main(argv) == 2
    err = capsys.readouterr().err
    assert f"the model is a {architecture}, which speculative parallelism does not serve" in err
    served = "(it serves " + ", ".join(sp_architectures()) + ")"
    assert served in err and "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM" in served
    assert "serve it without --spexis-draft-head, as plain SGLang" in err


def test_a_hub_id_is_checked_through_the_hugging_face_cache(tmp_path, monkeypatch):
    """``--model-path org/name``: the architecture is read from the cached config.json (and
    fetched when the hub is reachable; here it is offline and only the cache is read)."""
    import json

    import huggingface_hub.constants

    from spexis_sglang.srt.launch_config import check_sp_architecture

    snapshot = _fake_hub_snapshot(tmp_path, "acme/tiny-phi")
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["PhiForCausalLM"]}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(launch_server.LaunchError, match="the model is a PhiForCausalLM"):
        check_sp_architecture("acme/tiny-phi")
    check_sp_architecture("acme/not-cached")  # nothing to read: SGLang reports it later


def _fake_hub_snapshot(cache, repo_id: str) -> "os.PathLike":
    """An empty snapshot of ``repo_id`` in a Hugging Face cache laid out at ``cache``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.mark.parametrize("weights", ["same", "other", "not downloaded"])
def test_a_hub_id_gets_the_bundled_artifacts_checked_against_its_cached_files(
    weights, tmp_path, monkeypatch
):
    """``--model-path HuggingFaceTB/SmolLM2-135M-Instruct --spexis-draft-head bundled``: the
    layer count and the artifacts' checks read the cache's config.json (a hub id has no
    directory of its own), and the weights fingerprint its snapshot's weights once SGLang has
    downloaded them: another checkpoint under the same name is refused."""
    import json
    import shutil
    from types import SimpleNamespace

    import huggingface_hub.constants
    import torch
    from safetensors.torch import save_file

    from spexis_sglang.models.artifact import weights_fingerprint
    from spexis_sglang.srt.launch_config import check_draft_head_artifact, resolve_length_predictor

    repo_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    snapshot = _fake_hub_snapshot(tmp_path, repo_id)
    model = ensure_default_model()
    (snapshot / "config.json").symlink_to(os.path.join(model, "config.json"))
    if weights == "same":
        (snapshot / "model.safetensors").symlink_to(os.path.join(model, "model.safetensors"))
    elif weights == "other":  # a fine-tune's embedding (a few rows are all the hash reads)
        embedding = torch.randn(64, 576, generator=torch.Generator().manual_seed(0))
        save_file({"model.embed_tokens.weight": embedding}, str(snapshot / "model.safetensors"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    assert bundled_draft_head(repo_id, 2) == os.path.join(HEADS, "draft-exit15")
    # the shipped head records no weights hash: a copy that records the model's
    head = tmp_path / "head"
    shutil.copytree(os.path.join(HEADS, "draft-exit15"), head)
    config = json.loads((head / "config.json").read_text())
    config["base_weights_hash"] = weights_fingerprint(model)
    (head / "config.json").write_text(json.dumps(config))
    server_args = SimpleNamespace(model_path=repo_id, pp_size=2, load_format="auto")
    if weights == "other":
        with pytest.raises(launch_server.LaunchError, match="does not match the base model's"):
            check_draft_head_artifact(str(head), server_args)
        return
    check_draft_head_artifact(str(head), server_args)
    assert resolve_length_predictor("bundled", server_args) == os.path.join(HEADS, "length")


def test_a_hub_id_that_cannot_be_read_is_reported_not_crashed_on(tmp_path, monkeypatch):
    """Neither cached nor reachable: the bundled head and an artifact say what is missing."""
    from types import SimpleNamespace

    import huggingface_hub.constants

    from spexis_sglang.srt.bundled import BundledHeadError
    from spexis_sglang.srt.launch_config import check_draft_head_artifact

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(BundledHeadError, match="no config.json for the model"):
        bundled_draft_head(repo_id, 2)
    server_args = SimpleNamespace(model_path=repo_id, pp_size=2, load_format="auto")
    with pytest.raises(launch_server.LaunchError, match="cannot check it against the model"):
        check_draft_head_artifact(os.path.join(HEADS, "draft-exit15"), server_args)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], (0.0, False, 50, 8)),
        (["--spexis-alpha", "0.25"], (0.25, False, 50, 8)),
        (["--spexis-alpha", "auto"], (0.0, True, 50, 8)),
        (
            ["--spexis-alpha=AUTO", "--spexis-alpha-interval", "20", "--spexis-alpha-explore", "0"],
            (0.0, True, 20, 0),
        ),
    ],
)
def test_spexis_alpha_parses_numbers_and_auto(extra, expected, monkeypatch):
    """A numeric alpha works as before; 'auto' turns the online choice on."""
    from spexis_sglang.srt.config import ENV_CONFIG, ENV_DRAFT_HEAD, get_config
    from spexis_sglang.srt.launch import prepare_server_args

    for name in (ENV_CONFIG, ENV_DRAFT_HEAD):  # restored after the test
        monkeypatch.setenv(name, "")

    argv = ["--model-path", ensure_default_model(), "--pp-size", "2"]
    _, cfg = prepare_server_args(argv + ["--spexis-draft-head", "random:0", *extra])
    assert (cfg.alpha, cfg.alpha_auto, cfg.alpha_interval, cfg.alpha_explore) == expected
    cfg.to_env()  # what the scheduler processes read back
    assert get_config() == cfg


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], 8),
        (["--spexis-alpha-observe", "1"], 1),
        (["--spexis-alpha", "0.3", "--spexis-alpha-observe", "16"], 16),
        (["--spexis-alpha", "1"], 64),
        (["--spexis-alpha", "1", "--spexis-alpha-observe", "8"], 8),
    ],
)
def test_fixed_alpha_observes_every_kth_iteration(extra, expected, monkeypatch):
    """A fixed alpha's observer samples iterations (default 8; 64 at alpha 1, where drafts are
    made only near an observed iteration); the config carries K."""
    from spexis_sglang.srt.config import ENV_CONFIG, ENV_DRAFT_HEAD, get_config
    from spexis_sglang.srt.launch import prepare_server_args

    for name in (ENV_CONFIG, ENV_DRAFT_HEAD):  # restored after the test
        monkeypatch.setenv(name, "")
    argv = ["--model-path", ensure_default_model(), "--pp-size", "2"]
    _, cfg = prepare_server_args(argv + ["--spexis-draft-head", "random:0", *extra])
    assert cfg.alpha_observe == expected
    cfg.to_env()
    assert get_config().alpha_observe == expected


@pytest.mark.parametrize("extra, expected", [([], None), (["4096"], 4096), (["49152"], None)])
def test_draft_vocabulary_reaches_the_config(extra, expected, monkeypatch):
    """``--spexis-draft-vocab K``; the whole vocabulary is the default, however given."""
    from spexis_sglang.srt.config import ENV_CONFIG, ENV_DRAFT_HEAD, get_config
    from spexis_sglang.srt.launch import prepare_server_args

    for name in (ENV_CONFIG, ENV_DRAFT_HEAD):  # restored after the test
        monkeypatch.setenv(name, "")
    argv = ["--model-path", ensure_default_model(), "--pp-size", "2"]
    flag = ["--spexis-draft-vocab", *extra] if extra else []
    _, cfg = prepare_server_args(argv + ["--spexis-draft-head", "random:0", *flag])
    assert cfg.draft_vocab == expected
    cfg.to_env()
    assert get_config().draft_vocab == expected


def test_help_says_what_alpha_auto_does(capsys):
    assert launch_server.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--spexis-alpha ALPHA|auto" in out and "re-chooses alpha with the cost model" in out
    assert "--spexis-alpha-interval K" in out and "--spexis-alpha-explore E" in out


def test_bundled_head_matches_stage0_of_pp2():
    path = bundled_draft_head(ensure_default_model(), 2)
    assert path.endswith("draft-exit15")
    assert os.path.isfile(os.path.join(path, "model.safetensors"))


def test_lookahead_admission_flags_resolve_the_bundled_predictor():
    from spexis_sglang.srt.launch import prepare_server_args

    argv = ["--model-path", ensure_default_model(), "--pp-size", "2"]
    argv += ["--spexis-draft-head", "bundled", "--spexis-length-predictor", "bundled"]
    argv += ["--spexis-lookahead-admission", "--spexis-admission-pdr", "3"]
    _, cfg = prepare_server_args(argv)
    assert cfg.length_predictor == os.path.join(HEADS, "length")
    assert cfg.lookahead_admission and cfg.admission_pdr == 3.0


@pytest.mark.parametrize("option", [["--dp-size", "2"], ["--page-size", "4"]])
def test_sp_accepts_data_parallelism_and_pages(option):
    """--dp-size > 1 (every replica runs its own SP pipeline) and --page-size > 1 (SP allocates
    page by page): equality tests in tests/e2e/test_sp_launch_options.py."""
    from spexis_sglang.srt.launch import prepare_server_args

    argv = ["--model-path", ensure_default_model(), "--pp-size", "2", *option]
    server_args, cfg = prepare_server_args(argv + ["--spexis-draft-head", "bundled"])
    assert cfg.enabled
    assert (server_args.dp_size, server_args.page_size) == (
        (2, 1) if "--dp-size" in option else (1, 4)
    )


def test_predictor_reading_scalar_features_is_refused(tmp_path, capsys):
    """The server feeds the predictor the hidden state only: an artifact that also needs
    tokens_generated is refused at launch, not misread in every iteration."""
    import json
    import shutil

    lp = tmp_path / "lp"
    shutil.copytree(os.path.join(HEADS, "length"), lp)
    cfg = json.loads((lp / "config.json").read_text())
    cfg["extra"]["features"] = ["tokens_generated"]
    (lp / "config.json").write_text(json.dumps(cfg))
    argv = ["--model-path", ensure_default_model(), "--pp-size", "2"]
    argv += ["--spexis-draft-head", "bundled", "--spexis-length-predictor", str(lp)]
    assert launch_server.main(argv) == 2
    assert "hidden-state-only predictors; this one also reads tokens_generated" in (
        capsys.readouterr().err
    )


def test_mismatched_base_model_is_refused(tmp_path, capsys):
    """A head trained for SmolLM2 on a model with another shape: the field is named."""
    import json
    import shutil

    model = tmp_path / "other-model"
    shutil.copytree(ensure_default_model(), model, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_key_value_heads"] = 1
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "model.safetensors").write_bytes(b"")
    argv = [
        "--model-path",
        str(model),
        "--pp-size",
        "2",
        "--spexis-draft-head",
        os.path.join(HEADS, "draft-exit15"),
    ]
    assert launch_server.main(argv) == 2
    err = capsys.readouterr().err
    assert "'num_key_value_heads' is 3 in the artifact" in err and "but 1 in the base" in err, err


def test_float64_mode_sets_the_model_dtype_on_every_kind_of_server():
    """--spexis-float64 (the equality tests' exact mode) reaches SGLang's model config, with
    speculation and without (the plain baseline must run in the same precision)."""
    import torch
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    from spexis_sglang.srt.hooks import register_float64_dtype
    from spexis_sglang.srt.launch import prepare_server_args

    for extra in ([], ["--spexis-draft-head", "bundled"]):
        argv = ["--model-path", ensure_default_model(), "--pp-size", "2", "--device", "cpu"]
        server_args, cfg = prepare_server_args(argv + ["--spexis-float64", *extra])
        assert cfg.float64 and server_args.dtype == "float64"
    register_float64_dtype()
    assert _get_and_verify_dtype({"torch_dtype": "float32"}, "float64") == torch.float64


def test_help_names_the_launch_options_sp_combines_with_and_refuses(capsys):
    assert launch_server.main(["--help"]) == 0
    out = "".join(capsys.readouterr().out.split())  # argparse wraps lines at hyphens too
    for text in (
        "Works with --dp-size (one SP pipeline per replica) and --page-size",
        "Refused with --pp-async-batch-depth > 0",
        "With --enable-mixed-chunk the running requests' SP rows ride along each prefill chunk",
        "--scheduler-recv-interval > 1 (the later stages must read stage 0's plan",
        "--speculative-algorithm (SP is itself a speculation; SGLang runs none under PP)",
        "for a model architecture without a Spexis class",
        "decode CUDA graphs are captured up to pp-size x SGLang's default batch",
        "so requests may be admitted earlier than SGLang would",
        "by ~1e-13 instead of up to ~0.1",
    ):
        assert "".join(text.split()) in out, text


def test_float64_mode_is_refused_off_the_cpu(capsys):
    argv = ["--model-path", ensure_default_model(), "--pp-size", "2", "--device", "cuda"]
    assert launch_server.main(argv + ["--spexis-float64"]) == 2
    assert "--spexis-float64 is a CPU test mode (got --device cuda)" in capsys.readouterr().err


def _graph_args(max_bs, backend="full", pp=2, device="cuda", max_running=None):
    from types import SimpleNamespace

    decode = SimpleNamespace(max_bs=max_bs, backend=backend)
    return SimpleNamespace(
        cuda_graph_config=SimpleNamespace(decode=decode),
        device=device,
        pp_size=pp,
        max_running_requests=max_running,
    )


def test_sp_sizes_decode_graphs_for_its_full_batch():
    """SP runs all B rows per iteration, stock PP B/N: SGLang's default graph limit is raised
    N-fold (capped), unless the user sized the graphs, graphs are off, or SP is off."""
    from spexis_sglang.srt.config import SpexisConfig
    from spexis_sglang.srt.launch import SP_GRAPH_MAX_BS_CAP, sp_graph_max_bs

    sp, plain = SpexisConfig(draft_head="random:0"), SpexisConfig()
    assert sp_graph_max_bs([], _graph_args(256), sp) == 512
    assert sp_graph_max_bs([], _graph_args(512, pp=4), sp) == SP_GRAPH_MAX_BS_CAP
    assert sp_graph_max_bs([], _graph_args(256, max_running=300), sp) == 300
    assert sp_graph_max_bs([], _graph_args(256, max_running=200), sp) is None
    assert sp_graph_max_bs(["--cuda-graph-max-bs", "64"], _graph_args(64), sp) is None
    assert sp_graph_max_bs(["--cuda-graph-bs-decode=8"], _graph_args(8), sp) is None
    assert sp_graph_max_bs([], _graph_args(256, backend="disabled"), sp) is None
    assert sp_graph_max_bs([], _graph_args(256, device="cpu"), sp) is None
    assert sp_graph_max_bs([], _graph_args(256), plain) is None


def _corrupt_copy(tmp_path, name: str, how: str) -> str:
    """A copy of a shipped artifact whose model.safetensors is truncated or reshaped."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / f"{name}-{how}"
    shutil.copytree(os.path.join(HEADS, name), path)
    weights = path / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    else:
        state = load_file(str(weights))
        first = sorted(k for k, v in state.items() if v.dim() == 2)[0]
        state[first] = state[first][:, :-1].contiguous()
        save_file(state, str(weights))
    return str(path)


@pytest.mark.parametrize(
    "how, message", [("truncated", "corrupt or truncated"), ("reshaped", "has shape")]
)
@pytest.mark.parametrize(
    "flag, name", [("--spexis-draft-head", "draft-exit15"), ("--spexis-length-predictor", "length")]
)
def test_corrupt_artifact_weights_fail_at_launch(tmp_path, capsys, flag, name, how, message):
    """A damaged model.safetensors is refused by the launcher (header only, no process
    started), not at stage 0's first forward."""
    path = _corrupt_copy(tmp_path, name, how)
    argv = ["--model-path", ensure_default_model(), "--pp-size", "2"]
    if flag == "--spexis-length-predictor":
        argv += ["--spexis-draft-head", "bundled"]
    argv += [flag, path]
    assert launch_server.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} {path}" in err and message in err, err


def test_cpu_defaults_turn_graphs_off_without_the_deprecated_flag():
    model = ensure_default_model()
    argv = launch_server.prepare_argv(["--model-path", model], on_cpu=True)
    assert "--disable-decode-cuda-graph" in argv and "--disable-prefill-cuda-graph" in argv
    assert "--disable-cuda-graph" not in argv  # SGLang 0.5.17 prints a deprecation for it
    # a user's own graph flag wins: the defaults add none
    mine = launch_server.prepare_argv(["--model-path", model, "--disable-cuda-graph"], True)
    assert mine.count("--disable-cuda-graph") == 1
    assert "--disable-decode-cuda-graph" not in mine


def test_every_server_gets_the_queue_limit_and_the_bundled_model_its_clean_name():
    from spexis_sglang.default_model import default_model_dir

    for argv in ([], ["--model-path", ensure_default_model()]):
        got = launch_server.prepare_argv(argv, on_cpu=False)
        assert launch_server.flag_value(got, ("--served-model-name",)) == (
            True,
            "smollm2-135m-instruct",
        )
        assert launch_server.flag_value(got, ("--max-queued-requests",)) == (True, "1024")
        assert launch_server.flag_value(got, ("--model-path",))[1] == default_model_dir()
    # what the user gives wins
    argv = ["--served-model-name", "mine", "--max-queued-requests", "7"]
    got = launch_server.prepare_argv(argv, on_cpu=False)
    assert got.count("--served-model-name") == 1 and got.count("--max-queued-requests") == 1
    assert launch_server.flag_value(got, ("--max-queued-requests",)) == (True, "7")
    # another model keeps SGLang's own name (its path)
    other = os.path.join(HEADS, "draft-exit15")  # any directory with a config.json
    assert "--served-model-name" not in launch_server.prepare_argv(["--model-path", other], False)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], (128, 1024, False)),
        (["--spexis-max-n", "4", "--spexis-accept-any-model"], (4, 1024, True)),
        (["--spexis-max-request-sequences", "64"], (128, 64, False)),
        # a request could never be queued whole beyond the queue: the queue bounds it
        (["--max-queued-requests", "100"], (128, 100, False)),
    ],
)
def test_request_limits_reach_the_config(extra, expected, monkeypatch):
    from spexis_sglang.srt.config import ENV_CONFIG, ENV_DRAFT_HEAD, get_config
    from spexis_sglang.srt.launch import prepare_server_args

    for name in (ENV_CONFIG, ENV_DRAFT_HEAD):  # restored after the test
        monkeypatch.setenv(name, "")
    argv = launch_server.prepare_argv(["--pp-size", "2", *extra], on_cpu=False)
    _, cfg = prepare_server_args(argv)
    assert (cfg.max_n, cfg.max_request_sequences, cfg.accept_any_model) == expected
    cfg.to_env()
    assert get_config() == cfg
