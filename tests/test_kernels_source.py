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
