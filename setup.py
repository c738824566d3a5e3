"""Only the compiled part of kvfs; everything else is declared in pyproject.toml.

kvfs/codecs/_entropy.c is a plain C library (no Python API), loaded with ctypes by kvfs/codecs/entropy.py.
It is built as an extension so that `pip install` compiles it with the interpreter's toolchain.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvfs.codecs._entropy", ["kvfs/codecs/_entropy.c"],
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
