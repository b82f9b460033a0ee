"""seqlib inside ordinary MLX programs: every module under mx.compile (the forward, and a whole training
step with model and optimizer state), mx.vmap, gradients, mx.export_function (through
seqlib.export_function), safetensors and set_dtype, each checked against the module run eagerly; and
no forced evaluation inside a forward (lazy indices are checked in the graph)."""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

import seqlib
from seqlib import native
from seqlib.kernels import use_backend

V, D, H, B, T = 20, 8, 6, 3, 5


def _ids(shape, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, V, shape).astype(np.int32))


class _TableLSTMHead(nn.Module):
    """The small model every MLX user writes: a table, a recurrent layer, a head."""

    def __init__(self, cell="LSTM"):
        super().__init__()
        self.embedding = seqlib.nn.Embedding(V, D, padding_idx=0)
        self.rnn = getattr(seqlib.nn, cell)(D, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, V)

    def __call__(self, ids):
        return self.head(self.rnn(self.embedding(ids))[0])


def _first(output):
    return output[0] if isinstance(output, tuple) else output


# name -> (module factory, example inputs, the array of the output to compare)
CASES = {
    "Embedding": (lambda: seqlib.nn.Embedding(V, D, padding_idx=1, scale_grad_by_freq=True), lambda: (_ids((B, T)),)),
    "Embedding-max_norm": (lambda: seqlib.nn.Embedding(V, D, max_norm=1.0), lambda: (_ids((B, T)),)),
    "EmbeddingBag-mean-2d": (lambda: seqlib.nn.EmbeddingBag(V, D, mode="mean", padding_idx=2), lambda: (_ids((B, T)),)),
    "EmbeddingBag-sum-offsets": (
        lambda: seqlib.nn.EmbeddingBag(V, D, mode="sum"),
        lambda: (_ids((7,)), mx.array([0, 2, 2, 5]), mx.random.uniform(shape=(7,), key=mx.random.key(3))),
    ),
    "EmbeddingBag-max-offsets": (
        lambda: seqlib.nn.EmbeddingBag(V, D, mode="max", include_last_offset=True),
        lambda: (_ids((7,)), mx.array([0, 3, 3, 7])),
    ),
    "LSTM": (lambda: seqlib.nn.LSTM(D, H, num_layers=2, bidirectional=True), lambda: (mx.random.normal((T, B, D)),)),
    "LSTM-proj": (lambda: seqlib.nn.LSTM(D, H, proj_size=4), lambda: (mx.random.normal((T, B, D)),)),
    "GRU": (
        lambda: seqlib.nn.GRU(D, H, num_layers=2, bidirectional=True, batch_first=True),
        lambda: (mx.random.normal((B, T, D)),),
    ),
    "RNN-relu": (lambda: seqlib.nn.RNN(D, H, nonlinearity="relu", bias=False), lambda: (mx.random.normal((T, D)),)),
    "LSTMCell": (lambda: seqlib.nn.LSTMCell(D, H), lambda: (mx.random.normal((B, D)),)),
    "GRUCell": (lambda: seqlib.nn.GRUCell(D, H), lambda: (mx.random.normal((B, D)),)),
    "RNNCell": (lambda: seqlib.nn.RNNCell(D, H), lambda: (mx.random.normal((B, D)),)),
    "model-LSTM": (lambda: _TableLSTMHead("LSTM"), lambda: (_ids((B, T)),)),
    "model-GRU": (lambda: _TableLSTMHead("GRU"), lambda: (_ids((B, T)),)),
}


def _make(name):
    mx.random.seed(7)
    factory, inputs = CASES[name]
    module, args = factory(), inputs()
    mx.eval(module.parameters(), args)
    return module, args


def _close(got, want, atol=1e-5):
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)


def _loss(module, *args):
    return _first(module(*args)).astype(mx.float32).square().mean()


@pytest.mark.parametrize("name", CASES)
def test_compiled_forward_equals_eager(name):
    module, args = _make(name)
    want = _first(module(*args))
    _close(_first(mx.compile(module)(*args)), want)


@pytest.mark.parametrize("name", CASES)
def test_compiled_training_step_equals_eager(name):
    """The mlx-examples pattern: the whole step compiled with the model's and the optimizer's state."""
    results = [_train(name, compiled) for compiled in (False, True)]
    (eager_losses, eager_params), (losses, params) = results
    _close(mx.stack(losses), mx.stack(eager_losses), atol=1e-4)
    for (_, want), (_, got) in zip(seqlib_tree_flatten(eager_params), seqlib_tree_flatten(params), strict=True):
        _close(got, want, atol=1e-4)


