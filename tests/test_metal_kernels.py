"""Every Metal kernel, forward and backward, run in the C++ emulation of Metal and checked against NumPy/torch.

Each kernel runs under several thread orders (forward, reverse, random) with
outputs pre-filled with NaN and guard zones around every buffer, on grids
that are exact (partial threadgroups at the edges) and padded to whole
threadgroups (extra threads must do nothing): a missing barrier, an unwritten
element or a stray read or write fails.  Then the modules run their Metal
path on top of the emulation and are held to torch, reusing the hypothesis
tests of the MLX-ops path.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from emulated import REAL_METAL, launch_count, metal_backend
from seqlib import emulation
from test_cells import cell_cases
from test_cells import test_cells_match_torch_outputs_and_all_gradients as cell_test
from test_embedding import lookups
from test_embedding import test_module_matches_torch_output_gradient_and_renormalised_weight as lookup_test
from test_embedding_bag import bag_cases
from test_embedding_bag import test_matches_torch_output_gradients_and_renormalised_weight as bag_test
from test_recurrent_layers import layer_cases
from test_recurrent_layers import test_layers_match_torch_outputs_states_and_all_gradients as layer_test
from test_sparse import batches
from test_sparse import test_sparse_gradient_matches_torchs_coalesced_sparse_grad_and_the_dense_gradient as sparse_test

import seqlib
from seqlib import kernels, scan

pytestmark = pytest.mark.metal_emulation

# (thread order, pad the grid to whole threadgroups)
SCHEDULES = [("forward", False), ("reverse", True), ("random", False), ("random", True)]
# (B, H): one element; H not a multiple of 32; partial threadgroups (groups are 64 x 4); several groups
CELL_SHAPES = [(1, 1), (1, 33), (5, 70), (9, 130)]


def random(shape, seed, scale=1.0):
    return mx.array(np.random.default_rng(seed).normal(0, scale, shape).astype(np.float32))


def torch_of(array):
    return torch.tensor(np.array(array), dtype=torch.float64, requires_grad=True)


def close(ours, theirs, atol=2e-6, rtol=2e-6, what=""):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else theirs
    np.testing.assert_allclose(np.array(ours), theirs, rtol=rtol, atol=atol, err_msg=what)


# ----------------------------------------------------------------- cells against torch autograd


def lstm_cell_torch(gates, c_prev):
    """torch's LSTM step on pre-activations (B, 4H), gates in the order i, f, g, o: h, c, activations, tanh(c)."""
    i, f, g, o = gates.chunk(4, dim=1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    c = f * c_prev + i * g
    return o * torch.tanh(c), c, torch.cat([i, f, g, o], 1), torch.tanh(c)


def gru_cell_torch(input_side, hidden_side, h_prev):
    """torch's GRU step from both sides' pre-activations (B, 3H), gates r, z, n: h and the activations."""
    input_r, input_z, input_n = input_side.chunk(3, dim=1)
    hidden_r, hidden_z, hidden_n = hidden_side.chunk(3, dim=1)
    r, z = torch.sigmoid(input_r + hidden_r), torch.sigmoid(input_z + hidden_z)
    n = torch.tanh(input_n + r * hidden_n)
    return (1 - z) * n + z * h_prev, torch.cat([r, z, n], 1)


def rnn_cell_torch(pre, nonlinearity):
    return torch.tanh(pre) if nonlinearity == "tanh" else torch.relu(pre)


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize(("batch", "hidden_size"), CELL_SHAPES)
def test_lstm_cell_forward_and_backward_match_torch(order, pad_grid, batch, hidden_size):
    gates, c_prev = random((batch, 4 * hidden_size), 0, 3.0), random((batch, hidden_size), 1)
    d_h, d_c = random((batch, hidden_size), 2), random((batch, hidden_size), 3)
    with metal_backend(order, pad_grid):
        h, c, activations, tanh_c = kernels.lstm_pointwise(gates, c_prev)
        d_gates, d_c_prev = kernels.lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev)
    gates_t, c_prev_t = torch_of(gates), torch_of(c_prev)
    h_t, c_t, activations_t, tanh_c_t = lstm_cell_torch(gates_t, c_prev_t)
    for ours, theirs, what in [(h, h_t, "h"), (c, c_t, "c"), (tanh_c, tanh_c_t, "tanh_c"),
                               (activations, activations_t, "activations")]:  # fmt: skip
        close(ours, theirs, what=what)
    torch.autograd.backward([h_t, c_t], [torch_of(d_h), torch_of(d_c)])
    close(d_gates, gates_t.grad, what="d_gates")
    close(d_c_prev, c_prev_t.grad, what="d_c_prev")


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize(("batch", "hidden_size"), CELL_SHAPES)
def test_gru_cell_forward_and_backward_match_torch(order, pad_grid, batch, hidden_size):
    input_side, hidden_side = random((batch, 3 * hidden_size), 0, 2.0), random((batch, 3 * hidden_size), 1, 2.0)
    h_prev, d_h = random((batch, hidden_size), 2), random((batch, hidden_size), 3)
    with metal_backend(order, pad_grid):
        h, activations = kernels.gru_pointwise(input_side, hidden_side, h_prev)
        d_input, d_hidden, d_h_prev = kernels.gru_pointwise_backward(d_h, activations, hidden_side, h_prev)
    input_t, hidden_t, h_prev_t = torch_of(input_side), torch_of(hidden_side), torch_of(h_prev)
    h_t, activations_t = gru_cell_torch(input_t, hidden_t, h_prev_t)
    close(h, h_t, what="h")
    close(activations, activations_t, what="activations")
    h_t.backward(torch_of(d_h))
    close(d_input, input_t.grad, what="d_input_side")
    close(d_hidden, hidden_t.grad, what="d_hidden_side")
    close(d_h_prev, h_prev_t.grad, what="d_h_prev")


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
@pytest.mark.parametrize(("batch", "hidden_size"), CELL_SHAPES)
def test_rnn_cell_forward_and_backward_match_torch(order, pad_grid, nonlinearity, batch, hidden_size):
    pre, d_h = random((batch, hidden_size), 0, 2.0), random((batch, hidden_size), 1)
    with metal_backend(order, pad_grid):
        h = kernels.rnn_activation(pre, nonlinearity)
        d_pre = kernels.rnn_activation_backward(d_h, h, nonlinearity)
    pre_t = torch_of(pre)
    h_t = rnn_cell_torch(pre_t, nonlinearity)
    h_t.backward(torch_of(d_h))
    close(h, h_t, what="h")
    close(d_pre, pre_t.grad, what="d_pre")


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_cell_keeps_signed_zeros_infinities_and_nan_as_torch(nonlinearity):
    """torch: relu(-0) = -0 and relu(NaN) = NaN (tanh keeps both too); the relu gradient passes at NaN, not at 0."""
    pre = mx.array([[-0.0, 0.0, np.nan, -2.0, 3.0, -np.inf, np.inf]])
    d_h = mx.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    with metal_backend():
        h = kernels.rnn_activation(pre, nonlinearity)
        d_pre = kernels.rnn_activation_backward(d_h, h, nonlinearity)
    pre_t = torch_of(pre)
    h_t = rnn_cell_torch(pre_t, nonlinearity)
    h_t.backward(torch_of(d_h))
    for ours, theirs, what in [(h, h_t, "h"), (d_pre, pre_t.grad, "d_pre")]:
        ours, theirs = np.array(ours, np.float64), theirs.detach().numpy()
        close(ours, theirs, what=what)  # NaN where torch has NaN
        numbers = ~np.isnan(theirs)
        np.testing.assert_array_equal(np.signbit(ours[numbers]), np.signbit(theirs[numbers]), err_msg=what)


