"""The codec kernel: one plain C library (no Python API, sources in kernel_sources.py), loaded with ctypes,
which releases the GIL while a kernel function runs.

- codec 4 (`entropy`, entropy.py): kvec_encode, kvec_encode_version, kvec_decode;
- codec 5 (`entropy8`, entropy8.py): kf8_encode, kf8_decode;
- XXH3-64 of large buffers (format.xxh3): kvfs_xxh3_64;
- whole runs of frames of an object read and decoded in one call (kvfs.direct): kvfs_read_frames, which
  decodes zstd frames with the system's libzstd when one is found (kvfs_use_zstd), and leaves them to
  Python otherwise;
- frames encoded as format.encode_frame does, and a codec chosen from a frame's sample as EncodingPolicy._choose
  does (_encode.c: kvfs_encode_frame, kvfs_choose), for the native front end's writers (kvfs/frontend/_loop.c);
  zstd frames with the system's libzstd (kvfs_use_zstd_compress), else none.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.machinery
import pathlib

# kvfs_read_frames' results (_object.c)
READ_OK, ERR_IO, ERR_SHORT, ERR_PAYLOAD, ERR_DECODE, ERR_RAW, UNSUPPORTED, ERR_NOMEM, ERR_ARGS = range(0, -9, -1)


def _load() -> ctypes.CDLL:
    here = pathlib.Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_entropy{suffix}"
        if path.exists():
            return _declare(ctypes.CDLL(str(path), use_errno=True))
    raise ImportError(f"the entropy codec kernel is not built in {here}: run `pip install -e .` "
                      "(needs a C compiler)")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.kvec_encode.restype = ctypes.c_int64
    lib.kvec_encode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_size_t]
    lib.kvec_encode_version.restype = ctypes.c_int64
    lib.kvec_encode_version.argtypes = lib.kvec_encode.argtypes + [ctypes.c_int]
    lib.kvec_decode.restype = ctypes.c_int
    lib.kvec_decode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    lib.kf8_encode.restype = ctypes.c_int64
    lib.kf8_encode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    lib.kf8_encode_k.restype = ctypes.c_int64
    lib.kf8_encode_k.argtypes = lib.kf8_encode.argtypes + [ctypes.c_int]
    lib.kf8_decode.restype = ctypes.c_int
    lib.kf8_decode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    lib.kvfs_xxh3_64.restype = ctypes.c_uint64
    lib.kvfs_xxh3_64.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.kvfs_read_frames.restype = ctypes.c_int
    lib.kvfs_read_frames.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                     ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64)]
    lib.kvfs_use_zstd.restype = None
    lib.kvfs_use_zstd.argtypes = [ctypes.c_void_p]
    lib.kvfs_use_zstd_compress.restype = None
    lib.kvfs_use_zstd_compress.argtypes = [ctypes.c_void_p] * 5
    lib.kvfs_encode_supported.restype = ctypes.c_int
    lib.kvfs_encode_supported.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.kvfs_encode_bound.restype = ctypes.c_size_t
    lib.kvfs_encode_bound.argtypes = [ctypes.c_size_t]
    lib.kvfs_encode_frame.restype = ctypes.c_int
    lib.kvfs_encode_frame.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.kvfs_choose.restype = ctypes.c_int
    lib.kvfs_choose.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def _system_zstd() -> ctypes.CDLL | None:
    """The system's libzstd (Debian: libzstd1, which apt itself needs), or None."""
    for name in (ctypes.util.find_library("zstd"), "libzstd.so.1"):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    return None


lib = _load()
_zstd = _system_zstd()  # kept referenced: the kernel holds a pointer into it
if _zstd is not None:
    lib.kvfs_use_zstd(ctypes.cast(_zstd.ZSTD_decompress, ctypes.c_void_p))
    try:
        lib.kvfs_use_zstd_compress(*(ctypes.cast(getattr(_zstd, name), ctypes.c_void_p) for name in (
            "ZSTD_createCCtx", "ZSTD_freeCCtx", "ZSTD_CCtx_setParameter", "ZSTD_compress2", "ZSTD_isError")))
    except AttributeError:  # a libzstd older than 1.4 (no advanced API): zstd frames are encoded in Python
        pass
ZSTD_IN_KERNEL = _zstd is not None
