"""Streaming: ``layer.step(x_t, state)``, one time step of a whole stack with a carried state.

Stepping a sequence one step at a time must give torch's layer on the whole sequence, the
same outputs and states as a call on a sequence of one step, and the same gradients.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten, tree_map
from torch_reference import assert_close

import seqlib

KINDS = ("RNN", "LSTM", "GRU")


def layer_pair(kind, input_size=3, hidden_size=5, **options):
    torch.manual_seed(0)
    theirs = getattr(torch.nn, kind)(input_size, hidden_size, **options)
    return seqlib.from_torch(theirs), theirs


def as_state(kind, state):
    """torch's state (h or (h, c)) as MLX arrays, or None."""
    if state is None:
        return None
    if kind == "LSTM":
        return tuple(mx.array(s.detach().numpy()) for s in state)
    return mx.array(state.detach().numpy())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("options", [{}, {"num_layers": 3}, {"num_layers": 2, "bias": False}, {"batch_first": True}])
def test_stepping_a_sequence_gives_torch_on_the_whole_sequence(kind, options):
    ours, theirs = layer_pair(kind, **options)
    steps, batch = 7, 2
    x = np.random.default_rng(1).standard_normal((steps, batch, 3)).astype(np.float32)
    x_torch = torch.from_numpy(x.swapaxes(0, 1).copy() if options.get("batch_first") else x)
    with torch.no_grad():
        want_output, want_state = theirs(x_torch)
    want_output = want_output.numpy().swapaxes(0, 1) if options.get("batch_first") else want_output.numpy()
    state = None
    for t in range(steps):
        output, state = ours.step(mx.array(x[t]), state)
        assert_close(output, want_output[t], what=f"output at step {t}")
    for mine, want in zip(_leaves(state), _leaves(as_state(kind, want_state)), strict=True):
        assert_close(mine, np.array(want), what="final state")


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_equals_a_call_on_one_step_batched_unbatched_and_projected(kind):
    options = {"num_layers": 2, "proj_size": 2} if kind == "LSTM" else {"num_layers": 2}
    ours, _ = layer_pair(kind, **options)
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((4, 3)).astype(np.float32))
    sizes = [(2, 4, ours.output_size)] + ([(2, 4, 5)] if kind == "LSTM" else [])
    state = [mx.array(rng.standard_normal(size).astype(np.float32)) for size in sizes]
    state = tuple(state) if kind == "LSTM" else state[0]
    output, new_state = ours.step(x, state)
    want_output, want_state = ours(x[None], state)
    assert output.shape == (4, ours.output_size)
    assert_close(output, np.array(want_output[0]), rtol=0, atol=0)
    for mine, want in zip(_leaves(new_state), _leaves(want_state), strict=True):
        assert mine.shape == want.shape
        assert_close(mine, np.array(want), rtol=0, atol=0)
    # One sequence is a batch of 1, whose matmuls are matrix-vector products (GEMV, summed in another
    # order than the batch's GEMM): equal within float32 rounding.
    unbatched_output, unbatched_state = ours.step(x[0], tree_map(lambda s: s[:, 0], state))
    assert_close(unbatched_output, np.array(output[0]), rtol=1e-5, atol=1e-6)
    for mine, want in zip(_leaves(unbatched_state), _leaves(new_state), strict=True):
        assert_close(mine, np.array(want[:, 0]), rtol=1e-5, atol=1e-6)


def _leaves(state):
    return list(state) if isinstance(state, tuple) else [state]


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_steps_equal_those_through_the_call(kind):
    ours, _ = layer_pair(kind, num_layers=2)
    x = mx.array(np.random.default_rng(3).standard_normal((5, 2, 3)).astype(np.float32))

    def stepped(parameters):
        ours.update(parameters)
        state, total = None, 0.0
        for t in range(x.shape[0]):
            output, state = ours.step(x[t], state)
            total = total + (output * (t + 1)).sum()
        return total

    def called(parameters):
        ours.update(parameters)
        output, _ = ours(x)
        return (output * mx.arange(1, 6, dtype=mx.float32)[:, None, None]).sum()

    parameters = ours.trainable_parameters()
    ours_grads = dict(tree_flatten(mx.grad(stepped)(parameters)))
    want_grads = dict(tree_flatten(mx.grad(called)(parameters)))
    assert ours_grads.keys() == want_grads.keys()
    for name, gradient in ours_grads.items():
        assert_close(gradient, np.array(want_grads[name]), rtol=1e-5, atol=1e-5, what=name)


def test_a_bidirectional_layer_refuses_to_step_and_bad_inputs_are_named():
    with pytest.raises(ValueError, match="bidirectional"):
        seqlib.nn.LSTM(3, 4, bidirectional=True).step(mx.zeros((1, 3)))
    layer = seqlib.nn.GRU(3, 4)
    with pytest.raises(ValueError, match=r"input: expected shape \(batch, input_size=3\)"):
        layer.step(mx.zeros((2, 5, 3)))
    with pytest.raises(ValueError, match="input"):
        layer.step(mx.zeros((2, 4)))
    with pytest.raises(TypeError, match="input"):
        layer.step(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="dtype"):
        layer.step(mx.zeros((2, 3), mx.float16))
    with pytest.raises(ValueError, match="hx"):
        layer.step(mx.zeros((2, 3)), mx.zeros((1, 3, 4)))


