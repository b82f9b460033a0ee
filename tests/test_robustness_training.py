"""Malformed input for training: seqlib.optim, seqlib.sparse and seqlib.interop (issue 13, part 2).

Every public callable of these modules gets bad input and must either give torch's
result (computed here on the same data) or raise a clear error at the call.  Cases
whose indices could reach a gather or scatter unchecked run in a worker process
(tests/isolated.py), so a segfault or an out-of-bounds write fails one test.

Ported from PyTorch's own tests: the optimizer error inputs of
torch/testing/_internal/common_optimizers.py (``Tensor lr must be 1-element``,
``momentum=-0.5``, ``lr_decay=-0.5``, ``betas=(1.0, 0.0)``, SparseAdam's refusal of
complex parameters) and torch.sparse_coo_tensor's construction checks (indices out
of range or negative with the invariant checks on, values whose row count or width
does not match, a size of the wrong length).
"""

import math
import warnings

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from isolated import assert_clear_error, run_isolated
from torch_reference import assert_close

import seqlib
from seqlib import optim
from seqlib.interop import from_mlx, from_torch, to_mlx, to_mlx_array
from seqlib.sparse import SparseGradient, lookup_table, value_and_grad

OPTIMIZER_NAMES = ["SGD", "Adagrad", "SparseAdam"]  # those that take a SparseGradient
DENSE_OPTIMIZER_NAMES = ["SGD", "Adagrad", "Adam"]
DEFAULT_LR = {"SGD": 0.1, "Adagrad": 0.1, "SparseAdam": 0.05, "Adam": 0.01}


def make_optimizer(name, **kwargs):
    kwargs.setdefault("learning_rate", DEFAULT_LR[name])
    return getattr(optim, name)(**kwargs)


def torch_optimizer(name, parameters, **kwargs):
    kwargs = dict(kwargs)
    kwargs["lr"] = kwargs.pop("learning_rate", DEFAULT_LR[name])
    return getattr(torch.optim, name)(parameters, **kwargs)


# ------------------------------------------------------------------ worker-side cases (plain data in, MLX inside)


def sparse_update(name, kwargs, indices, values, gradient_shape, table_shape=(4, 2)):
    """One optimizer step on a (table_shape) table with the SparseGradient built from the arguments."""
    table = seqlib.nn.Embedding.from_pretrained(mx.ones(table_shape), freeze=False, sparse=True)
    gradient = SparseGradient(mx.array(indices), mx.array(values), tuple(gradient_shape))
    make_optimizer(name, **kwargs).update(table, {"weight": gradient})
    return table.weight


def dense_update(name, kwargs, gradients, dtype="float32"):
    """One optimizer step on a float32 (4, 2) table with ``gradients`` (a tree, arrays as NumPy)."""
    table = seqlib.nn.Embedding.from_pretrained(mx.ones((4, 2)), freeze=False)

    def to_mlx_leaves(tree):
        if isinstance(tree, dict):
            return {key: to_mlx_leaves(value) for key, value in tree.items()}
        return mx.array(tree).astype(getattr(mx, dtype)) if isinstance(tree, np.ndarray) else tree

    make_optimizer(name, **kwargs).update(table, to_mlx_leaves(gradients))
    return table.weight


def reuse_optimizer_on_a_bigger_table(name, bigger_rows):
    """One step on a (4, 2) table, then the same optimizer on a (bigger_rows, 2) table's last row."""
    optimizer = make_optimizer(name, **({"momentum": 0.5} if name == "SGD" else {}))
    for rows in (4, bigger_rows):
        table = seqlib.nn.Embedding(rows, 2, sparse=True)
        optimizer.update(table, {"weight": SparseGradient(mx.array([rows - 1]), mx.ones((1, 2)), (rows, 2))})
    return table.weight


def construct_and_densify(indices, values, shape):
    return SparseGradient(mx.array(indices), mx.array(values), shape).to_dense()


def sparse_grad_of_lookup(ids, num_embeddings=5, dim=2):
    """seqlib.sparse.value_and_grad of an Embedding(sparse=True) looking up ``ids``, as (indices, values)."""
    mx.random.seed(0)
    table = seqlib.nn.Embedding(num_embeddings, dim, sparse=True)
    loss_and_grad = value_and_grad(table, lambda m, ids: (m(ids) * mx.arange(1, dim + 1)).sum())
    _, grads = loss_and_grad(table, mx.array(ids))
    return grads["weight"].indices, grads["weight"].values


class RawLookup(mlx.nn.Module):
    """A sparse-capable table that gathers rows itself (no checks of its own), as lookup_table allows."""

    def __init__(self, num_embeddings, dim):
        super().__init__()
        self.weight = mx.ones((num_embeddings, dim))
        self.padding_idx = None
        self.sparse = True
        self.sparse_recording = None

    def __call__(self, ids):
        table, ids, _ = lookup_table(self, ids)
        return mx.take(table, ids, axis=0)


def raw_lookup_gradient(ids):
    table = RawLookup(4, 2)
    _, grads = value_and_grad(table, lambda m, ids: m(ids).sum())(table, mx.array(ids))
    return grads["weight"].to_dense()


# ------------------------------------------------------------------ SparseGradient


@st.composite
def sparse_rows(draw, low=0, extra=0, max_rows=6):
    """(indices, values, shape): rows may repeat; ``low``/``extra`` widen the index range past [0, V)."""
    num_rows = draw(st.integers(1, 6))
    dim = draw(st.integers(1, 3))
    indices = draw(st.lists(st.integers(low, num_rows - 1 + extra), min_size=0, max_size=max_rows))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = rng.standard_normal((len(indices), dim)).astype(np.float32)
    return np.array(indices, np.int64), values, (num_rows, dim)