# ----------------------------------------------------------------- whole-sequence kernels


def packed_case(batch_sizes, hidden_size, gate_blocks, seed=0):
    rows = sum(batch_sizes)
    return (
        random((rows, gate_blocks * hidden_size), seed, 1.0),
        random((gate_blocks * hidden_size, hidden_size), seed + 1, 0.5 / np.sqrt(hidden_size)),
        random((batch_sizes[0], hidden_size), seed + 2),
    )


# (batch_sizes, H): one unit; packed, H not a multiple of 32; equal lengths; H > 256 threads: a thread loads, stores
# and (one thread per unit) computes several units
SEQUENCE_CASES = [((1,), 1), ((3, 3, 2, 1), 33), ((2, 2, 2), 70), ((5, 4, 4, 1, 1), 40), ((2, 1), 300)]


def _ops_sequence(function, *arguments):
    """The ops path's custom function outputs: (output, h_n, c_n) and the four packed saved arrays."""
    with kernels.use_backend("ops"):
        outputs = function(*arguments)
    return list(outputs[:3]), list(outputs[3:])


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize("version", ["simd", "simple"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("batch_sizes", "hidden_size"), SEQUENCE_CASES)
def test_lstm_sequence_kernel_matches_the_ops_path_and_saves_what_the_backward_needs(
    order, pad_grid, version, reverse, batch_sizes, hidden_size
):
    x_gates, w_hh, h0 = packed_case(batch_sizes, hidden_size, 4)
    c0 = random(h0.shape, 9)
    with metal_backend(order, pad_grid):
        output, h_n, c_n, activations, tanh_c, c_prev, h_prev = kernels.lstm_sequence_forward(
            x_gates, w_hh, h0, c0, batch_sizes, reverse, version
        )
    function = scan._lstm_sequence_function(batch_sizes, reverse, False, False)
    (want_output, want_h, want_c), saved = _ops_sequence(function, x_gates, w_hh, h0, c0)
    for ours, theirs, what in zip(
        [output, h_n, c_n, activations, tanh_c, c_prev, h_prev],
        [want_output, want_h, want_c, *saved],
        ["output", "h_n", "c_n", "activations", "tanh_c", "c_prev", "h_prev"],
        strict=True,
    ):
        close(ours, theirs, atol=3e-6, what=what)


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("batch_sizes", "hidden_size"), SEQUENCE_CASES)
def test_gru_sequence_kernel_matches_the_ops_path_and_saves_what_the_backward_needs(
    order, pad_grid, reverse, batch_sizes, hidden_size
):
    x_gates, w_hh, h0 = packed_case(batch_sizes, hidden_size, 3)
    b_hh = random((3 * hidden_size,), 7)
    with metal_backend(order, pad_grid):
        output, h_n, activations, hidden_side, h_prev = kernels.gru_sequence_forward(
            x_gates, w_hh, b_hh, h0, batch_sizes, reverse
        )
    function = scan._gru_sequence_function(batch_sizes, reverse, False)
    with kernels.use_backend("ops"):
        outputs = function(x_gates, w_hh, b_hh, h0)
    saved = outputs[2:]  # activations, hidden_side, h_prev: packed rows in time order
    for ours, theirs, what in zip(
        [output, h_n, activations, hidden_side, h_prev],
        [outputs[0], outputs[1], *saved],
        ["output", "h_n", "activations", "hidden_side", "h_prev"],
        strict=True,
    ):
        close(ours, theirs, atol=3e-6, what=what)