def test_an_empty_batch_steps_to_empty_outputs():
    output, (h, c) = seqlib.nn.LSTM(3, 4, num_layers=2).step(mx.zeros((0, 3)))
    assert (output.shape, h.shape, c.shape) == ((0, 4), (2, 0, 4), (2, 0, 4))


# ----------------------------------------------------------------- steps run at once (seqlib.native)

def _runs_at_once() -> bool:
    from seqlib import kernels, native

    return native.available() and not kernels.uses_kernels()


def _graph_path_only(monkeypatch):
    """Send every step through the MLX graph, as where seqlib.native is not built."""
    from seqlib.nn import recurrence

    monkeypatch.setattr(recurrence.Recurrence, "_step_now", lambda self, rows, states, suffixes: None)


STEP_OPTIONS = [{}, {"num_layers": 3}, {"num_layers": 2, "bias": False}]
STEP_CASES = [(kind, options) for kind in KINDS for options in STEP_OPTIONS] + [("RNN", {"nonlinearity": "relu"})]


@pytest.mark.parametrize(("kind", "options"), STEP_CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_steps_run_at_once_equal_the_graph_path(monkeypatch, kind, options, batch):
    """Outside mx.grad a step runs in seqlib.native's C++, no MLX graph: the same numbers as the graph."""
    ours, _ = layer_pair(kind, hidden_size=6, **options)
    cell = getattr(seqlib.nn, kind + "Cell")(3, 6, bias=options.get("bias", True), **(
        {"nonlinearity": options["nonlinearity"]} if "nonlinearity" in options else {}))  # fmt: skip
    rng = np.random.default_rng(4)
    xs = [mx.array(rng.standard_normal((batch, 3)).astype(np.float32)) for _ in range(4)]

    def stream():
        state, cell_state, results = None, None, []
        for x in xs:
            output, state = ours.step(x, state)
            cell_state = cell(x, cell_state)
            results += [output, *_leaves(state), *_leaves(cell_state)]
        return [np.array(result) for result in results]

    at_once = stream()
    with monkeypatch.context() as patch:
        _graph_path_only(patch)
        graph = stream()
    for position, (mine, want) in enumerate(zip(at_once, graph, strict=True)):
        np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-6, err_msg=f"result {position}")


# A cell at batch 1 whose weights take a team of threads (about 1 MB or more: the rows of its products are shared)
# or whose widths leave partial vectors and rows (37, 45; the GRU's 3 H = 135 rows, not a multiple of 4).
WIDE_CELLS = [("LSTMCell", 640, 640, {}), ("GRUCell", 320, 576, {}), ("RNNCell", 700, 600, {"nonlinearity": "relu"}),
              ("LSTMCell", 37, 45, {}), ("GRUCell", 37, 45, {"bias": False}), ("RNNCell", 45, 37, {})]  # fmt: skip


@pytest.mark.parametrize(("kind", "input_size", "hidden_size", "options"), WIDE_CELLS)
def test_a_streamed_cell_at_batch_1_gives_torchs_cell(kind, input_size, hidden_size, options):
    """At batch 1 a step's products are matrix-vector products over the weights' rows (shared by a team of threads
    where the weights are large): torch's cell, step after step, within float32 rounding."""
    torch.manual_seed(1)
    theirs = getattr(torch.nn, kind)(input_size, hidden_size, **options)
    ours = seqlib.from_torch(theirs)
    rng = np.random.default_rng(6)
    xs = rng.standard_normal((3, 1, input_size)).astype(np.float32)
    state, want_state = None, None
    for x in xs:
        state = ours(mx.array(x), state)
        with torch.no_grad():
            want_state = theirs(torch.from_numpy(x), want_state)
        for mine, want in zip(_leaves(state), _leaves(want_state), strict=True):
            assert_close(mine, want.numpy(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_outside_mx_grad_calls_the_primitive_once_for_the_whole_stack(monkeypatch, kind):
    if not _runs_at_once():
        pytest.skip("seqlib.native is not built here, or the Metal kernels run the steps")
    from seqlib import native

    extension = native.extension()
    name = kind.lower() + "_step"
    calls = []
    original = getattr(extension, name)
    monkeypatch.setattr(extension, name, lambda *args: calls.append(args) or original(*args))
    ours, _ = layer_pair(kind, num_layers=3)
    x = mx.ones((2, 3))
    mx.eval(ours.step(x))
    assert len(calls) == 1  # all three layers in one call, no graph between them
    mx.eval(mx.grad(lambda x: ours.step(x)[0].sum())(x))  # traced: the graph path, with its gradient
    mx.eval(mx.compile(lambda x: ours.step(x)[0])(x))  # traced by mx.compile: the graph path too
    assert len(calls) == 1
