"""Weights between torch and seqlib: from_torch, load_torch_state_dict, torch_state_dict."""

import io

import mlx.core as mx
import numpy as np
import pytest
import torch
from torch_reference import assert_close

import seqlib

TORCH_TABLES = [
    lambda: torch.nn.Embedding(7, 3),
    lambda: torch.nn.Embedding(7, 3, padding_idx=2, max_norm=1.5, norm_type=1.0, scale_grad_by_freq=True),
    lambda: torch.nn.Embedding(7, 3, sparse=True, dtype=torch.float16),
    lambda: torch.nn.EmbeddingBag(7, 3),
    lambda: torch.nn.EmbeddingBag(7, 3, mode="max", padding_idx=-1, include_last_offset=True),
    lambda: torch.nn.EmbeddingBag(7, 3, mode="sum", sparse=True, max_norm=2.0, dtype=torch.bfloat16),
]
OPTIONS = ["num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
           "sparse", "mode", "include_last_offset"]  # fmt: skip


@pytest.mark.parametrize("make", TORCH_TABLES)
def test_from_torch_copies_options_and_weights(make):
    torch.manual_seed(0)
    theirs = make()
    ours = seqlib.from_torch(theirs)
    assert type(ours).__name__ == type(theirs).__name__
    for option in OPTIONS:
        if hasattr(theirs, option):
            assert getattr(ours, option) == getattr(theirs, option), option
    assert str(ours.weight.dtype).split(".")[-1] == str(theirs.weight.dtype).split(".")[-1]
    assert_close(ours.weight, theirs.weight.float(), rtol=0, atol=0)
    ids = torch.tensor([[0, 2, 6], [1, 1, 3]])
    expected = theirs(ids).float()
    assert_close(ours(mx.array(ids.numpy())), expected, rtol=1e-2, atol=1e-2)


def test_frozen_torch_weight_gives_a_frozen_table():
    frozen = torch.nn.Embedding.from_pretrained(torch.ones(3, 2))
    assert seqlib.from_torch(frozen).trainable_parameters() == {}


def test_state_dict_round_trip_through_torch_save_is_lossless():
    ours = seqlib.nn.EmbeddingBag(9, 4, mode="sum")
    buffer = io.BytesIO()
    torch.save({key: torch.from_numpy(value) for key, value in ours.torch_state_dict().items()}, buffer)
    buffer.seek(0)
    theirs = torch.nn.EmbeddingBag(9, 4, mode="sum")
    theirs.load_state_dict(torch.load(buffer))
    back = seqlib.nn.EmbeddingBag(9, 4, mode="sum")
    back.load_torch_state_dict(theirs.state_dict())
    assert np.array_equal(np.array(back.weight), np.array(ours.weight))
    from_numpy = seqlib.nn.EmbeddingBag(9, 4)
    from_numpy.load_torch_state_dict(ours.torch_state_dict())
    assert np.array_equal(np.array(from_numpy.weight), np.array(ours.weight))


def test_load_torch_state_dict_keeps_the_modules_dtype_and_checks_keys_and_shapes():
    table = seqlib.nn.Embedding(4, 2, dtype=mx.bfloat16)
    table.load_torch_state_dict({"weight": torch.arange(8.0).reshape(4, 2)})
    assert table.weight.dtype == mx.bfloat16 and table.torch_state_dict()["weight"].dtype == np.float32
    with pytest.raises(ValueError, match=r"missing keys \['weight'\]"):
        table.load_torch_state_dict({})
    with pytest.raises(ValueError, match=r"unexpected keys \['bias'\]"):
        table.load_torch_state_dict({"weight": np.zeros((4, 2)), "bias": np.zeros(2)})
    with pytest.raises(ValueError, match=r"expected shape \(4, 2\), got \(2, 4\)"):
        table.load_torch_state_dict({"weight": np.zeros((2, 4))})
    with pytest.raises(TypeError, match="list"):
        table.load_torch_state_dict({"weight": [[0.0, 0.0]] * 4})


def test_from_torch_names_what_it_can_convert():
    with pytest.raises(TypeError, match=r"torch\.nn\.Embedding.*got torch\.nn\.modules\.linear\.Linear"):
        seqlib.from_torch(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------ TorchScript modules and partial loads

TORCH_RECURRENT = [
    lambda: torch.nn.LSTMCell(3, 4),
    lambda: torch.nn.GRUCell(3, 4, bias=False),
    lambda: torch.nn.RNNCell(3, 4, nonlinearity="relu"),
    lambda: torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True),
    lambda: torch.nn.GRU(3, 4, batch_first=True),
    lambda: torch.nn.RNN(3, 4, nonlinearity="relu", bias=False),
]


def _saved_and_loaded(scripted):
    """What a .jit file gives back: the scripted module through torch.jit.save and torch.jit.load."""
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    return torch.jit.load(buffer)


SCRIPTING = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


