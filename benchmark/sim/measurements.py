"""Measurements the simulator is calibrated and validated against, each with its provenance.

Numbers that exist in the repository as JSON are read from there (``COMMITTED``); numbers
that were reported by the runs' operator but not committed as JSON are written out here,
once, with what is known about how they were taken.
"""

from __future__ import annotations

#: The emulated two-GPU box: both PP ranks on one H200 split by MPS, NCCL over loopback.
BOX_2026_12_02 = {
    "provenance": (
        "emulated two-GPU box, 2026-12-02: one NVIDIA H200 split by NVIDIA MPS into two 50 % "
        "clients (one per PP rank, SPEXIS_SHARE_GPU=1), NCCL between the ranks over loopback "
        "sockets; Llama-3.1-8B-shaped config (benchmark/gpu/configs/llama-3.1-8b), dummy "
        "weights, bf16, CUDA graphs on for both loops, --max-total-tokens 131072, forced "
        "acceptance Theta = 0.76, input 128 tokens, benchmark/gpu/decode_throughput.py "
        "(T_step from 16- and 128-token runs). Two numbers = two runs. Reported by the runs' "
        "operator, not committed as JSON."
    ),
    "model_config": "benchmark/gpu/configs/llama-3.1-8b",
    "theta": 0.76,
    "input_len": 128,
    "stock_pp2_tok_s": {64: [6367, 6588], 128: [7687, 8340], 256: [13097, 12220], 512: [16963]},
    "sp2_tok_s": {64: [5529, 5307], 128: [10388, 9372], 256: [12823, 13268], 512: [16028]},
    # stage 0's phase timers, wall ms per SP iteration (draft_sync not reported at B=256)
    "sp2_phase_ms": {
        64: {
            "iteration": 9.0,
            "schedule": 0.92,
            "draft_sync": 0.15,
            "launch": 1.39,
            "wait_output": 4.88,
            "process": 0.66,
            "send": 0.81,
        },
        256: {
            "iteration": 15.4,
            "schedule": 0.85,
            "launch": 1.98,
            "wait_output": 10.24,
            "process": 1.0,
            "send": 0.86,
        },
        512: {
            "iteration": 24.5,
            "schedule": 1.8,
            "draft_sync": 0.53,
            "launch": 1.85,
            "wait_output": 17.9,
            "process": 1.19,
            "send": 0.79,
        },
    },
    # a stage made of GEMMs only (16 layers' projections + LM head), timed on the box:
    # Theta-weighted SP2 / PP2 throughput ratio if stage times were all that mattered
    "gemm_only_ideal_sp2_over_pp2": {16: 1.59, 32: 1.54, 64: 1.35, 128: 1.24, 256: 1.28, 512: 0.89},
}

#: Bandwidth and GEMM rate of one H200 under MPS (mps_probe.sh, 2026-12-02).
MPS_PROBE_2026_12_02 = {
    "provenance": (
        "mps_probe.sh on nvidia-h200, 2026-12-02: bf16 GEMM rate and copy bandwidth of one "
        "process alone, one 50 % MPS client alone, and each of two 50 % clients at once"
    ),
    "whole_gpu": {"tflops": 660.0, "tbps": 4.25},
    "one_client_alone": {"tflops": 445.0, "tbps": 3.69},
    "two_clients_each": {"tflops": 340.0, "tbps": 2.30},
}

#: Stock SGLang PP=1 on one H200 with CUDA graphs.
H200_PP1_GRAPHS_2026_12_01 = {
    "provenance": (
        "one NVIDIA H200, 2026-12-01: stock SGLang 0.5.17 PP=1, Llama-3.1-8B-shaped config, "
        "dummy weights, bf16, CUDA graphs on, triton attention, decode_throughput.py protocol "
        "(decode steps of 5.1 / 5.9 / 10.6 ms); reported, not committed as JSON"
    ),
    "model_config": "benchmark/gpu/configs/llama-3.1-8b",
    "tok_s": {16: 3130, 64: 10937, 256: 24105},
}

#: AIConfigurator's own estimate for the same PP=1 points (for the record).
AIC_CLI_PP1 = {
    "command": (
        "aiconfigurator cli estimate --model-path meta-llama/Meta-Llama-3.1-8B --system "
        "h200_sxm --backend sglang --estimate-mode static_gen --batch-size B --isl 128 "
        "--osl 128 --tp-size 1 --pp-size 1"
    ),
    "tok_s": {16: 3288, 64: 11545, 256: 26547},
}

