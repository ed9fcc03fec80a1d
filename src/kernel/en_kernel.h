/*
 * echo_native compiled core: fused JPEG decode + crop + resize + flip.
 *
 * Pure C over libjpeg-turbo; never includes Python.h.  Every entry point
 * returns 0 on success or a negative en_status, with a human-readable reason
 * in decoder->errmsg.  libjpeg's longjmp never leaves this library: each
 * function that calls into libjpeg owns its own setjmp.
 */
#ifndef EN_KERNEL_H
#define EN_KERNEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum en_status {
    EN_OK = 0,
    EN_ERR_DECODE = -1,   /* the bytes are not a decodable JPEG */
    EN_ERR_LIMIT = -2,    /* a guard tripped: pixel count, scan count, working memory */
    EN_ERR_ARG = -3,      /* the caller asked for something impossible */
    EN_ERR_NOMEM = -4,
} en_status;

typedef struct en_limits {
    uint64_t max_pixels;  /* decompression-bomb guard on width * height */
    int max_scans;        /* progressive scans allowed before giving up */
    int strict;           /* 1: a libjpeg warning that loses or corrupts image data is an
                           * error (truncation, corrupt entropy data, junk in or after a scan);
                           * harmless ones (junk between header segments, odd APPn
                           * contents) are counted and ignored.  See en_jpeg.c. */
    uint64_t max_memory;  /* bytes of working memory one decode may need (en_decoder_last_memory) */
} en_limits;

#define EN_DEFAULT_MAX_PIXELS ((uint64_t)89478485) /* Pillow's MAX_IMAGE_PIXELS */
#define EN_DEFAULT_MAX_SCANS 256
#define EN_DEFAULT_MAX_MEMORY ((uint64_t)512 << 20) /* 512 MiB */

typedef struct en_image_info {
    int width, height;
    int components;       /* channels stored in the file: 1, 3 or 4 */
    int progressive;
    int colorspace;       /* libjpeg J_COLOR_SPACE of the file */
} en_image_info;

/* A crop box in full-resolution pixel coordinates; fractional boxes are allowed. */
typedef struct en_box {
    double top, left, height, width;
} en_box;

typedef struct en_decoder en_decoder;

en_decoder *en_decoder_new(void);
void en_decoder_free(en_decoder *d);
void en_decoder_set_limits(en_decoder *d, en_limits limits);
en_limits en_decoder_get_limits(const en_decoder *d);
const char *en_decoder_errmsg(const en_decoder *d);
/* libjpeg warnings seen by the last call, by what they mean for the pixels:
 * data loss (what strict mode refuses; lenient mode counts and decodes on) and
 * harmless (header junk, odd metadata; never refused). */
int en_decoder_warnings(const en_decoder *d);
int en_decoder_harmless_warnings(const en_decoder *d);
int en_decoder_last_scale(const en_decoder *d); /* DCT denominator used by the last call */
/* Working memory the last header parsed needs (0 before any): the whole-image
 * coefficient buffers of a multi-scan (progressive) file, sum over components
 * of width_in_blocks * height_in_blocks (rounded up to the sampling factors)
 * * 64 * sizeof(JCOEF), plus the full-size RGB image, width * height * 3.
 * A header needing more than limits.max_memory is refused (EN_ERR_LIMIT) by
 * every entry point, before anything is allocated. */
uint64_t en_decoder_last_memory(const en_decoder *d);

/* Where the time of the crop entry points goes (decode_crop, decode_random_crop,
 * decode_center_crop), summed over calls while profiling is on; for
 * benchmarks.  Off (the default), each stage costs one untaken branch. */
typedef struct en_profile {
    uint64_t calls;
    uint64_t header_ns; /* header, table and limit checks, the box and its DCT scale */
    uint64_t start_ns;  /* jpeg_start_decompress: all of a multi-scan file's entropy decode */
    uint64_t skip_ns;   /* jpeg_skip_scanlines to the crop's first row (entropy decode only) */
    uint64_t rows_ns;   /* the crop's rows: entropy decode, IDCT, upsampling, colour */
    uint64_t tail_ns;   /* strict mode's look at the bytes below the crop */
    uint64_t hpass_ns;  /* horizontal resampling pass, the flip folded in */
    uint64_t vpass_ns;  /* vertical resampling pass, straight into the output */
    uint64_t finish_ns; /* releasing libjpeg's state for the next image */
} en_profile;

void en_decoder_profile(en_decoder *d, int on); /* on: zero and start; off: stop, keep */
en_profile en_decoder_get_profile(const en_decoder *d);

/* Header only: dimensions, channel count, coding process. */
int en_jpeg_info(en_decoder *d, const uint8_t *data, size_t len, en_image_info *info);

/* Full-size decode to RGB; out holds height rows of `stride` bytes. */
int en_jpeg_decode(en_decoder *d, const uint8_t *data, size_t len,
                   uint8_t *out, size_t out_cap, size_t stride);

/* DCT denominator (1, 2, 4, 8) for cropping box to out_h x out_w: the largest
 * d with box.height / d >= out_h and box.width / d >= out_w. */
int en_pick_scale(en_box box, int out_h, int out_w);

/* Fused crop + (DCT scale) + antialiased bilinear resize + optional flip.
 * Only the iMCU rows and columns the resampling filter touches are decoded. */
int en_jpeg_decode_crop(en_decoder *d, const uint8_t *data, size_t len, en_box box,
                        int out_h, int out_w, int flip, uint8_t *out, size_t stride);

