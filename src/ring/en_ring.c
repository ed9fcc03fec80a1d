/* See en_ring.h for the protocol. */
#define _GNU_SOURCE
#include "en_ring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
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

static void describe(char *err, size_t errlen, const char *what, const char *name) {
    if (err && errlen) snprintf(err, errlen, "%s %s: %s", what, name, strerror(errno));
}

int en_shm_create(const char *name, size_t size, void **addr, char *err, size_t errlen) {
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        describe(err, errlen, "shm_open", name);
        return -1;
    }
    if (ftruncate(fd, (off_t)size) != 0) {
        describe(err, errlen, "ftruncate", name);
        close(fd);
        shm_unlink(name);
        return -1;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd); /* the mapping keeps the segment alive; no fd is left open */
    if (p == MAP_FAILED) {
        describe(err, errlen, "mmap", name);
        shm_unlink(name);
        return -1;
    }
    *addr = p;
    return 0;
}

int en_shm_attach(const char *name, void **addr, size_t *size, char *err, size_t errlen) {
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        describe(err, errlen, "shm_open", name);
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        describe(err, errlen, "fstat", name);
        close(fd);
        return -1;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        describe(err, errlen, "mmap", name);
        return -1;
    }
    *addr = p;
    *size = (size_t)st.st_size;
    return 0;
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
