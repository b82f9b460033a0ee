"""seqlib.data: the adding problem and the Python-source corpus."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlib import data


@given(num_sequences=st.integers(1, 40), length=st.integers(2, 60), seed=st.integers(0, 2**32 - 1))
def test_adding_problem_marks_one_step_in_each_half_and_sums_them(num_sequences, length, seed):
    inputs, targets = data.adding_problem(num_sequences, length, seed)
    assert inputs.shape == (num_sequences, length, 2) and inputs.dtype == mx.float32
    assert targets.shape == (num_sequences,) and targets.dtype == mx.float32
    values, markers = np.array(inputs[..., 0]), np.array(inputs[..., 1])
    assert values.min() >= 0.0 and values.max() < 1.0
    assert set(np.unique(markers)) <= {0.0, 1.0}
    half = length // 2
    np.testing.assert_array_equal(markers[:, :half].sum(axis=1), 1)
    np.testing.assert_array_equal(markers[:, half:].sum(axis=1), 1)
    np.testing.assert_allclose(np.array(targets), (values * markers).sum(axis=1), rtol=1e-6)


def test_adding_problem_is_seeded_and_a_generator_draws_fresh_batches():
    first, _ = data.adding_problem(8, 20, 3)
    again, _ = data.adding_problem(8, 20, 3)
    assert mx.array_equal(first, again)
    rng = np.random.default_rng(3)
    one, _ = data.adding_problem(8, 20, rng)
    two, _ = data.adding_problem(8, 20, rng)
    assert mx.array_equal(one, first) and not mx.array_equal(one, two)


def test_adding_problem_baseline_is_the_variance_of_the_target():
    _, targets = data.adding_problem(200_000, 10, 0)
    mse_of_predicting_one = float(np.mean((np.array(targets) - 1.0) ** 2))
    assert mse_of_predicting_one == pytest.approx(data.ADDING_PROBLEM_BASELINE_MSE, rel=0.01)


@pytest.mark.parametrize(
    ("num_sequences", "length", "match"),
    [(0, 10, "num_sequences"), (4, 1, "length: expected at least 2"), (4, 2.5, "length"), (True, 10, "num_sequences")],
)
def test_adding_problem_rejects_bad_sizes(num_sequences, length, match):
    with pytest.raises(ValueError, match=match):
        data.adding_problem(num_sequences, length)


def test_source_words_are_maximal_ascii_identifier_runs():
    text = "def f(x_1):\n    return 3abc + _private  # Hello, wörld: a.b\n"
    assert data.source_words(text) == ["def", "f", "x_1", "return", "abc", "_private", "Hello", "w", "rld", "a", "b"]
    assert data.source_words("42 + 7.5") == []


def test_python_source_tokens_are_the_words_of_the_stdlib_files_in_name_order():
    files = data.stdlib_source_files()
    assert len(files) > 50 and files == sorted(files)
    assert all(path.suffix == ".py" and path.parent == files[0].parent for path in files)
    tokens = data.python_source_tokens(max_files=3)
    expected = [word for path in files[:3] for word in data.source_words(path.read_text(encoding="utf-8"))]
    assert tokens == expected and len(tokens) > 100
    everything = data.python_source_tokens()
    assert everything[: len(tokens)] == tokens and len(everything) > 100_000
    assert {"def", "return", "self", "True", "None"} <= set(everything)


def test_python_source_tokens_rejects_a_bad_max_files():
    with pytest.raises(ValueError, match="max_files"):
        data.python_source_tokens(max_files=0)


def test_character_corpus_reads_the_fixed_modules_in_order():
    corpus = data.character_corpus()
    assert [name for name, _ in corpus] == list(data.CHARACTER_CORPUS_MODULES)
    assert 100_000 < sum(len(text) for _, text in corpus) < 1_000_000
    name, text = data.character_corpus(["copy"])[0]
    assert name == "copy" and "def deepcopy(" in text


@pytest.mark.parametrize(
    ("modules", "error", "match"),
    [("copy", TypeError, "modules"), ([], ValueError, "at least one"), (["os.path"], ValueError, "module names"),
     (["no_such_module_here"], FileNotFoundError, "no_such_module_here")],
)
def test_character_corpus_rejects_bad_module_lists(modules, error, match):
    with pytest.raises(error, match=match):
        data.character_corpus(modules)


@given(count=st.integers(2, 40), every=st.integers(2, 6))
def test_split_by_file_holds_out_every_kth_file_whole(count, every):
    files = [f"file{i}" for i in range(count)]
    if count < every:
        with pytest.raises(ValueError, match="files"):
            data.split_by_file(files, every)
        return
    train, validation = data.split_by_file(files, every)
    assert validation == files[every - 1 :: every]
    assert sorted(train + validation) == sorted(files) and not set(train) & set(validation)
    assert train == [f for f in files if f not in validation]


@pytest.mark.parametrize(
    ("files", "every", "error"),
    [(["a", "b"], 1, ValueError), (["a", "b"], 0, ValueError), ("abcde", 2, TypeError), (["a", "b"], 2.0, ValueError)],
)
def test_split_by_file_rejects_bad_arguments(files, every, error):
    with pytest.raises(error):
        data.split_by_file(files, every)


def test_character_vocabulary_round_trips_and_maps_unseen_characters_to_unknown():
    vocab = data.CharacterVocabulary("hello world\n", min_count=1)
    assert vocab.chars[0] == vocab.UNKNOWN and vocab.chars[1:] == sorted(set("hello world\n"))
    assert len(vocab) == 1 + len(set("hello world\n"))
    ids = vocab.encode("hold\n")
    assert ids.dtype == np.int32 and ids.shape == (5,) and ids.min() > 0
    assert vocab.decode(ids) == "hold\n" and vocab.decode(mx.array(ids)) == "hold\n"
    assert vocab.encode("hz!").tolist()[1:] == [0, 0] and vocab.decode(vocab.encode("z")) == vocab.UNKNOWN
    frequent = data.CharacterVocabulary("aaabbc", min_count=2)
    assert frequent.chars == [frequent.UNKNOWN, "a", "b"] and frequent.encode("c").tolist() == [0]


def test_character_vocabulary_rejects_bad_input():
    with pytest.raises(TypeError, match="text"):
        data.CharacterVocabulary(b"bytes")
    with pytest.raises(ValueError, match="min_count"):
        data.CharacterVocabulary("abc", min_count=0)
    with pytest.raises(ValueError, match="no character"):
        data.CharacterVocabulary("abc", min_count=2)
    vocab = data.CharacterVocabulary("abc")
    with pytest.raises(IndexError, match="ids"):
        vocab.decode([0, 4])
    with pytest.raises(TypeError, match="ids"):
        vocab.decode([1.0])
    with pytest.raises(ValueError, match="1-D"):
        vocab.decode(np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match="text"):
        vocab.encode(["a"])


@given(count=st.integers(2, 300), batch_size=st.integers(1, 8), length=st.integers(1, 12), data_=st.data())
def test_tbptt_batches_cut_parallel_streams_that_continue_across_windows(count, batch_size, length, data_):
    offset = data_.draw(st.integers(0, length - 1))
    ids = np.arange(count, dtype=np.int64)
    steps = (count - offset - 1) // batch_size
    if steps < length:
        with pytest.raises(ValueError, match="fewer than one window"):
            data.tbptt_batches(ids, batch_size, length, offset=offset)
        return
    windows = data.tbptt_batches(ids, batch_size, length, offset=offset)
    assert len(windows) == steps // length
    for inputs, targets in windows:
        assert inputs.shape == targets.shape == (batch_size, length) and inputs.dtype == mx.int32
        np.testing.assert_array_equal(np.array(targets), np.array(inputs) + 1)  # the next id
    streams = np.concatenate([np.array(inputs) for inputs, _ in windows], axis=1)  # (B, windows * L)
    starts = offset + np.arange(batch_size)[:, None] * steps  # stream b starts at offset + b * S
    np.testing.assert_array_equal(streams, starts + np.arange(streams.shape[1]))


def test_tbptt_batches_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        data.tbptt_batches(np.arange(10), 0, 2)
    with pytest.raises(ValueError, match="length"):
        data.tbptt_batches(np.arange(10), 2, 1.5)
    with pytest.raises(TypeError, match="ids"):
        data.tbptt_batches(np.linspace(0, 1, 10), 2, 2)
    with pytest.raises(ValueError, match="1-D"):
        data.tbptt_batches(np.zeros((4, 4), np.int32), 2, 2)
    with pytest.raises(ValueError, match=r"offset: expected an int in \[0, length=2\), got 2"):
        data.tbptt_batches(np.arange(10), 2, 2, offset=2)
    with pytest.raises(ValueError, match="offset"):
        data.tbptt_batches(np.arange(10), 2, 2, offset=-1)
    with pytest.raises(TypeError, match="offset"):
        data.tbptt_batches(np.arange(10), 2, 2, offset=0.5)
