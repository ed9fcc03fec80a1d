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
    en_buf_free(&r->xpairs);
    en_buf_free(&r->ypairs);
    en_buf_free(&r->xplan);
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

/* The horizontal pass as 16-bit multiply-adds, bit-exact with the scalar code.
 * A 22-bit weight c does not fit a 16-bit lane, but its halves do: with
 * c = hi * 2^11 + lo (0 <= hi <= 2^11, 0 <= lo < 2^11), sum(p * c) =
 * 2^11 * sum(p * hi) + sum(p * lo), each sum exact in 32 bits.  Taps go in
 * pairs: one unaligned load per row brings two neighbouring RGB pixels, one
 * in-lane shuffle spreads them into (R0 R1 G0 G1 B0 B1 0 0) words, and
 * vpmaddwd against (hi0 hi1) and (lo0 lo1) adds both taps of all three
 * channels at once.  The shuffles are the only port-5 work (one per pair and
 * two rows), which is what limited the older one-tap-at-a-time kernel.
 *
 * Pairs are packed per output pixel by pack_pairs: npairs words of hi halves,
 * then npairs of lo halves, (second << 16) | first, zero past `count`. */
static int pair_count(const en_axis *x) { return (x->ksize + 1) / 2; }

static int pack_pairs(en_buf *buf, const en_axis *x) {
    const int np = pair_count(x);
    if (en_buf_reserve(buf, sizeof(uint32_t) * 2 * (size_t)np * x->out_size)) return -1;
    uint32_t *w = buf->p;
    for (int i = 0; i < x->out_size; i++, w += 2 * np) {
        const int32_t *c = x->coeffs + (size_t)i * x->ksize;
        for (int j = 0; j < np; j++) {
            const int k = 2 * j, n = x->count[i];
            const uint32_t c0 = k < n ? (uint32_t)c[k] : 0, c1 = k + 1 < n ? (uint32_t)c[k + 1] : 0;
            w[j] = (c0 >> 11) | (c1 >> 11) << 16;
            w[np + j] = (c0 & 2047u) | (c1 & 2047u) << 16;
        }
    }
    return 0;
}

/* Pillow's rounded sum from the split accumulators, (2^11 hi + lo + 2^21) >> 22,
 * as (hi + ((lo + 2^21) >> 11)) >> 11: floor divisions nest, so the two are the
 * same integer, and the lo accumulators start at the rounding term (ROUND_LO),
 * which leaves two shifts and an add. */
#define ROUND_LO (1 << (PRECISION_BITS - 1))

__attribute__((target("avx2"))) static inline __m256i combine256(__m256i hi, __m256i lo) {
    return _mm256_srai_epi32(_mm256_add_epi32(hi, _mm256_srai_epi32(lo, 11)), 11);
}

/* Output pixel i of four rows: (R G B 0) int32 per 128-bit lane, already
 * shifted down; lanes: a[0] = rows 0 | 1, a[1] = rows 2 | 3. */
__attribute__((target("avx2"))) static inline void madd_pixel(
    const uint8_t *src, const size_t s[4], int src_x0, const en_axis *x, const uint32_t *pairs,
    int np, int i, __m256i spread, __m256i a[2]) {
    const uint32_t *ph = pairs + (size_t)i * 2 * np, *pl = ph + np;
    const uint8_t *p = src + (size_t)(x->first[i] - src_x0) * 3;
    __m256i h01 = _mm256_setzero_si256(), h23 = h01;
    __m256i l01 = _mm256_set1_epi32(ROUND_LO), l23 = l01;
    for (int j = 0, n = (x->count[i] + 1) >> 1; j < n; j++, p += 6) {
        const __m256i ch = _mm256_set1_epi32((int)ph[j]), cl = _mm256_set1_epi32((int)pl[j]);
        const __m256i v01 = _mm256_shuffle_epi8(
            _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const void *)p)),
                                    _mm_loadu_si128((const void *)(p + s[1])), 1),
            spread);
        const __m256i v23 = _mm256_shuffle_epi8(
            _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const void *)(p + s[2]))),
                _mm_loadu_si128((const void *)(p + s[3])), 1),
            spread);
        h01 = _mm256_add_epi32(h01, _mm256_madd_epi16(v01, ch));
        l01 = _mm256_add_epi32(l01, _mm256_madd_epi16(v01, cl));
        h23 = _mm256_add_epi32(h23, _mm256_madd_epi16(v23, ch));
        l23 = _mm256_add_epi32(l23, _mm256_madd_epi16(v23, cl));
    }
    a[0] = combine256(h01, l01);
    a[1] = combine256(h23, l23);
}

