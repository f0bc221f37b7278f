"""How long a draft head takes to train for a large model: throughput and peak memory of
each step of ``python -m spexis_sglang.train`` on one device, with random (dummy) weights.

Random weights train nothing useful but cost exactly what real ones cost, so an 8B-shaped
config (``benchmark/gpu/configs/llama-3.1-8b``) measures what a real 8B head's training
takes without the checkpoint. Per step, on the pipeline's own functions:

* ``generate``: greedy answers with HF ``generate`` (the pipeline's ``hf`` collect backend;
  the ``sglang`` backend serves them at serving throughput instead), answer tokens/s;
* ``teacher_forced``: collect's pass over prompt + answer recording exit and final hidden
  states (``collect.teacher_forced``), tokens/s;
* ``train_draft``: the draft head's training (``draft.train_draft_head``, bf16 autocast on a
  GPU) on random exit states, tokens/s per epoch;
* ``train_length``: the length predictor's (``length.train_length_predictor``), rows/s.

Each step reports its peak device memory (``torch.cuda.max_memory_allocated``; the process's
peak RSS on CPU). ``estimate`` turns the rates into the time of a run of the ``gpu`` preset's
size (``--estimate-*``). Output: one JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_base(config_dir: str, device: str, dtype: torch.dtype):
    """The config's model with random weights, made on the device, as a pipeline BaseModel."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from spexis_sglang.train.collect import BaseModel

    cfg = AutoConfig.from_pretrained(config_dir)
    t0 = time.time()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    _sync(device)
    # the last id as EOS: random weights almost never emit it, so answers run to the cap
    base = BaseModel(
        model=model,
        tokenizer=None,
        config=cfg,
        eos_ids=(cfg.vocab_size - 1,),
        pad_id=0,
        name="dummy",
    )
    return base, time.time() - t0


def measure_generate(base, device: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
    from spexis_sglang.train.collect import generate_greedy

    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (batch, prompt_len), generator=g).tolist()
    generate_greedy(base, prompts[:2], 2)  # warm-up
    _peak_reset(device)
    t0 = time.time()
    out = generate_greedy(base, prompts, new_tokens)
    _sync(device)
    dt = time.time() - t0
    tokens = sum(len(a) for a, _ in out)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "seconds": dt,
        "answer_tokens_per_s": tokens / dt,
        "peak_gib": _peak_gib(device),
    }


def measure_teacher_forced(
    base, device: str, batch: int, seq_len: int, repeats: int, exit_layer: int
) -> dict:
    from spexis_sglang.train.collect import teacher_forced

    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(10, vocab, (batch, seq_len), generator=g).tolist()
    teacher_forced(base, seqs[:1], (exit_layer,))  # warm-up
    _peak_reset(device)
    t0 = time.time()
    for _ in range(repeats):
        recs = teacher_forced(base, seqs, (exit_layer,))
    _sync(device)
    dt = time.time() - t0
    del recs
    return {
        "batch": batch,
        "seq_len": seq_len,
        "repeats": repeats,
        "seconds": dt,
        "tokens_per_s": batch * seq_len * repeats / dt,
        "peak_gib": _peak_gib(device),
    }


def _random_collected(config, n_seqs: int, seq_len: int, exit_layer: int, device: str):
    """A collected set of random rows (hidden states at the base's scale, random labels)."""
    from spexis_sglang.train.collect import Collected

    g = torch.Generator().manual_seed(2)
    total = n_seqs * seq_len
    h = config.hidden_size
    meta = [
        {
            "prompt_len": seq_len // 4,
            "answer_len": seq_len - seq_len // 4,
            "length": seq_len,
            "finished": i % 2 == 0,
            "category": "x",
            "source": "x",
        }
        for i in range(n_seqs)
    ]
    tensors = {
        f"hidden_{exit_layer}": torch.randn(total, h, generator=g).to(torch.float16),
        "final": torch.randn(total, h, generator=g).to(torch.float16),
        "next": torch.randint(0, config.vocab_size, (total,), generator=g).to(torch.int32),
        "tokens": torch.randint(0, config.vocab_size, (total,), generator=g).to(torch.int32),
    }
    offsets = torch.arange(n_seqs) * seq_len
    return Collected(meta=meta, offsets=offsets, tensors=tensors, max_new_tokens=seq_len)


def measure_train_draft(
    base, device: str, n_seqs: int, seq_len: int, batch_tokens: int, exit_layer: int, dtype: str
) -> dict:
    from spexis_sglang.train.draft import DraftTrainConfig, new_draft_head, train_draft_head

    data = _random_collected(base.config, n_seqs, seq_len, exit_layer, device)
    head = new_draft_head(base.config, base.final_norm_weight, 1, 0)
    lm_w = base.lm_head_weight
    cfg = DraftTrainConfig(
        exit_layer=exit_layer,
        epochs=1,
        batch_tokens=batch_tokens,
        device=device,
        dtype=dtype,
        warmup_steps=2,
    )
    # warm-up on a few sequences (kernels, allocator)
    small = _random_collected(base.config, 2, seq_len, exit_layer, device)
    train_draft_head(
        new_draft_head(base.config, base.final_norm_weight, 1, 0), small, None, lm_w, cfg
    )
    _peak_reset(device)
    t0 = time.time()
    _, info = train_draft_head(head, data, None, lm_w, cfg)
    _sync(device)
    dt = time.time() - t0
    return {
        "sequences": n_seqs,
        "seq_len": seq_len,
        "batch_tokens": batch_tokens,
        "steps": info["steps"],
        "dtype": dtype,
        "seconds": dt,
        "tokens_per_s": n_seqs * seq_len / dt,
        "peak_gib": _peak_gib(device),
        "head_parameters": sum(p.numel() for p in head.parameters()),
    }


