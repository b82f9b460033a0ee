import re

import pytest

from seqlib import kernels


def test_every_kernel_source_loads_and_states_its_thread_job():
    names = kernels.kernel_names()
    assert "embedding_gather" in names
    for name in names:
        source = kernels.kernel_source(name)
        assert "thread" in source.lower() and source.strip()


def test_unknown_kernel_name_lists_the_available_ones():
    with pytest.raises(ValueError, match="embedding_gather"):
        kernels.kernel_source("no_such_kernel")


def test_the_named_codes_in_the_shared_header_are_the_python_enums():
    """MODE_* and NORM_* in seqlib_math.h are what seqlib passes as the MODE and NORM template arguments."""
    header = kernels.kernel_header()
    constants = {name: int(value) for name, value in re.findall(r"constexpr int (\w+) = (\d+);", header)}
    for enum_class, prefix in ((kernels.BagMode, "MODE_"), (kernels.NormKind, "NORM_")):
        named = {name.removeprefix(prefix): value for name, value in constants.items() if name.startswith(prefix)}
        assert named == {member.name: member.value for member in enum_class}


def test_kernels_use_the_named_codes_not_bare_numbers():
    for name in kernels.kernel_names():
        code = re.sub(r"//[^\n]*", "", kernels.kernel_source(name))
        assert not re.search(r"\b(MODE|NORM) [=!]= \d", code), name


def test_every_kernel_cites_its_reference_function_and_no_chapter_number():
    import seqlib.reference

    for name in kernels.kernel_names():
        source = kernels.kernel_source(name)
        cited = re.findall(r"seqlib\.reference\.(\w+)", source)
        assert cited, f"{name}.metal cites no seqlib.reference function"
        for function in cited:
            assert callable(getattr(seqlib.reference, function, None)), f"{name}.metal cites {function}"
        assert not re.search(r"chapter \d", source, re.IGNORECASE), name


def test_every_kernel_has_a_spec_and_a_generated_source_with_its_body():
    import mlx.core as mx

    assert sorted(kernels.KERNEL_SPECS) == kernels.kernel_names()
    for name in kernels.kernel_names():
        for dtype in (mx.float32, mx.float16):
            text = kernels.generated_source(name, dtype)
            assert kernels.kernel_source(name) in text and f"custom_kernel_{name}" in text
    with pytest.raises(ValueError, match="REVERSE"):
        kernels.generated_source("rnn_cell", REVERSE=True)
    with pytest.raises(ValueError, match="embedding_gather"):
        kernels.generated_source("no_such_kernel")
    with pytest.raises(TypeError, match="dtype"):
        kernels.generated_source("lstm_cell", mx.int32)


@pytest.mark.metal_emulation
def test_generated_source_is_the_text_a_launch_compiles():
    """show_kernel's text is what the emulation (and MLX: test_metal_emulation_codegen) compiles for a real call."""
    import mlx.core as mx

    from emulated import metal_backend
    from seqlib import emulation
    from seqlib.notebook import show_kernel

    x_gates, w_hh, state = mx.zeros((16, 32)), mx.zeros((32, 8)), mx.zeros((2, 8))
    with metal_backend(), emulation.record() as launches:
        kernels.lstm_pointwise(mx.zeros((2, 32), mx.float16), state.astype(mx.float16))
        kernels.lstm_sequence_forward(x_gates, w_hh, state, state, (2,) * 8, reverse=True)
        kernels.embedding_bag(mx.arange(16) % 10, mx.ones((10, 8)), mx.arange(0, 16, 2), "sum", mx.ones((16,)))
    lstm_cell, lstm_sequence, embedding_bag = launches
    assert lstm_cell.text == kernels.generated_source("lstm_cell", mx.float16)
    assert lstm_sequence.text == kernels.generated_source("lstm_sequence", REVERSE=True)
    # (every input here has 8 elements or more: MLX passes smaller ones in `constant` memory, the example does not)
    assert embedding_bag.text == kernels.generated_source("embedding_bag", WEIGHTED=True)
    assert show_kernel("lstm_cell", mx.float16).data == lstm_cell.text
