/* See en_ring.h for the protocol and the layout. */
#define _GNU_SOURCE
#include "en_ring.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <linux/futex.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Spins before sleeping.  A hand-off normally finds the slot ready or waits
 * milliseconds for a decode; spinning longer than a context switch would only
 * steal the core a worker needs (2-core machines). */
#define EN_SPINS 64

/* ---- layout ------------------------------------------------------------------------- */

/* Each C field a binding reads: its name, offset, size in bytes and element width. */
#define FIELD(type, name, width) {#name, offsetof(type, name), sizeof(((type *)0)->name), width}
#define H(name, width) FIELD(en_ring_header, name, width)
#define S(name, width) FIELD(en_ring_slot, name, width)
#define F(name, width) FIELD(en_ring_failure, name, width)
#define END {NULL, 0, 0, 0}

const en_ring_field en_ring_header_fields[] = {
    H(magic, 8), H(version, 4), H(owner_pid, 4), H(nslots, 4), H(batch, 4),
    H(sample_bytes, 8), H(slot_bytes, 8), H(closed, 4), H(next_ticket, 8), H(record, 4),
    H(claims, 8),
    H(reading, 8), H(reading_ms, 8), END};

const en_ring_field en_ring_slot_fields[] = {
    S(seq, 4), S(count, 4), S(ticket, 8), S(error, 4), S(failures, 4), S(report_len, 4),
    S(fill_us, 4), S(warned, 4), S(report, 1), END};

const en_ring_field en_ring_failure_fields[] = {
    F(sample_id, 8), F(path_len, 4), F(message_len, 4), F(reason, 1), F(flags, 1), END};

#undef H
#undef S
#undef F
#undef END

