// Re-augmentation of echoed canvases on a pool of native threads: a batch's rows
// are its tasks (crop + resize of the row's canvas, then its op program from
// en_ops.cpp), taken by whichever thread is free.  Each thread owns a decoder
// (the resampler's scratch) and an ops scratch image, so a row's bytes never
// depend on the thread that made it.  The contract: en_pool.h.
#include "en_pool.h"

#include "en_kernel.h"
#include "en_ops.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <new>

struct en_reaug;

namespace {

typedef void (*task_fn)(en_reaug* r, void* ctx, int64_t task, int thread);

struct worker_arg {
    en_reaug* r;
    int index;
};

}  // namespace

struct en_reaug {
    int threads;        // the caller and threads - 1 of our own
    pid_t pid;          // the process that started them
    int started;        // threads running
    pthread_t* tids;
    worker_arg* wargs;
    pthread_mutex_t run_mu;  // one batch at a time
    pthread_mutex_t mu;      // guards what follows, up to `next`
    pthread_cond_t wake, done;
    unsigned long long generation;
    int stop, busy;
    task_fn fn;
    void* ctx;
    int64_t tasks;
    std::atomic<int64_t> next;
    // per thread: a decoder (the resampler's scratch) and the ops' scratch image
    en_decoder** dec;
    uint8_t** scratch;
    size_t* scratch_cap;
    // the first failed row of a batch
    pthread_mutex_t err_mu;
    int64_t err_row;
    int err_status;
    char err_msg[512];
};

namespace {

void work(en_reaug* r, int thread) {
    const int64_t tasks = r->tasks;
    for (int64_t t; (t = r->next.fetch_add(1, std::memory_order_relaxed)) < tasks;)
        r->fn(r, r->ctx, t, thread);
}

void* worker_main(void* p) {
    worker_arg* a = (worker_arg*)p;
    en_reaug* r = a->r;
    unsigned long long seen = 0;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && r->generation == seen) pthread_cond_wait(&r->wake, &r->mu);
        if (r->stop) break;
        seen = r->generation;
        pthread_mutex_unlock(&r->mu);
        work(r, a->index);
        pthread_mutex_lock(&r->mu);
        if (--r->busy == 0) pthread_cond_signal(&r->done);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

// Tasks 0 .. tasks - 1 over the pool; returns when every one has run.
void pool_run(en_reaug* r, task_fn fn, void* ctx, int64_t tasks) {
    if (r->started == 0 || tasks <= 1 || getpid() != r->pid) {
        // No thread of ours here (a forked child has none): the caller does it all.
        for (int64_t t = 0; t < tasks; t++) fn(r, ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&r->mu);
    r->fn = fn;
    r->ctx = ctx;
    r->tasks = tasks;
    r->next.store(0, std::memory_order_relaxed);
    r->busy = r->started;
    r->generation++;
    pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->mu);
    work(r, 0);
    pthread_mutex_lock(&r->mu);
    while (r->busy) pthread_cond_wait(&r->done, &r->mu);
    pthread_mutex_unlock(&r->mu);
}

void stop_threads(en_reaug* r) {
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->mu);
    if (getpid() == r->pid)
        for (int i = 0; i < r->started; i++) pthread_join(r->tids[i], NULL);
    r->started = 0;
}

// Every thread's ops scratch holds at least `bytes`: allocated by the caller, so
// that a task never fails for memory.
int reserve_scratch(en_reaug* r, size_t bytes) {
    for (int t = 0; t < r->threads; t++) {
        if (r->scratch_cap[t] >= bytes) continue;
        uint8_t* p = (uint8_t*)realloc(r->scratch[t], bytes);
        if (!p) return -1;
        r->scratch[t] = p;
        r->scratch_cap[t] = bytes;
    }
    return 0;
}

void reset_error(en_reaug* r) {
    r->err_row = -1;
    r->err_status = 0;
    r->err_msg[0] = '\0';
}

