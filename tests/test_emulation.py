"""seqlib.emulation's public API on small hand-written kernels.

Each distinct kernel text costs a compile (under a second each), so the file
uses four: an elementwise copy, a neighbour read that lacks its barrier, a
reduction with barriers, simd_sum and atomics, and one the compiler rejects.
"""

import inspect

import mlx.core as mx
import numpy as np
import pytest

from seqlib import emulation
from seqlib.emulation import codegen

pytestmark = pytest.mark.metal_emulation

DOUBLE = """
uint x = thread_position_in_grid.x;
uint y = thread_position_in_grid.y;
uint width = a_shape[1];
if (x < width && y < a_shape[0]) {
  out[y * width + x] = 2.0f * a[y * width + x];
}
"""

# Each thread reads what the previous thread of its group stored: it needs a barrier between.
PREVIOUS_WITHOUT_BARRIER = """
uint i = thread_position_in_grid.x;
uint t = thread_index_in_threadgroup;
threadgroup float shared[64];
shared[t] = a[i];
out[i] = shared[t > 0 ? t - 1 : 0];
"""

# Two barriers, one simd_sum and one atomic add per SIMD group.
GROUP_SUM = """
uint i = thread_position_in_grid.x;
uint t = thread_index_in_threadgroup;
threadgroup float shared[64];
shared[t] = a[i];
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = simd_sum(shared[t]);
threadgroup_barrier(mem_flags::mem_threadgroup);
if (thread_index_in_simdgroup == 0) {
  atomic_fetch_add_explicit(&out[0], total, memory_order_relaxed);
}
"""


def double_kernel():
    return emulation.metal_kernel("double", ["a"], ["out"], DOUBLE)


def run_double(a, grid, threadgroup, output_shape=None, **call):
    (out,) = double_kernel()(inputs=[a], output_shapes=[output_shape or a.shape], output_dtypes=[mx.float32],
                             grid=grid, threadgroup=threadgroup, **call)  # fmt: skip
    return np.array(out)


def run_previous(order):
    kernel = emulation.metal_kernel("previous", ["a"], ["out"], PREVIOUS_WITHOUT_BARRIER)
    with emulation.options(order=order):
        (out,) = kernel(inputs=[mx.arange(64, dtype=mx.float32)], output_shapes=[(64,)], output_dtypes=[mx.float32],
                        grid=(64, 1, 1), threadgroup=(64, 1, 1))  # fmt: skip
    return np.array(out)


def run_group_sum(a, order="forward"):
    kernel = emulation.metal_kernel("group_sum", ["a"], ["out"], GROUP_SUM, atomic_outputs=True)
    with emulation.options(order=order), emulation.record(writers=True) as launches:
        (out,) = kernel(inputs=[a], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(a.size, 1, 1),
                        threadgroup=(64, 4, 1), init_value=0.0)  # fmt: skip
    return np.array(out), launches[0]


def values(shape):
    return mx.arange(int(np.prod(shape)), dtype=mx.float32).reshape(shape)


# ----------------------------------------------------------------- same API as mx.fast.metal_kernel


def signature_from_doc(doc: str) -> inspect.Signature:
    """The signature nanobind writes on the first line of a docstring, as an inspect.Signature."""
    head = doc.splitlines()[0]
    parameters = head[head.index("(") + 1 : head.rindex(")")]
    namespace = {"false": False, "true": True}
    exec(f"from __future__ import annotations\ndef f({parameters}): pass", namespace)
    return inspect.signature(namespace["f"])


def plain(signature: inspect.Signature) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values() if p.name != "self"]


def test_factory_and_call_have_mlx_signatures():
    assert plain(inspect.signature(emulation.metal_kernel)) == plain(signature_from_doc(mx.fast.metal_kernel.__doc__))
    mlx_kernel = mx.fast.metal_kernel(name="k", input_names=["a"], output_names=["out"], source="out[0] = a[0];")
    ours = inspect.signature(emulation.EmulatedKernel.__call__)
    assert plain(ours) == plain(signature_from_doc(mlx_kernel.__doc__))


