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

/* SIMD: AVX2 versions of both passes, picked at run time, so a portable build
 * (no -march) still gets them on CPUs that have AVX2.  They are bit-exact
 * with the scalar code: same 22-bit weights, 32-bit products, same rounding. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(EN_NO_SIMD)
#define EN_HAVE_AVX2 1
#include <immintrin.h>
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

static inline void store3(uint8_t *dst, int32_t r, int32_t g, int32_t b) {
    dst[0] = clip8(r);
    dst[1] = clip8(g);
    dst[2] = clip8(b);
}

static void horizontal_rows(const uint8_t *src, size_t src_stride, int src_x0, int rows,
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
            store3(o + (size_t)(flip ? out_w - 1 - i : i) * 3, r, g, b);
        }
    }
}

/* n bytes of one output row from `count` rows of tmp, `row_bytes` apart. */
static void vertical_row(const uint8_t *tmp, size_t row_bytes, size_t n, int count,
                         const int32_t *c, uint8_t *out) {
    for (size_t i = 0; i < n; i++) {
        int32_t acc = 1 << (PRECISION_BITS - 1);
        for (int k = 0; k < count; k++) acc += tmp[(size_t)k * row_bytes + i] * c[k];
        out[i] = clip8(acc);
    }
}

#ifdef EN_HAVE_AVX2
static inline uint32_t load4(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Four rows at a time: every tap loads one RGB pixel (plus the next byte,
 * whose lane is discarded) from each row, widened to 32-bit lanes, two rows
 * per 256-bit register, so each tap is two multiplies for 12 channels.  Reads
 * one byte past a pixel: the caller guarantees that byte is addressable. */
__attribute__((target("avx2"))) static void horizontal_rows4_avx2(
    const uint8_t *src, size_t src_stride, int src_x0, const en_axis *x, int flip, uint8_t *tmp) {
    const int out_w = x->out_size, ksize = x->ksize;
    const size_t tstride = (size_t)out_w * 3;
    const __m256i half = _mm256_set1_epi32(1 << (PRECISION_BITS - 1));
    for (int i = 0; i < out_w; i++) {
        const int32_t *c = x->coeffs + (size_t)i * ksize;
        const uint8_t *p = src + (size_t)(x->first[i] - src_x0) * 3;
        __m256i a01 = half, a23 = half;
        for (int k = 0; k < x->count[i]; k++, p += 3) {
            const __m256i ck = _mm256_set1_epi32(c[k]);
            __m128i v01 = _mm_insert_epi32(_mm_cvtsi32_si128((int)load4(p)),
                                           (int)load4(p + src_stride), 1);
            __m128i v23 = _mm_insert_epi32(_mm_cvtsi32_si128((int)load4(p + 2 * src_stride)),
                                           (int)load4(p + 3 * src_stride), 1);
            a01 = _mm256_add_epi32(a01, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(v01), ck));
            a23 = _mm256_add_epi32(a23, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(v23), ck));
        }
        a01 = _mm256_srai_epi32(a01, PRECISION_BITS);
        a23 = _mm256_srai_epi32(a23, PRECISION_BITS);
        /* packs/packus saturate to [0, 255], the same clamp as clip8.  Per
         * 128-bit lane: low = rows 0 and 2, high = rows 1 and 3. */
        __m256i p16 = _mm256_packs_epi32(a01, a23);
        __m256i p8 = _mm256_packus_epi16(p16, p16);
        __m128i lo = _mm256_castsi256_si128(p8), hi = _mm256_extracti128_si256(p8, 1);
        uint32_t px[4] = {(uint32_t)_mm_cvtsi128_si32(lo), (uint32_t)_mm_cvtsi128_si32(hi),
                          (uint32_t)_mm_extract_epi32(lo, 1), (uint32_t)_mm_extract_epi32(hi, 1)};
        uint8_t *dst = tmp + (size_t)(flip ? out_w - 1 - i : i) * 3;
        for (int r = 0; r < 4; r++) memcpy(dst + r * tstride, &px[r], 3);
    }
}