/* 12 bytes of one 128-bit lane to dst (an 8-byte and a 4-byte store: never
 * past the 4 pixels, which may end a row or abut pixels written already). */
__attribute__((target("avx2"))) static inline void store12(uint8_t *dst, __m128i v) {
    _mm_storel_epi64((__m128i *)dst, v);
    const uint32_t last = (uint32_t)_mm_extract_epi32(v, 2);
    memcpy(dst + 8, &last, 4);
}

/* Up to four rows (nrows 1..4; missing rows repeat the last and are not
 * stored), four output pixels per step: the accumulators of pixels
 * i..i+3 are packed together (packs/packus saturate to [0, 255], the same
 * clamp as clip8) and one shuffle per two rows drops the fourth byte of
 * each pixel, reversing the pixels when flipping.  A pair's load reads 16
 * bytes from its first pixel: at most 13 bytes past the last pixel of the
 * row that the filter uses, so the caller guarantees 16 addressable bytes
 * after the end of the last row. */
__attribute__((target("avx2"))) static void horizontal_rows4_madd(
    const uint8_t *src, size_t src_stride, int nrows, int src_x0, const en_axis *x,
    const uint32_t *pairs, int flip, uint8_t *tmp) {
    const int out_w = x->out_size, np = pair_count(x);
    const size_t tstride = (size_t)out_w * 3;
    size_t s[4] = {0, 0, 0, 0};
    for (int r = 1; r < 4; r++) s[r] = (size_t)(r < nrows ? r : nrows - 1) * src_stride;
    const __m256i spread = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1,
                                            -1, 0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1,
                                            -1, -1);
    const __m256i pack = flip ? _mm256_setr_epi8(12, 13, 14, 8, 9, 10, 4, 5, 6, 0, 1, 2, -1, -1,
                                                 -1, -1, 12, 13, 14, 8, 9, 10, 4, 5, 6, 0, 1, 2,
                                                 -1, -1, -1, -1)
                              : _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1,
                                                 -1, -1, 0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14,
                                                 -1, -1, -1, -1);
    int i = 0;
    for (; i + 4 <= out_w; i += 4) {
        __m256i a0[2], a1[2], a2[2], a3[2];
        madd_pixel(src, s, src_x0, x, pairs, np, i, spread, a0);
        madd_pixel(src, s, src_x0, x, pairs, np, i + 1, spread, a1);
        madd_pixel(src, s, src_x0, x, pairs, np, i + 2, spread, a2);
        madd_pixel(src, s, src_x0, x, pairs, np, i + 3, spread, a3);
        const size_t at = (size_t)(flip ? out_w - 4 - i : i) * 3;
        for (int g = 0; g < 2; g++) { /* rows 2g | 2g + 1 */
            const __m256i b = _mm256_shuffle_epi8(
                _mm256_packus_epi16(_mm256_packs_epi32(a0[g], a1[g]),
                                    _mm256_packs_epi32(a2[g], a3[g])),
                pack);
            if (2 * g < nrows) store12(tmp + 2 * g * tstride + at, _mm256_castsi256_si128(b));
            if (2 * g + 1 < nrows)
                store12(tmp + (2 * g + 1) * tstride + at, _mm256_extracti128_si256(b, 1));
        }
    }
    for (; i < out_w; i++) { /* the last out_w % 4 pixels, one at a time */
        __m256i a[2];
        madd_pixel(src, s, src_x0, x, pairs, np, i, spread, a);
        const __m256i p8 = _mm256_packus_epi16(_mm256_packs_epi32(a[0], a[1]),
                                               _mm256_setzero_si256());
        const __m128i lo = _mm256_castsi256_si128(p8), hi = _mm256_extracti128_si256(p8, 1);
        const uint32_t px[4] = {(uint32_t)_mm_cvtsi128_si32(lo), (uint32_t)_mm_cvtsi128_si32(hi),
                                (uint32_t)_mm_extract_epi32(lo, 1),
                                (uint32_t)_mm_extract_epi32(hi, 1)};
        uint8_t *dst = tmp + (size_t)(flip ? out_w - 1 - i : i) * 3;
        for (int r = 0; r < nrows; r++) memcpy(dst + r * tstride, &px[r], 3);
    }
}

