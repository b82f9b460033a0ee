"""Every kernel seqlib builds, by name, and the source MLX generates for it.

``mx.fast.metal_kernel`` takes only a kernel's body; MLX writes the signature
(one parameter per input, output and thread-position name the body uses) and
compiles the whole.  :func:`generated_source` shows that whole, as MLX would
compile it for one example instantiation, without a Mac: the same text
:mod:`seqlib.emulation` compiles.
"""

from __future__ import annotations

import mlx.core as mx

from seqlib.emulation import codegen
from seqlib.kernels import bag_kernels, cell_kernels, embedding_kernels, sequence_kernels
from seqlib.kernels.runtime import T, KernelSpec, kernel_header, kernel_source

__all__ = ["KERNEL_SPECS", "generated_source"]

#: Every kernel's :class:`KernelSpec` by kernel name (``"lstm_cell"``, ``"embedding_gather"``, ...).
#:
#: :meta hide-value:
KERNEL_SPECS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (*cell_kernels.SPECS, *sequence_kernels.SPECS, *embedding_kernels.SPECS, *bag_kernels.SPECS)
}

_EXAMPLE_SIZE = 1024  # inputs this large are `device` pointers (MLX puts ones under 8 elements in `constant`)


def generated_source(name: str, dtype: mx.Dtype = mx.float32, **template) -> str:
    """The source MLX compiles for kernel ``name`` (header, signature, body, instantiation).

    dtype: the floating dtype of the call (float32, float16 or bfloat16); template:
    values for the kernel's other template arguments (e.g. ``REVERSE=True``,
    ``MODE=kernels.BagMode.MAX``), each defaulting to the spec's example.
    """
    if name not in KERNEL_SPECS:
        raise ValueError(f"name: no kernel called {name!r}; available: {', '.join(sorted(KERNEL_SPECS))}")
    if dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    spec = KERNEL_SPECS[name]
    known = [key for key, _ in spec.template if key != "T"]
    unknown = sorted(set(template) - set(known))
    if unknown:
        raise ValueError(f"template: {name} takes {known or 'no other arguments'}, got {unknown}")

    def resolve(value):
        return dtype if value is T else value

    values = [(key, resolve(template.get(key, value))) for key, value in spec.template]
    values = [(key, int(value) if isinstance(value, int) and not isinstance(value, bool) else value)
              for key, value in values]  # fmt: skip
    inputs = [
        codegen.InputSpec(input_name, resolve(input_dtype), 0 if input_name in spec.scalars else 1,
                          1 if input_name in spec.scalars else _EXAMPLE_SIZE)
        for input_name, input_dtype in spec.inputs
    ]  # fmt: skip
    output_dtypes = [resolve(output_dtype) for _, output_dtype in spec.outputs]
    return codegen.kernel_text(
        name, kernel_source(name), kernel_header(), inputs, list(spec.output_names), output_dtypes,
        values or None, spec.atomic,
    )  # fmt: skip