def _train(name, compiled):
    """Three Adam steps of the module's _loss, eagerly or compiled: the losses and the parameters after."""
    module, args = _make(name)
    optimizer = optim.Adam(learning_rate=1e-2)
    loss_and_grad = nn.value_and_grad(module, _loss)
    state = [module.state, optimizer.state]

    def step(*args):
        loss, grads = loss_and_grad(module, *args)
        optimizer.update(module, grads)
        return loss

    if compiled:
        step = functools.partial(mx.compile, inputs=state, outputs=state)(step)
    losses = [step(*args) for _ in range(3)]
    mx.eval(losses, module.parameters())
    return losses, module.parameters()


def seqlib_tree_flatten(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


@pytest.mark.parametrize("name", CASES)
def test_vmap_equals_a_loop(name):
    module, args = _make(name)
    batched = tuple(mx.stack([arg, arg]) for arg in args)
    got = mx.vmap(lambda *xs: _first(module(*xs)))(*batched)
    want = _first(module(*args))
    _close(got[0], want)
    _close(got[1], want)


@pytest.mark.parametrize("name", CASES)
def test_exported_function_equals_eager(name, tmp_path):
    module, args = _make(name)
    path = str(tmp_path / "model.mlxfn")
    seqlib.export_function(path, lambda *xs: _first(module(*xs)), *args)
    imported = mx.import_function(path)
    # The plain path uses mx.tanh where the others use seqlib's rational tanh (within 4e-7).
    _close(imported(*args)[0], _first(module(*args)), atol=2e-5)


@pytest.mark.parametrize("name", CASES)
def test_gradients_equal_the_plain_path(name):
    """MLX's autodiff through plain built-in ops is the reference for seqlib's hand-written backward."""
    grads = []
    for backend in ("auto", "plain"):
        module, args = _make(name)
        with use_backend(backend):
            _, grad = nn.value_and_grad(module, _loss)(module, *args)
        mx.eval(grad)
        grads.append(seqlib_tree_flatten(grad))
    for (_, want), (_, got) in zip(*grads, strict=True):
        _close(got, want, atol=2e-5)


@pytest.mark.parametrize("name", ["model-LSTM", "EmbeddingBag-sum-offsets", "GRU"])
def test_safetensors_round_trip(name, tmp_path):
    module, args = _make(name)
    path = str(tmp_path / "weights.safetensors")
    module.save_weights(path)
    copy, _ = _make(name)
    copy.update(seqlib_tree_unflatten_zeros(copy))
    copy.load_weights(path)
    _close(_first(copy(*args)), _first(module(*args)), atol=0)


def seqlib_tree_unflatten_zeros(module):
    from mlx.utils import tree_map

    return tree_map(mx.zeros_like, module.parameters())


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("name", ["model-LSTM", "EmbeddingBag-mean-2d", "GRUCell"])
def test_set_dtype_runs_in_that_dtype(name, dtype):
    module, args = _make(name)
    want = np.array(_first(module(*args)))
    module.set_dtype(dtype)
    args = tuple(arg.astype(dtype) if mx.issubdtype(arg.dtype, mx.floating) else arg for arg in args)
    got = _first(module(*args))
    assert got.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=0.1, rtol=0.1)


# ----------------------------------------------------------------- no forced evaluation, checks in the graph

needs_extension = pytest.mark.skipif(native.module() is None, reason=f"no seqlib extension: {native.reason()}")


@needs_extension
@pytest.mark.parametrize("name", [name for name in CASES if not name.startswith(("LSTM", "GRU", "RNN"))])
def test_a_forward_evaluates_nothing(name):
    """Lazy inputs are still unevaluated after the forward: it forced no evaluation (no mx.eval, .item(),
    NumPy conversion) of them, nor of anything else, since everything else depends on them."""
    module, args = _make(name)
    lazy = tuple(arg + 0 for arg in args)
    output = _first(module(*lazy))
    assert not any(native.module().is_available(arg) for arg in lazy)
    assert not native.module().is_available(output)
    _close(output, _first(module(*args)))


@needs_extension
@pytest.mark.parametrize("kind", ["embedding", "bag"])
def test_a_lazy_index_outside_the_table_raises_where_it_is_evaluated(kind):
    table = seqlib.nn.Embedding(V, D) if kind == "embedding" else seqlib.nn.EmbeddingBag(V, D)
    ids = mx.array([[1, 2, V + 3]]) + 0  # lazy
    output = table(ids)  # no error yet: the values do not exist
    with pytest.raises(RuntimeError, match=rf"input: every index must lie in \[0, {V}\) \(num_embeddings={V}\); "
                                           rf"got values from 1 to {V + 3}"):  # fmt: skip
        mx.eval(output)