@settings(max_examples=30)
@given(sparse_rows(low=-8, extra=8))
def test_sparse_gradient_accepts_torchs_valid_indices_and_refuses_the_rest(case):
    indices, values, shape = case
    outcome = run_isolated(construct_and_densify, indices, values, shape)
    if indices.size == 0 or (indices.min() >= 0 and indices.max() < shape[0]):
        expected = torch.sparse_coo_tensor(torch.from_numpy(indices)[None], torch.from_numpy(values), shape)
        assert outcome.kind == "returned", str(outcome)
        assert_close(outcome.value, expected.to_dense(), rtol=1e-6, atol=1e-6)
    else:
        with pytest.raises(RuntimeError, match=r"(size is inconsistent|negative)"):
            torch.sparse_coo_tensor(torch.from_numpy(indices)[None], torch.from_numpy(values), shape,
                                    check_invariants=True)  # fmt: skip
        assert_clear_error(outcome, "indices", f"[0, {shape[0]})", str(int(indices.min() if indices.min() < 0
                                                                           else indices.max())))  # fmt: skip


@given(sparse_rows(max_rows=10))
def test_coalesce_sorts_and_sums_repeated_rows_like_torch(case):
    indices, values, shape = case
    ours = SparseGradient(mx.array(indices), mx.array(values), shape).coalesce()
    theirs = torch.sparse_coo_tensor(torch.from_numpy(indices)[None], torch.from_numpy(values), shape).coalesce()
    assert np.array(ours.indices).tolist() == theirs.indices()[0].tolist()
    assert_close(ours.values, theirs.values(), rtol=1e-6, atol=1e-6)
    assert ours.is_coalesced() and ours.coalesce() is ours
    assert SparseGradient(mx.array(indices), mx.array(values), shape).is_coalesced() == (
        bool(np.all(np.diff(indices) > 0))
    )


@pytest.mark.parametrize(
    ("indices", "values", "shape", "error", "words"),
    [
        (mx.array([[0, 1]]), mx.ones((2, 2)), (4, 2), ValueError, ["indices", "1-D", "(1, 2)"]),
        (mx.array([0.0]), mx.ones((1, 2)), (4, 2), TypeError, ["indices", "integer", "float32"]),
        ([0, 1], mx.ones((2, 2)), (4, 2), TypeError, ["indices", "list"]),
        (mx.array([0, 1]), mx.ones((1, 2)), (4, 2), ValueError, ["values", "(2, 2)", "(1, 2)"]),  # torch: nnz
        (mx.array([0]), mx.ones((1, 3)), (4, 2), ValueError, ["values", "(1, 2)", "(1, 3)"]),  # torch: values size
        (mx.array([0]), mx.ones((1,)), (4, 2), ValueError, ["values", "(1, 2)", "(1,)"]),
        (mx.array([0]), mx.ones((1, 2), mx.int32), (4, 2), TypeError, ["values", "floating", "int32"]),
        (mx.array([0]), mx.ones((1, 2), mx.complex64), (4, 2), TypeError, ["values", "floating", "complex64"]),
        (mx.array([0]), "rows", (4, 2), TypeError, ["values", "str"]),
        (mx.array([0]), mx.ones((1, 2)), (4,), ValueError, ["shape", "(4,)"]),  # torch: len(size)
        (mx.array([0]), mx.ones((1, 2)), (4, 2, 1), ValueError, ["shape", "(4, 2, 1)"]),
        (mx.array([0]), mx.ones((1, 2)), (-3, 2), ValueError, ["shape[0]", "-3"]),
        (mx.array([0]), mx.ones((1, 2)), (4.0, 2), TypeError, ["shape[0]", "4.0"]),
        (mx.array([0]), mx.ones((1, 2)), (4, True), TypeError, ["shape[1]", "True"]),
        (mx.array([0]), mx.ones((1, 2)), None, TypeError, ["shape", "NoneType"]),
        (mx.array([0]), mx.ones((1, 2)), 4, TypeError, ["shape", "int"]),
        (mx.array([0]), mx.ones((1, 2)), (0, 2), IndexError, ["indices", "[0, 0)", "0"]),
    ],
)
def test_sparse_gradient_construction_refuses_malformed_parts(indices, values, shape, error, words):
    with pytest.raises(error) as raised:
        SparseGradient(indices, values, shape)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_sparse_gradients_compare_by_identity_instead_of_failing_inside_mlx():
    first, second = (SparseGradient(mx.array([0, 1]), mx.ones((2, 2)), (3, 2)) for _ in range(2))
    assert first == first and first != second and len({first, second}) == 2


def test_sparse_gradient_takes_numpy_and_torch_values():
    gradient = SparseGradient(np.array([3, 1]), torch.ones(2, 2, dtype=torch.bfloat16), (4, 2))
    assert gradient.values.dtype == mx.float32 and gradient.indices.dtype == mx.int64
    np.testing.assert_array_equal(np.array(gradient.to_dense()), [[0, 0], [1, 1], [0, 0], [1, 1]])


