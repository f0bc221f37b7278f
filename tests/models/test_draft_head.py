"""Draft head: shapes, dtypes, incremental KV, equivalence with an HF Llama layer, artifact I/O."""

import json
import os

import pytest
import torch

from spexis_sglang.models import (
    ArtifactMismatchError,
    DraftHead,
    DraftHeadConfig,
    architecture_fields,
    base_fingerprint,
    greedy_with_confidence,
    load_draft_head,
    save_draft_head,
)

BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 97,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "rms_norm_eps": 1e-5,
}


def _head(layers: int = 1, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig.from_base(BASE, num_layers=layers))
    with torch.no_grad():  # make every part non-trivial (o_proj starts at zero)
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def test_shapes_dtypes_and_confidence():
    head = _head()
    h = torch.randn(3, 7, 64) * 4
    pos = torch.arange(7).expand(3, 7)
    z, kv = head(h, pos)
    assert z.shape == (3, 7, 64) and z.dtype == torch.float32
    assert len(kv) == 1 and kv[0][0].shape == (3, 2, 7, 16)
    lm = torch.randn(97, 64)
    tok, conf, _ = head.draft(h, pos, lm)
    assert tok.shape == (3, 7) and tok.dtype == torch.int64
    assert conf.shape == (3, 7) and conf.dtype == torch.float32
    probs = torch.softmax(z @ lm.t(), -1)
    assert torch.equal(tok, probs.argmax(-1))
    torch.testing.assert_close(conf, probs.max(-1).values)
    assert ((conf > 0) & (conf <= 1)).all()


def test_parameter_names_map_to_llama():
    names = dict((k, tuple(v.shape)) for k, v in _head(layers=2).state_dict().items())
    assert names == {
        "norm.weight": (64,),
        "fc.weight": (64, 64),
        "fc.bias": (64,),
        "layers.0.input_layernorm.weight": (64,),
        "layers.0.self_attn.q_proj.weight": (64, 64),
        "layers.0.self_attn.k_proj.weight": (32, 64),
        "layers.0.self_attn.v_proj.weight": (32, 64),
        "layers.0.self_attn.o_proj.weight": (64, 64),
        "layers.1.input_layernorm.weight": (64,),
        "layers.1.self_attn.q_proj.weight": (64, 64),
        "layers.1.self_attn.k_proj.weight": (32, 64),
        "layers.1.self_attn.v_proj.weight": (32, 64),
        "layers.1.self_attn.o_proj.weight": (64, 64),
        "final_norm.weight": (64,),
    }


def test_incremental_kv_equals_full_forward():
    head = _head(layers=2)
    h = torch.randn(2, 9, 64)
    pos = torch.arange(9).expand(2, 9)
    full, _ = head(h, pos)
    z1, kv = head(h[:, :5], pos[:, :5])
    outs = [z1]
    for t in range(5, 9):  # one decode row at a time, as the server runs it
        z, kv = head(h[:, t : t + 1], pos[:, t : t + 1], past_key_values=kv)
        outs.append(z)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_padding_mask_isolates_sequences():
    head = _head()
    a, b = torch.randn(1, 6, 64), torch.randn(1, 3, 64)
    za, _ = head(a, torch.arange(6)[None])
    zb, _ = head(b, torch.arange(3)[None])
    batch = torch.zeros(2, 6, 64)
    batch[0], batch[1, :3] = a[0], b[0]
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    z, _ = head(batch, torch.arange(6).expand(2, 6), key_padding_mask=mask)
    torch.testing.assert_close(z[0], za[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z[1, :3], zb[0], atol=1e-5, rtol=1e-5)


def test_matches_hf_llama_decoder_layer_without_mlp():
    """The head's layer is exactly an HF Llama layer (RoPE, GQA, norms) whose MLP is zero."""
    from transformers import LlamaConfig, LlamaModel

    head = _head()
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=97,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        attention_bias=False,
    )
    hf = LlamaModel(cfg).eval()
    sd = head.state_dict()
    with torch.no_grad():
        layer = hf.layers[0]
        layer.input_layernorm.weight.copy_(sd["layers.0.input_layernorm.weight"])
        for n in "qkvo":
            getattr(layer.self_attn, f"{n}_proj").weight.copy_(
                sd[f"layers.0.self_attn.{n}_proj.weight"]
            )
        layer.mlp.down_proj.weight.zero_()
        hf.norm.weight.copy_(sd["final_norm.weight"])
    h = torch.randn(2, 8, 64) * 3
    pos = torch.tensor([list(range(8)), list(range(5, 13))])  # RoPE positions come from the caller
    y = head.fc(head.norm(h))
    with torch.no_grad():
        ref = hf(inputs_embeds=y, position_ids=pos).last_hidden_state
        ours, _ = head(h, pos)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_untrained_head_is_logit_lens():
    head = DraftHead(DraftHeadConfig.from_base(BASE))
    w = torch.rand(64) + 0.5
    head.reset_parameters(final_norm_weight=w)
    h = torch.randn(2, 4, 64)
    z, _ = head(h, torch.arange(4).expand(2, 4))
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(z, ref, atol=1e-4, rtol=1e-4)


