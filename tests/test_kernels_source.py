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