# ------------------------------------------------------------------ optimizers: memory safety


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
@pytest.mark.parametrize("bad_index", [-1, 4, 5, 10**8, -(10**8)])
def test_out_of_range_sparse_rows_never_reach_an_optimizers_scatter(name, bad_index):
    """Adagrad segfaulted, SGD wrote a row past the table, SparseAdam with -1 updated the last row."""
    outcome = run_isolated(sparse_update, name, {}, [1, bad_index], np.ones((2, 2), np.float32), (4, 2))
    assert_clear_error(outcome, "indices", "[0, 4)", str(bad_index), case=(name, bad_index))


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_a_sparse_gradient_for_a_bigger_table_is_refused_before_its_rows_are_written(name):
    outcome = run_isolated(sparse_update, name, {}, [1, 7], np.ones((2, 2), np.float32), (8, 2), (4, 2))
    assert_clear_error(outcome, "weight", "(4, 2)", "(8, 2)", allowed=(ValueError,), case=name)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_an_optimizer_reused_on_a_bigger_table_refuses_instead_of_scattering_past_its_state(name):
    outcome = run_isolated(reuse_optimizer_on_a_bigger_table, name, 10**6)
    assert_clear_error(outcome, "'weight'", "(4, 2)", "(1000000, 2)", "new optimizer", allowed=(ValueError,))


@pytest.mark.parametrize("name", DENSE_OPTIMIZER_NAMES)
def test_an_optimizer_reused_after_a_dtype_change_refuses_instead_of_promoting_the_parameter(name):
    optimizer = make_optimizer(name, **({"momentum": 0.5} if name == "SGD" else {}))
    table = seqlib.nn.Embedding(4, 2)
    optimizer.update(table, {"weight": mx.ones((4, 2))})
    table.set_dtype(mx.float16)
    with pytest.raises(ValueError, match=r"'weight'.*float32.*float16"):
        optimizer.update(table, {"weight": mx.ones((4, 2), mx.float16)})


# ------------------------------------------------------------------ optimizers: against torch


@st.composite
def optimizer_runs(draw):
    name = draw(st.sampled_from(OPTIMIZER_NAMES))
    options = {
        "SGD": st.fixed_dictionaries({}, optional={"momentum": st.sampled_from([0.5, 0.9]),
                                                   "dampening": st.sampled_from([0.0, 0.3])}),
        "Adagrad": st.fixed_dictionaries({}, optional={"lr_decay": st.sampled_from([0.0, 0.1]),
                                                       "initial_accumulator_value": st.sampled_from([0.0, 0.2])}),
        "SparseAdam": st.fixed_dictionaries({}, optional={"betas": st.sampled_from([(0.9, 0.999), (0.5, 0.8)])}),
    }[name]  # fmt: skip
    kwargs = draw(options)
    num_rows, dim = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    steps = draw(st.lists(st.lists(st.integers(0, num_rows - 1), max_size=8), min_size=1, max_size=3))
    return name, kwargs, (num_rows, dim), steps, draw(st.integers(0, 2**16))


@given(optimizer_runs())
def test_optimizers_match_torch_on_repeated_and_empty_sparse_rows(run):
    """torch coalesces a sparse grad (sums repeated rows) before Adagrad's and SparseAdam's non-linear update."""
    name, kwargs, shape, steps, seed = run
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal(shape).astype(np.float32)
    ours = seqlib.nn.Embedding.from_pretrained(mx.array(weight), freeze=False, sparse=True)
    theirs = torch.nn.Parameter(torch.from_numpy(weight.copy()))
    our_optimizer, their_optimizer = make_optimizer(name, **kwargs), torch_optimizer(name, [theirs], **kwargs)
    for step, rows in enumerate(steps):
        values = rng.standard_normal((len(rows), shape[1])).astype(np.float32)
        indices = np.array(rows, np.int64)
        our_optimizer.update(ours, {"weight": SparseGradient(mx.array(indices), mx.array(values), shape)})
        theirs.grad = torch.sparse_coo_tensor(torch.from_numpy(indices)[None], torch.from_numpy(values), shape)
        their_optimizer.step()
        assert_close(ours.weight, theirs.detach(), rtol=1e-5, atol=1e-5, what=f"{name} {kwargs} step {step}")


@pytest.mark.parametrize(("name", "kwargs"), [
    ("SGD", {"momentum": 0.9, "dampening": 0.5}),
    ("Adagrad", {"lr_decay": 0.5}),
    ("SparseAdam", {}),
])  # fmt: skip
def test_a_parameter_first_updated_late_starts_at_its_own_step_as_in_torch(name, kwargs):
    """This raised a KeyError (no optimizer state for it); torch counts steps per parameter."""
    rng = np.random.default_rng(3)
    weights = {key: rng.standard_normal((5, 2)).astype(np.float32) for key in "ab"}
    ours = mlx.nn.Module()
    for key, weight in weights.items():
        setattr(ours, key, seqlib.nn.Embedding.from_pretrained(mx.array(weight), freeze=False, sparse=True))
    theirs = {key: torch.nn.Parameter(torch.from_numpy(weight.copy())) for key, weight in weights.items()}
    our_optimizer, their_optimizer = make_optimizer(name, **kwargs), torch_optimizer(name, theirs.values(), **kwargs)
    for keys in ["a", "ab", "ab", "b"]:
        grads = {}
        for key in "ab":
            theirs[key].grad = None
            if key in keys:
                indices, values = np.array([0, 3, 3]), rng.standard_normal((3, 2)).astype(np.float32)
                grads[key] = {"weight": SparseGradient(mx.array(indices), mx.array(values), (5, 2))}
                theirs[key].grad = torch.sparse_coo_tensor(torch.from_numpy(indices)[None],
                                                           torch.from_numpy(values), (5, 2))  # fmt: skip
        our_optimizer.update(ours, grads)
        their_optimizer.step()
        for key in "ab":
            assert_close(getattr(ours, key).weight, theirs[key].detach(), rtol=1e-5, atol=1e-6, what=f"{keys} {key}")


