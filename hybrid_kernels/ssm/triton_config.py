"""The tunable launch parameters of the SSM Triton kernels (``CONFIG``, one dict for every kernel in
triton_conv.py / triton_scan.py / triton_ssd.py / triton_norm.py).

Launch configs are pure functions of shapes and of ``CONFIG`` (no run-time autotuning: CUDA-graph and
AOT safe). Override entries (``CONFIG["ssd"]["BLOCK_M"] = 128``) before the first launch; bench/ssm.py
prints the dict it ran with."""
from __future__ import annotations

import triton

CONFIG: dict[str, dict] = {
    # causal_conv1d prefill: tile [BLOCK_C channels, BLOCK_T steps] for channel-last x (HF: a split of
    # in_proj's output, transposed), the *_TLAST pair when time is the contiguous dim
    "conv": {"BLOCK_C": 128, "BLOCK_T": 16, "BLOCK_C_TLAST": 16, "BLOCK_T_TLAST": 128, "num_warps": 4},
    # causal_conv1d_update (decode): one row, BLOCK_C channels per program
    "conv_update": {"BLOCK_C": 256, "num_warps": 4},
    # Mamba1 selective_scan: per program BLOCK_D channels x N states x BLOCK_T steps scanned at once;
    # BLOCK_D = max(1, TILE // (N_pow2 * BLOCK_T))
    "scan": {"BLOCK_T": 64, "TILE": 2048, "num_warps": 4},
    # Mamba1 selective_state_update: state tile [BLOCK_D, N_pow2], BLOCK_D = max(1, TILE // N_pow2)
    "scan_update": {"TILE": 2048, "num_warps": 4},
    # SSD chunked scan. CHUNK = 0: use the caller's chunk_size (rounded up to a power of two, clamped to
    # [16, 256]); results do not depend on it beyond rounding. BLOCK_M/BLOCK_K: output/source sub-blocks
    # inside a chunk (<= chunk). BLOCK_P: head-dim block. STATE_BLOCK_P/N: state tile of one program of the
    # sequential states kernel, N halved (down to 32) while fewer than STATE_MIN_PROGRAMS programs would run,
    # then halved until num_stages staged x and B tiles take at most STATE_SMEM bytes (fp32 or 256-step chunks).
    # CB: precompute C.B^T per (chunk, group) once and share it across heads. Tuned at 128 heads, T = 32K
    # (bench/ssd_sweep.py; bench/TUNING.md).
    "ssd": {
        "CHUNK": 128,
        "BLOCK_M": 64,
        "BLOCK_K": 32,
        "BLOCK_P": 64,
        "CB": True,
        "STATE_BLOCK_P": 64,
        "STATE_BLOCK_N": 128,
        "STATE_MIN_PROGRAMS": 128,
        "STATE_SMEM": 160 * 1024,
        "num_warps": 4,
        "num_stages": 2,
        "state_num_warps": 8,
        "state_num_stages": 3,
    },
    # ssd_state_update (decode): state tile [BLOCK_P, N_pow2], BLOCK_P = max(1, TILE // N_pow2)
    "ssd_update": {"TILE": 4096, "num_warps": 4},
    # gated RMSNorm: rows of one group, BLOCK_G = next_pow2(group_size); BLOCK_R rows per program
    "norm": {"ELEMS": 4096, "num_warps": 4, "big_num_warps": 8},
}


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))

