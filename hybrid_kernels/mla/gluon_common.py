"""What the Gluon MLA decode kernels share (gluon_wide.py, gluon_narrow.py): the Gluon imports (absent on Tritons
without Gluon: ``HAVE_GLUON``), the widths they are built for, the operand checks for cp.async, and the device
functions that find and copy key tiles from the paged cache (or, page 0, from HF's dense latent / rope tensors).
"""
from __future__ import annotations

from torch import Tensor

try:  # Gluon (Triton >= 3.5); the module stays importable where it is missing (CPU-only installs)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    # cp.async of a pointer tensor into shared memory: ``async_load`` from Triton 3.7 on (the old name raises there)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed barrier() in Triton 3.7
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

BN = 64                        # keys per tile
LAT, ROPE = 512, 64            # the only latent / rope widths the kernels are built for (DeepSeek V2 / V3)
NARROW_MAX_HEADS = 32          # up to this many heads: gluon_narrow.py (all heads of a sequence in one program)
WIDE_HEADS = 64                # heads per program of gluon_wide.py (head counts that are multiples of it)


def rows_ok(t: Tensor, width: int) -> bool:
    """A [.., rows, width] operand cp.async can copy 16 bytes at a time: last dim contiguous, a 16-byte aligned start
    (the offset into its storage: no data pointer, which a compiled graph's fake tensors do not have), other strides
    multiples of 8 elements."""
    return (t.shape[-1] == width and t.stride(-1) == 1 and t.storage_offset() * t.element_size() % 16 == 0
            and all(st % 8 == 0 for st in t.stride()[:-1]))


if HAVE_GLUON:
    @gluon.jit
    def _pdl_start(PDL: gl.constexpr):
        """library.pdl_start in Gluon: wait for the kernel before (its writes visible), then let the next one (the
        merge) launch, its programs waiting in their own pdl_start while this kernel runs."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    # one warpgroup's [64 keys, 64 columns] copies: a warp's 16-byte copies take 4 whole 128-byte rows (bench/README.md,
    # TUNING: MLA Gluon key copies)
    _CHUNK = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def _key_blocks(BT, kb, start, bt_keys, PAGE: gl.constexpr, BN: gl.constexpr):
        """Where the keys start .. start + BN sit: paged (PAGE > 0), key k in block BT[kb + k // PAGE] ([BN] block
        ids, a plain load: it stalls only where used; ids past the sequence are loaded too, but never copied from);
        dense (PAGE == 0), all in batch row kb. bt_keys: the keys a block-table row addresses (its width x PAGE), the
        load's bound, so that it need not wait for the sequence's length."""
        if PAGE > 0:
            keys = start + gl.arange(0, BN, layout=gl.SliceLayout(1, _CHUNK))
            return gl.load(BT + kb + keys // PAGE, mask=keys < bt_keys, other=0).to(gl.int64)
        else:
            return kb

    @gluon.jit
    def _copy_keys(LATP, ROPEP, blk, start, k_hi, s_lb, s_ls, s_rb, s_rs, lat_dst, rope_dst, C0: gl.constexpr,
                   NC: gl.constexpr, WITH_ROPE: gl.constexpr, PAGE: gl.constexpr, LAT: gl.constexpr,
                   BN: gl.constexpr):
        """cp.async (one commit group) of latent columns [64 C0, 64 (C0 + NC)) of the key tile start .. start + BN
        (in blocks ``blk``, from _key_blocks), and its rope columns if WITH_ROPE, issued by one warpgroup; keys >=
        k_hi read as zeros. 64-column copies keep few pointers live (Triton 3.6 puts a CTA barrier between copies
        into slices of one buffer; 3.9 does not)."""
        keys = start + gl.arange(0, BN, layout=gl.SliceLayout(1, _CHUNK))
        if PAGE > 0:
            pos = (keys % PAGE).to(gl.int64)
        else:
            pos = keys.to(gl.int64)
        row_l = gl.expand_dims(blk * s_lb + pos * s_ls, 1)
        ok = gl.expand_dims(keys < k_hi, 1)
        cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, _CHUNK)), 0)
        for c in gl.static_range(C0, C0 + NC):
            _cp_async(lat_dst.slice(c * 64, 64, dim=1), LATP + row_l + (cols + c * 64), mask=ok)
        if WITH_ROPE:
            _cp_async(rope_dst, ROPEP + gl.expand_dims(blk * s_rb + pos * s_rs, 1) + cols, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _load_keys(LATP, ROPEP, BT, kb, start, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, lat_dst, rope_dst,
                   C0: gl.constexpr, NC: gl.constexpr, WITH_ROPE: gl.constexpr, PAGE: gl.constexpr, LAT: gl.constexpr,
                   BN: gl.constexpr):
        """_copy_keys of the tile's columns, its block ids loaded here (paged: in batch-row kb of the table BT)."""
        _copy_keys(LATP, ROPEP, _key_blocks(BT, kb, start, bt_keys, PAGE, BN), start, k_hi, s_lb, s_ls, s_rb, s_rs,
                   lat_dst, rope_dst, C0, NC, WITH_ROPE, PAGE, LAT, BN)

    @gluon.jit
    def _sequence(SEQ, S_DENSE, b64, s_bt, PAGE: gl.constexpr):
        """Sequence b64: (kb, its length). kb: its block-table row offset (paged) or batch row (dense, every sequence
        S_DENSE keys)."""
        if PAGE > 0:
            return b64 * s_bt, gl.load(SEQ + b64)
        else:
            return b64, S_DENSE
