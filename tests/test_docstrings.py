"""Every public name of seqlib is documented, and the book's links into the API reference resolve.

Public means: the modules reachable from ``seqlib.__all__`` (recursively through each module's
``__all__``), every name in their ``__all__``, and the public methods and properties of those
classes that seqlib itself defines (not those inherited from MLX).  The API reference
(``book/api/*.md``) documents them with autodoc; this test checks, without building the book, that

- every public function, class, method and module has a docstring that says something (not a
  stub, not the one ``NamedTuple`` writes), and every public constant a ``#:`` doc comment;
- every public name has an entry on a reference page (``.. autofunction::``, ``.. autoclass::``...),
  so a new name cannot be left out of the reference;
- every ``{py:func}`/``{py:class}``... role in the chapters and front matter names an object
  that exists and that the reference documents, so a chapter's link cannot silently break.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

import seqlib

ROOT = Path(__file__).resolve().parents[1]
API_PAGES = sorted((ROOT / "book" / "api").glob("*.md"))
BOOK_TEXTS = sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.md"))
ROLE = re.compile(r"\{py:(func|class|meth|mod|data|attr|obj|exc)\}`([^`]+)`")
DIRECTIVE = re.compile(r"^\.\. (auto\w+|currentmodule|py:currentmodule)::\s*(\S+)\s*$")
NAMEDTUPLE_DOC = re.compile(r"^\w+\([\w, ]*\)$")  # what NamedTuple writes when a class has no docstring
MIN_WORDS = 5


def public_modules() -> dict[str, ModuleType]:
    """seqlib and every module reachable through ``__all__``, by name."""
    found: dict[str, ModuleType] = {}
    todo = [seqlib]
    while todo:
        module = todo.pop()
        if module.__name__ in found:
            continue
        found[module.__name__] = module
        for name in getattr(module, "__all__", []):
            value = getattr(module, name)
            if inspect.ismodule(value) and value.__name__.startswith("seqlib"):
                todo.append(value)
    return found


MODULES = public_modules()


def public_names() -> list[tuple[str, str, object]]:
    """(module name, name, object) for every non-module name in a public module's ``__all__``."""
    return [
        (modname, name, getattr(module, name))
        for modname, module in sorted(MODULES.items())
        for name in module.__all__
        if not inspect.ismodule(getattr(module, name)) and not (name.startswith("__") and name.endswith("__"))
    ]


def is_constant(value) -> bool:
    return not (inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value))


def defining_class(cls: type, name: str) -> type:
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def public_methods(cls: type) -> dict[str, object]:
    """Public methods and properties of ``cls`` that a seqlib class defines (MLX's and object's are not ours)."""
    methods = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = defining_class(cls, name)
        member = vars(owner)[name]
        if not owner.__module__.startswith("seqlib") or name in getattr(owner, "_fields", ()):
            continue  # a NamedTuple's fields are documented by #: comments, checked with the class
        if isinstance(member, (staticmethod, classmethod, property)) or inspect.isfunction(member):
            methods[name] = getattr(cls, name) if not isinstance(member, property) else member
    return methods


PUBLIC_NAMES = public_names()
PUBLIC_CLASSES = {id(obj): obj for _, _, obj in PUBLIC_NAMES if inspect.isclass(obj)}
PUBLIC_METHODS = [
    (f"{cls.__module__}.{cls.__qualname__}.{name}", member)
    for cls in PUBLIC_CLASSES.values()
    for name, member in sorted(public_methods(cls).items())
]


def says_something(doc: str | None) -> bool:
    return bool(doc) and not NAMEDTUPLE_DOC.match(doc.strip()) and len(doc.split()) >= MIN_WORDS


def own_docstring(obj) -> str | None:
    """A class's own docstring (``inspect.getdoc`` would fall back to a base class's); a function's docstring."""
    if inspect.isclass(obj):
        return inspect.cleandoc(vars(obj)["__doc__"]) if isinstance(vars(obj).get("__doc__"), str) else None
    return inspect.getdoc(obj)


