"""seqlib.notebook.below: the machine-independent way chapters print an error against a reference."""

import math

import mlx.core as mx
import numpy as np
import pytest

from seqlib.kernels import generated_source, kernel_header
from seqlib.notebook import below, show_kernel


@pytest.mark.parametrize("error", [0.0, 4.47e-8, -9.9e-7, [3e-8, -7e-7], mx.array([1e-8, 2e-7])])
def test_errors_under_the_bound_print_only_the_bound(error):
    assert below(error, 1e-6) == "< 1e-06"


@pytest.mark.parametrize(
    ("error", "shown"),
    [(1e-6, "1.0e-06"), ([0.0, -2e-3], "2.0e-03"), (mx.array([[1.0, -5.0]]), "5.0e+00"), (math.inf, "inf")],
)
def test_errors_at_or_over_the_bound_show_themselves(error, shown):
    assert below(error, 1e-6) == f"= {shown}, ABOVE the bound 1e-06"


def test_nan_never_passes():
    assert "ABOVE" in below(np.array([0.0, np.nan]), 1.0)


def test_show_kernel_is_the_generated_source_with_or_without_the_shared_header():
    full = generated_source("gru_cell", mx.float16)
    assert show_kernel("gru_cell", mx.float16).data == full
    short = show_kernel("gru_cell", mx.float16, header=False).data
    assert kernel_header() in full and kernel_header() not in short
    assert short.splitlines()[0].startswith("// ... seqlib_math.h")
    assert short.endswith(full[len(kernel_header()):])  # signature and body untouched