def test_sequence_kernels_refuse_what_their_threadgroup_memory_cannot_hold():
    x_gates, w_hh, h0 = packed_case((1,), 1025, 4)
    with metal_backend(), pytest.raises(ValueError, match="hidden_size <= 1024"):
        kernels.lstm_sequence_forward(x_gates, w_hh, h0, h0, (1,))
    x_gates, w_hh, h0 = packed_case((2, 1), 4, 4)
    with metal_backend(), pytest.raises(ValueError, match="batch_sizes"):
        kernels.lstm_sequence_forward(x_gates, w_hh, h0, h0, (1, 2))
    with metal_backend(), pytest.raises(ValueError, match="version"):
        kernels.lstm_sequence_forward(x_gates, w_hh, h0, h0, (2, 1), version="fast")


# ----------------------------------------------------------------- embeddings


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf"), 3.0])
@pytest.mark.parametrize("embedding_dim", [1, 33, 100, 1100])
def test_renorm_scales_match_torch_norms(order, pad_grid, norm_type, embedding_dim):
    weight = random((6, embedding_dim), 0, 0.3)
    rows = mx.array([5, 0, 3], mx.int32)
    max_norm = 0.9 * float(np.linalg.norm(np.array(weight[3]), ord=norm_type))  # row 3 just outside the ball
    with metal_backend(order, pad_grid):
        scale = kernels.embedding_renorm_scales(weight, rows, max_norm, norm_type)
    norms = torch.linalg.vector_norm(torch.tensor(np.array(weight))[[5, 0, 3]], ord=norm_type, dim=1)
    want = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
    assert float(want.min()) < 1  # some rows are rescaled, so the comparison can fail
    close(scale, want.numpy(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf"), 3.0])
def test_renorm_leaves_a_row_on_the_sphere_and_scales_tiny_rows_as_torch(order, pad_grid, norm_type):
    """Rows of +-2^-14 (norms exact in float32 for p = 1, 2, inf): one exactly on the sphere keeps its scale of 1
    (only norms above max_norm shrink), and where norms are ~1e-4 torch's + 1e-7 in the divisor shows."""
    signs = np.where(np.random.default_rng(0).random((2, 100)) < 0.5, -1.0, 1.0)
    weight = mx.array((signs * np.array([[1.0], [2.0]]) * 2.0**-14).astype(np.float32))  # row 1 = 2 x row 0 in size
    norms = torch.linalg.vector_norm(torch.tensor(np.array(weight), dtype=torch.float64), ord=norm_type, dim=1)
    max_norm = float(norms[0]) * (0.75 if norm_type == 3.0 else 1.0)  # the pow norm is not exact: no sphere
    with metal_backend(order, pad_grid):
        scale = kernels.embedding_renorm_scales(weight, mx.array([0, 1], mx.int32), max_norm, norm_type)
    want = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms)).numpy()
    assert want[1] < 1 - 1e-4  # rescaled, and 1e-7 / norm is far above float32 rounding
    if norm_type != 3.0:
        assert float(scale[0]) == want[0] == 1.0
    close(scale, want, atol=0, rtol=1e-5)


