/* kvfs native FUSE front end: the libfuse 3 session, its C threads, and the reply bindings.
 *
 * The session loop is libfuse's multi-threaded one (fuse_session_loop_mt, clone_fd, a bounded thread count),
 * run in a C thread this module starts. A libfuse worker that receives a request copies what the request
 * carries (names, written bytes, the caller's ids) into one heap block, appends it to a queue under a mutex
 * and, when the queue was empty, writes an eventfd; then it goes back to read the next request. It never takes
 * the GIL. The daemon's trio loop waits for the eventfd to be readable, takes the whole queue (`fetch`), runs
 * each request's Python handler and answers it through the Request object's reply_* methods (libfuse allows a
 * reply from any thread). A Request dropped without an answer answers EIO, so no caller waits forever.
 *
 * One session per process, as in pyfuse3 (its module-level notify functions need no session argument).
 * Replies and notifications hold a read lock of `S.life`; close() takes it for writing before it destroys the
 * session, so nothing answers into freed memory. See docs/frontend.md.
 */
#define FUSE_USE_VERSION 312
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

enum {
    OP_INIT = 1, OP_LOOKUP, OP_FORGET, OP_GETATTR, OP_SETATTR, OP_READLINK, OP_MKNOD, OP_MKDIR, OP_UNLINK,
    OP_RMDIR, OP_SYMLINK, OP_RENAME, OP_LINK, OP_OPEN, OP_READ, OP_WRITE, OP_FLUSH, OP_RELEASE, OP_FSYNC,
    OP_OPENDIR, OP_READDIRPLUS, OP_RELEASEDIR, OP_FSYNCDIR, OP_STATFS, OP_SETXATTR, OP_GETXATTR, OP_LISTXATTR,
    OP_REMOVEXATTR, OP_CREATE, OP_ENDED,
    OP_NATIVE_FIRST,                  /* the first read of a native handle (no answer): hits, promotion, atime */
    OP_READ_CORRUPT                   /* a native read found a frame corrupt: Python drops the file, answers EIO */
};

/* one received request, owned by the queue, then by its Request object */
struct kreq {
    struct kreq *next;
    int op;
    int has_fh;
    fuse_req_t req;
    uint64_t ino, ino2, fh, size, rdev;
    int64_t off;
    uint32_t flags, mode;
    uint32_t uid, gid, pid, umask;
    struct stat st;                   /* setattr */
    const char *name, *name2;         /* in payload, NUL-terminated */
    size_t namelen, name2len;
    const char *data;                 /* written bytes, xattr value, forget pairs */
    size_t datalen;
    char payload[];
};

static struct {
    struct fuse_session *se;
    pthread_mutex_t qlock;
    struct kreq *head, *tail;
    int efd;
    pthread_rwlock_t life;            /* read: a reply/notify in progress; write: destroying */
    int closed;                       /* under life */
    pthread_t thread;
    int running;                      /* the loop thread was started and not joined */
    unsigned max_threads;
    int clone_fd;
    int want_export, want_writeback, want_acl;
    int loop_result;
} S = {.qlock = PTHREAD_MUTEX_INITIALIZER, .life = PTHREAD_RWLOCK_INITIALIZER, .efd = -1};

static int exiting;                 /* exit() was asked: the join repeats the wake signal */
static int wake_signal(void) { return SIGRTMIN + 3; }
static void wake_handler(int sig) { (void)sig; }

/* ---- the worker side: no GIL ------------------------------------------------------------------------ */

static struct kreq *kreq_new(int op, fuse_req_t req, const char *name, const char *name2, const void *data,
                             size_t datalen) {
    size_t nl = name ? strlen(name) : 0, n2 = name2 ? strlen(name2) : 0;
    struct kreq *k = malloc(sizeof(*k) + (name ? nl + 1 : 0) + (name2 ? n2 + 1 : 0) + datalen);
    if (k == NULL)
        return NULL;
    memset(k, 0, sizeof(*k));
    k->op = op;
    k->req = req;
    char *p = k->payload;
    if (name) {
        memcpy(p, name, nl + 1);
        k->name = p;
        k->namelen = nl;
        p += nl + 1;
    }
    if (name2) {
        memcpy(p, name2, n2 + 1);
        k->name2 = p;
        k->name2len = n2;
        p += n2 + 1;
    }
    if (datalen) {
        memcpy(p, data, datalen);
        k->data = p;
        k->datalen = datalen;
    }
    if (req) {
        const struct fuse_ctx *c = fuse_req_ctx(req);
        k->uid = c->uid;
        k->gid = c->gid;
        k->pid = c->pid;
        k->umask = c->umask;
    }
    return k;
}

static void enqueue(struct kreq *k) {
    pthread_mutex_lock(&S.qlock);
    int was_empty = S.head == NULL;
    if (S.tail)
        S.tail->next = k;
    else
        S.head = k;
    S.tail = k;
    pthread_mutex_unlock(&S.qlock);
    if (was_empty) {
        uint64_t one = 1;
        ssize_t r;
        do
            r = write(S.efd, &one, sizeof(one));
        while (r < 0 && errno == EINTR);
    }
}

/* enqueue, or answer ENOMEM when the request could not be copied */
static void submit(struct kreq *k, fuse_req_t req) {
    if (k == NULL) {
        if (req)
            fuse_reply_err(req, ENOMEM);
        return;
    }
    enqueue(k);
}

/* ---- native reads of committed objects: served in the worker thread, no GIL, no trio round trip ------------
 *
 * At open, Python (kvfs/frontend/ops) hands over a committed, unsealed, lossless object of a local tier that nobody
 * writes: an fd opened on it (owned here until the last reference goes: an fd keeps reading the immutable object
 * across the mover's moves and unlinks), its raw size, frame size and frame table as stored (already verified by
 * Python: header and table checksums, every entry's bounds). A READ on that handle is answered here: the frames
 * covering [off, off+size) go through kvfs_read_frames (the codec kernel's, kvfs/codecs/_object.c: pread, the
 * payload checksum, decode, the raw checksum), and the reply is written from the decoded bytes.
 *
 * - A frame that fails a check is never served: the request goes to Python as OP_READ_CORRUPT (it marks the file
 *   corrupt, drops and quarantines it, answers EIO, as for a read of its own), and the handle's later reads go to
 *   Python too. An I/O error, a frame the kernel does not decode, or no memory: the request goes to Python as an
 *   ordinary READ (its own read path decides).
 * - Python still learns what it keeps: the first read of each handle is queued as OP_NATIVE_FIRST (hits per tier,
 *   read-triggered promotion, atime and the idle policy's last read); requests, bytes, frames, stored bytes per
 *   tier and a latency histogram are counted here and taken by `native_take` (the stats and the metrics).
 * - Bounded: the worker threads (max_threads), one decode buffer per thread (the frames of one request: at most
 *   MAX_SPAN bytes, else Python serves it) freed when the thread exits, and per handle the one frame last decoded
 *   for a read that wanted part of it (kept for the next part).
 * - A handle is found by its fh in a hash table; each read holds a reference, so a release (native_close) while a
 *   read runs frees the handle only after that read.
 */
typedef int (*read_frames_fn)(int fd, const uint8_t *table, size_t count, uint8_t *dst, size_t dst_len,
                              int64_t *at);
static read_frames_fn read_frames;   /* kvfs_read_frames of the loaded codec kernel (set_reader) */

enum { NR_DONE = 0, NR_PYTHON = 1, NR_CORRUPT = 2 };
enum { KVF_ERR_IO = -1, KVF_ERR_SHORT = -2, KVF_ERR_PAYLOAD = -3, KVF_ERR_DECODE = -4, KVF_ERR_RAW = -5,
       KVF_UNSUPPORTED = -6, KVF_ERR_NOMEM = -7, KVF_ERR_ARGS = -8 };
#define ENTRY_SIZE 36                 /* format.FRAME_ENTRY "<QIIBBHQQ" */
#define NH_BUCKETS 1024
#define MAX_TIERS 16
#define MAX_LAT 32
#define MAX_SPAN ((size_t)64 << 20)   /* decoded bytes one request may need (frames <= 16 MiB, reads <= 1 MiB) */

struct nh {
    struct nh *next;                  /* hash chain, under NT.lock */
    uint64_t fh, ino;
    int fd, tier;
    uint64_t raw_size;
    uint32_t frame_size, n_frames;
    uint8_t *table;                   /* n_frames entries as stored */
    int refs;                         /* atomic: the table's, and each read's */
    int disabled;                     /* atomic: reads go to Python (a writer opened the file, or corruption) */
    int first_done;                   /* atomic: OP_NATIVE_FIRST was queued */
    uint64_t bytes;                   /* atomic: logical bytes answered */
    uint64_t last_read_ns;            /* atomic: wall-clock time of the last read answered (atime, idle policy) */
    pthread_mutex_t cache_lock;
    uint8_t *cache;                   /* the frame last decoded for a partial read, or NULL */
    size_t cache_cap;
    int64_t cache_frame;              /* -1: none */
};

static struct {
    pthread_mutex_t lock;
    struct nh *buckets[NH_BUCKETS];
    size_t count;
} NT = {.lock = PTHREAD_MUTEX_INITIALIZER};

static struct {                       /* atomic adds; native_take reads and clears them */
    uint64_t reads, bytes, frames, cache_hits, fallbacks, corrupt;
    uint64_t stored[MAX_TIERS];
    uint64_t lat[MAX_LAT + 1];
    uint64_t lat_sum_ns;
} NC;
static uint64_t lat_bounds_ns[MAX_LAT];
static int n_lat;

#define ADD(field, v) __atomic_fetch_add(&(field), (v), __ATOMIC_RELAXED)
#define TAKE(field) __atomic_exchange_n(&(field), 0, __ATOMIC_RELAXED)

