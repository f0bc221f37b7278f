"""Spexis' runtime configuration, handed from the launcher to every scheduler process.

The launcher parses the ``--spexis-*`` flags into :class:`SpexisConfig` and exports it as JSON
in ``SPEXIS_CONFIG``; spawned scheduler processes inherit the environment and read it back with
:func:`get_config`. (An environment variable survives ``spawn`` without touching SGLang's
``ServerArgs``.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from spexis_sglang.core.online_alpha import (
    AUTO_ALPHA_EXPLORE,
    AUTO_ALPHA_INTERVAL,
    FIXED_ALPHA_OBSERVE_EVERY,
)
from spexis_sglang.srt.request_checks import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_SEQUENCES

ENV_CONFIG = "SPEXIS_CONFIG"
# Read by the stage-0 model (draft head location), see srt/draft_model.py.
ENV_DRAFT_HEAD = "SPEXIS_DRAFT_HEAD"
#: a draft head value ``random:SEED``: an untrained head, deterministic given the seed
RANDOM_HEAD_PREFIX = "random:"

# Developer aids, read in the scheduler processes (all off by default):
#: a file to which stage 0 (TP rank 0) appends one JSON line per eager forward (draft_model)
ENV_DRAFT_TRACE = "SPEXIS_DRAFT_TRACE"
#: "1": time stock SGLang's event_loop_pp by phase too (stats.StockPPPhaseTimers)
ENV_PHASE_TIMERS = "SPEXIS_PHASE_TIMERS"
#: a path prefix: cProfile each rank's SP loop into PREFIX.pp{rank}.tp{rank}.prof
ENV_PROFILE_LOOP = "SPEXIS_PROFILE_LOOP"
#: "1": each step of a rank's PP loop (stock or SP) is a named range in a torch.profiler trace
#: (SGLang's /start_profile), so a GPU timeline shows what the host did meanwhile
#: (profiling.ProfilerRanges)
ENV_PROFILE_RANGES = "SPEXIS_PROFILE_RANGES"
#: a file to which stage 0's alpha controller appends one JSON line per decode launch: the
#: time since the previous launch, the rows of the batches in the pipe it is set against,
#: this iteration's alpha and kind (probe, explore) and whether it became a latency sample
ENV_ALPHA_LOG = "SPEXIS_ALPHA_LOG"
#: a file to which stage 0's scheduler (TP rank 0) appends one JSON line per SP decode batch:
#: each row's request, position, input token, draft, confidence and length bucket, as the
#: scheduler received them (CUDA-graph replays included; ENV_DRAFT_TRACE sees eager forwards)
ENV_DRAFT_LOG = "SPEXIS_DRAFT_LOG"
#: every rank of the server runs on the GPUs there are (hooks.share_one_gpu), NCCL over
#: loopback sockets: "mps", an emulated multi-GPU box (each rank an NVIDIA MPS client with its
#: share of the SMs: kernels of the ranks run at once); "1", plain sharing (the ranks take
#: turns: for correctness tests only)
ENV_SHARE_GPU = "SPEXIS_SHARE_GPU"
SHARE_GPU_MODES = ("1", "mps")
#: "ipc": PP ranks sharing one GPU send their tensor messages through CUDA IPC buffers instead
#: of NCCL over loopback sockets (stage_link.SameGpuLink; the GPU scripts set it under mps);
#: "packed": ranks on one host send each message's layout over a local pipe and its tensors in
#: one send (stage_link.PackedLink) instead of SGLang's gloo metadata and a send per tensor;
#: "nccl": SGLang's own transport. Unset: "packed" for an SP server where it applies (one host,
#: TP 1), SGLang's for a plain PP server
ENV_PP_TRANSPORT = "SPEXIS_PP_TRANSPORT"
#: "1": time each rank's decode forwards on the device (CUDA events) by batch rows, logged
#: per rank every few seconds and under /server_info (stats.GpuForwardTimer)
ENV_GPU_TIMERS = "SPEXIS_GPU_TIMERS"
#: "0": stage 0 takes its drafts from the logits with PyTorch's ops instead of the fused
#: Triton pass on a GPU (draft_triton; to time one against the other)
ENV_DRAFT_FUSED = "SPEXIS_DRAFT_FUSED"
#: "0": a decode batch's rows are completed at launch with PyTorch's ops instead of the one
#: Triton kernel on a GPU (rows_triton; to time one against the other)
ENV_ROWS_FUSED = "SPEXIS_ROWS_FUSED"
#: "0": stage 0 launches its draft pass kernel by kernel instead of replaying it from a CUDA
#: graph per row bucket on a GPU (draft_graphs; to time one against the other)
ENV_DRAFT_GRAPH = "SPEXIS_DRAFT_GRAPH"

# Set-up and the CPU environment:
#: where the converted default model is cached (default: $XDG_CACHE_HOME/spexis, ~/.cache/spexis)
ENV_CACHE_DIR = "SPEXIS_CACHE_DIR"
#: "1" in a process whose CPU support is active (cpu_support.activate; children inherit it)
ENV_CPU_SUPPORT = "SPEXIS_CPU_SUPPORT"
#: "1": no automatic CPU support when a GPU-less process imports sglang. The start-up modules
#: (cpu_import_hook, cpu_support and its quiet module) keep copies of their names: they run
#: before numpy or torch may be imported, so they import nothing of the package
#: (tests/test_env_names.py checks the copies)
ENV_NO_AUTO_CPU_SUPPORT = "SPEXIS_NO_AUTO_CPU_SUPPORT"
#: "1": show each model class SGLang could not import on a CPU (cpu_support.quiet)
ENV_SHOW_SKIPPED_MODELS = "SPEXIS_SHOW_SKIPPED_MODELS"
#: "1": keep every start-up line a CPU server prints (cpu_support.quiet)
ENV_SHOW_ALL_STARTUP_LINES = "SPEXIS_SHOW_ALL_STARTUP_LINES"
#: extra arguments appended to every test server's command line (testing.ServerProcess)
ENV_TEST_SERVER_ARGS = "SPEXIS_TEST_SERVER_ARGS"
#: a directory: a server's processes unpickle their tokenizer from it, pickled there by the
#: first load with the same arguments and files (srt/tokenizer_cache.py; the test suite's)
ENV_TOKENIZER_CACHE = "SPEXIS_TOKENIZER_CACHE"


def env_flag(name: str) -> bool:
    """A developer switch from the environment ("1" = on)."""
    return os.environ.get(name, "0") == "1"


def env_value(name: str) -> Optional[str]:
    """A developer setting from the environment (None when unset or empty)."""
    return os.environ.get(name) or None


def random_head_seed(value: str) -> Optional[int]:
    """The seed of a ``random:SEED`` draft head; None for any other value (an artifact).

    Raises ValueError when the seed is not an integer."""
    value = value.strip()
    if not value.startswith(RANDOM_HEAD_PREFIX):
        return None
    seed = value[len(RANDOM_HEAD_PREFIX) :]
    try:
        return int(seed)
    except ValueError:
        raise ValueError(f"{value!r}: the seed after {RANDOM_HEAD_PREFIX!r} must be an integer")


def share_gpu_mode() -> Optional[str]:
    """``SPEXIS_SHARE_GPU``: ``"mps"``, ``"1"`` or None (off)."""
    mode = env_value(ENV_SHARE_GPU)
    if mode in (None, "0"):
        return None
    if mode not in SHARE_GPU_MODES:
        raise ValueError(f"{ENV_SHARE_GPU}={mode!r}: expected one of {SHARE_GPU_MODES} or 0")
    return mode


@dataclasses.dataclass(frozen=True)
class SpexisConfig:
    """What the ``--spexis-*`` flags decided."""

    #: Artifact directory of the draft head, or ``random:<seed>``; None = plain SGLang.
    draft_head: Optional[str] = None
    #: Fraction of drafts dropped each iteration (selective speculation, §5.1).
    alpha: float = 0.0
    #: ``--spexis-alpha auto``: stage 0 chooses alpha online (``core.online_alpha``);
    #: ``alpha`` is then unused.
    alpha_auto: bool = False
    #: With ``alpha_auto``: re-choose every this many decode iterations ...
    alpha_interval: int = AUTO_ALPHA_INTERVAL
    #: ... and run every this-many-th decode iteration at alpha 0 (0: never).
    alpha_explore: int = AUTO_ALPHA_EXPLORE
    #: With a fixed alpha: its observer (``recommended_alpha``) takes every this-many-th
    #: decode iteration (1: every one).
    alpha_observe: int = FIXED_ALPHA_OBSERVE_EVERY
    #: Benchmark-only: verification accepts a draft with this probability (None = real).
    force_accept: Optional[float] = None
    #: Benchmark-only length oracle: the target quality (``core.length_oracle.OracleQuality``
    #: as a dict) of the remaining-length buckets made from the true lengths (None = off).
    length_oracle: Optional[dict] = None
    #: Seconds between the periodic Spexis statistics log lines (0 = never).
    log_interval: float = 10.0
    #: Artifact directory of the remaining-length predictor run on stage 0 (None = off).
    length_predictor: Optional[str] = None
    #: Look-ahead admission (§5.2): delay new requests when admitting them now costs more
    #: (expected evictions and recomputes) than it gains. Needs ``length_predictor``.
    lookahead_admission: bool = False
    #: Prefill-to-decode latency ratio ``t_p / t_d`` of the admission gain G.
    admission_pdr: float = 2.0
    #: Exact-equality test mode (CPU only): weights, activations and KV cache in float64,
    #: so a row's logits move by ~1e-16 when the batch around it changes (docs/design.md §5).
    float64: bool = False
    #: Constrained decoding: stage 0's draft head drafts only tokens the row's grammar allows.
    grammar_draft_mask: bool = True
    #: The draft head drafts among the first this-many token ids only (None: all of them).
    draft_vocab: Optional[int] = None
    #: The largest ``n`` one request may ask for (``request_checks``; every server).
    max_n: int = DEFAULT_MAX_N
    #: The most sequences (prompts x ``n``) one request may fan out to.
    max_request_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES
    #: The OpenAI routes accept any model name (SGLang's behaviour) instead of answering 404.
    accept_any_model: bool = False

    @property
    def enabled(self) -> bool:
        return self.draft_head is not None

    def to_env(self) -> None:
        os.environ[ENV_CONFIG] = json.dumps(dataclasses.asdict(self))
        if self.draft_head is not None:
            os.environ[ENV_DRAFT_HEAD] = self.draft_head
        else:
            os.environ.pop(ENV_DRAFT_HEAD, None)


def get_config() -> SpexisConfig:
    raw = os.environ.get(ENV_CONFIG)
    if not raw:
        return SpexisConfig()
    return SpexisConfig(**json.loads(raw))
