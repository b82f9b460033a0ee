"""Bad and edge input for seqlib's embeddings and bags, held to torch (issue 13, part 2).

Every public callable of the embedding family gets malformed input: the modules
``seqlib.nn.Embedding`` / ``EmbeddingBag`` (constructor, ``from_pretrained``, call),
``seqlib.functional`` (``embedding``, ``embedding_bag``, ``embedding_renorm``,
``renorm_for_lookup``) and the embedding wrappers of ``seqlib.kernels``, the modules and
functions on both backends: the MLX-ops path and the Metal kernels in the emulation
(``metal_backend()``).  Each seqlib call runs in a worker process (``tests/isolated.py``),
so an unchecked index reaching a gather fails one test instead of the run.  torch runs on
the same data (in the worker too: some of its own edge cases segfault) and is the oracle:
where it returns, seqlib must return the same; where it raises, seqlib must raise a clear
error naming the argument; except for the documented DEVIATIONS, where seqlib raises (or,
for a (B, 0) bag input, returns zeros) on purpose.

Ported from PyTorch's test/nn/test_embedding.py: test_embedding_bag_padding_idx_error,
test_embeddingbag_include_last_offset (a deviation), test_embedding_bag_empty_input,
test_EmbeddingBag_empty_per_sample_weights_and_offsets, test_embedding_bag_out_of_bounds_idx,
test_embedding_bag_dimension_errors, test_EmbeddingBag_per_sample_weights_failures,
test_embedding_scalar_weight_error (also common_methods_invocations' error_inputs_embedding),
test_embedding_sparse_empty_tensor, test_embedding_from_pretrained (integer tables: a deviation)
and test_embedding_padding_idx's range checks.
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from isolated import assert_clear_error, run_isolated
from emulated import launch_count, metal_backend

import seqlib
from seqlib import functional as F
from seqlib import kernels

BACKENDS = ["ops", "metal"]
INDEX_DTYPES = [np.int32, np.int64]
NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------- running a case on either side
#
# A case is plain data: {"op": name, "args": {argument: value}}.  NumPy arrays become
# mx.array / torch.tensor on each side (same dtype); ("raw", x) is passed as it is.


def _build(value, framework: str):
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "raw":
        return value[1]
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "mx":  # an MLX dtype, by name
        return getattr(mx, value[1])
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy()) if framework == "torch" else mx.array(value)
    return value


def _arguments(case: dict, framework: str) -> dict:
    return {name: _build(value, framework) for name, value in case["args"].items()}


@contextlib.contextmanager
def _on(backend: str):
    if backend == "metal":
        with metal_backend("random", True):
            yield
    else:
        with kernels.use_backend("ops"):
            yield


MODULE_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse", "mode",
                  "include_last_offset")  # fmt: skip


def _module_options(a: dict) -> dict:
    return {name: a[name] for name in MODULE_OPTIONS if name in a}


def _seqlib_op(op: str, a: dict):
    if op == "embedding":
        return F.embedding(a.pop("input"), a.pop("weight"), **a)
    if op == "embedding_bag":
        return F.embedding_bag(a.pop("input"), a.pop("weight"), **a)
    if op == "embedding_renorm":
        return F.embedding_renorm(a["weight"], a["input"], a["max_norm"], a.get("norm_type", 2.0))
    if op == "renorm_for_lookup":
        return F.renorm_for_lookup(a["weight"], a["input"], a["max_norm"], a.get("norm_type", 2.0))
    if op in ("Embedding", "EmbeddingBag"):
        module = getattr(seqlib.nn, op).from_pretrained(a["weight"], freeze=False, **_module_options(a))
        call = [a["input"]] + ([a.get("offsets"), a.get("per_sample_weights")] if op == "EmbeddingBag" else [])
        return module(*call), module.weight
    if op == "kernels.embedding":
        return kernels.embedding(a["indices"], a["weight"], a.get("padding_idx"), a.get("grad_scale"))
    if op == "kernels.embedding_bag":  # offsets as bounds: the last one ends the last bag
        return kernels.embedding_bag(a["indices"], a["weight"], a["offsets"], a.get("mode", "mean"),
                                     a.get("per_sample_weights"), True, a.get("padding_idx"))  # fmt: skip
    if op == "kernels.embedding_renorm_scales":
        return kernels.embedding_renorm_scales(a["weight"], a["rows"], a["max_norm"], a.get("norm_type", 2.0))
    raise AssertionError(op)


def seqlib_call(case: dict, backend: str = "ops"):
    """Run a case through seqlib on ``backend``.

    A function that launches a kernel before raising fails the case.  (A module with
    ``max_norm`` may renormalise the rows it was given, range-checked, before its bag
    checks refuse the call; the result is dropped and the module left unchanged.)
    """
    with _on(backend):
        before = launch_count()
        try:
            result = _seqlib_op(case["op"], _arguments(case, "mlx"))
            mx.eval(result)
            return result
        except Exception as error:
            if launch_count() != before and not case["op"][0].isupper():
                raise AssertionError(f"a kernel was launched before the error {error!r}") from error
            raise


def _torch_op(op: str, a: dict):
    functional = torch.nn.functional
    if op == "embedding":
        return functional.embedding(a.pop("input"), a.pop("weight"), **a)
    if op == "embedding_bag":
        return functional.embedding_bag(a.pop("input"), a.pop("weight"), **a)
    if op in ("embedding_renorm", "renorm_for_lookup"):
        return torch.embedding_renorm_(a["weight"], a["input"], a["max_norm"], a.get("norm_type", 2.0))
    if op in ("Embedding", "EmbeddingBag"):
        module = getattr(torch.nn, op).from_pretrained(a["weight"], freeze=False, **_module_options(a))
        call = [a["input"]] + ([a.get("offsets"), a.get("per_sample_weights")] if op == "EmbeddingBag" else [])
        return module(*call), module.weight
    if op == "kernels.embedding":
        return functional.embedding(a["indices"].long(), a["weight"])
    if op == "kernels.embedding_bag":
        return functional.embedding_bag(a["indices"].long(), a["weight"], a["offsets"].long(),
                                        mode=a.get("mode", "mean"), include_last_offset=True,
                                        per_sample_weights=a.get("per_sample_weights"),
                                        padding_idx=a.get("padding_idx"))  # fmt: skip
    if op == "kernels.embedding_renorm_scales":
        norms = torch.linalg.vector_norm(a["weight"][a["rows"].long()].double(), ord=a.get("norm_type", 2.0), dim=1)
        return torch.where(norms > a["max_norm"], a["max_norm"] / (norms + 1e-7), torch.ones_like(norms))
    raise AssertionError(op)


def torch_call(case: dict):
    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.detach().float().numpy() if value.is_floating_point() else value.numpy()
        return tuple(plain(item) for item in value) if isinstance(value, tuple) else value

    return plain(_torch_op(case["op"], _arguments(case, "torch")))


def assert_same(ours, theirs, what="", rtol=1e-5, atol=1e-6):
    if isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs), what
        for one, other in zip(ours, theirs, strict=True):
            assert_same(one, other, what, rtol, atol)
        return
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape}, torch {theirs.shape}"
    np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), rtol=rtol, atol=atol,
                               equal_nan=True, err_msg=what)  # fmt: skip


def check_against_torch(case: dict, backend: str, names=(), deviation: str | None = None):
    """seqlib on ``case`` gives torch's result, or a clear error naming ``names`` where torch raises.

    ``deviation``: "raise" where seqlib refuses what torch accepts; "zeros" where seqlib returns
    zeros that torch fails (or crashes) on: B bags of nothing from a (B, 0) input, and no bags
    from empty offsets (torch's max and padding_idx kernels crash on a non-empty input there).
    """
    ours = run_isolated(seqlib_call, case, backend)
    if deviation == "raise":
        assert_clear_error(ours, *names, case=case)
        return
    theirs = run_isolated(torch_call, case)
    if deviation == "zeros" and theirs.kind != "returned":
        assert ours.kind == "returned", f"{case}: {ours}"
        output = ours.value[0] if isinstance(ours.value, tuple) else ours.value
        assert not np.any(output), output
        return
    if theirs.kind == "returned":
        assert ours.kind == "returned", f"torch returns for {case}, but seqlib {ours}"
        assert_same(ours.value, theirs.value, what=str(case))
    else:
        assert_clear_error(ours, *names, case=case)


# ----------------------------------------------------------------- corruptions of valid cases
#
# Each takes a valid case's arguments (a dict of NumPy arrays and options) and a random
# generator, breaks one thing, and says which names seqlib's error must contain.  For the
# modules, the table is from_pretrained's ``embeddings``.


def _nonempty_input(a, rng):
    if a["input"].size == 0:
        a["input"] = np.zeros(1, a["input"].dtype) if a["input"].ndim < 2 else np.zeros((1, 1), a["input"].dtype)
        if a.get("offsets") is not None:
            a["offsets"] = np.array([0], np.int64) if not a.get("include_last_offset") else np.array([0, 1])
        if a.get("per_sample_weights") is not None:
            a["per_sample_weights"] = np.ones(a["input"].shape, np.float32)
    return a["input"].reshape(-1)


def index_too_big(a, rng):
    flat = _nonempty_input(a, rng).copy()
    flat[rng.integers(flat.size)] = len(a["weight"]) + rng.integers(0, 3)
    a["input"] = flat.reshape(a["input"].shape)
    return ("input",)


def index_negative(a, rng):
    flat = _nonempty_input(a, rng).copy()
    flat[rng.integers(flat.size)] = -1 - rng.integers(0, len(a["weight"]) + 2)
    a["input"] = flat.reshape(a["input"].shape)
    return ("input",)


def float_input(a, rng):
    a["input"] = a["input"].astype(np.float32)
    return ("input", "float32")


def bool_input(a, rng):
    a["input"] = a["input"] > 0
    return ("input", "bool")


def list_input(a, rng):
    a["input"] = ("raw", np.atleast_1d(a["input"]).tolist())
    return ("input", "list")


def numpy_float_input(a, rng):
    a["input"] = ("raw", a["input"].astype(np.float64))
    return ("input", "float64")


def padding_too_big(a, rng):
    a["padding_idx"] = len(a["weight"]) + int(rng.integers(0, 3))
    return ("padding_idx", str(a["padding_idx"]))


def padding_too_small(a, rng):
    a["padding_idx"] = -len(a["weight"]) - 1 - int(rng.integers(0, 3))
    return ("padding_idx", str(a["padding_idx"]))


def padding_float(a, rng):
    a["padding_idx"] = 0.5
    return ("padding_idx", "float")


def max_norm_negative(a, rng):
    a["max_norm"] = -0.5
    return ("max_norm", "-0.5")


def norm_type_not_positive(a, rng):
    a["max_norm"], a["norm_type"] = 1.0, float(rng.choice([0.0, -1.0]))
    return ("norm_type",)


def weight_1d(a, rng):
    a["weight"] = a["weight"].reshape(-1)
    return ("2-D",)


def weight_3d(a, rng):
    a["weight"] = a["weight"][None]
    return ("2-D",)


def weight_0d(a, rng):
    a["weight"] = np.array(1.0, np.float32)
    return ("2-D",)


def weight_int(a, rng):
    a["weight"] = np.nan_to_num(a["weight"], nan=0.0, posinf=0.0, neginf=0.0).astype(np.int32)  # NaN has no int
    return ("floating", "int32")


LOOKUP_CORRUPTIONS = {
    None: (), "index_too_big": index_too_big, "index_negative": index_negative, "float_input": float_input,
    "bool_input": bool_input, "list_input": list_input, "numpy_float_input": numpy_float_input,
    "padding_too_big": padding_too_big, "padding_too_small": padding_too_small, "padding_float": padding_float,
    "max_norm_negative": max_norm_negative, "norm_type_not_positive": norm_type_not_positive,
    "weight_1d": weight_1d, "weight_3d": weight_3d, "weight_0d": weight_0d, "weight_int": weight_int,
}  # fmt: skip
# seqlib raises where torch returns: a negative max_norm flips rows' signs and norm_type <= 0 is
# no norm (seqlib's check_max_norm); seqlib's tables are floating (they are trained; torch looks
# up integer tables too); a Python list or NumPy float array (torch: TypeError) is refused too.
LOOKUP_DEVIATIONS = {"max_norm_negative", "norm_type_not_positive", "weight_int"}
WEIGHT_CORRUPTIONS = {"weight_1d", "weight_3d", "weight_0d", "weight_int"}


def _names(names, corruption, op):
    """A corrupted table is named ``weight`` in the functions and ``embeddings`` in from_pretrained."""
    if corruption in WEIGHT_CORRUPTIONS:
        return ("embeddings" if op[0].isupper() else "weight", *names)
    return names


@st.composite
def lookup_cases(draw, ops=("embedding", "Embedding")):
    op = draw(st.sampled_from(ops))
    num_embeddings, embedding_dim = draw(st.integers(0, 6)), draw(st.integers(0, 4))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    if num_embeddings == 0:
        shape = [*shape[:2], 0]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    a = {
        "input": rng.integers(0, max(num_embeddings, 1), size=shape).astype(draw(st.sampled_from(INDEX_DTYPES))),
        "weight": rng.standard_normal((num_embeddings, embedding_dim)).astype(np.float32),
        "padding_idx": draw(st.none() | st.integers(-num_embeddings, num_embeddings - 1)) if num_embeddings else None,
        "max_norm": draw(st.none() | st.sampled_from([0.0, 0.5, 2.0])),
        "norm_type": draw(st.sampled_from([1.0, 2.0, 3.0, INF])),
        "scale_grad_by_freq": draw(st.booleans()),
    }  # fmt: skip
    corruption = draw(st.sampled_from(list(LOOKUP_CORRUPTIONS)))
    names = LOOKUP_CORRUPTIONS[corruption](a, rng) if corruption else ()
    return {"op": op, "args": a}, corruption, _names(names, corruption, op)


@settings(max_examples=60)
@given(lookup_cases(), st.sampled_from(BACKENDS))
def test_lookups_give_torchs_result_or_a_clear_error(drawn, backend):
    case, corruption, names = drawn
    event(f"{case['op']}: {corruption}")
    deviation = "raise" if corruption in LOOKUP_DEVIATIONS else None
    a = case["args"]
    table = a.get("weight", a.get("embeddings"))
    if corruption is None and a.get("max_norm") is not None and a.get("norm_type") == np.inf and table.shape[1] == 0:
        deviation = "zeros"  # rows of no columns: torch fails to take their inf norm, seqlib looks them up
    check_against_torch(case, backend, names, deviation)


# ----------------------------------------------------------------- bags


def input_3d(a, rng):
    a["input"], a["offsets"], a["per_sample_weights"] = a["input"].reshape(1, 1, -1), None, None
    return ("input", "1-D", "2-D")


def input_0d(a, rng):
    a["input"], a["per_sample_weights"] = np.array(0, np.int64), None
    return ("input",)


def _one_d(a, rng):
    """Make the case 1-D with offsets (the corruption is about offsets)."""
    if a["input"].ndim == 2:
        rows, length = a["input"].shape
        a["input"] = a["input"].reshape(-1)
        a["offsets"] = np.arange(rows, dtype=np.int64) * length
        if a.get("include_last_offset"):
            a["offsets"] = np.append(a["offsets"], rows * length)
        if a.get("per_sample_weights") is not None:
            a["per_sample_weights"] = a["per_sample_weights"].reshape(-1)


def offsets_not_from_zero(a, rng):
    _one_d(a, rng)
    _nonempty_input(a, rng)
    a["offsets"] = np.append(a["offsets"], a["input"].size)
    a["offsets"][0] = 1 + rng.integers(0, a["input"].size)
    a["offsets"] = np.sort(a["offsets"])
    return ("offsets", "0")


def offsets_decreasing(a, rng):
    _one_d(a, rng)
    _nonempty_input(a, rng)
    a["offsets"] = np.array([0, a["input"].size, 0], np.int64)
    return ("offsets", "non-decreasing")


def offsets_past_end(a, rng):
    _one_d(a, rng)
    a["offsets"] = np.array([0, a["input"].size + 1 + rng.integers(0, 3)], np.int64)
    return ("offsets", str(a["input"].size))


def offsets_float(a, rng):
    _one_d(a, rng)
    a["offsets"] = a["offsets"].astype(np.float32)
    return ("offsets", "float32")


def offsets_bool(a, rng):
    _one_d(a, rng)
    a["offsets"] = np.zeros(max(a["offsets"].size, 1), bool)
    return ("offsets", "bool")


def offsets_2d(a, rng):
    _one_d(a, rng)
    a["offsets"] = np.zeros((1, 1), np.int64)
    return ("offsets", "1-D")


def offsets_with_2d_input(a, rng):
    a["input"] = a["input"].reshape(1, -1)
    a["offsets"], a["per_sample_weights"] = np.zeros(1, np.int64), None
    return ("offsets", "None")


def offsets_missing(a, rng):
    _one_d(a, rng)
    a["offsets"] = None
    return ("offsets", "None")


def last_offset_short(a, rng):
    _one_d(a, rng)
    _nonempty_input(a, rng)
    a["include_last_offset"] = True
    a["offsets"] = np.array([0, rng.integers(0, a["input"].size)], np.int64)
    return ("offsets", "include_last_offset", "52851")


def weights_dtype(a, rng):
    a["mode"], a["max_norm"] = "sum", None
    a["per_sample_weights"] = np.ones(a["input"].shape, rng.choice([np.float16, np.int32]))
    return ("per_sample_weights", "dtype")


def weights_flat_for_2d(a, rng):
    a["mode"], a["max_norm"], a["offsets"] = "sum", None, None
    a["input"] = a["input"].reshape(1, -1) if a["input"].ndim == 1 else a["input"]
    a["per_sample_weights"] = np.ones(a["input"].size + (a["input"].shape[0] != 1), np.float32)
    return ("per_sample_weights", str(tuple(a["input"].shape)))


def weights_wrong_length(a, rng):
    _one_d(a, rng)
    a["mode"] = "sum"
    a["per_sample_weights"] = np.ones(a["input"].size + 1, np.float32)
    return ("per_sample_weights", f"({a['input'].size},)")


def weights_with_mean_or_max(a, rng):
    a["mode"], a["scale_grad_by_freq"] = str(rng.choice(["mean", "max"])), False
    a["per_sample_weights"] = np.ones(a["input"].shape, np.float32)
    return ("per_sample_weights", "sum")


def mode_unknown(a, rng):
    a["mode"] = str(rng.choice(["avg", "Sum", "median"]))
    return ("mode", a["mode"])


def max_with_sparse(a, rng):
    a["mode"], a["sparse"], a["per_sample_weights"] = "max", True, None
    return ("sparse", "max")


def max_with_frequency_scaling(a, rng):
    a["mode"], a["scale_grad_by_freq"], a["per_sample_weights"] = "max", True, None
    return ("scale_grad_by_freq", "max")


BAG_CORRUPTIONS = {
    None: (), "index_too_big": index_too_big, "index_negative": index_negative, "float_input": float_input,
    "bool_input": bool_input, "list_input": list_input, "input_3d": input_3d, "input_0d": input_0d,
    "offsets_not_from_zero": offsets_not_from_zero, "offsets_decreasing": offsets_decreasing,
    "offsets_past_end": offsets_past_end, "offsets_float": offsets_float, "offsets_bool": offsets_bool,
    "offsets_2d": offsets_2d, "offsets_with_2d_input": offsets_with_2d_input, "offsets_missing": offsets_missing,
    "last_offset_short": last_offset_short, "weights_dtype": weights_dtype,
    "weights_flat_for_2d": weights_flat_for_2d, "weights_wrong_length": weights_wrong_length,
    "weights_with_mean_or_max": weights_with_mean_or_max, "padding_too_big": padding_too_big,
    "padding_too_small": padding_too_small, "padding_float": padding_float, "mode_unknown": mode_unknown,
    "max_with_sparse": max_with_sparse, "max_with_frequency_scaling": max_with_frequency_scaling,
    "max_norm_negative": max_norm_negative, "norm_type_not_positive": norm_type_not_positive,
    "weight_1d": weight_1d, "weight_3d": weight_3d, "weight_int": weight_int,
}  # fmt: skip
# seqlib raises where torch returns: bool indices and offsets (torch's bags read them as 0/1, its
# lookups refuse them), entries after the last offset with include_last_offset (pytorch#52851),
# and max_norm / norm_type as for lookups.
# seqlib refuses these where torch returns something: bools read as 0/1, a short last offset (pytorch#52851),
# a negative max_norm, a norm_type that is no norm, and decreasing offsets (torch's sum/mean kernels refuse
# them, its max kernel returns bags of whatever lies between)
BAG_DEVIATIONS = {"bool_input", "offsets_bool", "last_offset_short", "max_norm_negative", "norm_type_not_positive",
                  "offsets_decreasing"}  # fmt: skip


@st.composite
def bag_cases(draw, ops=("embedding_bag", "EmbeddingBag")):
    op = draw(st.sampled_from(ops))
    num_embeddings, embedding_dim = draw(st.integers(1, 6)), draw(st.integers(0, 4))
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    include_last_offset = draw(st.booleans())
    if draw(st.booleans()):  # 2-D: B bags of N (B or N may be 0)
        indices = rng.integers(0, num_embeddings, size=(draw(st.integers(0, 3)), draw(st.integers(0, 3))))
        offsets = None
    else:
        lengths = draw(st.lists(st.integers(0, 4), max_size=4))
        indices = rng.integers(0, num_embeddings, size=sum(lengths))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        offsets = offsets if include_last_offset else offsets[:-1]  # no lengths and no last offset: no bags
    weight = rng.standard_normal((num_embeddings, embedding_dim)).astype(np.float32)
    if draw(st.booleans()):  # NaN and -inf in the table: max mode must pick what torch picks
        weight[rng.random(weight.shape) < 0.3] = NAN
        weight[rng.random(weight.shape) < 0.2] = -INF
    finite = np.isfinite(weight).all()  # renormalising inf rows: 0 * inf, not a case for this test
    max_norm = draw(st.none() | st.sampled_from([0.5, 2.0])) if finite else None
    a = {
        "input": indices.astype(draw(st.sampled_from(INDEX_DTYPES))), "weight": weight, "offsets": offsets,
        "mode": mode, "include_last_offset": include_last_offset, "max_norm": max_norm,
        "padding_idx": draw(st.none() | st.integers(-num_embeddings, num_embeddings - 1)),
        "per_sample_weights": (rng.uniform(-2, 2, indices.shape).astype(np.float32)
                               if mode == "sum" and draw(st.booleans()) else None),
    }  # fmt: skip
    corruption = draw(st.sampled_from(list(BAG_CORRUPTIONS)))
    names = BAG_CORRUPTIONS[corruption](a, rng) if corruption else ()
    return {"op": op, "args": a}, corruption, _names(names, corruption, op)


def _deviation(case, corruption):
    if corruption in BAG_DEVIATIONS:
        return "raise"
    table = case["args"].get("weight", case["args"].get("embeddings"))
    if corruption and corruption.startswith("offsets") and table is not None and 0 in table.shape:
        return "raise"  # torch checks offsets only where there is work: a table with no columns skips them
    inputs, offsets = case["args"]["input"], case["args"].get("offsets")
    if corruption is None and inputs.ndim == 2 and inputs.shape[1] == 0:
        return "zeros"  # torch 2.13 fails in its own arange (step 0); B empty bags are B rows of zeros
    if corruption is None and inputs.ndim == 1 and offsets is not None and offsets.size == 0:
        return "zeros"  # no bags: (0, D), as torch's sum/mean kernels give (its others crash)
    return None


@settings(max_examples=80)
@given(bag_cases(), st.sampled_from(BACKENDS))
def test_bags_give_torchs_result_or_a_clear_error(drawn, backend):
    case, corruption, names = drawn
    event(f"{case['op']}: {corruption}")
    check_against_torch(case, backend, names, _deviation(case, corruption))


# ----------------------------------------------------------------- the kernels' wrappers, called directly


@st.composite
def kernel_bag_cases(draw):
    op = "kernels.embedding_bag"
    num_embeddings, embedding_dim = draw(st.integers(1, 5)), draw(st.integers(0, 70))
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = draw(st.lists(st.integers(0, 3), max_size=4))
    indices = rng.integers(0, num_embeddings, size=sum(lengths)).astype(np.int32)
    a = {
        "weight": rng.standard_normal((num_embeddings, embedding_dim)).astype(np.float32),
        "indices": indices, "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), "mode": mode,
        "padding_idx": draw(st.none() | st.integers(-num_embeddings, num_embeddings - 1)),
        "per_sample_weights": (rng.uniform(-2, 2, indices.size).astype(np.float32)
                               if mode == "sum" and draw(st.booleans()) else None),
    }  # fmt: skip
    corruptions = {
        None: ((), lambda: None),
        "offsets_float": (("offsets", "float32"), lambda: a.update(offsets=a["offsets"].astype(np.float32))),
        "offsets_2d": (("offsets", "1-D"), lambda: a.update(offsets=a["offsets"][None])),
        "offsets_empty": (("offsets", "empty"), lambda: a.update(offsets=np.zeros(0, np.int32))),
        "offsets_not_from_zero": (("offsets", "0"), lambda: a.update(offsets=a["offsets"] + 1)),
        "offsets_decreasing": (("offsets", "non-decreasing"),
                               lambda: a.update(offsets=np.array([0, indices.size, 0], np.int32))),
        "offsets_past_end": (("offsets", str(indices.size)),
                             lambda: a.update(offsets=np.array([0, indices.size + 1], np.int32))),
        "entries_after_last_offset": (("offsets", "include_last_offset"), lambda: a.update(
            indices=np.append(indices, 0).astype(np.int32),
            per_sample_weights=None if a["per_sample_weights"] is None else np.append(a["per_sample_weights"], 1))),
        "index_too_big": (("input",), lambda: a.update(indices=np.append(indices, num_embeddings))),
        "index_negative": (("input",), lambda: a.update(indices=np.append(indices, -1).astype(np.int32))),
        "indices_float": (("input", "float32"), lambda: a.update(indices=indices.astype(np.float32))),
        "indices_2d": (("offsets", "2-D"), lambda: a.update(indices=indices[None])),
        "padding_too_big": (("padding_idx",), lambda: a.update(padding_idx=num_embeddings)),
        "padding_float": (("padding_idx", "float"), lambda: a.update(padding_idx=1.0)),
        "weights_dtype": (("per_sample_weights", "dtype"),
                          lambda: a.update(mode="sum", per_sample_weights=np.ones(indices.size, np.float16))),
        "weights_length": (("per_sample_weights", "shape"),
                           lambda: a.update(mode="sum", per_sample_weights=np.ones(indices.size + 1, np.float32))),
        "weights_with_mean": (("per_sample_weights", "sum"),
                              lambda: a.update(mode="mean", per_sample_weights=np.ones(indices.size, np.float32))),
        "mode_unknown": (("mode",), lambda: a.update(mode="avg")),
        "weight_int": (("weight",), lambda: a.update(weight=a["weight"].astype(np.int32))),
        "weight_1d": (("weight", "2-D"), lambda: a.update(weight=a["weight"].reshape(-1))),
        "weight_list": (("weight", "list"), lambda: a.update(weight=("raw", a["weight"].tolist()))),
    }  # fmt: skip
    if indices.size == 0:
        del corruptions["offsets_decreasing"]  # [0, 0, 0] does not decrease
    corruption = draw(st.sampled_from(list(corruptions)))
    names, corrupt = corruptions[corruption]
    corrupt()
    return {"op": op, "args": a}, corruption, names


@settings(max_examples=50)
@given(kernel_bag_cases())
def test_bag_kernel_wrappers_give_torchs_result_or_refuse_before_launching(drawn):
    check_kernel_case(*drawn, valid=(None,))


def check_kernel_case(case, corruption, names, valid):
    """A kernel wrapper on the emulation: torch's result for a ``valid`` case, else a clear error before launching."""
    event(f"{case['op']}: {corruption}")
    if corruption in valid:
        check_against_torch(case, "metal")
    else:
        assert_clear_error(run_isolated(seqlib_call, case, "metal"), *names, case=case)


@st.composite
def kernel_lookup_cases(draw):
    num_embeddings, embedding_dim = draw(st.integers(1, 5)), draw(st.integers(0, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    indices = rng.integers(0, num_embeddings, size=draw(st.lists(st.integers(0, 3), max_size=2))).astype(np.int64)
    weight = rng.standard_normal((num_embeddings, embedding_dim)).astype(np.float32)
    lookup = {"weight": weight, "indices": indices, "padding_idx": None, "grad_scale": None}
    renorm = {"weight": weight, "rows": np.unique(indices).astype(np.int32), "max_norm": 1.0, "norm_type": 2.0}
    corruptions = {
        None: ("kernels.embedding", (), {}),
        "renorm": ("kernels.embedding_renorm_scales", (), {}),
        "index_too_big": ("kernels.embedding", ("input",), {"indices": np.array([num_embeddings])}),
        "index_negative": ("kernels.embedding", ("input",), {"indices": np.array([-num_embeddings - 1])}),
        "indices_float": ("kernels.embedding", ("input",), {"indices": indices.astype(np.float32)}),
        "indices_list": ("kernels.embedding", ("input", "list"), {"indices": ("raw", [indices.tolist()])}),
        "padding_too_big": ("kernels.embedding", ("padding_idx",), {"padding_idx": num_embeddings + 1}),
        "padding_too_small": ("kernels.embedding", ("padding_idx",), {"padding_idx": -num_embeddings - 1}),
        "padding_float": ("kernels.embedding", ("padding_idx",), {"padding_idx": 0.5}),
        "grad_scale_shape": ("kernels.embedding", ("grad_scale", "shape"),
                             {"grad_scale": np.ones(indices.size + 1, np.float32)}),
        "grad_scale_list": ("kernels.embedding", ("grad_scale", "list"), {"grad_scale": ("raw", [1.0] * indices.size)}),
        "grad_scale_int": ("kernels.embedding", ("grad_scale",), {"grad_scale": np.ones(indices.size, np.int32)}),
        "weight_int": ("kernels.embedding", ("weight",), {"weight": weight.astype(np.int32)}),
        "weight_3d": ("kernels.embedding", ("weight", "2-D"), {"weight": weight[None]}),
        "rows_too_big": ("kernels.embedding_renorm_scales", ("rows",), {"rows": np.array([num_embeddings])}),
        "rows_float": ("kernels.embedding_renorm_scales", ("rows",), {"rows": np.array([0.0], np.float32)}),
        "max_norm_none": ("kernels.embedding_renorm_scales", ("max_norm", "None"), {"max_norm": None}),
        "max_norm_negative": ("kernels.embedding_renorm_scales", ("max_norm",), {"max_norm": -1.0}),
        "max_norm_nan": ("kernels.embedding_renorm_scales", ("max_norm",), {"max_norm": NAN}),
        "max_norm_text": ("kernels.embedding_renorm_scales", ("max_norm", "str"), {"max_norm": "1"}),
        "norm_type_zero": ("kernels.embedding_renorm_scales", ("norm_type",), {"norm_type": 0.0}),
    }  # fmt: skip
    corruption = draw(st.sampled_from(list(corruptions)))
    op, names, change = corruptions[corruption]
    args = {**(renorm if op.endswith("scales") else lookup), **change}
    return {"op": op, "args": args}, corruption, names


@settings(max_examples=40)
@given(kernel_lookup_cases())
def test_lookup_kernel_wrappers_give_torchs_result_or_refuse_before_launching(drawn):
    check_kernel_case(*drawn, valid=(None, "renorm"))


# ----------------------------------------------------------------- the bugs of issue 13, one by one


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_per_sample_weights_of_another_dtype_are_refused_not_cast(backend, dtype):
    case = {"op": "embedding_bag", "args": {
        "input": np.array([0, 1, 2, 3]), "weight": np.ones((5, 3), np.float32), "offsets": np.array([0, 2]),
        "mode": "sum", "per_sample_weights": np.ones(4, dtype)}}  # fmt: skip
    assert run_isolated(torch_call, case).kind == "raised"  # torch: "... to have the same type as ..."
    assert_clear_error(run_isolated(seqlib_call, case, backend), "per_sample_weights", "dtype", "float32")


@pytest.mark.parametrize("backend", BACKENDS)
def test_flattened_per_sample_weights_for_2d_input_are_refused(backend):
    case = {"op": "EmbeddingBag", "args": {
        "input": np.array([[0, 1], [2, 3]]), "weight": np.ones((5, 3), np.float32), "mode": "sum",
        "per_sample_weights": np.ones(4, np.float32)}}  # fmt: skip
    assert run_isolated(torch_call, case).kind == "raised"  # torch: "must have the same shape as the input"
    assert_clear_error(run_isolated(seqlib_call, case, backend), "per_sample_weights", "(2, 2)", "(4,)")


# Bags of max mode with NaN and -inf in different places.  torch's CPU rule: the first entry,
# then only strictly greater values, so a NaN counts only as a bag's first entry; the gradient
# goes to the entry that won.
MAX_ROWS = np.array([[1, NAN], [NAN, 2], [3, 0], [NAN, NAN], [-INF, -INF], [-INF, 5], [2, 2], [0, -0.0]], np.float32)
MAX_BAGS = [
    ([0, 1, 2], None),  # NaN in the middle of column 0 (skipped), first in column 1 (kept)
    ([3, 4], None),  # an all-NaN row first: NaN in both columns
    ([4, 3], None),  # NaN after -inf: -inf stays
    ([5, 4], None),  # -inf ties: the first wins
    ([6, 6, 3, 3], None),  # equal maxima: the first; NaNs later: skipped
    ([3, 3], None),  # an all-NaN bag
    ([7, 0, 1], None),  # signed zeros
    ([0, 1, 3], 0),  # padding first: the NaN after it is the first that counts
    ([1, 1], 1),  # only padding: zeros
]


def max_bag_with_gradient(rows, bags, padding_idx, backend):
    indices = mx.array(np.concatenate([np.array(bag) for bag in bags]).astype(np.int32))
    offsets = mx.array(np.cumsum([0] + [len(bag) for bag in bags[:-1]]).astype(np.int32))
    d_out = mx.arange(1, 2 * len(bags) + 1, dtype=mx.float32).reshape(len(bags), 2)

    def loss(table):
        out = F.embedding_bag(indices, table, offsets, mode="max", padding_idx=padding_idx)
        return (out * d_out).sum(), out

    with _on(backend):
        (_, out), grad = mx.value_and_grad(loss)(mx.array(rows))
    return out, grad


def torch_max_bag_with_gradient(rows, bags, padding_idx):
    table = torch.tensor(rows, requires_grad=True)
    indices = torch.tensor(np.concatenate([np.array(bag) for bag in bags]).astype(np.int64))
    offsets = torch.tensor(np.cumsum([0] + [len(bag) for bag in bags[:-1]]).astype(np.int64))
    out = torch.nn.functional.embedding_bag(indices, table, offsets, mode="max", padding_idx=padding_idx)
    (out * torch.arange(1.0, 2 * len(bags) + 1).reshape(len(bags), 2)).sum().backward()
    return out.detach().numpy(), table.grad.numpy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("bag", "padding_idx"), MAX_BAGS)
def test_max_mode_treats_nan_and_inf_as_torch_does_on_both_backends(backend, bag, padding_idx):
    bags = [bag, [6, 2]]  # a second, ordinary bag after it
    outcome = run_isolated(max_bag_with_gradient, MAX_ROWS, bags, padding_idx, backend)
    assert outcome.kind == "returned", outcome
    out, grad = outcome.value
    want_out, want_grad = torch_max_bag_with_gradient(MAX_ROWS, bags, padding_idx)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(want_out))  # -0.0 where torch has it
    np.testing.assert_array_equal(grad, want_grad)


def test_max_mode_nan_rule_holds_for_long_bags_and_half_precision():
    """Many entries per bag (one bucket of length 40) and float16 storage: same rule, same winners."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, 3)).astype(np.float16)
    rows[rng.random(rows.shape) < 0.3] = NAN
    indices = rng.integers(0, 50, size=120)
    offsets = np.array([0, 40, 80])
    want = torch.nn.functional.embedding_bag(torch.tensor(indices), torch.tensor(rows.astype(np.float32)),
                                             torch.tensor(offsets), mode="max").numpy()  # fmt: skip
    for backend in BACKENDS:
        case = {"op": "embedding_bag", "args": {"input": indices, "weight": rows, "offsets": offsets, "mode": "max"}}
        outcome = run_isolated(seqlib_call, case, backend)
        np.testing.assert_array_equal(outcome.value.astype(np.float32), want, err_msg=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("call", "error", "words"), [
    ({"offsets": np.array([0.0, 2.0], np.float32)}, TypeError, ["offsets", "float32"]),
    ({"offsets": np.array([[0, 2]])}, ValueError, ["offsets", "1-D", "(1, 2)"]),
    ({"padding_idx": 7}, ValueError, ["padding_idx", "7", "[-5, 5)"]),
    ({"padding_idx": -6}, ValueError, ["padding_idx", "-6"]),
    ({"indices": np.array([0, 1, 2, 5])}, IndexError, ["input", "[0, 5)", "5"]),
    ({"indices": np.array([0, -1, 2, 3])}, IndexError, ["input", "-1"]),
    ({"indices": np.array([[0, 1], [2, 3]])}, ValueError, ["offsets", "2-D"]),
    ({"indices": np.array([0.0, 1.0, 2.0, 3.0], np.float32)}, TypeError, ["input", "float32"]),
    ({"offsets": np.zeros(0, np.int64)}, ValueError, ["offsets", "empty"]),
    ({"offsets": np.array([1, 2, 4])}, ValueError, ["offsets", "start at 0"]),
    ({"offsets": np.array([0, 3, 2])}, ValueError, ["offsets", "non-decreasing"]),
    ({"offsets": np.array([0, 2, 5])}, ValueError, ["offsets", "past the end", "5"]),
    ({"mode": "median"}, ValueError, ["mode", "median"]),
    ({"padding_idx": 1.0}, TypeError, ["padding_idx", "float"]),
    ({"weight": np.ones((5, 3), np.int32)}, TypeError, ["weight", "int32"]),
    ({"weight": np.ones(15, np.float32)}, ValueError, ["weight", "2-D", "(15,)"]),
    ({"mode": "mean", "per_sample_weights": np.ones(4, np.float32)}, ValueError, ["per_sample_weights", "sum"]),
    ({"mode": "sum", "per_sample_weights": np.ones(4, np.float16)}, TypeError, ["per_sample_weights", "dtype"]),
])  # fmt: skip
def test_direct_bag_kernel_calls_check_every_argument(backend, call, error, words):
    args = {"weight": np.ones((5, 3), np.float32), "indices": np.array([0, 1, 2, 3]), "offsets": np.array([0, 2, 4]),
            **call}  # fmt: skip
    outcome = run_isolated(seqlib_call, {"op": "kernels.embedding_bag", "args": args}, "metal")
    assert_clear_error(outcome, *words, allowed=(error,))


def test_direct_lookup_kernel_calls_check_grad_scale_and_max_norm():
    base = {"weight": np.ones((5, 3), np.float32), "indices": np.array([[0, 1], [2, 3]])}
    for grad_scale, words in [(np.ones(3, np.float32), ["grad_scale", "(4,)", "(3,)"]),
                              (np.ones((2, 2), np.float32), ["grad_scale", "(4,)", "(2, 2)"]),
                              (("raw", [1.0] * 4), ["grad_scale", "list"])]:  # fmt: skip
        case = {"op": "kernels.embedding", "args": {**base, "grad_scale": grad_scale}}
        assert_clear_error(run_isolated(seqlib_call, case, "metal"), *words)
    for max_norm, norm_type, words in [(None, 2.0, ["max_norm", "None"]), (-1.0, 2.0, ["max_norm", "-1.0"]),
                                       (1.0, 0.0, ["norm_type", "0.0"]), (1.0, NAN, ["norm_type"])]:  # fmt: skip
        case = {"op": "kernels.embedding_renorm_scales",
                "args": {"weight": base["weight"], "rows": np.array([0, 1]), "max_norm": max_norm,
                         "norm_type": norm_type}}  # fmt: skip
        assert_clear_error(run_isolated(seqlib_call, case, "metal"), *words)


EMPTY_BAGS = [
    # (input, offsets, include_last_offset): torch returns a result for each
    (np.zeros((0, 3), np.int64), None, False),  # no bags of 3: (0, D)
    (np.zeros(0, np.int64), np.array([0]), False),  # one empty bag (torch's test_embedding_bag_empty_input)
    (np.zeros(0, np.int64), np.array([0, 0]), False),
    (np.zeros(0, np.int64), np.array([0, 0, 0, 0, 0]), False),  # torch's ..._empty_per_sample_weights_and_offsets
    (np.zeros(0, np.int64), np.zeros(0, np.int64), False),  # no offsets: no bags
    (np.array([1, 2]), np.array([0, 0, 2, 2]), False),  # empty bags around a full one
    (np.zeros(0, np.int64), np.array([0]), True),  # include_last_offset: [0] is no bags
    (np.zeros(0, np.int64), np.array([0, 0]), True),  # one empty bag
    (np.array([1, 2, 3]), np.array([0, 0, 3, 3]), True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize(("indices", "offsets", "include_last_offset"), EMPTY_BAGS)
def test_empty_inputs_and_empty_bags_give_torchs_result(backend, mode, indices, offsets, include_last_offset):
    for op in ("embedding_bag", "EmbeddingBag"):
        args = {"input": indices, "weight": np.arange(15, dtype=np.float32).reshape(5, 3) - 7, "offsets": offsets,
                "mode": mode, "include_last_offset": include_last_offset}  # fmt: skip
        if mode == "sum":
            args["per_sample_weights"] = np.full(indices.shape, 0.5, np.float32)
        check_against_torch({"op": op, "args": args}, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_entries_without_offsets_make_no_bags(backend, mode, padding_idx):
    """Empty offsets over a non-empty input: no bags, (0, D), as torch's sum/mean kernels give
    (its max and padding_idx kernels crash on it: checked in a worker, like seqlib)."""
    args = {"input": np.array([1, 2]), "weight": np.ones((5, 3), np.float32), "offsets": np.zeros(0, np.int64),
            "mode": mode, "padding_idx": padding_idx}  # fmt: skip
    outcome = run_isolated(seqlib_call, {"op": "embedding_bag", "args": args}, backend)
    assert outcome.kind == "returned" and outcome.value.shape == (0, 3), outcome
    if mode != "max" and padding_idx is None:
        assert run_isolated(torch_call, {"op": "embedding_bag", "args": args}).value.shape == (0, 3)


def empty_bag_gradients(backend):
    """Gradients of bags with no entries are zeros, also for per_sample_weights (torch's ..._empty_... test)."""
    weight, weights = mx.ones((5, 2)), mx.zeros((0,))
    with _on(backend):
        loss = lambda table, sample: F.embedding_bag(mx.zeros((0,), mx.int32), table, mx.array([0, 0, 0]),
                                                     mode="sum", per_sample_weights=sample).sum()  # fmt: skip
        return mx.grad(loss, argnums=(0, 1))(weight, weights)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_bags_send_zero_gradients(backend):
    outcome = run_isolated(empty_bag_gradients, backend)
    assert outcome.kind == "returned", outcome
    d_table, d_weights = outcome.value
    assert d_table.shape == (5, 2) and not d_table.any() and d_weights.shape == (0,)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2, 0), (3, 0), (0, 0)])
