/*
 * JPEG side of the fused kernel: libjpeg-turbo with region-of-interest
 * decoding (jpeg_crop_scanline + jpeg_skip_scanlines) and DCT-domain scaling.
 * The decoder it drives, and how a libjpeg error or warning becomes a status
 * returned here: en_decoder.c.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include "en_decoder.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Charge the time since the previous mark to one stage's counter. */
static inline void stage(en_decoder *d, uint64_t *counter) {
    if (!d->profiling) return;
    const uint64_t t = now_ns();
    *counter += t - d->mark_ns;
    d->mark_ns = t;
}

/* Every public entry point starts with this: it arms the jump point in the
 * caller's frame.  On a longjmp the macro returns the stored status. */
#define EN_GUARD(d)                                 \
    do {                                            \
        if (setjmp((d)->jump)) {                    \
            jpeg_abort_decompress(&(d)->cinfo);     \
            return (d)->status;                     \
        }                                           \
    } while (0)

/* The working memory a decode of this header needs, from the header alone, so
 * that every entry point accepts or refuses the same file.  libjpeg keeps the
 * whole image's DCT coefficients when the file has more than one scan
 * (progressive, or sequential non-interleaved): jdcoefct.c allocates, per
 * component, width_in_blocks x height_in_blocks rounded up to the sampling
 * factors, 64 JCOEFs a block, whatever the DCT scale or crop.  On top comes
 * one full-size RGB image (what a full decode returns; crops and canvases
 * need less).  Row buffers (a few rows of width) are left out. */
static uint64_t memory_need(j_decompress_ptr ci, uint64_t *coefs) {
    uint64_t c = 0;
    if (jpeg_has_multiple_scans(ci)) {
        for (int i = 0; i < ci->num_components; i++) {
            const jpeg_component_info *cp = &ci->comp_info[i];
            const uint64_t h = cp->h_samp_factor > 0 ? (uint64_t)cp->h_samp_factor : 1;
            const uint64_t v = cp->v_samp_factor > 0 ? (uint64_t)cp->v_samp_factor : 1;
            const uint64_t wb = ((uint64_t)cp->width_in_blocks + h - 1) / h * h;
            const uint64_t hb = ((uint64_t)cp->height_in_blocks + v - 1) / v * v;
            c += wb * hb * DCTSIZE2 * sizeof(JCOEF);
        }
    }
    *coefs = c;
    return c + (uint64_t)ci->image_width * ci->image_height * 3;
}

static void check_memory(en_decoder *d) {
    j_decompress_ptr ci = &d->cinfo;
    uint64_t coefs;
    const uint64_t need = memory_need(ci, &coefs);
    d->last_memory = need;
    if (need > d->limits.max_memory)
        fail(d, EN_ERR_LIMIT,
             "%s JPEG %ux%u needs %llu bytes of decoder memory (%llu of coefficient buffers "
             "+ %llu of RGB pixels), over the limit max_memory=%llu",
             ci->progressive_mode ? "progressive" : coefs ? "multi-scan" : "sequential",
             ci->image_width, ci->image_height, (unsigned long long)need,
             (unsigned long long)coefs, (unsigned long long)(need - coefs),
             (unsigned long long)d->limits.max_memory);
}

