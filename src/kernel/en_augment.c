/*
 * Augmentation parameters as pure functions of (seed, epoch, sample id, echo
 * index).  A counter-based generator (Philox4x64-10, Salmon et al. 2011, the
 * same family as numpy.random.Philox) needs no state: any worker, thread or
 * GPU kernel that holds the key draws the same numbers, which is what makes
 * batches independent of worker count and scheduling.
 */
#include "en_kernel.h"

#include <math.h>
#include <string.h>

#include "en_opcodes.h"

static inline void mulhilo(uint64_t a, uint64_t b, uint64_t *hi, uint64_t *lo) {
    __uint128_t p = (__uint128_t)a * b;
    *hi = (uint64_t)(p >> 64);
    *lo = (uint64_t)p;
}

void en_philox4x64(const uint64_t ctr[4], const uint64_t key[2], uint64_t out[4]) {
    uint64_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint64_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        if (round) {
            k0 += 0x9E3779B97F4A7C15ULL;
            k1 += 0xBB67AE8584CAA73BULL;
        }
        uint64_t hi0, lo0, hi1, lo1;
        mulhilo(0xD2E7470EE14C6C93ULL, c0, &hi0, &lo0);
        mulhilo(0xCA5A826395121157ULL, c2, &hi1, &lo1);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* Domain tag in the second key word, so these streams never coincide with
 * another use of the same seed (shuffling, echo counts). */
#define EN_STREAM_CROP 0x63726f70ULL /* "crop" */

typedef struct draws {
    uint64_t ctr[4], key[2], words[4];
    int used;
} draws;

static void draws_init(draws *s, en_key k, uint64_t block) {
    s->ctr[0] = k.sample_id;
    s->ctr[1] = k.epoch;
    s->ctr[2] = k.echo_index;
    s->ctr[3] = block << 32;
    s->key[0] = k.seed;
    s->key[1] = EN_STREAM_CROP;
    s->used = 4;
}

/* Uniform double in [0, 1) from the top 53 bits. */
static double uniform(draws *s) {
    if (s->used == 4) {
        en_philox4x64(s->ctr, s->key, s->words);
        s->ctr[3]++;
        s->used = 0;
    }
    return (double)(s->words[s->used++] >> 11) * 0x1.0p-53;
}

void en_random_resized_crop(en_key key, int height, int width, en_rrc_spec spec, en_box *box,
                            int *flip) {
    draws s;
    draws_init(&s, key, 0);
    const double area = (double)height * width;
    const double log_lo = log(spec.ratio_lo), log_hi = log(spec.ratio_hi);
    int found = 0, h = height, w = width, top = 0, left = 0;
    for (int attempt = 0; attempt < 10 && !found; attempt++) {
        double target = area * (spec.scale_lo + (spec.scale_hi - spec.scale_lo) * uniform(&s));
        double aspect = exp(log_lo + (log_hi - log_lo) * uniform(&s));
        /* nearbyint rounds half to even, as Python's round() in torchvision. */
        int cw = (int)nearbyint(sqrt(target * aspect));
        int ch = (int)nearbyint(sqrt(target / aspect));
        double ui = uniform(&s), uj = uniform(&s);
        if (cw > 0 && cw <= width && ch > 0 && ch <= height) {
            h = ch;
            w = cw;
            top = (int)(ui * (height - h + 1));
            left = (int)(uj * (width - w + 1));
            found = 1;
        }
    }
    if (!found) { /* torchvision's fallback: the centre crop at the nearest allowed ratio */
        double in_ratio = (double)width / height;
        if (in_ratio < spec.ratio_lo) {
            w = width;
            h = (int)nearbyint(w / spec.ratio_lo);
        } else if (in_ratio > spec.ratio_hi) {
            h = height;
            w = (int)nearbyint(h * spec.ratio_hi);
        } else {
            w = width;
            h = height;
        }
        if (h < 1) h = 1;
        if (w < 1) w = 1;
        top = (height - h) / 2;
        left = (width - w) / 2;
    }
    box->top = top;
    box->left = left;
    box->height = h;
    box->width = w;
    /* The flip has its own block so it does not depend on how many tries the crop took. */
    draws f;
    draws_init(&f, key, 1);
    *flip = uniform(&f) < spec.flip_p;
}

en_box en_center_crop_box(int height, int width, int resize_side, int out_h, int out_w) {
    /* torchvision Resize(resize_side): the shorter side becomes resize_side and
     * the longer one int(resize_side * long / short); CenterCrop rounds the offset. */
    int rh, rw;
    if (width <= height) {
        rw = resize_side;
        rh = (int)((double)resize_side * height / width);
    } else {
        rh = resize_side;
        rw = (int)((double)resize_side * width / height);
    }
    double sy = (double)rh / height, sx = (double)rw / width;
    double ch = out_h < rh ? out_h : rh, cw = out_w < rw ? out_w : rw;
    double top = nearbyint((rh - ch) / 2.0), left = nearbyint((rw - cw) / 2.0);
    en_box b = {top / sy, left / sx, ch / sy, cw / sx};
    return b;
}

/* ---- the per-example ops' programs -------------------------------------- */

#define EN_STREAM_OPS 0x6F707321ULL /* "ops!" */

/* Op k of a row reads blocks k << 32, (k << 32) + 1, ... of its stream. */
static void op_draws(draws *s, uint64_t seed, uint64_t epoch, uint64_t sample_id,
                     uint64_t echo_index, int k) {
    s->ctr[0] = epoch;
    s->ctr[1] = sample_id;
    s->ctr[2] = echo_index;
    s->ctr[3] = (uint64_t)k << 32;
    s->key[0] = seed;
    s->key[1] = EN_STREAM_OPS;
    s->used = 4;
}

static double between(draws *s, double lo, double hi) { return lo + (hi - lo) * uniform(s); }

/* Uniform integer in 0 .. n - 1 (torch.randint(n)); n is far below 2^53, so the
 * bias of scaling a 53-bit uniform is below 2^-30. */
static int64_t below(draws *s, int64_t n) {
    int64_t v = (int64_t)(uniform(s) * (double)n);
    return v < n ? v : n - 1;
}

typedef struct program {
    int32_t *codes;
    float *args;
    int steps, k;
} program;

static void emit(program *p, int code, const double *a, int count) {
    if (p->k >= p->steps) return; /* steps comes from en_ops_steps: never short */
    p->codes[p->k] = code;
    for (int i = 0; i < count && i < OP_ARGS; i++) p->args[p->k * OP_ARGS + i] = (float)a[i];
    p->k++;
}

/* torchvision's ColorJitter (with RandomApply's p): the four adjustments in the
 * order of a uniform permutation (randperm(4)), each factor uniform on its range. */
static void draw_color_jitter(draws *s, const double *v, program *p) {
    if (uniform(s) >= v[0]) return;
    static const int codes[4] = {OP_BRIGHTNESS, OP_CONTRAST, OP_SATURATION, OP_HUE};
    int order[4] = {0, 1, 2, 3};
    for (int i = 3; i > 0; i--) { /* Fisher-Yates */
        const int j = (int)below(s, i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (int i = 0; i < 4; i++) {
        const int which = order[i];
        const double lo = v[1 + 2 * which], hi = v[2 + 2 * which];
        const double identity = which == 3 ? 0.0 : 1.0;
        if (lo == identity && hi == identity) continue; /* torchvision leaves it out */
        const double f = between(s, lo, hi);
        emit(p, codes[which], &f, 1);
    }
}

/* Pillow's rotate(degrees) about the image centre as the inverse affine map the
 * AFFINE op takes (augment.rotation in Python); cos and sin are rounded to 15
 * decimals so that right angles map exactly. */
static void rotation(double degrees, int h, int w, double *m) {
    double d = fmod(degrees, 360.0);
    if (d < 0) d += 360.0;
    const double a = -(d * (3.14159265358979323846 / 180.0)); /* as math.radians */
    const double c = nearbyint(cos(a) * 1e15) / 1e15, sn = nearbyint(sin(a) * 1e15) / 1e15;
    const double cx = w / 2.0, cy = h / 2.0;
    m[0] = c;
    m[1] = sn;
    m[2] = c * -cx + sn * -cy + cx;
    m[3] = -sn;
    m[4] = c;
    m[5] = -sn * -cx + c * -cy + cy;
}

/* torchvision's TrivialAugmentWide (its PIL path): one of 14 ops, uniformly, at a
 * uniform magnitude bin of the wide ranges, with a random sign for signed ops. */
static void draw_trivial_wide(draws *s, const double *v, int h, int w, program *p) {
    enum { IDENTITY, SHEAR_X, SHEAR_Y, TRANSLATE_X, TRANSLATE_Y, ROTATE, BRIGHT, COLOR,
           CONTRAST, SHARP, POSTERIZE, SOLARIZE, AUTOCONTRAST, EQUALIZE, COUNT };
    const int bins = (int)v[0];
    const double fill = v[1];
    const int op = (int)below(s, COUNT);
    const int b = (int)below(s, bins);
    const double t = (double)b / (bins - 1);
    double m = 0.0;
    switch (op) {
        case SHEAR_X: case SHEAR_Y: case BRIGHT: case COLOR: case CONTRAST: case SHARP:
            m = 0.99 * t; break;
        case TRANSLATE_X: case TRANSLATE_Y: m = 32.0 * t; break;
        case ROTATE: m = 135.0 * t; break;
        case POSTERIZE: m = 8.0 - nearbyint(b / ((bins - 1) / 6.0)); break;
        case SOLARIZE: m = 255.0 * (1.0 - t); break;
        default: break;
    }
    if (op >= SHEAR_X && op <= SHARP && below(s, 2)) m = -m;
    double a[7] = {1.0, 0.0, 0.0, 0.0, 1.0, 0.0, fill};
    switch (op) {
        case SHEAR_X: a[1] = m; emit(p, OP_AFFINE, a, 7); break;
        case SHEAR_Y: a[3] = m; emit(p, OP_AFFINE, a, 7); break;
        case TRANSLATE_X: a[2] = -trunc(m); emit(p, OP_AFFINE, a, 7); break; /* int(m) px */
        case TRANSLATE_Y: a[5] = -trunc(m); emit(p, OP_AFFINE, a, 7); break;
        case ROTATE: rotation(m, h, w, a); emit(p, OP_AFFINE, a, 7); break;
        case BRIGHT: case COLOR: case CONTRAST: case SHARP: {
            static const int codes[4] = {OP_BRIGHTNESS, OP_SATURATION, OP_CONTRAST,
                                         OP_SHARPNESS};
            const double f = 1.0 + m;
            emit(p, codes[op - BRIGHT], &f, 1);
            break;
        }
        case POSTERIZE: emit(p, OP_POSTERIZE, &m, 1); break;
        case SOLARIZE: emit(p, OP_SOLARIZE, &m, 1); break;
        case AUTOCONTRAST: emit(p, OP_AUTOCONTRAST, NULL, 0); break;
        case EQUALIZE: emit(p, OP_EQUALIZE, NULL, 0); break;
        default: break; /* identity */
    }
}

/* torchvision's RandomErasing.get_params: ten tries at an area uniform on scale x
 * the image's and a log-uniform aspect ratio; the first that fits is placed
 * uniformly, else nothing is erased. */
static void draw_erasing(draws *s, const double *v, int h, int w, program *p) {
    if (uniform(s) >= v[0]) return;
    const double area = (double)h * w;
    for (int attempt = 0; attempt < 10; attempt++) {
        const double erase = area * between(s, v[1], v[2]);
        const double aspect = exp(between(s, v[3], v[4]));
        /* nearbyint rounds half to even, as Python's round() in torchvision */
        const int64_t eh = (int64_t)nearbyint(sqrt(erase * aspect));
        const int64_t ew = (int64_t)nearbyint(sqrt(erase / aspect));
        if (!(eh < h && ew < w)) continue;
        const double top = (double)below(s, h - eh + 1), left = (double)below(s, w - ew + 1);
        const double a[7] = {top, left, (double)eh, (double)ew, v[5], v[6], v[7]};
        emit(p, OP_ERASE, a, 7);
        return;
    }
}

#define EN_DRAW_ROW(name, kind, numbers, steps) {#name, kind, numbers, steps},
const en_draw_kind en_draw_kinds[] = {EN_DRAW_LIST(EN_DRAW_ROW) {NULL, 0, 0, 0}};
#undef EN_DRAW_ROW

int en_ops_steps(const en_op_spec *ops, int nops) {
    int steps = 0;
    for (int k = 0; k < nops; k++) {
        switch (ops[k].kind) {
#define EN_DRAW_STEPS(name, kind, numbers, n) case EN_DRAW_##name: steps += n; break;
            EN_DRAW_LIST(EN_DRAW_STEPS)
#undef EN_DRAW_STEPS
            default: return -1;
        }
    }
    return steps;
}

void en_ops_draw(const en_op_spec *ops, int nops, int steps, uint64_t seed,
                 const int64_t *epochs, const int64_t *sample_ids, const int64_t *echo_index,
                 int64_t n, int h, int w, int32_t *codes, float *args) {
    memset(codes, 0, (size_t)n * steps * sizeof *codes);
    memset(args, 0, (size_t)n * steps * OP_ARGS * sizeof *args);
    for (int64_t i = 0; i < n; i++) {
        program p = {codes + i * steps, args + i * steps * OP_ARGS, steps, 0};
        for (int k = 0; k < nops; k++) {
            draws s;
            op_draws(&s, seed, (uint64_t)epochs[i], (uint64_t)sample_ids[i],
                     (uint64_t)echo_index[i], k);
            const double *v = ops[k].v;
            switch (ops[k].kind) {
                case EN_DRAW_COLOR_JITTER: draw_color_jitter(&s, v, &p); break;
                case EN_DRAW_GRAYSCALE:
                    if (uniform(&s) < v[0]) emit(&p, OP_GRAYSCALE, NULL, 0);
                    break;
                case EN_DRAW_TRIVIAL_WIDE: draw_trivial_wide(&s, v, h, w, &p); break;
                case EN_DRAW_ERASING: draw_erasing(&s, v, h, w, &p); break;
                default: break;
            }
        }
    }
}
