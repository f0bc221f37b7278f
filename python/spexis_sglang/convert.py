"""Convert a GGUF checkpoint into the HF safetensors directory SGLang and the trainer load.

transformers dequantises a GGUF to fp32 but refuses to ``save_pretrained`` a model it still
marks as quantised, so the state dict is copied into a fresh module first. Llama-family models
with tied embeddings are saved untied (``lm_head.weight`` a copy of the embedding): SGLang
0.5.17's Llama cannot run PP > 1 tied (see ``default_model``). Gemma keeps its tied head (its
SGLang class always reads the embedding).

Usage: ``python -m spexis_sglang.convert MODEL.gguf [--output DIR]`` prints the directory
(default ``<cache>/models/<gguf stem>``); a converted directory is reused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time

logger = logging.getLogger(__name__)

_DONE_MARKER = ".spexis-converted"
# architectures whose SGLang class needs an untied LM head for PP > 1
_UNTIE = ("LlamaForCausalLM", "MistralForCausalLM")


def converted_dir_for(gguf: str) -> str:
    """Where :func:`ensure_converted` puts a GGUF's conversion (outside any repository)."""
    from spexis_sglang.default_model import cache_root

    stem = os.path.basename(gguf)
    stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else stem
    return os.path.join(cache_root(), "models", stem.lower())


def ensure_converted(gguf: str, out_dir: str | None = None, force: bool = False) -> str:
    """The HF directory for ``gguf`` (converted once; idempotent)."""
    out_dir = out_dir or converted_dir_for(gguf)
    if os.path.isfile(os.path.join(out_dir, _DONE_MARKER)) and not force:
        return out_dir
    if not os.path.isfile(gguf):
        raise FileNotFoundError(f"no such GGUF file: {gguf!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spexis_sglang.default_model import fix_tokenizer_decoder

    t0 = time.time()
    tmp_dir = out_dir + ".partial"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    name = os.path.basename(gguf)
    steps = tqdm(total=4, desc=f"converting {name}", unit="step", file=sys.stderr)
    src_dir, src_file = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_file)
    steps.update()
    steps.set_postfix_str("dequantising weights")
    quantised = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=src_file, dtype=torch.float32
    )
    steps.update()
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # plain fp32 tensors now
    arch = type(quantised).__name__
    config.architectures = [arch]
    state = quantised.state_dict()
    untie = arch in _UNTIE and bool(getattr(config, "tie_word_embeddings", False))
    if untie:
        config.tie_word_embeddings = False
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    model = type(quantised)(config)
    missing, _ = model.load_state_dict(state, strict=False)  # tied heads: either name
    missing = [k for k in missing if not (k == "lm_head.weight" and not untie)]
    if missing:
        raise RuntimeError(f"{name}: tensors missing after dequantisation: {missing[:5]}")
    model.generation_config = quantised.generation_config
    steps.update()
    steps.set_postfix_str("saving")
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    fixed = fix_tokenizer_decoder(tmp_dir)
    if _is_rank_scored_unigram(tmp_dir):
        sentencepiece_bpe_tokenizer(tmp_dir, bos=tokenizer.bos_token)
    with open(os.path.join(tmp_dir, _DONE_MARKER), "w") as f:
        json.dump({"gguf": name, "untied_lm_head": untie, "byte_level_decoder": fixed}, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.replace(tmp_dir, out_dir)
    steps.update()
    steps.close()
    logger.info("converted %s into %s in %.1f s", name, out_dir, time.time() - t0)
    return out_dir


def _is_rank_scored_unigram(model_dir: str) -> bool:
    """transformers' GGUF conversion of a SentencePiece *BPE* vocabulary (Gemma's) gives a
    Unigram model whose scores are merge ranks: it then segments "capital" as "c|ap|it|al",
    and the tokenizer class rebuilds it as a BPE without merges (one token per character)."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    if data["model"].get("type") != "Unigram":
        return False
    control = _control_tokens(data)
    scores = [s for p, s in data["model"]["vocab"] if p not in control and s != 0.0]
    ordered = sum(a >= b for a, b in zip(scores, scores[1:]))
    return len(scores) > 1000 and ordered >= 0.99 * (len(scores) - 1)


def _control_tokens(data: dict) -> set:
    """Special tokens (the GGUF's control and user-defined ones): never merged."""
    return {t["content"] for t in data.get("added_tokens", []) if t.get("special")}


def sentencepiece_bpe_tokenizer(model_dir: str, bos: str | None) -> None:
    """Rewrite ``tokenizer.json`` as the SentencePiece BPE it is (merges from the pieces'
    scores, as transformers' GemmaConverter builds them from a ``.model`` file), with the
    BOS the GGUF adds, loaded as a plain fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import generate_merges

    path = os.path.join(model_dir, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pieces = data["model"]["vocab"]
    vocab: dict[str, int] = {}
    for i, (p, _) in enumerate(pieces):
        if p in vocab:  # the converter renamed a byte piece ("<0x09>") to an existing "\t"
            p = f"<0x{ord(p):02X}>" if len(p) == 1 and ord(p) < 256 else f"<duplicate-{i}>"
            pieces[i][0] = p
        vocab[p] = i
    control = _control_tokens(data)
    merges = generate_merges(vocab, pieces, skip_tokens=control)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=pieces[data["model"].get("unk_id", 3)][0],
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    added = data.get("added_tokens", [])
    rebuilt = json.loads(tok.to_str())
    rebuilt["added_tokens"] = added
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rebuilt, f, ensure_ascii=False)
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tcfg = json.load(f)
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # tokenizer.json as written
    with open(cfg_path, "w") as f:
        json.dump(tcfg, f, indent=2)


def resolve_model_path(path: str) -> str:
    """A model directory as given, or a ``.gguf`` file converted into the cache."""
    path = os.path.expanduser(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ensure_converted(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"--model-path {path!r}: neither a model directory (with config.json) nor a .gguf file"
        )
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spexis_sglang.convert", description=__doc__)
    p.add_argument("gguf", help="a .gguf checkpoint")
    p.add_argument("--output", default=None, help="default: <cache>/models/<gguf stem>")
    p.add_argument("--force", action="store_true", help="convert even if already done")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_converted(args.gguf, args.output, force=args.force))
    return 0


if __name__ == "__main__":
    from spexis_sglang.cpu_support import activate

    activate()
    sys.exit(main())