static void nh_put(struct nh *h) {
    if (__atomic_sub_fetch(&h->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    close(h->fd);
    free(h->table);
    free(h->cache);
    pthread_mutex_destroy(&h->cache_lock);
    free(h);
}

static struct nh *nh_get(uint64_t fh) {
    pthread_mutex_lock(&NT.lock);
    struct nh *h = NT.buckets[fh % NH_BUCKETS];
    while (h && h->fh != fh)
        h = h->next;
    if (h)
        __atomic_add_fetch(&h->refs, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_unlock(&NT.lock);
    return h;
}

/* removed from the table (its reads in progress keep it until they end); NULL when unknown */
static struct nh *nh_unlink(uint64_t fh) {
    pthread_mutex_lock(&NT.lock);
    struct nh **p = &NT.buckets[fh % NH_BUCKETS];
    while (*p && (*p)->fh != fh)
        p = &(*p)->next;
    struct nh *h = *p;
    if (h) {
        *p = h->next;
        __atomic_sub_fetch(&NT.count, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&NT.lock);
    return h;
}

/* this thread's decode buffer: freed when the thread exits (libfuse's idle workers do) */
struct tbuf { uint8_t *p; size_t cap; };
static pthread_key_t tbuf_key;
static pthread_once_t tbuf_once = PTHREAD_ONCE_INIT;
static void tbuf_free(void *v) {
    struct tbuf *b = v;
    free(b->p);
    free(b);
}
static void tbuf_init(void) { pthread_key_create(&tbuf_key, tbuf_free); }

static struct tbuf *tbuf_get(size_t need) {
    pthread_once(&tbuf_once, tbuf_init);
    struct tbuf *b = pthread_getspecific(tbuf_key);
    if (b == NULL) {
        b = calloc(1, sizeof(*b));
        if (b == NULL || pthread_setspecific(tbuf_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    if (b->cap < need) {
        free(b->p);
        b->p = malloc(need);
        b->cap = b->p ? need : 0;
        if (b->p == NULL)
            return NULL;
    }
    return b;
}

static uint32_t entry_u32(const uint8_t *e, int at) {
    uint32_t v;
    memcpy(&v, e + at, 4);
    return v;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static void count_read(struct nh *h, size_t n, uint64_t stored, uint32_t frames, uint64_t t0) {
    ADD(NC.reads, 1);
    ADD(NC.bytes, n);
    ADD(NC.frames, frames);
    if (stored && h->tier >= 0 && h->tier < MAX_TIERS)
        ADD(NC.stored[h->tier], stored);
    __atomic_fetch_add(&h->bytes, n, __ATOMIC_RELAXED);
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    __atomic_store_n(&h->last_read_ns, (uint64_t)wall.tv_sec * 1000000000ULL + (uint64_t)wall.tv_nsec,
                     __ATOMIC_RELAXED);
    uint64_t dt = now_ns() - t0;
    int b = 0;
    while (b < n_lat && dt > lat_bounds_ns[b])
        b++;
    ADD(NC.lat[b], 1);
    ADD(NC.lat_sum_ns, dt);
}

/* where a native read's bytes go: the FUSE reply, or (native_pread, tests) a buffer */
typedef struct { fuse_req_t req; uint8_t *out; size_t out_len; } sink_t;

static void sink_write(sink_t *s, const uint8_t *data, size_t len) {
    if (s->req) {
        fuse_reply_buf(s->req, (const char *)data, len);
    } else if (s->out) {
        if (len)
            memcpy(s->out, data, len);
        s->out_len = len;
    }
}

/* Serve [off, off+size) of handle h into s: NR_DONE (answered), NR_PYTHON (not answered: Python reads it) or
 * NR_CORRUPT (not answered; *code and *frame say what failed). */
static int native_serve(struct nh *h, size_t size, int64_t off, sink_t *s, int *code, int64_t *frame) {
    uint64_t t0 = now_ns();
    if (__atomic_load_n(&h->disabled, __ATOMIC_ACQUIRE) || off < 0 || read_frames == NULL)
        return NR_PYTHON;
    uint64_t start = (uint64_t)off;
    if (start >= h->raw_size || size == 0) {   /* at or past the end: no bytes, as the Python path answers */
        count_read(h, 0, 0, 0, t0);
        sink_write(s, NULL, 0);
        return NR_DONE;
    }
    uint64_t end = size > h->raw_size - start ? h->raw_size : start + size;
    uint64_t F = h->frame_size;
    uint64_t first = start / F, last = (end - 1) / F;
    if (last >= h->n_frames)
        return NR_PYTHON;   /* unreachable: Python checked the table against the raw size */
    uint64_t base = first * F;
    uint64_t span = (last + 1) * F < h->raw_size ? (last + 1) * F - base : h->raw_size - base;
    if (span > MAX_SPAN)
        return NR_PYTHON;
    int partial = first == last && (start != base || end != base + span);
    if (partial) {   /* the rest of a frame decoded for an earlier part of it? */
        pthread_mutex_lock(&h->cache_lock);
        if (h->cache_frame == (int64_t)first) {
            ADD(NC.cache_hits, 1);
            count_read(h, (size_t)(end - start), 0, 0, t0);
            sink_write(s, h->cache + (start - base), (size_t)(end - start));
            pthread_mutex_unlock(&h->cache_lock);
            return NR_DONE;
        }
        pthread_mutex_unlock(&h->cache_lock);
    }
    struct tbuf *b = tbuf_get((size_t)(partial ? F : span));
    if (b == NULL) {
        ADD(NC.fallbacks, 1);
        return NR_PYTHON;
    }
    int64_t at = 0;
    uint32_t count = (uint32_t)(last - first + 1);
    const uint8_t *entries = h->table + first * ENTRY_SIZE;
    int rc = read_frames(h->fd, entries, count, b->p, (size_t)span, &at);
    if (rc != 0) {
        if (rc == KVF_ERR_SHORT || rc == KVF_ERR_PAYLOAD || rc == KVF_ERR_DECODE || rc == KVF_ERR_RAW) {
            __atomic_store_n(&h->disabled, 1, __ATOMIC_RELEASE);
            ADD(NC.corrupt, 1);
            *code = rc;
            *frame = (int64_t)first + at;
            return NR_CORRUPT;
        }
        ADD(NC.fallbacks, 1);   /* I/O error, a codec the kernel does not decode, no memory */
        return NR_PYTHON;
    }
    uint64_t stored = 0;
    for (uint32_t i = 0; i < count; i++)
        if (!(entries[i * ENTRY_SIZE + 18] & 1))   /* not a hole */
            stored += entry_u32(entries + i * ENTRY_SIZE, 8);
    /* counted before the answer: a reader that reads .kvfs/stats next finds this read in it */
    count_read(h, (size_t)(end - start), stored, count, t0);
    sink_write(s, b->p + (start - base), (size_t)(end - start));
    if (partial) {   /* keep the decoded frame for the next part: this thread takes the old one's buffer */
        pthread_mutex_lock(&h->cache_lock);
        uint8_t *old = h->cache;
        size_t old_cap = h->cache_cap;
        h->cache = b->p;
        h->cache_cap = b->cap;
        h->cache_frame = (int64_t)first;
        pthread_mutex_unlock(&h->cache_lock);
        b->p = old;
        b->cap = old ? old_cap : 0;
    }
    return NR_DONE;
}

/* a READ in a libfuse worker: NR_DONE when answered here */
static int native_read(fuse_req_t req, uint64_t fh, size_t size, off_t off, int *code, int64_t *frame) {
    if (__atomic_load_n(&NT.count, __ATOMIC_RELAXED) == 0)   /* no native handle: no lock taken */
        return NR_PYTHON;
    struct nh *h = nh_get(fh);
    if (h == NULL)
        return NR_PYTHON;
    int res = NR_PYTHON;
    if (!__atomic_load_n(&h->disabled, __ATOMIC_ACQUIRE)) {
        if (!__atomic_exchange_n(&h->first_done, 1, __ATOMIC_ACQ_REL)) {
            /* queued before the answer: a request the reader sends after it is fetched after this */
            struct kreq *k = kreq_new(OP_NATIVE_FIRST, NULL, NULL, NULL, NULL, 0);
            if (k) {
                k->fh = fh;
                k->has_fh = 1;
                k->ino = h->ino;
                enqueue(k);
            }
        }
        sink_t s = {.req = req};
        res = native_serve(h, size, off, &s, code, frame);
    }
    nh_put(h);
    return res;
}

static void native_close_all(void) {
    pthread_mutex_lock(&NT.lock);
    struct nh *all = NULL;
    for (int i = 0; i < NH_BUCKETS; i++) {
        while (NT.buckets[i]) {
            struct nh *h = NT.buckets[i];
            NT.buckets[i] = h->next;
            h->next = all;
            all = h;
        }
    }
    __atomic_store_n(&NT.count, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&NT.lock);
    while (all) {
        struct nh *next = all->next;
        nh_put(all);
        all = next;
    }
}

/* ---- native sequential writes: WRITE of a file written in order, buffered and encoded in C threads -------------
 *
 * At create, or an open with O_TRUNC, of a file nobody else has open, Python (kvfs/frontend/native_write.py) registers
 * a write-only handle here (native_write_open) with the codec candidates of the file's encoding policy. A WRITE of
 * that handle at the offset where the last one ended is copied into the file's frames (frame_size bytes each, kept
 * until Python takes them) and answered at once, in the libfuse worker, without the GIL; a frame filled up is queued
 * to a small pool of encoder threads (kvfs_encode_frame of the codec kernel: hole, checksums, transform, codec, stored
 * raw when it does not shrink), so the frames of one writer are encoded in parallel while its next WRITEs arrive. The
 * codec is chosen from the first frame encoded, as EncodingPolicy._choose does (kvfs_choose).
 *
 * Anything else stops the handle: a WRITE at another offset, of nothing or past the size limit, a frame the memory
 * budget cannot hold (those go to Python as ordinary WRITEs), FLUSH, fsync, RELEASE, and whatever Python decides
 * (native_write_take: an open of the file by another handle, a truncate, ...). A stopped handle takes no more
 * WRITEs; FLUSH, fsync and RELEASE also encode what is left (the last frame, here in the worker, beside the pool)
 * and wait for the frames in flight before they are queued to Python. Python then takes the raw frames (their
 * buffers handed over, no copy) and their encodings into the file's OpenFile as dirty frames encoded early, and the
 * commit is OpenFile's own (kvfs/openfile.py): placement, quotas, sealing, the index, events and crash safety stay in
 * one place, and a handle stopped mid-way goes on in Python exactly as if Python had received its writes.
 *
 * Bounded: the raw frames held here count against the mount's dirty budget together with Python's (a frame that does
 * not fit sends its WRITE to Python, which answers ENOSPC as it would); a handle's frames queued or being encoded
 * (NW_MAX_PENDING, else the WRITE waits); the encoder threads (set_writer).
 */
typedef struct {   /* as the codec kernel fills it (_encode.c kvfs_frame_t) */
    uint32_t stored_len, raw_len;
    uint8_t codec, transform;
    uint16_t flags;
    uint64_t stored_xxh3, raw_xxh3;
} kvf_frame_t;
typedef int (*encode_frame_fn)(const uint8_t *raw, size_t n, int codec, int transform, int param, uint8_t *dst,
                               size_t cap, kvf_frame_t *f);
typedef int (*choose_fn)(const uint8_t *raw, size_t n, const int32_t *cands, int count, int auto_mode);
typedef size_t (*bound_fn)(size_t n);
static encode_frame_fn encode_frame;  /* the codec kernel's kvfs_encode_frame, kvfs_choose, kvfs_encode_bound */
static choose_fn choose_codec;
static bound_fn encode_bound;

#define NW_MAX_CANDS 8
#define NW_MAX_PENDING 16                 /* a handle's frames queued or being encoded; a WRITE past it waits */
#define NW_MAX_FILE ((uint64_t)64 << 30)  /* format.MAX_FILE_SIZE: a WRITE past it goes to Python (EFBIG) */
#define NW_MAX_ENCODERS 64
#define FRAME_HOLE_FLAG 1
#define CODEC_ZSTD_ID 1

enum { WF_FILLING = 0, WF_QUEUED, WF_ENCODING, WF_DONE };

struct wframe {
    uint8_t *raw;                         /* frame_size bytes, [0, len) written */
    uint8_t *payload;                     /* the coded payload; NULL for a hole or a frame stored raw (its raw bytes) */
    uint32_t len;
    uint8_t state;
    uint8_t encoded;                      /* f and payload are this frame's encoding of [0, len) */
    kvf_frame_t f;
};

struct nw {
    struct nw *next;                      /* hash chain, under NWT.lock */
    uint64_t fh, ino;
    int refs;                             /* atomic: the table's, each request's, each queued frame's */
    pthread_mutex_t lock;
    pthread_cond_t cond;                  /* a frame encoded, the codec chosen, the handle stopped */
    int active;                           /* WRITEs are taken here (under lock; read atomically) */
    int finished;                         /* stopped, every frame encoded (FLUSH, fsync, RELEASE) */
    uint32_t frame_size;
    struct wframe *frames;
    uint32_t n_frames, cap_frames;
    int pending;                          /* frames queued or being encoded */
    int chosen;                           /* 1: codec, transform, param are the file's; -1: none (Python encodes) */
    int choosing;
    int codec, transform, param;
    int n_cands, auto_mode;
    int32_t cands[3 * NW_MAX_CANDS];
    int encode_zstd;                      /* 0: zstd frames are left to Python (python-zstandard's exact output) */
    uint64_t size, writes, last_write_ns; /* written under lock, read atomically */
};

static struct {
    pthread_mutex_t lock;
    struct nw *buckets[NH_BUCKETS];
    size_t count;
} NWT = {.lock = PTHREAD_MUTEX_INITIALIZER};

struct nw_job { struct nw_job *next; struct nw *h; uint32_t i; };

static struct {                           /* the encoder threads */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct nw_job *head, *tail;
    pthread_t threads[NW_MAX_ENCODERS];
    int n_threads, want, stop;
    int nice;                             /* the encoders' nice value: the WRITE path's threads come first */
} EP = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

static struct { uint64_t limit, py_used, held; } NB = {.limit = UINT64_MAX};   /* the dirty budget (atomics) */

static struct {                           /* atomic adds; native_take reads and clears them */
    uint64_t writes, bytes, frames, fallbacks, budget_fallbacks, handles_taken;
    uint64_t lat[MAX_LAT + 1];
    uint64_t lat_sum_ns;
} NWC;

static uint64_t realtime_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

/* room for n more bytes of raw frames under the budget shared with Python's dirty frames */
static int budget_take(uint64_t n) {
    uint64_t held = __atomic_load_n(&NB.held, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t limit = __atomic_load_n(&NB.limit, __ATOMIC_RELAXED), py = __atomic_load_n(&NB.py_used, __ATOMIC_RELAXED);
        if (held + n + py > limit || held + n < held)
            return 0;
        if (__atomic_compare_exchange_n(&NB.held, &held, held + n, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return 1;
    }
}

static void budget_give(uint64_t n) { __atomic_fetch_sub(&NB.held, n, __ATOMIC_RELAXED); }

static void nw_free(struct nw *h) {
    for (uint32_t i = 0; i < h->n_frames; i++) {
        free(h->frames[i].raw);
        free(h->frames[i].payload);
    }
    budget_give((uint64_t)h->n_frames * h->frame_size);   /* frames handed to Python were counted out already */
    free(h->frames);
    pthread_mutex_destroy(&h->lock);
    pthread_cond_destroy(&h->cond);
    free(h);
}

static void nw_put(struct nw *h) {
    if (__atomic_sub_fetch(&h->refs, 1, __ATOMIC_ACQ_REL) == 0)
        nw_free(h);
}

static struct nw *nw_get(uint64_t fh) {
    pthread_mutex_lock(&NWT.lock);
    struct nw *h = NWT.buckets[fh % NH_BUCKETS];
    while (h && h->fh != fh)
        h = h->next;
    if (h)
        __atomic_add_fetch(&h->refs, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_unlock(&NWT.lock);
    return h;
}

static struct nw *nw_unlink(uint64_t fh) {
    pthread_mutex_lock(&NWT.lock);
    struct nw **p = &NWT.buckets[fh % NH_BUCKETS];
    while (*p && (*p)->fh != fh)
        p = &(*p)->next;
    struct nw *h = *p;
    if (h) {
        *p = h->next;
        __atomic_sub_fetch(&NWT.count, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&NWT.lock);
    return h;
}

static void nw_stop_locked(struct nw *h) {
    if (h->active) {
        __atomic_store_n(&h->active, 0, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&h->cond);
    }
}

/* Encode frame i, whose state the caller set to WF_ENCODING (counted in pending). Called and returns with h->lock
 * held; drops it while choosing and encoding. */
static void nw_encode(struct nw *h, uint32_t i) {
    while (h->chosen == 0) {   /* the first frame encoded chooses the file's codec, as in EncodingPolicy.encode */
        if (h->choosing) {
            pthread_cond_wait(&h->cond, &h->lock);
            continue;
        }
        h->choosing = 1;
        const uint8_t *raw = h->frames[i].raw;
        uint32_t len = h->frames[i].len;
        pthread_mutex_unlock(&h->lock);
        int c = choose_codec(raw, len, h->cands, h->n_cands, h->auto_mode);
        pthread_mutex_lock(&h->lock);
        h->choosing = 0;
        if (c >= 0 && c < h->n_cands) {
            h->codec = h->cands[3 * c];
            h->transform = h->cands[3 * c + 1];
            h->param = h->cands[3 * c + 2];
            h->chosen = 1;
        } else if (c == -1) {   /* incompressible: stored raw */
            h->codec = h->transform = h->param = 0;
            h->chosen = 1;
        } else {
            h->chosen = -1;     /* no memory, or a candidate the kernel cannot code: Python chooses and encodes */
        }
        pthread_cond_broadcast(&h->cond);
    }
    kvf_frame_t f;
    int rc = -1;
    uint8_t *dst = NULL;
    if (h->chosen > 0 && (h->codec != CODEC_ZSTD_ID || h->encode_zstd)) {
        const uint8_t *raw = h->frames[i].raw;
        uint32_t len = h->frames[i].len;
        int codec = h->codec, transform = h->transform, param = h->param;
        pthread_mutex_unlock(&h->lock);
        size_t cap = encode_bound(len);
        dst = malloc(cap);
        if (dst)
            rc = encode_frame(raw, len, codec, transform, param, dst, cap, &f);
        if (rc == 0 && !(f.flags & FRAME_HOLE_FLAG) && f.codec != 0) {
            uint8_t *shrunk = realloc(dst, f.stored_len ? f.stored_len : 1);
            if (shrunk)
                dst = shrunk;
        } else {
            free(dst);
            dst = NULL;
        }
        pthread_mutex_lock(&h->lock);
    }
    struct wframe *fr = &h->frames[i];
    fr->state = WF_DONE;
    fr->encoded = rc == 0;
    if (rc == 0) {
        fr->f = f;
        fr->payload = dst;
        ADD(NWC.frames, 1);
    }
    h->pending--;
    pthread_cond_broadcast(&h->cond);
}

static void *encoder_thread(void *arg) {
    (void)arg;
    if (EP.nice)   /* this thread only (Linux: a thread's own nice value) */
        (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), EP.nice);
    for (;;) {
        pthread_mutex_lock(&EP.lock);
        while (EP.head == NULL && !EP.stop)
            pthread_cond_wait(&EP.cond, &EP.lock);
        if (EP.head == NULL) {   /* stopping, nothing left */
            pthread_mutex_unlock(&EP.lock);
            return NULL;
        }
        struct nw_job *j = EP.head;
        EP.head = j->next;
        if (EP.head == NULL)
            EP.tail = NULL;
        pthread_mutex_unlock(&EP.lock);
        struct nw *h = j->h;
        uint32_t i = j->i;
        free(j);
        pthread_mutex_lock(&h->lock);
        if (i < h->n_frames && h->frames[i].state == WF_QUEUED) {   /* else a FLUSH encoded it meanwhile */
            h->frames[i].state = WF_ENCODING;
            nw_encode(h, i);
        }
        pthread_mutex_unlock(&h->lock);
        nw_put(h);
    }
}

/* Frame i is full: queue it to the encoders (h->lock held). Without memory for the job it stays unencoded here
 * (FLUSH encodes it, or Python at its commit). */
static void nw_queue(struct nw *h, uint32_t i) {
    struct nw_job *j = malloc(sizeof(*j));
    if (j == NULL)
        return;
    j->next = NULL;
    j->h = h;
    j->i = i;
    __atomic_add_fetch(&h->refs, 1, __ATOMIC_ACQ_REL);
    h->frames[i].state = WF_QUEUED;
    h->pending++;
    pthread_mutex_lock(&EP.lock);
    if (EP.tail)
        EP.tail->next = j;
    else
        EP.head = j;
    EP.tail = j;
    pthread_cond_signal(&EP.cond);
    pthread_mutex_unlock(&EP.lock);
}

enum { NW_TAKEN = 0, NW_PYTHON = 1 };

/* A WRITE of [off, off+size) on handle h: NW_TAKEN when its bytes are in the frames (the caller answers it), else
 * NW_PYTHON (the handle is stopped when it was still active: Python takes it over before this WRITE). */
static int nw_accept(struct nw *h, const char *buf, size_t size, int64_t off) {
    pthread_mutex_lock(&h->lock);
    for (;;) {
        if (!h->active) {
            pthread_mutex_unlock(&h->lock);
            return NW_PYTHON;
        }
        if (off < 0 || (uint64_t)off != h->size || size == 0 || size > NW_MAX_FILE - h->size) {
            nw_stop_locked(h);   /* not the next bytes in order: Python goes on from what is here */
            ADD(NWC.fallbacks, 1);
            pthread_mutex_unlock(&h->lock);
            return NW_PYTHON;
        }
        if (h->pending < NW_MAX_PENDING)
            break;
        pthread_cond_wait(&h->cond, &h->lock);   /* the encoders are behind: wait for one frame */
    }
    uint64_t F = h->frame_size, start = h->size, end = start + size;
    uint64_t need = (end + F - 1) / F, add = need - h->n_frames;
    if (add) {
        if (!budget_take(add * F)) {
            nw_stop_locked(h);   /* Python's write answers ENOSPC: the budget counts these frames */
            ADD(NWC.budget_fallbacks, 1);
            pthread_mutex_unlock(&h->lock);
            return NW_PYTHON;
        }
        uint32_t old = h->n_frames, k;
        if (need > h->cap_frames) {
            uint64_t cap = h->cap_frames ? (uint64_t)h->cap_frames * 2 : 4;
            while (cap < need)
                cap *= 2;
            struct wframe *grown = cap <= UINT32_MAX ? realloc(h->frames, cap * sizeof(*grown)) : NULL;
            if (grown == NULL)
                goto nomem;
            h->frames = grown;
            h->cap_frames = (uint32_t)cap;
        }
        for (k = old; k < need; k++) {
            memset(&h->frames[k], 0, sizeof(h->frames[k]));
            h->frames[k].raw = malloc(F);
            if (h->frames[k].raw == NULL) {
                while (k-- > old)
                    free(h->frames[k].raw);
                goto nomem;
            }
        }
        h->n_frames = (uint32_t)need;
    }
    const char *p = buf;
    for (uint64_t pos = start; pos < end;) {
        uint64_t i = pos / F, fo = pos % F, n = F - fo < end - pos ? F - fo : end - pos;
        struct wframe *fr = &h->frames[i];
        memcpy(fr->raw + fo, p, n);
        fr->len = (uint32_t)(fo + n);
        if (fr->len == F)
            nw_queue(h, (uint32_t)i);
        pos += n;
        p += n;
    }
    __atomic_store_n(&h->size, end, __ATOMIC_RELAXED);
    __atomic_store_n(&h->writes, h->writes + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&h->last_write_ns, realtime_ns(), __ATOMIC_RELAXED);
    pthread_mutex_unlock(&h->lock);
    return NW_TAKEN;
nomem:
    budget_give(add * F);
    nw_stop_locked(h);
    ADD(NWC.fallbacks, 1);
    pthread_mutex_unlock(&h->lock);
    return NW_PYTHON;
}

/* Stop h and encode what is left: the frames not queued (the last one) here, beside the encoders, and the queued
 * ones no encoder has started; then wait for those in flight. FLUSH, fsync and RELEASE do this in their worker
 * before they are queued to Python; native_write_take(block) too. */
static void nw_finish(struct nw *h) {
    pthread_mutex_lock(&h->lock);
    nw_stop_locked(h);
    if (!h->finished) {
        for (uint32_t i = 0; i < h->n_frames; i++) {   /* no WRITE is taken any more: the array stays */
            struct wframe *fr = &h->frames[i];
            if (fr->state == WF_FILLING && fr->len > 0) {
                fr->state = WF_ENCODING;
                h->pending++;
                nw_encode(h, i);
            } else if (fr->state == WF_QUEUED) {
                fr->state = WF_ENCODING;   /* its job finds it taken */
                nw_encode(h, i);
            }
        }
        while (h->pending > 0)
            pthread_cond_wait(&h->cond, &h->lock);
        h->finished = 1;
    }
    pthread_mutex_unlock(&h->lock);
}

/* a WRITE in a libfuse worker: NW_TAKEN when answered here */
static int native_write(fuse_req_t req, uint64_t fh, const char *buf, size_t size, off_t off) {
    if (__atomic_load_n(&NWT.count, __ATOMIC_RELAXED) == 0)   /* no native writer: no lock taken */
        return NW_PYTHON;
    struct nw *h = nw_get(fh);
    if (h == NULL)
        return NW_PYTHON;
    uint64_t t0 = now_ns();
    int res = nw_accept(h, buf, size, (int64_t)off);
    nw_put(h);
    if (res == NW_TAKEN) {   /* counted before the answer: a stats read the writer makes next finds it */
        ADD(NWC.writes, 1);
        ADD(NWC.bytes, size);
        uint64_t dt = now_ns() - t0;
        int b = 0;
        while (b < n_lat && dt > lat_bounds_ns[b])
            b++;
        ADD(NWC.lat[b], 1);
        ADD(NWC.lat_sum_ns, dt);
        fuse_reply_write(req, size);
    }
    return res;
}

/* FLUSH, fsync, RELEASE of a native writer: finish it before Python sees the request */
static void native_write_finish(uint64_t fh) {
    if (__atomic_load_n(&NWT.count, __ATOMIC_RELAXED) == 0)
        return;
    struct nw *h = nw_get(fh);
    if (h) {
        nw_finish(h);
        nw_put(h);
    }
}

static void native_write_close_all(void) {
    pthread_mutex_lock(&EP.lock);   /* the encoders end (each after its frame); queued frames are dropped */
    EP.stop = 1;
    pthread_cond_broadcast(&EP.cond);
    int n = EP.n_threads;
    pthread_mutex_unlock(&EP.lock);
    for (int i = 0; i < n; i++)
        pthread_join(EP.threads[i], NULL);
    pthread_mutex_lock(&EP.lock);
    struct nw_job *j = EP.head;
    EP.head = EP.tail = NULL;
    EP.n_threads = 0;
    EP.stop = 0;
    pthread_mutex_unlock(&EP.lock);
    while (j) {
        struct nw_job *next = j->next;
        nw_put(j->h);
        free(j);
        j = next;
    }
    pthread_mutex_lock(&NWT.lock);
    struct nw *all = NULL;
    for (int i = 0; i < NH_BUCKETS; i++) {
        while (NWT.buckets[i]) {
            struct nw *h = NWT.buckets[i];
            NWT.buckets[i] = h->next;
            h->next = all;
            all = h;
        }
    }
    __atomic_store_n(&NWT.count, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&NWT.lock);
    while (all) {
        struct nw *next = all->next;
        nw_put(all);
        all = next;
    }
}

#define FI(k, fi) do { if (fi) { (k)->fh = (fi)->fh; (k)->has_fh = 1; (k)->flags = (fi)->flags; } } while (0)

static void ll_init(void *userdata, struct fuse_conn_info *conn) {
    (void)userdata;
    conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO;
    if (S.want_export && (conn->capable & FUSE_CAP_EXPORT_SUPPORT))
        conn->want |= FUSE_CAP_EXPORT_SUPPORT;
    if (S.want_writeback && (conn->capable & FUSE_CAP_WRITEBACK_CACHE))
        conn->want |= FUSE_CAP_WRITEBACK_CACHE;
    if (S.want_acl && (conn->capable & FUSE_CAP_POSIX_ACL))
        conn->want |= FUSE_CAP_POSIX_ACL;
    struct kreq *k = kreq_new(OP_INIT, NULL, NULL, NULL, NULL, 0);
    if (k)
        enqueue(k);
}

static void ll_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    struct kreq *k = kreq_new(OP_LOOKUP, req, name, NULL, NULL, 0);
    if (k) k->ino = parent;
    submit(k, req);
}

static void ll_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
    uint64_t pair[2] = {ino, nlookup};
    struct kreq *k = kreq_new(OP_FORGET, NULL, NULL, NULL, pair, sizeof(pair));
    fuse_reply_none(req);
    if (k) enqueue(k);
}

static void ll_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets) {
    struct kreq *k = NULL;
    if (count <= SIZE_MAX / 16) {
        uint64_t *pairs = malloc(count * 16 + 16);
        if (pairs) {
            for (size_t i = 0; i < count; i++) {
                pairs[2 * i] = forgets[i].ino;
                pairs[2 * i + 1] = forgets[i].nlookup;
            }
            k = kreq_new(OP_FORGET, NULL, NULL, NULL, pairs, count * 16);
            free(pairs);
        }
    }
    fuse_reply_none(req);
    if (k) enqueue(k);
}

static void ll_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct kreq *k = kreq_new(OP_GETATTR, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); }
    submit(k, req);
}

static void ll_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set, struct fuse_file_info *fi) {
    struct kreq *k = kreq_new(OP_SETATTR, req, NULL, NULL, NULL, 0);
    if (k) {
        k->ino = ino;
        FI(k, fi);
        k->st = *attr;
        k->mode = (uint32_t)to_set;   /* the to_set bits */
    }
    submit(k, req);
}

static void ll_readlink(fuse_req_t req, fuse_ino_t ino) {
    struct kreq *k = kreq_new(OP_READLINK, req, NULL, NULL, NULL, 0);
    if (k) k->ino = ino;
    submit(k, req);
}

static void ll_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, dev_t rdev) {
    struct kreq *k = kreq_new(OP_MKNOD, req, name, NULL, NULL, 0);
    if (k) { k->ino = parent; k->mode = mode; k->rdev = rdev; }
    submit(k, req);
}

static void ll_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode) {
    struct kreq *k = kreq_new(OP_MKDIR, req, name, NULL, NULL, 0);
    if (k) { k->ino = parent; k->mode = (mode & ~S_IFMT) | S_IFDIR; }
    submit(k, req);
}

static void ll_unlink(fuse_req_t req, fuse_ino_t parent, const char *name) {
    struct kreq *k = kreq_new(OP_UNLINK, req, name, NULL, NULL, 0);
    if (k) k->ino = parent;
    submit(k, req);
}

static void ll_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name) {
    struct kreq *k = kreq_new(OP_RMDIR, req, name, NULL, NULL, 0);
    if (k) k->ino = parent;
    submit(k, req);
}

static void ll_symlink(fuse_req_t req, const char *link, fuse_ino_t parent, const char *name) {
    struct kreq *k = kreq_new(OP_SYMLINK, req, name, link, NULL, 0);
    if (k) k->ino = parent;
    submit(k, req);
}

static void ll_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                      const char *newname, unsigned int flags) {
    struct kreq *k = kreq_new(OP_RENAME, req, name, newname, NULL, 0);
    if (k) { k->ino = parent; k->ino2 = newparent; k->flags = flags; }
    submit(k, req);
}

static void ll_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char *newname) {
    struct kreq *k = kreq_new(OP_LINK, req, newname, NULL, NULL, 0);
    if (k) { k->ino = ino; k->ino2 = newparent; }
    submit(k, req);
}