def test_elementwise_kernel_matches_numpy_and_prints_mlx_text(capsys):
    a = values((3, 10))
    out = run_double(a, (10, 3, 1), (4, 2, 1), verbose=True)
    np.testing.assert_array_equal(out, 2 * np.array(a))
    spec = codegen.InputSpec("a", mx.float32, 2, 30)
    text = codegen.kernel_text("double", DOUBLE, "", [spec], ["out"], [mx.float32], None, False)
    assert "const constant int* a_shape [[buffer(1)]]" in text
    assert capsys.readouterr().out == f"Generated source code for `double`:\n```\n{text}\n```\n"


def test_bad_calls_and_options_are_refused():
    a = values((3, 10))
    with pytest.raises(ValueError, match="inputs: kernel 'double' takes 1"):
        double_kernel()(inputs=[a, a], output_shapes=[(3, 10)], output_dtypes=[mx.float32], grid=(10, 3, 1),
                        threadgroup=(4, 2, 1))  # fmt: skip
    with pytest.raises(ValueError, match=r"grid: expected 3 ints"):
        run_double(a, (10, 3), (4, 2, 1))
    with pytest.raises(ValueError, match=r"threadgroup: expected 3 ints >= 1"):
        run_double(a, (10, 3, 1), (0, 2, 1))
    with pytest.raises(TypeError, match=r"input 'a'.*float64"):
        run_double(a.astype(mx.float64), (10, 3, 1), (4, 2, 1))
    for arguments, error, words in [
        ({"order": "sideways"}, ValueError, "order: expected one of"),
        ({"seed": -1}, ValueError, r"seed: expected an int in \[0, 2\*\*32\)"),
        ({"seed": "1"}, TypeError, "seed: expected an int"),
        ({"nan_fill": 1}, TypeError, "nan_fill: expected a bool"),
        ({"guards": None}, TypeError, "guards: expected a bool"),
    ]:
        with pytest.raises(error, match=words), emulation.options(**arguments):
            pass
    with pytest.raises(TypeError, match="writers: expected a bool"), emulation.record(writers=1):
        pass


# ----------------------------------------------------------------- options expose kernel bugs


def test_reverse_and_random_orders_expose_a_missing_barrier():
    expected = np.concatenate([[0.0], np.arange(63)])
    np.testing.assert_array_equal(run_previous("forward"), expected)  # forward order happens to work
    assert np.isnan(run_previous("reverse")[1:]).all()  # nobody has stored its value yet
    assert np.isnan(run_previous("random")).any()


def test_nan_fill_exposes_an_unwritten_row_and_zeros_without_it():
    a = values((3, 10))
    out = run_double(a, (10, 2, 1), (4, 2, 1))  # the grid misses row 2
    np.testing.assert_array_equal(out[:2], 2 * np.array(a)[:2])
    assert np.isnan(out[2]).all()
    with emulation.options(nan_fill=False):
        np.testing.assert_array_equal(run_double(a, (10, 2, 1), (4, 2, 1))[2], 0.0)
        np.testing.assert_array_equal(run_double(a, (10, 2, 1), (4, 2, 1), init_value=7.0)[2], 7.0)


def test_guards_catch_an_out_of_bounds_write():
    a = values((4, 10))
    with pytest.raises(emulation.EmulationError, match="double: the kernel wrote outside output 'out'"):
        run_double(a, (10, 4, 1), (4, 2, 1), output_shape=(3, 10))  # row 3 lands past the end
    with emulation.options(guards=False):  # no guard zones: same results for a kernel that stays inside
        np.testing.assert_array_equal(run_double(a, (10, 4, 1), (4, 2, 1)), 2 * np.array(a))


def test_pad_grid_runs_whole_groups_whose_extra_threads_must_do_nothing():
    a = values((3, 10))
    with emulation.options(pad_grid=True), emulation.record() as launches:
        out = run_double(a, (10, 3, 1), (4, 2, 1))
    np.testing.assert_array_equal(out, 2 * np.array(a))
    assert (launches[0].grid, launches[0].threads, launches[0].threadgroups) == ((12, 4, 1), 48, 6)


