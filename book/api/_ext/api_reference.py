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

from sphinx.ext.autodoc import DataDocumenter, ModuleDocumenter, ObjectMember
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
    candidates = [modname] + sorted(name for name in sys.modules if name.startswith(modname + "."))
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


_data_module_comment = DataDocumenter.get_module_comment
_module_members = ModuleDocumenter.get_module_members


def _get_module_comment(self, attrname):
    return _data_module_comment(self, attrname) or constant_comment(self.modname, attrname) or None


def _get_module_members(self):
    members = _module_members(self)
    for name, member in members.items():
        if not member.docstring and not callable(member.object) and not isinstance(member.object, type(sys)):
            comment = constant_comment(self.modname, name)
            if comment:
                members[name] = ObjectMember(name, member.object, docstring="\n".join(comment))
    return members


def setup(app):
    DataDocumenter.get_module_comment = _get_module_comment
    ModuleDocumenter.get_module_members = _get_module_members
    return {"parallel_read_safe": True, "parallel_write_safe": True}
