"""Helpers for the chapter notebooks (need IPython; import on demand).

``show_source`` is how every chapter shows the code it discusses: straight from
the installed library, so the page shows exactly what the tests test.
"""

from __future__ import annotations

import inspect

from IPython.display import Code

__all__ = ["show_source"]


def show_source(obj) -> Code:
    """Syntax-highlighted source of a seqlib function, class or method."""
    return Code(inspect.getsource(obj), language="python")
