"""Only the compiled part of kvfs; everything else is declared in pyproject.toml.

kvfs/codecs/_entropy.c (codec 4, versions 1-2) and _classes.c (version 3) are a plain C library (no Python
API), loaded with ctypes by kvfs/codecs/entropy.py. Version 3 codes with huff0, the Huffman coder of zstd,
vendored under kvfs/codecs/huf0 (BSD licence; see the README there). It is built as an extension so that
`pip install` compiles it with the interpreter's toolchain. The source list: kvfs/codecs/kernel_sources.py.

kvfs/frontend/_loop.c is a CPython extension: the native FUSE front end on libfuse 3's low-level API (flags
from pkg-config fuse3; tools/install.sh installs libfuse3-dev and pkg-config). KVFS_ASAN=1 at build time
compiles it with AddressSanitizer (run the daemon with LD_PRELOAD=$(gcc -print-file-name=libasan.so)).
"""

import os
import platform
import runpy
import shlex
import subprocess

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


def pkg_config(*args: str, default: str) -> list[str]:
    try:
        return shlex.split(subprocess.run(["pkg-config", *args, "fuse3"], check=True, capture_output=True,
                                          text=True).stdout)
    except (OSError, subprocess.CalledProcessError):
        return shlex.split(default)


fuse_cflags = pkg_config("--cflags", default="-I/usr/include/fuse3")
fuse_libs = pkg_config("--libs", default="-lfuse3 -lpthread")
asan = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"] if os.environ.get("KVFS_ASAN") == "1" else []
frontend = Extension("kvfs.frontend._loop", ["kvfs/frontend/_loop.c"],
                     include_dirs=[f[2:] for f in fuse_cflags if f.startswith("-I")],
                     extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                         "-Wno-missing-field-initializers",
                                         *[f for f in fuse_cflags if not f.startswith("-I")], *asan],
                     libraries=[f[2:] for f in fuse_libs if f.startswith("-l")],
                     library_dirs=[f[2:] for f in fuse_libs if f.startswith("-L")],
                     extra_link_args=asan)

setup(cmdclass={"build_ext": BuildWithAssembly},
      ext_modules=[Extension("kvfs.codecs._entropy",
                             sources["C_SOURCES"] + ([sources["X86_64_ASM"]] if x86_64 else []),
                             define_macros=[] if x86_64 else [("ZSTD_DISABLE_ASM", "1")],
                             libraries=["m"],
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]),
                   frontend])