static void begin(en_decoder *d, const uint8_t *data, size_t len) {
    if (d->profiling) d->mark_ns = now_ns();
    d->status = EN_OK;
    d->warnings = 0;
    d->harmless = 0;
    d->last_memory = 0;
    d->errmsg[0] = '\0';
    if (len == 0) fail(d, EN_ERR_DECODE, "empty input (0 bytes)");
    /* A bare SOI is a JPEG cut short, not "not a JPEG": say so. */
    if (len < 4 && len >= 2 && data[0] == 0xFF && data[1] == 0xD8)
        fail(d, EN_ERR_DECODE, "truncated JPEG: only %zu bytes", len);
    if (len < 4 || data[0] != 0xFF || data[1] != 0xD8)
        fail(d, EN_ERR_DECODE, "not a JPEG file: starts with 0x%02x 0x%02x", data[0],
             len > 1 ? data[1] : 0);
    /* libjpeg keeps Huffman and quantisation tables in a decompressor from one
     * image to the next (for abbreviated datastreams).  For independent files
     * that is hidden state: a file without DHT (Motion-JPEG style, relying on
     * the standard tables) or one using a table it never defines would decode
     * with whatever the previous image on this thread left behind (found by
     * fuzzing: results depended on call history).  A fresh decompressor per
     * image costs well under a microsecond; err is preserved by create. */
    jpeg_destroy_decompress(&d->cinfo);
    jpeg_create_decompress(&d->cinfo);
    d->cinfo.progress = &d->progress;
    jpeg_mem_src(&d->cinfo, data, (unsigned long)len);
    jpeg_read_header(&d->cinfo, TRUE);
    j_decompress_ptr ci = &d->cinfo;
    /* A zero quantizer is invalid (T.81 B.2.4.1: 1..255) and libjpeg accepts
     * it silently, zeroing those coefficients: a corrupt table would come out
     * as a plausible-looking flat image.  Refuse it. */
    for (int t = 0; t < NUM_QUANT_TBLS; t++) {
        const JQUANT_TBL *q = ci->quant_tbl_ptrs[t];
        if (!q) continue;
        for (int k = 0; k < DCTSIZE2; k++)
            if (q->quantval[k] == 0)
                fail(d, EN_ERR_DECODE, "corrupt quantization table %d: entry %d is zero", t, k);
    }
    uint64_t pixels = (uint64_t)ci->image_width * ci->image_height;
    if (ci->image_width == 0 || ci->image_height == 0)
        fail(d, EN_ERR_DECODE, "JPEG declares an empty image (%ux%u)", ci->image_width,
             ci->image_height);
    if (pixels > d->limits.max_pixels)
        fail(d, EN_ERR_LIMIT,
             "JPEG declares %ux%u = %llu pixels, over the decompression-bomb limit "
             "max_pixels=%llu",
             ci->image_width, ci->image_height, (unsigned long long)pixels,
             (unsigned long long)d->limits.max_pixels);
    check_memory(d);
    if (ci->jpeg_color_space == JCS_CMYK || ci->jpeg_color_space == JCS_YCCK) {
        ci->out_color_space = JCS_CMYK; /* libjpeg turns YCCK into CMYK for us */
        d->cmyk_inverted = ci->saw_Adobe_marker;
    } else {
        ci->out_color_space = JCS_RGB;  /* grayscale is expanded by libjpeg-turbo */
    }
    ci->dct_method = JDCT_ISLOW;       /* the accurate IDCT, as Pillow uses */
    ci->do_fancy_upsampling = TRUE;
    ci->scale_num = 1;
    ci->scale_denom = 1;
}

/* Same arithmetic as Pillow's CMYK -> RGB: each ink darkens multiplicatively. */
static void cmyk_to_rgb(const uint8_t *in, uint8_t *out, int n, int inverted) {
    for (int i = 0; i < n; i++, in += 4, out += 3) {
        int c = in[0], m = in[1], y = in[2], k = in[3];
        if (inverted) {
            c = 255 - c;
            m = 255 - m;
            y = 255 - y;
            k = 255 - k;
        }
        int nk = 255 - k, t;
        t = c * nk + 128;
        out[0] = (uint8_t)(nk - (((t >> 8) + t) >> 8));
        t = m * nk + 128;
        out[1] = (uint8_t)(nk - (((t >> 8) + t) >> 8));
        t = y * nk + 128;
        out[2] = (uint8_t)(nk - (((t >> 8) + t) >> 8));
    }
}