static void ll_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct kreq *k = kreq_new(OP_OPEN, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); }
    submit(k, req);
}

static void ll_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    int64_t frame = 0;
    int code = 0;
    int served = native_read(req, fi->fh, size, off, &code, &frame);
    if (served == NR_DONE)
        return;
    struct kreq *k = kreq_new(served == NR_CORRUPT ? OP_READ_CORRUPT : OP_READ, req, NULL, NULL, NULL, 0);
    if (k) {
        k->ino = ino;
        FI(k, fi);
        k->size = size;
        k->off = off;
        if (served == NR_CORRUPT) {
            k->mode = (uint32_t)-code;   /* kvfs_read_frames' error, negated */
            k->ino2 = (uint64_t)frame;
        }
    }
    submit(k, req);
}

static void ll_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi) {
    if (native_write(req, fi->fh, buf, size, off) == NW_TAKEN)
        return;
    struct kreq *k = kreq_new(OP_WRITE, req, NULL, NULL, buf, size);
    if (k) { k->ino = ino; FI(k, fi); k->size = size; k->off = off; }
    submit(k, req);
}

static void ll_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    native_write_finish(fi->fh);   /* a native writer's frames are all encoded before Python sees the request */
    struct kreq *k = kreq_new(OP_FLUSH, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); }
    submit(k, req);
}

