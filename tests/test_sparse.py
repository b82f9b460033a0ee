"""Sparse gradients (seqlib.sparse) and the optimizers that apply them (seqlib.optim), against torch."""

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch_reference import assert_close, loss_weights

import seqlib
from seqlib import optim
from seqlib.sparse import SparseGradient


class BagClassifier(mlx.nn.Module):
    """A sparse bag of embeddings feeding a dense linear layer: the usual recommender shape."""

    def __init__(self, weight: np.ndarray, mode: str, padding_idx):
        super().__init__()
        self.bag = seqlib.nn.EmbeddingBag.from_pretrained(
            mx.array(weight), freeze=False, mode=mode, sparse=True, padding_idx=padding_idx
        )
        self.head = mlx.nn.Linear(weight.shape[1], 3)

    def __call__(self, ids, offsets):
        return self.head(self.bag(ids, offsets))


def torch_twin(model: BagClassifier) -> torch.nn.Module:
    bag = torch.nn.EmbeddingBag.from_pretrained(
        torch.from_numpy(np.array(model.bag.weight)), freeze=False, mode=model.bag.mode, sparse=True,
        padding_idx=model.bag.padding_idx,
    )  # fmt: skip
    head = torch.nn.Linear(model.head.weight.shape[1], 3)
    head.load_state_dict({"weight": torch.from_numpy(np.array(model.head.weight)),
                          "bias": torch.from_numpy(np.array(model.head.bias))})  # fmt: skip
    return torch.nn.ModuleDict({"bag": bag, "head": head})