#define EN_RING_COLUMN(name, type, dtype, align, rows, width) \
    {#name, dtype, EN_RING_ROWS_##rows, width, offsetof(en_ring_layout, name)},
const en_ring_column en_ring_columns[] = {EN_RING_COLUMNS(EN_RING_COLUMN) {NULL, NULL, 0, 0, 0}};
#undef EN_RING_COLUMN

#define EN_RING_ROW_KIND(kind, parent, size, limit) \
    {#kind, EN_RING_ROWS_##parent, #size, limit, offsetof(en_ring_record, size)},
const en_ring_row_kind en_ring_row_kinds[] = {EN_RING_ROW_KINDS(EN_RING_ROW_KIND)
                                              {NULL, 0, NULL, 0, 0}};
#undef EN_RING_ROW_KIND

/* *at = align(*at, a) + n * width, refusing overflow; returns the aligned start. */
static int place(size_t *at, size_t align, size_t n, size_t width, size_t *start) {
    size_t s, bytes;
    if (__builtin_add_overflow(*at, align - 1, &s)) return -1;
    s -= s % align;
    if (__builtin_mul_overflow(n, width, &bytes) || __builtin_add_overflow(s, bytes, at))
        return -1;
    *start = s;
    return 0;
}

int en_ring_compute_layout(uint32_t nslots, uint32_t batch, uint64_t sample_bytes,
                           const en_ring_record *record, en_ring_layout *out) {
    if (nslots == 0 || batch == 0 || sample_bytes > SIZE_MAX) return -1;
    en_ring_layout l = {.nslots = nslots, .batch = batch, .sample_bytes = sample_bytes,
                        .record = *record};
    size_t at = sizeof(en_ring_slot), end;
    /* Each kind's rows in a slot: its parent's times its size (kinds follow their parents). */
    size_t rows[EN_RING_NROWS] = {[EN_RING_ROWS_SAMPLE] = batch};
#define EN_RING_ROWS_OF(kind, parent, size, limit)                                    \
    if (record->size > (limit) ||                                                   \
        __builtin_mul_overflow(rows[EN_RING_ROWS_##parent], (size_t)record->size,   \
                               &rows[EN_RING_ROWS_##kind]))                          \
        return -1;
    EN_RING_ROW_KINDS(EN_RING_ROWS_OF)
#undef EN_RING_ROWS_OF
    /* The record's columns in their order, each on its alignment; pixels on a page
     * so that they can be pinned or mapped for a device on their own. */
#define EN_RING_PLACE(name, type, dtype, align, r, width) \
    if (place(&at, align, rows[EN_RING_ROWS_##r], (width) * sizeof(type), &l.name)) return -1;
    EN_RING_COLUMNS(EN_RING_PLACE)
#undef EN_RING_PLACE
    if (place(&at, EN_RING_PAGE, batch, (size_t)sample_bytes, &l.pixels) ||
        place(&at, EN_RING_PAGE, 0, 0, &end))
        return -1;
    l.slot_bytes = end;
    size_t slots;
    if (__builtin_mul_overflow((size_t)nslots, l.slot_bytes, &slots) ||
        __builtin_add_overflow(slots, (size_t)EN_RING_HEADER_BYTES, &l.total_bytes) ||
        l.total_bytes > (size_t)INT64_MAX) /* ftruncate takes an off_t */
        return -1;
    *out = l;
    return 0;
}

int en_ring_init(void *mem, size_t size, const en_ring_layout *layout, uint64_t first_ticket,
                 uint32_t owner_pid) {
    if (size < layout->total_bytes) return -1;
    en_ring_header *h = (en_ring_header *)mem;
    h->version = EN_RING_VERSION;
    h->owner_pid = owner_pid;
    h->nslots = layout->nslots;
    h->batch = layout->batch;
    h->sample_bytes = layout->sample_bytes;
    h->record = layout->record;
    h->slot_bytes = layout->slot_bytes;
    __atomic_store_n(&h->closed, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&h->next_ticket, first_ticket, __ATOMIC_RELAXED);
    for (uint32_t w = 0; w < EN_RING_MAX_WORKERS; w++) {
        __atomic_store_n(&h->claims[w], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&h->reading[w], 0, __ATOMIC_RELAXED);
    }
    for (uint32_t i = 0; i < layout->nslots; i++)
        __atomic_store_n(&en_ring_slot_of(mem, layout, first_ticket + i)->seq,
                         en_ring_seq_free(first_ticket + i), __ATOMIC_RELAXED);
    /* Release: whoever acquires the magic sees the geometry and the free slots. */
    __atomic_store_n(&h->magic, EN_RING_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

int en_ring_check(const void *mem, size_t size, en_ring_layout *out) {
    const en_ring_header *h = (const en_ring_header *)mem;
    if (size < EN_RING_HEADER_BYTES || __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != EN_RING_MAGIC)
        return EN_RING_NOT_A_RING;
    if (h->version != EN_RING_VERSION) return EN_RING_BAD_VERSION;
    en_ring_layout l;
    en_ring_record record = h->record;  /* a copy: the segment is another process's too */
    if (en_ring_compute_layout(h->nslots, h->batch, h->sample_bytes, &record, &l) != 0 ||
        l.slot_bytes != h->slot_bytes || l.total_bytes > size)
        return EN_RING_BAD_GEOMETRY;
    *out = l;
    return EN_RING_CHECK_OK;
}

uint64_t *en_ring_claim(en_ring_header *header, uint64_t worker) {
    return worker < EN_RING_MAX_WORKERS ? &header->claims[worker] : NULL;
}

uint64_t *en_ring_reading(en_ring_header *header, uint64_t worker) {
    return worker < EN_RING_MAX_WORKERS ? &header->reading[worker] : NULL;
}

/* ---- shared memory ---------------------------------------------------------------------- */

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif

/* err = "<what> <name>: <strerror(errno)>", errno left as it was. */
static void describe(char *err, size_t errlen, const char *what, const char *name) {
    int saved = errno;
    if (err && errlen) snprintf(err, errlen, "%s %s: %s", what, name, strerror(saved));
    errno = saved;
}

/* MemAvailable of /proc/meminfo in bytes, or -1 when there is none to read. */
static long long mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    long long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
    fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

/* Allocate every page of [0, size) of fd now, so that no later page fault can fail for
 * want of memory or file-system space (SIGBUS).  In steps, each retried when a signal
 * interrupts it (shmem's fallocate gives up with EINTR on any pending signal, a child's
 * SIGCHLD included), so that a stream of signals cannot undo the progress made.  Before
 * each step, ENOMEM if the machine has not that much memory available any more: past
 * that point the kernel would not fail the call but OOM-kill some process (the caller
 * checks the whole size first; this guards against memory taken meanwhile).
 * 0 or an errno value. */
static int reserve(int fd, size_t size) {
    const size_t step = (size_t)64 << 20;
    size_t at = 0;
    while (at < size) {
        size_t n = size - at < step ? size - at : step;
        long long avail = mem_available();
        if (avail >= 0 && (unsigned long long)avail < n) return ENOMEM;
        int rc = posix_fallocate(fd, (off_t)at, (off_t)n);
        if (rc == EINTR) continue;
        if (rc != 0) return rc;
        at += n;
    }
    return 0;
}

/* Size the new memory file fd to size bytes, reserve every page (a ring that does not
 * fit fails here, never with SIGBUS later), seal it (kind "memfd") and map it; the
 * mapping, or NULL with errno and err set.  what/name label the messages. */
static void *size_reserve_map(int fd, size_t size, const char *kind, const char *name,
                              char *err, size_t errlen) {
    char what[32];
    int rc;
    if (ftruncate(fd, (off_t)size) != 0) {
        snprintf(what, sizeof what, "ftruncate %s", kind);
        describe(err, errlen, what, name);
        return NULL;
    }
    if ((rc = reserve(fd, size)) != 0) {
        errno = rc;
        snprintf(what, sizeof what, "fallocate %s", kind);
        describe(err, errlen, what, name);
        return NULL;
    }
#ifdef F_ADD_SEALS
    /* Nobody, a worker included, can shrink it under a mapping (SIGBUS) or grow it.
     * (A named segment cannot be sealed: the call fails there, harmlessly.) */
    (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
#endif
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        snprintf(what, sizeof what, "mmap %s", kind);
        describe(err, errlen, what, name);
        return NULL;
    }
    return p;
}

int en_memfd_create(const char *label, size_t size, int *fd_out, void **addr, char *err,
                    size_t errlen) {
    if (size == 0 || size > (size_t)INT64_MAX) {
        errno = EINVAL;
        describe(err, errlen, "memfd size for", label);
        return -1;
    }
#ifdef SYS_memfd_create
    int fd = (int)syscall(SYS_memfd_create, label, MFD_CLOEXEC | MFD_ALLOW_SEALING);
#else
    int fd = -1;
    errno = ENOSYS;
#endif
    if (fd < 0) {
        describe(err, errlen, "memfd_create", label);
        return -1;
    }
    void *p = size_reserve_map(fd, size, "memfd", label, err, errlen);
    if (p == NULL) {
        int rc = errno;
        close(fd);
        errno = rc;
        return -1;
    }
    *fd_out = fd;
    *addr = p;
    return 0;
}

int en_fd_attach(int fd, void **addr, size_t *size, char *err, size_t errlen) {
    char what[32];
    snprintf(what, sizeof what, "%d", fd);
    struct stat st;
    if (fstat(fd, &st) != 0) {
        describe(err, errlen, "fstat of descriptor", what);
        return -1;
    }
    if (st.st_size <= 0) {
        errno = EINVAL;
        describe(err, errlen, "empty memory file at descriptor", what);
        return -1;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        describe(err, errlen, "mmap of descriptor", what);
        return -1;
    }
    *addr = p;
    *size = (size_t)st.st_size;
    return 0;
}

int en_memfd_open(const char *name, char *err, size_t errlen) {
    const size_t plen = sizeof EN_RING_MEMFD_PREFIX - 1;
    if (strncmp(name, EN_RING_MEMFD_PREFIX, plen) != 0) {
        errno = EINVAL;
        describe(err, errlen, "not a memfd ring name:", name);
        return -1;
    }
    /* The creator's pid: the digits after the label's first '-'. */
    const char *dash = strchr(name + plen, '-');
    char *end = NULL;
    long pid = dash ? strtol(dash + 1, &end, 10) : 0;
    if (!dash || end == dash + 1 || *end != '-' || pid <= 0) {
        errno = EINVAL;
        describe(err, errlen, "no creator pid in memfd ring name", name);
        return -1;
    }
    char dir[64], link[64 + 2 + sizeof(((struct dirent *)0)->d_name)], target[PATH_MAX];
    snprintf(dir, sizeof dir, "/proc/%ld/fd", pid);
    DIR *d = opendir(dir);
    if (!d) {
        describe(err, errlen, "cannot look for", name);
        return -1;
    }
    const size_t nlen = strlen(name);
    int fd = -1, open_errno = ENOENT;
    struct dirent *e;
    while (fd < 0 && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        snprintf(link, sizeof link, "%s/%s", dir, e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n < 0) continue;
        target[n] = 0;
        /* The kernel shows "/memfd:<label> (deleted)": a memfd never has a link. */
        if (strncmp(target, name, nlen) == 0 &&
            (target[nlen] == 0 || strcmp(target + nlen, " (deleted)") == 0) &&
            (fd = open(link, O_RDWR | O_CLOEXEC)) < 0)
            open_errno = errno;
    }
    closedir(d);
    if (fd < 0) {
        errno = open_errno;
        describe(err, errlen, "cannot open", name);
        return -1;
    }
    return fd;
}

int en_shm_create(const char *name, size_t size, void **addr, char *err, size_t errlen) {
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        describe(err, errlen, "shm_open", name);
        return -1;
    }
    void *p = size_reserve_map(fd, size, "shm", name, err, errlen);
    int rc = errno;
    close(fd); /* the mapping keeps the segment alive; no fd is left open */
    if (p == NULL) {
        shm_unlink(name);
        errno = rc;
        return -1;
    }
    *addr = p;
    return 0;
}

int en_shm_attach(const char *name, void **addr, size_t *size, char *err, size_t errlen) {
    int memfd = strncmp(name, EN_RING_MEMFD_PREFIX, sizeof EN_RING_MEMFD_PREFIX - 1) == 0;
    int fd = memfd ? en_memfd_open(name, err, errlen) : shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        if (!memfd) describe(err, errlen, "shm_open", name);
        return -1;
    }
    int rc = en_fd_attach(fd, addr, size, err, errlen);
    int saved = errno;
    close(fd);
    if (rc != 0) {
        describe(err, errlen, "cannot map", name);
        errno = saved;
    }
    return rc;
}

int en_shm_detach(void *addr, size_t size) { return munmap(addr, size); }

int en_shm_unlink(const char *name) {
    if (shm_unlink(name) == 0 || errno == ENOENT) return 0;
    return -1;
}

uint64_t en_ticket_take(uint64_t *counter) {
    /* The slot's sequence word carries the data dependencies; the ticket
     * only names work.  Acquire-release all the same, for the supervisor's
     * lost-ticket accounting: a worker's earlier CLAIM_PENDING store must be
     * visible to whoever acquire-loads a counter that includes its ticket,
     * and its later claim store must not move before the increment.  (Free
     * on x86, where every locked RMW is a full barrier.) */
    return __atomic_fetch_add(counter, 1, __ATOMIC_ACQ_REL);
}

uint64_t en_load64(const uint64_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
void en_store64(uint64_t *word, uint64_t value) { __atomic_store_n(word, value, __ATOMIC_RELEASE); }
uint32_t en_seq_load(const uint32_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

void en_seq_publish(uint32_t *word, uint32_t value) {
    /* Release: every byte written into the slot before this store is visible
     * to whoever acquires the new value. */
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    /* Shared (not FUTEX_PRIVATE) because waiters live in other processes. */
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void en_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

int en_seq_wait(const uint32_t *word, uint32_t expect, const uint32_t *closed, double timeout_s) {
    for (int i = 0; i < EN_SPINS; i++) {
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == expect) return EN_WAIT_OK;
        cpu_relax();
    }
    const double deadline = now_s() + timeout_s;
    for (;;) {
        uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (seen == expect) return EN_WAIT_OK;
        if (closed && __atomic_load_n(closed, __ATOMIC_ACQUIRE)) return EN_WAIT_CLOSED;
        double left = deadline - now_s();
        if (left <= 0) return EN_WAIT_TIMEOUT;
        struct timespec ts;
        ts.tv_sec = (time_t)left;
        ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
        /* Sleeps only while the word still holds `seen`; a publish in between
         * makes the call return at once (EAGAIN), so no wake-up is lost. */
        syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
    }
}