def test_bags_of_nothing_in_2d_are_zeros_where_torch_fails(backend, shape):
    """A (B, 0) input is B empty bags: seqlib gives (B, D) zeros; torch 2.13 fails in its arange."""
    for mode in ("sum", "mean", "max"):
        case = {"op": "embedding_bag", "args": {"input": np.zeros(shape, np.int64),
                                                "weight": np.ones((4, 3), np.float32), "mode": mode}}  # fmt: skip
        outcome = run_isolated(seqlib_call, case, backend)
        assert outcome.kind == "returned", outcome
        assert outcome.value.shape == (shape[0], 3) and not outcome.value.any()
        assert run_isolated(torch_call, case).kind != "returned"  # when torch fixes this, compare with it


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_include_last_offset_with_entries_after_it_is_refused(backend, mode):
    """torch's own test_embeddingbag_include_last_offset: offsets [0, 3, 3] over 4 entries, padding_idx set.

    torch's test wants the 4th entry in the last bag; torch's sum/mean kernels without padding_idx
    drop it (pytorch#52851).  seqlib raises; the equivalent call with offsets [0, 3, 4] agrees with
    torch's reference."""
    weight = np.random.default_rng(0).standard_normal((100, 3)).astype(np.float32)
    for offsets, padding_idx in (([0, 3, 3], 61), ([0, 3, 3], None), ([0, 2], None), ([0], None)):  # [0]: torch
        # gives (0, D) in sum and mean, and segfaults in max mode
        case = {"op": "EmbeddingBag", "args": {"input": np.array([0, 1, 2, 3]), "weight": weight,
                                               "offsets": np.array(offsets), "mode": mode, "padding_idx": padding_idx,
                                               "include_last_offset": True}}  # fmt: skip
        assert_clear_error(run_isolated(seqlib_call, case, backend), "offsets", "include_last_offset", "52851")
    case = {"op": "EmbeddingBag", "args": {"input": np.array([0, 1, 2, 3]), "weight": weight, "mode": mode,
                                           "offsets": np.array([0, 3, 4]), "padding_idx": 61,
                                           "include_last_offset": True}}  # fmt: skip
    outcome = run_isolated(seqlib_call, case, backend)
    reduce = {"sum": np.sum, "mean": np.mean, "max": np.max}[mode]
    np.testing.assert_allclose(outcome.value[0], np.stack([reduce(weight[0:3], axis=0), weight[3]]), rtol=1e-6)