@st.composite
def batches(draw):
    vocab = draw(st.integers(2, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
    ids = rng.integers(0, vocab, size=sum(lengths))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    weight = rng.standard_normal((vocab, 4)).astype(np.float32)
    mode = draw(st.sampled_from(["sum", "mean"]))  # max has no sparse gradient, in torch either
    padding_idx = draw(st.none() | st.integers(0, vocab - 1))
    return weight, ids, offsets, mode, padding_idx


@given(batches())
def test_sparse_gradient_matches_torchs_coalesced_sparse_grad_and_the_dense_gradient(batch):
    weight, ids, offsets, mode, padding_idx = batch
    mx.random.seed(0)
    model = BagClassifier(weight, mode, padding_idx)
    theirs = torch_twin(model)
    scale = loss_weights((len(offsets), 3))

    def loss(model, ids, offsets):
        return (model(ids, offsets) * mx.array(scale)).sum()

    value, grads = seqlib.sparse.value_and_grad(model, loss)(model, mx.array(ids), mx.array(offsets))
    out_t = theirs["head"](theirs["bag"](torch.from_numpy(ids), torch.from_numpy(offsets)))
    (out_t * torch.from_numpy(scale)).sum().backward()
    sparse_t = theirs["bag"].weight.grad.coalesce()

    grad = grads["bag"]["weight"]
    assert isinstance(grad, SparseGradient) and grad.shape == weight.shape
    assert np.array(grad.indices).tolist() == sparse_t.indices()[0].tolist()
    assert_close(grad.values, sparse_t.values(), what="row gradients")
    assert_close(grads["head"]["weight"], theirs["head"].weight.grad, what="dense head gradient")
    assert_close(value, (out_t * torch.from_numpy(scale)).sum(), rtol=1e-5, atol=1e-5)
    _, dense = mlx.nn.value_and_grad(model, loss)(model, mx.array(ids), mx.array(offsets))
    assert_close(grad.to_dense(), np.array(dense["bag"]["weight"]), what="sparse vs dense")


class TwoTables(mlx.nn.Module):
    """A sparse bag read twice (entry weights from a dense parameter, in sum mode) and a sparse Embedding: their
    lookups read the table itself where seqlib.native serves, and every other path reads the gathered rows."""

    def __init__(self, weight: np.ndarray, entries: int, mode: str, padding_idx, scale_grad_by_freq: bool):
        super().__init__()
        options = dict(freeze=False, sparse=True, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.bag = seqlib.nn.EmbeddingBag.from_pretrained(mx.array(weight), mode=mode, **options)
        self.table = seqlib.nn.Embedding.from_pretrained(mx.array(weight[::-1].copy()), **options)
        self.entry_scale = mx.linspace(0.5, 1.5, entries) if mode == "sum" else None

    def __call__(self, ids, offsets):
        weights = None if self.entry_scale is None else self.entry_scale * 2.0
        bags = self.bag(ids, offsets, per_sample_weights=weights) * 1.5 + self.bag(ids[::-1], offsets)
        return bags, self.table(ids)


@given(batches(), st.booleans())
def test_sparse_rows_read_from_the_table_give_the_dense_gradients(batch, scale_grad_by_freq):
    weight, ids, offsets, mode, padding_idx = batch
    model = TwoTables(weight, len(ids), mode, padding_idx, scale_grad_by_freq)
    rng = np.random.default_rng(len(ids))
    bag_scale = mx.array(rng.standard_normal((len(offsets), weight.shape[1])).astype(np.float32))
    row_scale = mx.array(rng.standard_normal((len(ids), weight.shape[1])).astype(np.float32))

    def loss(model, ids, offsets):
        bags, rows = model(ids, offsets)
        return (bags * bag_scale).sum() + (rows * row_scale).sum()

    arguments = (model, mx.array(ids), mx.array(offsets))
    value, grads = seqlib.sparse.value_and_grad(model, loss)(*arguments)
    dense_value, dense = mlx.nn.value_and_grad(model, loss)(*arguments)
    assert_close(value, dense_value, what="loss")
    for table in ("bag", "table"):
        assert_close(grads[table]["weight"].to_dense(), dense[table]["weight"], what=f"{table}'s gradient")
    if mode == "sum":
        assert_close(grads["entry_scale"], dense["entry_scale"], what="entry weights' parameter gradient")


def test_sparse_embedding_in_a_list_of_layers_keeps_its_place_in_the_tree():
    class Model(mlx.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [seqlib.nn.Embedding(10, 3, sparse=True), mlx.nn.Linear(3, 1)]

        def __call__(self, ids):
            return self.layers[1](self.layers[0](ids))

    model = Model()
    _, grads = seqlib.sparse.value_and_grad(model, lambda m, ids: m(ids).sum())(model, mx.array([[1, 7], [7, 2]]))
    assert isinstance(grads["layers"][0]["weight"], SparseGradient)
    assert np.array(grads["layers"][0]["weight"].indices).tolist() == [1, 2, 7]
    assert set(grads["layers"][1]) == {"weight", "bias"}


def test_without_sparse_tables_it_is_mlx_value_and_grad():
    model = seqlib.nn.Embedding(5, 2)
    _, grads = seqlib.sparse.value_and_grad(model, lambda m: m(mx.array([1])).sum())(model)
    assert isinstance(grads["weight"], mx.array) and grads["weight"].shape == (5, 2)


def without_row_bitmaps(monkeypatch):
    """seqlib.sparse renumbers rows with NumPy alone, as where seqlib.native is not built."""
    monkeypatch.setattr(seqlib.sparse, "_row_bitmaps", lambda num_embeddings, lookups: None)


@pytest.mark.parametrize("second", [[3], [-1], [10], [2, 12]])
@pytest.mark.parametrize("vocab", [10, 100_000])  # without bitmaps: through a (V,) map, and by binary search
@pytest.mark.parametrize("bitmaps", [True, False])
def test_a_loss_that_reads_other_rows_the_second_time_is_refused(second, vocab, bitmaps, monkeypatch):
    if not bitmaps:
        without_row_bitmaps(monkeypatch)
    model = seqlib.nn.Embedding(vocab, 2, sparse=True)
    calls = iter([mx.array([1, 2]), mx.array(second)])
    with pytest.raises(RuntimeError, match="second run"):
        seqlib.sparse.value_and_grad(model, lambda m: m(next(calls)).sum())(model)
    assert model.sparse_recording is None and "weight" in model.trainable_parameters()


@pytest.mark.parametrize("second", [[[2, 1, 1]], [[1, 2], [2, 2]], [[2, 1], [1, 2]], [[1], [2, 1]]])
@pytest.mark.parametrize("bitmaps", [True, False])
def test_a_loss_that_reads_its_rows_otherwise_the_second_time_gets_their_gradient(second, bitmaps, monkeypatch):
    """The first run's positions serve only a lookup that reads what the first run's lookup of that turn read:
    other orders, counts and splits of the same rows are renumbered again."""
    if not bitmaps:
        without_row_bitmaps(monkeypatch)
    model = seqlib.nn.Embedding(5, 2, sparse=True)
    runs = iter([[[1, 2], [2, 1]], second])
    scale = mx.arange(2, dtype=mx.float32) + 1

    def loss(model):
        return sum(((model(mx.array(ids)) * scale) * (turn + 1)).sum() for turn, ids in enumerate(next(runs)))

    _, grads = seqlib.sparse.value_and_grad(model, loss)(model)
    expected = np.zeros((5, 2), np.float32)
    for turn, ids in enumerate(second):
        np.add.at(expected, ids, (turn + 1) * np.array([1, 2], np.float32))
    assert np.array(grads["weight"].indices).tolist() == [1, 2]
    np.testing.assert_array_equal(np.array(grads["weight"].to_dense()), expected)


INDEX_DTYPES = [np.int32, np.int64, np.uint8, np.int16, np.uint32, np.uint64]


@given(st.integers(1, 5000), st.integers(0, 3000), st.sampled_from(INDEX_DTYPES), st.integers(0, 2**32 - 1))
def test_the_row_bitmaps_renumber_rows_as_numpy_does(vocab, count, dtype, seed):
    """seqlib.native's unique_rows and row_positions give NumPy's sorted rows and positions, any index dtype."""
    from seqlib.sparse import _Rows, _row_bitmaps, _sorted_unique

    if _row_bitmaps(vocab, count) is None:
        pytest.skip("seqlib.native is not available here")
    rng = np.random.default_rng(seed)
    high = min(vocab, np.iinfo(dtype).max + 1)
    indices = rng.integers(0, high, size=count).astype(dtype)
    unique, positions = _sorted_unique(indices, vocab, "input")
    expected, inverse = np.unique(indices, return_inverse=True)
    np.testing.assert_array_equal(unique, expected)
    assert unique.dtype == positions.dtype == np.int32
    np.testing.assert_array_equal(positions, inverse.reshape(-1))
    with pytest.MonkeyPatch.context() as patch:
        without_row_bitmaps(patch)
        numpy_unique, no_positions = _sorted_unique(indices, vocab, "input")
    np.testing.assert_array_equal(numpy_unique, expected)
    assert no_positions is None  # the second run finds them
    # the second run's indices: any shape, rows read or not, and values that are no row at all
    asked = np.concatenate([indices, rng.integers(-3, vocab + 3, size=50)]).astype(np.int64)
    asked = asked[: asked.size // 2 * 2].reshape(2, -1)
    with pytest.MonkeyPatch.context() as patch:
        without_row_bitmaps(patch)
        numpy_positions = _Rows(unique, vocab).positions(asked)
    positions = _Rows(unique, vocab).positions(asked)
    assert positions.shape == asked.shape and positions.dtype == np.int32
    np.testing.assert_array_equal(positions, numpy_positions)
    np.testing.assert_array_equal(_Rows(unique, vocab, lookups=3).positions(asked), numpy_positions)  # a (V,) map
    found = positions >= 0
    np.testing.assert_array_equal(unique[positions[found]], asked[found])


def test_the_row_bitmaps_refuse_what_they_cannot_read():
    bitmaps = seqlib.sparse._row_bitmaps(10, 1)
    if bitmaps is None:
        pytest.skip("seqlib.native is not available here")
    with pytest.raises(IndexError, match=r"indices: every index must lie in \[0, 10\), got 10"):
        bitmaps.unique_rows(np.array([3, 10], np.int32), 10)
    with pytest.raises(IndexError, match=r"input of emb: every index must lie in \[0, 10\) \(num_embeddings=10\); "
                                         r"got values from 3 to 10"):  # the message of every lookup
        seqlib.sparse._sorted_unique(np.array([3, 10], np.int32), 10, "input of emb")
    with pytest.raises(IndexError, match=r"got -1"):
        bitmaps.unique_rows(np.array([-1], np.int64), 10)
    for unique in ([3, 3], [4, 2], [10], [-1]):
        with pytest.raises(ValueError, match="unique: expected sorted distinct rows in"):
            bitmaps.row_positions(np.array(unique, np.int32), np.array([1], np.int32), 10)
    with pytest.raises(ValueError, match="rows: expected a table's row count"):
        bitmaps.unique_rows(np.array([1], np.int32), -1)
    # other dtypes are refused, not cast: 2**32 + 3 as int32 would be row 3, 3.7 would be row 3
    for indices in (np.array([2**32 + 3], np.uint64), np.array([3.7]), np.array([3], np.int16)):
        with pytest.raises(TypeError):
            bitmaps.unique_rows(indices, 10)
        with pytest.raises(TypeError):
            bitmaps.row_positions(np.array([3], np.int32), indices, 10)
    with pytest.raises(TypeError):
        bitmaps.row_positions(np.array([2**32 + 3], np.int64), np.array([3], np.int32), 10)
    unique, positions = bitmaps.unique_rows(np.zeros(0, np.int32), 0)
    assert unique.shape == positions.shape == (0,)


OPTIMIZERS = [
    ("SGD", dict(lr=0.1), dict(learning_rate=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9), dict(learning_rate=0.1, momentum=0.9)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True), dict(learning_rate=0.1, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.05, momentum=0.5, dampening=0.3), dict(learning_rate=0.05, momentum=0.5, dampening=0.3)),
    ("Adagrad", dict(lr=0.3), dict(learning_rate=0.3)),
    ("Adagrad", dict(lr=0.3, lr_decay=0.1, initial_accumulator_value=0.2),
     dict(learning_rate=0.3, lr_decay=0.1, initial_accumulator_value=0.2)),
    ("SparseAdam", dict(lr=0.05), dict(learning_rate=0.05)),
    ("SparseAdam", dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6), dict(learning_rate=0.05, betas=(0.8, 0.9), eps=1e-6)),
]


@pytest.mark.parametrize(("name", "torch_kwargs", "our_kwargs"), OPTIMIZERS)
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_optimizers_match_torch_over_several_sparse_steps(name, torch_kwargs, our_kwargs, padding_idx):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((12, 3)).astype(np.float32)
    ours = seqlib.nn.Embedding.from_pretrained(mx.array(weight), freeze=False, sparse=True, padding_idx=padding_idx)
    theirs = torch.nn.Embedding.from_pretrained(torch.from_numpy(weight.copy()), freeze=False, sparse=True,
                                                padding_idx=padding_idx)  # fmt: skip
    our_optimizer = getattr(optim, name)(**our_kwargs)
    their_optimizer = getattr(torch.optim, name)(theirs.parameters(), **torch_kwargs)
    loss_and_grad = seqlib.sparse.value_and_grad(ours, lambda m, ids: (m(ids) ** 2).sum() + m(ids).sum())
    for step in range(5):
        ids = rng.integers(0, 12, size=(2, 4))  # rows differ from step to step
        _, grads = loss_and_grad(ours, mx.array(ids))
        our_optimizer.update(ours, grads)
        their_optimizer.zero_grad()
        out = theirs(torch.from_numpy(ids))
        ((out**2).sum() + out.sum()).backward()
        their_optimizer.step()
        assert_close(ours.weight, theirs.weight, rtol=1e-5, atol=1e-6, what=f"{name} step {step}")


@pytest.mark.parametrize(("name", "torch_kwargs", "our_kwargs"), [
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01), dict(learning_rate=0.1, momentum=0.9, weight_decay=0.01)),
    ("Adagrad", dict(lr=0.3, weight_decay=0.1), dict(learning_rate=0.3, weight_decay=0.1)),
])  # fmt: skip
def test_sgd_and_adagrad_also_match_torch_on_dense_gradients(name, torch_kwargs, our_kwargs):
    weight = np.random.default_rng(2).standard_normal((6, 3)).astype(np.float32)
    ours = seqlib.nn.Embedding.from_pretrained(mx.array(weight), freeze=False)
    theirs = torch.nn.Embedding.from_pretrained(torch.from_numpy(weight.copy()), freeze=False)
    our_optimizer = getattr(optim, name)(**our_kwargs)
    their_optimizer = getattr(torch.optim, name)(theirs.parameters(), **torch_kwargs)
    ids = np.array([0, 2, 2, 5])
    for _ in range(4):
        _, grads = mlx.nn.value_and_grad(ours, lambda m: (m(mx.array(ids)) ** 2).sum())(ours)
        our_optimizer.update(ours, grads)
        their_optimizer.zero_grad()
        (theirs(torch.from_numpy(ids)) ** 2).sum().backward()
        their_optimizer.step()
    assert_close(ours.weight, theirs.weight, rtol=1e-5, atol=1e-6)


def test_sparse_gradients_refuse_what_torch_refuses():
    table = seqlib.nn.Embedding(5, 2, sparse=True)
    _, grads = seqlib.sparse.value_and_grad(table, lambda m: m(mx.array([1])).sum())(table)
    with pytest.raises(ValueError, match="weight_decay"):
        optim.SGD(learning_rate=0.1, weight_decay=0.1).update(table, grads)
    with pytest.raises(ValueError, match="weight_decay"):
        optim.Adagrad(learning_rate=0.1, weight_decay=0.1).update(table, grads)
    dense = seqlib.nn.Embedding(5, 2)
    _, dense_grads = mlx.nn.value_and_grad(dense, lambda m: m(mx.array([1])).sum())(dense)
    with pytest.raises(TypeError, match="SparseAdam needs SparseGradient"):
        optim.SparseAdam().update(dense, dense_grads)