def bag_inputs(seed=0):
    rng = np.random.default_rng(seed)
    indices = mx.array(rng.integers(0, 7, 23).astype(np.int32))
    offsets = mx.array(np.array([0, 0, 4, 5, 11, 11, 23], np.int32))  # bounds: empty bags, a bag of one, a long bag
    return random((7, 70), seed), indices, offsets, random((23,), seed + 1)  # D > 64: padded grids overhang in x


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize(("mode", "padding_idx"), [("sum", None), ("sum", 2), ("mean", 4), ("max", None), ("max", 1)])
def test_bag_kernels_forward_and_gradients_match_torch(order, pad_grid, mode, padding_idx):
    weight, indices, offsets, per_sample_weights = bag_inputs(1)
    weighted = mode == "sum"
    bounds = np.array(offsets).astype(np.int64)
    table = torch.tensor(np.array(weight), requires_grad=True)
    psw = torch.tensor(np.array(per_sample_weights), requires_grad=True)
    out = torch.nn.functional.embedding_bag(
        torch.tensor(np.array(indices).astype(np.int64)), table, torch.tensor(bounds),
        mode=mode, include_last_offset=True, per_sample_weights=psw if weighted else None, padding_idx=padding_idx,
    )  # fmt: skip
    d_out = random(out.shape, 3)
    (out * torch.tensor(np.array(d_out))).sum().backward()

    def loss(table, sample_weights):
        bags = kernels.embedding_bag(indices, table, offsets, mode, sample_weights if weighted else None, True,
                                     padding_idx)
        return (bags * d_out).sum(), bags

    with metal_backend(order, pad_grid):
        (_, bags), grads = mx.value_and_grad(loss, argnums=(0, 1))(weight, per_sample_weights)
    close(bags, out, what="bags")
    close(grads[0], table.grad, atol=1e-5, rtol=1e-5, what="d_weight")
    if weighted:
        close(grads[1], psw.grad, atol=1e-5, rtol=1e-5, what="d_per_sample_weights")


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
def test_max_bags_keep_the_first_of_equal_values_as_torch(order, pad_grid):
    """Ties go to the first entry, as in torch: its value (-0 before 0 stays -0) and its row gets the gradient."""
    weight = mx.array([[1.0, 2.0], [1.0, 2.0], [0.5, 3.0], [-0.0, 0.0], [0.0, -0.0]])
    indices, offsets = mx.array([0, 1, 2, 3, 4, 4, 3], mx.int32), mx.array([0, 3, 5], mx.int32)
    d_out = mx.array([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]])
    table = torch_of(weight)
    out = torch.nn.functional.embedding_bag(torch.tensor(np.array(indices).astype(np.int64)), table,
                                            torch.tensor(np.array(offsets).astype(np.int64)), mode="max")  # fmt: skip
    out.backward(torch_of(d_out))

    def loss(table):
        bags = kernels.embedding_bag(indices, table, offsets, "max")
        return (bags * d_out).sum(), bags

    with metal_backend(order, pad_grid):
        (_, bags), grad = mx.value_and_grad(loss)(weight)
    np.testing.assert_array_equal(np.array(bags), out.detach().numpy())
    np.testing.assert_array_equal(np.signbit(np.array(bags)), np.signbit(out.detach().numpy()))
    np.testing.assert_array_equal(np.array(grad), table.grad.numpy())


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
def test_lookup_kernels_gather_and_scatter_add_with_padding_and_frequency_scaling(order, pad_grid):
    weight = random((9, 70), 0)  # D > 64 and not a multiple of it: padded grids overhang in x
    indices = mx.array([[3, 1, 3], [8, 0, 3]], mx.int32)
    d_out = random((2, 3, 70), 1)
    table = torch.tensor(np.array(weight), requires_grad=True)
    out = torch.nn.functional.embedding(
        torch.tensor(np.array(indices).astype(np.int64)), table, padding_idx=1, scale_grad_by_freq=True
    )
    (out * torch.tensor(np.array(d_out))).sum().backward()
    with metal_backend(order, pad_grid):
        grad = mx.grad(
            lambda w: (seqlib.functional.embedding(indices, w, padding_idx=1, scale_grad_by_freq=True) * d_out).sum()
        )(weight)  # fmt: skip
        gathered = seqlib.functional.embedding(indices, weight)
    close(gathered, out, what="lookup")
    close(grad, table.grad, atol=1e-6, what="d_weight")


# ----------------------------------------------------------------- half precision
#
# Every kernel whose storage type T can be float16 or bfloat16, in both, held to torch in float64 on the same
# (already rounded) inputs.  The kernels read T, compute in float32 and round each output once, so a forward
# output is within half an ulp of the exact value: |ours - exact| <= eps * max |exact|, eps the format's
# machine epsilon ("1 ulp of the output's magnitude"; half of it is what rounding allows).  The cell backwards
# also read saved activations rounded to T, which costs up to about one ulp more; sums of atomics and dot
# products run in float32.  Copies (a lookup, the winner of a max bag) are exact.

HALF_FORMATS = [pytest.param(mx.float16, 2.0**-10, id="float16"), pytest.param(mx.bfloat16, 2.0**-7, id="bfloat16")]


def in_format(array, dtype):
    """``array`` rounded to ``dtype``: the inputs the kernel sees, and, exactly, the reference's."""
    return array.astype(dtype)


def exact_of(array):
    """A float64 torch tensor (with grad) holding the values of a float16/bfloat16/float32 array exactly."""
    return torch_of(array.astype(mx.float32))


def within_ulps(ours, exact, dtype, eps, ulps, what):
    """``ours`` has dtype ``dtype`` and lies within ``ulps * eps`` of ``exact``'s magnitude (its largest |value|)."""
    assert ours.dtype == dtype, f"{what}: {ours.dtype}, expected {dtype}"
    exact = exact.detach().numpy() if isinstance(exact, torch.Tensor) else np.asarray(exact, np.float64)
    error = np.abs(np.array(ours.astype(mx.float32), np.float64) - exact).max()
    bound = ulps * eps * np.abs(exact).max()
    assert error <= bound, f"{what}: off by {error:.3g}, more than {ulps} ulp(s) of its magnitude ({bound:.3g})"


