"""The source text MLX wraps around a kernel body, generated here exactly as MLX does.

``mx.fast.metal_kernel`` takes only the *body* of a kernel and writes the
signature itself: one parameter per input (plus ``<name>_shape``,
``<name>_strides``, ``<name>_ndim`` where the body mentions them), one per
output, and one per special thread-position name the body mentions.  The
emulation compiles this same text as C++, so it must be the same text (the
test suite's ``test_metal_emulation_codegen.py`` diffs it against what MLX
itself prints for every seqlib kernel and for probes of each rule below).

Rules (read off MLX 0.32.4's output):
- inputs with no dimensions are ``const constant T& name``; inputs with fewer
  than 8 elements live in the ``constant`` address space, larger ones in
  ``device``;
- the special names are found by substring search of the body and listed in
  alphabetical order;
- the function name is ``custom_kernel_<name>``, then ``_`` and one ``_<value>``
  per template argument (if any), one ``_<dtype>`` per input (suffixed ``c``
  for a ``constant`` pointer and ``s`` for a scalar) and one ``_<dtype>`` per output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

# The thread-position names MLX recognises that seqlib's kernels may use, with
# their types, in the (alphabetical) order MLX lists them.
ATTRIBUTES = {
    "simdgroup_index_in_threadgroup": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}

DTYPE_NAMES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.bool_: "bool",
}

CONSTANT_SIZE_LIMIT = 8  # inputs with fewer elements are passed in `constant` memory


@dataclass(frozen=True)
class InputSpec:
    """What the signature needs to know about one input array."""

    name: str
    dtype: mx.Dtype
    ndim: int
    size: int

    @property
    def is_scalar(self) -> bool:
        return self.ndim == 0

    @property
    def is_constant(self) -> bool:
        return self.size < CONSTANT_SIZE_LIMIT


def template_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return DTYPE_NAMES[value]


def template_declaration(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return "typename"


def function_name(name: str, inputs: list[InputSpec], output_dtypes, template) -> str:
    text = f"custom_kernel_{name}"
    if template:
        text += "_" + "".join(f"_{template_value(value)}" for _, value in template)
    for spec in inputs:
        suffix = "s" if spec.is_scalar else "c" if spec.is_constant else ""
        text += f"_{DTYPE_NAMES[spec.dtype]}{suffix}"
    for dtype in output_dtypes:
        text += f"_{DTYPE_NAMES[dtype]}"
    return text


def shape_uses(source: str, name: str) -> tuple[bool, bool, bool]:
    """Whether the body mentions ``name_shape``, ``name_strides``, ``name_ndim``."""
    return (f"{name}_shape" in source, f"{name}_strides" in source, f"{name}_ndim" in source)


def used_attributes(source: str) -> list[str]:
    return [attribute for attribute in ATTRIBUTES if attribute in source]


def parameters(source: str, inputs: list[InputSpec], output_names, output_dtypes, atomic_outputs: bool) -> list[str]:
    params, index = [], 0
    for spec in inputs:
        type_name = DTYPE_NAMES[spec.dtype]
        if spec.is_scalar:
            params.append(f"const constant {type_name}& {spec.name} [[buffer({index})]]")
        else:
            space = "constant" if spec.is_constant else "device"
            params.append(f"const {space} {type_name}* {spec.name} [[buffer({index})]]")
        index += 1
        if spec.ndim > 0:
            uses_shape, uses_strides, uses_ndim = shape_uses(source, spec.name)
            if uses_shape:
                params.append(f"const constant int* {spec.name}_shape [[buffer({index})]]")
                index += 1
            if uses_strides:
                params.append(f"const constant int64_t* {spec.name}_strides [[buffer({index})]]")
                index += 1
            if uses_ndim:
                params.append(f"const constant int& {spec.name}_ndim [[buffer({index})]]")
                index += 1
    for name, dtype in zip(output_names, output_dtypes, strict=True):
        type_name = DTYPE_NAMES[dtype]
        if atomic_outputs:
            params.append(f"device atomic<{type_name}>* {name} [[buffer({index})]]")
        else:
            params.append(f"device {type_name}* {name} [[buffer({index})]]")
        index += 1
    for attribute in used_attributes(source):
        params.append(f"{ATTRIBUTES[attribute]} {attribute} [[{attribute}]]")
    return params


def kernel_text(
    name: str,
    source: str,
    header: str,
    inputs: list[InputSpec],
    output_names: list[str],
    output_dtypes: list,
    template: list | None,
    atomic_outputs: bool,
) -> str:
    """The text MLX generates (and prints with ``verbose=True``) for one call of a kernel."""
    function = function_name(name, inputs, output_dtypes, template)
    text = header
    if template:
        declared = ", ".join(f"{template_declaration(value)} {key}" for key, value in template)
        text += f"template <{declared}>\n"
    params = parameters(source, inputs, output_names, output_dtypes, atomic_outputs)
    text += f"[[kernel]] void {function}(\n  " + ",\n  ".join(params) + ") {\n"
    text += source + "\n}\n"
    if template:
        arguments = ", ".join(template_value(value) for _, value in template)
        instance = f"{function}<{arguments}>"
        text += f'\ntemplate [[host_name("{function}")]] [[kernel]] decltype({instance}) {instance};\n'
    return text


# ----------------------------------------------------------------- from MLX's text to g++'s

_THREADGROUP_DECLARATION = re.compile(r"\bthreadgroup\s+([A-Za-z_][\w:<>]*)\s+([A-Za-z_]\w*)((?:\s*\[[^\]]+\])+)\s*;")
_INSTANTIATION = re.compile(r"^template \[\[host_name\(.*$", re.MULTILINE)


def rewrite_threadgroup_declarations(text: str) -> str:
    """``threadgroup float buf[2][64];`` -> a reference to storage shared by the group.

    Each declaration gets its own block (keyed by its position in the text), so
    every thread of a group that reaches it sees the same memory, as on the GPU.
    """
    counter = iter(range(10**6))

    def replace(match: re.Match) -> str:
        type_name, variable, dims = match.group(1), match.group(2), match.group(3).replace(" ", "")
        return f"auto& {variable} = *emu::threadgroup_array<{type_name}{dims}>({next(counter)});"

    return _THREADGROUP_DECLARATION.sub(replace, text)


def emulation_source(
    text: str,
    function: str,
    template: list | None,
    param_kinds: list[tuple[str, str]],
    attributes: list[str],
    uses_fibers: bool,
) -> str:
    """Turn MLX's text into a C++ translation unit with an ``extern "C"`` launcher.

    param_kinds: for each buffer, (C element type with its const, "pointer" or "reference"), in buffer order.
    """
    body = rewrite_threadgroup_declarations(_INSTANTIATION.sub("", text))
    instance = function
    if template:
        instance += "<" + ", ".join(template_value(value) for _, value in template) + ">"
    arguments = []
    for index, (c_type, kind) in enumerate(param_kinds):
        if kind == "reference":
            arguments.append(f"*static_cast<{c_type}*>(buffers[{index}])")
        else:
            arguments.append(f"static_cast<{c_type}*>(buffers[{index}])")
    arguments += [f"ids.{attribute}" for attribute in attributes]
    joined = ",\n      ".join(arguments)
    return f"""#include "metal_emulation.h"

{body}

extern "C" int emu_launch(void** buffers, const unsigned* grid, const unsigned* group, int order,
                          unsigned seed, emu::Instruments* instruments, char* message, int message_size) {{
  emu::Body body = [](const emu::ThreadIds& ids, void** buffers) {{
    (void)ids;
    {instance}(
      {joined});
  }};
  return emu::launch(body, buffers, grid, group, order, seed, {"true" if uses_fibers else "false"},
                     instruments, message, message_size);
}}
"""