/* Read `rows` output scanlines into dst (RGB, `stride` bytes apart). */
static void read_rows(en_decoder *d, uint8_t *dst, size_t stride, int rows) {
    j_decompress_ptr ci = &d->cinfo;
    const int w = (int)ci->output_width;
    const int cmyk = ci->out_color_space == JCS_CMYK;
    if (cmyk && en_buf_reserve(&d->rowbuf, (size_t)w * 4))
        fail(d, EN_ERR_NOMEM, "out of memory for a %d-pixel scanline", w);
    for (int y = 0; y < rows;) {
        JSAMPROW row = cmyk ? (JSAMPROW)d->rowbuf.p : dst + (size_t)y * stride;
        JDIMENSION got = jpeg_read_scanlines(ci, &row, 1);
        if (got == 0) fail(d, EN_ERR_DECODE, "JPEG data ended before scanline %d", y);
        if (cmyk) cmyk_to_rgb(d->rowbuf.p, dst + (size_t)y * stride, w, d->cmyk_inverted);
        y += (int)got;
    }
}

int en_jpeg_info(en_decoder *d, const uint8_t *data, size_t len, en_image_info *info) {
    EN_GUARD(d);
    begin(d, data, len);
    info->width = (int)d->cinfo.image_width;
    info->height = (int)d->cinfo.image_height;
    info->components = d->cinfo.num_components;
    info->progressive = d->cinfo.progressive_mode;
    info->colorspace = (int)d->cinfo.jpeg_color_space;
    jpeg_abort_decompress(&d->cinfo);
    return EN_OK;
}