# ------------------------------------------------------------------ optimizers: arguments, as torch checks them

ARGUMENT_VALUES = [-1.0, -1e-9, 0.0, 1e-9, 0.5, 0.999, 1.0, 2.0, math.inf, -math.inf]
ARGUMENTS = {
    "SGD": {"lr": "learning_rate", "momentum": "momentum", "weight_decay": "weight_decay", "dampening": "dampening"},
    "Adagrad": {"lr": "learning_rate", "lr_decay": "lr_decay", "weight_decay": "weight_decay",
                "initial_accumulator_value": "initial_accumulator_value", "eps": "eps"},
    "SparseAdam": {"lr": "learning_rate", "eps": "eps", "beta1": None, "beta2": None},
    "Adam": {"lr": "learning_rate", "eps": "eps", "weight_decay": "weight_decay", "beta1": None, "beta2": None},
}  # fmt: skip


def torch_accepts(name, torch_kwargs) -> str | None:
    """None if torch.optim.<name> accepts the arguments, else its message."""
    try:
        getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(2, 2))], **torch_kwargs)
    except ValueError as error:
        return str(error)
    return None


@st.composite
def optimizer_arguments(draw):
    name = draw(st.sampled_from([*OPTIMIZER_NAMES, "Adam"]))
    torch_kwargs = {argument: draw(st.sampled_from(ARGUMENT_VALUES)) for argument in ARGUMENTS[name]
                    if draw(st.booleans())}  # fmt: skip
    if name == "SGD" and draw(st.booleans()):
        torch_kwargs["nesterov"] = True
    return name, torch_kwargs


@settings(max_examples=80)
@given(optimizer_arguments())
def test_optimizer_arguments_are_accepted_and_refused_as_torch_does(case):
    name, torch_kwargs = case
    torch_kwargs.setdefault("lr", 0.1)
    ours = {ARGUMENTS[name].get(key, key): value for key, value in torch_kwargs.items() if "beta" not in key}
    if name in ("SparseAdam", "Adam"):
        betas = (torch_kwargs.pop("beta1", 0.9), torch_kwargs.pop("beta2", 0.999))
        torch_kwargs["betas"] = ours["betas"] = betas
    refusal = torch_accepts(name, torch_kwargs)
    if refusal is None:
        getattr(optim, name)(**ours)
        return
    with pytest.raises(ValueError) as raised:
        getattr(optim, name)(**ours)
    message = str(raised.value)
    torch_names = {"Invalid learning rate": "learning_rate", "Invalid epsilon": "eps", "index 0": "betas[0]",
                   "index 1": "betas[1]", "Nesterov": "nesterov"}  # fmt: skip
    named = next((ours_name for words, ours_name in torch_names.items() if words in refusal),
                 refusal.split("Invalid ")[-1].split(" value")[0])  # fmt: skip
    assert named in message, (refusal, message)


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "words"),
    [
        ("SGD", {"momentum": -0.5}, ValueError, ["momentum", "-0.5"]),  # ported: common_optimizers.py
        ("Adagrad", {"lr_decay": -0.5}, ValueError, ["lr_decay", "-0.5"]),  # ported
        ("SparseAdam", {"betas": (1.0, 0.0)}, ValueError, ["betas[0]", "1.0"]),  # ported
        ("SGD", {"learning_rate": mx.array([0.001, 0.001])}, ValueError, ["learning_rate", "(2,)"]),  # ported
        ("SparseAdam", {"learning_rate": 0.0}, ValueError, ["learning_rate", "0.0"]),
        ("SparseAdam", {"eps": 0.0}, ValueError, ["eps", "0.0"]),
        ("SparseAdam", {"betas": 0.9}, TypeError, ["betas", "0.9"]),
        ("SparseAdam", {"betas": (0.9,)}, TypeError, ["betas", "(0.9,)"]),
        ("SGD", {"nesterov": True}, ValueError, ["nesterov", "momentum=0"]),
        ("SGD", {"nesterov": True, "momentum": 0.9, "dampening": 0.1}, ValueError, ["nesterov", "dampening=0.1"]),
        ("SGD", {"learning_rate": "0.1"}, TypeError, ["learning_rate", "str"]),
        ("SGD", {"learning_rate": None}, TypeError, ["learning_rate", "NoneType"]),
        ("Adagrad", {"eps": None}, TypeError, ["eps", "NoneType"]),
        ("SGD", {"momentum": math.nan}, ValueError, ["momentum", "nan"]),  # torch lets NaN through here
        ("SGD", {"learning_rate": lambda step: -0.1 * mx.ones(())}, ValueError, ["learning_rate"]),
        ("Adagrad", {"learning_rate": lambda step: 0.1}, TypeError, ["learning_rate", "schedule", "float"]),
        ("Adam", {"betas": (0.9, 1.0)}, ValueError, ["betas[1]", "1.0"]),
        ("Adam", {"weight_decay": -0.1}, ValueError, ["weight_decay", "-0.1"]),
        ("Adam", {"eps": -1e-8}, ValueError, ["eps", "-1e-08"]),
        ("Adam", {"amsgrad": 1}, TypeError, ["amsgrad", "1"]),  # torch takes any truthy value
        ("Adam", {"betas": (1.0, 0.999), "weight_decay": -1.0}, ValueError, ["betas[0]", "1.0"]),  # torch's order
        ("Adam", {"maximize": "yes"}, TypeError, ["maximize", "yes"]),
        ("Adam", {"betas": [0.9, "0.99"]}, TypeError, ["betas[1]", "str"]),
    ],
)
def test_optimizer_constructors_refuse_malformed_arguments(name, kwargs, error, words):
    with pytest.raises(error) as raised:
        make_optimizer(name, **kwargs)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_a_learning_rate_schedule_and_a_one_element_array_are_still_accepted():
    make_optimizer("SGD", learning_rate=lambda step: 0.1 * 0.5 ** step.astype(mx.float32))
    make_optimizer("Adagrad", learning_rate=mx.array(0.1))


