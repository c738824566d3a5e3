"""Native sequential writes: WRITE of a file written in order, taken and encoded in the C threads (docs/frontend.md,
"Native writes"; the C side is _loop.c's "native sequential writes").

A handle qualifies at create, or at an open (O_TRUNC, or an empty file), when it is write-only, the file's only
handle and empty, and its encoding policy is lossless with candidates the codec kernel codes (entropy, entropy8,
stored raw; zstd through the system's libzstd). `start` registers it in C with those candidates: from then on its
WRITEs in order are copied into raw frames and answered in the libfuse workers, and full frames are encoded by the
C encoder threads (the codec chosen from the first, as EncodingPolicy._choose does, on the same sample). Frames of a
file whose codec is zstd are left to Python's encoder (python-zstandard: another zstd version than the system's,
whose frames differ slightly in size) unless KVFS_NATIVE_WRITE_ZSTD=1.

Python takes a handle's content back (`settle_fh`) before anything else touches the file through it or beside it:
its FLUSH, fsync or RELEASE (the C side has encoded the last frame and waited for the others before queuing
them), a WRITE the C side sent to Python (another offset, or no room in the dirty budget), a truncate or setattr,
an open of the file by another handle, the end of the mount. The raw frames become the file's dirty frames (the C
buffers, without a copy) with their encodings as early encodes, exactly as if Python had received the writes; the
commit is then OpenFile's own (placement, quotas, sealing, index, events, crash safety, the written pages kept).
An encoding is used only if the file's policy is still the one the frames were encoded for (a dtype, shape or
lossy attribute set meanwhile: Python encodes them again).

Meanwhile the file's attributes show what C took (`sync`: size, mtime). The raw frames count against the mount's
dirty budget together with Python's (DirtyBudget.held_outside, on_change).

KVFS_NATIVE_WRITES=0 in the daemon's environment turns native writes off; KVFS_NATIVE_ENCODERS sets the number of
encoder threads (default: the CPUs, at least 2).
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct

import trio

from . import _loop
from .. import codecs
from .. import format as fmt
from ..codecs import kernel
from ..codecs.entropy import EntropyCodec
from ..openfile import DirtyFrame

log = logging.getLogger("kvfs.frontend")

ENABLED = os.environ.get("KVFS_NATIVE_WRITES", "1") != "0"
ENCODERS = min(64, int(os.environ.get("KVFS_NATIVE_ENCODERS", "0") or 0) or max(2, os.cpu_count() or 2))
ENCODER_NICE = int(os.environ.get("KVFS_NATIVE_ENCODER_NICE", "0"))  # the encoder threads' nice value (0-19)
# zstd frames encoded in C with the system's libzstd too (another version than python-zstandard's: the same
# codec, a slightly different size); by default they are left to Python, which writes exactly what it always did
ENCODE_ZSTD = os.environ.get("KVFS_NATIVE_WRITE_ZSTD", "0") == "1"


def _param(codec) -> int:
    return codec.stride if codec.id == EntropyCodec.id else 0


def plan(policy) -> tuple[tuple[tuple[int, int, int], ...], bool] | None:
    """How the C side encodes a file's frames as `policy` would: ((codec, transform, param), ...) candidates and
    whether the mount's codec is `auto` (noise is stored raw), or None where it cannot (lossy; a codec or transform
    the kernel does not encode)."""
    if not policy.effective_lossy.lossless:
        return None
    if policy.transform is not None:  # known already (the codec and the dtype given, or codec none)
        triples, auto = ((policy.codec.id, policy.transform, _param(policy.codec)),), False
    else:
        triples, auto = tuple((c.id, t, _param(c)) for c, t in policy._candidates()), policy.requested is None
    if not triples or not all(kernel.lib.kvfs_encode_supported(c, t) for c, t, _ in triples):
        return None
    return triples, auto


class Writer:
    __slots__ = ("fh", "ino", "state", "plan", "policy", "inputs", "synced")

    def __init__(self, fh: int, ino: int, state, plan_) -> None:
        self.fh = fh
        self.ino = ino
        self.state = state  # its OpenFile
        self.plan = plan_
        self.policy = state.policy  # the policy the plan is of, and what it was made from
        self.inputs = _inputs(self.policy)
        self.synced = 0  # WRITEs taken in C that the OpenFile's attributes show


def _inputs(policy) -> tuple:
    return policy.requested, policy.dtype, policy.shape, policy.lossy, policy.codec, policy.transform


class NativeWrites:
    """The native writers of one mount (bridge.py calls these around the Operations' handlers)."""

    def __init__(self, ops) -> None:
        from ..metrics import LATENCY_BUCKETS

        self.ops = ops
        self.writers: dict[int, Writer] = {}  # fh -> writer
        self._settling: dict[int, trio.Event] = {}
        lib = kernel.lib
        address = (lambda f: ctypes.cast(f, ctypes.c_void_p).value)
        _loop.set_writer(address(lib.kvfs_encode_frame), address(lib.kvfs_choose), address(lib.kvfs_encode_bound),
                         ENCODERS, tuple(LATENCY_BUCKETS), ENCODER_NICE)
        budget = ops.dirty_budget
        budget.held_outside = _loop.native_write_held
        budget.on_change = self._budget_changed
        self._budget_changed(budget.used)

    def _budget_changed(self, used: int) -> None:
        _loop.native_write_budget(self.ops.dirty_budget.limit, used)

    # -- registration ---------------------------------------------------------------------------------
    def start(self, fh: int, flags: int) -> None:
        """After the Operations made a handle (create, open): its WRITEs in order go to C, if it qualifies."""
        h = self.ops.handles.get(fh)
        if h is None or h.state is None or not h.writer or flags & os.O_ACCMODE != os.O_WRONLY:
            return
        state = h.state
        if state.handles != 1 or state.writers != 1 or state.size or state.dirty or state.corrupt:
            return
        try:
            p = plan(state.policy)
        except Exception:  # noqa: BLE001 - a policy that cannot be read here is Python's to report
            log.debug("inode %d: no native writes", h.ino, exc_info=True)
            return
        if p is None:
            return
        triples, auto = p
        flat = [x for t in triples for x in t]
        try:
            _loop.native_write_open(fh, h.ino, state.frame_size, struct.pack(f"<{len(flat)}i", *flat), auto,
                                    ENCODE_ZSTD)
        except (ValueError, MemoryError) as e:
            log.warning("inode %d: writes stay in Python: %s", h.ino, e)
            return
        self.writers[fh] = Writer(fh, h.ino, state, p)

    # -- attributes while C writes ----------------------------------------------------------------------
    def sync(self, ino: int | None = None) -> None:
        """Make the OpenFiles of native writers (of `ino`, or all) show what C took: size, modification times."""
        for w in list(self.writers.values()):
            if ino is not None and w.ino != ino:
                continue
            st = _loop.native_write_state(w.fh)
            if st is None or st[1] == w.synced:
                continue
            size, writes, last_ns, _active = st
            w.synced = writes
            state = w.state
            state.size = max(state.size, size)
            state.modified = True
            state.mtime_ns = state.ctime_ns = last_ns
            self.ops.attrs_given.discard(w.ino)  # the kernel drops its attributes at a write's answer

    # -- taking a writer back into Python -----------------------------------------------------------------
    async def settle_fh(self, fh: int) -> None:
        """The handle's content moves into its OpenFile; its later requests are Python's."""
        w = self.writers.get(fh)
        if w is None:
            return
        done = self._settling.get(fh)
        if done is not None:  # another request of the handle is taking it: after that one
            await done.wait()
            return
        try:
            taken = _loop.native_write_take(fh, False)  # FLUSH, fsync, RELEASE finished it in C: at once
            if taken is False:  # frames still being encoded: wait for them in a worker thread
                done = self._settling[fh] = trio.Event()
                with trio.CancelScope(shield=True):
                    taken = await trio.to_thread.run_sync(_loop.native_write_take, fh, True)
            self._install(w, taken)
        except Exception:
            w.state.corrupt = "unsaved native writes could not be taken over"  # never committed without them
            log.exception("inode %d: taking native writes over failed; the file is dropped", w.ino)
            raise
        finally:
            self.writers.pop(fh, None)
            if done is not None:
                del self._settling[fh]
                done.set()

    async def policy_changed(self, ino: int) -> None:
        """An attribute of the file was set or removed: a writer whose plan no longer is the policy's is taken
        back; one that has taken no write yet starts again with the new plan (user.kvfs.dtype set after create)."""
        for fh, w in list(self.writers.items()):
            if w.ino != ino:
                continue
            try:
                if plan(w.state.policy) == w.plan:
                    continue
            except Exception:  # noqa: BLE001 - Python's path reports what is wrong with the policy
                pass
            st = _loop.native_write_state(fh)
            await self.settle_fh(fh)
            h = self.ops.handles.get(fh)
            if st is not None and st[1] == 0 and h is not None:
                self.start(fh, h.flags)

    async def settle_ino(self, ino: int) -> None:
        for fh in [fh for fh, w in self.writers.items() if w.ino == ino]:
            await self.settle_fh(fh)

    async def settle_all(self) -> None:
        for fh in list(self.writers):
            await self.settle_fh(fh)

    def _install(self, w: Writer, taken) -> None:
        """C's frames become the OpenFile's dirty frames, encoded early where the policy is still theirs."""
        if not taken:
            return
        size, writes, last_ns, choice, frames = taken
        state, ops = w.state, self.ops
        ops.dirty_budget.take_over(state.frame_size * len(frames))
        usable = choice is not None and self._policy_agrees(w, state.policy, choice)
        for i, (raw, length, enc) in enumerate(frames):
            df = DirtyFrame(memoryview(raw))  # read-only: OpenFile copies it before a write changes it
            df.version = 1
            df.filled = length
            if enc is not None and usable:
                payload, stored_len, codec, transform, flags, stored_xxh3, raw_xxh3 = enc
                if flags & fmt.FRAME_HOLE:
                    data = b""
                elif payload is None:  # stored raw: the payload is the raw bytes
                    data = df.buf[:length]
                else:
                    data = memoryview(payload)
                df.encoded = (1, fmt.EncodedFrame(data, length, codec, transform, flags, stored_xxh3, raw_xxh3))
            if state.dirty.pop(i, None) is not None:  # not reached: the handle was the file's only one
                ops.dirty_budget.release(state.frame_size)
            state.dirty[i] = df
        if writes:
            state.size = max(state.size, size)
            state.modified = True
            state.changes += writes
            state.mtime_ns = state.ctime_ns = last_ns
            ops.attrs_given.discard(w.ino)

    @staticmethod
    def _policy_agrees(w: Writer, policy, choice: tuple[int, int, int]) -> bool:
        """Whether frames C encoded with `choice` are what `policy` would write; it adopts the choice."""
        if policy is not w.policy or _inputs(policy) != w.inputs:  # (setxattr took such writers back already)
            try:
                if plan(policy) != w.plan:
                    return False
            except Exception:  # noqa: BLE001
                return False
        codec_id, transform, param = choice
        if policy.transform is None:
            codec = codecs.by_id(codec_id)
            policy.codec = codec.with_stride(param) if codec_id == EntropyCodec.id else codec
            policy.transform = transform
            return True
        return (policy.codec.id, policy.transform, _param(policy.codec)) == (codec_id, transform, param)


def add_counts(ops, t: dict) -> None:
    """Add the native writes' counters of a _loop.native_take() to the mount's (stats, metrics)."""
    c = ops.counters
    c.write_requests += t["writes"]
    c.bytes_written += t["write_bytes"]
    c.native_writes += t["writes"]
    c.native_write_bytes += t["write_bytes"]
    c.native_write_fallbacks += t["write_fallbacks"] + t["write_budget_fallbacks"]
    c.frames_encoded += t["frames_encoded"]
    ops.latency.add_writes(t["write_latency"], t["write_latency_sum_s"])
