"""``python -m seqlib.bench blas``: what routing MLX's matmuls to OpenBLAS buys, and proof that torch keeps its speed.

Two measurements, each in fresh interpreters (the routing happens at import,
so it cannot be switched inside one process):

- an MLX float32 matmul against NumPy's, interleaved in one routed process
  (GFLOP/s; routed MLX should be within a small factor of NumPy's OpenBLAS);
- torch's matmul and ``nn.GRU`` forward in processes with the routing on and
  off (``SEQLIB_BLAS=1``/``0``), alternated, best of each: the routing must not
  change torch's speed.  A global OpenBLAS once captured torch's Fortran
  ``sgemm_`` and made its GRU 3x slower; ``tests/test_blas.py`` checks the
  mechanism (which library serves each BLAS symbol), this suite the speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import seqlib
from seqlib.bench import print_versions

MLX_AGAINST_NUMPY = """
    import json, time
    import seqlib, mlx.core as mx, numpy as np
    seqlib.route_mlx_blas()
    n = {size}
    a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b)
    a_np, b_np = np.array(a), np.array(b)
    mlx_times, numpy_times = [], []
    for _ in range({repeats}):  # interleaved, so a noisy neighbour hits both alike
        start = time.perf_counter(); mx.eval(a @ b); mlx_times.append(time.perf_counter() - start)
        start = time.perf_counter(); a_np @ b_np; numpy_times.append(time.perf_counter() - start)
    gflops = lambda times: 2 * n**3 / sorted(times)[len(times) // 2] / 1e9
    print(json.dumps({{"mlx": gflops(mlx_times), "numpy": gflops(numpy_times),
                      "routed": seqlib.blas_status().routed}}))
"""

TORCH_TIMING = """
    import json, time
    import seqlib, torch
    torch.manual_seed(0)
    a = torch.randn({size}, {size})
    gru = torch.nn.GRU(128, 256)
    x = torch.randn(50, 16, 128)
    def median_ms(fn, repeats={repeats}):
        times = []
        for _ in range(repeats):
            start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
        return 1e3 * sorted(times)[repeats // 2]
    with torch.no_grad():
        median_ms(lambda: gru(x), 2)
        print(json.dumps({{"matmul": median_ms(lambda: a @ a), "gru": median_ms(lambda: gru(x)),
                          "routed": seqlib.blas_status().routed}}))
"""


def _run(code: str, **env) -> dict:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"benchmark process failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout)


def main(repeats: int = 7, quick: bool = False) -> None:
    print_versions()
    print(f"routing: {seqlib.blas_status().reason}")
    size = 256 if quick else 1024
    speed = _run(MLX_AGAINST_NUMPY.format(size=size, repeats=repeats))
    print(f"\n{size}^3 float32 matmul, medians of {repeats}: MLX {speed['mlx']:.1f} GFLOP/s, "
          f"NumPy {speed['numpy']:.1f} GFLOP/s, MLX / NumPy = {speed['mlx'] / speed['numpy']:.2f}"
          f" ({'routed' if speed['routed'] else 'NOT routed'})")  # fmt: skip
    runs = {"routed": [], "plain": []}
    for _ in range(3):  # alternate the two kinds of process to share the machine's noise
        for kind, setting in (("routed", "1"), ("plain", "0")):
            runs[kind].append(_run(TORCH_TIMING.format(size=size, repeats=repeats), SEQLIB_BLAS=setting))
    print("\ntorch with seqlib's routing on and off (best of 3 processes each; noise only adds time):")
    for op, label in (("matmul", f"{size}^3 matmul"), ("gru", "nn.GRU(128, 256), T=50, B=16")):
        routed = min(run[op] for run in runs["routed"])
        plain = min(run[op] for run in runs["plain"])
        print(f"  {label:<30} {routed:8.2f} ms routed  {plain:8.2f} ms plain  routed / plain = {routed / plain:.2f}")