@pytest.mark.parametrize(("dtype", "eps"), HALF_FORMATS)
def test_half_precision_lstm_cell_and_backward_match_torch(dtype, eps):
    gates, c_prev = in_format(random((5, 4 * 70), 0, 3.0), dtype), in_format(random((5, 70), 1), dtype)
    d_h, d_c = in_format(random((5, 70), 2), dtype), in_format(random((5, 70), 3), dtype)
    with metal_backend("random", True):
        h, c, activations, tanh_c = kernels.lstm_pointwise(gates, c_prev)
        d_gates, d_c_prev = kernels.lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev)
    gates_t, c_prev_t = exact_of(gates), exact_of(c_prev)
    exact = lstm_cell_torch(gates_t, c_prev_t)
    names = ["h", "c", "activations", "tanh_c"]
    for ours, theirs, what in zip([h, c, activations, tanh_c], exact, names, strict=True):
        within_ulps(ours, theirs, dtype, eps, 1, what)
    torch.autograd.backward(exact[:2], [exact_of(d_h), exact_of(d_c)])
    within_ulps(d_gates, gates_t.grad, dtype, eps, 2, "d_gates")
    within_ulps(d_c_prev, c_prev_t.grad, dtype, eps, 2, "d_c_prev")


@pytest.mark.parametrize(("dtype", "eps"), HALF_FORMATS)
def test_half_precision_gru_cell_and_backward_match_torch(dtype, eps):
    input_side, hidden_side = (in_format(random((5, 3 * 70), seed, 2.0), dtype) for seed in (0, 1))
    h_prev, d_h = (in_format(random((5, 70), seed), dtype) for seed in (2, 3))
    with metal_backend("random", True):
        h, activations = kernels.gru_pointwise(input_side, hidden_side, h_prev)
        d_input, d_hidden, d_h_prev = kernels.gru_pointwise_backward(d_h, activations, hidden_side, h_prev)
    input_t, hidden_t, h_prev_t = exact_of(input_side), exact_of(hidden_side), exact_of(h_prev)
    h_t, activations_t = gru_cell_torch(input_t, hidden_t, h_prev_t)
    within_ulps(h, h_t, dtype, eps, 1, "h")
    within_ulps(activations, activations_t, dtype, eps, 1, "activations")
    h_t.backward(exact_of(d_h))
    for ours, theirs, what in [(d_input, input_t.grad, "d_input_side"), (d_hidden, hidden_t.grad, "d_hidden_side"),
                               (d_h_prev, h_prev_t.grad, "d_h_prev")]:  # fmt: skip
        within_ulps(ours, theirs, dtype, eps, 2, what)


@pytest.mark.parametrize(("dtype", "eps"), HALF_FORMATS)
def test_half_precision_rnn_cell_and_backward_match_torch(dtype, eps):
    """tanh (relu only copies or zeroes values, whatever their format)."""
    pre, d_h = in_format(random((5, 70), 0, 2.0), dtype), in_format(random((5, 70), 1), dtype)
    with metal_backend("random", True):
        h = kernels.rnn_activation(pre, "tanh")
        d_pre = kernels.rnn_activation_backward(d_h, h, "tanh")
    pre_t = exact_of(pre)
    h_t = rnn_cell_torch(pre_t, "tanh")
    h_t.backward(exact_of(d_h))
    within_ulps(h, h_t, dtype, eps, 1, "h")
    within_ulps(d_pre, pre_t.grad, dtype, eps, 2, "d_pre")


def _sequence_rows(batch_sizes, reverse):
    """Each sequence b of a packed batch with its rows, in the order its recurrence visits them."""
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)[:-1]])
    for b in range(batch_sizes[0]):
        rows = [int(offsets[t]) + b for t, size in enumerate(batch_sizes) if size > b]
        yield b, rows[::-1] if reverse else rows


def lstm_sequence_torch(x_gates, w_hh, h0, c0, batch_sizes, reverse):
    """The packed LSTM recurrence, one sequence and step at a time with torch's cell:
    output, h_n, c_n and the saved activations, tanh_c, c_prev, h_prev, as lstm_sequence_forward returns them."""
    saved = {name: [None] * x_gates.shape[0] for name in ("output", "activations", "tanh_c", "c_prev", "h_prev")}
    h_n, c_n = [], []
    for b, rows in _sequence_rows(batch_sizes, reverse):
        h, c = h0[b:b + 1], c0[b:b + 1]
        for row in rows:
            saved["h_prev"][row], saved["c_prev"][row] = h, c
            h, c, saved["activations"][row], saved["tanh_c"][row] = lstm_cell_torch(x_gates[row:row + 1] + h @ w_hh.T,
                                                                                      c)  # fmt: skip
            saved["output"][row] = h
        h_n.append(h)
        c_n.append(c)
    rows = [torch.cat(saved[name]) for name in ("output", "activations", "tanh_c", "c_prev", "h_prev")]
    return rows[0], torch.cat(h_n), torch.cat(c_n), *rows[1:]


def gru_sequence_torch(x_gates, w_hh, b_hh, h0, batch_sizes, reverse):
    """The packed GRU recurrence with torch's cell: output, h_n, activations, hidden_side, h_prev."""
    saved = {name: [None] * x_gates.shape[0] for name in ("output", "activations", "hidden_side", "h_prev")}
    h_n = []
    for b, rows in _sequence_rows(batch_sizes, reverse):
        h = h0[b:b + 1]
        for row in rows:
            saved["h_prev"][row], saved["hidden_side"][row] = h, h @ w_hh.T + b_hh
            h, saved["activations"][row] = gru_cell_torch(x_gates[row:row + 1], saved["hidden_side"][row], h)
            saved["output"][row] = h
        h_n.append(h)
    rows = [torch.cat(saved[name]) for name in ("output", "activations", "hidden_side", "h_prev")]
    return rows[0], torch.cat(h_n), *rows[1:]