# ------------------------------------------------------------------ optimizers: gradients that do not fit

FLOAT_ONES = np.ones((4, 2), np.float32)


@pytest.mark.parametrize("name", DENSE_OPTIMIZER_NAMES)
@pytest.mark.parametrize(
    ("gradients", "dtype", "error", "words"),
    [
        ({"weight": np.ones((2,), np.float32)}, "float32", ValueError, ["'weight'", "(4, 2)", "(2,)"]),
        ({"weight": np.ones((4, 1), np.float32)}, "float32", ValueError, ["'weight'", "(4, 2)", "(4, 1)"]),
        ({"weight": np.ones((1, 4, 2), np.float32)}, "float32", ValueError, ["'weight'", "(1, 4, 2)"]),
        ({"weight": FLOAT_ONES}, "float16", TypeError, ["'weight'", "float32", "float16"]),
        ({"weight": FLOAT_ONES}, "int32", TypeError, ["'weight'", "float32", "int32"]),
        ({"weight": None}, "float32", TypeError, ["'weight'", "NoneType"]),
        ({"weight": [[1.0, 1.0]] * 4}, "float32", TypeError, ["'weight'"]),
        ({"bias": FLOAT_ONES}, "float32", ValueError, ["'bias'", "no parameter"]),
        ({"weight": FLOAT_ONES, "extra": {"w": FLOAT_ONES}}, "float32", ValueError, ["'extra'", "no parameter"]),
        (None, "float32", TypeError, ["gradients", "NoneType"]),
        (FLOAT_ONES, "float32", TypeError, ["gradients", "dict", "array"]),
        ({"weight": {"w": FLOAT_ONES}}, "float32", TypeError, ["'weight'", "dict"]),
    ],
)
def test_dense_gradients_that_do_not_fit_their_parameter_are_refused(name, gradients, dtype, error, words):
    outcome = run_isolated(dense_update, name, {}, gradients, dtype)
    assert_clear_error(outcome, *words, allowed=(error,), case=(name, dtype))


@pytest.mark.parametrize("name", [*OPTIMIZER_NAMES, "Adam"])
def test_update_and_apply_gradients_refuse_what_is_not_a_model(name):
    gradients = {"weight": mx.ones((4, 2))}
    for call, words in [(lambda: make_optimizer(name).update(None, gradients), ["model", "NoneType"]),
                        (lambda: make_optimizer(name).update(dict(gradients), gradients), ["model", "dict"]),
                        (lambda: make_optimizer(name).apply_gradients(gradients, None), ["parameters", "NoneType"])]:
        with pytest.raises(TypeError) as raised:
            call()
        for word in words:
            assert word in str(raised.value)


@pytest.mark.parametrize("name", DENSE_OPTIMIZER_NAMES)
def test_apply_gradients_takes_a_parameter_tree_as_mlx_optimizers_do(name):
    table = seqlib.nn.Embedding(4, 2)
    updated = make_optimizer(name).apply_gradients({"weight": mx.ones((4, 2))}, table.parameters())
    assert updated["weight"].shape == (4, 2)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_a_sparse_gradient_of_another_dtype_is_refused(name):
    table = seqlib.nn.Embedding(4, 2, dtype=mx.float16, sparse=True)
    gradient = SparseGradient(mx.array([1]), mx.ones((1, 2)), (4, 2))
    with pytest.raises(TypeError, match=r"'weight'.*float16.*float32"):
        make_optimizer(name).update(table, {"weight": gradient})


def test_sparse_adam_refuses_dense_gradients_and_weight_decay_refuses_sparse_ones_naming_the_parameter():
    outcome = run_isolated(dense_update, "SparseAdam", {}, {"weight": FLOAT_ONES})
    assert_clear_error(outcome, "'weight'", "SparseAdam", allowed=(TypeError,))
    for name in ["SGD", "Adagrad"]:
        outcome = run_isolated(sparse_update, name, {"weight_decay": 0.1}, [1], np.ones((1, 2), np.float32), (4, 2))
        assert_clear_error(outcome, "weight_decay", "'weight'", allowed=(ValueError,), case=name)


def test_valid_dense_gradients_still_match_torch():
    gradient = np.random.default_rng(0).standard_normal((4, 2)).astype(np.float32)
    for name, kwargs in [("SGD", {"momentum": 0.9, "nesterov": True}), ("Adagrad", {"weight_decay": 0.1}),
                         ("Adam", {"weight_decay": 0.1, "amsgrad": True})]:  # fmt: skip
        outcome = run_isolated(dense_update, name, kwargs, {"weight": gradient})
        theirs = torch.nn.Parameter(torch.ones(4, 2))
        theirs.grad = torch.from_numpy(gradient)
        torch_optimizer(name, [theirs], **kwargs).step()
        assert_close(outcome.value, theirs.detach(), rtol=1e-6, atol=1e-6, what=name)


# ------------------------------------------------------------------ seqlib.sparse.value_and_grad and lookup_table


