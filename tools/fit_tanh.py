"""Fit the rational tanh in ``seqlib/activations.py``: ``tanh(x) ~ x P(x^2) / Q(x^2)``.

P has degree 6 and Q degree 3 (in x^2), Q(0) = 1, fitted on [0, CLIP] by
iterated, reweighted linear least squares (Sanathanan-Koerner iteration with
Lawson weights pushing down the largest relative error).  The variable is scaled
by CLIP^2 while fitting so the normal equations stay well conditioned.
Prints the coefficients and the error of a float32 Horner evaluation.

    python tools/fit_tanh.py
"""

import numpy as np

CLIP = 7.90531110763549805  # beyond this, float32 tanh rounds to within 2 ulp of +-1
P_TERMS, Q_TERMS = 7, 3  # P: s^0..s^6, Q: 1 + s^1..s^3


def fit(iterations: int = 60):
    x = np.concatenate([np.linspace(0, 1, 4000), np.linspace(1, CLIP, 8000)])[1:]
    y = np.tanh(x)
    scale = CLIP * CLIP
    s = x * x / scale
    weights, q_values = np.ones_like(x), np.ones_like(x)
    for _ in range(iterations):
        # x P(s) - y (Q(s) - 1) = y, weighted by 1 / (y Q_prev(s)): the relative error of P/Q
        design = np.concatenate(
            [x[:, None] * s[:, None] ** np.arange(P_TERMS), -y[:, None] * s[:, None] ** np.arange(1, Q_TERMS + 1)],
            axis=1,
        )
        row_weights = weights / (y * q_values)
        solution, *_ = np.linalg.lstsq(design * row_weights[:, None], y * row_weights, rcond=None)
        p, q = solution[:P_TERMS], np.concatenate([[1.0], solution[P_TERMS:]])
        q_values = np.polyval(q[::-1], s)
        relative_error = np.abs(x * np.polyval(p[::-1], s) / q_values - y) / y
        weights = weights * (relative_error / relative_error.max()) ** 0.3 + 1e-3
        weights /= weights.mean()
    # undo the scaling of s
    return p / scale ** np.arange(P_TERMS), q / scale ** np.arange(Q_TERMS + 1), relative_error.max()


def tanh_float32(x, p, q):
    x = np.clip(x, np.float32(-CLIP), np.float32(CLIP))
    s = x * x
    numerator, denominator = np.float32(p[-1]), np.float32(q[-1])
    for c in p[-2::-1]:
        numerator = numerator * s + np.float32(c)
    for c in q[-2::-1]:
        denominator = denominator * s + np.float32(c)
    return x * numerator / denominator


if __name__ == "__main__":
    p, q, error64 = fit()
    print(f"max relative error in float64: {error64:.2e}")
    print("P =", ", ".join(f"{c:.17g}" for c in p))
    print("Q =", ", ".join(f"{c:.17g}" for c in q))
    grid = np.linspace(-20, 20, 4_000_001).astype(np.float32)
    exact = np.tanh(grid.astype(np.float64))
    error = np.abs(tanh_float32(grid, p, q) - exact)
    relative = (error / np.abs(exact).clip(1e-38)).max()
    print(f"float32 Horner: max abs error {error.max():.2e}, max relative {relative:.2e}")
