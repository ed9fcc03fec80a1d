/*
 * Augmentation parameters as pure functions of (seed, epoch, sample id, echo
 * index).  A counter-based generator (Philox4x64-10, Salmon et al. 2011, the
 * same family as numpy.random.Philox) needs no state: any worker, thread or
 * GPU kernel that holds the key draws the same numbers, which is what makes
 * batches independent of worker count and scheduling.
 */
#include "en_kernel.h"

#include <math.h>

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
