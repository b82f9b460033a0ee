"""seqlib.functional.cross_entropy and seqlib.nn.CrossEntropyLoss against torch's, on both implementations:
backend "ops" (seqlib's C++ primitive, where it is built) and "plain" (MLX's ops)."""

import math

import mlx.core as mx
import mlx.nn
import mlx.optimizers
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch_reference import assert_close, loss_weights

import seqlib
from seqlib import functional as F
from seqlib import kernels, native

BACKENDS = ["ops", "plain"]  # "ops": the native path where it is built (float32 on the CPU); "plain": MLX's ops


@st.composite
def cases(draw):
    """Logits of shape (C,), (N, C) or (N, C, d), targets (indices or probabilities) and the options."""
    classes = draw(st.integers(1, 40))
    batch = draw(st.sampled_from(["single", "rows", "spatial"]))
    rows = draw(st.integers(0, 6))
    shape = {"single": (classes,), "rows": (rows, classes), "spatial": (rows, classes, draw(st.integers(1, 3)))}[batch]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = (rng.standard_normal(shape) * draw(st.sampled_from([0.1, 3.0, 30.0]))).astype(np.float32)
    probabilities = draw(st.booleans())
    class_axis = 0 if batch == "single" else 1
    target_shape = shape if probabilities else shape[:class_axis] + shape[class_axis + 1:]
    if probabilities:  # each position's distribution over the classes, the classes on the class axis
        positions = shape[:class_axis] + shape[class_axis + 1:]
        target = np.moveaxis(rng.dirichlet(np.ones(classes), size=positions).astype(np.float32), -1, class_axis)
        ignore_index = -100
    else:
        target = np.asarray(rng.integers(0, classes, target_shape))
        ignore_index = draw(st.sampled_from([-100, 0, classes - 1]))
        if target.size and draw(st.booleans()):
            target.reshape(-1)[0] = -100 if ignore_index == -100 else ignore_index
    weight = rng.uniform(0.1, 2.0, classes).astype(np.float32) if draw(st.booleans()) else None
    options = dict(ignore_index=ignore_index, reduction=draw(st.sampled_from(["none", "mean", "sum"])),
                   label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])))  # fmt: skip
    return logits, np.array(target, copy=True), weight, options, draw(st.sampled_from([mx.int32, mx.int64, mx.uint8]))


def _torch_loss(logits, target, weight, options):
    x = torch.from_numpy(logits).requires_grad_()
    t = torch.from_numpy(target) if target.dtype == np.float32 else torch.from_numpy(target.astype(np.int64))
    w = None if weight is None else torch.from_numpy(weight)
    out = torch.nn.functional.cross_entropy(x, t, w, **options)
    scale = torch.from_numpy(loss_weights(tuple(out.shape), seed=1).astype(np.float32))
    (out * scale).sum().backward()
    return out.detach().numpy(), x.grad.numpy()


def _our_loss(logits, target, weight, options, index_dtype):
    t = mx.array(target) if target.dtype == np.float32 else mx.array(target).astype(index_dtype)
    w = None if weight is None else mx.array(weight)
    scale = mx.array(loss_weights(tuple(F.cross_entropy(mx.array(logits), t, w, **options).shape), seed=1))

    def loss(x):
        out = F.cross_entropy(x, t, w, **options)
        return (out * scale).sum(), out

    (_, out), grad = mx.value_and_grad(loss)(mx.array(logits))
    return np.array(out), np.array(grad)


@pytest.mark.parametrize("backend", BACKENDS)
@given(cases())
def test_matches_torch_loss_and_gradient(backend, case):
    logits, target, weight, options, index_dtype = case
    if index_dtype == mx.uint8 and (target.dtype != np.float32 and (target.min(initial=0) < 0)):
        index_dtype = mx.int32  # a negative ignore_index has no uint8 form
    with kernels.use_backend(backend):
        out, grad = _our_loss(logits, target, weight, options, index_dtype)
    want_out, want_grad = _torch_loss(logits, target, weight, options)
    scale = max(1.0, float(np.abs(logits).max(initial=0)))  # the loss is of the logits' size
    assert_close(out, want_out, rtol=2e-5, atol=2e-5 * scale, what="loss")
    assert_close(grad, want_grad, rtol=1e-4, atol=1e-5, what="gradient")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_language_models_vocabulary_matches_torch(backend):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((33, 50257)) * 4).astype(np.float32)
    target = rng.integers(0, 50257, 33)
    with kernels.use_backend(backend):
        out, grad = _our_loss(logits, target, None, {"reduction": "none"}, mx.int32)
    want_out, want_grad = _torch_loss(logits, target, None, {"reduction": "none"})
    assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert_close(grad, want_grad, rtol=1e-4, atol=1e-7)


