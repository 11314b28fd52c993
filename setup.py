"""Builds libcolibri (libcolibri/src/*.c) into colibrid/_libcolibri*.so.

The library is a plain C shared object loaded with ctypes by colibrid/native/; it is
declared as an Extension only so that setuptools compiles it for both `pip install .` and
`pip install -e .` and puts it inside the colibrid package. Everything else about the package
is in pyproject.toml.
"""

import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import PlatformError

HERE = os.path.dirname(os.path.abspath(__file__))
NO_COMPILER = "colibri needs a C compiler (cc/gcc) to build libcolibri: apt-get install gcc"


def _relative(pattern):
    # setuptools wants source paths relative to the project root
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


class BuildLibcolibri(build_ext):
    """build_ext for a ctypes library: fail in one line when there is no C compiler, and do
    not require (or export) a PyInit_ function."""

    def build_extensions(self):
        compiler_cmd = getattr(self.compiler, "compiler_so", None) or ["cc"]
        if shutil.which(compiler_cmd[0]) is None:
            raise PlatformError(NO_COMPILER)
        super().build_extensions()

    def get_export_symbols(self, ext):
        return ext.export_symbols  # no PyInit_<name>: this is not a Python module


libcolibri = Extension(
    "colibrid._libcolibri",
    sources=_relative("libcolibri/src/*.c"),
    depends=_relative("libcolibri/src/*.h") + _relative("libcolibri/include/*.h"),
    include_dirs=["libcolibri/include"],
    libraries=["m", "pthread"],
    extra_compile_args=[
        "-O2",
        "-std=c11",
        "-fvisibility=hidden",   # only COL_API symbols are exported
        "-ffp-contract=off",     # no silent FMA: results must not depend on the build
        "-Wall",
        "-Wextra",
    ],
)

setup(ext_modules=[libcolibri], cmdclass={"build_ext": BuildLibcolibri})
