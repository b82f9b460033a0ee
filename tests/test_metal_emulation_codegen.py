"""The emulation compiles the very text MLX generates: diffed against MLX's own output.

On Linux MLX cannot run a Metal kernel, but ``mx.export_function`` traces a
call and, with ``verbose=True``, prints the source MLX would compile.  For a
call of every seqlib kernel (recorded while running them in the emulation)
plus probes of the rules (scalars, small inputs in ``constant`` memory, shape
and stride names, template kinds, atomic outputs), MLX's text must equal ours
byte for byte.
"""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from emulated import metal_backend

from seqlib import emulation, kernels

pytestmark = pytest.mark.metal_emulation

MLX_SCRIPT = r"""
import json, os, sys, tempfile
import mlx.core as mx
calls = json.load(sys.stdin)
folder = tempfile.mkdtemp()
def dtype(name):
    name = name.split(".")[-1]
    return mx.bool_ if name == "bool" else getattr(mx, name)
for number, call in enumerate(calls):
    kernel = mx.fast.metal_kernel(
        name=call["name"], input_names=call["input_names"], output_names=call["output_names"],
        source=call["source"], header=call["header"], atomic_outputs=call["atomic_outputs"])
    template = [(k, v if isinstance(v, (bool, int)) else dtype(v)) for k, v in call["template"]]
    def f(*inputs):
        return kernel(inputs=list(inputs), template=template or None, grid=(1, 1, 1), threadgroup=(1, 1, 1),
                      output_shapes=[tuple(s) for s in call["output_shapes"]],
                      output_dtypes=[dtype(d) for d in call["output_dtypes"]], verbose=True)
    args = [mx.zeros(tuple(shape), dtype(name)) for shape, name in call["inputs"]]
    print(f"@@@ {number}", flush=True)
    mx.export_function(os.path.join(folder, f"{number}.mlxfn"), f, *args)
    sys.stdout.flush()
"""


def mlx_texts(calls):
    """MLX's generated source for each call, from its verbose output in a fresh process."""
    result = subprocess.run([sys.executable, "-c", MLX_SCRIPT], input=json.dumps(calls), capture_output=True,
                            text=True, check=True)  # fmt: skip
    texts = {}
    for chunk in result.stdout.split("@@@ ")[1:]:
        number, _, printed = chunk.partition("\n")
        body = printed.split("```\n", 1)[1]
        texts[int(number)] = body[: body.rindex("\n```")]
    return [texts[number] for number in range(len(calls))]


def as_call(launch: emulation.Launch) -> dict:
    """A recorded launch as the JSON the MLX script takes."""
    return {
        "name": launch.name, "input_names": list(launch.input_names), "output_names": list(launch.output_names),
        "source": launch.source, "header": launch.header, "atomic_outputs": launch.atomic_outputs,
        "inputs": [(shape, str(dtype)) for shape, dtype in zip(launch.input_shapes, launch.input_dtypes, strict=True)],
        "template": [(k, v if isinstance(v, (bool, int)) else str(v)) for k, v in launch.template or []],
        "output_shapes": list(launch.output_shapes), "output_dtypes": [str(d) for d in launch.output_dtypes],
        "text": launch.text,
    }  # fmt: skip