def constant_comment(modname: str, name: str) -> list[str]:
    sys.path.insert(0, str(ROOT / "book" / "api" / "_ext"))
    try:
        from api_reference import constant_comment as lookup
    finally:
        sys.path.pop(0)
    return lookup(modname, name)


def test_the_public_api_is_what_the_reference_covers():
    """The walk finds the modules the issue names (a broken __all__ would hide a whole module)."""
    for name in ("seqlib.nn", "seqlib.nn.utils.rnn", "seqlib.functional", "seqlib.sparse", "seqlib.optim",
                 "seqlib.interop", "seqlib.kernels", "seqlib.emulation", "seqlib.data"):  # fmt: skip
        assert name in MODULES, f"{name} is not reachable through seqlib.__all__"
    assert len(PUBLIC_NAMES) > 100 and len(PUBLIC_METHODS) > 20


@pytest.mark.parametrize("modname", sorted(MODULES))
def test_public_module_has_a_docstring_and_an_all(modname):
    module = MODULES[modname]
    assert isinstance(getattr(module, "__all__", None), list), f"{modname} has no __all__ list"
    assert says_something(module.__doc__), f"{modname}: no module docstring"


@pytest.mark.parametrize(("modname", "name", "obj"), PUBLIC_NAMES, ids=[f"{m}.{n}" for m, n, _ in PUBLIC_NAMES])
def test_public_name_has_a_docstring(modname, name, obj):
    if is_constant(obj):
        comment = constant_comment(modname, name)
        assert says_something(" ".join(comment)), f"{modname}.{name}: a constant needs a '#:' doc comment"
    else:
        assert says_something(own_docstring(obj)), f"{modname}.{name}: no docstring (or a trivial one)"
    if inspect.isclass(obj) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
        for field in obj._fields:
            comment = constant_comment(obj.__module__, field) or _field_comment(obj, field)
            assert says_something(" ".join(comment)), f"{modname}.{name}.{field}: a field needs a '#:' comment"


def _field_comment(cls: type, field: str) -> list[str]:
    from sphinx.pycode import ModuleAnalyzer

    analyzer = ModuleAnalyzer.for_module(cls.__module__)
    analyzer.analyze()
    return list(analyzer.attr_docs.get((cls.__qualname__, field), []))


@pytest.mark.parametrize(("qualname", "member"), PUBLIC_METHODS, ids=[q for q, _ in PUBLIC_METHODS])
def test_public_method_has_a_docstring(qualname, member):
    doc = member.__doc__ if isinstance(member, property) else inspect.getdoc(member)
    assert says_something(doc), f"{qualname}: no docstring (or a trivial one)"


# ----------------------------------------------------------------------------- the reference pages


def documented_objects() -> dict[str, object]:
    """Full name -> object for every entry the reference pages make (autodoc directives and their members)."""
    entries: dict[str, object] = {}
    for page in API_PAGES:
        current = None
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            match = DIRECTIVE.match(line.strip())
            if not match:
                continue
            kind, target = match.groups()
            options = directive_options(lines, number)
            if kind in ("automodule", "currentmodule", "py:currentmodule"):
                current = target
                module = entries[target] = importlib.import_module(target)
                if kind == "automodule" and "members" in options:  # every name of __all__, or those listed
                    names = [n.strip() for n in options["members"].split(",") if n.strip()] or module.__all__
                    for name in names:
                        if not inspect.ismodule(getattr(module, name)):
                            add_entry(entries, f"{target}.{name}", getattr(module, name), options)
                continue
            fullname = target if target.startswith("seqlib") else f"{current}.{target}"
            add_entry(entries, fullname, resolve(fullname), options)
    return entries


def directive_options(lines: list[str], number: int) -> dict[str, str]:
    """The ``:name: value`` lines under the directive on line ``number``."""
    options = {}
    for line in lines[number + 1 :]:
        option = re.match(r"^\s+:([\w-]+):\s*(.*)$", line)
        if not option:
            break
        options[option.group(1)] = option.group(2)
    return options