/* Sixteen output bytes per step, taps in pairs of rows as in the horizontal
 * pass: the bytes of rows k and k + 1 interleaved into (p_k, p_k+1) words,
 * one vpmaddwd against the pair's hi halves and one against its lo halves. */
__attribute__((target("avx2"))) static void vertical_row_avx2(const uint8_t *tmp,
                                                               size_t row_bytes, size_t len,
                                                               int count,
                                                               const uint32_t *pairs, int np,
                                                               uint8_t *out) {
    const uint32_t *ph = pairs, *pl = pairs + np;
    const int n = (count + 1) >> 1;
    size_t i = 0;
    for (; i + 16 <= len; i += 16) {
        __m256i hlo = _mm256_setzero_si256(), hhi = hlo;
        __m256i llo = _mm256_set1_epi32(ROUND_LO), lhi = llo;
        const uint8_t *row = tmp + i;
        for (int j = 0; j < n; j++, row += 2 * row_bytes) {
            const __m256i ch = _mm256_set1_epi32((int)ph[j]), cl = _mm256_set1_epi32((int)pl[j]);
            const __m128i a = _mm_loadu_si128((const __m128i *)row);
            /* An odd count's last pair: its second weight is zero; read row k again. */
            const __m128i b = 2 * j + 1 < count
                                  ? _mm_loadu_si128((const __m128i *)(row + row_bytes)) : a;
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));
            const __m256i hi = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, b));
            hlo = _mm256_add_epi32(hlo, _mm256_madd_epi16(lo, ch));
            llo = _mm256_add_epi32(llo, _mm256_madd_epi16(lo, cl));
            hhi = _mm256_add_epi32(hhi, _mm256_madd_epi16(hi, ch));
            lhi = _mm256_add_epi32(lhi, _mm256_madd_epi16(hi, cl));
        }
        const __m256i lo = combine256(hlo, llo), hi = combine256(hhi, lhi);
        /* packs interleaves 64-bit quarters (0-3, 8-11 | 4-7, 12-15): put them back in order. */
        __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
        __m128i p8 = _mm_packus_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
        _mm_storeu_si128((__m128i *)(out + i), p8);
    }
}

/* ECHO_NATIVE_SIMD (read once) caps the instruction set: "avx2" keeps the
 * AVX-512 code out, "none" takes the scalar code; the tests hold all three to
 * the same bytes. */
static int simd_level(void) { /* 0 scalar, 1 AVX2, 2 AVX-512 (F, BW, VBMI, VNNI) */
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        const char *cap = getenv("ECHO_NATIVE_SIMD");
        const int most = !cap || !*cap ? 2 : !strcmp(cap, "avx2") ? 1 : 0;
        int level = __builtin_cpu_supports("avx2") ? 1 : 0;
        if (level && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni"))
            level = 2;
        cached = level < most ? level : most;
    }
    return cached;
}

static int have_avx2(void) { return simd_level() >= 1; }
static int have_avx512(void) { return simd_level() >= 2; }
#endif

/* The horizontal pass with AVX-512 VBMI + VNNI, one row at a time, eight
 * output pixels per step.  A group's input pixels all lie in one 64-byte
 * window (the plan checks it: true for any scale below about 2.2, which the
 * DCT-scale rule guarantees but for the largest images), so one masked load
 * brings them, and vpermb builds each output's (p_k, p_k+1) word pairs from
 * the window with no per-pixel loads at all.  vpdpwssd then multiplies and
 * adds a pair of taps of four outputs per instruction, on the same split
 * 22-bit weights as the AVX2 kernel: same sums, same bytes.  The masked load
 * reads only the group's own pixels, so this pass never over-reads.
 *
 * Plan (en_resampler.xplan), per group: its header, then per pair of taps six
 * 64-byte vectors: the vpermb indices of outputs 0-3 and 4-7, their hi-half
 * weights, their lo-half weights. */
typedef struct en_group {
    int base;       /* first input pixel of the window */
    int pairs;      /* pairs of taps the group's outputs need */
    uint64_t load;  /* bytes of the window to load */
} en_group;

enum { EN_GROUP = 8, EN_VEC = 64 };

static size_t plan_group_bytes(int np) { return sizeof(en_group) + (size_t)np * 6 * EN_VEC; }

/* Build the plan from pack_pairs' words; 0 if some group's pixels do not fit a
 * window (use AVX2). */