def measure_train_length(base, device: str, n_seqs: int, seq_len: int, exit_layer: int) -> dict:
    from spexis_sglang.models.length_predictor import LengthPredictor, LengthPredictorConfig
    from spexis_sglang.train.length import LengthTrainConfig, length_rows, train_length_predictor

    data = _random_collected(base.config, n_seqs, seq_len, exit_layer, device)
    rows = length_rows(data, exit_layer)
    model = LengthPredictor(LengthPredictorConfig(hidden_size=base.config.hidden_size))
    _peak_reset(device)
    t0 = time.time()
    _, info = train_length_predictor(
        model, rows, LengthTrainConfig(exit_layer=exit_layer, epochs=1, device=device), None
    )
    _sync(device)
    dt = time.time() - t0
    return {
        "rows": info.get("rows"),
        "seconds": dt,
        "rows_per_s": info.get("rows", 0) / dt,
        "peak_gib": _peak_gib(device),
    }


def estimate(
    res: dict, prompts: int, prompt_tokens: float, answer_tokens: float, epochs: int
) -> dict:
    """Hours of a run of ``prompts`` prompts (mean prompt / answer tokens) at the rates measured."""
    total = prompts * (prompt_tokens + answer_tokens)
    out = {
        "prompts": prompts,
        "mean_prompt_tokens": prompt_tokens,
        "mean_answer_tokens": answer_tokens,
        "draft_epochs": epochs,
    }
    if "generate" in res:
        out["generate_hf_s"] = prompts * answer_tokens / res["generate"]["answer_tokens_per_s"]
    out["teacher_forced_s"] = total / res["teacher_forced"]["tokens_per_s"]
    out["train_draft_s"] = epochs * total / res["train_draft"]["tokens_per_s"]
    out["total_without_generate_s"] = out["teacher_forced_s"] + out["train_draft_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="an HF config directory (dummy weights)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", help="the base model's dtype")
    p.add_argument("--train-dtype", default=None, help="draft training (default: bf16 on a GPU)")
    p.add_argument("--pp-size", type=int, default=2, help="the exit layer is stage 0's end")
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--gen-prompt-len", type=int, default=256)
    p.add_argument("--gen-new-tokens", type=int, default=64)
    p.add_argument("--tf-batch", type=int, default=16)
    p.add_argument("--tf-seq-len", type=int, default=1024)
    p.add_argument("--tf-repeats", type=int, default=5)
    p.add_argument("--draft-seqs", type=int, default=256)
    p.add_argument("--draft-seq-len", type=int, default=1024)
    p.add_argument("--draft-batch-tokens", type=int, default=8192)
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--estimate-prompts", type=int, default=5000)
    # the gpu preset's training set (benchmark/results/quality.json): 4,664 sequences, 1.69M tokens
    p.add_argument("--estimate-prompt-tokens", type=float, default=155.0)
    p.add_argument("--estimate-answer-tokens", type=float, default=207.0)
    p.add_argument("--estimate-epochs", type=int, default=12)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.device == "cpu":
        from spexis_sglang.cpu_support import activate

        activate()
    if args.threads:
        torch.set_num_threads(args.threads)
    from spexis_sglang.train.pipeline import stage0_layers

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    train_dtype = args.train_dtype or ("float32" if args.device == "cpu" else "bfloat16")
    base, build_s = build_base(args.config, args.device, dtype)
    exit_layer = stage0_layers(base.config.num_hidden_layers, args.pp_size)
    res: dict = {
        "what": "draft-head training throughput and peak memory, dummy (random) weights",
        "config": os.path.relpath(os.path.abspath(args.config), os.path.join(HERE, "..", "..")),
        "device": (
            torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else platform.processor() or "cpu"
        ),
        "base_dtype": args.dtype,
        "exit_layer": exit_layer,
        "pp_size": args.pp_size,
        "parameters": sum(p.numel() for p in base.model.parameters()),
        "build_s": build_s,
        "torch": torch.__version__,
        "command": "python "
        + " ".join(
            [os.path.relpath(__file__, os.getcwd())] + sys.argv[1:] if argv is None else argv
        ),
    }
    steps = []
    if not args.skip_generate:
        steps.append(
            (
                "generate",
                lambda: measure_generate(
                    base, args.device, args.gen_batch, args.gen_prompt_len, args.gen_new_tokens
                ),
            )
        )
    steps += [
        (
            "teacher_forced",
            lambda: measure_teacher_forced(
                base, args.device, args.tf_batch, args.tf_seq_len, args.tf_repeats, exit_layer
            ),
        ),
        (
            "train_draft",
            lambda: measure_train_draft(
                base,
                args.device,
                args.draft_seqs,
                args.draft_seq_len,
                args.draft_batch_tokens,
                exit_layer,
                train_dtype,
            ),
        ),
        (
            "train_length",
            lambda: measure_train_length(
                base, args.device, args.draft_seqs, args.draft_seq_len, exit_layer
            ),
        ),
    ]
    for name, fn in steps:
        t0 = time.time()
        res[name] = fn()
        print(f"{name}: {json.dumps(res[name])} ({time.time() - t0:.0f} s)", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # what finished, should the call run out of time
            json.dump(res, f, indent=1)
    res["estimate"] = estimate(
        res,
        args.estimate_prompts,
        args.estimate_prompt_tokens,
        args.estimate_answer_tokens,
        args.estimate_epochs,
    )
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["estimate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
