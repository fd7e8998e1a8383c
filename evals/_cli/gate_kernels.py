"""``gate kernels``: will the engine run this checkpoint's MoE on a tuned kernel (aiter, Triton)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from quant import kernels
    from quant.engines import serving

    p = sub.add_parser("kernels", help="will the engine run this checkpoint's MoE on a tuned kernel (aiter, Triton)",
                       description=kernels.HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    kernels.add_arguments(p)
    serving.add_arguments(p)
    p.set_defaults(func=kernels.run_cli)