def test_embedding_renorm_without_max_norm_is_a_clear_error():
    for op in ("embedding_renorm", "renorm_for_lookup"):
        case = {"op": op, "args": {"weight": np.ones((4, 2), np.float32), "input": np.array([1]), "max_norm": None}}
        assert run_isolated(torch_call, case).kind == "raised"  # torch: must be float, not NoneType
        assert_clear_error(run_isolated(seqlib_call, case), "max_norm", "None", allowed=(TypeError,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["embedding_renorm", "renorm_for_lookup"])
@pytest.mark.parametrize("max_norm", [0.0, 0.5, INF])
def test_embedding_renorm_matches_torch_including_max_norm_zero(backend, op, max_norm):
    weight = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    case = {"op": op, "args": {"weight": weight, "input": np.array([[1, 4], [4, 0]]), "max_norm": max_norm}}
    check_against_torch(case, backend)


# ----------------------------------------------------------------- constructors and from_pretrained


def construct(kind, args, kwargs):
    module = getattr(seqlib.nn, kind)(*args, **{key: _build(value, "mlx") for key, value in kwargs.items()})
    return tuple(module.weight.shape), str(module.weight.dtype), "weight" in dict(module.trainable_parameters())


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize(("args", "kwargs", "error", "words"), [
    ((-1, 3), {}, ValueError, ["num_embeddings", "-1"]),
    ((3, -2), {}, ValueError, ["embedding_dim", "-2"]),
    ((3.0, 2), {}, TypeError, ["num_embeddings", "float"]),
    ((3, 2.5), {}, TypeError, ["embedding_dim", "float"]),
    ((True, 2), {}, TypeError, ["num_embeddings", "bool"]),
    (("3", 2), {}, TypeError, ["num_embeddings", "str"]),
    ((3, 2), {"padding_idx": 3}, ValueError, ["padding_idx", "[-3, 3)", "3"]),
    ((3, 2), {"padding_idx": -4}, ValueError, ["padding_idx", "-4"]),
    ((3, 2), {"padding_idx": 1.0}, TypeError, ["padding_idx", "float"]),
    ((0, 2), {"padding_idx": 0}, ValueError, ["padding_idx", "0"]),
    ((3, 2), {"max_norm": -1.0}, ValueError, ["max_norm", "-1.0"]),
    ((3, 2), {"max_norm": NAN}, ValueError, ["max_norm", "nan"]),
    ((3, 2), {"max_norm": "1"}, TypeError, ["max_norm", "str"]),
    ((3, 2), {"norm_type": 0}, ValueError, ["norm_type", "0"]),
    ((3, 2), {"norm_type": -2.0}, ValueError, ["norm_type", "-2.0"]),
    ((3, 2), {"dtype": ("mx", "int32")}, TypeError, ["dtype", "int32"]),
    ((3, 2), {"dtype": "float32"}, TypeError, ["dtype", "float32"]),
    ((3, 2), {"_weight": np.ones((2, 2), np.float32)}, ValueError, ["_weight", "(3, 2)", "(2, 2)"]),
    ((3, 2), {"_weight": np.ones((3, 2), np.int32)}, TypeError, ["_weight", "int32"]),
    ((3, 2), {"_weight": ("raw", [[1.0, 2.0]] * 3)}, TypeError, ["_weight", "list"]),
])  # fmt: skip
def test_constructors_refuse_bad_options(kind, args, kwargs, error, words):
    assert_clear_error(run_isolated(construct, kind, args, kwargs), *words, allowed=(error,))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"mode": "avg"}, ["mode", "avg"]), ({"mode": None}, ["mode", "None"]),
    ({"mode": "max", "sparse": True}, ["sparse", "max"]),
    ({"mode": "max", "scale_grad_by_freq": True}, ["scale_grad_by_freq", "max"]),
])  # fmt: skip
def test_embedding_bag_refuses_bad_modes_at_construction(kwargs, words):
    """torch accepts these at construction and fails at the first call; seqlib fails at once."""
    assert_clear_error(run_isolated(construct, "EmbeddingBag", (3, 2), kwargs), *words, allowed=(ValueError,))


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize("sizes", [(0, 3), (3, 0), (0, 0)])
def test_empty_tables_as_in_torch(kind, sizes):
    outcome = run_isolated(construct, kind, sizes, {})
    assert outcome.kind == "returned" and outcome.value[0] == tuple(getattr(torch.nn, kind)(*sizes).weight.shape)