static int plan_groups(en_buf *buf, const en_axis *x, const uint32_t *pairs) {
    const int np = pair_count(x), groups = (x->out_size + EN_GROUP - 1) / EN_GROUP;
    const size_t gbytes = plan_group_bytes(np);
    if (en_buf_reserve(buf, gbytes * groups)) return 0;
    for (int g = 0; g < groups; g++) {
        const int i0 = g * EN_GROUP, n = x->out_size - i0 < EN_GROUP ? x->out_size - i0 : EN_GROUP;
        en_group *hd = (en_group *)((uint8_t *)buf->p + gbytes * g);
        hd->base = x->first[i0];
        int end = hd->base, need = 0;
        for (int q = 0; q < n; q++) {
            const int e = x->first[i0 + q] + x->count[i0 + q];
            if (e > end) end = e;
            if ((x->count[i0 + q] + 1) / 2 > need) need = (x->count[i0 + q] + 1) / 2;
        }
        if ((end - hd->base) * 3 > EN_VEC) return 0;
        hd->pairs = need;
        hd->load = (end - hd->base) * 3 == EN_VEC ? ~0ull : (1ull << ((end - hd->base) * 3)) - 1;
        uint8_t *v = (uint8_t *)(hd + 1);
        for (int j = 0; j < np; j++, v += 6 * EN_VEC) {
            for (int q = 0; q < EN_GROUP; q++) {
                const int o = i0 + (q < n ? q : n - 1); /* padding repeats the last output */
                const uint32_t hi = pairs[(size_t)o * 2 * np + j];
                const uint32_t lo = pairs[(size_t)o * 2 * np + np + j];
                const int b = (x->first[o] + 2 * j - hd->base) * 3;
                const int at = (q >> 2) * EN_VEC + (q & 3) * 16;
                /* Words R0 R1 G0 G1 B0 B1 0 0: the zero bytes come from vpermb's mask;
                 * a tap past `count` has weight 0, so its index may wrap (mod 64). */
                static const uint8_t spread[16] = {0, 0, 3, 0, 1, 0, 4, 0, 2, 0, 5, 0, 0, 0, 0, 0};
                for (int t = 0; t < 16; t++) v[at + t] = (uint8_t)((b + spread[t]) & 63);
                for (int t = 0; t < 4; t++) {
                    memcpy(v + 2 * EN_VEC + at + 4 * t, &hi, 4);
                    memcpy(v + 4 * EN_VEC + at + 4 * t, &lo, 4);
                }
            }
        }
    }
    return 1;
}

/* vpermb indices that gather eight packed outputs (out q at byte 16q, out q + 4
 * at byte 16q + 4 after packs/packus) into 24 RGB bytes, the first n of them
 * reversed when flipping. */
static void compact_indices(uint8_t idx[EN_VEC], int n, int flip) {
    memset(idx, 0, EN_VEC);
    for (int m = 0; m < n; m++) {
        const int src = m < 4 ? 16 * m : 16 * (m - 4) + 4, dst = 3 * (flip ? n - 1 - m : m);
        for (int c = 0; c < 3; c++) idx[dst + c] = (uint8_t)(src + c);
    }
}

/* combine256 for 512-bit accumulators. */
__attribute__((target("avx512f"))) static inline __m512i combine512(__m512i hi, __m512i lo) {
    return _mm512_srai_epi32(_mm512_add_epi32(hi, _mm512_srai_epi32(lo, 11)), 11);
}

