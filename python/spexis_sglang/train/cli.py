"""Command line: ``python -m spexis_sglang.train [options]
{collect,train-draft,train-length,calibrate,evaluate,export,all}``."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from spexis_sglang.train import pipeline

STEPS = {
    "prompts": pipeline.step_prompts,
    "collect": pipeline.step_collect,
    "train-draft": pipeline.step_train_draft,
    "train-length": pipeline.step_train_length,
    "calibrate": pipeline.step_calibrate,
    "evaluate": pipeline.step_evaluate,
    "export": pipeline.step_export,
    "check-artifacts": pipeline.step_check_artifacts,
    "compare": pipeline.step_compare,
    "all": pipeline.step_all,
}


def _worker(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"need 0 <= K < N, got {text!r}")
    return k, n


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2 or 2,4, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spexis_sglang.train",
        description="Train a Spexis draft head and remaining-length predictor for a causal LM "
        "(self-distillation: the model answers prompts itself), evaluate them and export "
        "servable artifacts. Example: python -m spexis_sglang.train all --model-path DIR_OR_GGUF "
        "--pp-size 2 --out DIR; then serve with --pp-size 2 --spexis-draft-head "
        "DIR/draft-exit<L> --spexis-length-predictor DIR/length.",
    )
    p.add_argument(
        "step", choices=sorted(STEPS), help="pipeline step ('all' runs every step in order)"
    )
    p.add_argument(
        "--preset",
        default="cpu",
        choices=sorted(pipeline.PRESETS),
        help="size preset (default: cpu; gpu for a full run on one GPU)",
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="base model: an HF directory or a .gguf file (converted once into the cache); "
        "default: the bundled SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--out",
        default=None,
        help="where the artifacts (draft-exit<L>/, length/) and report.{json,md} go "
        "(default: <cache>/heads/<model>); never the installed package",
    )
    p.add_argument(
        "--pp-size",
        dest="pp_sizes",
        type=_ints,
        default=None,
        help="pipeline split(s) to serve, e.g. 2 or 2,4: one draft head each, exiting after "
        "stage 0's last layer as SGLang assigns layers (default: the preset's)",
    )
    p.add_argument(
        "--exit-layer",
        "--exits",
        dest="exits",
        type=_ints,
        default=None,
        help="draft-head exit layer(s), overriding --pp-size's (serve with "
        "SGLANG_PP_LAYER_PARTITION so that stage 0 ends there)",
    )
    p.add_argument(
        "--length-exit-layer",
        dest="length_exit",
        type=int,
        default=None,
        help="the length predictor's exit layer (default: the first draft-head exit)",
    )
    p.add_argument(
        "--data",
        dest="data_file",
        default=None,
        help="your prompts (JSONL of prompt / messages / ShareGPT conversations records, or a "
        "ShareGPT JSON array) instead of the offline datasets; split 80/10/10 train/val/test",
    )
    p.add_argument(
        "--force",
        action="store_true",
        default=None,
        help="re-train heads whose checkpoint is current (all resumes by default)",
    )
    p.add_argument(
        "--update-shipped",
        action="store_true",
        default=None,
        help="maintainers only: write the package's shipped SmolLM2 artifacts and "
        "benchmark/results/quality.* (refused for any other model)",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        help="collected data and checkpoints (default: <out>/work)",
    )
    p.add_argument(
        "--artifact-dir",
        default=None,
        help="where export writes draft-exit*/ and length/ (default: --out)",
    )
    p.add_argument(
        "--results-dir", default=None, help="where evaluate writes the report (default: --out)"
    )
    p.add_argument(
        "--results-stem", default=None, help="file name stem of the report (default: report)"
    )
    p.add_argument(
        "--base-dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="the base model's dtype in collect (default float32: exact labels; bfloat16 "
        "halves the memory of a large model)",
    )
    p.add_argument(
        "--train-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="draft-head training precision (default: bfloat16 autocast on a GPU, float32 on CPU)",
    )
    p.add_argument(
        "--prompts-file",
        default=None,
        help="prompt sets frozen by the 'prompts' step (collect then needs no data packages)",
    )
    p.add_argument(
        "--collect-worker",
        type=_worker,
        default=None,
        metavar="K/N",
        help="collect only shards K, K+N, ... (one process per GPU, K from 0); "
        "a plain collect afterwards merges the sets",
    )
    p.add_argument(
        "--collect-deadline",
        type=float,
        default=None,
        metavar="UNIX_TIME",
        help="start no collect shard that would end after this time (left for a later run); "
        "1 = start none (a merge only)",
    )
    p.add_argument(
        "--collect-allow-partial",
        action="store_true",
        default=None,
        help="a merge writes meta.json even with shards missing (train on what exists)",
    )
    p.add_argument(
        "--collect-backend",
        choices=("hf", "sglang"),
        default=None,
        help="who generates the greedy answers: hf (batched generate) or sglang (one "
        "spexis_sglang.launch_server per collect call; preset default)",
    )
    p.add_argument(
        "--collect-server-dtype",
        default=None,
        help="dtype of the collect SGLang server (default: float32 on CPU, bfloat16 on a GPU)",
    )
    p.add_argument(
        "--collect-server-args",
        default=None,
        help="more arguments for the collect SGLang server, one string; write "
        "--collect-server-args='--flag value ...' (with '=', as the value starts with '--')",
    )
    p.add_argument(
        "--length-source",
        choices=("hidden", "final"),
        default=None,
        help="length predictor input: hidden (hidden_<exit>) or final (last layer after the "
        "final norm: a ceiling variant, evaluated, not exported)",
    )
    p.add_argument(
        "--length-tag",
        default=None,
        help="name of a length-predictor variant: length-TAG.pt, calibration-TAG.json, "
        "evaluation-TAG.json (e.g. with --length-features tokens_generated)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (preset default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 2)")
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--n-val", type=int, default=None)
    p.add_argument("--n-sharegpt-test", type=int, default=None)
    p.add_argument("--n-eval-per-category", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--draft-epochs", type=int, default=None)
    p.add_argument("--draft-lr", type=float, default=None)
    p.add_argument(
        "--prompt-loss-weight",
        type=float,
        default=None,
        help="draft loss weight of prompt rows (default 0.1; 0 trains on answer rows only, "
        "about 3x cheaper on a CPU with a large vocabulary)",
    )
    p.add_argument(
        "--kl-weight",
        type=float,
        default=None,
        help="weight of the distillation term (KL to the base's next-token distribution; "
        "default 0.5)",
    )
    p.add_argument("--length-epochs", type=int, default=None)
    p.add_argument(
        "--length-features",
        type=lambda s: tuple(x for x in s.split(",") if x),
        default=None,
        help="length predictor scalar inputs, e.g. tokens_generated,prompt_len ('' = hidden only)",
    )
    p.add_argument("--length-output", choices=("independent", "cumulative"), default=None)
    p.add_argument("--length-mask", choices=("window", "known"), default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    overrides = {k: v for k, v in vars(args).items() if k not in ("step", "preset", "verbose")}
    try:
        cfg = pipeline.make_config(args.preset, **overrides)
    except (ValueError, FileNotFoundError) as e:
        build_parser().error(str(e))
    cfg.command = (
        pipeline.command_line()
        if argv is None
        else "python -m spexis_sglang.train " + " ".join(argv)
    )
    result = STEPS[args.step](cfg)
    summary = json.dumps(result, default=str)
    print(summary if len(summary) < 4000 else summary[:4000] + " ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
