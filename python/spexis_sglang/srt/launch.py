"""The launcher behind ``python -m spexis_sglang.launch_server``: SGLang's server with Spexis'
scheduler hooks.

Accepts every SGLang server argument. Without ``--model-path`` it serves the bundled default
model (converted on first use) under the name ``smollm2-135m-instruct``. On a machine without
CUDA it turns on SGLang's CPU engine and picks defaults that work there (CPU device,
torch-native attention, PyTorch sampling, no CUDA graphs, a bounded KV pool, sleeping when
idle); any of them can be overridden on the command line. Every server it starts bounds what
one request may ask (``--spexis-max-n``, ``--spexis-max-request-sequences``) and how many
requests may wait (``--max-queued-requests``, default 1024), and answers an unknown model name
with 404 (see ``docs/limits-and-errors.md``). :func:`draft_head_main` is
``python -m spexis_sglang.draft_head_server``'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import List, Optional, Tuple

from spexis_sglang.core.online_alpha import (
    AUTO_ALPHA_EXPLORE,
    AUTO_ALPHA_INITIAL,
    AUTO_ALPHA_INTERVAL,
    FIXED_ALPHA_OBSERVE_EVERY,
)
from spexis_sglang.srt.config import RANDOM_HEAD_PREFIX, random_head_seed
from spexis_sglang.srt.request_checks import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_SEQUENCES,
)

logger = logging.getLogger(__name__)

PROG = "python -m spexis_sglang.launch_server"

# Defaults that let SGLang 0.5.17 serve on CPU; each is added only if the user did not set it.
CPU_DEFAULTS: List[Tuple[str, Optional[str]]] = [
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--sampling-backend", "pytorch"),
    # CUDA graphs off (SGLang's own --disable-cuda-graph is deprecated in 0.5.17)
    ("--disable-decode-cuda-graph", None),
    ("--disable-prefill-cuda-graph", None),
    ("--max-total-tokens", "8192"),
    ("--sleep-on-idle", None),
]

# Defaults on every server the launcher starts, each only if the user did not set it: a
# bounded waiting queue (beyond it SGLang answers 503, with our Retry-After)
SERVER_DEFAULTS: List[Tuple[str, Optional[str]]] = [
    ("--max-queued-requests", str(DEFAULT_MAX_QUEUED_REQUESTS)),
]

_MODEL_FLAGS = ("--model-path", "--model")
# the flags that turn CUDA graphs off; given any, the CPU defaults add none of them
_GRAPH_OFF_FLAGS = (
    "--disable-cuda-graph",
    "--disable-decode-cuda-graph",
    "--disable-prefill-cuda-graph",
    "--cuda-graph-backend-decode",
    "--cuda-graph-backend-prefill",
)
# the flags that size SGLang's decode CUDA graphs; without any, SP sizes them (see below)
_GRAPH_SIZE_FLAGS = (
    "--cuda-graph-max-bs",
    "--cuda-graph-max-bs-decode",
    "--cuda-graph-bs",
    "--cuda-graph-bs-decode",
    "--cuda-graph-config",
)
# SP decode graphs are captured up to pp_size x SGLang's default, at most this many rows
SP_GRAPH_MAX_BS_CAP = 1024


class LaunchError(ValueError):
    """A bad command line, reported before any process is started."""


def _flag_value(argv: List[str], names: Tuple[str, ...]) -> Tuple[bool, Optional[str]]:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name:
                return True, argv[i + 1] if i + 1 < len(argv) else None
            if arg.startswith(name + "="):
                return True, arg.split("=", 1)[1]
    return False, None


def _has_flag(argv: List[str], name: str) -> bool:
    return _flag_value(argv, (name,))[0]


def check_model_path(path: Optional[str]) -> None:
    """Fail fast on a model path that cannot be served, before any process is spawned."""
    if path is None or path == "":
        raise LaunchError("--model-path needs a value")
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise LaunchError(
                f"--model-path {path!r} is a directory but holds no config.json: "
                "it is not a Hugging Face model directory"
            )
        return
    if os.path.exists(expanded):
        raise LaunchError(f"--model-path {path!r} is a file, not a model directory")
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    looks_local = path.startswith(("/", "./", "../", "~")) or path.count("/") != 1
    if offline or looks_local:
        raise LaunchError(
            f"--model-path {path!r}: no such model directory"
            + (" (the model hub is offline here: HF_HUB_OFFLINE=1)" if offline else "")
        )


def build_parser() -> argparse.ArgumentParser:
    """SGLang's own server arguments plus Spexis' ``--spexis-*`` group (for ``--help``)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="SGLang server with Spexis (speculative parallelism). "
        "All SGLang server arguments are accepted; --model-path defaults to the bundled "
        "SmolLM2-135M-Instruct.",
    )
    ServerArgs.add_cli_args(parser)
    extra_help = {
        "--model-path": " Default: the bundled SmolLM2-135M-Instruct.",
        "--served-model-name": " Default here for the bundled model: 'smollm2-135m-instruct'.",
        "--max-queued-requests": f" Default here: {DEFAULT_MAX_QUEUED_REQUESTS}; a request "
        "arriving at a full queue answers 503 with Retry-After.",
    }
    for action in parser._actions:
        for flag, text in extra_help.items():
            if flag in action.option_strings:
                action.help = (action.help or "") + text
        if "--model-path" in action.option_strings:
            action.required = False
    add_spexis_args(parser)
    return parser


