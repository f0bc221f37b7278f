"""The ``--spexis-*`` values checked and turned into the :class:`~.config.SpexisConfig` every
scheduler process reads: alpha, the draft head and length predictor artifacts (checked against
the served model and stage 0's depth), the length oracle, the request limits."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Optional, Tuple

from spexis_sglang.core.online_alpha import (
    AUTO_ALPHA_EXPLORE,
    AUTO_ALPHA_INTERVAL,
    FIXED_ALPHA_OBSERVE_EVERY,
    FIXED_ALPHA_ONE_OBSERVE_EVERY,
)
from spexis_sglang.srt.config import RANDOM_HEAD_PREFIX, random_head_seed
from spexis_sglang.srt.launch_flags import LaunchError
from spexis_sglang.srt.model_files import read_model_config, read_model_config_and_dir

if TYPE_CHECKING:
    from spexis_sglang.srt.config import SpexisConfig

logger = logging.getLogger(__name__)


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
    if observe is None:
        observe = FIXED_ALPHA_ONE_OBSERVE_EVERY if alpha >= 1.0 else FIXED_ALPHA_OBSERVE_EVERY
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
        if args.spexis_draft_vocab is not None:
            raise LaunchError("--spexis-draft-vocab needs --spexis-draft-head (no drafts are made)")
        return SpexisConfig(
            log_interval=args.spexis_log_interval, float64=args.spexis_float64, **limits
        )
    if server_args.pp_size < 2:
        raise LaunchError(
            "--spexis-draft-head needs --pp-size >= 2: speculative parallelism runs the "
            "draft head on the first of several pipeline stages "
            f"(got --pp-size {server_args.pp_size})"
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
    if server_args.speculative_algorithm:
        raise LaunchError(
            f"--spexis-draft-head with --speculative-algorithm {server_args.speculative_algorithm}"
            ": speculative parallelism is itself a speculation (stage 0's draft head, verified by "
            "the last stage), and SGLang 0.5.17 runs no speculative decoding under pipeline "
            "parallelism; leave --speculative-algorithm out"
        )
    check_sp_architecture(server_args.model_path)
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
    draft_vocab = _draft_vocab(args.spexis_draft_vocab, server_args)
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
        draft_vocab=draft_vocab,
        **limits,
    )


def _draft_vocab(k: Optional[int], server_args) -> Optional[int]:
    """``--spexis-draft-vocab``: at least 1 and at most the model's vocabulary (None: all)."""
    if k is None:
        return None
    try:
        config = read_model_config(server_args.model_path)
    except FileNotFoundError:  # SGLang's own loader says so later
        config = {}
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if k < 1 or (vocab is not None and k > int(vocab)):
        bound = f"the model's vocabulary ({vocab} ids)" if vocab is not None else "the vocabulary"
        raise LaunchError(f"--spexis-draft-vocab must be between 1 and {bound}, got {k}")
    return None if vocab is not None and k == int(vocab) else k


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


def check_sp_architecture(model_path: str) -> None:
    """Refuse ``--spexis-draft-head`` for a checkpoint class that has no Spexis model class:
    SGLang would build its own class, which makes no drafts, and stage 0 would fail at its
    first forward."""
    from spexis_sglang.srt.model_registry import sp_architectures, unserved_architecture

    if not model_path:
        return
    try:
        architectures = read_model_config(model_path).get("architectures")
    except (OSError, ValueError, AttributeError):
        return  # SGLang reports a missing or unreadable config itself
    arch = unserved_architecture(architectures)
    if arch is not None:
        raise LaunchError(
            f"--spexis-draft-head: the model is a {arch}, which speculative parallelism does "
            f"not serve (it serves {', '.join(sp_architectures())}); serve it without "
            "--spexis-draft-head, as plain SGLang"
        )


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
    from spexis_sglang.srt.bundled import stage0_end_layer

    try:
        base, model_dir = read_model_config_and_dir(server_args.model_path)
    except (OSError, ValueError) as e:
        raise LaunchError(f"{where}: cannot check it against the model: {e}") from None
    try:
        cfg = read_artifact_config(path)
        exit_layer = stage0_end_layer(base["num_hidden_layers"], server_args.pp_size)
        check_compatible(cfg, base, expected_kind=kind, exit_layer=exit_layer, where=where)
        if server_args.load_format != "dummy":  # same architecture, other checkpoint
            check_weights_fingerprint(cfg, model_dir, where)
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


def is_default_model(path: str) -> bool:
    from spexis_sglang.default_model import default_model_dir

    return os.path.realpath(os.path.expanduser(path)) == os.path.realpath(default_model_dir())