def test_empty_tables_look_up_empty_results_like_torch():
    """torch's test_embedding_sparse_empty_tensor: Embedding(0, 0) and (10, 0) tables."""
    for num_embeddings, embedding_dim, indices in [(0, 0, np.zeros(0, np.int64)), (0, 3, np.zeros((2, 0), np.int64)),
                                                   (10, 0, np.array([[0, 2, 4, 5], [4, 3, 0, 9]]))]:  # fmt: skip
        for backend in BACKENDS:
            for op in ("embedding", "Embedding"):
                args = {"input": indices, "weight": np.zeros((num_embeddings, embedding_dim), np.float32)}
                check_against_torch({"op": op, "args": args}, backend)
            bag = {"input": indices,
                   "weight": np.zeros((num_embeddings, embedding_dim), np.float32), "mode": "sum"}  # fmt: skip
            if bag["input"].ndim == 1:
                bag["offsets"] = np.array([0])
            case = {"op": "embedding_bag", "args": bag}
            check_against_torch(case, backend, deviation=_deviation(case, None))


def empty_table_gradients(num_embeddings, embedding_dim, backend):
    """Gradients through lookups and bags of a table with no rows or no columns (MLX's scatter into
    such a table divides by zero: SIGFPE), with every option that takes another code path."""
    weight = mx.zeros((num_embeddings, embedding_dim))
    indices = mx.zeros((3 if num_embeddings else 0,), mx.int32)
    offsets, sample_weights = mx.array([0, min(1, indices.size)]), mx.ones((indices.size,))
    grads = {}
    with _on(backend):
        grads["embedding"] = mx.grad(lambda w: F.embedding(indices, w, max_norm=1.0).sum())(weight)
        grads["scaled"] = mx.grad(lambda w: F.embedding(indices, w, 0, scale_grad_by_freq=True).sum()
                                  if num_embeddings else F.embedding(indices, w).sum())(weight)  # fmt: skip
        for mode in ("sum", "mean", "max"):
            grads[mode] = mx.grad(lambda w, mode=mode: F.embedding_bag(indices, w, offsets, mode=mode).sum())(weight)
        grads["per_sample_weights"] = mx.grad(
            lambda p: F.embedding_bag(indices, weight, offsets, mode="sum", per_sample_weights=p).sum())(sample_weights)
        module = seqlib.nn.Embedding(num_embeddings, embedding_dim, max_norm=1.0)
        grads["module"] = mlx.nn.value_and_grad(module, lambda m: m(indices).sum())(module)[1]["weight"]
    return grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", [(4, 0), (0, 3), (0, 0)])