def test_the_native_path_runs_where_it_is_built():
    if not native.available():
        pytest.skip(f"seqlib's C++ primitives are not available: {native.reason()}")
    logits, target = mx.zeros((4, 3)), mx.array([0, 1, 2, 0])
    with kernels.use_backend("ops"):
        graph = F.cross_entropy(logits, target)
    assert "SoftmaxCrossEntropy" in _primitive_names(graph)
    with kernels.use_backend("plain"):
        assert "SoftmaxCrossEntropy" not in _primitive_names(F.cross_entropy(logits, target))


def _primitive_names(array) -> str:
    """The names of the primitives behind ``array`` (MLX's DOT export of its graph)."""
    import io

    out = io.StringIO()
    mx.export_to_dot(out, array)
    return out.getvalue()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("special", ["nan", "minus_inf", "plus_inf", "all_minus_inf"])
def test_non_finite_logits_give_torchs_answer(backend, special):
    logits = np.random.default_rng(0).standard_normal((3, 20)).astype(np.float32)
    value = {"nan": np.nan, "minus_inf": -np.inf, "plus_inf": np.inf, "all_minus_inf": -np.inf}[special]
    if special == "all_minus_inf":
        logits[1] = value
    else:
        logits[1, [3, 7]] = value
    target = np.array([2, 5, 4])
    with kernels.use_backend(backend):
        out = np.array(F.cross_entropy(mx.array(logits), mx.array(target), reduction="none"))
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(target), reduction="none")
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-6)  # NaN where torch has NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_ignored_give_torchs_nan_mean_and_zero_sum(backend):
    logits, target = mx.ones((2, 3)), mx.array([-100, -100])
    with kernels.use_backend(backend):
        assert math.isnan(F.cross_entropy(logits, target).item())
        assert F.cross_entropy(logits, target, reduction="sum").item() == 0.0
        grad = mx.grad(lambda x: F.cross_entropy(x, target, reduction="sum"))(logits)
    assert np.array(grad).tolist() == [[0.0] * 3] * 2


def test_a_target_outside_the_classes_is_an_index_error_at_the_call():
    with pytest.raises(IndexError, match=r"target: every index must lie in \[0, 3\).*got values from 0 to 3"):
        F.cross_entropy(mx.zeros((2, 3)), mx.array([0, 3]))
    with pytest.raises(IndexError, match="target"):
        F.cross_entropy(mx.zeros((2, 3)), mx.array([-1, 0]))  # -1 is not the ignore_index


def test_a_lazy_target_outside_the_classes_fails_where_it_is_evaluated():
    if not native.available():
        pytest.skip(f"seqlib's C++ primitives are not available: {native.reason()}")
    step = mx.compile(lambda x, t: F.cross_entropy(x, t))
    with pytest.raises(RuntimeError, match=r"target: every index must lie in \[0, 3\)"):
        mx.eval(step(mx.zeros((2, 3)), mx.array([0, 7])))


def test_where_no_check_can_run_a_bad_targets_row_is_nan():
    with kernels.use_backend("plain"):
        step = mx.compile(lambda x, t: F.cross_entropy(x, t, reduction="none"))
        out = np.array(step(mx.zeros((3, 3)), mx.array([0, 7, -100])))
    assert math.isnan(out[1]) and out[0] == pytest.approx(math.log(3)) and out[2] == 0.0


def _labels():
    return mx.array([0, 1])


BAD_CALLS = [  # (call, error, words of its message); logits (2, 3) unless the case is about them
    (lambda: F.cross_entropy(np.zeros((2, 3)), _labels()), TypeError, "input: expected a floating"),
    (lambda: F.cross_entropy(mx.zeros((2, 3), mx.int32), _labels()), TypeError, "input"),
    (lambda: F.cross_entropy(mx.array(1.0), mx.array(0)), ValueError, "input: expected logits of shape"),
    (lambda: F.cross_entropy(mx.zeros((2, 3)), [0, 1]), TypeError, "target: expected an mlx.core.array"),
    (lambda: F.cross_entropy(mx.zeros((2, 3)), mx.array([0, 1, 2])), ValueError,
     r"target: expected class indices of shape \(2,\)"),
    (lambda: F.cross_entropy(mx.zeros((2, 3)), mx.array([True, False])), TypeError, "target: expected class indices"),
    (lambda: F.cross_entropy(mx.zeros((2, 3)), mx.zeros((2, 4))), ValueError, "target: expected probabilities"),
    (lambda: F.cross_entropy(mx.zeros((2, 3)), _labels(), mx.ones(4)), ValueError,
     r"weight: expected a floating array of shape \(3,\)"),
    (lambda: F.cross_entropy(mx.zeros((2, 3)), _labels(), ignore_index=1.5), TypeError, "ignore_index"),
    (lambda: F.cross_entropy(mx.zeros((2, 3)), _labels(), reduction="average"), ValueError, "reduction"),
    (lambda: F.cross_entropy(mx.zeros((2, 3)), _labels(), label_smoothing=1.5), ValueError, "label_smoothing"),
    (lambda: seqlib.nn.CrossEntropyLoss(reduction="avg"), ValueError, "reduction"),
]