@settings(max_examples=25)
@given(st.lists(st.integers(-7, 11), max_size=6), st.sampled_from(["flat", "row", "column"]))
def test_value_and_grad_matches_torchs_sparse_grad_or_refuses_out_of_range_ids(ids, layout):
    """Any ids: torch's coalesced sparse grad (empty batches included), or an IndexError naming input."""
    ids = np.array(ids, np.int64)
    ids = {"flat": ids, "row": ids[None, :], "column": ids[:, None]}[layout]
    outcome = run_isolated(sparse_grad_of_lookup, ids)
    if ids.size and (ids.min() < 0 or ids.max() >= 5):
        assert_clear_error(outcome, "input", "[0, 5)", allowed=(IndexError,), case=ids.tolist())
        return
    table = torch.nn.Embedding(5, 2, sparse=True)
    (table(torch.from_numpy(ids)) * torch.arange(1, 3)).sum().backward()
    expected = table.weight.grad.coalesce()
    assert outcome.kind == "returned", str(outcome)
    indices, values = outcome.value
    assert indices.tolist() == expected.indices()[0].tolist()
    assert_close(values.reshape(-1, 2), expected.values(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad_ids", [[0, 4], [-1], [2, 10**8]])
def test_a_table_that_gathers_its_own_rows_gets_them_checked_before_the_gather(bad_ids):
    outcome = run_isolated(raw_lookup_gradient, bad_ids)
    assert_clear_error(outcome, "input", "[0, 4)", str(min(bad_ids) if min(bad_ids) < 0 else max(bad_ids)),
                       allowed=(IndexError,))  # fmt: skip
    assert run_isolated(raw_lookup_gradient, [3, 3]).value.tolist() == [[0, 0], [0, 0], [0, 0], [2, 2]]


def test_an_empty_batch_gives_an_empty_sparse_gradient_that_changes_nothing():
    table = seqlib.nn.Embedding(4, 2, sparse=True)
    before = np.array(table.weight)
    _, grads = value_and_grad(table, lambda m: m(mx.zeros((0,), mx.int32)).sum())(table)
    assert grads["weight"].indices.shape == (0,) and grads["weight"].values.shape == (0, 2)
    for name in OPTIMIZER_NAMES:
        make_optimizer(name).update(table, grads)
        np.testing.assert_array_equal(np.array(table.weight), before)


SPARSE_MODEL = seqlib.nn.Embedding(4, 2, sparse=True)
DENSE_MODEL = seqlib.nn.Embedding(4, 2)


@pytest.mark.parametrize("model", [SPARSE_MODEL, DENSE_MODEL], ids=["sparse", "dense"])
@pytest.mark.parametrize(
    ("fn", "error", "words"),
    [
        (lambda m: m(mx.array([1, 2])), ValueError, ["fn", "scalar", "(2, 2)"]),  # torch: implicit grad of non-scalar
        (lambda m: m(mx.array([1])).sum(keepdims=True), ValueError, ["fn", "scalar", "(1, 1)"]),
        (lambda m: 3.0, TypeError, ["fn", "float"]),
        (lambda m: None, TypeError, ["fn", "NoneType"]),
        (lambda m: m(mx.array([1])).sum().astype(mx.int32), TypeError, ["fn", "int32"]),
        (lambda m: m(mx.array([1.0])).sum(), TypeError, ["input", "float32"]),
        (lambda m: m([1, 2]).sum(), TypeError, ["input", "list"]),
    ],
)
def test_value_and_grad_refuses_losses_mlx_cannot_differentiate(model, fn, error, words):
    with pytest.raises(error) as raised:
        value_and_grad(model, fn)(model)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
    assert getattr(model, "sparse_recording", None) is None and "weight" in model.trainable_parameters()


def test_value_and_grad_still_passes_auxiliary_outputs_through():
    value, grads = value_and_grad(SPARSE_MODEL, lambda m: (m(mx.array([1])).sum(), mx.array(7)))(SPARSE_MODEL)
    assert value[1].item() == 7 and isinstance(grads["weight"], SparseGradient)


@pytest.mark.parametrize(("model", "fn", "words"), [
    (None, lambda m: m, ["model", "NoneType"]),
    (torch.nn.Embedding(3, 2), lambda m: m, ["model", "Embedding"]),
    (SPARSE_MODEL, None, ["fn", "NoneType"]),
    (SPARSE_MODEL, "loss", ["fn", "str"]),
])  # fmt: skip
def test_value_and_grad_refuses_what_is_not_a_model_or_a_function(model, fn, words):
    with pytest.raises(TypeError) as raised:
        value_and_grad(model, fn)
    for word in words:
        assert word in str(raised.value)


class NotATable(mlx.nn.Module):
    sparse = True

    def __init__(self):
        super().__init__()
        self.weight = mx.ones((3, 2))

    def __call__(self, ids):
        return self.weight[ids]  # reads its weight directly, not through lookup_table


def test_a_module_that_only_calls_itself_sparse_gets_a_correct_dense_gradient():
    """Without lookup_table its rows cannot be recorded: its gradient stays dense instead of going missing."""
    model = NotATable()
    _, grads = value_and_grad(model, lambda m: m(mx.array([1, 1])).sum())(model)
    np.testing.assert_array_equal(np.array(grads["weight"]), [[0, 0], [2, 2], [0, 0]])


@pytest.mark.parametrize(("module", "input", "error", "words"), [
    (None, mx.array([0]), TypeError, ["module", "NoneType"]),
    (mlx.nn.Linear(2, 2), mx.array([0]), TypeError, ["module", "Linear"]),
    (SPARSE_MODEL, mx.array([0.5]), TypeError, ["input", "float32"]),
    (SPARSE_MODEL, [0], TypeError, ["input", "list"]),
    (SPARSE_MODEL, None, TypeError, ["input", "NoneType"]),
])  # fmt: skip
def test_lookup_table_refuses_modules_without_a_table_and_non_integer_input(module, input, error, words):
    with pytest.raises(error) as raised:
        lookup_table(module, input)
    for word in words:
        assert word in str(raised.value)


def test_register_from_torch_takes_a_class_name():
    with pytest.raises(TypeError, match="torch_class_name"):
        seqlib.interop.register_from_torch(torch.nn.LSTM)


def test_lookup_table_outside_value_and_grad_is_the_modules_own_table():
    table, ids, padding_idx = lookup_table(seqlib.nn.Embedding(4, 2, padding_idx=-1), np.array([1, 2]))
    assert ids.tolist() == [1, 2] and padding_idx == 3 and table.shape == (4, 2)


# ------------------------------------------------------------------ seqlib.interop


def lstm_state_dict():
    torch.manual_seed(0)
    return torch.nn.LSTM(3, 2).state_dict()


@settings(max_examples=30)
@given(st.data())
def test_load_torch_state_dict_accepts_and_refuses_what_torchs_load_state_dict_does(data):
    state = lstm_state_dict()
    keys = list(state)
    dropped = data.draw(st.sets(st.sampled_from(keys), max_size=2))
    extra = data.draw(st.sets(st.sampled_from(["bias", "weight_ih_l1", "weight_hr_l0"]), max_size=1))
    reshaped = data.draw(st.sets(st.sampled_from(keys), max_size=1))
    strict = data.draw(st.booleans())
    given_state = {key: value for key, value in state.items() if key not in dropped}
    given_state |= {key: torch.zeros(2) for key in extra}
    for key in reshaped & set(given_state):
        given_state[key] = torch.zeros(given_state[key].shape[0] + 1, *given_state[key].shape[1:])
    try:
        torch_result = torch.nn.LSTM(3, 2).load_state_dict(given_state, strict=strict)
        torch_error = None
    except RuntimeError as error:
        torch_error = str(error)
    ours = seqlib.nn.LSTM(3, 2)
    before = ours.torch_state_dict()
    if torch_error is None:
        result = ours.load_torch_state_dict(given_state, strict=strict)
        assert (sorted(result.missing_keys), sorted(result.unexpected_keys)) == (
            sorted(torch_result.missing_keys), sorted(torch_result.unexpected_keys))
        for key, value in ours.torch_state_dict().items():
            expected = given_state[key].numpy() if key in given_state else before[key]
            np.testing.assert_array_equal(value, expected, err_msg=key)
        return
    with pytest.raises(ValueError) as raised:
        ours.load_torch_state_dict(given_state, strict=strict)
    for key in sorted(dropped) * strict + sorted(extra) * strict + sorted(reshaped & set(given_state)):
        if key in torch_error:
            assert key in str(raised.value), (key, str(raised.value))
    for key, value in ours.torch_state_dict().items():  # nothing was loaded
        np.testing.assert_array_equal(value, before[key])


with torch.device("meta"):
    META_WEIGHT = torch.zeros(4, 2)
    META_TABLE = torch.nn.Embedding(4, 2)


@pytest.mark.parametrize(("state_dict", "error", "words"), [
    (None, TypeError, ["state_dict", "NoneType"]),
    ([("weight", torch.zeros(4, 2))], TypeError, ["state_dict", "list"]),
    ({"weight": "zeros"}, TypeError, ["state_dict['weight']", "str"]),
    ({"weight": None}, TypeError, ["state_dict['weight']", "NoneType"]),
    ({"weight": [[0.0, 0.0]] * 4}, TypeError, ["state_dict['weight']", "list"]),
    ({"weight": np.zeros((4, 2), object)}, TypeError, ["state_dict['weight']", "object"]),
    pytest.param({"weight": np.zeros((4, 2), np.longdouble)}, TypeError, ["state_dict['weight']", "float128"],
                 marks=pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="long double is float64")),
    ({"weight": META_WEIGHT}, ValueError, ["state_dict['weight']", "meta"]),
    ({"weight": torch.zeros(2, 4)}, ValueError, ["state_dict['weight']", "(4, 2)", "(2, 4)"]),
    ({0: torch.zeros(4, 2)}, TypeError, ["state_dict", "0"]),
    ({}, ValueError, ["missing keys ['weight']"]),
    ({"weight": torch.zeros(4, 2), "bias": torch.zeros(2)}, ValueError, ["unexpected keys ['bias']"]),
])  # fmt: skip
def test_load_torch_state_dict_refuses_malformed_state_dicts_naming_the_key(state_dict, error, words):
    table = seqlib.nn.Embedding(4, 2)
    with pytest.raises(error) as raised:
        table.load_torch_state_dict(state_dict)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_load_torch_state_dict_converts_dtypes_and_layouts_as_torchs_copy_does():
    values = torch.arange(8.0).reshape(4, 2)
    for given_value in [values.to(torch.float8_e4m3fn), values.to(torch.int64), values.to(torch.bfloat16),
                        values.requires_grad_(True) * 1, np.arange(8).reshape(4, 2)]:
        theirs = torch.nn.Embedding(4, 2)
        theirs.load_state_dict({"weight": given_value if isinstance(given_value, torch.Tensor)
                                else torch.from_numpy(given_value)})  # fmt: skip
        ours = seqlib.nn.Embedding(4, 2)
        ours.load_torch_state_dict({"weight": given_value})
        assert_close(ours.weight, theirs.weight, rtol=0, atol=0, what=str(getattr(given_value, "dtype", "")))


@pytest.mark.parametrize(("value", "dtype", "error", "words"), [
    (None, None, TypeError, ["value", "NoneType"]),
    ([1.0, 2.0], None, TypeError, ["value", "list"]),
    (3.0, None, TypeError, ["value", "float"]),
    (np.array(["a"]), None, TypeError, ["value", "<U1"]),
    (torch.nn.Linear(2, 2), None, TypeError, ["value", "Linear"]),
    (torch.zeros(2), "float32", TypeError, ["dtype", "str"]),
    (META_WEIGHT, None, ValueError, ["value", "meta", "(4, 2)"]),
])  # fmt: skip
def test_to_mlx_array_refuses_what_is_not_an_array(value, dtype, error, words):
    with pytest.raises(error) as raised:
        to_mlx_array(value, dtype)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_to_mlx_array_reads_torch_tensors_numpy_cannot():
    real = torch.tensor([1.5, -2.0, 0.25])
    np.testing.assert_array_equal(np.array(to_mlx_array(real.to(torch.bfloat16))), [1.5, -2.0, 0.25])
    np.testing.assert_array_equal(np.array(to_mlx_array(real.to(torch.float8_e5m2))), [1.5, -2.0, 0.25])
    np.testing.assert_array_equal(np.array(to_mlx_array(-real.neg())), real.numpy())  # a neg-bit view
    conjugate = torch.tensor([1 + 2j]).conj()
    assert np.array(to_mlx_array(conjugate)).tolist() == [1 - 2j]
    with pytest.raises(RuntimeError, match="dense and sparse"):  # torch's load_state_dict refuses sparse values
        torch.zeros(3).copy_(real.to_sparse())
    for refused in [real.to_sparse(), quantized_table().weight()]:
        with pytest.raises(TypeError, match="dense"):
            to_mlx_array(refused)


def quantized_table():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates its quantized tensors
        return torch.ao.nn.quantized.Embedding(4, 2)


class SubclassedLSTM(torch.nn.LSTM):
    def forward(self, input, hx=None):
        return super().forward(input.flip(0), hx)


class LSTM(mlx.nn.Module):  # the name of an mlx.nn layer, not one
    pass


@pytest.mark.parametrize(("module", "error", "words"), [
    (None, TypeError, ["module", "NoneType", "torch.nn.LSTM"]),
    ("LSTM", TypeError, ["module", "str"]),
    (torch.nn.Linear(2, 2), TypeError, ["module", "Linear"]),
    (SubclassedLSTM(3, 2), TypeError, ["module", "SubclassedLSTM"]),
    (seqlib.nn.LSTM(3, 2), TypeError, ["module", "seqlib"]),
    (mlx.nn.LSTM(3, 2), TypeError, ["module", "mlx"]),
    (quantized_table(), TypeError, ["module", "torch.ao"]),
    (META_TABLE, ValueError, ["module:", "meta", "['weight']"]),
])  # fmt: skip
def test_from_torch_refuses_what_it_cannot_convert(module, error, words):
    assert_raises_naming(from_torch, module, error, words)

def assert_raises_naming(convert, value, error, words):
    """``convert(value)`` raises ``error`` with every one of ``words`` in its message."""
    with pytest.raises(error) as raised:
        convert(value)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def broken_mlx_lstm():
    module = mlx.nn.LSTM(3, 2)
    module.Wh = mx.zeros((8, 3))  # hidden size 3 cannot hold 4 * 3 gate rows
    return module


def flat_mlx_gru():
    module = mlx.nn.GRU(3, 2)
    module.Wx = mx.zeros((6,))
    return module


@pytest.mark.parametrize(("make", "error", "words"), [
    (lambda: None, TypeError, ["module", "NoneType"]),
    (lambda: mlx.nn.Linear(3, 2), TypeError, ["module", "Linear"]),
    (LSTM, TypeError, ["module", "LSTM"]),
    (lambda: seqlib.nn.GRU(3, 2), TypeError, ["module", "GRU"]),
    (lambda: torch.nn.RNN(3, 2), TypeError, ["module", "RNN"]),
    (broken_mlx_lstm, ValueError, ["weight_ih_l0", "weight_hh_l0", "(12, 3)", "(8, 3)"]),
    (flat_mlx_gru, ValueError, ["module", "2-D", "(6,)"]),
])  # fmt: skip
def test_from_mlx_refuses_what_is_not_an_intact_mlx_layer(make, error, words):
    assert_raises_naming(from_mlx, make(), error, words)



def test_from_mlx_keeps_the_layers_dtype():
    module = mlx.nn.GRU(3, 2)
    module.set_dtype(mx.bfloat16)
    assert all(value.dtype == mx.bfloat16 for value in from_mlx(module).parameters().values())


@pytest.mark.parametrize(("make", "error", "words"), [
    (lambda: None, TypeError, ["layer", "NoneType"]),
    (lambda: mlx.nn.LSTM(3, 2), TypeError, ["layer", "LSTM"]),
    (lambda: seqlib.nn.LSTMCell(3, 2), TypeError, ["layer", "LSTMCell"]),
    (lambda: torch.nn.GRU(3, 2), TypeError, ["layer", "GRU"]),
    (lambda: seqlib.nn.RNN(3, 2, num_layers=2), ValueError, ["layer", "num_layers=2"]),
])  # fmt: skip
def test_to_mlx_refuses_what_mlx_nn_cannot_hold(make, error, words):
    assert_raises_naming(to_mlx, make(), error, words)