def add_spexis_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``--spexis-*`` flags; each arrives with the feature that uses it."""
    group = parser.add_argument_group("Spexis (speculative parallelism)")
    group.add_argument(
        "--spexis-draft-head",
        default=None,
        metavar="DIR|bundled|random:SEED",
        help="Turn on speculative parallelism (needs --pp-size >= 2) with this early-exit "
        "draft head on stage 0: an artifact directory, 'bundled' (the head shipped for the "
        "default model at stage 0's depth), or 'random:SEED' (untrained, for tests and "
        "throughput runs). Default: off, plain SGLang. Works with --dp-size (one SP pipeline "
        "per replica) and --page-size. On a GPU, decode CUDA graphs are captured up to "
        "pp-size x SGLang's default batch (at most 1024; SP runs every running request in "
        "each decode batch), which costs start-up time and GPU memory; --cuda-graph-max-bs "
        "sets the limit. Refused with --pp-async-batch-depth > 0 (no gain: under "
        "SP a depth lengthens the verification loop and costs more committed tokens per row "
        "than the wait it could hide) and with --scheduler-recv-interval > 1 (the later "
        "stages must read stage 0's plan in the iteration it was made for). With "
        "--enable-mixed-chunk the running requests' SP rows ride along each prefill chunk "
        "(requests that return logprobs, use a grammar or penalties keep chunks unmixed).",
    )
    group.add_argument(
        "--spexis-alpha",
        default="0",
        metavar="ALPHA|auto",
        help="Selective speculation: fraction of drafts with the lowest confidence dropped "
        "each iteration, in [0, 1] (1: stock PP's schedule, each request one row every "
        "pp-size iterations, on the draft of its row in transit, which the device redoes "
        "where that draft is rejected, in pp-size micro-batches), or 'auto': stage 0 measures acceptance by confidence rank "
        "and iteration time against rows while serving, and re-chooses alpha with the cost "
        "model every --spexis-alpha-interval iterations, up to 1 where a stage's time grows "
        "in proportion to its rows and speculation cannot pay (every draft dropped: SP runs "
        f"like PP; starting at {AUTO_ALPHA_INITIAL}; "
        "every --spexis-alpha-explore-th iteration drops nothing, so the ranks it would drop "
        "are still measured). The alpha in force is in /server_info, the log line and the "
        "spexis:alpha metric. Default: 0.",
    )
    group.add_argument(
        "--spexis-alpha-interval",
        type=int,
        default=None,
        metavar="K",
        help=f"With --spexis-alpha auto: decode iterations between choices. Default: "
        f"{AUTO_ALPHA_INTERVAL}.",
    )
    group.add_argument(
        "--spexis-alpha-explore",
        type=int,
        default=None,
        metavar="E",
        help="With --spexis-alpha auto: every E-th decode iteration runs at alpha 0 (0 turns "
        "exploration off; the dropped ranks' acceptance is then never re-measured). Default: "
        f"{AUTO_ALPHA_EXPLORE}.",
    )
    group.add_argument(
        "--spexis-alpha-observe",
        type=int,
        default=None,
        metavar="K",
        help="With a fixed --spexis-alpha: stage 0 still measures what 'auto' would choose "
        "(/server_info spexis_alpha.recommended_alpha), on every K-th decode iteration, each "
        "weighted K times (the drops do not depend on it; measuring every iteration costs "
        "~0.1-0.2 ms of stage 0's CPU per iteration at 256 rows). 1: every iteration. "
        f"Default: {FIXED_ALPHA_OBSERVE_EVERY}.",
    )
    group.add_argument(
        "--spexis-benchmark-force-accept",
        type=float,
        default=None,
        metavar="THETA",
        help="BENCHMARK ONLY: verification accepts each draft with probability THETA "
        "instead of comparing it with the model's token, for throughput runs on models with "
        "random weights. Outputs are then not the model's; every output token carries the "
        "meta_info label 'spexis_benchmark_forced_acceptance'. Needs --load-format dummy.",
    )
    group.add_argument(
        "--spexis-benchmark-length-oracle",
        default=None,
        metavar="PRESET|P/R|P/R,...",
        help="BENCHMARK ONLY: stage 0's remaining-length buckets come from the true remaining "
        "length (known for requests with ignore_eos: they end at max_new_tokens) degraded to a "
        "stated precision P and recall R per threshold (4, 8, 16, 32, 64), instead of a "
        "length predictor; for measuring --spexis-lookahead-admission on models with random "
        "weights. PRESET: 'ours' (the shipped predictor's calibration), 'paper-l70' / "
        "'paper-q32' (the paper's Table 4, ShareGPT), 'perfect'; or P/R for every threshold; "
        "or five P/R pairs. Requests without ignore_eos (or with stop strings or a grammar) get "
        "no prediction. Labelled in the log, /server_info "
        "('spexis_benchmark_length_oracle') and the spexis:benchmark_mode metric. Needs "
        "--load-format dummy; replaces --spexis-length-predictor.",
    )
    group.add_argument(
        "--spexis-log-interval",
        type=float,
        default=10.0,
        help="Seconds between Spexis statistics log lines (acceptance, effective batch, "
        "row kinds); 0 turns them off. Default: 10.",
    )
    group.add_argument(
        "--spexis-length-predictor",
        default=None,
        metavar="DIR|bundled",
        help="Remaining-length predictor run on stage 0's exit hidden state (§5.2): an "
        "artifact directory or 'bundled' (the one shipped for the default model). Needs "
        "--spexis-draft-head. Default: off.",
    )
    group.add_argument(
        "--spexis-lookahead-admission",
        action="store_true",
        help="Look-ahead admission (§5.2, Algorithm 1): stage 0 decides each iteration how "
        "many waiting requests to admit, in place of SGLang's reservation (which reserves "
        "future tokens as if no running request ever finished). The count is what the KV "
        "pool allows with each running request's release bounded by its max_new_tokens and "
        "its predicted remaining length, so requests may be admitted earlier than SGLang "
        "would; the look-ahead projection over the next 64 iterations and the gain G hold "
        "them back when an eviction looms. Retraction stays the safety net. Needs "
        "--spexis-length-predictor (or, benchmark only, --spexis-benchmark-length-oracle).",
    )
    group.add_argument(
        "--spexis-admission-pdr",
        type=float,
        default=2.0,
        metavar="RATIO",
        help="Prefill-to-decode latency ratio used by look-ahead admission's gain G "
        "(t_prefill / t_decode of one iteration). Default: 2.",
    )
    group.add_argument(
        "--spexis-no-grammar-draft-mask",
        dest="spexis_grammar_draft_mask",
        action="store_false",
        help="Constrained decoding (regex, JSON schema, EBNF, structural tags): let stage 0's "
        "draft head draft tokens the request's grammar forbids (they are always rejected). "
        "Default: drafts are masked with the grammar, in eager forwards (every CPU forward; "
        "a GPU's decode CUDA graphs replay the head unmasked).",
    )
    group.add_argument(
        "--spexis-max-n",
        type=int,
        default=DEFAULT_MAX_N,
        metavar="N",
        help="Every server: the largest n (parallel samples of one prompt) a request may ask "
        "for; more answers 400 before anything is queued. Default: "
        f"{DEFAULT_MAX_N} (OpenAI's limit).",
    )
    group.add_argument(
        "--spexis-max-request-sequences",
        type=int,
        default=DEFAULT_MAX_REQUEST_SEQUENCES,
        metavar="N",
        help="Every server: the most sequences (prompts x n) one request may fan out to; more "
        "answers 400. At most --max-queued-requests (a larger request could never be queued "
        f"whole). Default: {DEFAULT_MAX_REQUEST_SEQUENCES}. The launcher also sets SGLang's "
        f"--max-queued-requests to {DEFAULT_MAX_QUEUED_REQUESTS} unless given: a request "
        "arriving at a full waiting queue answers 503 with Retry-After.",
    )
    group.add_argument(
        "--spexis-accept-any-model",
        action="store_true",
        help='Every server: the OpenAI routes accept any "model" name (SGLang\'s behaviour). '
        "Default: only the served name (--served-model-name; the bundled model is served as "
        "'smollm2-135m-instruct'), the --model-path, and 'default' are accepted; another name "
        "answers 404 model_not_found, as OpenAI's API does.",
    )
    group.add_argument(
        "--spexis-float64",
        action="store_true",
        help="TEST MODE, CPU only, with or without speculation: weights, activations and KV "
        "cache in float64 (SGLang's default, --dtype auto, serves float32 checkpoints in "
        "float16). Batch composition then moves a row's top-2 logit gap by ~1e-13 instead of "
        "up to ~0.1, so greedy outputs of differently batched servers agree (the equality "
        "tests use it).",
    )
    return group


def spexis_config_from_args(args: argparse.Namespace, server_args) -> "SpexisConfig":
    """Validate the Spexis flags against SGLang's resolved arguments; raise LaunchError."""
    from spexis_sglang.srt.config import SpexisConfig

    head = args.spexis_draft_head
    alpha, alpha_auto = parse_alpha(args.spexis_alpha)
    interval, explore = args.spexis_alpha_interval, args.spexis_alpha_explore
    if not alpha_auto and (interval is not None or explore is not None):
        raise LaunchError(
            "--spexis-alpha-interval and --spexis-alpha-explore need --spexis-alpha auto"
        )
    observe = args.spexis_alpha_observe
    if alpha_auto and observe is not None:
        raise LaunchError("--spexis-alpha-observe needs a fixed --spexis-alpha (auto observes all)")
    observe = FIXED_ALPHA_OBSERVE_EVERY if observe is None else observe
    if observe < 1:
        raise LaunchError(f"--spexis-alpha-observe must be >= 1, got {observe}")
    interval = AUTO_ALPHA_INTERVAL if interval is None else interval
    explore = AUTO_ALPHA_EXPLORE if explore is None else explore
    if interval < 1:
        raise LaunchError(f"--spexis-alpha-interval must be >= 1, got {interval}")
    if explore < 0:
        raise LaunchError(f"--spexis-alpha-explore must be >= 0, got {explore}")
    if args.spexis_log_interval < 0:
        raise LaunchError("--spexis-log-interval must be >= 0")
    oracle_spec = args.spexis_benchmark_length_oracle
    if (
        args.spexis_lookahead_admission
        and args.spexis_length_predictor is None
        and oracle_spec is None
    ):
        raise LaunchError(
            "--spexis-lookahead-admission needs --spexis-length-predictor (or, benchmark only, "
            "--spexis-benchmark-length-oracle)"
        )
    if oracle_spec is not None and args.spexis_length_predictor is not None:
        raise LaunchError(
            "--spexis-benchmark-length-oracle replaces the length predictor's buckets: give "
            "--spexis-length-predictor or the oracle, not both"
        )
    if not args.spexis_admission_pdr > 0:
        raise LaunchError(f"--spexis-admission-pdr must be > 0, got {args.spexis_admission_pdr}")
    limits = request_limits_from_args(args, server_args)
    if args.spexis_float64 and server_args.device != "cpu":
        raise LaunchError(
            f"--spexis-float64 is a CPU test mode (got --device {server_args.device})"
        )
    if head is None:
        if alpha or alpha_auto:
            raise LaunchError("--spexis-alpha needs --spexis-draft-head (speculation is off)")
        if args.spexis_benchmark_force_accept is not None:
            raise LaunchError("--spexis-benchmark-force-accept needs --spexis-draft-head")
        if oracle_spec is not None:
            raise LaunchError(
                "--spexis-benchmark-length-oracle needs --spexis-draft-head (its buckets feed "
                "SP's look-ahead admission on stage 0)"
            )
        if args.spexis_length_predictor is not None:
            raise LaunchError(
                "--spexis-length-predictor needs --spexis-draft-head (it runs beside the "
                "draft head on stage 0)"
            )
        return SpexisConfig(
            log_interval=args.spexis_log_interval, float64=args.spexis_float64, **limits
        )
    if server_args.pp_size < 2:
        raise LaunchError(
            "--spexis-draft-head needs --pp-size >= 2: speculative parallelism runs the "
            f"draft head on the first of several pipeline stages (got --pp-size {server_args.pp_size})"
        )
    if server_args.pp_async_batch_depth:
        raise LaunchError(
            "--spexis-draft-head needs --pp-async-batch-depth 0 (got "
            f"{server_args.pp_async_batch_depth}): stock PP processes a micro-batch's result D "
            "iterations later so that stage 0 need not wait for it; under SP that result "
            "verifies drafts, so a depth D lengthens SP's verification loop from N to N + D "
            "iterations: N + D - 1 unverified drafts per request and fewer tokens committed per "
            "row (Eq. 2, 1 / (N + D - theta (N + D - 1)): N=2, theta=0.6 gives 0.71 at D=0 and "
            "0.56 at D=1), more than the wait it could hide (stage 0 waits 10-24% of its loop "
            "in the H200 runs); it did not speed up stock PP=2 on CPU either (0.90x, "
            "benchmark/results/cpu_pp_async_depth.json)"
        )
    if server_args.scheduler_recv_interval > 1:
        raise LaunchError(
            "--spexis-draft-head needs --scheduler-recv-interval 1 (got "
            f"{server_args.scheduler_recv_interval}): SGLang's receive skipper reads requests "
            "only every K-th iteration, but under SP the later stages read stage 0's plan "
            "(admissions, dropped drafts) with the requests in the iteration it was made for"
        )
    if head == "bundled":
        from spexis_sglang.srt.bundled import BundledHeadError, bundled_draft_head

        try:
            head = bundled_draft_head(server_args.model_path, server_args.pp_size)
        except BundledHeadError as e:
            raise LaunchError(f"--spexis-draft-head bundled: {e}") from None
        # the shipped files too (a clone with git-lfs pointers or a damaged install)
        _check_stage0_artifact(head, server_args, "draft_head", "--spexis-draft-head bundled")
    elif head.startswith(RANDOM_HEAD_PREFIX):
        try:
            random_head_seed(head)
        except ValueError:
            raise LaunchError(f"--spexis-draft-head {head!r}: expected random:<integer seed>")
    else:
        path = _artifact_dir(head, f"--spexis-draft-head {head!r}")
        check_draft_head_artifact(path, server_args)
        head = path
    theta = args.spexis_benchmark_force_accept
    if theta is not None:
        if not 0.0 <= theta <= 1.0:
            raise LaunchError(f"--spexis-benchmark-force-accept must be in [0, 1], got {theta}")
        if server_args.load_format != "dummy":
            raise LaunchError(
                "--spexis-benchmark-force-accept makes outputs that are not the model's; it is "
                "refused unless the weights are random anyway (--load-format dummy)"
            )
    predictor = args.spexis_length_predictor
    if predictor is not None:
        predictor = resolve_length_predictor(predictor, server_args)
    oracle = None
    if oracle_spec is not None:
        oracle = resolve_length_oracle(oracle_spec, server_args)
    return SpexisConfig(
        draft_head=head,
        alpha=alpha,
        alpha_auto=alpha_auto,
        alpha_interval=interval,
        alpha_explore=explore,
        alpha_observe=observe,
        force_accept=theta,
        log_interval=args.spexis_log_interval,
        length_predictor=predictor,
        length_oracle=oracle,
        lookahead_admission=args.spexis_lookahead_admission,
        admission_pdr=args.spexis_admission_pdr,
        float64=args.spexis_float64,
        grammar_draft_mask=args.spexis_grammar_draft_mask,
        **limits,
    )


