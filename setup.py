"""Only the compiled part of kvfs; everything else is declared in pyproject.toml.

kvfs/codecs/_entropy.c (codec 4, versions 1-2) and _classes.c (version 3) are a plain C library (no Python
API), loaded with ctypes by kvfs/codecs/entropy.py. Version 3 codes with huff0, the Huffman coder of zstd,
vendored under kvfs/codecs/huf0 (BSD licence; see the README there). It is built as an extension so that
`pip install` compiles it with the interpreter's toolchain. The source list: kvfs/codecs/kernel_sources.py.
"""

import platform
import runpy

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sources = runpy.run_path("kvfs/codecs/kernel_sources.py")
x86_64 = platform.machine() in ("x86_64", "AMD64")


class BuildWithAssembly(build_ext):
    """distutils compiles .S files with the C compiler only when told the suffix is a source."""

    def build_extensions(self):
        if ".S" not in self.compiler.src_extensions:
            self.compiler.src_extensions.append(".S")
        super().build_extensions()


setup(cmdclass={"build_ext": BuildWithAssembly},
      ext_modules=[Extension("kvfs.codecs._entropy",
                             sources["C_SOURCES"] + ([sources["X86_64_ASM"]] if x86_64 else []),
                             define_macros=[] if x86_64 else [("ZSTD_DISABLE_ASM", "1")],
                             libraries=["m"],
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
