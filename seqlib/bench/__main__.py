"""``python -m seqlib.bench SUITE [--repeats N]``: time seqlib against torch and plain MLX (or, on a Mac, its
Metal kernels against its MLX-ops path)."""

from __future__ import annotations

import argparse

import seqlib
from seqlib.bench import keep_large_buffers

SUITES = ("embedding", "recurrent", "kernels", "blas")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m seqlib.bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per implementation (median is reported)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke test")
    parser.add_argument("--emulate", action="store_true",
                        help="kernels suite: run the kernels through seqlib.emulation (validation, CPU timings)")
    args = parser.parse_args()
    if args.suite != "blas":  # the blas suite compares routed and plain processes itself
        seqlib.route_mlx_blas()  # MLX's matmuls on OpenBLAS, as the book runs them
    keep_large_buffers()  # MLX reuses large buffers instead of page-faulting fresh ones (see its docstring)
    if args.suite == "embedding":
        from seqlib.bench import embedding_suite

        embedding_suite.main(repeats=args.repeats or 15, quick=args.quick)
    elif args.suite == "recurrent":
        from seqlib.bench import recurrent_suite

        recurrent_suite.main(repeats=args.repeats or 7, quick=args.quick)
    elif args.suite == "kernels":
        from seqlib.bench import kernel_suite

        kernel_suite.main(repeats=args.repeats or 15, quick=args.quick, emulate=args.emulate)
    elif args.suite == "blas":
        from seqlib.bench import blas_suite

        blas_suite.main(repeats=args.repeats or 7, quick=args.quick)


if __name__ == "__main__":
    main()
