"""What the routed-MoE kernels share: the launch configs per token bucket (``MOE_CONFIGS``, ``config_for``), the
kernel launcher, the operand-dtype rules and the ``tl.dot`` wrapper. Used by ``triton_routing.py`` and ``triton_experts.py``.

``launch`` is looked up on this module at every call (``common.launch(kernel)``), so one patch of it (tests, the
bench's launch recorder) sees every launch of the pipeline."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_kernels.library import interpreting

# ----------------------------------------------------------------------------------------------------------
# Configs. Keys of MOE_CONFIGS are T buckets (upper bounds on the number of tokens); the first key >= T wins.
#   BM: rows per expert block (alignment granularity and tl.dot M, >= 16).
#   up (gate+up GEMM, N = I, K = H) / down (N = H, K = I): BN, BK tiles (>= 16), GROUP_M (grouped tile order
#   for L2 reuse of weight tiles), warps, stages; down SPLIT_K (None: heuristic from the bucket's bound, so
#   that enough CTAs stream the weights at small T).
# TUNED[(E, H, I, top_k)] may hold a whole table of the same form for one model shape (fill it from bench).
# Every choice depends on the bucket only, never on T itself (few guards / recompiles under dynamic shapes).
# ----------------------------------------------------------------------------------------------------------
def small_config() -> dict:
    return dict(BM=16, up=dict(BN=32, BK=128, GROUP_M=1, warps=4, stages=4),
                down=dict(BN=64, BK=128, GROUP_M=1, warps=4, stages=4, SPLIT_K=None))


MOE_CONFIGS: dict[int, dict] = {
    1: small_config(),
    4: small_config(),
    16: small_config(),
    64: dict(BM=16, up=dict(BN=64, BK=128, GROUP_M=4, warps=4, stages=4),
             down=dict(BN=64, BK=128, GROUP_M=4, warps=4, stages=4, SPLIT_K=None)),
    256: dict(BM=32, up=dict(BN=64, BK=64, GROUP_M=8, warps=4, stages=4),
              down=dict(BN=128, BK=64, GROUP_M=8, warps=4, stages=4, SPLIT_K=None)),
    1024: dict(BM=64, up=dict(BN=64, BK=64, GROUP_M=8, warps=4, stages=4),
               down=dict(BN=128, BK=64, GROUP_M=8, warps=4, stages=4, SPLIT_K=1)),
    1 << 62: dict(BM=128, up=dict(BN=128, BK=64, GROUP_M=8, warps=8, stages=3),
                  down=dict(BN=128, BK=64, GROUP_M=8, warps=8, stages=4, SPLIT_K=1)),
}
TUNED: dict[tuple[int, int, int, int], dict[int, dict]] = {}
NUM_SMS_GUESS = 132  # H200; only used by the split-K heuristic (a pure function of shapes)


def launch(kernel):
    return torch.library.wrap_triton(kernel)


def cast_f32(dtype: torch.dtype) -> bool:
    """Load-and-widen operands before tl.dot: the interpreter's bf16/fp16 math is unreliable, fp32 stays fp32."""
    return interpreting() or dtype == torch.float32


def ieee(dtype: torch.dtype) -> bool:
    """fp32 operands: full-precision dot (torch's fp32 matmul does not use TF32 by default)."""
    return dtype == torch.float32


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


def pow2_at_least(n) -> int:
    """Smallest power of two >= n (comparisons only: works on SymInts with a few guards)."""
    p = 1
    while p < n:
        p *= 2
    return p


def bucket_for(T, table: dict | None = None) -> int:
    table = table if table is not None else MOE_CONFIGS
    for bound in sorted(table):
        if T <= bound:
            return bound
    return max(table)


def config_for(T, E: int, H: int, I: int, top_k: int, elem_bytes: int = 2) -> dict:
    """The config for T tokens of one MoE shape (pure function of shapes and element size, constant within a
    T bucket). The tables are written for 16-bit operands; wider ones get fewer stages / a smaller BK so the
    pipelined tiles fit in shared memory."""
    table = TUNED.get((E, H, I, top_k), MOE_CONFIGS)
    bound = bucket_for(T, table)
    cfg = table[bound]
    cfg = {"BM": cfg["BM"], "up": dict(cfg["up"]), "down": dict(cfg["down"])}
    fit_smem(cfg["up"], cfg["BM"], 2, elem_bytes)
    fit_smem(cfg["down"], cfg["BM"], 1, elem_bytes)
    if cfg["down"].get("SPLIT_K") is None:
        cfg["down"]["SPLIT_K"] = split_k_heuristic(min(bound, 1 << 20), E, H, I, top_k, cfg)
    return cfg


SMEM_BUDGET = 200 * 1024  # of the H200's 227 KB per block


def fit_smem(kcfg: dict, BM: int, n_weight_tiles: int, elem_bytes: int) -> None:
    def smem():
        return kcfg["stages"] * (BM + n_weight_tiles * kcfg["BN"]) * kcfg["BK"] * elem_bytes

    while smem() > SMEM_BUDGET and kcfg["stages"] > 2:
        kcfg["stages"] -= 1
    while smem() > SMEM_BUDGET and kcfg["BK"] > 16:
        kcfg["BK"] //= 2


def split_k_heuristic(T: int, E: int, H: int, I: int, top_k: int, cfg: dict) -> int:
    """Split the down projection's K until ~4 CTAs per SM stream weights (expected touched experts at T)."""
    touched = max(1.0, E * (1.0 - (1.0 - top_k / E) ** T))
    blocks = touched + T * top_k / cfg["BM"]
    ctas = blocks * triton.cdiv(H, cfg["down"]["BN"])
    k_iters = triton.cdiv(I, cfg["down"]["BK"])
    split = 1
    while ctas * split < 4 * NUM_SMS_GUESS and split * 2 <= 8 and k_iters // (split * 2) >= 4:
        split *= 2
    return split