@pytest.mark.parametrize(("dtype", "eps"), HALF_FORMATS)
@pytest.mark.parametrize("version", ["simd", "simple"])
def test_half_precision_lstm_sequence_matches_torch(version, dtype, eps):
    batch_sizes = (3, 3, 2, 1)
    x_gates, w_hh, h0 = (in_format(array, dtype) for array in packed_case(batch_sizes, 33, 4))
    c0 = in_format(random(h0.shape, 9), dtype)
    with metal_backend("random", True):
        ours = kernels.lstm_sequence_forward(x_gates, w_hh, h0, c0, batch_sizes, True, version)
    exact = lstm_sequence_torch(*(exact_of(array) for array in (x_gates, w_hh, h0, c0)), batch_sizes, True)
    names = ["output", "h_n", "c_n", "activations", "tanh_c", "c_prev", "h_prev"]
    for ours_array, theirs, what in zip(ours, exact, names, strict=True):
        within_ulps(ours_array, theirs, dtype, eps, 1, what)


@pytest.mark.parametrize(("dtype", "eps"), HALF_FORMATS)
def test_half_precision_gru_sequence_matches_torch(dtype, eps):
    batch_sizes = (3, 3, 2, 1)
    x_gates, w_hh, h0 = (in_format(array, dtype) for array in packed_case(batch_sizes, 33, 3))
    b_hh = in_format(random((3 * 33,), 7), dtype)
    with metal_backend("random", True):
        ours = kernels.gru_sequence_forward(x_gates, w_hh, b_hh, h0, batch_sizes, True)
    exact = gru_sequence_torch(*(exact_of(array) for array in (x_gates, w_hh, b_hh, h0)), batch_sizes, True)
    for ours_array, theirs, what in zip(ours, exact, ["output", "h_n", "activations", "hidden_side", "h_prev"],
                                        strict=True):  # fmt: skip
        within_ulps(ours_array, theirs, dtype, eps, 1, what)


@pytest.mark.parametrize(("dtype", "eps"), HALF_FORMATS)
def test_half_precision_embedding_gather_and_backward_match_torch(dtype, eps):
    weight, d_out = in_format(random((9, 70), 0), dtype), in_format(random((2, 3, 70), 1), dtype)
    indices = mx.array([[3, 1, 3], [8, 0, 3]], mx.int32)
    table = exact_of(weight)
    out = torch.nn.functional.embedding(
        torch.tensor(np.array(indices).astype(np.int64)), table, padding_idx=1, scale_grad_by_freq=True
    )
    (out * exact_of(d_out)).sum().backward()
    with metal_backend("random", True):
        grad = mx.grad(
            lambda w: (seqlib.functional.embedding(indices, w, padding_idx=1, scale_grad_by_freq=True) * d_out).sum()
        )(weight)  # fmt: skip
        gathered = seqlib.functional.embedding(indices, weight)
    within_ulps(gathered, out, dtype, eps, 0, "lookup")  # a copy: exact
    within_ulps(grad, table.grad, dtype, eps, 1, "d_weight")


@pytest.mark.parametrize(("dtype", "eps"), HALF_FORMATS)
def test_half_precision_embedding_renorm_matches_torch(dtype, eps):
    """The 2-norm of rows stored in T (the other norms read T the same way); the scales are float32 whatever T."""
    weight = in_format(random((6, 1100), 0, 0.3), dtype)
    rows = mx.array([5, 0, 3], mx.int32)
    norms = torch.linalg.vector_norm(exact_of(weight)[[5, 0, 3]], dim=1).detach()
    max_norm = 0.9 * float(norms[2])  # row 3 just outside the ball
    with metal_backend("random", True):
        scale = kernels.embedding_renorm_scales(weight, rows, max_norm, 2.0)
    want = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
    assert scale.dtype == mx.float32 and float(want.min()) < 1
    close(scale, want.numpy(), atol=2e-6, rtol=1e-5)  # float32's tolerance, as in the float32 test


@pytest.mark.parametrize(("dtype", "eps"), HALF_FORMATS)
@pytest.mark.parametrize(("mode", "padding_idx"), [("sum", 2), ("mean", 4), ("max", 1)])
def test_half_precision_embedding_bag_and_gradients_match_torch(mode, padding_idx, dtype, eps):
    weight, indices, offsets, per_sample_weights = bag_inputs(1)
    weight, per_sample_weights = in_format(weight, dtype), in_format(per_sample_weights, dtype)
    weighted = mode == "sum"
    table, psw = exact_of(weight), exact_of(per_sample_weights)
    out = torch.nn.functional.embedding_bag(
        torch.tensor(np.array(indices).astype(np.int64)), table, torch.tensor(np.array(offsets).astype(np.int64)),
        mode=mode, include_last_offset=True, per_sample_weights=psw if weighted else None, padding_idx=padding_idx,
    )  # fmt: skip
    d_out = in_format(random(out.shape, 3), dtype)
    (out * exact_of(d_out)).sum().backward()

    def loss(table, sample_weights):
        bags = kernels.embedding_bag(indices, table, offsets, mode, sample_weights if weighted else None, True,
                                     padding_idx)  # fmt: skip
        return (bags * d_out).sum(), bags

    with metal_backend("random", True):
        (_, bags), grads = mx.value_and_grad(loss, argnums=(0, 1))(weight, per_sample_weights)
    within_ulps(bags, out, dtype, eps, 0 if mode == "max" else 1, "bags")  # max: a copy of the winner, exact
    within_ulps(grads[0], table.grad, dtype, eps, 1, "d_weight")
    if weighted:
        within_ulps(grads[1], psw.grad, dtype, eps, 1, "d_per_sample_weights")