__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vnni"))) static void horizontal_rows_512(
    const uint8_t *src, size_t src_stride, int rows, int src_x0, const en_axis *x,
    const uint8_t *plan, int flip, uint8_t *tmp) {
    const int out_w = x->out_size, np = pair_count(x);
    const int groups = (out_w + EN_GROUP - 1) / EN_GROUP, tail = out_w - (groups - 1) * EN_GROUP;
    const size_t gbytes = plan_group_bytes(np), tstride = (size_t)out_w * 3;
    uint8_t full_idx[EN_VEC], tail_idx[EN_VEC];
    compact_indices(full_idx, EN_GROUP, flip);
    compact_indices(tail_idx, tail, flip);
    const __m512i full = _mm512_loadu_si512(full_idx), last = _mm512_loadu_si512(tail_idx);
    const __mmask64 words = 0x0555055505550555ull; /* the 6 bytes per lane that carry pixels */
    for (int r = 0; r < rows; r++) {
        const uint8_t *in = src + (size_t)r * src_stride - (size_t)src_x0 * 3;
        uint8_t *o = tmp + (size_t)r * tstride;
        const uint8_t *gp = plan;
        for (int g = 0; g < groups; g++, gp += gbytes) {
            const en_group *hd = (const en_group *)gp;
            const __m512i w = _mm512_maskz_loadu_epi8(hd->load, in + (size_t)hd->base * 3);
            __m512i h0 = _mm512_setzero_si512(), h1 = h0;
            __m512i l0 = _mm512_set1_epi32(ROUND_LO), l1 = l0;
            const uint8_t *v = (const uint8_t *)(hd + 1);
            for (int j = 0; j < hd->pairs; j++, v += 6 * EN_VEC) {
                const __m512i a = _mm512_maskz_permutexvar_epi8(words, _mm512_loadu_si512(v), w);
                const __m512i b =
                    _mm512_maskz_permutexvar_epi8(words, _mm512_loadu_si512(v + EN_VEC), w);
                h0 = _mm512_dpwssd_epi32(h0, a, _mm512_loadu_si512(v + 2 * EN_VEC));
                h1 = _mm512_dpwssd_epi32(h1, b, _mm512_loadu_si512(v + 3 * EN_VEC));
                l0 = _mm512_dpwssd_epi32(l0, a, _mm512_loadu_si512(v + 4 * EN_VEC));
                l1 = _mm512_dpwssd_epi32(l1, b, _mm512_loadu_si512(v + 5 * EN_VEC));
            }
            const __m512i s0 = combine512(h0, l0), s1 = combine512(h1, l1);
            /* packs/packus saturate to [0, 255], the same clamp as clip8. */
            const __m512i p16 = _mm512_packs_epi32(s0, s1);
            const __m512i p8 = _mm512_packus_epi16(p16, p16);
            const int n = g == groups - 1 ? tail : EN_GROUP, i0 = g * EN_GROUP;
            const __m512i px = _mm512_permutexvar_epi8(n == EN_GROUP ? full : last, p8);
            const size_t at = (size_t)(flip ? out_w - i0 - n : i0) * 3;
            _mm512_mask_storeu_epi8(o + at, (1ull << (3 * n)) - 1, px);
        }
    }
}

/* 32 output bytes per step with AVX-512 VNNI: the same pairs of rows, words
 * interleaved per 128-bit lane, vpdpwssd for multiply and add, and vpmovusdb
 * (after a max with 0: the clamp of clip8) to bytes.  Returns bytes done. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static size_t vertical_row_512(
    const uint8_t *tmp, size_t row_bytes, int count, const uint32_t *pairs, int np,
    uint8_t *out) {
    const __m512i zero = _mm512_setzero_si512();
    const uint32_t *ph = pairs, *pl = pairs + np;
    const int n = (count + 1) >> 1;
    size_t i = 0;
    for (; i + 32 <= row_bytes; i += 32) {
        __m512i hlo = zero, hhi = zero, llo = _mm512_set1_epi32(ROUND_LO), lhi = llo;
        const uint8_t *row = tmp + i;
        for (int j = 0; j < n; j++, row += 2 * row_bytes) {
            const __m512i ch = _mm512_set1_epi32((int)ph[j]), cl = _mm512_set1_epi32((int)pl[j]);
            const __m256i a = _mm256_loadu_si256((const __m256i *)row);
            const __m256i b = 2 * j + 1 < count
                                  ? _mm256_loadu_si256((const __m256i *)(row + row_bytes)) : a;
            /* bytes 0-7 and 16-23 | 8-15 and 24-31, as (p_k, p_k+1) words */
            const __m512i lo = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(a, b));
            const __m512i hi = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(a, b));
            hlo = _mm512_dpwssd_epi32(hlo, lo, ch);
            llo = _mm512_dpwssd_epi32(llo, lo, cl);
            hhi = _mm512_dpwssd_epi32(hhi, hi, ch);
            lhi = _mm512_dpwssd_epi32(lhi, hi, cl);
        }
        const __m512i vlo = combine512(hlo, llo), vhi = combine512(hhi, lhi);
        const __m128i blo = _mm512_cvtusepi32_epi8(_mm512_max_epi32(vlo, zero));
        const __m128i bhi = _mm512_cvtusepi32_epi8(_mm512_max_epi32(vhi, zero));
        _mm_storeu_si128((__m128i *)(out + i), _mm_unpacklo_epi64(blo, bhi));
        _mm_storeu_si128((__m128i *)(out + i + 16), _mm_unpackhi_epi64(blo, bhi));
    }
    return i;
}

