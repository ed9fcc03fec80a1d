/*
 * The lossless transcoder: a JPEG's DCT coefficients written back as one
 * baseline scan with optimised Huffman tables and restart markers, indexed.
 *
 * Nothing is decoded to pixels: jpeg_read_coefficients hands over the
 * quantised coefficients of every scan (progressive and arithmetic-coded
 * files included) and jpeg_write_coefficients re-encodes exactly those, so
 * every decoder computes the same pixels from the result as from the input.
 */
#include "en_seek.h"

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

struct tc_err {
    struct jpeg_error_mgr pub;
    struct jpeg_progress_mgr progress;
    jmp_buf jump;
    char *msg;
    size_t cap;
    int max_scans;
};

static void tc_error_exit(j_common_ptr c) {
    struct tc_err *e = (struct tc_err *)c->err;
    char buf[JMSG_LENGTH_MAX];
    (*c->err->format_message)(c, buf);
    snprintf(e->msg, e->cap, "%s", buf);
    longjmp(e->jump, 1);
}

/* A warning while reading means libjpeg substituted coefficients (truncated
 * or corrupt data): transcoding would bake the substitute into a file every
 * decoder then accepts silently, so it is refused, as the kernel's strict mode
 * refuses the original.  Only warnings about bytes no pixel depends on pass
 * (the same ones the kernel counts as harmless, see en_jpeg.c). */
static void tc_message(j_common_ptr c, int level) {
    if (level >= 0) return;
    struct tc_err *e = (struct tc_err *)c->err;
    const int code = c->err->msg_code;
    if (code == JWRN_JFIF_MAJOR || code == JWRN_ADOBE_XFORM || code == JWRN_BOGUS_ICC) return;
    if (code == JWRN_EXTRANEOUS_DATA && c->is_decompressor &&
        ((j_decompress_ptr)c)->input_scan_number == 0)
        return; /* junk between header segments */
    char buf[JMSG_LENGTH_MAX];
    (*c->err->format_message)(c, buf);
    snprintf(e->msg, e->cap, "%s (the data is damaged: not transcoded)", buf);
    longjmp(e->jump, 1);
}

static void tc_progress(j_common_ptr c) {
    struct tc_err *e = (struct tc_err *)c->err;
    if (c->is_decompressor && ((j_decompress_ptr)c)->input_scan_number > e->max_scans) {
        snprintf(e->msg, e->cap, "progressive JPEG has more than %d scans (max_scans)",
                 e->max_scans);
        longjmp(e->jump, 1);
    }
}

