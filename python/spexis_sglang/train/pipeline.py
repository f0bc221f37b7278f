"""The training pipeline: collect -> train-draft -> train-length -> calibrate -> evaluate -> export.

Any causal LM SGLang serves: the draft head's exit layer is stage 0's last layer for each
``--pp-size`` split, as SGLang assigns layers (:func:`stage0_layers`). Every step reads what the
previous ones wrote under ``work_dir`` (default ``<out>/work``), so steps can be re-run one at
a time and ``all`` resumes. Artifacts and the report go to ``out`` (default
``<cache>/heads/<model>``), never into the installed package: only ``update_shipped`` (the
maintainer's ``--update-shipped``) rebuilds the shipped SmolLM2 artifacts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from spexis_sglang.data.mix import evaluation_mix
from spexis_sglang.data.splits import deterministic_sample, source_split, training_prompts

logger = logging.getLogger(__name__)

# the shipped artifacts' model (only --update-shipped writes them)
SHIPPED_MODEL_ID = "SmolLM2-135M-Instruct"
SHIPPED_SUBDIR = "smollm2-135m-instruct"
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REPO_DIR = os.path.dirname(os.path.dirname(_PKG_DIR))
SHIPPED_ARTIFACTS = os.path.join(_PKG_DIR, "artifacts")
# the default model's depth: stands in for a model path that is a placeholder ("-")
_DEFAULT_MODEL_LAYERS = 30
# the length predictor's recipe (benchmark/results/length_predictor_cpu_study.md)
# (features are off: no gain on the CPU data; --length-features tokens_generated,prompt_len)
LENGTH_FEATURES: tuple[str, ...] = ()
LENGTH_OUTPUT = "cumulative"
LENGTH_POS_WEIGHT: str | None = None
LENGTH_MASK = "window"


@dataclass
class PipelineConfig:
    preset: str = "cpu"
    model_path: str = ""  # a model directory or a .gguf (converted into the cache)
    model_id: str = ""  # recorded in the artifacts (default: the model directory's name)
    # the user's directory: artifacts (draft-exit<L>/, length/) and report.{json,md,png};
    # default <cache>/heads/<model>
    out: str = ""
    work_dir: str = ""  # collected data and checkpoints (default <out>/work)
    artifact_dir: str = ""  # default: out
    results_dir: str = ""  # default: out
    results_stem: str = ""  # default "report" ("quality" with update_shipped)
    # the maintainer's switch: write the shipped SmolLM2 artifacts and benchmark/results
    update_shipped: bool = False
    device: str = "cpu"
    seed: int = 0
    threads: int = 2
    # pipeline splits to serve: one draft head per split, at stage 0's last layer
    pp_sizes: tuple[int, ...] = (2,)
    exits: tuple[int, ...] = ()  # explicit exit layers (default: from pp_sizes)
    length_exit: int = 0  # the length predictor's exit (default: the first exit)
    # the user's prompts (JSONL / ShareGPT JSON: data.user) instead of the offline datasets
    data_file: str = ""
    # the base model's dtype in collect's teacher-forced pass (float32: the labels are exact)
    base_dtype: str = "float32"
    # the draft head's training precision ("": bfloat16 autocast on a GPU, float32 on CPU)
    train_dtype: str = ""
    force: bool = False  # ``all`` re-trains a head / predictor whose checkpoint is current
    # data
    n_train: int = 160
    n_val: int = 32
    n_sharegpt_test: int = 32
    n_other_test: int = 0
    n_eval_per_category: int = 12
    max_prompt_tokens: int = 768
    max_new_tokens: int = 96
    batch_size: int = 32
    # draft head
    head_layers: int = 1
    draft_epochs: int = 4
    draft_lr: float = 2e-3
    batch_tokens: int = 4096
    kl_weight: float = 0.5
    prompt_loss_weight: float = 0.1
    # length predictor
    length_epochs: int = 20
    length_lr: float = 1e-3
    length_batch_rows: int = 1024
    # scalar inputs besides the hidden state (models.length_predictor.FEATURES); () = paper's
    length_features: tuple[str, ...] = LENGTH_FEATURES
    length_output: str = LENGTH_OUTPUT  # "independent" (paper) or "cumulative" (monotone)
    length_pos_weight: str | None = LENGTH_POS_WEIGHT  # None, "sqrt" or "balanced"
    # labels that train, calibrate and evaluate: "window" (no censoring bias) or "known"
    length_mask: str = LENGTH_MASK
    length_min_predicted: int = 20  # calibration ignores cutoffs predicting fewer val rows
    target_precision: float = 0.8
    rank_batch: int = 64
    prompts_file: str = ""  # read the prompt sets from here instead of the data packages
    # collect as worker k of n (one process per GPU); a plain collect afterwards merges
    collect_worker: tuple[int, int] = (0, 1)
    # training prompts per source (None = the whole split) instead of n_train x TRAIN_MIX
    train_counts: dict | None = None
    collect_batch_tokens: int = 0  # KV token budget of a generate batch (0: batch_size rows)
    collect_deadline: float = 0.0  # unix time: start no shard that would end later (0: none)
    collect_allow_partial: bool = False  # a merge writes meta.json with shards missing
    # who generates collect's greedy answers: "hf" (batched generate) or "sglang" (one
    # spexis_sglang.launch_server per collect call, every prompt of a set in one request batch)
    collect_backend: str = "hf"
    # the SGLang server's dtype ("" = float32 on CPU, as the teacher-forced pass; bfloat16 on a
    # GPU: sgl-kernel's rmsnorm has no float32 kernel, the server dies capturing CUDA graphs,
    # seen 2026-12-02; ``next`` from the fp32 teacher-forced pass stays the label) and extra
    # arguments (e.g. the GPU machine's required flags)
    collect_server_dtype: str = ""
    collect_server_args: str = ""
    # the length predictor's input: "hidden" (hidden_<length_exit>, what serving has) or
    # "final" (the last layer after the final norm: a ceiling for any hidden-state predictor)
    length_source: str = "hidden"
    # the length predictor's checkpoint / calibration name: length[-tag].pt, so variants
    # (e.g. with tokens_generated) train side by side on the same data
    length_tag: str = ""
    # > 0 (and below max_new_tokens): evaluate also reports every number on the data cut to
    # this answer cap (collect.capped), comparable with a run collected at that cap
    compare_cap: int = 0
    command: str = ""
    notes: list[str] = field(default_factory=list)


# one H200: the shipped artifacts (preset "gpu"; "gpu-long" starts from it)
_GPU: dict = dict(
    pp_sizes=(2, 4),
    device="cuda",
    threads=8,
    n_train=5000,
    n_val=400,
    n_sharegpt_test=400,
    n_other_test=200,
    n_eval_per_category=80,
    max_prompt_tokens=1536,
    max_new_tokens=256,
    batch_size=256,
    draft_epochs=12,
    draft_lr=2e-3,
    batch_tokens=8192,
    length_epochs=3,
)

PRESETS: dict[str, dict] = {
    # fits this shared 2-core CPU box: ~30 min collect, ~15 min train (a small reproduction)
    "cpu": dict(
        pp_sizes=(2, 4),
        n_train=120,
        n_val=24,
        n_sharegpt_test=24,
        n_eval_per_category=8,
        max_prompt_tokens=512,
        max_new_tokens=80,
        batch_size=24,
        batch_tokens=1024,
        draft_epochs=4,
        draft_lr=3e-3,
        length_epochs=10,
        length_min_predicted=5,  # 17 validation answers, 3 of them ended: few positive rows
    ),
    # one H200: the shipped artifacts
    "gpu": _GPU,
    # one H200, two device calls (benchmark/quality/train_artifacts_gpu.sh PHASE=collect, then
    # PHASE=train): every ShareGPT training-split conversation plus the gpu preset's other
    # sources (the same prompts: seeded order), answers capped at 768 instead of 256, the
    # evaluation sets of the gpu preset; 10 draft epochs (run 2: validation acceptance still rose
    # 0.53 -> 0.82 over 4 epochs; 10 reached 0.85 at the 1/2 exit)
    "gpu-long": {
        **_GPU,
        "threads": 2,
        "train_counts": {
            "sharegpt": None,
            "gsm8k": 500,
            "alpaca_eval": 500,
            "humaneval": 250,
            "arena_hard": 250,
        },
        "max_new_tokens": 768,
        "batch_size": 384,
        "collect_batch_tokens": 300_000,
        "draft_epochs": 10,
        "length_batch_rows": 4096,  # ~5x the rows of gpu: about its number of steps
        "compare_cap": 256,
        # run 1: six HF generate workers made ~2.1k answer tokens/s (a third of the set)
        "collect_backend": "sglang",
    },
    # the gpu-long recipe at unit-test size (CPU dry runs of the two-call flow)
    "tiny-long": dict(
        pp_sizes=(2, 4),
        train_counts={"sharegpt": 6, "gsm8k": 1, "alpaca_eval": 1, "humaneval": 1, "arena_hard": 1},
        n_val=4,
        n_sharegpt_test=4,
        n_other_test=2,
        n_eval_per_category=1,
        max_new_tokens=12,
        batch_size=4,
        collect_batch_tokens=4 * 200,
        draft_epochs=1,
        length_epochs=1,
        length_min_predicted=1,
        compare_cap=6,
    ),
    # unit tests / smoke runs
    "tiny": dict(
        pp_sizes=(2, 4),
        n_train=8,
        n_val=4,
        n_sharegpt_test=4,
        n_eval_per_category=1,
        max_new_tokens=8,
        batch_size=8,
        draft_epochs=1,
        length_epochs=1,
    ),
}


def stage0_layers(num_layers: int, pp_size: int) -> int:
    """Layers of pipeline stage 0 (its exit layer) as SGLang 0.5.17's ``get_pp_indices``
    assigns them: ``SGLANG_PP_LAYER_PARTITION`` if set, else an even split whose last
    ``num_layers % pp_size`` stages get one layer more (tests compare it with SGLang's)."""
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError(f"cannot split {num_layers} layers over {pp_size} pipeline stages")
    partition = os.environ.get("SGLANG_PP_LAYER_PARTITION")
    if partition:
        parts = [int(x) for x in partition.split(",")]
        if len(parts) != pp_size or sum(parts) != num_layers:
            raise ValueError(
                f"SGLANG_PP_LAYER_PARTITION={partition} does not split {num_layers} layers "
                f"over {pp_size} stages"
            )
        return parts[0]
    return num_layers // pp_size  # the extra layers go to the last stages


def partition_for(num_layers: int, pp_size: int, exit_layer: int) -> str:
    """A ``SGLANG_PP_LAYER_PARTITION`` value whose stage 0 ends at ``exit_layer``."""
    rest = num_layers - exit_layer
    if pp_size < 2 or rest < pp_size - 1:
        return ""
    base, extra = divmod(rest, pp_size - 1)
    parts = [exit_layer] + [
        base + (1 if i >= pp_size - 1 - extra else 0) for i in range(pp_size - 1)
    ]
    return ",".join(str(p) for p in parts)


def _model_config(model_path: str) -> dict:
    """The model's config.json (its text config for multimodal checkpoints); {} if unreadable."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if "num_hidden_layers" not in data and isinstance(data.get("text_config"), dict):
        return data["text_config"]
    return data


def model_slug(model_path: str) -> str:
    return os.path.basename(os.path.normpath(model_path)).lower() or "model"


def make_config(preset: str = "cpu", **overrides) -> PipelineConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = replace(PipelineConfig(preset=preset), **PRESETS[preset])
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if not cfg.model_path:
        from spexis_sglang.default_model import ensure_default_model

        cfg.model_path = ensure_default_model()
    elif cfg.model_path != "-":
        from spexis_sglang.convert import resolve_model_path

        cfg.model_path = resolve_model_path(cfg.model_path)
    num_layers = _model_config(cfg.model_path).get("num_hidden_layers", _DEFAULT_MODEL_LAYERS)
    if not cfg.exits:
        cfg.exits = tuple(dict.fromkeys(stage0_layers(num_layers, n) for n in cfg.pp_sizes))
    for ex in cfg.exits + ((cfg.length_exit,) if cfg.length_exit else ()):
        if not 0 < ex < num_layers:
            raise ValueError(
                f"exit layer {ex} is outside 1..{num_layers - 1} ({num_layers} layers)"
            )
    if not cfg.length_exit:
        cfg.length_exit = cfg.exits[0]
    for ex in cfg.exits:
        if all(ex != stage0_layers(num_layers, n) for n in cfg.pp_sizes):
            hint = partition_for(num_layers, cfg.pp_sizes[0], ex)
            cfg.notes.append(
                f"exit layer {ex} is not stage 0's last layer for --pp-size "
                f"{','.join(map(str, cfg.pp_sizes))}: serve it with SGLANG_PP_LAYER_PARTITION="
                f"{hint or '...'}"
            )
            logger.warning(cfg.notes[-1])
    _resolve_outputs(cfg)
    return cfg


def _check_shipped_model(model_path: str, shipped: str) -> None:
    """--update-shipped: the model is the one the shipped artifacts were trained for."""
    from spexis_sglang.models.artifact import architecture_fields, read_artifact_config

    base = _model_config(model_path)
    if not base:
        return  # a placeholder path: nothing is trained or exported with it
    want = read_artifact_config(os.path.join(shipped, "length")).base_architecture
    try:
        have = architecture_fields(base)
    except (TypeError, ValueError, KeyError):
        have = {}
    if any(have.get(k) != v for k, v in want.items()):
        raise ValueError(
            f"--update-shipped: {model_path} is not {SHIPPED_MODEL_ID} (the shipped artifacts' "
            "model); train into --out instead"
        )


def _resolve_outputs(cfg: PipelineConfig) -> None:
    """Where artifacts, the report and the work go; refuses the package unless update_shipped."""
    from spexis_sglang.default_model import cache_root

    shipped = os.path.join(SHIPPED_ARTIFACTS, SHIPPED_SUBDIR)
    if cfg.update_shipped:
        _check_shipped_model(cfg.model_path, shipped)
        cfg.model_id = cfg.model_id or SHIPPED_MODEL_ID
        cfg.artifact_dir = cfg.artifact_dir or shipped
        cfg.results_dir = cfg.results_dir or os.path.join(_REPO_DIR, "benchmark", "results")
        cfg.results_stem = cfg.results_stem or "quality"
        cfg.work_dir = cfg.work_dir or os.path.join(cache_root(), "train", cfg.preset)
        return
    cfg.model_id = cfg.model_id or os.path.basename(os.path.normpath(cfg.model_path))
    if not cfg.out:
        cfg.out = os.path.join(cache_root(), "heads", model_slug(cfg.model_path))
    cfg.artifact_dir = cfg.artifact_dir or cfg.out
    cfg.results_dir = cfg.results_dir or cfg.out
    cfg.results_stem = cfg.results_stem or "report"
    cfg.work_dir = cfg.work_dir or os.path.join(cfg.out, "work")
    inside = os.path.realpath(cfg.artifact_dir) + os.sep
    if inside.startswith(os.path.realpath(SHIPPED_ARTIFACTS) + os.sep):
        raise ValueError(
            f"{cfg.artifact_dir} is inside the package's shipped artifacts; only "
            "--update-shipped (a maintainer rebuilding them) writes there"
        )


def _data_dir(cfg: PipelineConfig, name: str) -> str:
    return os.path.join(cfg.work_dir, "data", name)


def _ckpt(cfg: PipelineConfig, name: str) -> str:
    return os.path.join(cfg.work_dir, "checkpoints", name)


def _lkey(cfg: PipelineConfig) -> str:
    """The collected tensor the length predictor reads (``length_source``)."""
    return "final" if cfg.length_source == "final" else f"hidden_{cfg.length_exit}"


def _tagged(cfg: PipelineConfig, name: str) -> str:
    """``length.pt`` -> ``length-<length_tag>.pt`` (also calibration.json, timing keys), so
    length-predictor variants train, calibrate and evaluate side by side on the same data."""
    if not cfg.length_tag:
        return name
    stem, dot, ext = name.partition(".")
    return f"{stem}-{cfg.length_tag}{dot}{ext}"


def _timings_path(cfg: PipelineConfig) -> str:
    return os.path.join(cfg.work_dir, "timings.json")


def _record_time(cfg: PipelineConfig, key: str, seconds: float) -> None:
    import fcntl

    os.makedirs(cfg.work_dir, exist_ok=True)
    path = _timings_path(cfg)
    # steps may run in parallel processes (one per GPU): read-modify-write under a lock
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t = {}
        if os.path.isfile(path):
            with open(path) as f:
                t = json.load(f)
        t[key] = seconds
        with open(path, "w") as f:
            json.dump(t, f, indent=1)


def _setup(cfg: PipelineConfig) -> None:
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    # on a GPU too: the host side (batch assembly, label building) runs torch CPU ops, and
    # parallel step processes (benchmark/quality/train_artifacts_gpu.sh) each default to one thread
    # per core, oversubscribing the machine
    torch.set_num_threads(max(1, cfg.threads))
    if cfg.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False  # keep the base's greedy tokens fp32-exact
        torch.backends.cudnn.allow_tf32 = False


_BASE_CACHE: dict = {}


def base_model(cfg: PipelineConfig):
    from spexis_sglang.train.collect import load_base_model

    key = (cfg.model_path, cfg.device, cfg.base_dtype)
    if key not in _BASE_CACHE:
        _BASE_CACHE.clear()
        _BASE_CACHE[key] = load_base_model(
            cfg.model_path, cfg.device, name=cfg.model_id, dtype=cfg.base_dtype
        )
    return _BASE_CACHE[key]


def data_sets(cfg: PipelineConfig) -> dict[str, list]:
    """The prompt sets collect runs, each from fixed seeded splits (or from ``prompts_file``)."""
    if cfg.prompts_file and os.path.isfile(cfg.prompts_file):
        return read_prompt_sets(cfg.prompts_file)
    if cfg.data_file:
        from spexis_sglang.data.user import read_user_prompts, split_user_prompts

        split = split_user_prompts(read_user_prompts(cfg.data_file), cfg.seed)
        caps = {"train": cfg.n_train, "val": cfg.n_val, "user_test": cfg.n_sharegpt_test}
        return {k: deterministic_sample(v, caps[k], cfg.seed, k) for k, v in split.items()}
    sets = {
        "train": training_prompts(cfg.n_train, "train", cfg.seed, counts=cfg.train_counts),
        "val": training_prompts(cfg.n_val, "val", cfg.seed),
        "sharegpt_test": deterministic_sample(
            source_split("sharegpt", "test", cfg.seed),
            cfg.n_sharegpt_test,
            cfg.seed,
            "sharegpt_test",
        ),
        "specbench": evaluation_mix(cfg.n_eval_per_category, cfg.seed),
    }
    if cfg.n_other_test:
        other = source_split("arena_hard", "test", cfg.seed) + source_split(
            "humaneval", "test", cfg.seed
        )
        sets["other_test"] = deterministic_sample(other, cfg.n_other_test, cfg.seed, "other_test")
    return sets


def write_prompt_sets(cfg: PipelineConfig, path: str) -> dict[str, int]:
    """Freeze the prompt sets into one JSON file (to collect on a machine without the data
    packages)."""
    sets = data_sets(replace(cfg, prompts_file=""))
    # references (human / ChatGPT answers) only built the derived prompts, already made here:
    # left out, the file carries in about half the bytes
    blob = {
        name: [{**asdict(p), "reference": ""} for p in prompts] for name, prompts in sets.items()
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(blob, f)
    return {k: len(v) for k, v in sets.items()}


def read_prompt_sets(path: str) -> dict[str, list]:
    from spexis_sglang.data.sources import Prompt

    with open(path) as f:
        blob = json.load(f)
    out = {}
    for name, items in blob.items():
        out[name] = [
            Prompt(
                **{
                    **d,
                    "messages": tuple(tuple(m) for m in d["messages"]),
                    "followups": tuple(d["followups"]),
                }
            )
            for d in items
        ]
    return out


def step_prompts(cfg: PipelineConfig) -> dict:
    path = cfg.prompts_file or os.path.join(cfg.work_dir, "prompts.json")
    return {"path": path, "sets": write_prompt_sets(cfg, path)}


def step_collect(cfg: PipelineConfig) -> dict:
    from spexis_sglang.train.collect import CollectConfig, collect, storage_dtype

    _setup(cfg)
    t0 = time.time()
    base = base_model(cfg)
    worker, num_workers = cfg.collect_worker
    ccfg = CollectConfig(
        exits=tuple(sorted(set(cfg.exits) | {cfg.length_exit})),
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size,
        device=cfg.device,
        worker=worker,
        num_workers=num_workers,
        batch_tokens=cfg.collect_batch_tokens,
        deadline=cfg.collect_deadline,
        allow_partial=cfg.collect_allow_partial,
        backend=cfg.collect_backend,
        store_dtype=storage_dtype(base, tuple(sorted(set(cfg.exits) | {cfg.length_exit}))),
    )
    if ccfg.backend == "sglang" and num_workers > 1:
        raise ValueError("--collect-backend sglang: one collect process (the server batches)")
    metas = {}
    sets = data_sets(cfg)
    # the small evaluation sets first: with a deadline, what is left over is training data
    order = [k for k in sets if k != "train"] + [k for k in sets if k == "train"]
    answers = _sglang_answers(cfg, base, sets, order, ccfg) if ccfg.backend == "sglang" else {}
    for name in order:
        prompts = sets[name]
        metas[name] = collect(
            base,
            prompts,
            _data_dir(cfg, name),
            ccfg,
            name,
            desc=f"collect {name}",
            answers=answers.get(name),
        )
    partial = {k: m for k, m in metas.items() if m.get("partial")}
    if partial:
        _record_time(cfg, f"collect worker {worker}/{num_workers}", time.time() - t0)
        return {"partial": sorted(partial), "worker": f"{worker}/{num_workers}"}
    # sum of the sets' own collection times (with parallel workers, each set's slowest), so a
    # re-run that skips finished sets keeps them
    _record_time(cfg, "collect", sum(float(m.get("seconds", 0.0)) for m in metas.values()))
    return {
        k: {
            "sequences": len(m["sequences"]),
            "tokens": m["n_tokens"],
            "answer_tokens": m["n_answer_tokens"],
            "gen_mismatches": m["gen_mismatches"],
            "skipped_too_long": m["skipped_too_long"],
            "missing_shards": m.get("missing_shards", 0),
        }
        for k, m in metas.items()
    }


def _set_done(out_dir: str) -> bool:
    p = os.path.join(out_dir, "meta.json")
    if not os.path.isfile(p):
        return False
    with open(p) as f:
        return not json.load(f).get("missing_shards")


def _sglang_answers(cfg: PipelineConfig, base, sets: dict, order: list[str], ccfg) -> dict:
    """Greedy answers of every set not yet collected, from ONE SGLang server (started here,
    stopped before the teacher-forced pass so that pass has the device to itself)."""
    import shlex

    from spexis_sglang.testing import ServerProcess
    from spexis_sglang.train.collect import read_answers, sglang_answers

    todo = [n for n in order if not _set_done(_data_dir(cfg, n))]
    out: dict = {}
    cache = {n: os.path.join(_data_dir(cfg, n), "answers.json") for n in todo}
    gen_deadline = 0.0
    if cfg.collect_deadline:
        left = cfg.collect_deadline - time.time()
        gen_deadline = cfg.collect_deadline - max(30.0, 0.3 * left)
    complete = all((read_answers(cache[n], ccfg) or {}).get("complete") for n in todo)
    if complete or (cfg.collect_deadline and time.time() >= gen_deadline):
        # nothing to generate, or no time to: the cached answers (a merge after a time-out)
        return {n: sglang_answers(base, None, sets[n], ccfg, cache[n]) for n in todo}
    t0 = time.time()
    dtype = cfg.collect_server_dtype or ("float32" if cfg.device == "cpu" else "bfloat16")
    args = ["--model-path", cfg.model_path, "--dtype", dtype]
    args += ["--random-seed", str(cfg.seed)] + shlex.split(cfg.collect_server_args)
    os.makedirs(cfg.work_dir, exist_ok=True)
    log = os.path.join(cfg.work_dir, "collect-server.log")
    # a SIGTERM (the script's time guard, `timeout`) must stop the server too: it runs in a
    # session of its own, so nothing else would
    import signal

    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = ServerProcess(args, log_path=log)
    try:
        server.wait_ready(timeout=900)
        logger.info("sglang server ready after %.0f s (log %s)", server.ready_after, log)
        # with a collect deadline, generation leaves 30% of the time left (at least 30 s) to
        # the teacher-forced pass; a set not answered in full is collected from what is
        for name in todo:
            out[name] = sglang_answers(
                base, server.base_url, sets[name], ccfg, cache[name], deadline=gen_deadline
            )
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, old)
    _record_time(cfg, "collect sglang answers (incl. server start)", time.time() - t0)
    return out


def _load(cfg: PipelineConfig, name: str, keys: tuple[str, ...] | None = None):
    from spexis_sglang.train.collect import load_collected

    path = _data_dir(cfg, name)
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise FileNotFoundError(f"{path} has not been collected; run the collect step first")
    return load_collected(path, keys)


def step_train_draft(cfg: PipelineConfig, exits: tuple[int, ...] | None = None) -> dict:
    from spexis_sglang.train.draft import DraftTrainConfig, new_draft_head, train_draft_head

    _setup(cfg)
    if cfg.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # training only; targets are already fixed
    base = base_model(cfg)
    out = {}
    for ex in exits or cfg.exits:
        t0 = time.time()
        key = _train_key(cfg, "draft", ex)
        done = _current_checkpoint(cfg, f"draft-exit{ex}.pt", key)
        if done is not None:
            out[ex] = done
            continue
        keys = (f"hidden_{ex}", "next", "final")
        train, val = _load(cfg, "train", keys), _load(cfg, "val", keys)
        head = new_draft_head(base.config, base.final_norm_weight, cfg.head_layers, cfg.seed)
        tcfg = DraftTrainConfig(
            exit_layer=ex,
            num_layers=cfg.head_layers,
            epochs=cfg.draft_epochs,
            lr=cfg.draft_lr,
            batch_tokens=cfg.batch_tokens,
            kl_weight=cfg.kl_weight,
            prompt_loss_weight=cfg.prompt_loss_weight,
            seed=cfg.seed,
            device=cfg.device,
            dtype=_train_dtype(cfg),
        )
        head, info = train_draft_head(head, train, val, base.lm_head_weight, tcfg)
        info["train_tokens"] = int(sum(m["length"] for m in train.meta))
        info["train_sequences"] = len(train)
        info["tokens_per_second"] = info["train_tokens"] * cfg.draft_epochs / info["seconds"]
        info["key"] = key
        os.makedirs(_ckpt(cfg, ""), exist_ok=True)
        torch.save(
            {"state": head.cpu().state_dict(), "num_layers": cfg.head_layers, "info": info},
            _ckpt(cfg, f"draft-exit{ex}.pt"),
        )
        _record_time(cfg, f"train-draft-exit{ex}", time.time() - t0)
        out[ex] = info
    return out


def _train_dtype(cfg: PipelineConfig) -> str:
    return cfg.train_dtype or ("float32" if cfg.device == "cpu" else "bfloat16")


def _train_key(cfg: PipelineConfig, what: str, exit_layer: int) -> str:
    """What a checkpoint depends on: the training settings and the data (a resumed ``all``
    skips a step whose checkpoint has the same key)."""
    names = {
        "draft": ("head_layers", "draft_epochs", "draft_lr", "batch_tokens", "kl_weight"),
        "length": ("length_epochs", "length_lr", "length_batch_rows", "length_features"),
    }[what]
    names += ("prompt_loss_weight", "seed", "length_output", "length_mask", "length_source")
    data = {}
    for name in ("train", "val"):
        p = os.path.join(_data_dir(cfg, name), "meta.json")
        if os.path.isfile(p):
            with open(p) as f:
                m = json.load(f)
            data[name] = [m.get("n_tokens"), m.get("n_answer_tokens"), m.get("config")]
    blob = {n: getattr(cfg, n) for n in names} | {"exit": exit_layer, "data": data}
    blob["train_dtype"] = _train_dtype(cfg) if what == "draft" else ""
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _current_checkpoint(cfg: PipelineConfig, name: str, key: str) -> dict | None:
    """The info of checkpoint ``name`` if it was trained with ``key`` (and not ``force``)."""
    path = _ckpt(cfg, name)
    if cfg.force or not os.path.isfile(path):
        return None
    info = torch.load(path, map_location="cpu").get("info", {})
    if info.get("key") != key:
        return None
    logger.info("%s is current (same settings and data); skipped (--force re-trains)", path)
    return info


def _n_layers(base) -> int:
    return int(base.config.num_hidden_layers)


def _load_head(cfg: PipelineConfig, ex: int):
    from spexis_sglang.models.draft_head import DraftHead, DraftHeadConfig

    ck = torch.load(_ckpt(cfg, f"draft-exit{ex}.pt"), map_location="cpu")
    head = DraftHead(DraftHeadConfig.from_base(base_model(cfg).config, num_layers=ck["num_layers"]))
    head.load_state_dict(ck["state"])
    return head.eval(), ck["info"]


def step_train_length(cfg: PipelineConfig) -> dict:
    from spexis_sglang.models.artifact import architecture_fields
    from spexis_sglang.models.length_predictor import LengthPredictor, LengthPredictorConfig
    from spexis_sglang.train.length import LengthTrainConfig, length_rows, train_length_predictor

    _setup(cfg)
    t0 = time.time()
    key = _train_key(cfg, "length", cfg.length_exit)
    done = _current_checkpoint(cfg, _tagged(cfg, "length.pt"), key)
    if done is not None:
        return done
    base = base_model(cfg)
    keys = (_lkey(cfg),)
    rows = length_rows(_load(cfg, "train", keys), _lkey(cfg))
    val = length_rows(_load(cfg, "val", keys), _lkey(cfg))
    torch.manual_seed(cfg.seed)
    model = LengthPredictor(
        LengthPredictorConfig(
            hidden_size=base.config.hidden_size,
            rms_norm_eps=architecture_fields(base.config)["rms_norm_eps"],
            features=tuple(cfg.length_features),
            output=cfg.length_output,
        )
    )
    model, info = train_length_predictor(
        model,
        rows,
        LengthTrainConfig(
            exit_layer=cfg.length_exit,
            epochs=cfg.length_epochs,
            lr=cfg.length_lr,
            batch_rows=cfg.length_batch_rows,
            seed=cfg.seed,
            device=cfg.device,
            pos_weight=cfg.length_pos_weight,
            mask=cfg.length_mask,
        ),
        val,
    )
    info["key"] = key
    os.makedirs(_ckpt(cfg, ""), exist_ok=True)
    torch.save(
        {
            "state": model.cpu().state_dict(),
            "info": info,
            "features": list(model.cfg.features),
            "output": model.cfg.output,
            "mask": cfg.length_mask,
        },
        _ckpt(cfg, _tagged(cfg, "length.pt")),
    )
    _record_time(cfg, _tagged(cfg, "train-length"), time.time() - t0)
    return info


def _load_length(cfg: PipelineConfig):
    from spexis_sglang.models.artifact import architecture_fields
    from spexis_sglang.models.length_predictor import LengthPredictor, LengthPredictorConfig

    ck = torch.load(_ckpt(cfg, _tagged(cfg, "length.pt")), map_location="cpu")
    cal_path = _ckpt(cfg, _tagged(cfg, "calibration.json"))
    cutoffs = None
    if os.path.isfile(cal_path):
        with open(cal_path) as f:
            cutoffs = json.load(f)["cutoffs"]
    lcfg = LengthPredictorConfig(
        hidden_size=base_model(cfg).config.hidden_size,
        rms_norm_eps=architecture_fields(base_model(cfg).config)["rms_norm_eps"],
        features=tuple(ck.get("features", ())),  # checkpoints from before features: none
        output=ck.get("output", "independent"),
    )
    if cutoffs is not None:
        lcfg.cutoffs = cutoffs
    model = LengthPredictor(lcfg)
    model.load_state_dict(ck["state"])
    return model.eval(), ck["info"]


def step_calibrate(cfg: PipelineConfig) -> dict:
    from spexis_sglang.train.length import calibrate_cutoffs, length_rows, predict_probs

    _setup(cfg)
    t0 = time.time()
    model, _ = _load_length(cfg)
    val = length_rows(_load(cfg, "val", (_lkey(cfg),)), _lkey(cfg))
    probs = predict_probs(model, val, cfg.device)
    cutoffs, stats = calibrate_cutoffs(
        probs,
        val,
        model.cfg.thresholds,
        cfg.target_precision,
        min_predicted=cfg.length_min_predicted,
        mask=cfg.length_mask,
    )
    with open(_ckpt(cfg, _tagged(cfg, "calibration.json")), "w") as f:
        json.dump(
            {
                "cutoffs": cutoffs,
                "validation": stats,
                "target_precision": cfg.target_precision,
                "mask": cfg.length_mask,
                "min_predicted": cfg.length_min_predicted,
            },
            f,
            indent=1,
        )
    _record_time(cfg, _tagged(cfg, "calibrate"), time.time() - t0)
    return {"cutoffs": cutoffs, "validation": stats}


def _views(cfg: PipelineConfig, data) -> dict:
    """{"": the data, "_cap<N>": cut to compare_cap} (the second only when it cuts)."""
    from spexis_sglang.train.collect import capped

    out = {"": data}
    if 0 < cfg.compare_cap < (data.max_new_tokens or 0):
        out[f"_cap{cfg.compare_cap}"] = capped(data, cfg.compare_cap)
    return out


def _length_quality(model, cutoffs, data, exit_layer: int, device: str, mask: str) -> list[dict]:
    """Precision / recall per threshold of a length predictor at its cutoffs on one set."""
    from spexis_sglang.train.length import length_rows, precision_recall, predict_probs

    rows = length_rows(data, exit_layer)
    probs = predict_probs(model, rows, device).numpy()
    y, known = rows.labels(model.cfg.thresholds, mask)
    return [
        {
            "threshold": t,
            **precision_recall(probs[:, k], y[:, k].numpy(), known[:, k].numpy(), cutoffs[k]),
        }
        for k, t in enumerate(model.cfg.thresholds)
    ]


def usable_eval_set(cfg: PipelineConfig, name: str, warn: bool = True) -> bool:
    """An evaluation set is scored only when collected in full and not empty: a partial one
    is a biased subset, an empty one has no tensors (run 1: KeyError 'hidden_15')."""
    p = os.path.join(_data_dir(cfg, name), "meta.json")
    why = ""
    if not os.path.isfile(p):
        why = "not collected"
    else:
        with open(p) as f:
            m = json.load(f)
        if m.get("missing_shards"):
            why = f"partial ({m['missing_shards']} of {m.get('n_shards')} shards missing)"
        elif not m.get("sequences"):
            why = "empty"
    # other_test is optional (n_other_test = 0): its absence is no news
    if why and warn and not (name in ("other_test", "user_test") and why == "not collected"):
        logger.warning("evaluation set %s is %s: skipped", name, why)
    return not why


def _eval_sets(cfg: PipelineConfig) -> dict[str, str]:
    sets = {
        "ShareGPT": "sharegpt_test",
        "SpecBench-like": "specbench",
        "ArenaHard+HumanEval": "other_test",
    }
    if cfg.data_file:
        sets = {"Your prompts": "user_test"}
    return {k: v for k, v in sets.items() if usable_eval_set(cfg, v)}


def _draft_eval_set(cfg: PipelineConfig) -> str:
    """The set draft acceptance is reported on (per category)."""
    return "user_test" if cfg.data_file else "specbench"


def step_evaluate(cfg: PipelineConfig) -> dict:
    from spexis_sglang.train.draft import draft_predictions, new_draft_head
    from spexis_sglang.train.length import length_rows, precision_recall, predict_probs
    from spexis_sglang.train.report import (
        acceptance_by_category,
        choose_alpha_for,
        rank_profile,
        write_report,
    )

    _setup(cfg)
    t0 = time.time()
    base = base_model(cfg)
    n_layers = base.config.num_hidden_layers
    results: dict = {
        "base_model": cfg.model_id,
        "model_short": cfg.model_id,
        "draft": {},
        "notes": list(cfg.notes),
    }
    if not getattr(base.tokenizer, "chat_template", None):
        results["notes"].append(
            "no chat template: prompts went to the model as the turns' text joined by blank lines"
        )
    eval_keys = tuple(f"hidden_{e}" for e in sorted(set(cfg.exits) | {cfg.length_exit}))
    eval_keys += ("next", _lkey(cfg))
    eval_sets = _eval_sets(cfg)
    main = _draft_eval_set(cfg)
    spec = _load(cfg, main, eval_keys) if main in eval_sets.values() else None
    for ex in cfg.exits if spec is not None else ():
        head, info = _load_head(cfg, ex)
        pred = draft_predictions(head, spec, ex, base.lm_head_weight, cfg.device)
        lens = new_draft_head(base.config, base.final_norm_weight, cfg.head_layers, cfg.seed)
        lens_pred = draft_predictions(lens, spec, ex, base.lm_head_weight, cfg.device)
        prof = rank_profile(
            pred["confidence"].numpy(),
            pred["accept"].numpy().astype(float),
            cfg.rank_batch,
            seed=cfg.seed,
        )
        stages = next(
            (n for n in cfg.pp_sizes if stage0_layers(n_layers, n) == ex),
            max(2, round(n_layers / ex)),
        )
        frac = {2: "1/2", 4: "1/4"}.get(stages, f"1/{stages}")
        capped_acc = {
            f"acceptance{suffix}": acceptance_by_category(
                draft_predictions(head, view, ex, base.lm_head_weight, cfg.device), view.meta
            )
            for suffix, view in _views(cfg, spec).items()
            if suffix
        }
        results["draft"][f"exit{ex}"] = {
            **capped_acc,
            "exit_layer": ex,
            "exit_fraction": frac,
            "acceptance": acceptance_by_category(pred, spec.meta),
            "logit_lens": acceptance_by_category(lens_pred, spec.meta),
            "rank_profile": prof,
            "alpha": choose_alpha_for(prof["acceptance"], stages, cfg.rank_batch),
            "mean_confidence": float(pred["confidence"].mean()),
            "training": {k: v for k, v in info.items() if k != "history"}
            | {"history": info.get("history")},
        }
        logger.info(
            "exit %d: acceptance %s", ex, results["draft"][f"exit{ex}"]["acceptance"]["avg"]
        )
    # length predictor
    model, linfo = _load_length(cfg)
    with open(_ckpt(cfg, _tagged(cfg, "calibration.json"))) as f:
        cal = json.load(f)
    lp = {
        "exit_layer": cfg.length_exit,
        "input": _lkey(cfg),
        "thresholds": list(model.cfg.thresholds),
        "cutoffs": cal["cutoffs"],
        "target_precision": cal["target_precision"],
        "validation": cal["validation"],
        "features": list(model.cfg.features),
        "output": model.cfg.output,
        "mask": cal.get("mask", "known"),
        "eval": {},
        "eval_known_mask": {},
        "training": {k: v for k, v in linfo.items() if k != "history"},
    }
    for label, name in eval_sets.items():
        data = spec if name == main else _load(cfg, name, (_lkey(cfg),))
        rows = length_rows(data, _lkey(cfg))
        probs = predict_probs(model, rows, cfg.device).numpy()
        for key, mask in (("eval", lp["mask"]), ("eval_known_mask", "known")):
            y, known = rows.labels(model.cfg.thresholds, mask)
            lp[key][label] = [
                {
                    "threshold": t,
                    **precision_recall(
                        probs[:, k], y[:, k].numpy(), known[:, k].numpy(), cal["cutoffs"][k]
                    ),
                }
                for k, t in enumerate(model.cfg.thresholds)
            ]
        for suffix, view in _views(cfg, data).items():
            if suffix:
                lp.setdefault(f"eval{suffix}", {})[label] = _length_quality(
                    model, cal["cutoffs"], view, _lkey(cfg), cfg.device, lp["mask"]
                )
    results["length"] = lp
    timings = {}
    if os.path.isfile(_timings_path(cfg)):
        with open(_timings_path(cfg)) as f:
            timings = json.load(f)
    timings["evaluate"] = time.time() - t0
    results["timings"] = timings
    results["data"] = _data_summary(cfg)
    results["run"] = {
        "preset": cfg.preset,
        "device": cfg.device,
        "seed": cfg.seed,
        "command": cfg.command,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("notes",)},
    }
    paths = write_report(results, cfg.results_dir, cfg.results_stem)
    with open(os.path.join(cfg.work_dir, _tagged(cfg, "evaluation.json")), "w") as f:
        json.dump(results, f, indent=1)
    _record_time(cfg, _tagged(cfg, "evaluate"), time.time() - t0)
    logger.info("wrote %s", paths)
    return results


def _data_summary(cfg: PipelineConfig) -> dict:
    out = {}
    for name in ("train", "val", "sharegpt_test", "specbench", "other_test", "user_test"):
        p = os.path.join(_data_dir(cfg, name), "meta.json")
        if os.path.isfile(p):
            with open(p) as f:
                m = json.load(f)
            fin = sum(s["finished"] for s in m["sequences"])
            miss = m.get("missing_shards", 0)
            out[name] = (
                (f"PARTIAL ({miss} of {m['n_shards']} shards missing): " if miss else "")
                + f"{len(m['sequences'])} sequences, {m['n_tokens']} tokens "
                f"({m['n_answer_tokens']} answer), "
                f"{fin} ended with EOS, "
                f"{m['gen_mismatches']} generate/teacher-forced greedy mismatches, "
                f"{m['skipped_too_long']} prompts skipped as too long"
                + (
                    f", {m['not_answered']} not answered by the generation deadline"
                    if m.get("not_answered")
                    else ""
                )
            )
    return out


def step_export(cfg: PipelineConfig) -> dict:
    from spexis_sglang.models.draft_head import load_draft_head, save_draft_head
    from spexis_sglang.models.length_predictor import load_length_predictor, save_length_predictor

    base = base_model(cfg)
    ev_path = os.path.join(cfg.work_dir, _tagged(cfg, "evaluation.json"))
    ev = {}
    if os.path.isfile(ev_path):
        with open(ev_path) as f:
            ev = json.load(f)
    from spexis_sglang.models.artifact import weights_fingerprint

    provenance = {
        "preset": cfg.preset,
        "seed": cfg.seed,
        "command": cfg.command,
        "exported": time.strftime("%Y-%m-%d"),
    }
    weights_hash = weights_fingerprint(cfg.model_path)
    report = os.path.join(cfg.results_dir, f"{cfg.results_stem}.md")
    # where the report lies, relative to the artifact directory (it travels with it)
    report = os.path.relpath(report, cfg.artifact_dir) if os.path.isfile(report) else None
    written = {}
    for ex in cfg.exits:
        head, info = _load_head(cfg, ex)
        d = os.path.join(cfg.artifact_dir, f"draft-exit{ex}")
        acc = ev.get("draft", {}).get(f"exit{ex}", {})
        meta = {
            "training": {
                k: info.get(k)
                for k in ("best_val_acceptance", "steps", "train_tokens", "train_sequences")
            },
            "acceptance": {k: v["acceptance"] for k, v in acc.get("acceptance", {}).items()},
            "alpha": (
                {k: acc.get("alpha", {}).get(k, {}).get("alpha") for k in ("affine", "flat")}
                if acc
                else {}
            ),
            "provenance": provenance,
            "pp_sizes": [n for n in cfg.pp_sizes if stage0_layers(_n_layers(base), n) == ex],
            "report": report,
        }
        save_draft_head(d, head, base.config, cfg.model_id, ex, torch.float16, meta, weights_hash)
        load_draft_head(d, base.config, exit_layer=ex)  # round trip check
        written[f"draft-exit{ex}"] = d
    if cfg.length_source == "final":
        # serving has no final hidden state at the exit: the ceiling variant is not shipped
        logger.warning("length_source final: the ceiling variant is evaluated, not exported")
        return written
    model, _ = _load_length(cfg)
    d = os.path.join(cfg.artifact_dir, "length")
    lp = ev.get("length", {})
    meta = {
        "validation": lp.get("validation"),
        "precision": [s.get("precision") for s in lp.get("validation", [])],
        "recall": [s.get("recall") for s in lp.get("validation", [])],
        "target_precision": cfg.target_precision,
        "label_mask": lp.get("mask", cfg.length_mask),
        "provenance": provenance,
        "report": report,
    }
    save_length_predictor(
        d, model, base.config, cfg.model_id, cfg.length_exit, torch.float16, meta, weights_hash
    )
    load_length_predictor(d, base.config, exit_layer=cfg.length_exit)
    written["length"] = d
    sums = []
    for name, d in sorted(written.items()):
        for fn in ("config.json", "model.safetensors"):
            with open(os.path.join(d, fn), "rb") as f:
                sums.append(f"{hashlib.sha256(f.read()).hexdigest()}  {name}/{fn}")
    with open(os.path.join(cfg.artifact_dir, "SHA256SUMS"), "w") as f:
        f.write("\n".join(sums) + "\n")
    logger.info("exported %s", written)
    return written


def step_check_artifacts(cfg: PipelineConfig) -> dict:
    """Evaluate the artifacts in ``artifact_dir`` (through the public loaders) on this run's data.

    A cross-check that exported weights work on hidden states computed elsewhere (e.g. the
    shipped, GPU-trained heads on data collected on this CPU).
    """
    from spexis_sglang.models.draft_head import load_draft_head
    from spexis_sglang.models.length_predictor import load_length_predictor
    from spexis_sglang.train.draft import draft_predictions
    from spexis_sglang.train.length import length_rows, precision_recall, predict_probs
    from spexis_sglang.train.report import acceptance_by_category

    _setup(cfg)
    base = base_model(cfg)
    keys = tuple(f"hidden_{e}" for e in sorted(set(cfg.exits) | {cfg.length_exit})) + ("next",)
    eval_sets = _eval_sets(cfg)
    spec = _load(cfg, "specbench", keys) if "specbench" in eval_sets.values() else None
    out: dict = {"artifact_dir": cfg.artifact_dir, "data": _data_summary(cfg).get("specbench")}
    for ex in cfg.exits if spec is not None else ():
        head, _ = load_draft_head(
            os.path.join(cfg.artifact_dir, f"draft-exit{ex}"), base.config, exit_layer=ex
        )
        for suffix, view in _views(cfg, spec).items():
            pred = draft_predictions(head, view, ex, base.lm_head_weight, cfg.device)
            out[f"draft-exit{ex}{suffix}"] = acceptance_by_category(pred, view.meta)
    lp, lcfg = load_length_predictor(
        os.path.join(cfg.artifact_dir, "length"), base.config, exit_layer=cfg.length_exit
    )
    if spec is not None:
        rows = length_rows(spec, cfg.length_exit)
        probs = predict_probs(lp, rows, cfg.device).numpy()
        y, known = rows.labels(lp.cfg.thresholds)
        out["length"] = [
            {
                "threshold": t,
                **precision_recall(
                    probs[:, k], y[:, k].numpy(), known[:, k].numpy(), lp.cfg.cutoffs[k]
                ),
            }
            for k, t in enumerate(lp.cfg.thresholds)
        ]
    # every evaluation set, on the label mask this run's predictors are evaluated with
    out["length_features"] = list(lp.cfg.features)
    out["length_eval"] = {}
    for label, name in eval_sets.items():
        data = spec if name == "specbench" else _load(cfg, name, (f"hidden_{cfg.length_exit}",))
        for suffix, view in _views(cfg, data).items():
            out["length_eval"].setdefault(f"eval{suffix}", {})[label] = _length_quality(
                lp, lp.cfg.cutoffs, view, cfg.length_exit, cfg.device, cfg.length_mask
            )
    with open(os.path.join(cfg.work_dir, "artifact_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def step_compare(cfg: PipelineConfig) -> dict:
    """New vs shipped, one report (``<stem>_compare.{json,md}``): draft acceptance per category
    (this run's heads vs the shipped ones, evaluated on the same data) and length
    precision / recall per threshold for the shipped predictor and every variant trained here
    (``evaluation[-tag].json``), so that what to ship can be decided from one table."""
    from spexis_sglang.train.report import write_compare

    def read(name):
        path = os.path.join(cfg.work_dir, name)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    shipped = read("artifact_check.json")
    if shipped is None:
        raise FileNotFoundError("run check-artifacts (the shipped artifacts on this data) first")
    variants = {}
    for fn in sorted(os.listdir(cfg.work_dir)):
        if fn.startswith("evaluation") and fn.endswith(".json"):
            tag = fn[len("evaluation") : -len(".json")].lstrip("-") or "hidden"
            variants[tag] = read(fn)
    if not variants:
        raise FileNotFoundError("run evaluate first")
    variants = dict(sorted(variants.items(), key=lambda kv: kv[0] != "hidden"))
    out = {
        "preset": cfg.preset,
        "compare_cap": cfg.compare_cap,
        "max_new_tokens": cfg.max_new_tokens,
        "shipped": shipped,
        "new": variants,
        "data": _data_summary(cfg),
        "target_recall": 0.40,
        "target_precision": cfg.target_precision,
        "target_acceptance": 0.70,
    }
    timings = read("timings.json")
    if timings:
        out["timings"] = timings
    paths = write_compare(out, cfg.results_dir, f"{cfg.results_stem}_compare")
    logger.info("wrote %s", paths)
    return {"paths": paths}


def step_all(cfg: PipelineConfig) -> dict:
    t0 = time.time()
    out = {"collect": step_collect(cfg)}
    out["train-draft"] = step_train_draft(cfg)
    out["train-length"] = step_train_length(cfg)
    out["calibrate"] = step_calibrate(cfg)
    _record_time(cfg, "all (before evaluate)", time.time() - t0)
    out["evaluate"] = step_evaluate(cfg)
    out["export"] = step_export(cfg)
    return out


def command_line() -> str:
    return "python -m spexis_sglang.train " + " ".join(sys.argv[1:])