int en_resample_piece_rows(void) {
#ifdef EN_HAVE_AVX2
    /* Measured on the kernel benchmark: interleaving libjpeg's code with the
     * 512-bit pass in small pieces costs more than the pieces' L1 locality
     * gains; for the 256-bit and scalar passes, 16 rows at a time win. */
    if (have_avx512()) return 0;
#endif
    return 16;
}

int en_resample_begin(en_resampler *r, const en_axis *x, const en_axis *y) {
    if (en_buf_reserve(&r->tmp, (size_t)x->out_size * 3 * (size_t)(y->hi - y->lo))) return -1;
#ifdef EN_HAVE_AVX2
    if (have_avx2() && (pack_pairs(&r->xpairs, x) || pack_pairs(&r->ypairs, y))) return -1;
    r->xgroups = have_avx512() && plan_groups(&r->xplan, x, r->xpairs.p);
#endif
    return 0;
}

void en_resample_h_rows(en_resampler *r, const uint8_t *src, size_t src_stride, int src_x0,
                        const en_axis *x, int flip, size_t src_slack, int row, int rows) {
    const size_t row_bytes = (size_t)x->out_size * 3;
    uint8_t *tmp = (uint8_t *)r->tmp.p + (size_t)row * row_bytes;
    int done = 0;
#ifdef EN_HAVE_AVX2
    if (r->xgroups) {
        horizontal_rows_512(src, src_stride, rows, src_x0, x, r->xplan.p, flip, tmp);
        return;
    }
    if (have_avx2()) {
        /* Rows whose over-read (16 bytes past their end) stays inside the buffer. */
        int safe_rows = rows;
        while (safe_rows > 0 && (size_t)(rows - safe_rows) * src_stride + src_slack < 16)
            safe_rows--;
        for (; done < safe_rows; done += 4) {
            const int n = safe_rows - done < 4 ? safe_rows - done : 4;
            horizontal_rows4_madd(src + (size_t)done * src_stride, src_stride, n, src_x0, x,
                                  r->xpairs.p, flip, tmp + (size_t)done * row_bytes);
            if (n < 4) done = safe_rows - 4; /* the loop's step lands on safe_rows */
        }
    }
#endif
    horizontal_rows(src + (size_t)done * src_stride, src_stride, src_x0, rows - done, x, flip,
                    tmp + (size_t)done * row_bytes);
}

void en_resample_v(const en_resampler *r, const en_axis *x, const en_axis *y, uint8_t *out,
                   size_t stride) {
    const size_t row_bytes = (size_t)x->out_size * 3;
    const uint8_t *tmp = r->tmp.p;
#ifdef EN_HAVE_AVX2
    const int simd = have_avx2(), wide_simd = have_avx512(), np = pair_count(y);
#endif
    for (int j = 0; j < y->out_size; j++) {
        const uint8_t *base = tmp + (size_t)(y->first[j] - y->lo) * row_bytes;
        const int32_t *c = y->coeffs + (size_t)j * y->ksize;
        uint8_t *o = out + (size_t)j * stride;
#ifdef EN_HAVE_AVX2
        if (simd) {
            const uint32_t *pairs = (const uint32_t *)r->ypairs.p + (size_t)j * 2 * np;
            const size_t wide = wide_simd ? vertical_row_512(base, row_bytes, y->count[j],
                                                             pairs, np, o) : 0;
            vertical_row_avx2(base + wide, row_bytes, row_bytes - wide, y->count[j], pairs, np,
                              o + wide);
            const size_t done = wide + ((row_bytes - wide) & ~(size_t)15);
            if (done < row_bytes)
                vertical_row(base + done, row_bytes, row_bytes - done, y->count[j], c, o + done);
            continue;
        }
#endif
        vertical_row(base, row_bytes, row_bytes, y->count[j], c, o);
    }
}

int en_resample(en_resampler *r, const uint8_t *src, size_t src_stride, int src_x0, int src_y0,
                const en_axis *x, const en_axis *y, int flip, size_t src_slack, uint8_t *out,
                size_t stride) {
    if (en_resample_begin(r, x, y)) return -1;
    en_resample_h_rows(r, src + (size_t)(y->lo - src_y0) * src_stride, src_stride, src_x0, x,
                       flip, src_slack, 0, y->hi - y->lo);
    en_resample_v(r, x, y, out, stride);
    return 0;
}
