/*
 * The echo buffer's rows in batches: canvases stored into rows, rows gathered
 * into a batch, and canvases re-augmented on a pool of native threads.  Never
 * includes Python.h.
 */
#ifndef EN_POOL_H
#define EN_POOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Re-augmentation of echoed canvases on a pool of native threads.
 *
 * A batch is split into its rows; each row (crop + resize of its canvas, then
 * its op program) is one task, taken by whichever thread is free, and a row's
 * bytes never depend on another row or on the thread that made it: any thread
 * count gives the same batch.  The calling thread works too, so a pool of
 * `threads` runs threads - 1 threads of its own; they sleep between batches.
 * One batch at a time per pool (calls are serialised); never call one from two
 * processes (a pool used in a forked child runs everything on the caller). */
typedef struct en_reaug en_reaug;

/* NULL when out of memory or when no thread can be started. */
en_reaug *en_reaug_new(int threads);
void en_reaug_free(en_reaug *r);
int en_reaug_threads(const en_reaug *r);

/* For each row i < n: crop boxes[4 i ..] (top, left, height, width) of the canvas
 * in row entries[i] of `pixels` (rows of row_bytes; shapes[2 e], shapes[2 e + 1]
 * = its height and width, its first h * w * 3 bytes), resize it with the
 * resampler of en_resize_rgb into out[i] (out_h x out_w RGB, contiguous), mirror
 * it where flips[i], then run codes[i * steps ..] / args[i * steps * OP_ARGS ..]
 * on it (steps may be 0; check the programs with en_ops_check first).  0, or the
 * en_status of the first row that failed with its reason in msg. */
int en_reaug_run(en_reaug *r, const uint8_t *pixels, int64_t row_bytes, const int64_t *entries,
                 const int32_t *shapes, const double *boxes, const uint8_t *flips, int64_t n,
                 int out_h, int out_w, uint8_t *out, const int32_t *codes, const float *args,
                 int steps, char *msg, size_t cap);

/* The programs alone, on n images of h x w in place (en_ops_apply over the pool). */
int en_reaug_apply(en_reaug *r, uint8_t *images, int64_t n, int h, int w,
                   const int32_t *codes, const float *args, int steps);

/* out[i] = the first h * w * 3 bytes of row entries[i] of pixels, mirrored left to
 * right where mirror[i] (mirror may be NULL). */
void en_reaug_gather(en_reaug *r, const uint8_t *pixels, int64_t row_bytes,
                     const int64_t *entries, int64_t n, int h, int w, uint8_t *out,
                     const uint8_t *mirror);

/* Row entries[i] of dst (rows of dst_row_bytes) = the first nbytes[i] bytes of row
 * i of src (rows of src_row_bytes): a batch of variable-size canvases stored in
 * one call. */
void en_store_rows(uint8_t *dst, int64_t dst_row_bytes, const int64_t *entries,
                   const uint8_t *src, int64_t src_row_bytes, const int64_t *nbytes, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
