/*
 * Seekable JPEGs: the same coefficients re-encoded with restart markers and
 * optimised Huffman tables, plus an index of where each restart segment
 * starts, so that a crop entropy-decodes only its own MCUs.
 *
 * The index travels inside the file, in APP9 segments right after SOI
 * ("ENSEEK" signature): every JPEG decoder skips them, so a seekable file is
 * an ordinary baseline JPEG to everything else, and any source that hands
 * over the bytes (tar shards, folders, Parquet) carries the index with them.
 *
 * Pure C over libjpeg-turbo, like the kernel.  Entry points return 0 or a
 * negative en_status with the reason in the error buffer or the decoder.
 */
#ifndef EN_SEEK_H
#define EN_SEEK_H

#include <stddef.h>
#include <stdint.h>

#include "en_kernel.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EN_SEEK_SIGNATURE "ENSEEK\0\1" /* 8 bytes: name, NUL, format version 1 */
#define EN_SEEK_SIGNATURE_LEN 8
#define EN_SEEK_ROW 0 /* restart interval "every MCU row" */

/* ---- transcoder -------------------------------------------------------- */

typedef struct en_transcode_opts {
    int restart;          /* MCUs per restart interval (>= 1), or EN_SEEK_ROW */
    int restart_px;       /* > 0: instead, as many MCUs as make this many pixels of width
                           * (at least one): the same segment width for every sampling */
    uint64_t max_pixels;  /* refuse larger images (decompression bombs) */
    int max_scans;        /* progressive scans allowed */
    uint64_t max_memory;  /* coefficient memory allowed */
} en_transcode_opts;

typedef struct en_transcode_result {
    uint8_t *data;        /* malloc'ed seekable JPEG; free() it */
    size_t len;
    size_t index_bytes;   /* of which the APP9 index segments */
    int interval;         /* MCUs per restart interval used */
    int segments;
    int width, height, mcu_w, mcu_h, progressive_in;
} en_transcode_result;

/* Lossless: read the DCT coefficients, write them back as one baseline scan
 * with optimised Huffman tables and restart markers, then index the markers.
 * Refuses (EN_ERR_DECODE, reason in errmsg) what it cannot keep exact:
 * colour spaces other than YCbCr and greyscale, files libjpeg warns about. */
int en_seek_transcode(const uint8_t *data, size_t len, en_transcode_opts opts,
                      en_transcode_result *res, char *errmsg, size_t errcap);

/* ---- index ----------------------------------------------------------------- */

typedef struct en_seek_index {
    int width, height;        /* the image, pixels */
    int ncomp;
    int mcu_w, mcu_h;         /* one MCU, pixels */
    int mcus_per_row, mcu_rows;
    int interval;             /* MCUs per restart segment; divides mcus_per_row */
    int segs_per_row;
    size_t scan_offset;       /* first entropy-coded byte, from the file's start */
    size_t scan_len;          /* entropy-coded bytes up to the EOI marker */
    size_t sof_dims;          /* offset of the SOF's height field */
    size_t dri_value;         /* offset of the DRI's interval field */
    const uint8_t *rows;      /* mcu_rows x (u32 data offset, u32 lens offset), LE */
    const uint8_t *lens;      /* LEB128 segment lengths, markers included */
    size_t lens_len;
} en_seek_index;

/* 1: the file carries a sound index (filled in); 0: no index (a plain JPEG);
 * negative: an index that disagrees with the file, reason in why.  Checks
 * everything that costs O(MCU rows): header layout, dimensions, DRI, bounds,
 * the EOI, and a restart marker in front of every row.  `blob` holds the
 * index when it spans several APP9 segments. */
int en_seek_parse(const uint8_t *data, size_t len, en_seek_index *ix, void *blob,
                  char *why, size_t whycap);

/* ---- assembler and decode ------------------------------------------------- */

typedef struct en_seeker en_seeker;

en_seeker *en_seeker_new(void);
void en_seeker_free(en_seeker *s);
en_decoder *en_seeker_decoder(en_seeker *s);
/* en_seek_parse with the seeker's buffers; the reason in en_seeker_why. */
int en_seeker_parse(en_seeker *s, const uint8_t *data, size_t len, en_seek_index *ix);
/* Why the last call left the seekable path ("" when it did not). */
const char *en_seeker_why(const en_seeker *s);

typedef struct en_seek_stats {
    uint64_t seek;      /* decoded from an assembled sub-image */
    uint64_t whole;     /* the crop needed every MCU: the file itself decoded */
    uint64_t plain;     /* no index */
    uint64_t fallback;  /* an index that disagrees with the file: plain path */
    uint64_t bytes_in;  /* entropy-coded bytes of the sub-images */
} en_seek_stats;
en_seek_stats en_seeker_stats(const en_seeker *s);

/* The sub-image of MCU rows [r0, r1) and columns [c0, c1) (columns aligned
 * to the interval) as a JPEG in the seeker's buffer. */
int en_seek_assemble(en_seeker *s, const uint8_t *data, size_t len, int r0, int r1, int c0,
                     int c1, const uint8_t **out, size_t *out_len);

/* The kernel's crop entry points, with the same arguments and pixels: a file
 * with an index decodes the crop's MCUs only; one without decodes as the
 * kernel does; one whose index disagrees with it falls back to the plain
 * path, which refuses the file if it is unsound. */
int en_seek_decode_crop(en_seeker *s, const uint8_t *data, size_t len, en_box box, int out_h,
                        int out_w, int flip, uint8_t *out, size_t stride);
int en_seek_decode_random_crop(en_seeker *s, const uint8_t *data, size_t len, en_key key,
                               en_rrc_spec spec, int out_h, int out_w, uint8_t *out,
                               size_t stride, en_box *box, int *flip);
int en_seek_decode_center_crop(en_seeker *s, const uint8_t *data, size_t len, int resize_side,
                               int out_h, int out_w, uint8_t *out, size_t stride, en_box *box);

#ifdef __cplusplus
}
#endif
#endif