void record_error(en_reaug* r, int64_t row, int status, const char* why) {
    pthread_mutex_lock(&r->err_mu);
    if (r->err_row < 0 || row < r->err_row) {  // the first row, whatever the schedule
        r->err_row = row;
        r->err_status = status;
        snprintf(r->err_msg, sizeof r->err_msg, "row %lld: %s", (long long)row, why);
    }
    pthread_mutex_unlock(&r->err_mu);
}

struct run_job {
    const uint8_t* pixels;
    int64_t row_bytes;
    const int64_t* entries;
    const int32_t* shapes;
    const double* boxes;
    const uint8_t* flips;
    int out_h, out_w;
    uint8_t* out;
    const int32_t* codes;
    const float* args;
    int steps;
};

void run_task(en_reaug* r, void* ctx, int64_t i, int thread) {
    const run_job* j = (const run_job*)ctx;
    const int64_t e = j->entries[i];
    const int ch = j->shapes[2 * e], cw = j->shapes[2 * e + 1];
    const en_box box = {j->boxes[4 * i], j->boxes[4 * i + 1], j->boxes[4 * i + 2],
                        j->boxes[4 * i + 3]};
    const size_t row = (size_t)j->out_w * 3;
    uint8_t* out = j->out + (size_t)i * j->out_h * row;
    const int st = en_resize_rgb(r->dec[thread], j->pixels + e * j->row_bytes, ch, cw,
                                 (size_t)cw * 3, box, j->out_h, j->out_w, j->flips[i] != 0,
                                 out, row);
    if (st) {
        record_error(r, i, st, en_decoder_errmsg(r->dec[thread]));
        return;
    }
    if (j->steps)
        en_ops_apply(out, 1, j->out_h, j->out_w, j->codes + i * j->steps,
                     j->args + i * j->steps * OP_ARGS, j->steps, r->scratch[thread]);
}

struct apply_job {
    uint8_t* images;
    int h, w;
    const int32_t* codes;
    const float* args;
    int steps;
};

void apply_task(en_reaug* r, void* ctx, int64_t i, int thread) {
    const apply_job* j = (const apply_job*)ctx;
    en_ops_apply(j->images + (size_t)i * j->h * j->w * 3, 1, j->h, j->w,
                 j->codes + i * j->steps, j->args + i * j->steps * OP_ARGS, j->steps,
                 r->scratch[thread]);
}

struct gather_job {
    const uint8_t* pixels;
    int64_t row_bytes;
    const int64_t* entries;
    int h, w;
    uint8_t* out;
    const uint8_t* mirror;
};

void gather_task(en_reaug*, void* ctx, int64_t i, int) {
    const gather_job* j = (const gather_job*)ctx;
    const size_t row = (size_t)j->w * 3, size = row * j->h;
    const uint8_t* src = j->pixels + j->entries[i] * j->row_bytes;
    uint8_t* dst = j->out + (size_t)i * size;
    if (!j->mirror || !j->mirror[i]) {
        memcpy(dst, src, size);
        return;
    }
    for (int y = 0; y < j->h; y++) {
        const uint8_t* s = src + y * row;
        uint8_t* d = dst + y * row;
        for (int x = 0; x < j->w; x++) {
            const uint8_t* p = s + (size_t)(j->w - 1 - x) * 3;
            d[3 * x] = p[0];
            d[3 * x + 1] = p[1];
            d[3 * x + 2] = p[2];
        }
    }
}

}  // namespace

