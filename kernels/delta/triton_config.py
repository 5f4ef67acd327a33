"""``CONFIG``: the tunable launch parameters of every delta-rule kernel (origins: bench/TUNING.md, "delta rule")."""

CONFIG = {
    # chunked prefill: C tokens per chunk (C_WIDE where K or V reaches 128: fp32 tiles of 64 x 128 overflow shared
    # memory), SUB-row blocks of the per-channel pairwise products, BKS channels at a time on their diagonal
    # blocks, BV value columns per state program
    "chunk": {"C": 64, "C_WIDE": 32, "SUB": 16, "BKS": 16, "BV": 32, "prepare_warps": 4, "state_warps": 4,
              "stages": 1},
    # recurrent step: BV value columns per program
    "step": {"BV": 32, "warps": 4},
}