static void ll_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    native_write_finish(fi->fh);   /* a native writer's frames are all encoded before Python sees the request */
    struct kreq *k = kreq_new(OP_RELEASE, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); }
    submit(k, req);
}

static void ll_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi) {
    native_write_finish(fi->fh);
    struct kreq *k = kreq_new(OP_FSYNC, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); k->flags = (uint32_t)datasync; }
    submit(k, req);
}

static void ll_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct kreq *k = kreq_new(OP_OPENDIR, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); }
    submit(k, req);
}

static void ll_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    struct kreq *k = kreq_new(OP_READDIRPLUS, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); k->size = size; k->off = off; }
    submit(k, req);
}

static void ll_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct kreq *k = kreq_new(OP_RELEASEDIR, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); }
    submit(k, req);
}

static void ll_fsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi) {
    struct kreq *k = kreq_new(OP_FSYNCDIR, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; FI(k, fi); k->flags = (uint32_t)datasync; }
    submit(k, req);
}

static void ll_statfs(fuse_req_t req, fuse_ino_t ino) {
    struct kreq *k = kreq_new(OP_STATFS, req, NULL, NULL, NULL, 0);
    if (k) k->ino = ino;
    submit(k, req);
}

static void ll_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value, size_t size,
                        int flags) {
    struct kreq *k = kreq_new(OP_SETXATTR, req, name, NULL, value, size);
    if (k) { k->ino = ino; k->flags = (uint32_t)flags; k->size = size; }
    submit(k, req);
}

static void ll_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size) {
    /* kvfs keeps only user.* attributes (the Operations answer ENODATA for any other name; setxattr refuses them),
     * so other names are answered here, without a trip through Python: the kernel asks for security.capability
     * before every write(2) to a file (file_remove_privs), `ls -l` for security.selinux and
     * system.posix_acl_access of every entry. */
    if (strncmp(name, "user.", 5) != 0) {
        fuse_reply_err(req, ENODATA);
        return;
    }
    struct kreq *k = kreq_new(OP_GETXATTR, req, name, NULL, NULL, 0);
    if (k) { k->ino = ino; k->size = size; }
    submit(k, req);
}

static void ll_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
    struct kreq *k = kreq_new(OP_LISTXATTR, req, NULL, NULL, NULL, 0);
    if (k) { k->ino = ino; k->size = size; }
    submit(k, req);
}

static void ll_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name) {
    struct kreq *k = kreq_new(OP_REMOVEXATTR, req, name, NULL, NULL, 0);
    if (k) k->ino = ino;
    submit(k, req);
}

static void ll_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                      struct fuse_file_info *fi) {
    struct kreq *k = kreq_new(OP_CREATE, req, name, NULL, NULL, 0);
    if (k) { k->ino = parent; k->mode = mode; FI(k, fi); }
    submit(k, req);
}

static const struct fuse_lowlevel_ops ll_ops = {
    .init = ll_init, .lookup = ll_lookup, .forget = ll_forget, .forget_multi = ll_forget_multi,
    .getattr = ll_getattr, .setattr = ll_setattr, .readlink = ll_readlink, .mknod = ll_mknod,
    .mkdir = ll_mkdir, .unlink = ll_unlink, .rmdir = ll_rmdir, .symlink = ll_symlink, .rename = ll_rename,
    .link = ll_link, .open = ll_open, .read = ll_read, .write = ll_write, .flush = ll_flush,
    .release = ll_release, .fsync = ll_fsync, .opendir = ll_opendir, .readdirplus = ll_readdirplus,
    .releasedir = ll_releasedir, .fsyncdir = ll_fsyncdir, .statfs = ll_statfs, .setxattr = ll_setxattr,
    .getxattr = ll_getxattr, .listxattr = ll_listxattr, .removexattr = ll_removexattr, .create = ll_create,
};

static void *loop_thread(void *arg) {
    (void)arg;
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    int res = -ENOMEM;
    if (cfg) {
        fuse_loop_cfg_set_clone_fd(cfg, (unsigned)S.clone_fd);
        fuse_loop_cfg_set_max_threads(cfg, S.max_threads);
        fuse_loop_cfg_set_idle_threads(cfg, S.max_threads < 4 ? S.max_threads : 4);
        res = fuse_session_loop_mt(S.se, cfg);
        fuse_loop_cfg_destroy(cfg);
    }
    S.loop_result = res;
    struct kreq *k = kreq_new(OP_ENDED, NULL, NULL, NULL, NULL, 0);
    if (k) {
        k->off = res;
        enqueue(k);
    } else {   /* the eventfd still says so: fetch() then finds no ENDED, and the caller checks running() */
        uint64_t one = 1;
        ssize_t r = write(S.efd, &one, sizeof(one));
        (void)r;
    }
    return NULL;
}

/* ---- Request objects (the trio side, GIL held) ------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    struct kreq *k;
    int replied;
    int exports;                      /* buffer views of the written bytes */
    /* copies of the scalar fields, for the member table */
    int op;
    unsigned long long ino, ino2, fh, size, rdev;
    long long off;
    unsigned int flags, mode, uid, gid, pid, umask;
    int has_fh;
} RequestObject;

static PyTypeObject RequestType;

static int begin_reply(RequestObject *r) {
    if (r->replied || r->k == NULL || r->k->req == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "request already answered");
        return -1;
    }
    r->replied = 1;
    return 0;
}

/* run a libfuse reply with the GIL released and the session kept alive; -ENOTCONN once closed */
#define REPLY(r, call) ({ int _ret; fuse_req_t req = (r)->k->req; (void)req; \
    Py_BEGIN_ALLOW_THREADS pthread_rwlock_rdlock(&S.life); \
    _ret = S.closed ? -ENOTCONN : (call); \
    pthread_rwlock_unlock(&S.life); Py_END_ALLOW_THREADS _ret; })

static PyObject *result(int ret) {
    return PyLong_FromLong(ret);   /* 0, or -errno as libfuse says (the daemon logs it at DEBUG) */
}