@pytest.mark.parametrize("call, error, words", BAD_CALLS)
def test_bad_arguments_raise_a_clear_error(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_module_matches_the_function_and_holds_its_weight_frozen():
    weight = mx.array([0.5, 1.0, 2.0])
    loss = seqlib.nn.CrossEntropyLoss(weight=weight, ignore_index=1, reduction="sum", label_smoothing=0.2)
    logits, target = mx.random.normal((5, 3), key=mx.random.key(0)), mx.array([0, 1, 2, 2, 0])
    want = F.cross_entropy(logits, target, weight, ignore_index=1, reduction="sum", label_smoothing=0.2)
    assert loss(logits, target).item() == want.item()
    assert loss.trainable_parameters() == {} and "weight" in loss.parameters()
    assert seqlib.nn.CrossEntropyLoss()(logits, target).item() == F.cross_entropy(logits, target).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_logits_match_float32(dtype):
    logits = mx.random.normal((16, 10), key=mx.random.key(1)).astype(dtype)
    target = mx.arange(16) % 10
    out = F.cross_entropy(logits, target, reduction="none")
    assert out.dtype == dtype
    want = F.cross_entropy(logits.astype(mx.float32), target, reduction="none")
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(want), rtol=2e-2, atol=2e-2)


def test_a_compiled_training_step_and_vmap():
    """Inside the transformations MLX programs use: a compiled Adam step whose loss falls, and mx.vmap over a
    batch of problems."""
    mx.random.seed(0)
    model = mlx.nn.Linear(8, 5)
    optimizer = mlx.optimizers.Adam(learning_rate=0.05)
    x, y = mx.random.normal((64, 8)), mx.random.randint(0, 5, (64,))
    loss_and_grad = mlx.nn.value_and_grad(model, lambda m, x, y: F.cross_entropy(m(x), y))
    state = [model.state, optimizer.state]

    @mx.compile
    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        optimizer.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    losses = [step(x, y).item() for _ in range(30)]
    assert losses[-1] < 0.8 * losses[0]

    logits, targets = mx.random.normal((3, 4, 6)), mx.random.randint(0, 6, (3, 4))
    mapped = mx.vmap(lambda a, b: F.cross_entropy(a, b))(logits, targets)
    want = mx.stack([F.cross_entropy(logits[i], targets[i]) for i in range(3)])
    np.testing.assert_allclose(np.array(mapped), np.array(want), rtol=1e-6)



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("targets", ["indices", "probabilities"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_shapeless_compile_follows_the_rows_in_the_loss_and_its_gradient(backend, targets, reduction):
    def loss(a, b):
        return F.cross_entropy(a, b, reduction=reduction)

    with kernels.use_backend(backend):
        value = mx.compile(loss, shapeless=True)
        gradient = mx.compile(mx.grad(lambda a, b: (loss(a, b) * 1.5).sum()), shapeless=True)
        for rows in (4, 9, 2, 40):
            a = mx.random.normal((rows, 6), key=mx.random.key(rows))
            b = (mx.random.randint(0, 6, (rows,), key=mx.random.key(100 + rows)) if targets == "indices"
                 else mx.softmax(mx.random.normal((rows, 6), key=mx.random.key(100 + rows)), axis=-1))  # fmt: skip
            np.testing.assert_allclose(np.array(value(a, b)), np.array(loss(a, b)), rtol=1e-6, atol=1e-7)
            want = mx.grad(lambda a, b=b: (loss(a, b) * 1.5).sum())(a)
            np.testing.assert_allclose(np.array(gradient(a, b)), np.array(want), rtol=1e-6, atol=1e-8)


def test_shapeless_compile_refuses_other_classes_and_rows_without_targets():
    """The classes are the traced graph's, and every row needs its target: the native path refuses either
    change with a ValueError at the call, instead of reading a wrong class or past the targets."""
    if not native.available():
        pytest.skip(f"seqlib's C++ primitives are not available: {native.reason()}")
    shapeless = mx.compile(lambda a, b: F.cross_entropy(a, b, reduction="none"), shapeless=True)
    shapeless(mx.zeros((3, 6)), mx.array([0, 1, 2]))
    with pytest.raises(ValueError, match="number of classes changed from 6 to 11"):
        shapeless(mx.random.normal((9, 11)), mx.random.randint(0, 11, (9,)))
    with pytest.raises(ValueError, match=r"one target .* per row of the logits, 40 rows, got an input of 2 values"):
        shapeless(mx.zeros((40, 6)), mx.array([0, 1]))


def test_exported_function_runs_without_seqlib(tmp_path):
    logits, target = mx.random.normal((6, 4), key=mx.random.key(2)), mx.array([0, 1, 2, 3, 0, 1])
    path = tmp_path / "loss.mlxfn"
    seqlib.export_function(str(path), lambda a, b: F.cross_entropy(a, b), logits, target)
    (out,) = mx.import_function(str(path))(logits, target)
    assert out.item() == pytest.approx(F.cross_entropy(logits, target).item(), rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_and_logsumexp_are_within_a_few_ulp_of_float64(backend):
    """Rows [0, x] for x across float32's exp range: the loss of target 0 is log(1 + e^x), its gradient in x the
    logistic sigmoid of x; checked against float64.  seqlib's polynomial exp: within 1e-6 (5.8e-7 seen: x - lse
    rounded to float32, as in torch); MLX's mx.exp is off by up to 3.8e-6 of itself near x = -74 (MLX 0.32)."""
    x = np.concatenate([np.linspace(-104.0, 0.0, 20001), -np.logspace(-8, 0, 200)]).astype(np.float32)
    logits = np.stack([np.zeros_like(x), x], axis=1)
    with kernels.use_backend(backend):
        grad = mx.grad(lambda a: F.cross_entropy(a, mx.zeros(len(x), mx.int32), reduction="sum"))(
            mx.array(logits))  # fmt: skip
        losses = np.array(F.cross_entropy(mx.array(logits), mx.zeros(len(x), mx.int32), reduction="none"))
    exact, rtol = x.astype(np.float64), 1e-6 if backend == "ops" and native.available() else 5e-6
    np.testing.assert_allclose(losses, np.log1p(np.exp(exact)), rtol=1e-6, atol=1.2e-7)  # log of a sum near 1
    np.testing.assert_allclose(np.array(grad)[:, 1], 1 / (1 + np.exp(-exact)), rtol=rtol, atol=2e-38)
    np.testing.assert_allclose(np.array(grad)[:, 0], -np.exp(exact) / (1 + np.exp(exact)), atol=1.2e-7)  # softmax - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_large_enough_for_threads_with_every_option_matches_torch(backend):
    """4,096 x 97 logits (the native loops split rows over threads from 65,536 floats) with class weights,
    ignored rows and label smoothing."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4096, 97)) * 3).astype(np.float32)
    target = rng.integers(0, 97, 4096)
    target[::7] = 5
    weight = rng.uniform(0.1, 2.0, 97).astype(np.float32)
    options = {"ignore_index": 5, "reduction": "mean", "label_smoothing": 0.1}
    with kernels.use_backend(backend):
        out, grad = _our_loss(logits, target, weight, options, mx.int64)
    want_out, want_grad = _torch_loss(logits, target, weight, options)
    assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    assert_close(grad, want_grad, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_classes_match_torch(backend):
    """C = 0: probabilities over no classes give 0 per row, as torch's -0.0."""
    with kernels.use_backend(backend):
        out = F.cross_entropy(mx.zeros((3, 0)), mx.zeros((3, 0)), reduction="none")
    want = torch.nn.functional.cross_entropy(torch.zeros(3, 0), torch.zeros(3, 0), reduction="none")
    np.testing.assert_array_equal(np.array(out), want.numpy())


def test_numpy_scalars_are_taken_as_torch_takes_them():
    logits, target = mx.random.normal((4, 3), key=mx.random.key(4)), mx.array([0, 1, 2, 1])
    want = F.cross_entropy(logits, target, ignore_index=1, label_smoothing=0.25)
    got = F.cross_entropy(logits, target, ignore_index=np.int64(1), label_smoothing=np.float32(0.25))
    assert got.item() == want.item()


def test_the_primitive_gives_nan_rows_for_a_target_outside_the_classes():
    """seqlib.losses checks targets before they reach the primitive; called directly with one outside [0, C]
    (C: ignored), its row's loss and gradient are NaN and nothing is read outside the row."""
    if not native.available():
        pytest.skip(f"seqlib's C++ primitives are not available: {native.reason()}")
    primitive = native.extension().softmax_cross_entropy
    logits, targets = mx.random.normal((3, 20), key=mx.random.key(5)), mx.array([1, 21, 20], mx.int32)
    nll = primitive(logits, targets)[0]
    grad = np.array(mx.grad(lambda a: primitive(a, targets)[0].sum())(logits))
    assert np.isnan(np.array(nll)[1]) and np.isfinite(np.array(nll)[[0, 2]]).all() and np.array(nll)[2] == 0
    assert np.isnan(grad[1]).all() and np.isfinite(grad[0]).all() and (grad[2] == 0).all()  # row 2: ignored
