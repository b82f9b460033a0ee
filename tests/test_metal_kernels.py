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


@pytest.mark.parametrize(("order", "pad_grid"), SCHEDULES)
@pytest.mark.parametrize(("batch", "hidden_size"), CELL_SHAPES)
def test_lstm_cell_forward_and_backward_match_torch(order, pad_grid, batch, hidden_size):
    gates, c_prev = random((batch, 4 * hidden_size), 0, 3.0), random((batch, hidden_size), 1)
    d_h, d_c = random((batch, hidden_size), 2), random((batch, hidden_size), 3)
    with metal_backend(order, pad_grid):
        h, c, activations, tanh_c = kernels.lstm_pointwise(gates, c_prev)
        d_gates, d_c_prev = kernels.lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev)
    gates_t, c_prev_t = torch_of(gates), torch_of(c_prev)
    i, f, g, o = gates_t.chunk(4, dim=1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    c_t = f * c_prev_t + i * g
    h_t = o * torch.tanh(c_t)
    for ours, theirs, what in [(h, h_t, "h"), (c, c_t, "c"), (tanh_c, torch.tanh(c_t), "tanh_c"),
                               (activations, torch.cat([i, f, g, o], 1), "activations")]:  # fmt: skip
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
    input_r, input_z, input_n = input_t.chunk(3, dim=1)
    hidden_r, hidden_z, hidden_n = hidden_t.chunk(3, dim=1)
    r, z = torch.sigmoid(input_r + hidden_r), torch.sigmoid(input_z + hidden_z)
    n = torch.tanh(input_n + r * hidden_n)
    h_t = (1 - z) * n + z * h_prev_t
    close(h, h_t, what="h")
    close(activations, torch.cat([r, z, n], 1), what="activations")
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
    h_t = torch.tanh(pre_t) if nonlinearity == "tanh" else torch.relu(pre_t)
    h_t.backward(torch_of(d_h))
    close(h, h_t, what="h")
    close(d_pre, pre_t.grad, what="d_pre")


def test_cell_kernels_keep_half_precision_storage_and_float32_math():
    gates, c_prev = random((3, 4 * 40), 0, 2.0), random((3, 40), 1)
    with metal_backend():
        full = kernels.lstm_pointwise(gates, c_prev)
        half = kernels.lstm_pointwise(gates.astype(mx.float16), c_prev.astype(mx.float16))
        brain = kernels.lstm_pointwise(gates.astype(mx.bfloat16), c_prev.astype(mx.bfloat16))
    for ours, reference in zip(half, full, strict=True):
        assert ours.dtype == mx.float16
        close(ours.astype(mx.float32), reference, atol=2e-3, rtol=2e-3)
    for ours, reference in zip(brain, full, strict=True):
        assert ours.dtype == mx.bfloat16
        close(ours.astype(mx.float32), reference, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------- whole-sequence kernels


def packed_case(batch_sizes, hidden_size, gate_blocks, seed=0):
    rows = sum(batch_sizes)
    return (
        random((rows, gate_blocks * hidden_size), seed, 1.0),
        random((gate_blocks * hidden_size, hidden_size), seed + 1, 0.5 / np.sqrt(hidden_size)),
        random((batch_sizes[0], hidden_size), seed + 2),
    )


SEQUENCE_CASES = [((1,), 1), ((3, 3, 2, 1), 33), ((2, 2, 2), 70), ((5, 4, 4, 1, 1), 40)]


def _ops_sequence(function, *arguments, num_steps):
    """The ops path's custom function outputs, with its per-step saved lists joined in time order."""
    with kernels.use_backend("ops"):
        outputs = function(*arguments)
    head, saved = outputs[: len(outputs) - 4 * num_steps], outputs[len(outputs) - 4 * num_steps:]
    return list(head), [mx.concatenate(saved[k * num_steps:(k + 1) * num_steps]) for k in range(4)]


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
    (want_output, want_h, want_c), saved = _ops_sequence(function, x_gates, w_hh, h0, c0, num_steps=len(batch_sizes))
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
    num_steps = len(batch_sizes)
    with kernels.use_backend("ops"):
        outputs = function(x_gates, w_hh, b_hh, h0)
    saved = [mx.concatenate(outputs[2 + k * num_steps:2 + (k + 1) * num_steps]) for k in range(3)]
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