def test_empty_tables_send_empty_gradients(backend, sizes):
    outcome = run_isolated(empty_table_gradients, *sizes, backend)
    assert outcome.kind == "returned", outcome
    for name, grad in outcome.value.items():
        want = (3 if sizes[0] else 0,) if name == "per_sample_weights" else sizes
        assert grad.shape == want and not grad.any(), (name, grad.shape)


def test_torch_weight_and_freeze_arguments():
    outcome = run_isolated(construct, "Embedding", (3, 2), {"_weight": np.ones((3, 2), np.float16), "padding_idx": 1,
                                                             "_freeze": True})  # fmt: skip
    assert outcome.value == ((3, 2), "mlx.core.float16", False)
    layer = seqlib.nn.Embedding(3, 2, padding_idx=1, _weight=mx.ones((3, 2)))
    assert np.array(layer.weight).tolist() == [[1, 1]] * 3  # torch leaves the padding row of _weight alone too


def from_pretrained(kind, embeddings, kwargs):
    module = getattr(seqlib.nn, kind).from_pretrained(_build(embeddings, "mlx"), **kwargs)
    return np.array(module.weight)


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize(("embeddings", "kwargs", "error", "words"), [
    (np.ones(3, np.float32), {}, ValueError, ["embeddings", "2-D", "(3,)"]),
    (np.ones((3, 2, 1), np.float32), {}, ValueError, ["embeddings", "2-D", "(3, 2, 1)"]),
    (np.array(1.0, np.float32), {}, ValueError, ["embeddings", "2-D", "()"]),
    (("raw", [[1.0, 2.0]]), {}, TypeError, ["embeddings", "list"]),
    (np.ones((2, 2), np.int64), {}, TypeError, ["embeddings", "int64"]),  # torch takes integer tables: deviation
    (np.ones((2, 2), np.float32), {"padding_idx": 2}, ValueError, ["padding_idx", "2"]),
    (np.ones((2, 2), np.float32), {"max_norm": -1}, ValueError, ["max_norm", "-1"]),
])  # fmt: skip
def test_from_pretrained_refuses_bad_tables_and_options(kind, embeddings, kwargs, error, words):
    assert_clear_error(run_isolated(from_pretrained, kind, embeddings, kwargs), *words, allowed=(error,))


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_from_pretrained_takes_a_numpy_table_as_load_torch_state_dict_does(kind):
    table = np.arange(6, dtype=np.float32).reshape(3, 2)
    module = getattr(seqlib.nn, kind).from_pretrained(table)
    assert isinstance(module.weight, mx.array) and module.weight.dtype == mx.float32
    np.testing.assert_array_equal(np.array(module.weight), table)


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_from_pretrained_keeps_the_table_and_its_padding_row(kind):
    """torch's test_embedding(_bag)_from_pretrained(_padding_idx): the table is kept as given."""
    table = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]], np.float32)
    outcome = run_isolated(from_pretrained, kind, table, {"padding_idx": 2})
    np.testing.assert_array_equal(outcome.value, table)