def request_limits_from_args(args: argparse.Namespace, server_args) -> dict:
    """The request limits (``SpexisConfig`` fields) every server applies."""
    if args.spexis_max_n < 1:
        raise LaunchError(f"--spexis-max-n must be >= 1, got {args.spexis_max_n}")
    sequences = args.spexis_max_request_sequences
    if sequences < 1:
        raise LaunchError(f"--spexis-max-request-sequences must be >= 1, got {sequences}")
    queued = server_args.max_queued_requests
    if queued is not None and queued < 1:
        raise LaunchError(f"--max-queued-requests must be >= 1, got {queued}")
    if queued is not None and sequences > queued:
        logger.info(
            "--spexis-max-request-sequences %d is above --max-queued-requests %d: "
            "one request may fan out to %d sequences",
            sequences,
            queued,
            queued,
        )
        sequences = queued
    return {
        "max_n": args.spexis_max_n,
        "max_request_sequences": sequences,
        "accept_any_model": args.spexis_accept_any_model,
    }


def resolve_length_oracle(spec: str, server_args) -> dict:
    """``--spexis-benchmark-length-oracle``: the target quality, benchmark servers only."""
    from spexis_sglang.core.length_oracle import PRESET_NAMES, OracleSpecError
    from spexis_sglang.srt.sp_length_oracle import resolve_oracle_quality

    if server_args.load_format != "dummy":
        raise LaunchError(
            "--spexis-benchmark-length-oracle reads the true output lengths to fake the "
            "length predictor; it is refused unless the weights are random anyway "
            "(--load-format dummy)"
        )
    try:
        return resolve_oracle_quality(spec).as_dict()
    except OracleSpecError as e:
        raise LaunchError(f"--spexis-benchmark-length-oracle {spec!r}: {e}") from None
    except (OSError, KeyError, ValueError) as e:
        raise LaunchError(
            f"--spexis-benchmark-length-oracle {spec!r}: unreadable calibration ({e}); "
            f"presets: {', '.join(PRESET_NAMES)}"
        ) from None