@needs_extension
def test_lazy_offsets_are_checked_where_they_are_evaluated():
    bag = seqlib.nn.EmbeddingBag(V, D, mode="sum")
    output = bag(mx.array([1, 2, 3]), mx.array([0, 2, 1]) + 0)
    with pytest.raises(RuntimeError, match=r"offsets: must be non-decreasing, got offsets\[1\] = 2 > offsets\[2\] = 1"):
        mx.eval(output)


@pytest.mark.parametrize("kind", ["embedding", "bag"])
def test_on_the_plain_path_a_bad_lazy_index_reads_nan(kind):
    table = seqlib.nn.Embedding(V, D) if kind == "embedding" else seqlib.nn.EmbeddingBag(V, D, mode="max")
    with use_backend("plain"):
        output = np.array(table(mx.array([[1, 2, -4], [3, 4, 5]]) + 0))
    bad, good = (output[0, 2], output[0, :2]) if kind == "embedding" else (output[0], output[1])
    assert np.isnan(bad).all() and np.isfinite(good).all() and np.isfinite(output[1]).all()


def test_evaluated_indices_are_still_checked_at_the_call():
    with pytest.raises(IndexError, match=r"input: every index must lie in \[0, 20\)"):
        seqlib.nn.Embedding(V, D)(mx.array([0, 20]))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("backend", ["auto", "plain"])
def test_bags_from_lazy_inputs_equal_bags_from_evaluated_ones(mode, dtype, backend):
    """The graph formulation (scatters over each entry's bag) against the host layout, outputs and gradients:
    padding, empty bags, per-sample weights, include_last_offset."""
    rng = np.random.default_rng(1)
    ids = mx.array(rng.integers(0, 9, 23).astype(np.int32))
    offsets = mx.array([0, 0, 4, 9, 9, 15, 23])
    weights = mx.array(rng.uniform(size=23).astype(np.float32)).astype(dtype) if mode == "sum" else None
    table = mx.random.normal((9, 5), key=mx.random.key(2)).astype(dtype)
    cotangent = mx.random.normal((6, 5), key=mx.random.key(4)).astype(dtype)

    def pooled(table, ids, offsets):
        return seqlib.functional.embedding_bag(ids, table, offsets, mode=mode, per_sample_weights=weights,
                                               include_last_offset=True, padding_idx=3)  # fmt: skip

    def value_and_vjp(ids, offsets):
        with use_backend(backend):
            (output,), (grad,) = mx.vjp(lambda table: (pooled(table, ids, offsets),), [table], [cotangent])
        return output, grad

    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    want_output, want_grad = value_and_vjp(ids, offsets)
    got_output, got_grad = value_and_vjp(ids + 0, offsets + 0)
    _close(got_output.astype(mx.float32), want_output.astype(mx.float32), atol=tolerance)
    _close(got_grad.astype(mx.float32), want_grad.astype(mx.float32), atol=tolerance)


# ----------------------------------------------------------------- the bindings check before touching memory


@needs_extension
def test_sequence_bindings_refuse_batch_sizes_past_the_rows():
    extension = native.module()
    x_gates, w_hh, h0 = mx.zeros((4, 8)), mx.zeros((8, 2)), mx.zeros((2, 2))
    with pytest.raises(ValueError, match="lstm_sequence: expected batch_sizes"):
        extension.lstm_sequence(x_gates, w_hh, h0, h0, [2, 2, 2], False, True)
    with pytest.raises(ValueError, match="lstm_sequence: expected w_hh float32 of shape"):
        extension.lstm_sequence(x_gates, mx.zeros((8, 3)), h0, h0, [2, 2], False, True)
    with pytest.raises(ValueError, match="gru_sequence: expected batch_sizes"):
        extension.gru_sequence(mx.zeros((4, 6)), mx.zeros((6, 2)), mx.zeros((6,)), h0, [2, 1], False, True)
    with pytest.raises(ValueError, match="rnn_sequence_backward: expected"):
        extension.rnn_sequence_backward(mx.zeros((2, 2)), mx.zeros((4, 2)), mx.zeros((3, 2)), h0, [2, 2], False, False)