static void Request_dealloc(RequestObject *r) {
    if (r->k) {
        if (!r->replied && r->k->req) {
            /* dropped without an answer: EIO, so the caller does not wait forever */
            r->replied = 1;
            fuse_req_t req = r->k->req;
            pthread_rwlock_rdlock(&S.life);
            if (!S.closed)
                fuse_reply_err(req, EIO);
            pthread_rwlock_unlock(&S.life);
        }
        free(r->k);
    }
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Request_reply_err(RequestObject *r, PyObject *arg) {
    long e = PyLong_AsLong(arg);
    if (e == -1 && PyErr_Occurred())
        return NULL;
    if (e < 0 || e > 4095)
        e = EIO;
    if (begin_reply(r) < 0)
        return NULL;
    return result(REPLY(r, fuse_reply_err(req, (int)e)));
}

static PyObject *Request_reply_none(RequestObject *r, PyObject *unused) {
    if (begin_reply(r) < 0)
        return NULL;
    REPLY(r, (fuse_reply_none(req), 0));
    Py_RETURN_NONE;
}

/* attributes as the bridge passes them: (ino, generation, entry_timeout, attr_timeout, mode, nlink, uid, gid,
 * rdev, size, blksize, blocks, atime_ns, mtime_ns, ctime_ns) */
static int parse_entry(PyObject *t, struct fuse_entry_param *e) {
    unsigned long long ino, gen, mode, nlink, uid, gid, rdev, blksize;
    long long size, blocks, at, mt, ct;
    double et, att;
    memset(e, 0, sizeof(*e));
    if (!PyArg_ParseTuple(t, "KKddKKKKKLKLLLL;attributes", &ino, &gen, &et, &att, &mode, &nlink, &uid, &gid,
                          &rdev, &size, &blksize, &blocks, &at, &mt, &ct))
        return -1;
    e->ino = ino;
    e->generation = gen;
    e->entry_timeout = et;
    e->attr_timeout = att;
    struct stat *s = &e->attr;
    s->st_ino = ino;
    s->st_mode = (mode_t)mode;
    s->st_nlink = (nlink_t)nlink;
    s->st_uid = (uid_t)uid;
    s->st_gid = (gid_t)gid;
    s->st_rdev = (dev_t)rdev;
    s->st_size = size;
    s->st_blksize = (blksize_t)blksize;
    s->st_blocks = blocks;
#define NS(field, v) do { long long _v = (v); s->field.tv_sec = _v / 1000000000LL; \
        s->field.tv_nsec = _v % 1000000000LL; \
        if (s->field.tv_nsec < 0) { s->field.tv_nsec += 1000000000LL; s->field.tv_sec -= 1; } } while (0)
    NS(st_atim, at);
    NS(st_mtim, mt);
    NS(st_ctim, ct);
#undef NS
    return 0;
}

static PyObject *Request_reply_entry(RequestObject *r, PyObject *arg) {
    struct fuse_entry_param e;
    if (parse_entry(arg, &e) < 0 || begin_reply(r) < 0)
        return NULL;
    return result(REPLY(r, fuse_reply_entry(req, &e)));
}

static PyObject *Request_reply_attr(RequestObject *r, PyObject *arg) {
    struct fuse_entry_param e;
    if (parse_entry(arg, &e) < 0 || begin_reply(r) < 0)
        return NULL;
    return result(REPLY(r, fuse_reply_attr(req, &e.attr, e.attr_timeout)));
}

static int fill_fi(struct fuse_file_info *fi, RequestObject *r, unsigned long long fh, int direct_io,
                   int keep_cache, int nonseekable) {
    memset(fi, 0, sizeof(*fi));
    fi->flags = (int)r->flags;
    fi->fh = fh;
    fi->direct_io = direct_io ? 1 : 0;
    fi->keep_cache = keep_cache ? 1 : 0;
    fi->nonseekable = nonseekable ? 1 : 0;
    return 0;
}

/* reply_open(fh, direct_io, keep_cache, nonseekable, noflush=False) */
static PyObject *Request_reply_open(RequestObject *r, PyObject *args) {
    unsigned long long fh;
    int dio, keep, nonseek, noflush = 0;
    struct fuse_file_info fi;
    if (!PyArg_ParseTuple(args, "Kppp|p", &fh, &dio, &keep, &nonseek, &noflush) || begin_reply(r) < 0)
        return NULL;
    fill_fi(&fi, r, fh, dio, keep, nonseek);
    fi.noflush = noflush ? 1 : 0;   /* a native read-only handle: its FLUSH would do nothing */
    return result(REPLY(r, fuse_reply_open(req, &fi)));
}

static PyObject *Request_reply_create(RequestObject *r, PyObject *args) {
    PyObject *attrs;
    unsigned long long fh;
    int dio, keep, nonseek;
    struct fuse_file_info fi;
    struct fuse_entry_param e;
    if (!PyArg_ParseTuple(args, "O!Kppp", &PyTuple_Type, &attrs, &fh, &dio, &keep, &nonseek))
        return NULL;
    if (parse_entry(attrs, &e) < 0 || begin_reply(r) < 0)
        return NULL;
    fill_fi(&fi, r, fh, dio, keep, nonseek);
    return result(REPLY(r, fuse_reply_create(req, &e, &fi)));
}

static PyObject *Request_reply_buf(RequestObject *r, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_CONTIG_RO) < 0)
        return NULL;
    if (begin_reply(r) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int ret = REPLY(r, fuse_reply_buf(req, view.buf, (size_t)view.len));
    PyBuffer_Release(&view);
    return result(ret);
}

static PyObject *Request_reply_write(RequestObject *r, PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (begin_reply(r) < 0)
        return NULL;
    return result(REPLY(r, fuse_reply_write(req, (size_t)n)));
}

static PyObject *Request_reply_xattr(RequestObject *r, PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (begin_reply(r) < 0)
        return NULL;
    return result(REPLY(r, fuse_reply_xattr(req, (size_t)n)));
}

static PyObject *Request_reply_readlink(RequestObject *r, PyObject *arg) {
    const char *target;
    if (!PyArg_Parse(arg, "y", &target) || begin_reply(r) < 0)   /* "y": no NUL inside */
        return NULL;
    return result(REPLY(r, fuse_reply_readlink(req, target)));
}

/* (bsize, frsize, blocks, bfree, bavail, files, ffree, favail, namemax) */
static PyObject *Request_reply_statfs(RequestObject *r, PyObject *arg) {
    unsigned long long bs, frs, b, bf, ba, f, ff, fa, nm;
    if (!PyArg_ParseTuple(arg, "KKKKKKKKK", &bs, &frs, &b, &bf, &ba, &f, &ff, &fa, &nm) || begin_reply(r) < 0)
        return NULL;
    struct statvfs st;
    memset(&st, 0, sizeof(st));
    st.f_bsize = bs;
    st.f_frsize = frs;
    st.f_blocks = b;
    st.f_bfree = bf;
    st.f_bavail = ba;
    st.f_files = f;
    st.f_ffree = ff;
    st.f_favail = fa;
    st.f_namemax = nm;
    return result(REPLY(r, fuse_reply_statfs(req, &st)));
}

static PyObject *Request_get_name(RequestObject *r, void *which) {
    const char *s = which ? r->k->name2 : r->k->name;
    if (s == NULL)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(s, (Py_ssize_t)(which ? r->k->name2len : r->k->namelen));
}

static PyObject *Request_get_data(RequestObject *r, void *unused) {
    return PyMemoryView_FromObject((PyObject *)r);
}

static PyObject *Request_get_forgets(RequestObject *r, void *unused) {
    size_t n = r->k->datalen / 16;
    const uint64_t *p = (const uint64_t *)r->k->data;
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        uint64_t ino, cnt;
        memcpy(&ino, p + 2 * i, 8);
        memcpy(&cnt, p + 2 * i + 1, 8);
        PyObject *t = Py_BuildValue("(KK)", (unsigned long long)ino, (unsigned long long)cnt);
        if (t == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    return list;
}

/* setattr: (to_set, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns) */
static PyObject *Request_get_setattr(RequestObject *r, void *unused) {
    const struct stat *s = &r->k->st;
    return Py_BuildValue("(IIIILLLL)", r->mode, (unsigned)s->st_mode, (unsigned)s->st_uid, (unsigned)s->st_gid,
                         (long long)s->st_size,
                         (long long)s->st_atim.tv_sec * 1000000000LL + s->st_atim.tv_nsec,
                         (long long)s->st_mtim.tv_sec * 1000000000LL + s->st_mtim.tv_nsec,
                         (long long)s->st_ctim.tv_sec * 1000000000LL + s->st_ctim.tv_nsec);
}

static int Request_getbuffer(RequestObject *r, Py_buffer *view, int flags) {
    const char *data = r->k && r->k->data ? r->k->data : "";
    size_t len = r->k && r->k->data ? r->k->datalen : 0;
    if (PyBuffer_FillInfo(view, (PyObject *)r, (void *)data, (Py_ssize_t)len, 1, flags) < 0)
        return -1;
    r->exports++;
    return 0;
}

static void Request_releasebuffer(RequestObject *r, Py_buffer *view) { r->exports--; }

static PyBufferProcs Request_as_buffer = {(getbufferproc)Request_getbuffer, (releasebufferproc)Request_releasebuffer};

static PyMethodDef Request_methods[] = {
    {"reply_err", (PyCFunction)Request_reply_err, METH_O, NULL},
    {"reply_none", (PyCFunction)Request_reply_none, METH_NOARGS, NULL},
    {"reply_entry", (PyCFunction)Request_reply_entry, METH_O, NULL},
    {"reply_attr", (PyCFunction)Request_reply_attr, METH_O, NULL},
    {"reply_open", (PyCFunction)Request_reply_open, METH_VARARGS, NULL},
    {"reply_create", (PyCFunction)Request_reply_create, METH_VARARGS, NULL},
    {"reply_buf", (PyCFunction)Request_reply_buf, METH_O, NULL},
    {"reply_write", (PyCFunction)Request_reply_write, METH_O, NULL},
    {"reply_xattr", (PyCFunction)Request_reply_xattr, METH_O, NULL},
    {"reply_readlink", (PyCFunction)Request_reply_readlink, METH_O, NULL},
    {"reply_statfs", (PyCFunction)Request_reply_statfs, METH_O, NULL},
    {NULL}
};

static PyGetSetDef Request_getset[] = {
    {"name", (getter)Request_get_name, NULL, NULL, NULL},
    {"name2", (getter)Request_get_name, NULL, NULL, (void *)1},
    {"data", (getter)Request_get_data, NULL, NULL, NULL},
    {"forgets", (getter)Request_get_forgets, NULL, NULL, NULL},
    {"setattr", (getter)Request_get_setattr, NULL, NULL, NULL},
    {NULL}
};

#define M(name, type, field) {name, type, offsetof(RequestObject, field), READONLY, NULL}
static PyMemberDef Request_members[] = {
    M("op", T_INT, op), M("ino", T_ULONGLONG, ino), M("ino2", T_ULONGLONG, ino2), M("fh", T_ULONGLONG, fh),
    M("size", T_ULONGLONG, size), M("rdev", T_ULONGLONG, rdev), M("off", T_LONGLONG, off),
    M("flags", T_UINT, flags), M("mode", T_UINT, mode), M("uid", T_UINT, uid), M("gid", T_UINT, gid),
    M("pid", T_UINT, pid), M("umask", T_UINT, umask), M("has_fh", T_INT, has_fh), M("replied", T_INT, replied),
    {NULL}
};
#undef M

static PyTypeObject RequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfs.frontend._loop.Request",
    .tp_basicsize = sizeof(RequestObject),
    .tp_dealloc = (destructor)Request_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One FUSE request, answered once through a reply_* method (EIO when dropped unanswered).",
    .tp_methods = Request_methods,
    .tp_members = Request_members,
    .tp_getset = Request_getset,
    .tp_as_buffer = &Request_as_buffer,
};

static PyObject *wrap(struct kreq *k) {
    RequestObject *r = PyObject_New(RequestObject, &RequestType);
    if (r == NULL)
        return NULL;
    r->k = k;
    r->replied = k->req == NULL;   /* init, forget, ended: nothing to answer */
    r->exports = 0;
    r->op = k->op;
    r->ino = k->ino;
    r->ino2 = k->ino2;
    r->fh = k->fh;
    r->size = k->size;
    r->rdev = k->rdev;
    r->off = k->off;
    r->flags = k->flags;
    r->mode = k->mode;
    r->uid = k->uid;
    r->gid = k->gid;
    r->pid = k->pid;
    r->umask = k->umask;
    r->has_fh = k->has_fh;
    return (PyObject *)r;
}

/* ---- module functions ----------------------------------------------------------------------------- */