def parse_alpha(value: str) -> Tuple[float, bool]:
    """``--spexis-alpha``: ``(alpha, auto)``; a number in [0, 1] or ``auto``."""
    text = str(value).strip()
    if text.lower() == "auto":
        return 0.0, True
    try:
        alpha = float(text)
    except ValueError:
        alpha = float("nan")
    if not 0.0 <= alpha <= 1.0:  # NaN fails too
        raise LaunchError(f"--spexis-alpha must be a number in [0, 1] or 'auto', got {value!r}")
    return alpha, False


def _artifact_dir(value: str, where: str) -> str:
    """An artifact directory given on the command line: absolute, with both of its files."""
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.isdir(path):
        raise LaunchError(f"{where}: no such artifact directory")
    for name in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(path, name)):
            raise LaunchError(f"{where}: {name} is missing")
    return path


def resolve_length_predictor(value: str, server_args) -> str:
    """The predictor's artifact directory, checked against the model and stage 0's depth."""
    where = f"--spexis-length-predictor {value}"
    if value == "bundled":
        from spexis_sglang.srt.bundled import BundledHeadError, bundled_length_predictor

        try:
            path = bundled_length_predictor(server_args.model_path)
        except BundledHeadError as e:
            raise LaunchError(f"{where}: {e}") from None
    else:
        path = _artifact_dir(value, where)
    cfg = _check_stage0_artifact(path, server_args, "length_predictor", where, False)
    features = cfg.extra.get("features") or []
    if features:
        raise LaunchError(
            f"{where}: the server runs hidden-state-only predictors; this one also reads "
            f"{', '.join(features)}"
        )
    _check_stage0_artifact(path, server_args, "length_predictor", where)
    return path


