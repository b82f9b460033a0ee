"""seqlib.optim.Adam against torch.optim.Adam (its default, for-loop implementation, on the CPU).

The native path (float32 on MLX's CPU device: seqlib/native/optim_cpu.cpp) follows torch's vectorised
kernels operation by operation: its moments equal torch's bit for bit where the parameter does not feed
back into the gradient (no weight decay) and torch runs its AVX2 or AVX-512 kernels (its scalar
"default" kernels round the lerp and the addcmul in two steps, not one), and the parameter is within a
rounding of torch's per step (torch's square roots are MKL's, not correctly rounded).  The MLX-ops path
(the "plain" backend here) gives the same numbers within float32 rounding.
"""

import math

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_reference import assert_close

import seqlib
from seqlib import kernels, native, optim

BACKENDS = ["ops", "plain"]  # "ops": the native path where it is built; "plain": MLX's ops
MOMENTS = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]  # the state arrays, torch's names (the last with amsgrad)
# whether torch's CPU kernels round as seqlib's native update does (fused multiply-adds in lerp and addcmul)
TORCH_FUSES = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def needs_native():
    if not native.available():
        pytest.skip(f"seqlib's C++ primitives are not available: {native.reason()}")


def one_parameter_model(value: np.ndarray) -> mlx.nn.Module:
    model = mlx.nn.Module()
    model.weight = mx.array(value)
    return model


