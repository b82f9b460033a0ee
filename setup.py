"""Builds seqlib's native code when the package is installed: the BLAS shim (C) and the C++ primitives.

Everything else is in pyproject.toml.  The build runs seqlib/_build.py's build_at_install (loaded by its
path: seqlib itself is not importable before it is installed) against the MLX, nanobind and
scipy-openblas32 of the build environment (pyproject's build-system requires).  Where it cannot build
(no compiler), the install still succeeds and seqlib builds on first use, or runs the MLX-ops path.
"""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _build_module():
    spec = importlib.util.spec_from_file_location("seqlib_build", ROOT / "seqlib" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildNative(build_ext):
    """Compiles with seqlib's own build rules (one place decides how seqlib's C and C++ are built)."""

    def build_extension(self, extension):
        if sys.platform != "linux":  # macOS: MLX runs seqlib's Metal kernels; nothing native to build
            return
        package_dir = Path(self.get_ext_fullpath(extension.name)).parent.parent  # .../seqlib
        package_dir.joinpath("native").mkdir(parents=True, exist_ok=True)
        for line in _build_module().build_at_install(package_dir):
            print(f"seqlib: {line}", file=sys.stderr)

    def _companions(self):
        """(built, in the source tree) for what is built beside the extension: the shim and the keys."""
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        names = ("_blas_shim.so", "_blas_shim.so.key", f"native/_seqlib_cpu{suffix}.key")
        return [(Path(self.build_lib) / "seqlib" / name, ROOT / "seqlib" / name) for name in names]

    def copy_extensions_to_source(self):  # an editable install (pip install -e .)
        super().copy_extensions_to_source()
        for built, in_place in self._companions():
            if built.exists():
                self.copy_file(str(built), str(in_place), level=self.verbose)

    def _get_output_mapping(self):
        yield from super()._get_output_mapping()
        if self.inplace:
            yield from ((str(built), str(in_place)) for built, in_place in self._companions() if built.exists())

    def get_outputs(self):
        outputs = super().get_outputs()
        if not self.inplace:
            outputs += [str(built) for built, _ in self._companions() if built.exists()]
        return outputs


setup(
    ext_modules=[Extension("seqlib.native._seqlib_cpu", sources=[])],
    cmdclass={"build_ext": BuildNative},
)