def check_draft_head_artifact(path: str, server_args) -> None:
    """Refuse, before any process starts, a head trained for another model or exit layer."""
    _check_stage0_artifact(path, server_args, "draft_head", f"--spexis-draft-head {path}")


def _check_draft_head_weights(path: str, cfg, base: dict, where: str) -> None:
    from spexis_sglang.models.draft_head import check_draft_head_weights

    check_draft_head_weights(path, cfg, base, where)


def _check_length_predictor_weights(path: str, cfg, base: dict, where: str) -> None:
    from spexis_sglang.models.length_predictor import check_length_predictor_weights

    check_length_predictor_weights(path, cfg, base, where)


_ARTIFACT_WEIGHT_CHECKS = {
    "draft_head": _check_draft_head_weights,
    "length_predictor": _check_length_predictor_weights,
}


def _check_stage0_artifact(
    path: str, server_args, kind: str, where: str, check_weights: bool = True
):
    """An artifact of ``kind`` read at stage 0's exit: same base model, same exit layer, and
    (``check_weights``) an intact weights file whose tensors fit the module."""
    from spexis_sglang.models.artifact import (
        ArtifactMismatchError,
        check_compatible,
        check_weights_fingerprint,
        read_artifact_config,
    )
    from spexis_sglang.srt.config import stage0_end_layer

    try:
        cfg = read_artifact_config(path)
        with open(os.path.join(server_args.model_path, "config.json")) as f:
            base = json.load(f)
        exit_layer = stage0_end_layer(base["num_hidden_layers"], server_args.pp_size)
        check_compatible(cfg, base, expected_kind=kind, exit_layer=exit_layer, where=where)
        if server_args.load_format != "dummy":  # same architecture, other checkpoint
            check_weights_fingerprint(cfg, server_args.model_path, where)
        if check_weights:
            # a truncated or reshaped model.safetensors fails here, not at stage 0's first
            # forward (header only: cheap)
            _ARTIFACT_WEIGHT_CHECKS[kind](path, cfg, base, where)
    except ArtifactMismatchError as e:
        hint = ""
        if "exit_layer" in str(e):
            hint = (
                " (set SGLANG_PP_LAYER_PARTITION so that stage 0 holds exactly the artifact's "
                "exit layers, or use an artifact trained for this split)"
            )
        raise LaunchError(str(e) + hint) from None
    except (OSError, ValueError, KeyError) as e:
        raise LaunchError(f"{where}: unreadable artifact ({e})") from None
    return cfg


