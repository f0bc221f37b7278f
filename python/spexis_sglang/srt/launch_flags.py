"""The launcher's command line: SGLang's server arguments plus the ``--spexis-*`` flags, and
the defaults the launcher adds (``--help`` prints both)."""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, Tuple

from spexis_sglang.core.online_alpha import (
    AUTO_ALPHA_EXPLORE,
    AUTO_ALPHA_INITIAL,
    AUTO_ALPHA_INTERVAL,
    FIXED_ALPHA_OBSERVE_EVERY,
    FIXED_ALPHA_ONE_OBSERVE_EVERY,
)
from spexis_sglang.srt.request_checks import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_SEQUENCES,
)

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

MODEL_FLAGS = ("--model-path", "--model")
# the flags that turn CUDA graphs off; given any, the CPU defaults add none of them
GRAPH_OFF_FLAGS = (
    "--disable-cuda-graph",
    "--disable-decode-cuda-graph",
    "--disable-prefill-cuda-graph",
    "--cuda-graph-backend-decode",
    "--cuda-graph-backend-prefill",
)
# the flags that size SGLang's decode CUDA graphs; without any, SP sizes them (see below)
GRAPH_SIZE_FLAGS = (
    "--cuda-graph-max-bs",
    "--cuda-graph-max-bs-decode",
    "--cuda-graph-bs",
    "--cuda-graph-bs-decode",
    "--cuda-graph-config",
)


class LaunchError(ValueError):
    """A bad command line, reported before any process is started."""


def flag_value(argv: List[str], names: Tuple[str, ...]) -> Tuple[bool, Optional[str]]:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name:
                return True, argv[i + 1] if i + 1 < len(argv) else None
            if arg.startswith(name + "="):
                return True, arg.split("=", 1)[1]
    return False, None


def has_flag(argv: List[str], name: str) -> bool:
    return flag_value(argv, (name,))[0]


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
        "stages must read stage 0's plan in the iteration it was made for), with "
        "--speculative-algorithm (SP is itself a speculation; SGLang runs none under PP) and "
        "for a model architecture without a Spexis class (the error names those served). With "
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
        "where that draft is rejected, in pp-size micro-batches), or 'auto': stage 0 measures "
        "acceptance by confidence rank and iteration time against rows while serving, and "
        "re-chooses alpha with the cost "
        "model every --spexis-alpha-interval iterations, up to 1 where a stage's time grows "
        "in proportion to its rows and speculation cannot pay (every draft dropped: SP runs "
        f"like PP; starting at {AUTO_ALPHA_INITIAL}; "
        "every --spexis-alpha-explore-th iteration drops nothing, so the ranks it would drop "
        "are still measured, and at alpha 0 probes at alpha 1 time fewer rows). The alpha in "
        "force is in /server_info, the log line and the spexis:alpha metric. Default: 0.",
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
        help="With --spexis-alpha auto: every E-th decode iteration runs at alpha 0, and at "
        "alpha 0 a probe of N iterations every E runs at alpha 1 to time B/N rows (0 turns both "
        "off; the dropped ranks' acceptance is then never re-measured). Default: "
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
        f"Default: {FIXED_ALPHA_OBSERVE_EVERY}; {FIXED_ALPHA_ONE_OBSERVE_EVERY} at alpha 1, "
        "where stage 0 makes drafts only near an observed iteration.",
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
        "--spexis-draft-vocab",
        type=int,
        default=None,
        metavar="K",
        help="Stage 0's draft head drafts among the first K token ids only (a byte-pair "
        "tokenizer numbers its tokens roughly from the most frequent): its LM head reads K "
        "rows of the embedding instead of the whole vocabulary, which at a large vocabulary "
        "is a sizeable part of stage 0's time (Llama-3's 128K ids: ~1 GB a forward). A token "
        "outside the K cannot be drafted, so its row is rejected; outputs are unchanged. "
        "docs/your-model.md has the acceptance against K. Default: the whole vocabulary.",
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
