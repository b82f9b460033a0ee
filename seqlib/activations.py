r"""``tanh`` and ``sigmoid`` from multiplies, adds and one divide: the recurrent layers' gate functions.

Why not ``mx.tanh``?  On x86 CPUs MLX evaluates ``exp``/``tanh``/``sigmoid`` one
element at a time (15-20 ns per element on an AVX2 server with MLX 0.32: time
``mx.eval(mx.tanh(x))`` for a million-element ``x`` to see it on yours), and an
LSTM step spends most of its time there.  A rational function needs only the
arithmetic that compilers vectorise, and ``mx.compile`` fuses it into one loop:

.. math::

    \tanh(x) \approx x \, \frac{P(x^2)}{Q(x^2)} \quad \text{for } |x| \le 7.905\ldots, \qquad \pm 1 \text{ beyond},

with P of degree 6 and Q of degree 3 in ``x^2``, fitted by ``tools/fit_tanh.py``
(max relative error 1.6e-9 in exact arithmetic; evaluated in float32 the
rounding dominates: at most 3.8e-7 absolute and relative, against 1e-7 for
``mx.tanh``).  The logistic sigmoid follows from ``sigmoid(x) = (1 + tanh(x/2)) / 2``
(absolute error at most 2.4e-7; far in the negative tail, where the sigmoid
is below 1e-7, the *relative* error grows, which the gates never notice).

Derivatives come from the outputs (``1 - tanh^2``, ``s (1 - s)``), so the
backward never needs these approximations' own derivatives.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["TANH_CLIP", "fast_sigmoid", "fast_tanh"]

#: Where :func:`fast_tanh` stops the rational function (beyond it, float32 tanh is within 2 ulp of +-1).
TANH_CLIP = 7.90531110763549805

# Coefficients of P and Q, lowest power of x^2 first (from tools/fit_tanh.py).
_P = (
    0.99999999846087562, 0.13127960818606593, 0.0031534538885072843, 1.1687376471272515e-05,
    -2.2515741118421894e-08, 6.4773125632460462e-11, -1.1907169347536057e-13,
)  # fmt: skip
_Q = (1.0, 0.46461292548968347, 0.024691123530499584, 0.00026190431069089969)


def _tanh_ratio(x: mx.array) -> mx.array:
    """x P(x^2) / Q(x^2), with the polynomials evaluated by Estrin's scheme (pairs of terms, then
    powers s^2, s^4): a shallower expression than Horner's, which ``mx.compile`` fuses into one loop."""
    s = x * x
    s2 = s * s
    s4 = s2 * s2
    p = (_P[0] + _P[1] * s) + s2 * (_P[2] + _P[3] * s) + s4 * ((_P[4] + _P[5] * s) + s2 * _P[6])
    q = (_Q[0] + _Q[1] * s) + s2 * (_Q[2] + _Q[3] * s)
    return x * p / q


def _as_real_array(x) -> mx.array:
    """``x`` as a floating MLX array, taking what ``mx.tanh`` takes: integers and bools become float32
    (squaring them as integers would overflow), complex input is refused."""
    if not isinstance(x, mx.array):
        try:
            x = mx.array(x)
        except (TypeError, ValueError) as error:
            raise TypeError(f"x: expected an mlx.core.array or a number, got {type(x).__name__}") from error
    if mx.issubdtype(x.dtype, mx.complexfloating):
        raise TypeError(f"x: expected a real dtype, got {x.dtype}")
    if not mx.issubdtype(x.dtype, mx.floating):
        x = x.astype(mx.float32)
    return x


def fast_tanh(x: mx.array) -> mx.array:
    """tanh(x) to within 3.8e-7, from arithmetic only; exactly +-1 beyond ``|x| = TANH_CLIP``, NaN stays NaN.

    The ratio grows like x^7 outside the fitted range (and overflows for huge x), so it is replaced
    there with a select; a select, unlike ``mx.clip``, leaves the compiled loop vectorisable."""
    x = _as_real_array(x)
    if x.dtype in (mx.float16, mx.bfloat16):  # too few bits for the polynomials: compute in float32
        return fast_tanh(x.astype(mx.float32)).astype(x.dtype)
    ratio = _tanh_ratio(x)
    return mx.where(x > TANH_CLIP, 1.0, mx.where(x < -TANH_CLIP, -1.0, ratio))


def fast_sigmoid(x: mx.array) -> mx.array:
    """The logistic sigmoid 1 / (1 + exp(-x)) to within 2.4e-7, as (1 + tanh(x/2)) / 2."""
    return 0.5 * fast_tanh(0.5 * _as_real_array(x)) + 0.5