static PyObject *m_mount(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"mountpoint", "options", "export_support", "writeback_cache", "acl", NULL};
    const char *mountpoint, *options;
    int exp = 0, wb = 0, acl = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ss|ppp", names, &mountpoint, &options, &exp, &wb, &acl))
        return NULL;
    if (S.se != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a session exists already (one per process)");
        return NULL;
    }
    S.want_export = exp;
    S.want_writeback = wb;
    S.want_acl = acl;
    if (S.efd < 0) {
        S.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (S.efd < 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    char *argv[] = {"kvfs", "-o", (char *)options, NULL};
    struct fuse_args fargs = FUSE_ARGS_INIT(options[0] ? 3 : 1, argv);
    struct fuse_session *se = fuse_session_new(&fargs, &ll_ops, sizeof(ll_ops), NULL);
    fuse_opt_free_args(&fargs);
    if (se == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fuse_session_new() failed");
        return NULL;
    }
    int res;
    Py_BEGIN_ALLOW_THREADS
    res = fuse_session_mount(se, mountpoint);
    Py_END_ALLOW_THREADS
    if (res != 0) {
        fuse_session_destroy(se);
        PyErr_SetString(PyExc_RuntimeError, "fuse_session_mount() failed");
        return NULL;
    }
    pthread_rwlock_wrlock(&S.life);
    S.se = se;
    S.closed = 0;
    pthread_rwlock_unlock(&S.life);
    Py_RETURN_NONE;
}

static PyObject *m_start(PyObject *self, PyObject *args) {
    unsigned int max_threads;
    int clone_fd;
    if (!PyArg_ParseTuple(args, "Ip", &max_threads, &clone_fd))
        return NULL;
    if (S.se == NULL || S.running) {
        PyErr_SetString(PyExc_RuntimeError, S.se ? "the loop runs already" : "not mounted");
        return NULL;
    }
    S.max_threads = max_threads ? max_threads : 1;
    S.clone_fd = clone_fd;
    /* the loop's threads take no process signals (Python's main thread does), except the one that wakes
     * the loop at exit(); the workers inherit this mask */
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = wake_handler;   /* no SA_RESTART: sem_wait returns EINTR */
    sigemptyset(&sa.sa_mask);
    if (sigaction(wake_signal(), &sa, NULL) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    sigset_t all, old;
    sigfillset(&all);
    sigdelset(&all, wake_signal());
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGABRT);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err = pthread_create(&S.thread, NULL, loop_thread, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    S.running = 1;
    Py_RETURN_NONE;
}

static PyObject *m_fileno(PyObject *self, PyObject *unused) { return PyLong_FromLong(S.efd); }

static PyObject *m_fetch(PyObject *self, PyObject *unused) {
    uint64_t v;
    /* read before taking the queue: a request appended after the take finds it empty and writes again */
    ssize_t rr = read(S.efd, &v, sizeof(v));
    (void)rr;
    pthread_mutex_lock(&S.qlock);
    struct kreq *k = S.head;
    S.head = S.tail = NULL;
    pthread_mutex_unlock(&S.qlock);
    PyObject *list = PyList_New(0);
    while (k) {
        struct kreq *next = k->next;
        k->next = NULL;
        PyObject *r = list ? wrap(k) : NULL;
        if (r == NULL) {   /* out of memory: answer what is left, keep going */
            if (k->req)
                fuse_reply_err(k->req, ENOMEM);
            free(k);
        } else {
            if (PyList_Append(list, r) < 0)
                Py_CLEAR(list);
            Py_DECREF(r);   /* the list holds it; dropped: answered EIO */
        }
        k = next;
    }
    if (list == NULL)
        PyErr_Clear(), list = PyList_New(0);
    return list;
}

/* Make the loop return: the session is marked as exited and the loop's main thread, waiting for a worker to
 * finish, is woken; libfuse then cancels the workers (blocked in read) and joins them. */
static PyObject *m_exit(PyObject *self, PyObject *unused) {
    if (S.se == NULL)
        Py_RETURN_NONE;
    fuse_session_exit(S.se);
    if (S.running) {
        exiting = 1;
        pthread_kill(S.thread, wake_signal());
    }
    Py_RETURN_NONE;
}

static PyObject *m_join(PyObject *self, PyObject *unused) {
    if (!S.running)
        return PyLong_FromLong(S.loop_result);
    int err;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {   /* a wake signal sent just before the loop's sem_wait would be lost: send it again */
        struct timespec deadline;
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_nsec += 100 * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec += 1;
            deadline.tv_nsec -= 1000000000L;
        }
        err = pthread_timedjoin_np(S.thread, NULL, &deadline);
        if (err != ETIMEDOUT)
            break;
        if (exiting)
            pthread_kill(S.thread, wake_signal());
    }
    Py_END_ALLOW_THREADS
    S.running = 0;
    exiting = 0;
    return PyLong_FromLong(S.loop_result);
}

static PyObject *m_close(PyObject *self, PyObject *args) {
    int unmount = 1;
    if (!PyArg_ParseTuple(args, "|p", &unmount))
        return NULL;
    if (S.se == NULL)
        Py_RETURN_NONE;
    if (S.running) {   /* close() without a finished loop: stop it first */
        fuse_session_exit(S.se);
        if (unmount) {
            Py_BEGIN_ALLOW_THREADS
            fuse_session_unmount(S.se);   /* the workers' reads fail: the loop ends */
            Py_END_ALLOW_THREADS
            unmount = 0;
        }
        exiting = 1;
        pthread_kill(S.thread, wake_signal());
        PyObject *r = m_join(self, NULL);
        Py_XDECREF(r);
    }
    Py_BEGIN_ALLOW_THREADS
    if (unmount)
        fuse_session_unmount(S.se);
    pthread_rwlock_wrlock(&S.life);
    S.closed = 1;
    struct fuse_session *se = S.se;
    S.se = NULL;
    pthread_rwlock_unlock(&S.life);
    fuse_session_destroy(se);
    Py_END_ALLOW_THREADS
    /* requests still queued (never fetched) are freed unanswered: the connection is gone */
    pthread_mutex_lock(&S.qlock);
    struct kreq *k = S.head;
    S.head = S.tail = NULL;
    pthread_mutex_unlock(&S.qlock);
    while (k) {
        struct kreq *next = k->next;
        free(k);
        k = next;
    }
    native_close_all();   /* no worker is left to read: every fd goes */
    native_write_close_all();   /* the encoders end; writers Python did not take are dropped */
    Py_RETURN_NONE;
}

/* notifications: like pyfuse3's, OSError(errno) on failure; blocking calls, with the GIL released */
#define NOTIFY(call) ({ int _ret; Py_BEGIN_ALLOW_THREADS pthread_rwlock_rdlock(&S.life); \
    _ret = (S.closed || S.se == NULL) ? -ENOTCONN : (call); pthread_rwlock_unlock(&S.life); \
    Py_END_ALLOW_THREADS _ret; })

static PyObject *notify_result(int ret, const char *what) {
    if (ret != 0) {
        PyObject *e = PyObject_CallFunction(PyExc_OSError, "is", -ret, what);
        if (e) {
            PyErr_SetObject((PyObject *)Py_TYPE(e), e);
            Py_DECREF(e);
        }
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *m_invalidate_entry(PyObject *self, PyObject *args) {
    unsigned long long parent, deleted = 0;
    const char *name;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Ky#|K", &parent, &name, &len, &deleted))
        return NULL;
    int ret = deleted ? NOTIFY(fuse_lowlevel_notify_delete(S.se, parent, deleted, name, (size_t)len))
                      : NOTIFY(fuse_lowlevel_notify_inval_entry(S.se, parent, name, (size_t)len));
    return notify_result(ret, "fuse_lowlevel_notify_inval_entry");
}

static PyObject *m_invalidate_inode(PyObject *self, PyObject *args) {
    unsigned long long ino;
    int attr_only = 0;
    if (!PyArg_ParseTuple(args, "K|p", &ino, &attr_only))
        return NULL;
    int ret = NOTIFY(fuse_lowlevel_notify_inval_inode(S.se, ino, attr_only ? -1 : 0, 0));
    return notify_result(ret, "fuse_lowlevel_notify_inval_inode");
}

static PyObject *m_notify_store(PyObject *self, PyObject *args) {
    unsigned long long ino;
    long long off;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "KLy*", &ino, &off, &view))
        return NULL;
    struct fuse_bufvec bv = FUSE_BUFVEC_INIT((size_t)view.len);
    bv.buf[0].mem = view.buf;
    int ret = NOTIFY(fuse_lowlevel_notify_store(S.se, ino, off, &bv, 0));
    PyBuffer_Release(&view);
    return notify_result(ret, "fuse_lowlevel_notify_store");
}

/* add_direntry_plus(bytearray, pos, name, attributes, next_id) -> the new pos, or -1 when it does not fit */
static PyObject *m_add_direntry_plus(PyObject *self, PyObject *args) {
    PyObject *buf, *attrs;
    Py_ssize_t pos, namelen;
    const char *name;
    long long next_id;
    struct fuse_entry_param e;
    if (!PyArg_ParseTuple(args, "O!ny#O!L", &PyByteArray_Type, &buf, &pos, &name, &namelen, &PyTuple_Type, &attrs,
                          &next_id))
        return NULL;
    if (parse_entry(attrs, &e) < 0)
        return NULL;
    Py_ssize_t cap = PyByteArray_GET_SIZE(buf);
    if (pos < 0 || pos > cap) {
        PyErr_SetString(PyExc_ValueError, "position outside the buffer");
        return NULL;
    }
    if ((size_t)namelen != strlen(name)) {
        PyErr_SetString(PyExc_ValueError, "a name with a NUL byte");
        return NULL;
    }
    char *base = PyByteArray_AS_STRING(buf);
    size_t need = fuse_add_direntry_plus(NULL, base + pos, (size_t)(cap - pos), name, &e, next_id);
    if (need > (size_t)(cap - pos))
        return PyLong_FromLong(-1);
    return PyLong_FromSsize_t(pos + (Py_ssize_t)need);
}


/* ---- native reads: what Python calls (GIL held; nothing here waits for a worker) --------------------------- */

/* set_reader(address of kvfs_read_frames, latency bucket bounds in seconds) */
static PyObject *m_set_reader(PyObject *self, PyObject *args) {
    unsigned long long addr;
    PyObject *bounds;
    if (!PyArg_ParseTuple(args, "KO!", &addr, &PyTuple_Type, &bounds))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    if (n > MAX_LAT) {
        PyErr_SetString(PyExc_ValueError, "too many latency buckets");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = PyFloat_AsDouble(PyTuple_GET_ITEM(bounds, i));
        if (v == -1.0 && PyErr_Occurred())
            return NULL;
        lat_bounds_ns[i] = v <= 0 ? 0 : (uint64_t)(v * 1e9);
    }
    n_lat = (int)n;
    read_frames = (read_frames_fn)(uintptr_t)addr;
    Py_RETURN_NONE;
}