# ----------------------------------------------------------------- the compiler


def test_a_missing_compiler_is_named_with_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-for-seqlib")
    with pytest.raises(emulation.CompilerNotFoundError, match="'no-such-compiler-for-seqlib' was not found"):
        run_double(values((3, 10)), (10, 3, 1), (4, 2, 1))  # the library is cached per compiler: no cache hit
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))
    how_to_get_one = r"none of .*g\+\+.* was found.*(apt install g\+\+|xcode-select --install)"
    with pytest.raises(emulation.CompilerNotFoundError, match=how_to_get_one):
        emulation.compiler.find_compiler()


def test_a_kernel_the_compiler_rejects_raises_with_its_message():
    kernel = emulation.metal_kernel("rejected", ["a"], ["out"], "out[0] = a[0] + undeclared_name;")
    with pytest.raises(emulation.EmulationError, match=r"rejected the kernel[\s\S]*undeclared_name"):
        kernel(inputs=[values((8,))], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
               threadgroup=(1, 1, 1))  # fmt: skip


# ----------------------------------------------------------------- record()


def test_record_counts_barriers_simd_collectives_and_atomics():
    a = values((100,))
    before = emulation.launch_count()
    out, launch = run_group_sum(a)
    assert emulation.launch_count() == before + 1
    np.testing.assert_allclose(out, [np.array(a).sum()])
    # threadgroup (64, 4, 1) clamped to the grid; groups of 64 and 36 threads, each 2 SIMD groups (32 + 32, 32 + 4)
    assert (launch.grid, launch.threadgroup, launch.threadgroups, launch.threads) == ((100, 1, 1), (64, 1, 1), 2, 100)
    assert (launch.barriers, launch.barrier_waits, launch.simd_collectives, launch.atomics) == (4, 200, 4, 4)
    assert launch.thread_barriers.shape == (1, 1, 100)
    np.testing.assert_array_equal(launch.thread_barriers, 2)
    np.testing.assert_array_equal(launch.thread_simd_collectives, 1)
    np.testing.assert_array_equal(np.flatnonzero(launch.thread_atomics), [0, 32, 64, 96])  # lane 0 of each
    assert launch.text.startswith("[[kernel]] void custom_kernel_group_sum_float_float(")
    assert (launch.input_shapes, launch.output_shapes, launch.init_value) == (((100,),), ((1,),), 0.0)


def test_writers_of_an_atomic_output_follow_the_thread_order():
    for order, last_writer, group, simdgroup in [("forward", 96, 1, 1), ("reverse", 0, 0, 0)]:
        _, launch = run_group_sum(values((100,)), order)
        assert launch.writers["out"].tolist() == [last_writer], order
        assert launch.writer_threadgroup("out").tolist() == [group]
        assert launch.writer_simdgroup("out").tolist() == [simdgroup]
        assert launch.writer_lane("out").tolist() == [0]
        assert launch.thread_writes.sum() == 4  # every atomic add changed the sum