#: Committed JSON results this package reads (paths relative to the repository root).
COMMITTED = {
    # stage 0's host phases, stock PP and SP, tiny model, CUDA graphs, H200 host CPU (its
    # back-to-back repeat is no longer in the repository: the mean is over this run alone)
    "loop_overhead": [
        "benchmark/results/gpu/sp_loop_overhead_one_gpu.json",
    ],
    # the same loops' host phases over the same-GPU CUDA IPC link (tiny model, graphs on, an
    # H100 machine's host CPU): stock PP per micro-batch at 32 and 128 rows, SP per iteration
    "loop_overhead_ipc": "benchmark/results/gpu/sp_loop_overhead_one_gpu_ipc.json",
    # real 2 x H200, CUDA graphs OFF, custom all-reduce off (the flags of that time)
    "run4_llama": [
        "benchmark/results/gpu/decode_llama-3.1-8b_no_graphs_pp_sp.json",
        "benchmark/results/gpu/decode_llama-3.1-8b_no_graphs_pp1_tp.json",
        "benchmark/results/gpu/decode_llama-3.1-8b_no_graphs_ppa.json",
    ],
    "run3_qwen": [
        "benchmark/results/gpu/decode_qwen3-8b_no_graphs_pp_sp.json",
        "benchmark/results/gpu/decode_qwen3-8b_no_graphs_pp1_tp_ppa.json",
    ],
    # acceptance of the shipped draft head by confidence decile, and per category
    "quality": "benchmark/results/quality_gpu_long.json",
    "sp_acceptance": "benchmark/results/gpu/sp_acceptance_specbench_768tok.json",
    # per-stage decode times, graphs on (benchmark/gpu/stage_times.sh), once measured
    "stage_times": "benchmark/results/gpu/stage_times_h200.json",
    # the emulated two-GPU box with the overlapped SP loop (stage 0's host work off the
    # critical path), graphs on, Llama-3.1-8B-shaped, dummy weights, bf16, forced Theta,
    # --max-total-tokens 160000 (benchmark/gpu/pipeline_box.sh): stock PP2 with SGLang's
    # micro-batch cap and balanced micro-batches, at async depth 0 (and 1 in the first file),
    # SP2 at alpha 0 and Theta 0.76 / 0.6; stage 0's phase timers and GPU time per batch.
    # The overlapped loop's host costs are fit on SP2's timers in the second file
    # (calibrate.OVERLAP_FIT_FILE); every other point is validation.
    "box_new_loop": [
        "benchmark/results/gpu/box_decode_llama-3.1-8b_pp1_alphaauto.json",  # 2026-12-03
        "benchmark/results/gpu/box_decode_llama-3.1-8b.json",  # 2026-12-03, inputs 128, 2048
        "benchmark/results/gpu/box_decode_llama-3.1-8b_alphaauto.json",  # 2026-12-04
    ],
    # one message between the box's two ranks by size, NCCL over loopback sockets (H200 box,
    # 2026-12-03): the loopback link's latency and bandwidth
    "box_transport_probe": "benchmark/results/gpu/box_transport_probe.json",
    # the same box and loop, Qwen3-32B-shaped (32 layers per stage), --max-total-tokens
    # 100000 (B = 512 at 128 + 128 tokens exceeds it): a model no fit has seen
    "box_qwen3_32b": [
        "benchmark/results/gpu/box_decode_qwen3-32b.json",  # 2026-12-04
        # 2026-12-05: stock PP2 at inputs 128 and 2,048 (its SP ran alpha auto: not compared)
        "benchmark/results/gpu/box_decode_qwen3-32b_alphaauto.json",
    ],
    # the same box, the stages linked by the same-GPU CUDA IPC link (SPEXIS_PP_TRANSPORT=ipc)
    # for stock PP and SP alike, Llama-3.1-8B-shaped, 2026-12-05: its probe (NCCL, IPC and
    # gloo by message size) and two decode runs (stock PP2 four ways, SP2 at alpha 0)
    "box_transport_probe_with_ipc": "benchmark/results/gpu/box_transport_probe_with_ipc.json",
    "box_ipc": [
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc.json",
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto.json",
    ],
    # stock PP=1 on one whole H100 80GB (the anchor of two box calls, 2026-12-07, graphs on,
    # Llama-3.1-8B-shaped, inputs 128 and 2,048): the H100's stage times, which borrow the
    # H200's correction
    "h100_pp1": [
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto_pp1_h100.json",
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto_input2048_pp1_h100.json",
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto_pp1_draft_graph_h100.json",
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto_two_thetas_pp1_h100.json",
    ],
    # the emulated box on an H100 (not an H200; the same emulation and IPC link), the same
    # four calls of 2026-12-07, Llama-3.1-8B-shaped: stock PP2 at both micro-batch caps, and
    # SP2 under --spexis-alpha auto where alpha stayed 0 for the whole point (its probes, a
    # few iterations of B/N rows, are not simulated)
    "box_h100": [
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto_pp1_h100.json",
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto_input2048_pp1_h100.json",
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto_pp1_draft_graph_h100.json",
        "benchmark/results/gpu/box_decode_llama-3.1-8b_ipc_alphaauto_two_thetas_pp1_h100.json",
    ],
}