/* native_open(fh, ino, tier, fd, raw_size, frame_size, table): fd is this module's from now on, even on error */
static PyObject *m_native_open(PyObject *self, PyObject *args) {
    unsigned long long fh, ino, raw_size;
    int tier, fd;
    unsigned int frame_size;
    Py_buffer table;
    if (!PyArg_ParseTuple(args, "KKiiKIy*", &fh, &ino, &tier, &fd, &raw_size, &frame_size, &table))
        return NULL;
    const char *why = NULL;
    uint64_t n = frame_size ? (raw_size + frame_size - 1) / frame_size : 0;
    if (read_frames == NULL)
        why = "no frame reader (set_reader)";
    else if (frame_size == 0 || n > UINT32_MAX || (uint64_t)table.len != n * ENTRY_SIZE)
        why = "the frame table does not match the sizes";
    struct nh *h = why ? NULL : calloc(1, sizeof(*h));
    uint8_t *copy = h ? malloc(table.len ? (size_t)table.len : 1) : NULL;
    if (why == NULL && (h == NULL || copy == NULL))
        why = "no memory";
    if (why) {
        PyBuffer_Release(&table);
        free(h);
        free(copy);
        close(fd);
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    memcpy(copy, table.buf, (size_t)table.len);
    PyBuffer_Release(&table);
    h->fh = fh;
    h->ino = ino;
    h->tier = tier;
    h->fd = fd;
    h->raw_size = raw_size;
    h->frame_size = frame_size;
    h->n_frames = (uint32_t)n;
    h->table = copy;
    h->refs = 1;
    h->cache_frame = -1;
    pthread_mutex_init(&h->cache_lock, NULL);
    struct nh *old = nh_unlink(fh);   /* an fh is never given out twice; should one be, the new one wins */
    if (old)
        nh_put(old);
    pthread_mutex_lock(&NT.lock);
    h->next = NT.buckets[fh % NH_BUCKETS];
    NT.buckets[fh % NH_BUCKETS] = h;
    __atomic_add_fetch(&NT.count, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&NT.lock);
    Py_RETURN_NONE;
}

/* native_last_read(fh) -> wall-clock ns of the handle's last read answered; 0: none, or not known here. A RELEASE
 * can reach Python after later requests (a utimensat): it notes the read's time, not its own. */
static PyObject *m_native_last_read(PyObject *self, PyObject *args) {
    unsigned long long fh;
    if (!PyArg_ParseTuple(args, "K", &fh))
        return NULL;
    struct nh *h = nh_get(fh);
    if (h == NULL)
        return PyLong_FromLong(0);
    unsigned long long t = __atomic_load_n(&h->last_read_ns, __ATOMIC_RELAXED);
    nh_put(h);
    return PyLong_FromUnsignedLongLong(t);
}

/* native_close(fh) -> logical bytes its reads answered, or -1 for a handle not known here */
static PyObject *m_native_close(PyObject *self, PyObject *args) {
    unsigned long long fh;
    if (!PyArg_ParseTuple(args, "K", &fh))
        return NULL;
    struct nh *h = nh_unlink(fh);
    if (h == NULL)
        return PyLong_FromLong(-1);
    unsigned long long bytes = __atomic_load_n(&h->bytes, __ATOMIC_RELAXED);
    nh_put(h);   /* freed now, or by the last read in progress */
    return PyLong_FromUnsignedLongLong(bytes);
}

/* native_disable(ino) -> handles of the inode whose reads go to Python from now on (a writer opened it) */
static PyObject *m_native_disable(PyObject *self, PyObject *args) {
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    long n = 0;
    pthread_mutex_lock(&NT.lock);
    for (int i = 0; i < NH_BUCKETS && __atomic_load_n(&NT.count, __ATOMIC_RELAXED); i++)
        for (struct nh *h = NT.buckets[i]; h; h = h->next)
            if (h->ino == ino && !__atomic_exchange_n(&h->disabled, 1, __ATOMIC_ACQ_REL))
                n++;
    pthread_mutex_unlock(&NT.lock);
    return PyLong_FromLong(n);
}

/* native_take() -> the counters since the last call: {reads, bytes, frames, cache_hits, fallbacks, corrupt,
 * stored: (per tier), latency: (per bucket, the last +Inf), latency_sum_s, handles} and the native writes':
 * {writes, write_bytes, frames_encoded, write_fallbacks, write_budget_fallbacks, writers_taken, write_latency,
 * write_latency_sum_s, writers, write_held_bytes} */
static PyObject *m_native_take(PyObject *self, PyObject *unused) {
    PyObject *stored = PyTuple_New(MAX_TIERS), *lat = PyTuple_New(n_lat + 1);
    if (stored == NULL || lat == NULL) {
        Py_XDECREF(stored);
        Py_XDECREF(lat);
        return NULL;
    }
    for (int i = 0; i < MAX_TIERS; i++)
        PyTuple_SET_ITEM(stored, i, PyLong_FromUnsignedLongLong(TAKE(NC.stored[i])));
    for (int i = 0; i <= n_lat; i++)
        PyTuple_SET_ITEM(lat, i, PyLong_FromUnsignedLongLong(TAKE(NC.lat[i])));
    unsigned long long reads = TAKE(NC.reads), bytes = TAKE(NC.bytes), frames = TAKE(NC.frames);
    unsigned long long hits = TAKE(NC.cache_hits), fb = TAKE(NC.fallbacks), bad = TAKE(NC.corrupt);
    double sum = (double)TAKE(NC.lat_sum_ns) / 1e9;
    PyObject *wlat = PyTuple_New(n_lat + 1);
    if (wlat == NULL) {
        Py_DECREF(stored);
        Py_DECREF(lat);
        return NULL;
    }
    for (int i = 0; i <= n_lat; i++)
        PyTuple_SET_ITEM(wlat, i, PyLong_FromUnsignedLongLong(TAKE(NWC.lat[i])));
    unsigned long long w = TAKE(NWC.writes), wb = TAKE(NWC.bytes), wf = TAKE(NWC.frames);
    unsigned long long wfb = TAKE(NWC.fallbacks), wbud = TAKE(NWC.budget_fallbacks), wt = TAKE(NWC.handles_taken);
    double wsum = (double)TAKE(NWC.lat_sum_ns) / 1e9;
    return Py_BuildValue("{sKsKsKsKsKsKsNsNsdsnsKsKsKsKsKsKsNsdsnsK}", "reads", reads, "bytes", bytes, "frames", frames,
                         "cache_hits", hits, "fallbacks", fb, "corrupt", bad, "stored", stored, "latency", lat,
                         "latency_sum_s", sum, "handles",
                         (Py_ssize_t)__atomic_load_n(&NT.count, __ATOMIC_RELAXED),
                         "writes", w, "write_bytes", wb, "frames_encoded", wf, "write_fallbacks", wfb,
                         "write_budget_fallbacks", wbud, "writers_taken", wt, "write_latency", wlat,
                         "write_latency_sum_s", wsum, "writers",
                         (Py_ssize_t)__atomic_load_n(&NWT.count, __ATOMIC_RELAXED),
                         "write_held_bytes", (unsigned long long)__atomic_load_n(&NB.held, __ATOMIC_RELAXED));
}

/* native_pread(fh, off, size) -> the bytes as a READ would be answered natively; None when Python would serve
 * it; a negative kvfs_read_frames error when a frame is corrupt. The GIL is released: tests race it with
 * native_close. */
static PyObject *m_native_pread(PyObject *self, PyObject *args) {
    unsigned long long fh;
    long long off;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "KLn", &fh, &off, &size))
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "negative size");
        return NULL;
    }
    int res = NR_PYTHON, code = 0;
    int64_t frame = 0;
    sink_t s = {0};
    Py_BEGIN_ALLOW_THREADS
    struct nh *h = nh_get(fh);
    if (h) {
        uint64_t want = (uint64_t)size;
        if (off >= 0 && (uint64_t)off < h->raw_size && want > h->raw_size - (uint64_t)off)
            want = h->raw_size - (uint64_t)off;
        if (off >= 0 && (uint64_t)off >= h->raw_size)
            want = 0;
        s.out = malloc(want ? (size_t)want : 1);
        if (s.out)
            res = native_serve(h, (size_t)size, off, &s, &code, &frame);
        nh_put(h);
    }
    Py_END_ALLOW_THREADS
    PyObject *r;
    if (res == NR_DONE)
        r = PyBytes_FromStringAndSize((const char *)s.out, (Py_ssize_t)s.out_len);
    else if (res == NR_CORRUPT)
        r = PyLong_FromLong(code);
    else
        r = Py_NewRef(Py_None);
    free(s.out);
    return r;
}

/* ---- native writes: what Python calls (GIL held; waits release it) ------------------------------------------- */

/* A buffer of this module handed to Python without a copy: a raw frame or a payload, read-only, freed with it. */
typedef struct {
    PyObject_HEAD
    uint8_t *p;
    Py_ssize_t len;
} OwnedObject;

static void Owned_dealloc(OwnedObject *o) {
    free(o->p);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static int Owned_getbuffer(OwnedObject *o, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)o, o->p ? (void *)o->p : (void *)"", o->len, 1, flags);
}

static Py_ssize_t Owned_length(OwnedObject *o) { return o->len; }

static PyBufferProcs Owned_as_buffer = {(getbufferproc)Owned_getbuffer, NULL};
static PySequenceMethods Owned_as_sequence = {.sq_length = (lenfunc)Owned_length};

static PyTypeObject OwnedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfs.frontend._loop.Owned",
    .tp_basicsize = sizeof(OwnedObject),
    .tp_dealloc = (destructor)Owned_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Bytes the native front end handed over (a frame, a payload): read-only, freed with this object.",
    .tp_as_buffer = &Owned_as_buffer,
    .tp_as_sequence = &Owned_as_sequence,
};

/* an Owned of p[0, len) (p is its own from now on, even on failure) */
static PyObject *owned(uint8_t *p, size_t len) {
    OwnedObject *o = PyObject_New(OwnedObject, &OwnedType);
    if (o == NULL) {
        free(p);
        return NULL;
    }
    o->p = p;
    o->len = (Py_ssize_t)len;
    return (PyObject *)o;
}

/* one more encoder thread (EP.lock held): 0, or an errno */
static int start_encoder(void) {
    sigset_t all, old;
    sigfillset(&all);   /* the encoders take no process signals (as the loop's threads) */
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGABRT);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    pthread_t t;
    int err = pthread_create(&t, NULL, encoder_thread, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err == 0)
        EP.threads[EP.n_threads++] = t;
    return err;
}

static int set_latency_bounds(PyObject *bounds) {
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    if (n > MAX_LAT) {
        PyErr_SetString(PyExc_ValueError, "too many latency buckets");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = PyFloat_AsDouble(PyTuple_GET_ITEM(bounds, i));
        if (v == -1.0 && PyErr_Occurred())
            return -1;
        lat_bounds_ns[i] = v <= 0 ? 0 : (uint64_t)(v * 1e9);
    }
    n_lat = (int)n;
    return 0;
}

/* set_writer(kvfs_encode_frame, kvfs_choose, kvfs_encode_bound addresses, encoder threads, latency bucket bounds
 * in seconds, encoders' nice value=0) */
static PyObject *m_set_writer(PyObject *self, PyObject *args) {
    unsigned long long enc, cho, bnd;
    int threads, nice = 0;
    PyObject *bounds;
    if (!PyArg_ParseTuple(args, "KKKiO!|i", &enc, &cho, &bnd, &threads, &PyTuple_Type, &bounds, &nice))
        return NULL;
    if (threads < 1 || threads > NW_MAX_ENCODERS) {
        PyErr_SetString(PyExc_ValueError, "encoder threads out of range");
        return NULL;
    }
    if (set_latency_bounds(bounds) < 0)
        return NULL;
    encode_frame = (encode_frame_fn)(uintptr_t)enc;
    choose_codec = (choose_fn)(uintptr_t)cho;
    encode_bound = (bound_fn)(uintptr_t)bnd;
    pthread_mutex_lock(&EP.lock);
    EP.want = threads;
    EP.nice = nice < 0 ? 0 : nice > 19 ? 19 : nice;
    pthread_mutex_unlock(&EP.lock);
    Py_RETURN_NONE;
}

/* native_write_budget(limit, python_used) -> bytes of raw frames held here */
static PyObject *m_native_write_budget(PyObject *self, PyObject *args) {
    unsigned long long limit, used;
    if (!PyArg_ParseTuple(args, "KK", &limit, &used))
        return NULL;
    __atomic_store_n(&NB.limit, (uint64_t)limit, __ATOMIC_RELAXED);
    __atomic_store_n(&NB.py_used, (uint64_t)used, __ATOMIC_RELAXED);
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&NB.held, __ATOMIC_RELAXED));
}

static PyObject *m_native_write_held(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&NB.held, __ATOMIC_RELAXED));
}

/* native_write_open(fh, ino, frame_size, candidates, auto, encode_zstd=False): WRITEs of fh in order are taken
 * here from now on. candidates: (codec, transform, param) triples as int32 (the file's policy; one triple: the
 * codec is known). Without encode_zstd, frames whose chosen codec is zstd are left for Python to encode. */