def add_entry(entries: dict[str, object], fullname: str, obj, options: dict[str, str]) -> None:
    """The entry and, for a class documented with ``:members:``, the methods autodoc lists with it.

    A page may leave out a method that only implements a base class's hook (``:exclude-members:``,
    e.g. the optimizers' ``apply_single``, whose contract is MLX's); it is recorded in ``EXCLUDED``.
    """
    entries[fullname] = obj
    excluded = {name.strip() for name in options.get("exclude-members", "").split(",") if name.strip()}
    if inspect.isclass(obj) and "members" in options:
        for name, member in public_methods(obj).items():
            if name in excluded:
                EXCLUDED.add(f"{fullname}.{name}")
            elif "inherited-members" in options or name in vars(obj):
                entries[f"{fullname}.{name}"] = member


EXCLUDED: set[str] = set()


def resolve(fullname: str):
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = fullname.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(fullname)


DOCUMENTED = documented_objects()


def test_reference_pages_exist():
    assert len(API_PAGES) >= 10, "book/api/ holds the API reference pages"
    toc = (ROOT / "_toc.yml").read_text()
    for page in API_PAGES:
        assert f"book/api/{page.stem}" in toc, f"{page.name} is not in _toc.yml (the build would warn)"


@pytest.mark.parametrize("modname", sorted(MODULES))
def test_every_public_module_has_a_page(modname):
    assert modname in DOCUMENTED or modname == "seqlib.nn.utils", f"no '.. automodule:: {modname}' in book/api/"


@pytest.mark.parametrize(("modname", "name", "obj"), PUBLIC_NAMES, ids=[f"{m}.{n}" for m, n, _ in PUBLIC_NAMES])
def test_every_public_name_has_a_reference_entry(modname, name, obj):
    """Under its own module's name or, for a re-export such as seqlib.Embedding, under the module that defines it."""
    if f"{modname}.{name}" in DOCUMENTED:
        return
    assert not is_constant(obj), f"{modname}.{name}: no entry in book/api/"
    assert any(value is obj for value in DOCUMENTED.values()), f"{modname}.{name}: no entry in book/api/"


@pytest.mark.parametrize(("qualname", "member"), PUBLIC_METHODS, ids=[q for q, _ in PUBLIC_METHODS])
def test_every_public_method_has_a_reference_entry(qualname, member):
    modname, classname, method = qualname.rsplit(".", 2)
    owners = [name for name, obj in DOCUMENTED.items()
              if inspect.isclass(obj) and obj.__qualname__ == classname and obj.__module__ == modname]  # fmt: skip
    entries = [f"{owner}.{method}" for owner in owners]
    listed = all(entry in DOCUMENTED or entry in EXCLUDED for entry in entries)
    assert owners and listed, f"{qualname}: not in book/api/"


# ----------------------------------------------------------------------------- links from the chapters


def roles_in_book() -> list[tuple[str, str, str]]:
    """(file, role, target) for every py-domain role in the chapters' Markdown cells and book/*.md."""
    found = []
    for path in BOOK_TEXTS:
        if path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            text = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
        else:
            text = path.read_text()
        for role, target in ROLE.findall(text):
            target = target.split("<")[-1].rstrip(">").strip() if "<" in target else target
            found.append((path.name, role, target.lstrip("~!")))
    return found


ROLES = roles_in_book()


@pytest.mark.parametrize(("page", "role", "target"), ROLES, ids=[f"{p}:{t}" for p, _, t in ROLES] or None)
def test_book_role_names_a_documented_object(page, role, target):
    """A chapter's {py:class}`seqlib.nn.LSTM` must name an entry of the reference, by its full name."""
    obj = resolve(target)  # raises if it names nothing
    assert target in DOCUMENTED, f"{page}: {{py:{role}}}`{target}` names no entry of the API reference (book/api/)"
    assert DOCUMENTED[target] is obj or isinstance(obj, property)
