"""Codec `qat`: deflate through Intel QATzip (libqatzip.so.3, via ctypes) — the QAT hardware when a device
exists, QATzip's software fallback otherwise. The bitstream is codecs/deflate.py's: frames written here
decode with ISA-L or Python's gzip, and QATzip decodes frames ISA-L wrote.

The library is found, in order: KVFS_QATZIP_LIB (a path to libqatzip.so.3) when set; the project-local
prefix filled by tools/install_qatzip.sh (<venv>/opt/qatzip); the system (Debian 13 / Ubuntu 24.04:
apt install libqatzip3). Struct layouts and constants follow qatzip.h (API 2.5, QATzip 1.3.1).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import os
import sys
import threading
from pathlib import Path

from . import register
from .base import CodecError
from .deflate import DeflateCodec, decompress_members

log = logging.getLogger(__name__)

ENV_LIB = "KVFS_QATZIP_LIB"
LOCAL_PREFIX = Path(sys.prefix) / "opt" / "qatzip"
LIB_SUBDIR = "usr/lib/x86_64-linux-gnu"
SONAME = "libqatzip.so.3"
DEPENDENCIES = ("libusdm.so.0", "libqat.so.4")  # loaded first, globally, when they sit beside the library

QZ_OK, QZ_DUPLICATE = 0, 1
QZ_NOSW_NO_HW = -101
SW_BACKUP_ALLOWED = 1
DIR_BOTH = 2
DATA_FMT_GZIP_EXT = 2  # gzip members with the 'QZ' extra field: codecs/deflate.py's format
HUFFMAN_DYNAMIC = 0
HW_BUFF_SZ = 64 << 10  # QAT request size: members of 64 KiB of input
LEVEL = 1
# Without a device, QATzip 1.3.1 re-runs qzInit on every request, and each run creates a pthread key
# (async_req_key) before it finds no device, never deleting it: one leaked key per request, and a process
# has PTHREAD_KEYS_MAX = 1024. So in software mode QATzip gets this many calls; after that the same format
# is written by ISA-L (frames then say codec deflate). Measured: ~1020 requests exhaust a process.
SOFTWARE_CALL_BUDGET = 256


class QatUnavailable(RuntimeError):
    """libqatzip cannot be found or loaded; the message says how to get it."""


class Session(ctypes.Structure):  # QzSession_T, 40 bytes
    _fields_ = [("hw_session_stat", ctypes.c_long), ("thd_sess_stat", ctypes.c_int),
                ("internal", ctypes.c_void_p), ("total_in", ctypes.c_ulong), ("total_out", ctypes.c_ulong)]


class ParamsCommon(ctypes.Structure):  # QzSessionParamsCommon_T, 48 bytes
    _fields_ = [("direction", ctypes.c_int), ("comp_lvl", ctypes.c_uint), ("comp_algorithm", ctypes.c_ubyte),
                ("max_forks", ctypes.c_uint), ("sw_backup", ctypes.c_ubyte), ("hw_buff_sz", ctypes.c_uint),
                ("strm_buff_sz", ctypes.c_uint), ("input_sz_thrshold", ctypes.c_uint),
                ("req_cnt_thrshold", ctypes.c_uint), ("wait_cnt_thrshold", ctypes.c_uint),
                ("polling_mode", ctypes.c_int), ("is_sensitive_mode", ctypes.c_uint)]


class ParamsDeflate(ctypes.Structure):  # QzSessionParamsDeflate_T, 56 bytes
    _fields_ = [("common", ParamsCommon), ("huffman_hdr", ctypes.c_int), ("data_fmt", ctypes.c_int)]


assert (ctypes.sizeof(Session), ctypes.sizeof(ParamsCommon), ctypes.sizeof(ParamsDeflate)) == (40, 48, 56)


@dataclasses.dataclass
class QatLibrary:
    path: str
    lib: ctypes.CDLL


def candidates() -> list[str]:
    explicit = os.environ.get(ENV_LIB)
    if explicit:
        return [explicit]  # an explicit choice is the only one: no silent fallback to another library
    found = [str(LOCAL_PREFIX / LIB_SUBDIR / SONAME)]
    system = ctypes.util.find_library("qatzip")
    return [*found, system or SONAME]


def load() -> QatLibrary:
    errors = []
    for path in candidates():
        if "/" in path and not Path(path).exists():
            errors.append(f"{path}: not found")
            continue
        try:
            for dep in DEPENDENCIES:
                beside = Path(path).parent / dep
                if "/" in path and beside.exists():
                    ctypes.CDLL(str(beside), mode=ctypes.RTLD_GLOBAL)
            return QatLibrary(path, _declare(ctypes.CDLL(path)))
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise QatUnavailable("codec qat needs Intel QATzip (libqatzip.so.3), which was not found ("
                         + "; ".join(errors) + "). Install it with tools/install_qatzip.sh (Debian 12), "
                         "'apt install libqatzip3' (Debian 13, Ubuntu 24.04), or point " + ENV_LIB +
                         " at the library. Codec deflate writes the same format without it.")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    sess, uint_p = ctypes.POINTER(Session), ctypes.POINTER(ctypes.c_uint)
    signatures = {
        "qzInit": ([sess, ctypes.c_ubyte], ctypes.c_int),
        "qzGetDefaultsDeflate": ([ctypes.POINTER(ParamsDeflate)], ctypes.c_int),
        "qzSetupSessionDeflate": ([sess, ctypes.POINTER(ParamsDeflate)], ctypes.c_int),
        "qzCompress": ([sess, ctypes.c_char_p, uint_p, ctypes.c_void_p, uint_p, ctypes.c_uint], ctypes.c_int),
        "qzDecompress": ([sess, ctypes.c_char_p, uint_p, ctypes.c_void_p, uint_p], ctypes.c_int),
        "qzMaxCompressedLength": ([ctypes.c_uint, sess], ctypes.c_uint),
        "qzTeardownSession": ([sess], ctypes.c_int),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def probe_hardware(library: QatLibrary) -> bool:
    """True when a QAT device serves QATzip: qzInit without software fallback succeeds."""
    sess = Session()
    rc = library.lib.qzInit(ctypes.byref(sess), 0)
    if rc in (QZ_OK, QZ_DUPLICATE):
        library.lib.qzTeardownSession(ctypes.byref(sess))
        return True
    if rc != QZ_NOSW_NO_HW:
        log.info("QATzip hardware probe returned %d", rc)
    return False


class QatCodec:
    """One QATzip session per worker thread, created at its first use and kept (sessions are costly)."""

    id = 3
    name = "qat"

    def __init__(self, library: QatLibrary, hardware: bool, level: int = LEVEL) -> None:
        self.library = library
        self.hardware = hardware
        self.level = level
        self.sessions = 0
        self.software_calls = 0  # QATzip calls made without a device (each leaks a pthread key)
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self._isal = DeflateCodec()

    @property
    def mode(self) -> str:
        return "hardware" if self.hardware else "software fallback"

    def status(self) -> dict:
        return {"library": self.library.path, "mode": self.mode, "sessions": self.sessions,
                "level": self.level, "request_bytes": HW_BUFF_SZ, "encoder": self.encoder().name,
                "software_calls": self.software_calls,
                "software_call_budget": None if self.hardware else SOFTWARE_CALL_BUDGET}

    def encoder(self):
        """Who writes new frames: QATzip, or ISA-L once QATzip's software budget is spent (same format)."""
        if self.hardware or self.software_calls < SOFTWARE_CALL_BUDGET:
            return self
        return self._isal

    def _spend(self, calls: int) -> None:
        """Count QATzip calls in software mode; warn once when the budget runs out."""
        if self.hardware:
            return
        with self._count_lock:
            before = self.software_calls
            self.software_calls += calls
        if before < SOFTWARE_CALL_BUDGET <= self.software_calls:
            log.warning("codec qat: QATzip's software fallback leaks a pthread key per request (QATzip 1.3.1, "
                        "no QAT device); after %d requests new frames are written by ISA-L in the same format "
                        "(codec deflate)", SOFTWARE_CALL_BUDGET)

    def _session(self) -> Session:
        sess = getattr(self._local, "session", None)
        if sess is None:
            sess = Session()
            lib = self.library.lib
            self._spend(2)  # qzInit, and qzSetupSessionDeflate's own
            rc = lib.qzInit(ctypes.byref(sess), SW_BACKUP_ALLOWED)
            if rc not in (QZ_OK, QZ_DUPLICATE) and rc < 0:
                raise CodecError(f"qzInit failed: {rc}")
            params = ParamsDeflate()
            _check(lib.qzGetDefaultsDeflate(ctypes.byref(params)), "qzGetDefaultsDeflate")
            params.common.direction = DIR_BOTH
            params.common.comp_lvl = self.level
            params.common.sw_backup = SW_BACKUP_ALLOWED
            params.common.hw_buff_sz = HW_BUFF_SZ
            params.huffman_hdr = HUFFMAN_DYNAMIC
            params.data_fmt = DATA_FMT_GZIP_EXT
            _check(lib.qzSetupSessionDeflate(ctypes.byref(sess), ctypes.byref(params)), "qzSetupSessionDeflate")
            self._local.session = sess
            self._local.out = ctypes.create_string_buffer(0)
            with self._count_lock:
                self.sessions += 1
        return sess

    def _buffer(self, size: int):
        if ctypes.sizeof(self._local.out) < size:
            self._local.out = ctypes.create_string_buffer(size)
        return self._local.out

    def compress(self, data) -> bytes:
        src = data if isinstance(data, bytes) else bytes(data)
        sess = self._session()
        self._spend(1)
        lib = self.library.lib
        cap = lib.qzMaxCompressedLength(len(src), ctypes.byref(sess))
        out = self._buffer(cap)
        src_len, dest_len = ctypes.c_uint(len(src)), ctypes.c_uint(cap)
        rc = lib.qzCompress(ctypes.byref(sess), src, ctypes.byref(src_len), out, ctypes.byref(dest_len), 1)
        _check(rc, "qzCompress")
        if src_len.value != len(src):
            raise CodecError(f"qzCompress consumed {src_len.value} of {len(src)} bytes")
        return ctypes.string_at(out, dest_len.value)

    def decompress(self, data, raw_len: int) -> bytes:
        if self.hardware:
            return self.decompress_with_qatzip(data, raw_len)
        return decompress_members(data, raw_len)  # ISA-L is several times faster than QATzip's software path

    def decompress_with_qatzip(self, data, raw_len: int) -> bytes:
        src = data if isinstance(data, bytes) else bytes(data)
        sess = self._session()
        self._spend(1)
        out = self._buffer(raw_len)
        src_len, dest_len = ctypes.c_uint(len(src)), ctypes.c_uint(raw_len)
        rc = self.library.lib.qzDecompress(ctypes.byref(sess), src, ctypes.byref(src_len), out,
                                           ctypes.byref(dest_len))
        if rc < 0 or dest_len.value != raw_len or src_len.value != len(src):
            raise CodecError(f"qzDecompress: rc {rc}, {dest_len.value} of {raw_len} bytes out, "
                             f"{src_len.value} of {len(src)} in")
        return ctypes.string_at(out, raw_len)


class HardwareDeflateDecoder(DeflateCodec):
    """Frames of id 2 (written by ISA-L) decoded on the QAT device, when there is one."""

    def __init__(self, qat: QatCodec) -> None:
        self.qat = qat

    def decompress(self, data, raw_len):
        return self.qat.decompress_with_qatzip(data, raw_len)


def install(library: QatLibrary, hardware: bool) -> QatCodec:
    """Register QATzip for id 3 (and for decoding id 2 when there is a device)."""
    codec = QatCodec(library, hardware)
    register(codec)
    if hardware:
        register(HardwareDeflateDecoder(codec))
    return codec


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise CodecError(f"{what} failed: {rc}")
