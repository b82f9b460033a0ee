"""Sphinx extension for the API reference (book/api/): constants re-exported by a package.

A constant's documentation is its ``#:`` comment (Sphinx's convention for data), which
autodoc reads only from the module being documented.  ``seqlib.kernels`` re-exports
``BACKENDS`` and friends from its submodules, where their comments are; this looks the
comment up in the submodule that defines the same object, so ``automodule::
seqlib.kernels`` documents them under their public name.  ``tests/test_docstrings.py``
uses :func:`constant_comment` to require such a comment for every public constant.
"""

from __future__ import annotations

import sys

from sphinx.ext.autodoc import ModuleDocumenter
from sphinx.pycode import ModuleAnalyzer
from sphinx.errors import PycodeError

_MISSING = object()


def constant_comment(modname: str, attrname: str) -> list[str]:
    """The ``#:`` comment lines of ``modname.attrname``, read where that object is assigned.

    Looks in ``modname`` itself, then in every imported submodule of it whose
    ``attrname`` is the same object; ``[]`` if none has a comment.
    """
    module = sys.modules.get(modname)
    value = getattr(module, attrname, _MISSING)
    candidates = [modname, *sorted(name for name in sys.modules if name.startswith(modname + "."))]
    for candidate in candidates:
        if getattr(sys.modules.get(candidate), attrname, _MISSING) is not value:
            continue
        try:
            analyzer = ModuleAnalyzer.for_module(candidate)
            analyzer.analyze()
        except PycodeError:
            continue
        lines = analyzer.attr_docs.get(("", attrname))
        if lines:
            return list(lines)
    return []


_module_members = ModuleDocumenter.get_module_members


def _get_module_members(self):
    """Autodoc's members of a module, with the comments of re-exported constants added to its analyzer.

    Autodoc documents a module-level name as data only if the module's analyzer has a comment for
    it (``attr_docs``); giving the analyzer the comment from the defining submodule makes the
    constant documented, under the name the package exports it by.
    """
    if self.analyzer is not None:
        attr_docs = self.analyzer.find_attr_docs()
        for name in getattr(self.object, "__all__", []):
            value = getattr(self.object, name, None)
            if ("", name) in attr_docs or callable(value) or isinstance(value, type(sys)):
                continue
            comment = constant_comment(self.modname, name)
            if comment:
                attr_docs["", name] = comment
    return _module_members(self)


def setup(app):
    ModuleDocumenter.get_module_members = _get_module_members
    return {"parallel_read_safe": True, "parallel_write_safe": True}
