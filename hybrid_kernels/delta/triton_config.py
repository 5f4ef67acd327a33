"""``CONFIG``: the tunable launch parameters of every delta-rule kernel (origins: bench/TUNING.md, "delta rule")."""

CONFIG = {
    # chunked prefill: C tokens per chunk (C_per_channel with a decay per key channel, whose off-diagonal pairwise
    # blocks grow with C; halved where a kernel's fp32 tiles overflow shared memory), BD columns at a time of the
    # prepare kernel's [C, D] tiles, SUB-row blocks of the per-channel pairwise products, BKS channels at a time on
    # their diagonal blocks, BV value columns per sequential state program (its loop pipelined over state_stages on
    # 16-bit scratch; fp32 tiles, twice the shared memory a stage, keep one), BV_OUT per output program;
    # scratch16: the kernels hand each other 16-bit tiles where the inputs are 16-bit; split: the prepare step as two
    # launches (pairwise products; solve and w, u); dot16: the prepare and output kernels' products on 16-bit
    # operands (fp32 sums) where the inputs are 16-bit; pair_prec: the per-channel off-diagonal pairwise products'
    # precision for 16-bit inputs ("ieee", "tf32" or "16"; fp32 inputs keep "ieee"); state16: the sequential state
    # pass's two products on 16-bit operands (fp32 state and sums) where the scratch is 16-bit
    "chunk": {"C": 64, "C_per_channel": 32, "BD": 64, "SUB": 16, "BKS": 16, "BV": 32, "BV_OUT": 64,
              "prepare_warps": 4, "state_warps": 4, "output_warps": 4, "stages": 1, "state_stages": 3,
              "scratch16": True, "split": True, "dot16": True, "pair_prec": "16", "state16": True},
    # recurrent step: BV value columns per program
    "step": {"BV": 32, "warps": 4},
}