def torch_kwargs(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    kwargs["lr"] = kwargs.pop("learning_rate", 0.001)
    return kwargs


def run_both(shape, kwargs, steps, seed, backend):
    """``steps`` updates of one parameter with the same gradients, ours and torch's: a list per step of
    (ours, theirs) pairs for the parameter and each state array."""
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(shape).astype(np.float32)
    ours, theirs = one_parameter_model(value), torch.nn.Parameter(torch.from_numpy(value.copy()))
    our_optimizer = optim.Adam(**kwargs)
    their_optimizer = torch.optim.Adam([theirs], **torch_kwargs(kwargs))
    names = MOMENTS if kwargs.get("amsgrad") else MOMENTS[:2]
    history = []
    for _ in range(steps):
        gradient = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
        with kernels.use_backend(backend):
            our_optimizer.update(ours, {"weight": mx.array(gradient)})
            mx.eval(ours.parameters(), our_optimizer.state)
        theirs.grad = torch.from_numpy(gradient)
        their_optimizer.step()
        state = our_optimizer.state["weight"]
        pairs = [(np.array(ours.weight), theirs.detach().numpy().copy())]
        pairs += [(np.array(state[name]), their_optimizer.state[theirs][name].numpy().copy()) for name in names]
        history.append(pairs)
    return history


def assert_within_roundings(ours, theirs, rounds: int, scale: float, what=""):
    """|ours - theirs| within ``rounds`` roundings of each element and of ``scale`` (the size of an update)."""
    bound = rounds * (np.spacing(np.abs(theirs).astype(np.float32)) + np.float32(scale) * 2.0**-22)
    excess = np.abs(ours.astype(np.float64) - theirs) - bound
    assert not np.any(excess > 0), f"{what}: {np.count_nonzero(excess > 0)} elements past {rounds} roundings"


@st.composite
def adam_runs(draw):
    # (257, 129): 33,153 elements, past parallel_for's threshold for a second thread (about 18.7k)
    shape = draw(st.sampled_from([(1,), (7,), (16,), (33,), (3, 5), (64, 17), (1000,), (2, 3, 4), (257, 129)]))
    kwargs = draw(st.fixed_dictionaries({}, optional={
        "learning_rate": st.sampled_from([1e-3, 0.05, 0.3]),
        "betas": st.sampled_from([(0.9, 0.999), (0.5, 0.8), (0.3, 0.6), (0.0, 0.0), (0.99, 0.9999)]),
        "eps": st.sampled_from([1e-8, 1e-3, 0.0]),
        "amsgrad": st.booleans(),
        "maximize": st.booleans(),
    }))  # fmt: skip
    return shape, kwargs, draw(st.integers(1, 4)), draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(adam_runs())
def test_the_native_update_has_torchs_moments_bit_for_bit_and_its_parameter_within_a_rounding(run):
    needs_native()
    shape, kwargs, steps, seed = run
    learning_rate = kwargs.get("learning_rate", 0.001)
    for step, pairs in enumerate(run_both(shape, kwargs, steps, seed, "ops"), 1):
        (ours, theirs), *moments = pairs
        for (our_moment, their_moment), name in zip(moments, MOMENTS, strict=False):
            if TORCH_FUSES:
                np.testing.assert_array_equal(our_moment, their_moment, err_msg=f"{name}, step {step}, {kwargs}")
            else:
                assert_close(our_moment, their_moment, rtol=2e-6 * step, atol=1e-7 * step, what=f"{name}, {kwargs}")
        assert_within_roundings(ours, theirs, step, learning_rate, what=f"param, step {step}, {kwargs}")


@settings(max_examples=20, deadline=None)
@given(adam_runs(), st.sampled_from(BACKENDS))
def test_weight_decay_and_the_mlx_ops_path_match_torch_within_float32_rounding(run, backend):
    shape, kwargs, steps, seed = run
    kwargs = {**kwargs, "weight_decay": 0.01 if seed % 2 else 0.0}
    for step, pairs in enumerate(run_both(shape, kwargs, steps, seed, backend), 1):
        for (ours, theirs), name in zip(pairs, ["param", *MOMENTS], strict=False):
            assert_close(ours, theirs, rtol=2e-6 * step, atol=1e-7 * step, what=f"{name}, step {step}, {kwargs}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_first_updated_late_starts_at_its_own_step_as_in_torch(backend):
    rng = np.random.default_rng(3)
    values = {key: rng.standard_normal((5, 2)).astype(np.float32) for key in "ab"}
    ours = mlx.nn.Module()
    for key, value in values.items():
        setattr(ours, key, mx.array(value))
    theirs = {key: torch.nn.Parameter(torch.from_numpy(value.copy())) for key, value in values.items()}
    our_optimizer, their_optimizer = optim.Adam(learning_rate=0.1), torch.optim.Adam(theirs.values(), lr=0.1)
    for keys in ["a", "ab", "ab", "b"]:
        grads = {}
        for key in "ab":
            theirs[key].grad = None
            if key in keys:
                gradient = rng.standard_normal((5, 2)).astype(np.float32)
                grads[key], theirs[key].grad = mx.array(gradient), torch.from_numpy(gradient)
        with kernels.use_backend(backend):
            our_optimizer.update(ours, grads)
        their_optimizer.step()
        for key in "ab":
            assert_close(getattr(ours, key), theirs[key].detach(), rtol=1e-6, atol=1e-6, what=f"{keys} {key}")


def test_a_learning_rate_schedule_follows_torchs_learning_rate_step_by_step():
    rates = [0.1 * 0.5**step for step in range(4)]  # MLX's schedules take the optimizer's step, from 0
    our_optimizer = optim.Adam(learning_rate=lambda step: 0.1 * 0.5 ** step.astype(mx.float32))
    value = np.random.default_rng(4).standard_normal((6, 3)).astype(np.float32)
    ours, theirs = one_parameter_model(value), torch.nn.Parameter(torch.from_numpy(value.copy()))
    their_optimizer = torch.optim.Adam([theirs], lr=rates[0])
    for rate in rates:
        gradient = np.random.default_rng(int(rate * 1e6)).standard_normal((6, 3)).astype(np.float32)
        our_optimizer.update(ours, {"weight": mx.array(gradient)})
        their_optimizer.param_groups[0]["lr"] = float(np.float32(rate))  # the schedule's float32 value
        theirs.grad = torch.from_numpy(gradient)
        their_optimizer.step()
        assert_close(ours.weight, theirs.detach(), rtol=1e-6, atol=1e-6, what=f"learning rate {rate}")


class TinyModel(mlx.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = seqlib.nn.Embedding(11, 8)
        self.recurrent = seqlib.nn.LSTM(8, 16, batch_first=True)
        self.head = mlx.nn.Linear(16, 11)

    def __call__(self, ids):
        return self.head(self.recurrent(self.embedding(ids))[0])


def train(compiled: bool, steps: int = 3) -> list:
    mx.random.seed(0)
    model, optimizer = TinyModel(), optim.Adam(learning_rate=0.01, amsgrad=True)
    ids = mx.array(np.random.default_rng(5).integers(0, 11, (4, 6)))
    loss_and_grad = mlx.nn.value_and_grad(
        model, lambda m, ids: seqlib.functional.cross_entropy(m(ids[:, :-1]).reshape(-1, 11), ids[:, 1:].reshape(-1)))
    state = [model.state, optimizer.state]

    def step(ids):
        loss, grads = loss_and_grad(model, ids)
        optimizer.update(model, grads)
        return loss

    if compiled:
        step = mx.compile(step, inputs=state, outputs=state)
    losses = []
    for _ in range(steps):
        loss = step(ids)
        mx.eval(state, loss)
        losses.append(loss.item())
    return [*losses, np.array(model.head.weight)]


def test_a_compiled_training_step_gives_the_eager_steps_numbers():
    with kernels.use_backend("ops"):  # the native path where it is built (emulated kernels cannot run compiled)
        eager, compiled = train(False), train(True)
    assert eager[:-1] == compiled[:-1]
    np.testing.assert_array_equal(eager[-1], compiled[-1])
    assert eager[-2] < eager[0]  # it trains


def test_the_native_update_maps_under_vmap_and_follows_shapes_under_a_shapeless_compile():
    needs_native()
    update = native.extension().adam_update
    rng = np.random.default_rng(6)
    params, grads = (mx.array(rng.standard_normal((3, 10)).astype(np.float32)) for _ in range(2))
    zeros, step, rate = mx.zeros((3, 10)), mx.array(2, mx.uint64), mx.array(0.1)
    mapped = mx.vmap(lambda p, g, m, v: update(p, g, [m, v], step, rate, 0.9, 0.999, 1e-8, 0.0, False, False))(
        params, grads, zeros, zeros)  # fmt: skip
    for row in range(3):
        one = update(params[row], grads[row], [zeros[row], zeros[row]], step, rate, 0.9, 0.999, 1e-8, 0.0, False, False)
        for ours, want in zip(mapped, one, strict=True):
            np.testing.assert_array_equal(np.array(ours[row]), np.array(want))
    shapeless = mx.compile(lambda p, g, m, v: update(p, g, [m, v], step, rate, 0.9, 0.999, 1e-8, 0.0, False, False),
                           shapeless=True)  # fmt: skip
    for size in (10, 4):
        out = shapeless(params[0, :size], grads[0, :size], zeros[0, :size], zeros[0, :size])
        want = update(params[0, :size], grads[0, :size], [zeros[0, :size]] * 2, step, rate, 0.9, 0.999, 1e-8, 0.0,
                      False, False)  # fmt: skip
        assert out[0].shape == (size,)
        np.testing.assert_array_equal(np.array(out[0]), np.array(want[0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_strided_and_nan_parameters_are_handled_as_torch_handles_them(backend):
    with kernels.use_backend(backend):
        empty = one_parameter_model(np.zeros((0, 3), np.float32))
        optim.Adam().update(empty, {"weight": mx.zeros((0, 3))})
        assert empty.weight.shape == (0, 3)
        value = np.arange(12, dtype=np.float32).reshape(3, 4)
        strided = one_parameter_model(value)
        strided.weight = mx.array(value.T.copy()).T  # a transposed view
        optimizer, gradient = optim.Adam(learning_rate=0.1), np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
        optimizer.update(strided, {"weight": mx.array(gradient)})
        theirs = torch.nn.Parameter(torch.from_numpy(value.copy()))
        theirs.grad = torch.from_numpy(gradient)
        torch.optim.Adam([theirs], lr=0.1).step()
        assert_close(strided.weight, theirs.detach(), rtol=1e-6, atol=1e-6)
        nan = one_parameter_model(np.ones(4, np.float32))
        optimizer = optim.Adam(amsgrad=True)
        optimizer.update(nan, {"weight": mx.array([1.0, math.nan, math.inf, -1.0])})
        optimizer.update(nan, {"weight": mx.array([1.0, 1.0, 1.0, -1.0])})
        theirs = torch.nn.Parameter(torch.ones(4))
        their_optimizer = torch.optim.Adam([theirs], amsgrad=True)
        for gradient in ([1.0, math.nan, math.inf, -1.0], [1.0, 1.0, 1.0, -1.0]):
            theirs.grad = torch.tensor(gradient)
            their_optimizer.step()
        np.testing.assert_array_equal(np.isnan(np.array(nan.weight)), torch.isnan(theirs.detach()).numpy())
        np.testing.assert_array_equal(np.isnan(np.array(optimizer.state["weight"]["max_exp_avg_sq"])),
                                      torch.isnan(their_optimizer.state[theirs]["max_exp_avg_sq"]).numpy())


def test_half_precision_parameters_take_the_mlx_ops_path():
    value = np.random.default_rng(7).standard_normal((4, 5)).astype(np.float32)
    results = []
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        model = one_parameter_model(value)
        model.weight = model.weight.astype(dtype)
        optim.Adam(learning_rate=0.1).update(model, {"weight": mx.ones((4, 5), dtype)})
        assert model.weight.dtype == dtype
        results.append(np.array(model.weight.astype(mx.float32)))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(results[2], results[0], rtol=2e-2, atol=2e-2)


def test_a_sparse_gradient_is_refused_as_torch_refuses_it():
    table = seqlib.nn.Embedding(5, 2, sparse=True)
    _, grads = seqlib.sparse.value_and_grad(table, lambda m: m(mx.array([1])).sum())(table)
    with pytest.raises(TypeError, match=r"'weight'.*Adam does not take a SparseGradient.*SparseAdam"):
        optim.Adam().update(table, grads)


def test_the_native_update_refuses_arrays_it_was_not_built_for():
    needs_native()
    update = native.extension().adam_update
    ones, step, rate = mx.ones((4,)), mx.array(1, mx.uint64), mx.array(0.1)
    cases = [
        (lambda: update(ones, mx.ones((5,)), [ones, ones], step, rate, 0.9, 0.999, 1e-8, 0.0, False, False),
         ["parameter's shape", "5", "4"]),
        (lambda: update(ones, ones, [ones], step, rate, 0.9, 0.999, 1e-8, 0.0, False, False), ["2 float32 state"]),
        (lambda: update(ones, ones, [ones, ones], step, rate, 0.9, 0.999, 1e-8, 0.0, True, False), ["3 float32"]),
        (lambda: update(ones.astype(mx.float16), ones, [ones, ones], step, rate, 0.9, 0.999, 1e-8, 0.0, False, False),
         ["float32 param"]),
        (lambda: update(ones, ones, [ones, ones], mx.array(1), rate, 0.9, 0.999, 1e-8, 0.0, False, False),
         ["uint64 step"]),
        (lambda: update(ones, ones, [ones, ones], step, mx.ones((2,)), 0.9, 0.999, 1e-8, 0.0, False, False),
         ["one learning rate"]),
    ]  # fmt: skip
    for call, words in cases:
        with pytest.raises(ValueError) as raised:
            call()
        for word in words:
            assert word in str(raised.value), (word, str(raised.value))


def test_a_gradient_through_the_update_needs_the_mlx_ops_path_and_says_so():
    model = one_parameter_model(np.ones(4, np.float32))
    optimizer = optim.Adam(learning_rate=0.1)
    optimizer.init(model.trainable_parameters())

    def updated_sum(gradient):
        return optimizer.apply_gradients({"weight": gradient}, model.trainable_parameters())["weight"].sum()

    if native.available():
        with kernels.use_backend("ops"), pytest.raises(ValueError, match=r"AdamUpdate.*optimizer's update.*NATIVE=0"):
            mx.eval(mx.grad(updated_sum)(mx.ones(4)))
    with kernels.use_backend("plain"):
        gradient = mx.grad(updated_sum)(mx.ones(4))
    assert np.all(np.isfinite(np.array(gradient)))