@SCRIPTING
@pytest.mark.parametrize("make", TORCH_RECURRENT + TORCH_TABLES)
@pytest.mark.parametrize("reload", [False, True], ids=["scripted", "saved-and-loaded"])
def test_from_torch_takes_torchscript_modules_scripted_from_torch_nn(make, reload):
    torch.manual_seed(0)
    eager = make().eval()
    scripted = torch.jit.script(eager)
    if reload:
        scripted = _saved_and_loaded(scripted)
    ours = seqlib.from_torch(scripted)
    assert type(ours).__name__ == type(eager).__name__
    assert not ours.training
    for key, value in eager.state_dict().items():
        assert_close(ours.torch_state_dict()[key], value.float(), rtol=0, atol=0, what=key)
    if "Embedding" in type(eager).__name__:
        ids = torch.tensor([[0, 2, 6], [1, 1, 3]])
        assert_close(ours(mx.array(ids.numpy())), eager(ids).float(), rtol=1e-2, atol=1e-2)
        return
    batch_first = getattr(eager, "batch_first", False)
    x = torch.randn(2, 5, 3) if batch_first else torch.randn(5, 2, 3)
    if "Cell" in type(eager).__name__:
        x = x[0]
    with torch.no_grad():
        expected = eager(x)  # scripted nn.LSTM/GRU/RNN keep only forward_tensor and forward_packed
    got = ours(mx.array(x.numpy()))
    expected = expected[0] if isinstance(expected, tuple) else expected
    got = got[0] if isinstance(got, tuple) else got
    assert_close(got, expected, rtol=1e-5, atol=1e-5)


@SCRIPTING
def test_from_torch_refuses_scripted_subclasses_and_containers_naming_the_class():
    class CustomCell(torch.nn.LSTMCell):
        pass

    with pytest.raises(TypeError, match=r"TorchScript module scripted from one.*CustomCell"):
        seqlib.from_torch(torch.jit.script(CustomCell(2, 3)))
    with pytest.raises(TypeError, match=r"TorchScript module of class torch\.nn\.modules\.container.*Sequential"):
        seqlib.from_torch(torch.jit.script(torch.nn.Sequential(torch.nn.LSTMCell(2, 3))))


@SCRIPTING
def test_from_torch_takes_a_sub_module_of_a_loaded_torchscript_model():
    class Decoder(torch.nn.Module):  # a model shaped like silero-vad's decoder: a cell inside a larger model
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTMCell(6, 5)
            self.head = torch.nn.Linear(5, 1)

        def forward(self, x, h, c):
            h, c = self.rnn(x, (h, c))
            return self.head(h), h, c

    torch.manual_seed(1)
    model = _saved_and_loaded(torch.jit.script(Decoder().eval()))
    cell = seqlib.from_torch(model.rnn)
    x, h, c = torch.randn(3, 6), torch.randn(3, 5), torch.randn(3, 5)
    with torch.no_grad():
        _, expected_h, expected_c = model(x, h, c)
    got_h, got_c = cell(mx.array(x.numpy()), (mx.array(h.numpy()), mx.array(c.numpy())))
    assert_close(got_h, expected_h, rtol=1e-5, atol=1e-5)
    assert_close(got_c, expected_c, rtol=1e-5, atol=1e-5)
    # the same weights taken out of the whole model's state dict
    again = seqlib.nn.LSTMCell(6, 5)
    result = again.load_torch_state_dict(seqlib.nn.sub_state_dict(model.state_dict(), "rnn"))
    assert result == ([], []) and repr(result) == "<All keys matched successfully>"
    for key, value in cell.torch_state_dict().items():
        np.testing.assert_array_equal(again.torch_state_dict()[key], value)


@pytest.mark.parametrize("given", [
    {},                                                   # nothing matches
    {"weight_ih": torch.ones(16, 3)},                     # part of it
    {"weight_ih": torch.ones(16, 3), "decoder.weight": torch.ones(1)},  # part, and a stranger
])  # fmt: skip
def test_non_strict_loading_returns_torchs_missing_and_unexpected_keys(given):
    theirs = torch.nn.LSTMCell(3, 4)
    ours = seqlib.from_torch(theirs)
    before = ours.torch_state_dict()
    expected = theirs.load_state_dict(given, strict=False)
    result = ours.load_torch_state_dict(given, strict=False)
    assert isinstance(result, seqlib.nn.IncompatibleKeys)
    assert (sorted(result.missing_keys), sorted(result.unexpected_keys)) == (
        sorted(expected.missing_keys), sorted(expected.unexpected_keys))
    for key, value in ours.torch_state_dict().items():
        np.testing.assert_array_equal(value, given[key].numpy() if key in given else before[key], err_msg=key)


def test_sub_state_dict_takes_one_module_path_and_names_the_others_when_nothing_matches():
    state_dict = {"encoder.0.weight": 1, "decoder.rnn.weight_ih": 2, "decoder.rnn.bias_ih": 3, "decoder.rnnx.w": 4}
    assert seqlib.nn.sub_state_dict(state_dict, "decoder.rnn") == {"weight_ih": 2, "bias_ih": 3}
    assert seqlib.nn.sub_state_dict(state_dict, "decoder.rnn.") == {"weight_ih": 2, "bias_ih": 3}
    with pytest.raises(ValueError, match=r"'decoder\.lstm\.'.*'decoder\.rnn'.*'encoder\.0'"):
        seqlib.nn.sub_state_dict(state_dict, "decoder.lstm")
    with pytest.raises(TypeError, match="prefix"):
        seqlib.nn.sub_state_dict(state_dict, "")
    with pytest.raises(TypeError, match="state_dict"):
        seqlib.nn.sub_state_dict([("a.b", 1)], "a")
