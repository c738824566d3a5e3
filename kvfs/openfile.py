"""The state of a regular file in use, per inode and shared by all its handles.

Reads are served from dirty frames, a small decoded-frame cache (with read-ahead of the next frame) or the
committed object. Writes fill dirty frames in memory; a frame completed by sequential writes is encoded
at once in a worker thread (so close() mostly only writes the object). commit() — called on flush (close)
and fsync — encodes what is left, writes a new object, switches the index row in one transaction and only
then deletes the old object. Mutations and commits of one file are serialised by `lock`; reads are not.

Invariants:
- bytes of dirty frames at offsets >= size are zero (truncate zeroes the tail of the last frame);
- bytes [0, clean_limit) of the committed object are still the file's content where no dirty frame
  covers them; beyond clean_limit the file reads as zeros unless dirty.
"""

from __future__ import annotations

import collections.abc
import errno
import logging
import threading
import time
from collections import OrderedDict

import trio

from . import codecs
from . import format as fmt
from .codecs import transforms
from . import lossy as lossy_modes
from .codecs.entropy import EntropyCodec, stride_from_shape
from .codecs.entropy8 import Entropy8Codec
from .index import Index
from .ratelimit import Throttle
from .store import Layout, ObjectRef, Store

log = logging.getLogger(__name__)

CACHE_FRAMES = 4  # decoded frames kept per open file
READ_AHEAD_FRAMES = 2  # frames decoded ahead of a sequential reader (one per core here)
MAX_EAGER = 8  # eager frame encodes queued per file
SAMPLE_BYTES = 64 << 10  # sampled (in SAMPLE_PIECES pieces) to choose a transform
SAMPLE_PIECES = 4
INCOMPRESSIBLE = 0.98  # auto: a first-frame sample that no codec shrinks below this is stored raw
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")  # 1-byte floats: codec 5 (entropy8) is a candidate


class FileCorrupt(Exception):
    """A file's object failed verification; the file must be dropped and the caller answered EIO."""

    def __init__(self, ino: int, reason: str) -> None:
        super().__init__(f"inode {ino}: {reason}")
        self.ino = ino
        self.reason = reason


class PublishedGone(FileCorrupt):
    """A published object vanished from the shared L4: another node unlinked the name. A miss (ENOENT)."""


class _StaleObject(Exception):
    """The object read was replaced by a commit while we read it; retry with the current one."""


class DirtyFrame:
    """A frame with unsaved content. `buf` holds frame_size bytes: a bytearray, or — for a frame written whole by
    one request — that request's immutable bytes (or a view of them), kept without a copy until a later write
    or truncation changes part of the frame (`OpenFile._writable`)."""

    __slots__ = ("buf", "version", "filled", "encoded", "encoding")

    def __init__(self, buf: bytearray | bytes | memoryview) -> None:
        self.buf = buf
        self.version = 0
        self.filled = 0  # [0, filled) written sequentially since the frame became dirty
        self.encoded: tuple[int, fmt.EncodedFrame] | None = None  # (version it encodes, frame)
        self.encoding: tuple[int, trio.Event] | None = None  # early encode in flight: (version, done)

    def encoded_as(self, length: int) -> fmt.EncodedFrame | None:
        """The early encoding, if it is of the current content and length."""
        if self.encoded and self.encoded[0] == self.version and self.encoded[1].raw_len == length:
            return self.encoded[1]
        return None


