/* Internal: antialiased bilinear resampling with Pillow's semantics. */
#ifndef EN_RESIZE_H
#define EN_RESIZE_H

#include <stddef.h>
#include <stdint.h>

/* A growable scratch buffer owned by a decoder: it reaches its working size
 * after the first few images and then never allocates again. */
typedef struct en_buf {
    void *p;
    size_t cap;
} en_buf;

int en_buf_reserve(en_buf *b, size_t bytes);
void en_buf_free(en_buf *b);

/* The resampling plan of one axis: output pixel i reads `count[i]` input
 * pixels from `first[i]` with fixed-point weights coeffs[i * ksize + k]. */
typedef struct en_axis {
    int out_size, ksize;
    int lo, hi;          /* input pixels [lo, hi) touched by any output pixel */
    int *first, *count;
    int32_t *coeffs;
} en_axis;

typedef struct en_resampler {
    en_buf xfirst, xcount, xcoef;
    en_buf yfirst, ycount, ycoef;
    en_buf tmp;          /* horizontal pass output, rows [y.lo, y.hi) */
    en_buf xpairs, ypairs; /* weights split and paired for the SIMD passes */
    en_buf xplan;        /* the AVX-512 horizontal pass's groups (en_resize.c) */
    int xgroups;         /* xplan holds the current x axis */
} en_resampler;

void en_resampler_free(en_resampler *r);

/* Plan the x (horizontal=1) or y axis for the interval [in0, in1) of an input
 * of in_size pixels resampled to out_size pixels. */
int en_plan_axis(en_resampler *r, int horizontal, double in0, double in1, int in_size,
                 int out_size, en_axis *axis);

/* Run both passes.  src points at input pixel (src_x0, src_y0) of the planned
 * coordinate system and must cover [x.lo, x.hi) x [y.lo, y.hi).  src_slack
 * is how many readable bytes follow the end (at src_stride) of the last row:
 * SIMD takes the rows that leave it 16 to over-read, the scalar code the rest. */
int en_resample(en_resampler *r, const uint8_t *src, size_t src_stride, int src_x0, int src_y0,
                const en_axis *x, const en_axis *y, int flip, size_t src_slack, uint8_t *out,
                size_t stride);

/* The two passes apart, for a caller that produces the input rows a few at a
 * time (the kernel, while libjpeg decodes them): begin once, then h_rows for
 * rows [row, row + rows) of [y.lo, y.hi), src pointing at the first of them,
 * src_slack as above for this piece; then the vertical pass from r->tmp. */
int en_resample_begin(en_resampler *r, const en_axis *x, const en_axis *y);
/* How many rows a piece should have for this CPU's pass; 0: all at once. */
int en_resample_piece_rows(void);
void en_resample_h_rows(en_resampler *r, const uint8_t *src, size_t src_stride, int src_x0,
                        const en_axis *x, int flip, size_t src_slack, int row, int rows);
void en_resample_v(const en_resampler *r, const en_axis *x, const en_axis *y, uint8_t *out,
                   size_t stride);

#endif