/* Sixteen output bytes per step with the accumulators held in registers. */
__attribute__((target("avx2"))) static void vertical_row_avx2(const uint8_t *tmp,
                                                               size_t row_bytes, int count,
                                                               const int32_t *c, uint8_t *out) {
    const __m256i half = _mm256_set1_epi32(1 << (PRECISION_BITS - 1));
    size_t i = 0;
    for (; i + 16 <= row_bytes; i += 16) {
        __m256i lo = half, hi = half;
        for (int k = 0; k < count; k++) {
            const __m256i ck = _mm256_set1_epi32(c[k]);
            __m128i v = _mm_loadu_si128((const __m128i *)(tmp + (size_t)k * row_bytes + i));
            lo = _mm256_add_epi32(lo, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(v), ck));
            hi = _mm256_add_epi32(
                hi, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)), ck));
        }
        lo = _mm256_srai_epi32(lo, PRECISION_BITS);
        hi = _mm256_srai_epi32(hi, PRECISION_BITS);
        /* packs interleaves 64-bit quarters (0-3, 8-11 | 4-7, 12-15): put them back in order. */
        __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
        __m128i p8 = _mm_packus_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
        _mm_storeu_si128((__m128i *)(out + i), p8);
    }
    if (i < row_bytes) vertical_row(tmp + i, row_bytes, row_bytes - i, count, c, out + i);
}

static int have_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return cached;
}
#endif

int en_resample_h(en_resampler *r, const uint8_t *src, size_t src_stride, int src_x0,
                  int src_y0, const en_axis *x, const en_axis *y, int flip, int src_slack) {
    const int rows = y->hi - y->lo;
    const size_t row_bytes = (size_t)x->out_size * 3;
    if (en_buf_reserve(&r->tmp, row_bytes * rows)) return -1;
    uint8_t *tmp = r->tmp.p;
    const uint8_t *first = src + (size_t)(y->lo - src_y0) * src_stride;
    int done = 0;
#ifdef EN_HAVE_AVX2
    if (have_avx2()) {
        /* The 4-row kernel over-reads one byte after a pixel: fine on every row
         * but the last one of a buffer without slack, which the scalar loop takes. */
        const int safe_rows = src_slack ? rows : rows - 1;
        for (; done + 4 <= safe_rows; done += 4)
            horizontal_rows4_avx2(first + (size_t)done * src_stride, src_stride, src_x0, x, flip,
                                  tmp + (size_t)done * row_bytes);
    }
#endif
    horizontal_rows(first + (size_t)done * src_stride, src_stride, src_x0, rows - done, x, flip,
                    tmp + (size_t)done * row_bytes);
    return 0;
}

void en_resample_v(const en_resampler *r, const en_axis *x, const en_axis *y, uint8_t *out,
                   size_t stride) {
    const size_t row_bytes = (size_t)x->out_size * 3;
    const uint8_t *tmp = r->tmp.p;
#ifdef EN_HAVE_AVX2
    const int simd = have_avx2();
#endif
    for (int j = 0; j < y->out_size; j++) {
        const uint8_t *base = tmp + (size_t)(y->first[j] - y->lo) * row_bytes;
        const int32_t *c = y->coeffs + (size_t)j * y->ksize;
        uint8_t *o = out + (size_t)j * stride;
#ifdef EN_HAVE_AVX2
        if (simd) {
            vertical_row_avx2(base, row_bytes, y->count[j], c, o);
            continue;
        }
#endif
        vertical_row(base, row_bytes, row_bytes, y->count[j], c, o);
    }
}

int en_resample(en_resampler *r, const uint8_t *src, size_t src_stride, int src_x0, int src_y0,
                const en_axis *x, const en_axis *y, int flip, int src_slack, uint8_t *out,
                size_t stride) {
    if (en_resample_h(r, src, src_stride, src_x0, src_y0, x, y, flip, src_slack)) return -1;
    en_resample_v(r, x, y, out, stride);
    return 0;
}