/* A canvas for echoing before augmentation: the whole image at the largest
 * DCT denominator d in (8, 4, 2, 1) that keeps both sides, rounded up, at
 * least min_side; shrunk uniformly (same resampler as every crop) when that
 * holds more than max_pixels.  Canvas pixel (y, x) starts at original pixel
 * (y * scale_y, x * scale_x).  The rule for every format lives here. */
typedef struct en_canvas {
    int denom;                         /* DCT denominator (or Pillow reduce factor) */
    int reduced_height, reduced_width; /* the image at 1/denom, before any shrinking */
    int height, width;                 /* the canvas */
    double scale_y, scale_x;           /* original pixels per canvas pixel */
    int source_height, source_width;   /* the original */
} en_canvas;

void en_canvas_plan(int height, int width, int min_side, uint64_t max_pixels, en_canvas *c);

/* One header parse.  out=NULL learns the canvas shape only. */
int en_jpeg_decode_canvas(en_decoder *d, const uint8_t *data, size_t len, int min_side,
                          uint64_t max_pixels, uint8_t *out, size_t out_cap, en_canvas *canvas);

/* Resample an RGB image (h x w x 3, row stride in bytes) the same way. */
int en_resize_rgb(en_decoder *d, const uint8_t *src, int h, int w, size_t src_stride,
                  en_box box, int out_h, int out_w, int flip, uint8_t *out, size_t stride);

/* ---- augmentation parameters, counter-based ----------------------------- */

typedef struct en_rrc_spec {
    double scale_lo, scale_hi;   /* fraction of the image area */
    double ratio_lo, ratio_hi;   /* width / height */
    double flip_p;               /* probability of a horizontal flip */
} en_rrc_spec;

typedef struct en_key {
    uint64_t seed, epoch, sample_id, echo_index;
} en_key;

/* Philox4x64-10: four 64-bit words from a 256-bit counter and a 128-bit key. */
void en_philox4x64(const uint64_t ctr[4], const uint64_t key[2], uint64_t out[4]);

/* torchvision's RandomResizedCrop.get_params (ten tries, then a centre crop at
 * the clamped ratio) with every draw taken from Philox keyed by `key`, so the
 * box is a pure function of the key and the image size. */
void en_random_resized_crop(en_key key, int height, int width, en_rrc_spec spec,
                            en_box *box, int *flip);

/* The per-example ops' parameters (echo_native/augment.py), drawn like the crop
 * from Philox keyed by (seed, epoch, sample id, echo index) under a tag of their
 * own, with torchvision's distributions; op k of the list reads its own blocks
 * of the stream, so its draws do not depend on how many the ops before it took.
 * One spec per op: its kind and EN_DRAW_NUMBERS numbers, of which the kind uses
 * the first `numbers` (the rest are zero), for `steps` program steps:
 *
 *   X(name, kind, numbers, steps)
 *   COLOR_JITTER  p, brightness lo hi, contrast lo hi, saturation lo hi, hue lo hi
 *                 (the adjustments in a random order, those whose range is the
 *                 identity left out)
 *   GRAYSCALE     p
 *   TRIVIAL_WIDE  magnitude bins, fill
 *   ERASING       p, scale lo hi, log ratio lo hi, fill R G B
 *
 * The binding (`_kernel.DRAWS`, `_kernel.DRAW_NUMBERS`) and the Python specs read
 * this table.  The programs go to codes (n, steps) and args (n, steps, OP_ARGS),
 * zeroed first: a step no op used is OP_NONE. */
#define EN_DRAW_LIST(X)                 \
    X(COLOR_JITTER, 1, 9, 4)            \
    X(GRAYSCALE, 2, 1, 1)               \
    X(TRIVIAL_WIDE, 3, 2, 1)            \
    X(ERASING, 4, 8, 1)
#define EN_DRAW_NUMBERS 12

#define EN_DRAW_KIND(name, kind, numbers, steps) EN_DRAW_##name = kind,
enum { EN_DRAW_LIST(EN_DRAW_KIND) };
#undef EN_DRAW_KIND

typedef struct en_op_spec {
    int kind;
    double v[EN_DRAW_NUMBERS];
} en_op_spec;

/* EN_DRAW_LIST as data, for bindings; ends with a NULL name. */
typedef struct en_draw_kind {
    const char *name;
    int kind, numbers, steps;
} en_draw_kind;
extern const en_draw_kind en_draw_kinds[];

/* Steps the specs need (4 for ColorJitter, 1 for the others), or -1 for an
 * unknown kind. */
int en_ops_steps(const en_op_spec *ops, int nops);

/* The programs of n images of h x w: row i keyed (seed, epochs[i], sample_ids[i],
 * echo_index[i]); `steps` is at least en_ops_steps(ops, nops). */
void en_ops_draw(const en_op_spec *ops, int nops, int steps, uint64_t seed,
                 const int64_t *epochs, const int64_t *sample_ids, const int64_t *echo_index,
                 int64_t n, int h, int w, int32_t *codes, float *args);

/* The fused evaluation transform: resize the shorter side to resize_side, then
 * take the centre out_h x out_w, as one resampling of a box of the original. */
en_box en_center_crop_box(int height, int width, int resize_side, int out_h, int out_w);

/* Centre crop + decode in one header parse; *box receives the box used. */
int en_jpeg_decode_center_crop(en_decoder *d, const uint8_t *data, size_t len, int resize_side,
                               int out_h, int out_w, uint8_t *out, size_t stride, en_box *box);

/* Random crop + decode in one header parse. */
int en_jpeg_decode_random_crop(en_decoder *d, const uint8_t *data, size_t len, en_key key,
                               en_rrc_spec spec, int out_h, int out_w, uint8_t *out,
                               size_t stride, en_box *box, int *flip);

#ifdef __cplusplus
}
#endif
#endif
