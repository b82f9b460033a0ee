"""What the Metal compiler rejects but g++ accepts, checked on the kernel text.

The emulation compiles kernels as C++, so it cannot see these: Metal has no
``double``, no C++ standard library, no variable-length arrays and no
recursion; every pointer must name its address space; and the address-space
words are keywords, so they cannot name variables.  ``lint`` returns one line
per problem (empty: clean).
"""

from __future__ import annotations

import re

ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread")
_KEYWORDS = (*ADDRESS_SPACES, "kernel", "vertex", "fragment")
_TYPES = (
    r"(?:float|half|bfloat|int|uint|short|ushort|char|uchar|bool|long|ulong|T|auto"
    r"|float16_t|bfloat16_t|int32_t|uint32_t|int64_t|uint64_t)"
)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _functions(code: str):
    """(name, parameter text, body) of each function definition in ``code``."""
    for match in re.finditer(r"\b[A-Za-z_][\w:<>]*\s+([A-Za-z_]\w*)\s*\(([^;{}()]*)\)\s*\{", code):
        depth, start = 1, match.end()
        position = start
        while depth and position < len(code):
            depth += {"{": 1, "}": -1}.get(code[position], 0)
            position += 1
        if match.group(1) not in ("if", "for", "while", "switch"):
            yield match.group(1), match.group(2), code[start:position - 1]


def lint(text: str) -> list[str]:
    """What in a kernel's text (body, header or MLX's generated source) the Metal compiler would reject.

    Returns one line per problem, naming it (an empty list: nothing found).
    It is a set of regular expressions, not a parser: it catches the usual
    slips (``double``, ``std::``, variable-length arrays, recursion, pointer
    parameters without an address space, address-space words used as names).
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    code = strip_comments(text)
    problems = []
    if re.search(r"\bdouble\b", code):
        problems.append("double: Metal has no 64-bit floating point")
    if "std::" in code:
        problems.append("std::: Metal has no C++ standard library (use metal:: functions)")
    for match in re.finditer(rf"\b{_TYPES}\s+([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)+)", code):
        for size in re.findall(r"\[([^\]]*)\]", match.group(2)):
            if not re.fullmatch(r"\s*\d+\s*", size):
                problems.append(f"{match.group(1)}[{size}]: array sizes must be integer constants (no VLAs)")
    for match in re.finditer(rf"\b{_TYPES}\s*[&*]?\s+({'|'.join(_KEYWORDS)})\s*[=;,)\[]", code):
        problems.append(f"{match.group(1)}: a Metal keyword cannot name a variable")
    for name, params, body in _functions(code):
        if re.search(rf"\b{name}\s*\(", body):
            problems.append(f"{name}: recursion is not allowed in Metal")
        for param in params.split(","):
            if "*" in param and not any(re.search(rf"\b{space}\b", param) for space in ADDRESS_SPACES):
                problems.append(f"{name}({param.strip()}): a pointer parameter needs an address space")
    return problems