def _is_default_model(path: str) -> bool:
    from spexis_sglang.default_model import default_model_dir

    return os.path.realpath(os.path.expanduser(path)) == os.path.realpath(default_model_dir())


def prepare_argv(argv: List[str], on_cpu: bool) -> List[str]:
    """Fill in the model path (the bundled model's under its clean name), the defaults every
    server gets and, on CPU, the defaults SGLang needs there."""
    argv = list(argv)
    has_model, model = _flag_value(argv, _MODEL_FLAGS)
    if has_model:
        check_model_path(model)
    else:
        from spexis_sglang.default_model import ensure_default_model

        model = ensure_default_model()
        argv = ["--model-path", model] + argv
    if _is_default_model(model) and not _has_flag(argv, "--served-model-name"):
        from spexis_sglang.default_model import SERVED_MODEL_NAME

        # not the cache directory: /v1/models and every response name the model
        argv += ["--served-model-name", SERVED_MODEL_NAME]
    for flag, value in SERVER_DEFAULTS:
        if not _has_flag(argv, flag):
            argv += [flag] if value is None else [flag, value]
    if on_cpu:
        graphs_set = any(_has_flag(argv, f) for f in _GRAPH_OFF_FLAGS)
        for flag, value in CPU_DEFAULTS:
            if flag in _GRAPH_OFF_FLAGS and graphs_set:
                continue
            if not _has_flag(argv, flag):
                argv += [flag] if value is None else [flag, value]
    return argv


