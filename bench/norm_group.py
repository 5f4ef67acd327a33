"""DeepSeek-V2-Lite's two grouped projections that read an RMSNorm, on the gemv kernel at one row (H200, cold weights):
the linear alone, the norm kernel then the linear, and the norm as the gemv's prologue (with the residual add, with
and without writing the norm's output for other readers: ``hybrid::norm_linear(return_normed=True)``), every gemv
config of ``bench/linear.py --sweep``; prints the 8 fastest.

    python3 bench/norm_group.py        # GPU
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.linear import cold_weights, per_call_us, sweep_configs  # noqa: E402
from hybrid_kernels.linear.triton_gemv import GEMV, GEMV_NORM, linear_triton  # noqa: E402
from hybrid_kernels.linear.triton_norm import add_rms_norm_triton  # noqa: E402


def main() -> None:
    dev, dt, K = "cuda", torch.bfloat16, 2048
    for Ns in ([2816, 2816], [3072, 576]):  # shared experts' gate + up; q_proj + kv_a_proj_with_mqa
        ws, _ = cold_weights(sum(Ns), K, dev, dt, 7)
        ws = [(w[:Ns[0]], w[Ns[0]:]) for w in ws]
        C, R = len(ws), max(8, len(ws))
        x = torch.randn(1, K, device=dev, dtype=dt)
        r = torch.randn(1, K, device=dev, dtype=dt)
        nw = torch.ones(K, device=dev, dtype=dt)
        s, h = torch.empty_like(x), torch.empty_like(x)

        def normed(cfg, out):
            return per_call_us([lambda i=i: linear_triton(x, list(ws[i % C]), config=cfg,
                                                          norm=(nw, 1e-6, r, s, True, out)) for i in range(R)])
        plain = per_call_us([lambda i=i: linear_triton(x, list(ws[i % C]), config=GEMV) for i in range(R)])
        two = per_call_us([lambda i=i: linear_triton(add_rms_norm_triton(x, r, nw, 1e-6, True, dt)[0],
                                                     list(ws[i % C]), config=GEMV) for i in range(R)])
        res = [(normed(cfg, out), out is not None, cfg) for cfg in [GEMV_NORM] + sweep_configs(1, 2)
               for out in (None, h)]
        print(Ns, f"plain {plain:.2f} norm-kernel+plain {two:.2f} GEMV_NORM {res[0][0]:.2f} (+h {res[1][0]:.2f})")
        for t, hh, cfg in sorted(res, key=lambda a: a[0])[:8]:
            print(f"  {t:.2f} h={hh} {cfg}")


if __name__ == "__main__":
    main()