def run_every_kernel() -> list[emulation.Launch]:
    """One call of each seqlib kernel, in the emulation, with the arguments seqlib passes."""
    x = mx.ones((3, 8))
    with metal_backend(), emulation.record() as launches:
        kernels.lstm_pointwise(mx.zeros((3, 32)).astype(mx.float16), x.astype(mx.float16))
        kernels.lstm_pointwise_backward(x, x, mx.zeros((3, 32)), x, x)
        kernels.gru_pointwise(mx.zeros((3, 24)), mx.zeros((3, 24)), x)
        kernels.gru_pointwise_backward(x, mx.zeros((3, 24)), mx.zeros((3, 24)), x)
        kernels.rnn_activation(x, "relu")
        kernels.rnn_activation_backward(x, x, "tanh")
        for version in ("simd", "simple"):
            kernels.lstm_sequence_forward(mx.zeros((5, 32)), mx.zeros((32, 8)), x, x, (3, 2), True, version)
        kernels.gru_sequence_forward(mx.zeros((5, 24)), mx.zeros((24, 8)), mx.zeros((24,)), x, (3, 2))
        kernels.embedding(mx.array([1, 2, 3]), mx.ones((10, 8)), padding_idx=2, grad_scale=mx.ones((3,)))
        mx.grad(lambda w: kernels.embedding(mx.array([1, 2, 3]), w, grad_scale=mx.ones((3,))).sum())(mx.ones((10, 8)))
        kernels.embedding_renorm_scales(mx.ones((10, 8)), mx.array([1, 2]), 1.0, 3.0)
        bag = lambda w, p: kernels.embedding_bag(mx.arange(9), w, mx.array([0, 4]), "sum", p, padding_idx=3).sum()
        mx.grad(bag, argnums=(0, 1))(mx.ones((10, 8)), mx.ones((9,)))
        mx.grad(lambda w: kernels.embedding_bag(mx.arange(9), w, mx.array([0, 4]), "max").sum())(mx.ones((10, 8)))
    return launches


def probe_calls():
    """Calls that exercise each rule of the signature (not seqlib kernels)."""
    source = ("uint i = thread_position_in_grid.x + thread_index_in_simdgroup + simdgroup_index_in_threadgroup"
              " + threads_per_simdgroup + threadgroups_per_grid.x + threads_per_grid.x;\n"
              "out[i] = a[i] * b + c[0] + a_shape[0] + a_strides[0] + a_ndim + c_ndim;")  # fmt: skip
    probes = []
    for atomic in (False, True):
        kernel = emulation.metal_kernel("probe", ["a", "b", "c"], ["out", "out2"], source, "// header\n",
                                     atomic_outputs=atomic)  # fmt: skip
        for inputs, template in [
            ([mx.zeros((4,)), mx.array(2.0), mx.zeros((3,), mx.int64)], [("T", mx.float32), ("N", 3), ("F", True)]),
            ([mx.zeros((2, 8)), mx.array(2.0, mx.float16), mx.zeros((9,), mx.uint32)], None),
            ([mx.zeros((8,), mx.bfloat16), mx.zeros((1,)), mx.zeros((7,), mx.bool_)], [("T", mx.bfloat16)]),
        ]:
            output_dtypes = [mx.float16, mx.int32]
            probes.append({
                "name": "probe", "input_names": ["a", "b", "c"], "output_names": ["out", "out2"], "source": source,
                "header": "// header\n", "atomic_outputs": atomic,
                "inputs": [(tuple(a.shape), str(a.dtype)) for a in inputs],
                "template": [(k, v if isinstance(v, (bool, int)) else str(v)) for k, v in template or []],
                "output_shapes": [(8,), (2,)], "output_dtypes": [str(d) for d in output_dtypes],
                "text": kernel.text(inputs, output_dtypes, template),
            })  # fmt: skip
    return probes


def test_the_emulation_compiles_exactly_the_source_mlx_generates():
    recorded = {}
    for launch in run_every_kernel():
        call = as_call(launch)
        recorded[call["name"], json.dumps(call["template"]), call["atomic_outputs"]] = call
    calls = list(recorded.values()) + probe_calls()
    assert {call["name"] for call in calls} >= set(kernels.kernel_names())  # every kernel is covered
    for call, theirs in zip(calls, mlx_texts(calls), strict=True):
        assert call["text"] == theirs, f"{call['name']}: our signature differs from MLX's"


def test_the_diff_would_see_a_one_character_difference():
    call = probe_calls()[0]
    altered = dict(call, text=call["text"].replace("[[buffer(1)]]", "[[buffer(2)]]"))
    assert altered["text"] != call["text"]
    assert altered["text"] != mlx_texts([call])[0] == call["text"]
