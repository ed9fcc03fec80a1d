/*
 * Antialiased bilinear resampling, numerically the same scheme as Pillow's
 * Image.resize(size, BILINEAR, box): a triangle filter widened by the
 * downscale factor, weights normalised per output pixel and rounded to 22-bit
 * fixed point, a horizontal pass rounded to uint8, then a vertical pass.
 * Matching Pillow keeps echo_native a drop-in for torchvision pipelines.
 */
#include "en_resize.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* 32 bits of accumulator minus 8 for the pixel and 2 of headroom, as Pillow. */
#define PRECISION_BITS 22

/* The vertical pass is a long run of identical multiply-adds over contiguous
 * bytes: compile it twice and let the loader pick AVX2 where the CPU has it,
 * so one portable wheel still gets the wide loop. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(EN_NO_MULTIVERSION) && !defined(__SANITIZE_ADDRESS__)
#define EN_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define EN_MULTIVERSION
#endif

int en_buf_reserve(en_buf *b, size_t bytes) {
    if (bytes <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < bytes) cap *= 2;
    void *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

void en_buf_free(en_buf *b) {
    free(b->p);
    b->p = NULL;
    b->cap = 0;
}

void en_resampler_free(en_resampler *r) {
    en_buf_free(&r->xfirst);
    en_buf_free(&r->xcount);
    en_buf_free(&r->xcoef);
    en_buf_free(&r->yfirst);
    en_buf_free(&r->ycount);
    en_buf_free(&r->ycoef);
    en_buf_free(&r->tmp);
    en_buf_free(&r->acc);
}

static inline double triangle(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static inline uint8_t clip8(int32_t v) {
    v >>= PRECISION_BITS;
    return (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

int en_plan_axis(en_resampler *r, int horizontal, double in0, double in1, int in_size,
                 int out_size, en_axis *axis) {
    double scale = (in1 - in0) / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale;   /* bilinear support is one input pixel */
    int ksize = (int)ceil(support) * 2 + 1;
    en_buf *bf = horizontal ? &r->xfirst : &r->yfirst;
    en_buf *bc = horizontal ? &r->xcount : &r->ycount;
    en_buf *bk = horizontal ? &r->xcoef : &r->ycoef;
    if (en_buf_reserve(bf, sizeof(int) * out_size) || en_buf_reserve(bc, sizeof(int) * out_size) ||
        en_buf_reserve(bk, sizeof(int32_t) * (size_t)out_size * ksize))
        return -1;
    axis->out_size = out_size;
    axis->ksize = ksize;
    axis->first = bf->p;
    axis->count = bc->p;
    axis->coeffs = bk->p;
    axis->lo = in_size;
    axis->hi = 0;

    double weights[64 + 1];
    double *w = ksize <= 64 ? weights : malloc(sizeof(double) * ksize);
    if (!w) return -1;
    double inv = 1.0 / filterscale;
    for (int i = 0; i < out_size; i++) {
        double center = in0 + (i + 0.5) * scale;
        int lo = (int)(center - support + 0.5);
        int hi = (int)(center + support + 0.5);
        if (lo < 0) lo = 0;
        if (hi > in_size) hi = in_size;
        int n = hi - lo;
        double total = 0.0;
        for (int k = 0; k < n; k++) {
            w[k] = triangle((k + lo - center + 0.5) * inv);
            total += w[k];
        }
        int32_t *c = axis->coeffs + (size_t)i * ksize;
        for (int k = 0; k < ksize; k++) {
            double v = k < n && total != 0.0 ? w[k] / total : 0.0;
            v *= (double)(1 << PRECISION_BITS);
            c[k] = (int32_t)(v < 0 ? v - 0.5 : v + 0.5);
        }
        axis->first[i] = lo;
        axis->count[i] = n;
        if (n > 0) {
            if (lo < axis->lo) axis->lo = lo;
            if (hi > axis->hi) axis->hi = hi;
        }
    }
    if (w != weights) free(w);
    if (axis->hi <= axis->lo) return -1;
    return 0;
}

static void horizontal_pass(const uint8_t *src, size_t src_stride, int src_x0, int rows,
                            const en_axis *x, int flip, uint8_t *tmp) {
    const int out_w = x->out_size, ksize = x->ksize;
    for (int row = 0; row < rows; row++) {
        const uint8_t *in = src + (size_t)row * src_stride;
        uint8_t *o = tmp + (size_t)row * out_w * 3;
        for (int i = 0; i < out_w; i++) {
            const int32_t *c = x->coeffs + (size_t)i * ksize;
            const uint8_t *p = in + (size_t)(x->first[i] - src_x0) * 3;
            int32_t r = 1 << (PRECISION_BITS - 1), g = r, b = r;
            for (int k = 0; k < x->count[i]; k++, p += 3) {
                r += p[0] * c[k];
                g += p[1] * c[k];
                b += p[2] * c[k];
            }
            uint8_t *dst = o + (size_t)(flip ? out_w - 1 - i : i) * 3;
            dst[0] = clip8(r);
            dst[1] = clip8(g);
            dst[2] = clip8(b);
        }
    }
}

EN_MULTIVERSION
static void vertical_row(const uint8_t *tmp, size_t row_bytes, int first, int count,
                         const int32_t *c, int32_t *acc, uint8_t *out) {
    for (size_t i = 0; i < row_bytes; i++) acc[i] = 1 << (PRECISION_BITS - 1);
    for (int k = 0; k < count; k++) {
        const uint8_t *in = tmp + (size_t)(first + k) * row_bytes;
        const int32_t ck = c[k];
        for (size_t i = 0; i < row_bytes; i++) acc[i] += in[i] * ck;
    }
    for (size_t i = 0; i < row_bytes; i++) {
        int32_t v = acc[i] >> PRECISION_BITS;
        out[i] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
    }
}

int en_resample(en_resampler *r, const uint8_t *src, size_t src_stride, int src_x0, int src_y0,
                const en_axis *x, const en_axis *y, int flip, uint8_t *out, size_t stride) {
    const int rows = y->hi - y->lo;
    const size_t row_bytes = (size_t)x->out_size * 3;
    if (en_buf_reserve(&r->tmp, row_bytes * rows) ||
        en_buf_reserve(&r->acc, sizeof(int32_t) * row_bytes))
        return -1;
    uint8_t *tmp = r->tmp.p;
    horizontal_pass(src + (size_t)(y->lo - src_y0) * src_stride, src_stride, src_x0, rows, x, flip,
                    tmp);
    for (int j = 0; j < y->out_size; j++) {
        vertical_row(tmp, row_bytes, y->first[j] - y->lo, y->count[j],
                     y->coeffs + (size_t)j * y->ksize, r->acc.p, out + (size_t)j * stride);
    }
    return 0;
}