def test_writers_of_an_elementwise_kernel_follow_metal_thread_numbering():
    height, width, group = 3, 40, (32, 2, 1)
    with emulation.record(writers=True) as launches:
        run_double(values((height, width)), (width, height, 1), group)
    (launch,) = launches
    y, x = np.mgrid[:height, :width]
    np.testing.assert_array_equal(launch.writers["out"], x + width * y)  # thread (x, y) writes out[y, x]
    np.testing.assert_array_equal(launch.writer_threadgroup("out"), x // 32 + 2 * (y // 2))
    # Metal's numbering inside a group: thread_index_in_threadgroup = x + (group width) * y, where the groups at
    # the right edge are 8 wide and those at the bottom 1 high; 32 lanes to a SIMD group.
    group_width = np.where(x // 32 == 1, width - 32, 32)
    index = x % 32 + group_width * (y % 2)
    np.testing.assert_array_equal(launch.writer_simdgroup("out"), index // 32)
    np.testing.assert_array_equal(launch.writer_lane("out"), index % 32)
    assert launch.thread_writes.shape == (1, height, width)
    np.testing.assert_array_equal(launch.thread_writes, 1)


def test_writers_are_recorded_only_when_asked_and_unwritten_elements_have_none():
    with emulation.record() as launches:
        run_double(values((3, 10)), (10, 2, 1), (4, 2, 1))
    assert launches[0].writers is None and launches[0].thread_writes is None
    with pytest.raises(ValueError, match=r"record\(writers=True\)"):
        launches[0].writer_lane("out")
    with emulation.record(writers=True) as launches:
        run_double(values((3, 10)), (10, 2, 1), (4, 2, 1))
    np.testing.assert_array_equal(launches[0].writers["out"][2], -1)  # row 2: outside the grid
    np.testing.assert_array_equal(launches[0].writer_lane("out")[2], -1)
    with pytest.raises(ValueError, match="output: expected one of \\['out'\\], got 'h'"):
        launches[0].writer_simdgroup("h")


# ----------------------------------------------------------------- as strict as Apple's compiler and GPUs


def run_small(name, body, size=64, **kernel_options):
    kernel = emulation.metal_kernel(name, ["a"], ["out"], body, **kernel_options)
    (out,) = kernel(inputs=[values((size,))], output_shapes=[(size,)], output_dtypes=[mx.float32],
                    grid=(size, 1, 1), threadgroup=(size, 1, 1))  # fmt: skip
    return np.array(out)


@pytest.mark.parametrize("construct", [
    "if constexpr (true) { out[0] = a[0]; }",                      # C++17
    "float pair[2] = {a[0], 1.0f}; auto [x, y] = pair; out[0] = x + y;",  # structured bindings, C++17
    "auto twice = [](auto v) constexpr { return 2 * v; }; out[0] = twice(a[0]);",  # constexpr lambda, C++17
])
def test_metal_is_cpp14_so_newer_constructs_are_rejected(construct):
    """MSL is based on C++14: the emulation compiles kernels as -std=c++14 -pedantic-errors, as a Mac would
    refuse them."""
    with pytest.raises(emulation.EmulationError, match=r"(?i)rejected the kernel[\s\S]*c\+\+17"):
        run_small("cpp17", construct, size=1)
    run_small("cpp14", "out[0] = a[0];", size=1)  # the same harness accepts a C++14 kernel


def test_a_barrier_without_mem_threadgroup_does_not_order_threadgroup_memory():
    racy = PREVIOUS_WITHOUT_BARRIER.replace("shared[t] = a[i];\n",
                                            "shared[t] = a[i];\nthreadgroup_barrier(mem_flags::mem_none);\n")
    with pytest.raises(emulation.EmulationError, match="without mem_flags::mem_threadgroup"):
        run_small("previous_mem_none", racy)
    ordered = racy.replace("mem_flags::mem_none", "mem_flags::mem_threadgroup")
    np.testing.assert_array_equal(run_small("previous_mem_threadgroup", ordered), np.r_[0, np.arange(63)])
    # execution-only barriers stay legal where no threadgroup memory was written before them
    assert run_small("mem_none_alone", "threadgroup_barrier(mem_flags::mem_none);\n"
                     "out[thread_position_in_grid.x] = a[thread_position_in_grid.x];")[5] == 5


def test_divergent_simd_collectives_are_refused():
    """On a GPU, simd_sum in each branch reduces over that branch's active lanes; matching the two calls
    as one reduction (as by phase) would be wrong, so the emulation refuses them."""
    divergent = """
uint i = thread_position_in_grid.x;
float total;
if (thread_index_in_simdgroup < 16) {
  total = simd_sum(a[i]);
} else {
  total = simd_sum(2.0f * a[i]);
}
out[i] = total;
"""
    with pytest.raises(emulation.EmulationError, match=r"divergent SIMD collectives.* lines 10 and 12 "):
        run_small("divergent_sum", divergent)
    # one call reached by only some lanes reduces over those lanes, as on a GPU
    partial = """
uint i = thread_position_in_grid.x;
if (thread_index_in_simdgroup >= 16) return;
out[i] = simd_sum(a[i]);
"""
    out = run_small("partial_sum", partial, size=32)
    assert out[0] == sum(range(16))