# ----------------------------------------------------------------- modules on the Metal path, held to torch


def _kernel_launches(function, *arguments, schedule=("random", True)):
    before = launch_count()
    with metal_backend(*schedule):
        function(*arguments)
    return launch_count() - before


@settings(max_examples=30)
@given(layer_cases(), st.sampled_from(SCHEDULES))
def test_recurrent_layers_on_the_metal_path_match_torch(case, schedule):
    assert _kernel_launches(layer_test.hypothesis.inner_test, case, schedule=schedule) > 0


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_relu"])
@pytest.mark.parametrize("packed", [False, True])
def test_large_batches_take_the_per_step_kernels_and_match_torch(kind, packed):
    case = {
        "kind": kind, "input_size": 3, "hidden_size": 5, "num_layers": 2, "bias": True, "batch_first": False,
        "bidirectional": True, "proj_size": 0, "steps": 4, "batch": 10, "with_state": True, "seed": 1,
        "lengths": [4, 1, 3, 2, 4, 4, 2, 1, 3, 3] if packed else None, "enforce_sorted": False,
    }  # fmt: skip
    assert case["batch"] > kernels.SEQUENCE_KERNEL_MAX_BATCH
    assert _kernel_launches(layer_test.hypothesis.inner_test, case) > 0


@settings(max_examples=15)
@given(cell_cases())
def test_cells_on_the_metal_path_match_torch(case):
    assert _kernel_launches(cell_test.hypothesis.inner_test, case) > 0


@settings(max_examples=15)
@given(lookups())
def test_embedding_on_the_metal_path_matches_torch(case):
    launches = _kernel_launches(lookup_test.hypothesis.inner_test, case)
    assert launches > 0 or case[1].size == 0  # an empty lookup launches nothing


@settings(max_examples=25)
@given(bag_cases())
def test_embedding_bag_on_the_metal_path_matches_torch(case):
    _kernel_launches(bag_test.hypothesis.inner_test, case)


@settings(max_examples=10)
@given(batches())
def test_sparse_gradients_on_the_metal_path_match_torch(batch):
    launches = _kernel_launches(sparse_test.hypothesis.inner_test, batch)
    assert launches > 0 or batch[1].size == 0


# ----------------------------------------------------------------- backend switch and checks


def test_backend_is_ops_without_metal_and_metal_cannot_be_forced_there(monkeypatch):
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert kernels.backend() == ("metal" if kernels.metal_available() else "ops")
    if not kernels.metal_available():
        with pytest.raises(RuntimeError, match="Metal is not available"), kernels.use_backend("metal"):
            pass
        monkeypatch.setenv(kernels.BACKEND_ENV, "metal")
        with pytest.raises(RuntimeError, match="Metal is not available"):
            kernels.backend()
    monkeypatch.setenv(kernels.BACKEND_ENV, "gpu")
    with pytest.raises(ValueError, match="SEQLIB_BACKEND"):
        kernels.backend()
    monkeypatch.setenv(kernels.BACKEND_ENV, "emulate")
    assert kernels.backend() == "emulate" and kernels.uses_kernels()
    with kernels.use_backend("ops"):
        assert kernels.backend() == "ops" and not kernels.uses_kernels()
    with metal_backend():
        assert kernels.backend() == ("metal" if REAL_METAL else "emulate")
        with kernels.use_backend("ops"):
            assert kernels.backend() == "ops"