class DirtyBudget:
    """Memory held by unsaved frames across all open files. Writes beyond the limit fail with ENOSPC
    (before the daemon would be killed for lack of memory); closing files commits and frees it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._full_log = Throttle()
        # unsaved bytes held outside Python against the same limit (the native front end's writers,
        # kvfs/frontend/native_write.py), and who is told of Python's use (it checks its own against the rest)
        self.held_outside: collections.abc.Callable[[], int] = _nothing
        self.on_change: collections.abc.Callable[[int], None] | None = None

    def charge(self, nbytes: int) -> None:
        if self.used + self.held_outside() + nbytes > self.limit:
            if self._full_log.due():
                log.warning("unsaved data reached the dirty limit (%d MiB): writes get ENOSPC until files are "
                            "closed (raise mount.max_dirty to allow more)", self.limit >> 20)
            raise OSError(errno.ENOSPC, "dirty data limit reached")
        self.used += nbytes
        if self.on_change is not None:
            self.on_change(self.used)

    def take_over(self, nbytes: int) -> None:
        """Bytes that were held outside (a native writer's frames) and are Python's now: within the limit already."""
        self.used += nbytes
        if self.on_change is not None:
            self.on_change(self.used)

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        if self.on_change is not None:
            self.on_change(self.used)

    @property
    def total(self) -> int:
        """All unsaved bytes against the limit: Python's and those held outside."""
        return self.used + self.held_outside()


def _nothing() -> int:
    return 0


class EncodingPolicy:
    """How new frames of a file are encoded: codec, transform and codec parameters, chosen once per file.

    codec None is the mount's `auto`: the sample of the first frame encoded is compressed by each candidate
    (the entropy coder for 2-byte floats, zstd on byte planes, zstd on raw bytes, the entropy coder for 1-byte
    floats) and the smallest wins.
    Frames are encoded in parallel, so in a file whose frames differ in kind (text, then noise) which frame
    decides is not fixed; KV frames are alike. A file's dtype, when known, narrows the candidates; its shape
    hint gives the entropy coder its channel stride. Either way a frame that does not shrink is stored raw
    (format.encode_frame)."""

    def __init__(self, codec: codecs.Codec | None, dtype: str, shape: bytes | None = None,
                 lossy: lossy_modes.Lossy = lossy_modes.LOSSLESS) -> None:
        self.requested = codec
        self.shape = shape  # user.kvfs.shape, validated; goes into the header (tag EXT_SHAPE)
        self.dtype = dtype  # 'auto', 'none' or a format.DTYPES name
        self.lossy = lossy  # asked for (user.kvfs.lossy or the mount's setting); see `effective_lossy`
        self._choosing = threading.Lock()  # the first frames of a file may be encoded in parallel
        self.codec: codecs.Codec | None = None
        self.transform: int | None = None
        if codec is not None and codec.id == codecs.NoneCodec.id:
            self.codec, self.transform = codec, transforms.IDENTITY
        elif codec is not None and dtype != "auto" and codec.id not in (EntropyCodec.id, Entropy8Codec.id):
            self.codec, self.transform = codec, _transform_for_dtype(dtype)

    @property
    def element_size(self) -> int:
        if self.dtype in fmt.DTYPE_ELEMENT_SIZE:
            return fmt.DTYPE_ELEMENT_SIZE[self.dtype]
        two_byte = self.transform == transforms.BYTEPLANE2 or (self.codec is not None and self.codec.id == EntropyCodec.id)
        return 2 if two_byte else 1

    @property
    def codec_id(self) -> int:
        """The codec recorded in the header (informational): the chosen one, else what was asked for."""
        chosen = self.codec or self.requested
        return chosen.id if chosen is not None else codecs.ZstdCodec.id

    @property
    def effective_lossy(self) -> lossy_modes.Lossy:
        """The lossy mode new frames get: the one asked for, where it applies to the file's dtype."""
        try:
            lossy_modes.check_applicable(self.lossy, self.dtype)
        except ValueError:
            return lossy_modes.LOSSLESS
        return self.lossy

    @property
    def lossy_header(self) -> tuple[int, int]:
        mode = self.effective_lossy
        return mode.mode, mode.header_param(self.fp8_group())

    def encode(self, raw, offset: int = 0) -> fmt.EncodedFrame:
        """Encode the frame at byte `offset` of the file. Runs in a worker thread."""
        mode = self.effective_lossy
        skip = max(0, self._hint()[0] - offset)  # bytes before the shape hint's offset stay exact
        if mode.mode == lossy_modes.MANTISSA:
            raw = lossy_modes.round_mantissa(raw, self.dtype, mode.param, skip)
        elif mode.mode == lossy_modes.FP8:
            return fmt.encode_frame(raw, codecs.by_name("zstd"), transforms.IDENTITY,
                                    fp8=fmt.Fp8Params(self.dtype, self.fp8_group(), skip))
        if self.transform is None:
            with self._choosing:
                if self.transform is None:
                    self.codec, self.transform = self._choose(raw)
        return fmt.encode_frame(raw, self.codec.encoder(), self.transform)

    def header(self, size: int, frame_size: int) -> fmt.Header:
        """The object header of a file of `size` bytes whose frames this policy encoded."""
        lossy_mode, lossy_param = self.lossy_header
        return fmt.Header(raw_size=size, frame_size=frame_size, n_frames=-(-size // frame_size),
                          transform=self.transform or transforms.IDENTITY, element_size=self.element_size,
                          codec=self.codec_id, dtype=fmt.DTYPES.get(self.dtype, 0), lossy_mode=lossy_mode,
                          lossy_param=lossy_param,
                          extensions=fmt.tlv(fmt.EXT_SHAPE, self.shape) if self.shape else b"")

    def fp8_group(self) -> int:
        """Values per fp8 scale: asked for, else a channel's tokens (shape hint with `token` innermost), else 64."""
        if self.lossy.param and self.lossy.mode == lossy_modes.FP8:
            return self.lossy.param
        dims = self._dims()
        if dims and dims[-1][0] == "token" and 16 <= dims[-1][1] <= lossy_modes.MAX_GROUP:
            return 1 << (dims[-1][1].bit_length() - 1)  # a power of two (the header keeps its log2)
        return lossy_modes.DEFAULT_GROUP

    def _hint(self) -> tuple[int, list[tuple[str, int]]]:
        """The shape hint as (payload offset, dimensions); (0, []) without one. Parsed on each use: the
        hint may be set or removed while the file is open."""
        if not self.shape:
            return 0, []
        try:
            return fmt.parse_shape_hint(self.shape)
        except ValueError:
            return 0, []

    def _dims(self) -> list[tuple[str, int]]:
        return self._hint()[1]

    def _choose(self, raw) -> tuple[codecs.Codec, int]:
        sample = _sample(raw)
        candidates = self._candidates()
        if len(candidates) == 1 or len(sample) < 512:
            return candidates[0]
        sizes = [len(codec.compress(transforms.apply(transform, sample))) for codec, transform in candidates]
        best = min(range(len(candidates)), key=sizes.__getitem__)
        if self.requested is None and sizes[best] > INCOMPRESSIBLE * len(sample):
            return codecs.by_id(codecs.NoneCodec.id), transforms.IDENTITY  # noise: do not try every frame
        return candidates[best]

    def _candidates(self) -> list[tuple[codecs.Codec, int]]:
        element = fmt.DTYPE_ELEMENT_SIZE.get(self.dtype)
        entropy = codecs.by_id(EntropyCodec.id).with_stride(self._stride())
        entropy8 = codecs.by_id(Entropy8Codec.id)
        if self.requested is not None:  # an entropy coder asked for, or any codec with dtype auto
            if self.requested.id == EntropyCodec.id:
                return [(entropy, transforms.IDENTITY)] if element in (None, 2) else [(codecs.by_name("zstd"), transforms.IDENTITY)]
            if self.requested.id == Entropy8Codec.id:
                fits = element in (None, 1)
                return [(entropy8 if fits else codecs.by_name("zstd"), transforms.IDENTITY)]
            return [(self.requested, transforms.BYTEPLANE2), (self.requested, transforms.IDENTITY)]
        zstd = codecs.by_name("zstd")
        if element == 2:
            return [(entropy, transforms.IDENTITY), (zstd, transforms.BYTEPLANE2)]
        if self.dtype in FP8_DTYPES:
            return [(entropy8, transforms.IDENTITY), (zstd, transforms.IDENTITY)]
        if element is not None:
            return [(zstd, transforms.IDENTITY)]
        return [(entropy, transforms.IDENTITY), (zstd, transforms.BYTEPLANE2), (zstd, transforms.IDENTITY),
                (entropy8, transforms.IDENTITY)]

    def _stride(self) -> int:
        dims = self._dims()
        return stride_from_shape(dims) if dims else 1


def _sample(raw) -> bytes:
    """SAMPLE_BYTES in SAMPLE_PIECES element-aligned pieces spread over the frame: the first rows of a KV
    block can be atypical."""
    n = len(raw) // 2 * 2
    piece = SAMPLE_BYTES // SAMPLE_PIECES
    starts = sorted({(n * k // SAMPLE_PIECES) // 2 * 2 for k in range(SAMPLE_PIECES)})
    pieces = [bytes(raw[start:min(start + piece, n)]) for start in starts]
    return b"".join(p[: len(p) // 2 * 2] for p in pieces)


def _transform_for_dtype(dtype: str) -> int:
    return transforms.BYTEPLANE2 if fmt.DTYPE_ELEMENT_SIZE.get(dtype) == 2 else transforms.IDENTITY


class OpenFile:
    def __init__(self, ino: int, row, store: Store, index: Index,
                 policy: EncodingPolicy | collections.abc.Callable[[], EncodingPolicy],
                 frame_size: int, nursery: trio.Nursery, counters, budget: DirtyBudget, lock: trio.Lock) -> None:
        self.ino = ino
        self.budget = budget
        self.store = store
        self.index = index
        # a policy, or what makes it at the first write (a file opened only to be read never needs one)
        self._policy: EncodingPolicy | None = policy if isinstance(policy, EncodingPolicy) else None
        self._make_policy = None if self._policy is not None else policy
        self.frame_size = frame_size
        self.nursery = nursery
        self.counters = counters
        self.size: int = row["size"]
        self.clean_limit = self.size
        self.ref: ObjectRef | None = ObjectRef.of_row(row)
        self.next_gen = row["obj_gen"] + 1
        self._layout: tuple[ObjectRef, Layout] | None = None
        self.dirty: dict[int, DirtyFrame] = {}
        self.modified = False
        self.changes = 0  # writes and truncates so far
        self.failed_at: int | None = None  # `changes` when a commit last failed (None: none failed since)
        self.mtime_ns: int | None = None  # of unsaved changes: the last write's, or one set since
        self.ctime_ns: int | None = None  # the last write's (an explicit mtime is not a ctime)
        self.lock = lock  # the inode's lock, shared with the mover
        self.cache: OrderedDict[tuple[int, int], bytes | bytearray] = OrderedDict()
        self.inflight: dict[tuple[int, int], trio.Event] = {}
        self.handles = 0
        self.writers = 0  # handles open for writing
        self.native_live = False  # handles of it are read by the native front end (kvfs/frontend/ops _native_open)
        self.corrupt: str | None = None
        self._eager = 0

    @property
    def policy(self) -> EncodingPolicy:
        if self._policy is None:
            self._policy = self._make_policy()
        return self._policy

    @policy.setter
    def policy(self, policy: EncodingPolicy) -> None:
        self._policy = policy

    # -- helpers ---------------------------------------------------------------------------------
    def _frame_len(self, i: int, size: int) -> int:
        return min(self.frame_size, size - i * self.frame_size)

    def _check_usable(self) -> None:
        if self.corrupt:
            kind = PublishedGone if self.corrupt.startswith("published object") else FileCorrupt
            raise kind(self.ino, self.corrupt)

    async def _layout_of(self, ref: ObjectRef) -> Layout:
        if self._layout is not None and self._layout[0] is ref:
            return self._layout[1]
        try:
            layout = await self.store.load_layout(ref)
        except fmt.CorruptObject as e:
            raise self._mark_corrupt(str(e)) from e
        except FileNotFoundError:
            raise self._stale_or_vanished(ref) from None
        if self.ref is ref:
            self._layout = (ref, layout)
        return layout

    def _mark_corrupt(self, reason: str) -> FileCorrupt:
        self.corrupt = reason
        return FileCorrupt(self.ino, reason)

    def relocated(self, ref: ObjectRef) -> None:
        """The mover moved the committed object to another tier (same bytes): read it there from now on.
        Reads in flight on the old place fail to open it and retry here (_StaleObject)."""
        if self.ref is not None and self.ref.gen == ref.gen:
            layout = self._layout[1] if self._layout is not None and self._layout[0] is self.ref else None
            if ref.stored_bytes != self.ref.stored_bytes:
                layout = None  # sealed or opened on the way (kvfs/sealing.py): another frame table
            self.ref = ref
            self._layout = (ref, layout) if layout is not None else None

    def _stale_or_vanished(self, ref: ObjectRef) -> Exception:
        if self.ref is not ref:
            return _StaleObject()
        if ref.key is not None:
            self.corrupt = f"published object {ref.key} is gone"
            return PublishedGone(self.ino, self.corrupt)
        return self._mark_corrupt(f"object {ref.object_id} vanished from {ref.tier}")

    async def _committed_frame(self, i: int):
        """Raw bytes of frame i of the committed object, or None where the file reads as zeros."""
        while True:
            ref = self.ref
            if ref is None or i * self.frame_size >= self.clean_limit:
                return None
            try:
                layout = await self._layout_of(ref)
                if i >= len(layout.frames) or layout.frames[i].is_hole:
                    return None
                return await self._decoded(ref, layout.frames[i], i, layout.cipher)
            except _StaleObject:
                continue

    async def _decoded(self, ref: ObjectRef, entry: fmt.FrameEntry, i: int, cipher=None):
        key = (ref.gen, i)
        while True:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
            event = self.inflight.get(key)
            if event is None:
                break
            await event.wait()
            self._check_usable()
            if self.ref is not ref and key not in self.cache:
                raise _StaleObject()
        event = self.inflight[key] = trio.Event()
        try:
            data = await self.store.read_frame(ref, entry, cipher)
            self.counters.frames_decoded += 1
        except fmt.CorruptObject as e:
            raise self._mark_corrupt(f"frame {i}: {e}") from e
        except FileNotFoundError:
            raise self._stale_or_vanished(ref) from None
        finally:
            del self.inflight[key]
            event.set()
        self._cache_put(key, data)
        return data

    def _cache_put(self, key, data) -> None:
        self.cache[key] = data
        self.cache.move_to_end(key)
        while len(self.cache) > CACHE_FRAMES:
            self.cache.popitem(last=False)

    async def _prefetch(self, ref: ObjectRef, i: int) -> None:
        try:
            layout = await self._layout_of(ref)
            if i < len(layout.frames) and not layout.frames[i].is_hole:
                await self._decoded(ref, layout.frames[i], i, layout.cipher)
        except Exception as e:  # a background task must never take the daemon down; the real read reports
            log.debug("read-ahead of inode %d frame %d: %r", self.ino, i, e)

    # -- reads -----------------------------------------------------------------------------------
    async def read(self, off: int, size: int) -> bytes | memoryview:
        """The bytes [off, off+size) (fewer at the end of the file). A read within one frame (the kernel's
        requests, read-ahead sized to frames) is answered with a view of the decoded frame, not a copy: pyfuse3
        copies it into the reply before any other task runs, and decoded frames are never changed."""
        self._check_usable()
        end = min(off + size, self.size)
        if end <= off:
            return b""
        F = self.frame_size
        last = (end - 1) // F
        if off // F == last:
            part = await self._part(last, off - last * F, end - off)
        else:
            parts = []
            pos = off
            while pos < end:
                i, fo = divmod(pos, F)
                n = min(F - fo, end - pos)
                parts.append(await self._part(i, fo, n))
                pos += n
            part = b"".join(parts)
        self._maybe_read_ahead(last, end)
        return part

    async def _part(self, i: int, fo: int, n: int) -> bytes | memoryview:
        """Bytes [fo, fo+n) of frame i."""
        raw = None if i in self.dirty else await self._committed_frame(i)
        df = self.dirty.get(i)  # checked again: a write may have landed while we awaited
        if df is not None:
            return bytes(memoryview(df.buf)[fo:fo + n])  # a copy: later writes change a dirty frame
        if raw is None:
            return bytes(n)
        chunk = memoryview(raw)[fo:fo + n]
        return chunk if len(chunk) == n else bytes(chunk) + bytes(n - len(chunk))

    def _maybe_read_ahead(self, i: int, end: int) -> None:
        """Sequential reader past the middle of frame i: decode the next frames in the background."""
        F = self.frame_size
        ref = self.ref
        if ref is None or end - i * F < F // 2:
            return
        for nxt in range(i + 1, i + 1 + READ_AHEAD_FRAMES):
            if nxt * F >= self.clean_limit:
                return
            if nxt not in self.dirty and (ref.gen, nxt) not in self.cache and (ref.gen, nxt) not in self.inflight:
                self.nursery.start_soon(self._prefetch, ref, nxt)

    # -- writes ----------------------------------------------------------------------------------
    async def _materialize(self, i: int) -> DirtyFrame:
        """Make frame i dirty, starting from its committed content. Caller holds the lock."""
        self.budget.charge(self.frame_size)
        try:
            raw = await self._committed_frame(i)
        except BaseException:
            self.budget.release(self.frame_size)
            raise
        buf = bytearray(self.frame_size)
        if raw is not None:
            buf[: len(raw)] = raw
        df = self.dirty[i] = DirtyFrame(buf)
        return df

    @staticmethod
    def _writable(df: DirtyFrame) -> DirtyFrame:
        """A dirty frame whose bytes can be changed in place: a frame kept as its write request's bytes is
        copied first (an early encode of the old bytes may still be reading them)."""
        if not isinstance(df.buf, bytearray):
            df.buf = bytearray(df.buf)
        return df

    def _drop_dirty(self, frames) -> None:
        for i in list(frames):
            del self.dirty[i]
            self.budget.release(self.frame_size)

    @property
    def changed_since_failure(self) -> bool:
        """Unsaved data that no failed commit has reported yet (e.g. mmap pages written back at release)."""
        return self.modified and self.failed_at != self.changes

    def discard(self) -> None:
        """Forget unsaved data (the file is gone, or its commit failed and its last handle closed)."""
        self._drop_dirty(self.dirty)
        self.modified = False

    async def write(self, off: int, data: bytes) -> int:
        self._check_usable()
        end = off + len(data)
        if end > fmt.MAX_FILE_SIZE:
            raise OSError(errno.EFBIG, "file too large")
        F = self.frame_size
        view = memoryview(data)
        # immutable: a whole frame of it can be kept without a copy (the native front end passes a read-only
        # view of the request's own copy, which nothing writes)
        keep = isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly)
        async with self.lock:
            pos = off
            while pos < end:
                i, fo = divmod(pos, F)
                n = min(F - fo, end - pos)
                df = self.dirty.get(i)
                if n == F and keep:
                    # the whole frame: its bytes are the request's (no zeroed buffer, no copy)
                    if df is None:
                        self.budget.charge(F)
                        df = self.dirty[i] = DirtyFrame(b"")
                    df.buf = data if n == len(data) else view[pos - off:pos - off + n]
                else:
                    df = self._writable(df) if df is not None else await self._materialize(i)
                    df.buf[fo:fo + n] = view[pos - off:pos - off + n]
                df.version += 1
                if fo <= df.filled:
                    df.filled = max(df.filled, fo + n)
                    if df.filled == F:
                        self._encode_early(i, df)
                pos += n
            self.size = max(self.size, end)
            self.modified = True
            self.changes += 1
            self.mtime_ns = self.ctime_ns = time.time_ns()
        return len(data)

    async def truncate(self, new_size: int) -> None:
        self._check_usable()
        if new_size > fmt.MAX_FILE_SIZE:
            raise OSError(errno.EFBIG, "file too large")
        F = self.frame_size
        async with self.lock:
            if new_size < self.size:
                keep = -(-new_size // F)
                self._drop_dirty([k for k in self.dirty if k >= keep])
                tail = new_size % F
                if tail:
                    i = new_size // F
                    df = self.dirty.get(i)
                    df = self._writable(df) if df is not None else await self._materialize(i)
                    df.buf[tail:] = bytes(F - tail)
                    df.version += 1
                    df.filled = min(df.filled, tail)
                self.clean_limit = min(self.clean_limit, new_size)
            self.size = new_size
            self.modified = True
            self.changes += 1
            self.mtime_ns = self.ctime_ns = time.time_ns()

    def _encode_early(self, i: int, df: DirtyFrame) -> None:
        if self._eager < MAX_EAGER:
            self._eager += 1
            done = trio.Event()
            df.encoding = (df.version, done)
            self.nursery.start_soon(self._encode_in_background, i, df, df.version, done)

    async def _encode_in_background(self, i: int, df: DirtyFrame, version: int, done: trio.Event) -> None:
        try:
            encoded = await self.store.cpu(self.policy.encode, df.buf, i * self.frame_size)
            self.counters.frames_encoded += 1
            if df.version == version and self.dirty.get(i) is df:
                df.encoded = (version, encoded)
        except Exception:  # the commit encodes it again and reports any error
            log.debug("early encode of inode %d frame %d failed", self.ino, i, exc_info=True)
        finally:
            self._eager -= 1
            if df.encoding is not None and df.encoding[1] is done:
                df.encoding = None
            done.set()

    # -- commit ----------------------------------------------------------------------------------
    async def commit(self, durable: bool = False) -> bool:
        """Encode and publish the file's current content. Returns True if a new object was written."""
        async with self.lock:
            self._check_usable()
            if not self.modified:
                return False
            try:
                await self._commit_locked(durable)
            except BaseException:
                self.counters.commit_failures += 1
                self.failed_at = self.changes
                raise
            self.counters.commits += 1
            return True

    async def _commit_locked(self, durable: bool) -> None:
        size = self.size
        n = -(-size // self.frame_size)
        old = self.ref
        layout = await self._layout_of(old) if old is not None and self.clean_limit > 0 else None
        reusable = self._reusable_entries(layout, n)
        # clean frames whose length changes (the old last frame, now followed by more) are re-encoded
        for i in range(n):
            if i not in self.dirty and i in reusable and reusable[i].raw_len != self._frame_len(i, size):
                if not reusable[i].is_hole:
                    await self._materialize(i)
                del reusable[i]

        frames: list[fmt.EncodedFrame | None] = [None] * n
        # one frame left to encode (the usual tail of a file written in order, the others encoded early): it is
        # encoded in the same worker-thread hop that writes the object (store.put_frames). Early encodes still
        # running are awaited first (the object needs them anyway; under the lock no write changes a frame):
        # measured, this beats encoding the tail beside them and writing the object in a hop of its own
        for df in list(self.dirty.values()):
            if df.encoding is not None and df.encoding[0] == df.version:
                await df.encoding[1].wait()
        last = self._only_unencoded(n, size)
        async with trio.open_nursery() as nursery:
            for i in range(n):
                df = self.dirty.get(i)
                length = self._frame_len(i, size)
                if df is not None:
                    frames[i] = df.encoded_as(length)
                    if frames[i] is None and i != last:
                        nursery.start_soon(self._encode_into, frames, i, df, length)
                elif i in reusable and not reusable[i].is_hole:
                    nursery.start_soon(self._copy_into, frames, i, old, reusable[i], layout.cipher)
                else:
                    frames[i] = fmt.EncodedFrame.hole(length)
        pending = None
        if last is not None:
            frames[last] = self.dirty[last].encoded_as(self._frame_len(last, size))  # an early encode may have ended
            if frames[last] is None:
                pending = (last, memoryview(self.dirty[last].buf)[:self._frame_len(last, size)])

        mtime = self.mtime_ns or time.time_ns()
        if n == 0:
            self.index.switch_object(self.ino, gen=0, tier=None, size=0, stored_bytes=0, codec=None,
                                     transform=None, mtime_ns=mtime, ctime_ns=self.ctime_ns)
            new_ref, new_layout = None, None
        else:
            header = self.policy.header(size, self.frame_size)
            gen = self.next_gen
            self.next_gen += 1
            new_ref, new_layout = await self.store.put_frames(self.ino, gen, header, frames, replacing=old,
                                                              durable=durable, pending=pending,
                                                              encode=self.policy.encode,
                                                              tenant=self.store.tenants.of_inode(self.index, self.ino))
            if pending is not None:
                self.counters.frames_encoded += 1
            self.index.switch_object(self.ino, gen=gen, tier=new_ref.tier, size=size,
                                     stored_bytes=new_ref.stored_bytes, codec=summary_codec(frames),
                                     transform=transforms.NAMES[header.transform], mtime_ns=mtime,
                                     ctime_ns=self.ctime_ns)
            self.store.keep_layout(new_ref, new_layout)  # the next open reads frames without loading the table
        self._publish(new_ref, new_layout, size)
        if old is not None:
            await self.store.delete(old)

    def _only_unencoded(self, n: int, size: int) -> int | None:
        """The one dirty frame with no early encoding of its current content (none running either), if there
        is exactly one and every other frame is encoded already or needs no encoding."""
        found = None
        for i, df in self.dirty.items():
            if i >= n or df.encoded_as(self._frame_len(i, size)) is not None:
                continue
            if found is not None or (df.encoding is not None and df.encoding[0] == df.version):
                return None
            found = i
        return found

    def _reusable_entries(self, layout: Layout | None, n: int) -> dict[int, fmt.FrameEntry]:
        if layout is None:
            return {}
        F = self.frame_size
        limit = min(n, len(layout.frames))
        return {i: layout.frames[i] for i in range(limit) if i * F < self.clean_limit}

    def _publish(self, ref: ObjectRef | None, layout: Layout | None, size: int) -> None:
        """After the index switch: readers move to the new object; committed dirty frames become cache."""
        self.ref = ref
        self._layout = (ref, layout) if ref is not None else None
        self.cache.clear()
        if ref is not None and self.policy.effective_lossy.lossless:  # lossy: reads must see stored values
            for i in sorted(self.dirty)[-CACHE_FRAMES:]:
                self._cache_put((ref.gen, i), memoryview(self.dirty[i].buf)[: self._frame_len(i, size)])
        self._drop_dirty(self.dirty)
        self.clean_limit = size
        self.modified = False
        self.mtime_ns = self.ctime_ns = None

    async def _encode_into(self, frames: list, i: int, df: DirtyFrame, length: int) -> None:
        if df.encoding is not None and df.encoding[0] == df.version:
            await df.encoding[1].wait()  # an early encode of this very content is running: use it
            frames[i] = df.encoded_as(length)
            if frames[i] is not None:
                return
        frames[i] = await self.store.cpu(self.policy.encode, memoryview(df.buf)[:length], i * self.frame_size)
        self.counters.frames_encoded += 1

    async def _copy_into(self, frames: list, i: int, ref: ObjectRef, entry: fmt.FrameEntry, cipher=None) -> None:
        """Reuse a clean frame's compressed bytes as they are (verified, not recompressed; a sealed one opened:
        the new object is sealed, or not, where it is placed)."""
        payload = await self.store.read_payload(ref, entry)
        if entry.is_sealed:
            try:
                entry, payload = await self.store.cpu(fmt.open_sealed, entry, payload, cipher)
            except fmt.CorruptObject as e:
                raise self._mark_corrupt(f"frame {i}: {e} while re-committing") from e
        elif not await self.store.cpu(_payload_intact, entry, payload):
            raise self._mark_corrupt(f"frame {i}: payload checksum mismatch while re-committing")
        frames[i] = fmt.EncodedFrame.from_entry(entry, payload)


def _payload_intact(entry: fmt.FrameEntry, payload: bytes) -> bool:
    return len(payload) == entry.stored_len and fmt.xxh3(payload) == entry.stored_xxh3


def summary_codec(frames) -> str:
    """The codecs of a file's frames (encoded frames or table entries), as user.kvfs.codec shows them."""
    names = sorted({codecs.by_id(f.codec).name for f in frames if not f.is_hole})
    return "+".join(names) if names else "none"