def prepare_server_args(argv: List[str]):
    """Parse a full command line into SGLang's ``ServerArgs`` and our ``SpexisConfig``."""
    from sglang.srt.server_args import prepare_server_args as sglang_prepare_server_args

    spexis_parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    add_spexis_args(spexis_parser)
    spexis_args, rest = spexis_parser.parse_known_args(argv)
    server_args = sglang_prepare_server_args(rest)
    config = spexis_config_from_args(spexis_args, server_args)
    graph_bs = sp_graph_max_bs(rest, server_args, config)
    if graph_bs is not None:
        server_args = sglang_prepare_server_args(
            rest + ["--cuda-graph-max-bs-decode", str(graph_bs)]
        )
    if config.float64:
        from spexis_sglang.srt.hooks import FLOAT64_DTYPE

        # SGLang's --dtype choices stop at float32; every process registers the name (hooks)
        server_args.override("spexis --spexis-float64", dtype=FLOAT64_DTYPE)
    return server_args, config


def sp_graph_max_bs(argv: List[str], server_args, config) -> Optional[int]:
    """The decode CUDA-graph limit SP needs, where the user did not size the graphs.

    A stock PP step runs B/N of the running requests, SP runs all B of them every iteration:
    SGLang's default limit (256 on an H200 with TP < 4) would send SP's larger batches to eager
    execution. None: leave SGLang's sizing (no SP, no graphs, or the user chose).
    """
    graphs = server_args.cuda_graph_config.decode
    if not config.enabled or server_args.device == "cpu" or graphs.backend == "disabled":
        return None
    if any(_has_flag(argv, flag) for flag in _GRAPH_SIZE_FLAGS) or not graphs.max_bs:
        return None
    limit = min(SP_GRAPH_MAX_BS_CAP, graphs.max_bs * server_args.pp_size)
    if server_args.max_running_requests:
        limit = min(limit, server_args.max_running_requests)
    return limit if limit > graphs.max_bs else None