static PyObject *m_native_write_open(PyObject *self, PyObject *args) {
    unsigned long long fh, ino;
    unsigned int frame_size;
    Py_buffer cands;
    int auto_mode, encode_zstd = 0;
    if (!PyArg_ParseTuple(args, "KKIy*p|p", &fh, &ino, &frame_size, &cands, &auto_mode, &encode_zstd))
        return NULL;
    const char *why = NULL;
    Py_ssize_t n = cands.len / (Py_ssize_t)(3 * sizeof(int32_t));
    if (encode_frame == NULL || choose_codec == NULL || encode_bound == NULL)
        why = "no frame encoder (set_writer)";
    else if (frame_size == 0 || frame_size > (64u << 20))
        why = "frame size out of range";
    else if (n < 1 || n > NW_MAX_CANDS || cands.len != n * (Py_ssize_t)(3 * sizeof(int32_t)))
        why = "candidates must be 1 to 8 (codec, transform, param) int32 triples";
    if (why) {
        PyBuffer_Release(&cands);
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    pthread_mutex_lock(&EP.lock);
    while (EP.n_threads < EP.want && !EP.stop && start_encoder() == 0)
        ;
    int have = EP.n_threads;
    pthread_mutex_unlock(&EP.lock);
    struct nw *h = have ? calloc(1, sizeof(*h)) : NULL;
    if (h == NULL) {
        PyBuffer_Release(&cands);
        PyErr_SetString(PyExc_MemoryError, have ? "no memory for a native writer" : "no encoder thread started");
        return NULL;
    }
    memcpy(h->cands, cands.buf, (size_t)cands.len);
    PyBuffer_Release(&cands);
    h->n_cands = (int)n;
    h->auto_mode = auto_mode;
    h->encode_zstd = encode_zstd;
    if (n == 1) {   /* one candidate: EncodingPolicy._choose takes it without a trial */
        h->codec = h->cands[0];
        h->transform = h->cands[1];
        h->param = h->cands[2];
        h->chosen = 1;
    }
    h->fh = fh;
    h->ino = ino;
    h->frame_size = frame_size;
    h->active = 1;
    h->refs = 1;
    pthread_mutex_init(&h->lock, NULL);
    pthread_cond_init(&h->cond, NULL);
    struct nw *old = nw_unlink(fh);   /* an fh is never given out twice; should one be, the new one wins */
    if (old) {
        Py_BEGIN_ALLOW_THREADS
        nw_finish(old);
        Py_END_ALLOW_THREADS
        nw_put(old);
    }
    pthread_mutex_lock(&NWT.lock);
    h->next = NWT.buckets[fh % NH_BUCKETS];
    NWT.buckets[fh % NH_BUCKETS] = h;
    __atomic_add_fetch(&NWT.count, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&NWT.lock);
    Py_RETURN_NONE;
}

/* native_write_state(fh) -> (bytes written, WRITEs taken, the last one's time in ns since the epoch, active) or
 * None: what Python's attributes of the file show while the handle writes here */
static PyObject *m_native_write_state(PyObject *self, PyObject *args) {
    unsigned long long fh;
    if (!PyArg_ParseTuple(args, "K", &fh))
        return NULL;
    if (__atomic_load_n(&NWT.count, __ATOMIC_RELAXED) == 0)
        Py_RETURN_NONE;
    struct nw *h = nw_get(fh);
    if (h == NULL)
        Py_RETURN_NONE;
    PyObject *r = Py_BuildValue("(KKKO)", (unsigned long long)__atomic_load_n(&h->size, __ATOMIC_RELAXED),
                                (unsigned long long)__atomic_load_n(&h->writes, __ATOMIC_RELAXED),
                                (unsigned long long)__atomic_load_n(&h->last_write_ns, __ATOMIC_RELAXED),
                                __atomic_load_n(&h->active, __ATOMIC_ACQUIRE) ? Py_True : Py_False);
    nw_put(h);
    return r;
}

/* native_write_take(fh, block) -> the handle's content, handed over to Python; None for a handle not here; False
 * when frames are still being encoded and block is false (the handle is stopped either way: WRITEs go to Python).
 * With block, what is left is encoded first (as at FLUSH), the GIL released. The content:
 * (size, writes, last_write_ns, choice, frames): choice (codec, transform, param) or None; frames: per frame
 * (raw, length, encoding): raw an Owned of frame_size bytes (zero past length), encoding None or
 * (payload: an Owned or None for a hole or a frame stored raw, stored_len, codec, transform, flags, stored_xxh3,
 * raw_xxh3). */
static PyObject *m_native_write_take(PyObject *self, PyObject *args) {
    unsigned long long fh;
    int block;
    if (!PyArg_ParseTuple(args, "Kp", &fh, &block))
        return NULL;
    struct nw *h = nw_get(fh);
    if (h == NULL)
        Py_RETURN_NONE;
    int ready;
    Py_BEGIN_ALLOW_THREADS
    if (block)
        nw_finish(h);
    pthread_mutex_lock(&h->lock);
    nw_stop_locked(h);
    ready = h->pending == 0;
    pthread_mutex_unlock(&h->lock);
    Py_END_ALLOW_THREADS
    if (!ready) {
        nw_put(h);
        Py_RETURN_FALSE;
    }
    struct nw *unlinked = nw_unlink(fh);
    if (unlinked != h) {   /* taken by another call meanwhile */
        if (unlinked)
            nw_put(unlinked);
        nw_put(h);
        Py_RETURN_NONE;
    }
    nw_put(unlinked);   /* the table's reference; ours keeps it */
    pthread_mutex_lock(&h->lock);   /* nothing else touches it now: stopped, nothing in flight, out of the table */
    uint32_t n = h->n_frames;
    PyObject *frames = PyList_New(n), *result = NULL;
    for (uint32_t i = 0; frames && i < n; i++) {
        struct wframe *fr = &h->frames[i];
        PyObject *enc, *raw, *item;
        if (fr->encoded) {
            PyObject *payload = fr->payload ? owned(fr->payload, fr->f.stored_len) : Py_NewRef(Py_None);
            fr->payload = NULL;
            enc = payload ? Py_BuildValue("(NIBBHKK)", payload, fr->f.stored_len, fr->f.codec, fr->f.transform,
                                          fr->f.flags, (unsigned long long)fr->f.stored_xxh3,
                                          (unsigned long long)fr->f.raw_xxh3) : NULL;
        } else {
            enc = Py_NewRef(Py_None);
        }
        if (fr->len < h->frame_size)   /* OpenFile's invariant: a dirty frame reads zeros past the file's end */
            memset(fr->raw + fr->len, 0, h->frame_size - fr->len);
        raw = owned(fr->raw, h->frame_size);
        fr->raw = NULL;
        if (enc == NULL || raw == NULL) {
            Py_XDECREF(enc);
            Py_XDECREF(raw);
            Py_CLEAR(frames);
            break;
        }
        item = Py_BuildValue("(NIN)", raw, fr->len, enc);
        if (item == NULL) {
            Py_CLEAR(frames);
            break;
        }
        PyList_SET_ITEM(frames, i, item);
    }
    /* the raw frames leave this module's budget (Python's counts them from now on), whatever happened */
    budget_give((uint64_t)n * h->frame_size);
    for (uint32_t i = 0; i < n; i++) {
        free(h->frames[i].raw);
        free(h->frames[i].payload);
    }
    h->n_frames = 0;
    if (frames) {
        PyObject *choice = h->chosen > 0 ? Py_BuildValue("(iii)", h->codec, h->transform, h->param)
                                         : Py_NewRef(Py_None);
        if (choice)
            result = Py_BuildValue("(KKKNN)", (unsigned long long)h->size, (unsigned long long)h->writes,
                                   (unsigned long long)h->last_write_ns, choice, frames);
        else
            Py_DECREF(frames);
    }
    pthread_mutex_unlock(&h->lock);
    ADD(NWC.handles_taken, 1);
    nw_put(h);
    return result;
}

/* native_write_pwrite(fh, off, data) -> True when taken as a WRITE would be natively (False: Python's); tests */
static PyObject *m_native_write_pwrite(PyObject *self, PyObject *args) {
    unsigned long long fh;
    long long off;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "KLy*", &fh, &off, &data))
        return NULL;
    int res = NW_PYTHON;
    Py_BEGIN_ALLOW_THREADS
    struct nw *h = nw_get(fh);
    if (h) {
        res = nw_accept(h, data.buf, (size_t)data.len, off);
        nw_put(h);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyBool_FromLong(res == NW_TAKEN);
}

/* native_write_finish(fh): what FLUSH does to a native writer before Python sees it; tests */
static PyObject *m_native_write_finish(PyObject *self, PyObject *args) {
    unsigned long long fh;
    if (!PyArg_ParseTuple(args, "K", &fh))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    native_write_finish(fh);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *m_running(PyObject *self, PyObject *unused) { return PyBool_FromLong(S.running); }

static PyMethodDef module_methods[] = {
    {"mount", (PyCFunction)(void (*)(void))m_mount, METH_VARARGS | METH_KEYWORDS,
     "mount(mountpoint, options, export_support=False, writeback_cache=False, acl=False)"},
    {"start", m_start, METH_VARARGS, "start(max_threads, clone_fd): run fuse_session_loop_mt in a C thread"},
    {"fileno", m_fileno, METH_NOARGS, "the eventfd that is readable when requests wait in the queue"},
    {"fetch", m_fetch, METH_NOARGS, "take every queued request: a list of Request"},
    {"exit", m_exit, METH_NOARGS, "make the loop return (the mount stays until close)"},
    {"join", m_join, METH_NOARGS, "wait for the loop thread; its result"},
    {"running", m_running, METH_NOARGS, NULL},
    {"close", m_close, METH_VARARGS, "close(unmount=True): unmount and destroy the session"},
    {"invalidate_entry", m_invalidate_entry, METH_VARARGS, NULL},
    {"invalidate_inode", m_invalidate_inode, METH_VARARGS, NULL},
    {"notify_store", m_notify_store, METH_VARARGS, NULL},
    {"add_direntry_plus", m_add_direntry_plus, METH_VARARGS, NULL},
    {"set_reader", m_set_reader, METH_VARARGS, "set_reader(address of kvfs_read_frames, latency bounds (s))"},
    {"native_open", m_native_open, METH_VARARGS,
     "native_open(fh, ino, tier, fd, raw_size, frame_size, table): READs of fh are served in C from now on"},
    {"native_close", m_native_close, METH_VARARGS, "native_close(fh) -> bytes its reads answered, -1: unknown"},
    {"native_last_read", m_native_last_read, METH_VARARGS,
     "native_last_read(fh) -> wall-clock ns of its last read answered, 0: none or unknown"},
    {"native_disable", m_native_disable, METH_VARARGS, "native_disable(ino): its handles' reads go to Python"},
    {"native_take", m_native_take, METH_NOARGS, "the native read counters since the last call"},
    {"native_pread", m_native_pread, METH_VARARGS, "native_pread(fh, off, size): a native read, for tests"},
    {"set_writer", m_set_writer, METH_VARARGS,
     "set_writer(kvfs_encode_frame, kvfs_choose, kvfs_encode_bound addresses, encoder threads)"},
    {"native_write_open", m_native_write_open, METH_VARARGS,
     "native_write_open(fh, ino, frame_size, candidates, auto): WRITEs of fh in order are taken in C from now on"},
    {"native_write_take", m_native_write_take, METH_VARARGS,
     "native_write_take(fh, block) -> a native writer's content handed to Python (None: not one; False: busy)"},
    {"native_write_state", m_native_write_state, METH_VARARGS,
     "native_write_state(fh) -> (size, writes, last_write_ns, active) of a native writer, or None"},
    {"native_write_budget", m_native_write_budget, METH_VARARGS,
     "native_write_budget(limit, python_used) -> bytes of raw frames held by native writers"},
    {"native_write_held", m_native_write_held, METH_NOARGS, "bytes of raw frames held by native writers"},
    {"native_write_pwrite", m_native_write_pwrite, METH_VARARGS,
     "native_write_pwrite(fh, off, data) -> True when taken natively; tests"},
    {"native_write_finish", m_native_write_finish, METH_VARARGS, "native_write_finish(fh): as at FLUSH; tests"},
    {NULL}
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_loop", "kvfs native FUSE session loop", -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__loop(void) {
    if (PyType_Ready(&RequestType) < 0)
        return NULL;
    if (PyType_Ready(&OwnedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RequestType);
    PyModule_AddObject(m, "Request", (PyObject *)&RequestType);
    Py_INCREF(&OwnedType);
    PyModule_AddObject(m, "Owned", (PyObject *)&OwnedType);
#define OPC(n) PyModule_AddIntConstant(m, #n, n)
    OPC(OP_INIT); OPC(OP_LOOKUP); OPC(OP_FORGET); OPC(OP_GETATTR); OPC(OP_SETATTR); OPC(OP_READLINK);
    OPC(OP_MKNOD); OPC(OP_MKDIR); OPC(OP_UNLINK); OPC(OP_RMDIR); OPC(OP_SYMLINK); OPC(OP_RENAME); OPC(OP_LINK);
    OPC(OP_OPEN); OPC(OP_READ); OPC(OP_WRITE); OPC(OP_FLUSH); OPC(OP_RELEASE); OPC(OP_FSYNC); OPC(OP_OPENDIR);
    OPC(OP_READDIRPLUS); OPC(OP_RELEASEDIR); OPC(OP_FSYNCDIR); OPC(OP_STATFS); OPC(OP_SETXATTR);
    OPC(OP_GETXATTR); OPC(OP_LISTXATTR); OPC(OP_REMOVEXATTR); OPC(OP_CREATE); OPC(OP_ENDED);
    OPC(OP_NATIVE_FIRST); OPC(OP_READ_CORRUPT);
    OPC(FUSE_SET_ATTR_MODE); OPC(FUSE_SET_ATTR_UID); OPC(FUSE_SET_ATTR_GID); OPC(FUSE_SET_ATTR_SIZE);
    OPC(FUSE_SET_ATTR_ATIME); OPC(FUSE_SET_ATTR_MTIME); OPC(FUSE_SET_ATTR_ATIME_NOW);
    OPC(FUSE_SET_ATTR_MTIME_NOW); OPC(FUSE_SET_ATTR_CTIME);
#undef OPC
    return m;
}