extern "C" en_reaug* en_reaug_new(int threads) {
    if (threads < 1) threads = 1;
    en_reaug* r = (en_reaug*)calloc(1, sizeof *r);
    if (!r) return NULL;
    new (&r->next) std::atomic<int64_t>(0);
    r->threads = threads;
    r->pid = getpid();
    pthread_mutex_init(&r->run_mu, NULL);
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->err_mu, NULL);
    pthread_cond_init(&r->wake, NULL);
    pthread_cond_init(&r->done, NULL);
    r->dec = (en_decoder**)calloc(threads, sizeof *r->dec);
    r->scratch = (uint8_t**)calloc(threads, sizeof *r->scratch);
    r->scratch_cap = (size_t*)calloc(threads, sizeof *r->scratch_cap);
    r->tids = (pthread_t*)calloc(threads, sizeof *r->tids);
    r->wargs = (worker_arg*)calloc(threads, sizeof *r->wargs);
    if (!r->dec || !r->scratch || !r->scratch_cap || !r->tids || !r->wargs) {
        en_reaug_free(r);
        return NULL;
    }
    for (int t = 0; t < threads; t++)
        if (!(r->dec[t] = en_decoder_new())) {
            en_reaug_free(r);
            return NULL;
        }
    // The threads never take a signal: the process's handlers (Python's) run on
    // the threads that expect them.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int t = 1; t < threads; t++) {
        r->wargs[t - 1] = {r, t};
        if (pthread_create(&r->tids[t - 1], NULL, worker_main, &r->wargs[t - 1])) break;
        r->started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (r->started != threads - 1) {
        en_reaug_free(r);
        return NULL;
    }
    return r;
}

extern "C" void en_reaug_free(en_reaug* r) {
    if (!r) return;
    stop_threads(r);
    for (int t = 0; t < r->threads; t++) {
        if (r->dec && r->dec[t]) en_decoder_free(r->dec[t]);
        if (r->scratch) free(r->scratch[t]);
    }
    free(r->dec);
    free(r->scratch);
    free(r->scratch_cap);
    free(r->tids);
    free(r->wargs);
    pthread_cond_destroy(&r->wake);
    pthread_cond_destroy(&r->done);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->err_mu);
    pthread_mutex_destroy(&r->run_mu);
    r->next.~atomic();
    free(r);
}

extern "C" int en_reaug_threads(const en_reaug* r) { return r->threads; }

extern "C" int en_reaug_run(en_reaug* r, const uint8_t* pixels, int64_t row_bytes,
                            const int64_t* entries, const int32_t* shapes, const double* boxes,
                            const uint8_t* flips, int64_t n, int out_h, int out_w, uint8_t* out,
                            const int32_t* codes, const float* args, int steps, char* msg,
                            size_t cap) {
    pthread_mutex_lock(&r->run_mu);
    int status = 0;
    if (steps > 0 && reserve_scratch(r, (size_t)3 * out_h * out_w)) {
        snprintf(msg, cap, "out of memory for the ops' scratch image (%d x %d)", out_h, out_w);
        status = EN_ERR_NOMEM;
    } else {
        reset_error(r);
        run_job j = {pixels, row_bytes, entries, shapes, boxes, flips, out_h, out_w, out,
                     codes, args, steps};
        pool_run(r, run_task, &j, n);
        status = r->err_status;
        if (status) snprintf(msg, cap, "%s", r->err_msg);
    }
    pthread_mutex_unlock(&r->run_mu);
    return status;
}

extern "C" int en_reaug_apply(en_reaug* r, uint8_t* images, int64_t n, int h, int w,
                              const int32_t* codes, const float* args, int steps) {
    if (n <= 0 || steps <= 0) return 0;
    pthread_mutex_lock(&r->run_mu);
    int status = 0;
    if (reserve_scratch(r, (size_t)3 * h * w)) {
        status = EN_ERR_NOMEM;
    } else {
        apply_job j = {images, h, w, codes, args, steps};
        pool_run(r, apply_task, &j, n);
    }
    pthread_mutex_unlock(&r->run_mu);
    return status;
}

extern "C" void en_reaug_gather(en_reaug* r, const uint8_t* pixels, int64_t row_bytes,
                                const int64_t* entries, int64_t n, int h, int w, uint8_t* out,
                                const uint8_t* mirror) {
    pthread_mutex_lock(&r->run_mu);
    gather_job j = {pixels, row_bytes, entries, h, w, out, mirror};
    pool_run(r, gather_task, &j, n);
    pthread_mutex_unlock(&r->run_mu);
}

extern "C" void en_store_rows(uint8_t* dst, int64_t dst_row_bytes, const int64_t* entries,
                              const uint8_t* src, int64_t src_row_bytes, const int64_t* nbytes,
                              int64_t n) {
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + entries[i] * dst_row_bytes, src + i * src_row_bytes, (size_t)nbytes[i]);
}