int en_jpeg_decode(en_decoder *d, const uint8_t *data, size_t len, uint8_t *out, size_t out_cap,
                   size_t stride) {
    EN_GUARD(d);
    begin(d, data, len);
    j_decompress_ptr ci = &d->cinfo;
    if (stride < (size_t)ci->image_width * 3 || out_cap < stride * ci->image_height)
        fail(d, EN_ERR_ARG, "output buffer too small for a %ux%u RGB image", ci->image_width,
             ci->image_height);
    jpeg_start_decompress(ci);
    d->last_scale = 1;
    read_rows(d, out, stride, (int)ci->output_height);
    jpeg_finish_decompress(ci);
    return EN_OK;
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

int en_pick_scale(en_box box, int out_h, int out_w) {
    for (int denom = 8; denom > 1; denom /= 2)
        if (box.height / denom >= out_h && box.width / denom >= out_w) return denom;
    return 1;
}

/* libjpeg-turbo's SIMD colour conversion writes a row with non-temporal
 * stores when the row starts on a 16-byte (SSE2) or 32-byte (AVX2) boundary:
 * the row bypasses the cache, and the resampler, reading it next, waits on
 * memory (fused / ceiling 0.71 with every row aligned, 0.84 with none).  So
 * the region's stride is a multiple of 32 bytes and its first row starts 8
 * bytes past a boundary: no row starts on one. */
enum { EN_ROW_ALIGN = 32, EN_ROW_SKEW = 8 };

static size_t region_stride(size_t row_bytes) {
    return (row_bytes + EN_ROW_ALIGN - 1) & ~(size_t)(EN_ROW_ALIGN - 1);
}

static uint8_t *region_rows(const en_buf *b) {
    const uintptr_t p = ((uintptr_t)b->p + EN_ROW_ALIGN - 1) & ~(uintptr_t)(EN_ROW_ALIGN - 1);
    return (uint8_t *)p + EN_ROW_SKEW;
}

/* Decode the columns [x0, x1) of rows [y.lo, y.hi) of the image scaled by
 * 1/denom and run the horizontal pass on them as they come, in pieces of the
 * resampler's choosing (en_resample_piece_rows: small pieces stay in L1 for
 * the AVX2 pass; the AVX-512 pass runs best over the whole crop at once).
 * libjpeg widens the columns to whole iMCUs. */
static void decode_resample_h(en_decoder *d, int denom, int x0, int x1, const en_axis *ax,
                              const en_axis *ay, int flip) {
    j_decompress_ptr ci = &d->cinfo;
    ci->scale_num = 1;
    ci->scale_denom = (unsigned)denom;
    d->last_scale = denom;
    jpeg_start_decompress(ci);
    stage(d, &d->prof.start_ns);
    JDIMENSION xoff = (JDIMENSION)x0, width = (JDIMENSION)(x1 - x0);
    if (xoff > 0 || width < ci->output_width) jpeg_crop_scanline(ci, &xoff, &width);
    const size_t rstride = region_stride((size_t)ci->output_width * 3);
    const int rows = ay->hi - ay->lo, piece_max = en_resample_piece_rows();
    const int piece = piece_max && piece_max < rows ? piece_max : rows;
    /* 16 spare bytes: the SIMD resampler reads up to 16 bytes past the last row. */
    const size_t bytes = rstride * (size_t)piece + 16 + EN_ROW_ALIGN + EN_ROW_SKEW;
    if (en_buf_reserve(&d->region, bytes) ||
        en_resample_begin(&d->rs, ax, ay))
        fail(d, EN_ERR_NOMEM, "out of memory for a %ux%d region", ci->output_width,
             ay->hi - ay->lo);
    if (ay->lo > 0 && jpeg_skip_scanlines(ci, (JDIMENSION)ay->lo) != (JDIMENSION)ay->lo)
        fail(d, EN_ERR_DECODE, "JPEG data ended before row %d", ay->lo);
    stage(d, &d->prof.skip_ns);
    uint8_t *const region = region_rows(&d->region);
    for (int row = 0; row < rows; row += piece) {
        const int n = rows - row < piece ? rows - row : piece;
        read_rows(d, region, rstride, n);
        stage(d, &d->prof.rows_ns);
        en_resample_h_rows(&d->rs, region, rstride, (int)xoff, ax, flip, 16, row, n);
        stage(d, &d->prof.hpass_ns);
    }
}

/* A crop of a single-scan file stops decoding after its last row: the rows
 * below are never entropy-decoded, so their warnings never fire.  (Multi-scan
 * and progressive files are read to EOI inside jpeg_start_decompress, and a
 * crop sees every warning a full decode sees.)  In strict mode:
 *   - a crop that decoded the scan through its last MCU row reads the markers
 *     after it to EOI, exactly as a full decode does (marker parsing only):
 *     it refuses and accepts the same files as a full decode;
 *   - a crop that stopped higher refuses what a full decode would refuse when
 *     one pass over the remaining bytes can tell for certain, without decoding
 *     them:
 *     . no EOI after the scan: the file is truncated (a full decode warns
 *       JWRN_JPEG_EOF); the commonest real-world defect;
 *     . a marker that cannot appear inside or right after a scan (SOI, SOFn,
 *       SOS in a single-scan file, JPGn, reserved codes): a full decode warns
 *       JWRN_HIT_MARKER or fails on it;
 *     . restart markers out of sequence (RSTn not followed by RSTn+1 mod 8):
 *       a full decode warns JWRN_MUST_RESYNC or JWRN_HIT_MARKER.
 *     What the pass cannot see below the crop -- corrupt entropy-coded bits,
 *     junk before a restart marker, surplus bytes before EOI, a table marker
 *     cutting the scan short -- takes entropy-decoding the rest of the scan
 *     (a large share of the decode a crop exists to skip) and is not looked
 *     for: such a crop is returned although a full decode refuses the file.
 *     Its rows are what the bytes above the defect say; a defect whose only
 *     symptom is surplus bytes at the end of the scan may have garbled rows
 *     above, as it may for any entry point when the data raises no warning. */
static void check_tail(en_decoder *d) {
    j_decompress_ptr ci = &d->cinfo;
    if (!d->limits.strict || jpeg_input_complete(ci)) return;
    if (ci->input_iMCU_row >= ci->total_iMCU_rows) {
        /* The input side finished the scan: consume_input now reads markers. */
        for (int i = 0; i < 64; i++) {
            const int r = jpeg_consume_input(ci);
            if (r == JPEG_REACHED_EOI || r == JPEG_SUSPENDED) return;
        }
        return;
    }
    const uint8_t *p = ci->src->next_input_byte;
    const uint8_t *const end = p + ci->src->bytes_in_buffer;
    int m = ci->unread_marker; /* a marker the entropy decoder already read */
    int last_rst = -1;
    for (;;) {
        if (m == 0) {
            const uint8_t *q = p < end ? memchr(p, 0xFF, (size_t)(end - p)) : NULL;
            if (!q) break;
            p = q + 1;
            while (p < end && *p == 0xFF) p++; /* fill bytes */
            if (p == end) break;
            m = *p++;
            if (m == 0) continue; /* stuffed zero: entropy-coded 0xFF */
        }
        if (m == 0xD9) return; /* EOI: the data is all there */
        if (m >= 0xD0 && m <= 0xD7) {
            const int n = m - 0xD0;
            if (ci->restart_interval && last_rst >= 0 && n != ((last_rst + 1) & 7))
                fail(d, EN_ERR_DECODE,
                     "Corrupt JPEG data: RST%d follows RST%d below the decoded rows (strict "
                     "mode: restart markers out of sequence, blocks are lost)", n, last_rst);
            last_rst = n;
            m = 0;
            continue;
        }
        if (m == 0x01) { /* TEM: parameterless */
            m = 0;
            continue;
        }
        if ((m >= 0xE0 && m <= 0xEF) || m == 0xFE || m == 0xC4 || m == 0xCC || m == 0xDB ||
            m == 0xDD || m == 0xDC) {
            /* Tables or metadata: legal after the scan, skip the segment. */
            if (end - p < 2) break;
            const size_t seg = (size_t)p[0] << 8 | p[1];
            if (seg < 2)
                fail(d, EN_ERR_DECODE, "Bogus marker length in marker 0x%02x after the scan "
                     "(strict mode)", m);
            if (seg > (size_t)(end - p)) break;
            p += seg;
            m = 0;
            continue;
        }
        fail(d, EN_ERR_DECODE,
             "Corrupt JPEG data: marker 0x%02x inside or right after the scan, below the "
             "decoded rows (strict mode: a full decode refuses this file)", m);
    }
    fail(d, EN_ERR_DECODE,
         "Premature end of JPEG file: no EOI marker after the scan, below the decoded rows "
         "(strict mode: the file is truncated, a full decode fills the missing rows with grey)");
}

/* Fancy chroma upsampling treats the first and last column of a jpeg_crop_scanline
 * region as the image edge, which changes the pixel next to each (up to ~20 levels on
 * 4:2:2 / 4:2:0 against a full decode).  Two extra columns per side keep those pixels
 * out of the filter's reach; on the left libjpeg then aligns down to the previous iMCU
 * boundary anyway.  (Checked exact against full decode + resize over thousands of crops.) */
enum { EN_CROP_MARGIN = 2 };

/* A planned crop from its header on: decode the planned rows (the margin's columns
 * added), check the tail, resample vertically into out, stop.  One function for the
 * plain crop (crop_resize) and the seekable one (en_seek.c's seek_crop, which compiles
 * this file in and calls it with the plan moved onto its sub-image), so that both
 * decode a plan with the same steps and give the same pixels. */
static void decode_planned_crop(en_decoder *d, int denom, const en_axis *ax, const en_axis *ay,
                                int flip, uint8_t *out, size_t stride) {
    j_decompress_ptr ci = &d->cinfo;
    const int sw = ceil_div((int)ci->image_width, denom);
    stage(d, &d->prof.header_ns);
    const int x0 = ax->lo > EN_CROP_MARGIN ? ax->lo - EN_CROP_MARGIN : 0;
    const int x1 = ax->hi + EN_CROP_MARGIN < sw ? ax->hi + EN_CROP_MARGIN : sw;
    decode_resample_h(d, denom, x0, x1, ax, ay, flip);
    check_tail(d); /* before writing out: a refused file leaves it untouched */
    stage(d, &d->prof.tail_ns);
    en_resample_v(&d->rs, ax, ay, out, stride);
    stage(d, &d->prof.vpass_ns);
    /* The rows below the crop are never decoded: abort instead of finishing. */
    jpeg_abort_decompress(ci);
    stage(d, &d->prof.finish_ns);
    d->prof.calls += d->profiling;
}

static int check_box(en_decoder *d, en_box b) {
    const double eps = 1e-6;
    const j_decompress_ptr ci = &d->cinfo;
    if (!(b.height > 0 && b.width > 0 && b.top >= -eps && b.left >= -eps &&
          b.top + b.height <= ci->image_height + eps && b.left + b.width <= ci->image_width + eps))
        fail(d, EN_ERR_ARG,
             "box (top=%g, left=%g, height=%g, width=%g) is not inside the %ux%u image", b.top,
             b.left, b.height, b.width, ci->image_height, ci->image_width);
    return 0;
}

static void crop_resize(en_decoder *d, en_box box, int out_h, int out_w, int flip, uint8_t *out,
                        size_t stride) {
    j_decompress_ptr ci = &d->cinfo;
    check_box(d, box);
    const int denom = en_pick_scale(box, out_h, out_w);
    const int sw = ceil_div((int)ci->image_width, denom);
    const int sh = ceil_div((int)ci->image_height, denom);
    en_axis ax, ay;
    if (en_plan_axis(&d->rs, 1, box.left / denom, (box.left + box.width) / denom, sw, out_w, &ax) ||
        en_plan_axis(&d->rs, 0, box.top / denom, (box.top + box.height) / denom, sh, out_h, &ay))
        fail(d, EN_ERR_NOMEM, "cannot plan a resize to %dx%d", out_h, out_w);
    decode_planned_crop(d, denom, &ax, &ay, flip, out, stride);
}

int en_jpeg_decode_crop(en_decoder *d, const uint8_t *data, size_t len, en_box box, int out_h,
                        int out_w, int flip, uint8_t *out, size_t stride) {
    EN_GUARD(d);
    begin(d, data, len);
    crop_resize(d, box, out_h, out_w, flip, out, stride);
    return EN_OK;
}

int en_jpeg_decode_random_crop(en_decoder *d, const uint8_t *data, size_t len, en_key key,
                               en_rrc_spec spec, int out_h, int out_w, uint8_t *out,
                               size_t stride, en_box *box, int *flip) {
    EN_GUARD(d);
    begin(d, data, len);
    en_random_resized_crop(key, (int)d->cinfo.image_height, (int)d->cinfo.image_width, spec, box,
                           flip);
    crop_resize(d, *box, out_h, out_w, *flip, out, stride);
    return EN_OK;
}

void en_canvas_plan(int height, int width, int min_side, uint64_t max_pixels, en_canvas *c) {
    int denom = 8;
    while (denom > 1 && (ceil_div(width, denom) < min_side || ceil_div(height, denom) < min_side))
        denom /= 2;
    const int rh = ceil_div(height, denom), rw = ceil_div(width, denom);
    c->denom = denom;
    c->source_height = height;
    c->source_width = width;
    c->reduced_height = c->height = rh;
    c->reduced_width = c->width = rw;
    if ((uint64_t)rh * (uint64_t)rw > max_pixels) {
        /* Over budget (very large or elongated images): shrink uniformly, by
         * the square root of the excess, so the bytes per sample are fixed. */
        const double t = sqrt((double)max_pixels / ((double)rh * (double)rw));
        c->height = (int)(rh * t) > 1 ? (int)(rh * t) : 1;
        c->width = (int)(rw * t) > 1 ? (int)(rw * t) : 1;
    }
    c->scale_y = ((double)rh / c->height) * denom;
    c->scale_x = ((double)rw / c->width) * denom;
}

int en_jpeg_decode_center_crop(en_decoder *d, const uint8_t *data, size_t len, int resize_side,
                               int out_h, int out_w, uint8_t *out, size_t stride, en_box *box) {
    EN_GUARD(d);
    begin(d, data, len);
    *box = en_center_crop_box((int)d->cinfo.image_height, (int)d->cinfo.image_width,
                              resize_side, out_h, out_w);
    crop_resize(d, *box, out_h, out_w, 0, out, stride);
    return EN_OK;
}

int en_jpeg_decode_canvas(en_decoder *d, const uint8_t *data, size_t len, int min_side,
                          uint64_t max_pixels, uint8_t *out, size_t out_cap, en_canvas *canvas) {
    EN_GUARD(d);
    begin(d, data, len);
    j_decompress_ptr ci = &d->cinfo;
    en_canvas_plan((int)ci->image_height, (int)ci->image_width, min_side, max_pixels, canvas);
    const int rh = canvas->reduced_height, rw = canvas->reduced_width;
    const size_t need = (size_t)canvas->height * canvas->width * 3;
    if (!out) {
        jpeg_abort_decompress(ci);
        return EN_OK;
    }
    if (out_cap < need)
        fail(d, EN_ERR_ARG, "canvas buffer holds %zu bytes, a %dx%d canvas needs %zu", out_cap,
             canvas->height, canvas->width, need);
    if (canvas->height == rh && canvas->width == rw) {
        stage(d, &d->prof.header_ns);
        ci->scale_denom = (unsigned)canvas->denom;
        d->last_scale = canvas->denom;
        jpeg_start_decompress(ci);
        stage(d, &d->prof.start_ns);
        read_rows(d, out, (size_t)rw * 3, rh);
        stage(d, &d->prof.rows_ns);
        jpeg_finish_decompress(ci); /* to EOI: a canvas sees every warning a decode does */
        stage(d, &d->prof.finish_ns);
    } else {
        /* Over budget: shrink the rows as libjpeg hands them over, as a crop
         * does (the plan spans every row, so all are read). */
        en_axis ax, ay;
        if (en_plan_axis(&d->rs, 1, 0.0, rw, rw, canvas->width, &ax) ||
            en_plan_axis(&d->rs, 0, 0.0, rh, rh, canvas->height, &ay))
            fail(d, EN_ERR_NOMEM, "out of memory shrinking a %dx%d canvas", rh, rw);
        stage(d, &d->prof.header_ns);
        decode_resample_h(d, canvas->denom, 0, rw, &ax, &ay, 0);
        jpeg_finish_decompress(ci); /* before writing out: a refused file leaves it as it was */
        stage(d, &d->prof.finish_ns);
        en_resample_v(&d->rs, &ax, &ay, out, (size_t)canvas->width * 3);
        stage(d, &d->prof.vpass_ns);
    }
    d->prof.calls += d->profiling;
    return EN_OK;
}

int en_resize_rgb(en_decoder *d, const uint8_t *src, int h, int w, size_t src_stride, en_box box,
                  int out_h, int out_w, int flip, uint8_t *out, size_t stride) {
    d->errmsg[0] = '\0';
    const double eps = 1e-6;
    if (!(box.height > 0 && box.width > 0 && box.top >= -eps && box.left >= -eps &&
          box.top + box.height <= h + eps && box.left + box.width <= w + eps)) {
        snprintf(d->errmsg, sizeof d->errmsg,
                 "box (top=%g, left=%g, height=%g, width=%g) is not inside the %dx%d image",
                 box.top, box.left, box.height, box.width, h, w);
        return EN_ERR_ARG;
    }
    en_axis ax, ay;
    if (en_plan_axis(&d->rs, 1, box.left, box.left + box.width, w, out_w, &ax) ||
        en_plan_axis(&d->rs, 0, box.top, box.top + box.height, h, out_h, &ay) ||
        en_resample(&d->rs, src, src_stride, 0, 0, &ax, &ay, flip,
                    /* bytes after the last row the filter reads, to the buffer's end */
                    ay.hi < h ? (size_t)(h - ay.hi - 1) * src_stride + (size_t)w * 3 : 0, out,
                    stride)) {
        snprintf(d->errmsg, sizeof d->errmsg, "out of memory resizing to %dx%d", out_h, out_w);
        return EN_ERR_NOMEM;
    }
    return EN_OK;
}