def install_http_guard(config) -> None:
    """Request limits, scrubbed errors and model-name checks on SGLang's HTTP app."""
    from sglang.srt.entrypoints import http_server

    from spexis_sglang.srt import http_guard
    from spexis_sglang.srt.request_checks import accepted_model_names
    from spexis_sglang.srt.tokenizer_manager import request_limits

    def accepted_models():
        if config.accept_any_model:
            return None
        manager = http_server.get_global_state().tokenizer_manager
        # read per request: SGLang renames the served model when it loads new weights
        return accepted_model_names(manager.served_model_name, manager.server_args.model_path)

    http_guard.install(http_server.app, request_limits, accepted_models)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from spexis_sglang.cpu_support import activate, single_threaded_torch

    on_cpu = activate()  # must precede every sglang/transformers import
    if on_cpu:
        single_threaded_torch()  # the stages share the cores (the schedulers are forked)
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    try:
        argv = prepare_argv(argv, on_cpu)
    except Exception as e:  # a LaunchError, or the default model could not be built
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        server_args, spexis_config = prepare_server_args(argv)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    spexis_config.to_env()  # inherited by every scheduler process
    logger.info(
        "spexis launch: %s",
        json.dumps({"cpu": on_cpu, "argv": argv, "spexis": spexis_config.__dict__}),
    )

    from spexis_sglang.srt.hooks import (
        fork_subprocesses_on_cpu,
        install,
        run_spexis_scheduler_process,
    )
    from spexis_sglang.srt.tokenizer_manager import init_spexis_tokenizer_manager

    install()
    install_http_guard(spexis_config)
    if on_cpu:
        fork_subprocesses_on_cpu()
    return _serve(
        server_args,
        # refuses out-of-vocabulary token ids with a 400 before they reach a scheduler
        init_tokenizer_manager_func=init_spexis_tokenizer_manager,
        run_scheduler_process_func=run_spexis_scheduler_process,
    )


def _serve(server_args, **process_funcs) -> int:
    """SGLang's HTTP server with our process functions; its child processes end with it."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.utils import kill_process_tree

    try:
        launch_server(server_args, **process_funcs)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


DRAFT_HEAD_PROG = "python -m spexis_sglang.draft_head_server"


def draft_head_main(argv: Optional[List[str]] = None) -> int:
    """Stock SGLang scheduling with the draft head on stage 0 (``srt/draft_runner.py``)."""
    from spexis_sglang.cpu_support import activate
    from spexis_sglang.srt.config import ENV_DRAFT_HEAD

    argv = sys.argv[1:] if argv is None else list(argv)
    on_cpu = activate()
    if not os.environ.get(ENV_DRAFT_HEAD):
        print(
            f"{DRAFT_HEAD_PROG}: error: set {ENV_DRAFT_HEAD} (artifact dir or random:<seed>)",
            file=sys.stderr,
        )
        return 2
    try:
        argv = prepare_argv(argv, on_cpu)
    except Exception as e:
        print(f"{DRAFT_HEAD_PROG}: error: {e}", file=sys.stderr)
        return 2
    from sglang.srt.server_args import prepare_server_args as sglang_prepare_server_args

    from spexis_sglang.srt.draft_runner import run_draft_head_scheduler_process

    server_args = sglang_prepare_server_args(argv)
    return _serve(server_args, run_scheduler_process_func=run_draft_head_scheduler_process)