@needs_extension
def test_bag_bindings_refuse_indices_outside_the_table_when_evaluated():
    extension = native.module()
    rows = extension.take_rows(mx.zeros((4, 3)), mx.array([0, 9], mx.int32))
    with pytest.raises(RuntimeError, match=r"indices: every index must lie in \[0, 4\)"):
        mx.eval(rows)
    pooled = extension.bag_pool(mx.zeros((4, 3)), mx.array([0, 1], mx.int32), mx.array([0, 5], mx.int32), None, 0, -1)
    with pytest.raises(RuntimeError, match="bounds: expected non-decreasing bounds"):
        mx.eval(pooled)


@needs_extension
@pytest.mark.parametrize("unique, positions", [([0, 9], [0, 1]), ([0, 2], [0, 2]), ([0, 2], [-1, 0])],
                         ids=["row outside the table", "position past unique", "negative position"])
def test_lookups_of_sparse_rows_refuse_positions_and_rows_outside_when_evaluated(unique, positions):
    # seqlib.sparse's rows: lookups of sparse_rows read the table at unique[positions], checked chunk by chunk
    extension = native.module()
    table = mx.arange(12, dtype=mx.float32).reshape(4, 3)
    rows = extension.sparse_rows(table, mx.array(unique, mx.int32), mx.zeros((2, 3)))
    positions = mx.array(positions, mx.int32)
    message = r"indices: every position must lie in \[0, 2\) and every row of unique in \[0, 4\)"
    with pytest.raises(RuntimeError, match=message):
        mx.eval(extension.bag_pool(rows, positions, mx.array([0, 1, 2], mx.int32), None, 1, -1))
    with pytest.raises(RuntimeError, match=message):
        mx.eval(extension.take_rows(rows, positions))


@needs_extension
def test_lookups_of_sparse_rows_read_the_table_at_unique_positions():
    extension = native.module()
    table = mx.random.normal((50, 4), key=mx.random.key(3))
    unique, positions = mx.array([3, 7, 41], mx.int32), mx.array([2, 0, 0, 1, 2, 2, 1], mx.int32)
    rows = extension.sparse_rows(table, unique, mx.zeros((3, 4)))
    want = np.array(table)[np.array(unique)[np.array(positions)]]
    assert np.array_equal(np.array(extension.take_rows(rows, positions)), want)
    bounds = mx.array([0, 3, 3, 7], mx.int32)  # bags of 3, 0 and 4 entries
    pooled = np.array(extension.bag_pool(rows, positions, bounds, None, 0, -1))
    assert np.array_equal(pooled, np.stack([want[:3].sum(0), np.zeros(4, np.float32), want[3:].sum(0)]))


def test_loading_a_cells_keys_into_a_layer_suggests_the_l0_names():
    cell_weights = seqlib.nn.LSTMCell(D, H).torch_state_dict()
    with pytest.raises(ValueError, match=r"rename 'bias_hh' -> 'bias_hh_l0'.*or load the cell's weights into a cell"):
        seqlib.nn.LSTM(D, H).load_torch_state_dict(cell_weights)


@pytest.mark.parametrize("name", ["LSTM", "GRU", "RNN-relu", "EmbeddingBag-sum-offsets"])
def test_gradient_of_a_vmap_equals_a_sum_of_gradients(name):
    """The primitives carry their own vjp, so a gradient through mx.vmap runs them (once per mapped index)."""
    module, args = _make(name)
    first = args[0]
    batched = mx.stack([first, first * 0.5 if mx.issubdtype(first.dtype, mx.floating) else first])
    weight_name = "weight" if name.startswith("Embedding") else "weight_hh_l0"
    weight = module.parameters()[weight_name]

    def loss(weight, inputs):
        module.update({weight_name: weight})
        return _first(module(inputs, *args[1:])).square().sum()

    mapped = mx.grad(lambda w: mx.vmap(lambda x: loss(w, x))(batched).sum())(weight)
    looped = sum(mx.grad(loss)(weight, batched[k]) for k in range(2))
    _close(mapped, looped, atol=1e-4)


def test_a_shapeless_compiled_lookup_follows_new_shapes():
    """The index check in the graph is elementwise: mx.compile(shapeless=True) infers its new shape.
    (MLX's own custom functions and scatters cannot: padding_idx and scale_grad_by_freq are not shapeless.)"""
    table = seqlib.nn.Embedding(V, D)
    mx.eval(table.parameters())
    lookup = mx.compile(table, shapeless=True)
    for length in (3, 5):
        ids = _ids((2, length)) + 0  # lazy: checked in the graph
        _close(lookup(ids), table(ids))