# ----------------------------------------------------------------- ported from torch's test_embedding.py


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_bag_padding_idx_range_as_torch(backend):
    """test_embedding_bag_padding_idx_error: padding_idx in [-V, V) works, outside it raises."""
    for padding_idx in range(-6, 6):
        case = {"op": "embedding_bag", "args": {"input": np.array([[1, 3, 2], [0, 2, 1]]),
                                                "weight": np.ones((4, 3), np.float32), "padding_idx": padding_idx}}
        check_against_torch(case, backend, ("padding_idx", str(padding_idx)))
        module = run_isolated(construct, "EmbeddingBag", (4, 3), {"padding_idx": padding_idx})
        if -4 <= padding_idx < 4:
            assert module.kind == "returned"
        else:
            assert_clear_error(module, "padding_idx", str(padding_idx))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_embedding_bag_out_of_bounds_indices(backend, mode, index_dtype):
    """test_embedding_bag_out_of_bounds_idx: -1 and past the end, with and without weights."""
    for indices in (np.array([[-1, 1]], index_dtype), np.array([[11, 8]], index_dtype)):
        for weights in ([None, np.ones((1, 2), np.float32)] if mode == "sum" else [None]):
            case = {"op": "embedding_bag", "args": {"input": indices, "weight": np.ones((10, 2), np.float32),
                                                    "per_sample_weights": weights, "padding_idx": 0, "mode": mode}}
            check_against_torch(case, backend, ("input", "[0, 10)", str(indices.min() if indices.min() < 0 else 11)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_bag_dimension_errors(backend):
    """test_embedding_bag_dimension_errors: 5-D input, 5-D offsets, 3-D weight."""
    for args, names in [
        ({"input": np.full((2, 0, 0, 6, 6), 2), "weight": np.zeros((2, 6), np.float32),
          "offsets": np.zeros((2, 0, 0, 6, 6), np.int64)}, ("input", "1-D", "2-D")),
        ({"input": np.full(2, 1), "weight": np.zeros((2, 2), np.float32),
          "offsets": np.zeros((2, 0, 0, 6, 6), np.int64)}, ("offsets", "1-D")),
        ({"input": np.full(2, 1), "weight": np.zeros((2, 2, 2), np.float32), "offsets": np.zeros(2, np.int64)},
         ("weight", "2-D")),
    ]:  # fmt: skip
        check_against_torch({"op": "embedding_bag", "args": args}, backend, names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sample_weights_failures(backend):
    """test_EmbeddingBag_per_sample_weights_failures: dtype, 1-D and 2-D size, and mode."""
    table = np.arange(10, dtype=np.float32).reshape(5, 2)
    cases = [
        ({"input": np.array([3, 1, 1, 1, 4, 0]), "offsets": np.array([0, 0, 3, 3, 6]), "mode": "sum",
          "per_sample_weights": np.ones(6, np.float16)}, ("per_sample_weights", "dtype")),
        ({"input": np.array([3, 1, 1, 1, 4, 0]), "offsets": np.array([0, 0, 3, 3, 6]), "mode": "sum",
          "per_sample_weights": np.ones(5, np.float32)}, ("per_sample_weights", "shape")),
        ({"input": np.zeros((7, 3), np.int64), "mode": "sum", "per_sample_weights": np.ones(21, np.float32)},
         ("per_sample_weights", "(7, 3)")),
        ({"input": np.zeros((7, 3), np.int64), "mode": "max", "per_sample_weights": np.ones((7, 3), np.float32)},
         ("per_sample_weights", "max")),
        ({"input": np.zeros((7, 3), np.int64), "mode": "mean", "per_sample_weights": np.ones((7, 3), np.float32)},
         ("per_sample_weights", "mean")),
    ]  # fmt: skip
    for args, names in cases:
        check_against_torch({"op": "EmbeddingBag", "args": {"weight": table, **args}}, backend, names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scalar_and_3d_weights_are_refused(backend):
    """test_embedding_scalar_weight_error (and error_inputs_embedding): 0-d and (1, 1, 1) weights."""
    for weight in (np.array(1.0, np.float32), np.ones((1, 1, 1), np.float32)):
        case = {"op": "embedding", "args": {"input": np.zeros((2, 2), np.int64), "weight": weight}}
        check_against_torch(case, backend, ("weight", "2-D"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_indices_of_any_width_and_numpy_input(backend):
    """seqlib takes every integer dtype (torch's lookups take int32/int64 only, its bags also uint8
    and int16) and NumPy integer arrays (torch wants tensors); the results are torch's."""
    weight = np.random.default_rng(2).standard_normal((7, 3)).astype(np.float32)
    indices = np.array([[0, 6], [3, 3]])
    want = torch.nn.functional.embedding(torch.tensor(indices), torch.tensor(weight)).numpy()
    for dtype in (np.uint8, np.int16, np.uint32, np.int64, np.uint64):
        for value in (indices.astype(dtype), ("raw", indices.astype(dtype))):
            case = {"op": "embedding", "args": {"input": value, "weight": weight}}
            outcome = run_isolated(seqlib_call, case, backend)
            np.testing.assert_array_equal(outcome.value, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_dimensional_input(backend):
    """A 0-d index looks up one row (D,) as in torch; a bag needs 1-D or 2-D input."""
    weight = np.arange(6, dtype=np.float32).reshape(3, 2)
    check_against_torch({"op": "embedding", "args": {"input": np.array(2), "weight": weight}}, backend)
    check_against_torch({"op": "Embedding", "args": {"input": np.array(2), "weight": weight}}, backend)
    for offsets in (None, np.array([0])):
        case = {"op": "EmbeddingBag", "args": {"input": np.array(2), "weight": weight, "offsets": offsets}}
        check_against_torch(case, backend, ("input", "()"))


def float64_lookups(backend):
    weight = mx.array(np.arange(12.0).reshape(4, 3), dtype=mx.float64)
    with _on(backend):
        return (F.embedding(mx.array([[1, 2]]), weight, max_norm=5.0),
                F.embedding_bag(mx.array([1, 2, 3]), weight, mx.array([0, 1]), mode="max"))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_tables_work_on_both_backends(backend):
    """The Metal kernels take float32/16 and bfloat16; a float64 table (MLX keeps it on the CPU) takes
    the ops path there instead of failing inside the kernel launch."""
    outcome = run_isolated(float64_lookups, backend)
    assert outcome.kind == "returned", outcome
    table = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    lookup = torch.nn.functional.embedding(torch.tensor([[1, 2]]), table.clone(), max_norm=5.0)
    bags = torch.nn.functional.embedding_bag(torch.tensor([1, 2, 3]), table, torch.tensor([0, 1]), mode="max")
    assert outcome.value[0].dtype == np.float64
    np.testing.assert_allclose(outcome.value[0], lookup.numpy(), rtol=1e-6)  # seqlib takes norms in float32
    np.testing.assert_array_equal(outcome.value[1], bags.numpy())


def failed_call_leaves_weight(kind, backend):
    """A module with max_norm called with bad offsets: the error comes, and the weight is unchanged."""
    weight = mx.full((4, 2), 3.0)
    module = getattr(seqlib.nn, kind).from_pretrained(weight, freeze=False, max_norm=1.0)
    with _on(backend):
        try:
            module(mx.array([0, 1, 2]), mx.array([1])) if kind == "EmbeddingBag" else module(mx.array([0, 7]))
        except (ValueError, IndexError) as error:
            return str(error), np.array(module.weight)
    return "no error", np.array(module.weight)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_a_call_that_raises_leaves_the_module_unchanged(backend, kind):
    outcome = run_isolated(failed_call_leaves_weight, kind, backend)
    message, weight = outcome.value
    assert message != "no error"
    np.testing.assert_array_equal(weight, np.full((4, 2), 3.0))


def sparse_gradient_of_bad_input(kind):
    """seqlib.sparse.value_and_grad with a sparse=True module: bad input raises the module's clear error."""
    module = getattr(seqlib.nn, kind)(5, 2, sparse=True)
    bad = mx.array([0, 9])
    loss = (lambda m: m(bad).sum()) if kind == "Embedding" else (lambda m: m(bad, mx.array([0])).sum())
    return seqlib.sparse.value_and_grad(module, loss)(module)


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_sparse_modules_refuse_out_of_range_indices(kind):
    assert_clear_error(run_isolated(sparse_gradient_of_bad_input, kind), "input", "[0, 5)", "9")


def test_modules_train_through_mlx_value_and_grad_after_bad_calls():
    """A refused call does not poison later ones: the module still matches torch afterwards."""
    layer = seqlib.nn.EmbeddingBag.from_pretrained(mx.ones((4, 2)), freeze=False, mode="max")
    with pytest.raises(IndexError):
        layer(mx.array([[0, 4]]))
    grads = mlx.nn.value_and_grad(layer, lambda m: m(mx.array([[0, 1]])).sum())(layer)[1]
    assert np.array(grads["weight"]).tolist() == [[1, 1], [0, 0], [0, 0], [0, 0]]
    assert math.isfinite(float(layer(mx.array([[3, 2]])).sum()))


def test_tables_too_large_for_the_kernels_32_bit_offsets_are_refused_before_any_work():
    """The kernels index with 32-bit offsets (``row * embedding_dim + d``): a table of 2**32 elements would
    wrap silently, so the launcher refuses it, from shapes alone (the 8 GB table below is never allocated)."""
    from seqlib import kernels
    from seqlib.kernels import bag_kernels
    from seqlib.kernels.runtime import check_kernel_sizes

    huge = mx.zeros((2**21, 2**11), dtype=mx.float16)  # 2**32 elements, lazy
    just_fits = mx.zeros((2**21 - 1, 2**11), dtype=mx.float16)
    with kernels.use_backend("emulate"):
        with pytest.raises(ValueError, match=r"embedding_gather: 'weight' has 4,294,967,296 elements.*32-bit"):
            seqlib.functional.embedding(mx.array([0, 1]), huge)
        with pytest.raises(ValueError, match=r"embedding_bag: 'weight' has 4,294,967,296 elements"):
            seqlib.functional.embedding_bag(mx.array([0, 1]), huge, offsets=mx.array([0]))
    check_kernel_sizes(bag_kernels.EMBEDDING_BAG, [just_fits, mx.array([0]), mx.array([0, 1]), mx.array([1.0]),
                                                   mx.array(-1)], [(1, 2**11), (1, 2**11)])  # fmt: skip
