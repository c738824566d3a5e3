/* Thread-exit release of the kernel's per-thread scratch buffers (_scratch.h). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>

#include "_scratch.h"

#define MAX_SCRATCH 8  /* buffers per thread: the kernel has four */

static __thread scratch_t *owned[MAX_SCRATCH];
static __thread int n_owned;
static pthread_key_t exit_key;
static pthread_once_t exit_key_once = PTHREAD_ONCE_INIT;
static int have_exit_key;

static void release_owned(void *unused) {
    (void)unused;
    for (int i = 0; i < n_owned; i++) {
        free(owned[i]->buf);
        owned[i]->buf = NULL;
        owned[i]->cap = 0;
    }
    n_owned = 0;
}

static void make_exit_key(void) { have_exit_key = pthread_key_create(&exit_key, release_owned) == 0; }

static void own(scratch_t *sc) {
    for (int i = 0; i < n_owned; i++)
        if (owned[i] == sc)
            return;
    if (n_owned == MAX_SCRATCH)
        return;  /* not reached with the kernel's four buffers */
    pthread_once(&exit_key_once, make_exit_key);
    owned[n_owned++] = sc;
    if (have_exit_key)
        pthread_setspecific(exit_key, owned);  /* non-NULL: release_owned runs when this thread exits */
}

uint8_t *scratch_reserve(scratch_t *sc, size_t n) {
    if (n <= sc->cap && sc->buf)
        return sc->buf;
    own(sc);
    free(sc->buf);
    sc->buf = malloc(n ? n : 1);
    sc->cap = sc->buf ? n : 0;
    return sc->buf;
}

static __thread scratch_t planes_scratch;

uint8_t *kvec_scratch(size_t n) { return scratch_reserve(&planes_scratch, n); }