def test_save_load_round_trip(tmp_path):
    head = _head(layers=2)
    path = str(tmp_path / "draft")
    save_draft_head(path, head, BASE, "tiny-llama", exit_layer=2, dtype=torch.float16)
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["kind"] == "draft_head" and cfg["exit_layer"] == 2
    assert cfg["base_fingerprint"] == base_fingerprint(BASE)
    loaded, acfg = load_draft_head(path, BASE, exit_layer=2)
    assert acfg.weights_dtype == "float16"
    for k, v in head.state_dict().items():
        lv = loaded.state_dict()[k]
        assert lv.dtype == torch.float32  # upcast on load
        torch.testing.assert_close(lv, v.half().float())
    h = torch.randn(1, 5, 64)
    pos = torch.arange(5)[None]
    torch.testing.assert_close(loaded(h, pos)[0], head(h, pos)[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", 128),
        ("num_hidden_layers", 8),
        ("vocab_size", 98),
        ("num_key_value_heads", 4),
        ("rms_norm_eps", 1e-6),
    ],
)
def test_mismatched_base_model_rejected(tmp_path, field, value):
    path = str(tmp_path / "draft")
    save_draft_head(path, _head(), BASE, "tiny-llama", exit_layer=2)
    other = dict(BASE, **{field: value})
    with pytest.raises(ArtifactMismatchError) as e:
        load_draft_head(path, other)
    msg = str(e.value)
    mine, theirs = architecture_fields(BASE)[field], architecture_fields(other)[field]
    assert repr(field) in msg and "tiny-llama" in msg
    assert f"is {mine!r} in the artifact" in msg and f"but {theirs!r} in the base model" in msg


def test_rope_theta_and_exit_layer_mismatch(tmp_path):
    path = str(tmp_path / "draft")
    save_draft_head(path, _head(), BASE, "tiny-llama", exit_layer=2)
    other = dict(BASE, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    with pytest.raises(ArtifactMismatchError, match="'rope_theta' is 10000.0 .* but 500000.0"):
        load_draft_head(path, other)
    with pytest.raises(ArtifactMismatchError, match="'exit_layer' is 2 .* after layer 3"):
        load_draft_head(path, BASE, exit_layer=3)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        os.remove(os.path.join(path, "model.safetensors"))
        load_draft_head(path, BASE)


def test_greedy_with_confidence_is_stable_for_large_logits():
    logits = torch.tensor([[1000.0, 999.0, -1000.0]])
    tok, conf = greedy_with_confidence(logits)
    assert tok.item() == 0
    torch.testing.assert_close(conf, torch.softmax(logits, -1)[:, 0])