def test_ops_backend_launches_no_kernel_even_where_metal_is_available():
    layer = seqlib.nn.LSTM(3, 4)
    x = random((5, 2, 3), 0)
    with metal_backend():
        on_metal = layer(x)[0]
        before = launch_count()
        with kernels.use_backend("ops"):
            on_ops = layer(x)[0]
        assert launch_count() == before
    close(on_metal, on_ops, atol=1e-6)


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda: kernels.lstm_pointwise(mx.zeros((2, 8)), mx.zeros((2, 3))), ValueError, "gates: expected shape (2, 12)"),
    (lambda: kernels.lstm_pointwise(mx.zeros((2, 12), mx.int32), mx.zeros((2, 3))), TypeError, "gates"),
    (lambda: kernels.gru_pointwise(mx.zeros((2, 9)), mx.zeros((2, 9), mx.float16), mx.zeros((2, 3))), TypeError,
     "dtype"),
    (lambda: kernels.rnn_activation(mx.zeros((2, 3)), "sigmoid"), ValueError, "nonlinearity"),
    (lambda: kernels.rnn_activation(mx.zeros((0, 3))), ValueError, "non-empty"),
    (lambda: kernels.embedding(mx.array([4]), mx.zeros((4, 2))), IndexError, "[0, 4)"),
    (lambda: kernels.embedding(mx.array([-1]), mx.zeros((4, 2))), IndexError, "[0, 4)"),
    (lambda: kernels.embedding(mx.array([1.0]), mx.zeros((4, 2))), TypeError, "integer dtype (int32"),
    (lambda: kernels.embedding(mx.array([1]), mx.zeros((4, 2), mx.float64)), TypeError, "float32, float16"),
    (lambda: kernels.embedding_bag(mx.array([1, 2]), mx.zeros((4, 2)), mx.array([0, 3])), ValueError, "offsets"),
    (lambda: kernels.embedding_bag(mx.array([1, 2]), mx.zeros((4, 2)), mx.array([1, 2])), ValueError, "offsets"),
    (lambda: kernels.embedding_bag(mx.array([1, 2]), mx.zeros((4, 2)), mx.array([0, 1]), include_last_offset=True),
     ValueError, "include_last_offset"),
    (lambda: kernels.embedding_bag(mx.array([1, 9]), mx.zeros((4, 2)), mx.array([0, 2])), IndexError, "input"),
    (lambda: kernels.embedding_bag(mx.array([1]), mx.zeros((4, 2)), mx.array([0, 1]), "median"), ValueError, "mode"),
    (lambda: kernels.embedding_renorm_scales(mx.zeros((4, 2)), mx.array([1]), -1.0), ValueError, "max_norm"),
])  # fmt: skip
def test_bad_arguments_are_refused_before_any_launch(call, error, words):
    before = launch_count()
    with metal_backend(), pytest.raises(error, match=__import__("re").escape(words)):
        call()
    assert launch_count() == before


# ----------------------------------------------------------------- the emulation itself


def _run(source, grid, threadgroup, order="forward", size=100):
    kernel = emulation.metal_kernel("probe", ["a"], ["out"], source)
    with emulation.options(order=order):
        (out,) = kernel(inputs=[mx.arange(size).astype(mx.float32)], output_shapes=[(size,)],
                        output_dtypes=[mx.float32], grid=grid, threadgroup=threadgroup)  # fmt: skip
        return np.array(out)


def test_a_missing_barrier_shows_up_as_nan_under_some_order():
    source = """
    uint i = thread_position_in_grid.x;
    threadgroup float shared[64];
    shared[thread_index_in_threadgroup] = a[i];
    BARRIER
    out[i] = shared[(thread_index_in_threadgroup + 1) % threads_per_threadgroup.x];
    """
    good = source.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    for order in ("forward", "reverse", "random"):
        assert not np.isnan(_run(good, (100, 1, 1), (64, 1, 1), order)).any()
    broken = [np.isnan(_run(source.replace("BARRIER", ""), (100, 1, 1), (64, 1, 1), order)).any()
              for order in ("forward", "reverse")]  # fmt: skip
    assert all(broken)


def test_simd_sum_covers_the_live_lanes_of_partial_groups():
    out = _run("out[thread_position_in_grid.x] = simd_sum(a[thread_position_in_grid.x]);", (40, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(out[:32], sum(range(32)))
    np.testing.assert_array_equal(out[32:40], sum(range(32, 40)))
    assert np.isnan(out[40:]).all()  # threads that do not exist write nothing


@pytest.mark.parametrize(("source", "message"), [
    ("if (thread_position_in_grid.x > 3) return; threadgroup_barrier(mem_flags::mem_threadgroup);", "returned"),
    ("out[thread_position_in_grid.x + 1] = 0;", "outside output"),
    ("out[thread_position_in_grid.x * 100000000u] = 0;", "memory fault"),
    ("threadgroup float big[9000]; big[0] = 0; out[0] = big[0];", "32 KB"),
    ("if (thread_index_in_simdgroup == 0) { out[0] = simd_sum(1.0f); } else "
     "{ threadgroup_barrier(mem_flags::mem_threadgroup); }", "deadlock"),
    ("uint thread = 0; out[thread] = a[0];", "rejected the kernel"),
])  # fmt: skip
def test_what_a_gpu_would_not_allow_is_reported(source, message):
    with pytest.raises(emulation.EmulationError, match=message):
        _run(source, (64, 1, 1), (64, 1, 1), size=64)


# ----------------------------------------------------------------- lint


def test_every_kernel_passes_the_metal_lint():
    sources = {name: kernels.kernel_source(name) for name in kernels.kernel_names()}
    sources[kernels.HEADER_NAME] = kernels.kernel_header()
    assert {name: emulation.lint(text) for name, text in sources.items() if emulation.lint(text)} == {}


@pytest.mark.parametrize(("snippet", "words"), [
    ("double x = 1.0;", "double"),
    ("float y = std::exp(1.0f);", "std::"),
    ("uint n = 4; float values[n];", "VLAs"),
    ("threadgroup float shared[hidden_size];", "VLAs"),
    ("inline float walk(float x) { return x > 0 ? walk(x - 1) : x; }", "recursion"),
    ("inline float first(const float* values) { return values[0]; }", "address space"),
    ("uint thread = thread_index_in_threadgroup;", "keyword"),
])  # fmt: skip
def test_the_lint_rejects_what_metal_rejects(snippet, words):
    assert any(words in problem for problem in emulation.lint(snippet))
    assert emulation.lint("inline float first(const device float* values) { return values[0]; }") == []