static void put_u32(uint8_t *p, uint64_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static size_t put_varint(uint8_t *p, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* The restart interval for `want` MCUs: a crop takes whole segments, so every
 * MCU row must start a segment: the interval must divide the MCUs of a row.
 * The largest divisor not above `want` (a row whose count is prime falls to
 * one MCU per segment); EN_SEEK_ROW or more than a row: one row. */
static int pick_interval(int want, int mcus_per_row) {
    if (want == EN_SEEK_ROW || want >= mcus_per_row) return mcus_per_row;
    for (int k = want; k > 1; k--)
        if (mcus_per_row % k == 0) return k;
    return 1;
}

typedef struct scan_layout {
    size_t sof_dims, dri_value, scan_offset, eoi;
    int width, height, mcu_w, mcu_h, dri;
} scan_layout;

/* Where the encoder put the segments this index needs (its own output: any
 * surprise is a bug, reported as such). */
static int find_layout(const uint8_t *d, size_t n, scan_layout *L, char *msg, size_t cap) {
    size_t p = 2;
    memset(L, 0, sizeof *L);
    int maxh = 1, maxv = 1, ncomp = 0;
    while (p + 4 <= n) {
        if (d[p] != 0xFF) break;
        const int m = d[p + 1];
        const size_t seg = (size_t)d[p + 2] << 8 | d[p + 3];
        if (seg < 2 || p + 2 + seg > n) break;
        const uint8_t *s = d + p + 4;
        if (m == 0xC0 || m == 0xC1) {
            L->sof_dims = p + 5;
            L->height = s[1] << 8 | s[2];
            L->width = s[3] << 8 | s[4];
            ncomp = s[5];
            for (int i = 0; i < ncomp; i++) {
                const int h = s[6 + 3 * i + 1] >> 4, v = s[6 + 3 * i + 1] & 15;
                if (h > maxh) maxh = h;
                if (v > maxv) maxv = v;
            }
        } else if (m == 0xDD) {
            L->dri_value = p + 4;
            L->dri = s[0] << 8 | s[1];
        } else if (m == 0xDA) {
            L->scan_offset = p + 2 + seg;
            /* A single-component scan's MCU is one block, whatever its factors. */
            L->mcu_w = ncomp == 1 ? 8 : 8 * maxh;
            L->mcu_h = ncomp == 1 ? 8 : 8 * maxv;
            return 0;
        }
        p += 2 + seg;
    }
    snprintf(msg, cap, "internal error: the transcoded JPEG has no SOF0/SOS where expected");
    return -1;
}

int en_seek_transcode(const uint8_t *data, size_t len, en_transcode_opts opts,
                      en_transcode_result *res, char *errmsg, size_t errcap) {
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    struct tc_err err;
    unsigned char *volatile out = NULL;
    unsigned long out_len = 0;
    uint8_t *volatile blob = NULL;
    volatile int have_dst = 0;
    memset(res, 0, sizeof *res);
    errmsg[0] = '\0';
    if (len < 4 || data[0] != 0xFF || data[1] != 0xD8) {
        snprintf(errmsg, errcap, "not a JPEG file (%zu bytes)", len);
        return EN_ERR_DECODE;
    }
    if (opts.restart < 0) {
        snprintf(errmsg, errcap, "restart interval must be >= 1 MCU or 0 (every MCU row), "
                                 "got %d", opts.restart);
        return EN_ERR_ARG;
    }
    src.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = tc_error_exit;
    err.pub.emit_message = tc_message;
    err.progress.progress_monitor = tc_progress;
    err.msg = errmsg;
    err.cap = errcap;
    err.max_scans = opts.max_scans;
    dst.err = &err.pub;
    if (setjmp(err.jump)) {
        if (have_dst) jpeg_destroy_compress(&dst);
        jpeg_destroy_decompress(&src);
        free(out);
        free(blob);
        return EN_ERR_DECODE;
    }
    jpeg_create_decompress(&src);
    src.progress = &err.progress;
    jpeg_mem_src(&src, data, (unsigned long)len);
    jpeg_read_header(&src, TRUE);
    const uint64_t pixels = (uint64_t)src.image_width * src.image_height;
    if (pixels == 0 || pixels > opts.max_pixels) {
        snprintf(errmsg, errcap, "JPEG declares %ux%u pixels, outside 1..max_pixels=%llu",
                 src.image_width, src.image_height, (unsigned long long)opts.max_pixels);
        longjmp(err.jump, 1);
    }
    /* Only colour spaces whose pixels do not depend on markers this writer
     * might change (JFIF vs Adobe, inverted CMYK): the rest stay as they are. */
    if (src.jpeg_color_space != JCS_YCbCr && src.jpeg_color_space != JCS_GRAYSCALE) {
        snprintf(errmsg, errcap, "colour space %d is not YCbCr or greyscale: not transcoded",
                 (int)src.jpeg_color_space);
        longjmp(err.jump, 1);
    }
    if (src.num_components != 1 && src.num_components != 3) {
        snprintf(errmsg, errcap, "%d components: not transcoded", src.num_components);
        longjmp(err.jump, 1);
    }
    uint64_t coef = 0;
    for (int i = 0; i < src.num_components; i++)
        coef += (uint64_t)src.comp_info[i].width_in_blocks *
                src.comp_info[i].height_in_blocks * DCTSIZE2 * sizeof(JCOEF);
    if (coef > opts.max_memory) {
        snprintf(errmsg, errcap, "%ux%u JPEG needs %llu bytes of coefficients, over "
                 "max_memory=%llu", src.image_width, src.image_height,
                 (unsigned long long)coef, (unsigned long long)opts.max_memory);
        longjmp(err.jump, 1);
    }
    res->progressive_in = src.progressive_mode;
    jvirt_barray_ptr *coefs = jpeg_read_coefficients(&src);

    jpeg_create_compress(&dst);
    have_dst = 1;
    unsigned char *buf = NULL;
    jpeg_mem_dest(&dst, &buf, &out_len);
    jpeg_copy_critical_parameters(&src, &dst);
    dst.optimize_coding = TRUE; /* per-file tables: pays for the markers */
    int maxh = 1;
    for (int i = 0; i < dst.num_components; i++)
        if (dst.comp_info[i].h_samp_factor > maxh) maxh = dst.comp_info[i].h_samp_factor;
    const int mcu_w = dst.num_components == 1 ? 8 : 8 * maxh;
    const int mcus_per_row = (int)((dst.image_width + mcu_w - 1) / mcu_w);
    int want = opts.restart;
    if (opts.restart_px > 0) want = opts.restart_px / mcu_w > 0 ? opts.restart_px / mcu_w : 1;
    const int interval = pick_interval(want, mcus_per_row);
    if (interval > 65535) {
        snprintf(errmsg, errcap, "an MCU row of %d MCUs does not fit a DRI", interval);
        longjmp(err.jump, 1);
    }
    dst.restart_interval = (unsigned)interval;
    jpeg_write_coefficients(&dst, coefs);
    jpeg_finish_compress(&dst);
    out = buf;
    jpeg_destroy_compress(&dst);
    have_dst = 0;
    jpeg_finish_decompress(&src);
    jpeg_destroy_decompress(&src);

    /* ---- index the markers of what was written ---- */
    scan_layout L;
    const size_t n = out_len;
    if (find_layout(out, n, &L, errmsg, errcap) || L.dri != interval || !L.dri_value) {
        if (!errmsg[0]) snprintf(errmsg, errcap, "internal error: DRI %d, wanted %d", L.dri,
                                 interval);
        free(out);
        return EN_ERR_DECODE;
    }
    const int mcu_rows = (L.height + L.mcu_h - 1) / L.mcu_h;
    const int spr = mcus_per_row / interval;
    const uint64_t nseg = (uint64_t)spr * mcu_rows;
    /* 40 bytes of fields, 8 per MCU row, at most 5 per segment length. */
    const size_t cap = 40 + 8 * (size_t)mcu_rows + 5 * (size_t)nseg;
    blob = malloc(cap);
    if (!blob) {
        snprintf(errmsg, errcap, "out of memory for an index of %llu segments",
                 (unsigned long long)nseg);
        free(out);
        return EN_ERR_NOMEM;
    }
    uint8_t *rows = blob + 40, *lens = rows + 8 * (size_t)mcu_rows;
    size_t nl = 0, start = L.scan_offset, p = L.scan_offset;
    uint64_t s = 0;
    for (;;) {
        const uint8_t *q = p < n ? memchr(out + p, 0xFF, n - p) : NULL;
        if (!q || (size_t)(q - out) + 1 >= n) break;
        p = (size_t)(q - out) + 2;
        const int m = q[1];
        if (m == 0x00) continue; /* stuffed byte */
        const int rst = m >= 0xD0 && m <= 0xD7;
        if (!rst && m != 0xD9) break;
        if (s >= nseg || (rst && m - 0xD0 != (int)(s & 7)) || (m == 0xD9) != (s + 1 == nseg))
            break;
        if (s % spr == 0) {
            put_u32(rows + 8 * (s / spr), start - L.scan_offset);
            put_u32(rows + 8 * (s / spr) + 4, nl);
        }
        /* A segment's length counts its RST marker; the last one's stops at EOI. */
        nl += put_varint(lens + nl, (rst ? p : p - 2) - start);
        start = p;
        if (++s == nseg) {
            L.eoi = p - 2;
            break;
        }
    }
    if (s != nseg || !L.eoi) {
        snprintf(errmsg, errcap, "internal error: %llu restart segments found, %llu expected",
                 (unsigned long long)s, (unsigned long long)nseg);
        free(out);
        free(blob);
        return EN_ERR_DECODE;
    }
    /* ---- APP9 segments after SOI; offsets shift by their size ---- */
    const size_t blob_len = 40 + 8 * (size_t)mcu_rows + nl;
    enum { CHUNK = 65533 - EN_SEEK_SIGNATURE_LEN };
    const size_t nchunks = (blob_len + CHUNK - 1) / CHUNK;
    const size_t app_bytes = blob_len + nchunks * (4 + EN_SEEK_SIGNATURE_LEN);
    put_u32(blob + 0, (uint32_t)L.width);
    put_u32(blob + 4, (uint32_t)L.height);
    put_u32(blob + 8, (uint32_t)(L.mcu_w | L.mcu_h << 16));
    put_u32(blob + 12, (uint32_t)mcus_per_row);
    put_u32(blob + 16, (uint32_t)mcu_rows);
    put_u32(blob + 20, (uint32_t)interval);
    put_u32(blob + 24, L.scan_offset + app_bytes);
    put_u32(blob + 28, L.eoi - L.scan_offset);
    put_u32(blob + 32, nl);
    put_u32(blob + 36, 0); /* flags: none yet */
    if ((uint64_t)n + app_bytes > 0xFFFFFFFFu) {
        snprintf(errmsg, errcap, "a seekable JPEG must stay under 4 GiB");
        free(out);
        free(blob);
        return EN_ERR_ARG;
    }
    uint8_t *f = malloc(n + app_bytes);
    if (!f) {
        snprintf(errmsg, errcap, "out of memory for a %zu-byte JPEG", n + app_bytes);
        free(out);
        free(blob);
        return EN_ERR_NOMEM;
    }
    f[0] = 0xFF;
    f[1] = 0xD8;
    size_t w = 2;
    for (size_t off = 0; off < blob_len; off += CHUNK) {
        const size_t c = blob_len - off < CHUNK ? blob_len - off : CHUNK;
        f[w] = 0xFF;
        f[w + 1] = 0xE9;
        f[w + 2] = (uint8_t)((c + 2 + EN_SEEK_SIGNATURE_LEN) >> 8);
        f[w + 3] = (uint8_t)(c + 2 + EN_SEEK_SIGNATURE_LEN);
        memcpy(f + w + 4, EN_SEEK_SIGNATURE, EN_SEEK_SIGNATURE_LEN);
        memcpy(f + w + 4 + EN_SEEK_SIGNATURE_LEN, blob + off, c);
        w += 4 + EN_SEEK_SIGNATURE_LEN + c;
    }
    memcpy(f + w, out + 2, n - 2);
    free(out);
    free(blob);
    res->data = f;
    res->len = n + app_bytes;
    res->index_bytes = app_bytes;
    res->interval = interval;
    res->segments = (int)nseg;
    res->width = L.width;
    res->height = L.height;
    res->mcu_w = L.mcu_w;
    res->mcu_h = L.mcu_h;
    return EN_OK;
}
