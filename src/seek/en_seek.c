/*
 * Seekable decode: assemble a small JPEG of the crop's MCUs from the restart
 * segments the index points at, and decode it with the kernel's own code.
 *
 * The kernel's source is compiled into this file (below) rather than linked:
 * its stages (header checks, the ROI decode feeding the resampler, the strict
 * tail check) are static, and the crop must be planned exactly as the kernel
 * plans it on the original -- same box, same DCT scale, same doubles -- and
 * only then moved onto the sub-image by a whole number of pixels.  Planning
 * on the sub-image's own coordinates would round differently (box.left - x0
 * is exact, but the resampler's centres are not), and the pixels must be
 * identical, not close.  -fvisibility=hidden keeps this copy's symbols apart
 * from _kernel's.
 */
#include "en_jpeg.c"

#include "en_seek.h"

/* ---- index parser ------------------------------------------------------------ */

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* One LEB128 value from [*p, end); -1 past the end or over 32 bits. */
static int64_t get_varint(const uint8_t **p, const uint8_t *end) {
    uint64_t v = 0;
    for (int shift = 0; shift < 35 && *p < end; shift += 7) {
        const uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) return v > 0xFFFFFFFFu ? -1 : (int64_t)v;
    }
    return -1;
}

#define BAD(...)                                      \
    do {                                              \
        snprintf(why, whycap, __VA_ARGS__);           \
        return -1;                                    \
    } while (0)

int en_seek_parse(const uint8_t *data, size_t len, en_seek_index *ix, void *blob_buf,
                  char *why, size_t whycap) {
    memset(ix, 0, sizeof *ix);
    why[0] = '\0';
    if (len < 4 || data[0] != 0xFF || data[1] != 0xD8) return 0;
    /* The index comes first (the transcoder puts it right after SOI): a
     * plain JPEG is told apart by its first marker, without walking it. */
    if (data[2] != 0xFF || data[3] != 0xE9) return 0;
    const uint8_t *blob = NULL;
    size_t blob_len = 0, blob_parts = 0;
    size_t p = 2;
    int ncomp = 0, maxh = 1, maxv = 1, dri = -1, sof = 0;
    for (;;) {
        if (p + 4 > len) BAD("the headers end at byte %zu, before the scan", p);
        if (data[p] != 0xFF) BAD("no marker at byte %zu of the headers", p);
        const int m = data[p + 1];
        const size_t seg = (size_t)data[p + 2] << 8 | data[p + 3];
        if (seg < 2 || p + 2 + seg > len)
            BAD("marker 0x%02x at byte %zu runs past the end of the file", m, p);
        const uint8_t *s = data + p + 4;
        const size_t sl = seg - 2;
        if (m == 0xE9 && sl >= EN_SEEK_SIGNATURE_LEN &&
            !memcmp(s, EN_SEEK_SIGNATURE, EN_SEEK_SIGNATURE_LEN)) {
            const size_t c = sl - EN_SEEK_SIGNATURE_LEN;
            if (blob_parts == 0) {
                blob = s + EN_SEEK_SIGNATURE_LEN;
            } else {
                /* Split index: the parts are copied together.  They are
                 * consecutive segments, so the total is bounded by the file. */
                if (!blob_buf) BAD("the index spans several segments and no buffer was given");
                en_buf *b = blob_buf;
                if (blob_parts == 1) {
                    if (en_buf_reserve(b, blob_len + c)) BAD("out of memory for the index");
                    memcpy(b->p, blob, blob_len);
                } else if (en_buf_reserve(b, blob_len + c)) {
                    BAD("out of memory for the index");
                }
                memcpy((uint8_t *)b->p + blob_len, s + EN_SEEK_SIGNATURE_LEN, c);
                blob = b->p;
            }
            blob_len += c;
            blob_parts++;
        } else if (m == 0xC0 || m == 0xC1) {
            if (sof++) BAD("two SOF markers");
            if (sl < 6) BAD("SOF segment too short");
            if (s[0] != 8) BAD("SOF precision %d, not 8", s[0]);
            ix->height = s[1] << 8 | s[2];
            ix->width = s[3] << 8 | s[4];
            ix->sof_dims = p + 5;
            ncomp = s[5];
            if ((ncomp != 1 && ncomp != 3) || sl < 6 + 3 * (size_t)ncomp)
                BAD("SOF with %d components", ncomp);
            for (int i = 0; i < ncomp; i++) {
                const int h = s[6 + 3 * i + 1] >> 4, v = s[6 + 3 * i + 1] & 15;
                if (h < 1 || h > 4 || v < 1 || v > 4) BAD("sampling factors %dx%d", h, v);
                if (h > maxh) maxh = h;
                if (v > maxv) maxv = v;
            }
        } else if ((m >= 0xC2 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) ||
                   m == 0xC8) {
            BAD("the file is not baseline (SOF 0x%02x): its index cannot apply", m);
        } else if (m == 0xDD) {
            if (sl != 2) BAD("DRI segment of %zu bytes", sl);
            dri = s[0] << 8 | s[1];
            ix->dri_value = p + 4;
        } else if (m == 0xDA) {
            if (!sof) BAD("SOS before SOF");
            if (sl < 1 || s[0] != ncomp || sl != 4 + 2 * (size_t)ncomp)
                BAD("a scan that does not hold every component");
            const uint8_t *t = s + 1 + 2 * ncomp;
            if (t[0] != 0 || t[1] != 63 || t[2] != 0) BAD("a scan that is not sequential");
            ix->scan_offset = p + 2 + seg;
            break;
        } else if (m == 0xD8 || m == 0xD9 || (m >= 0xD0 && m <= 0xD7) || m == 0x01) {
            BAD("marker 0x%02x in the headers", m);
        }
        p += 2 + seg;
    }
    if (!blob_parts) return 0;
    /* ---- the index against the headers ---- */
    if (blob_len < 40) BAD("index of %zu bytes, shorter than its fields", blob_len);
    const uint32_t W = get_u32(blob), H = get_u32(blob + 4), mcu = get_u32(blob + 8);
    ix->ncomp = ncomp;
    ix->mcu_w = ncomp == 1 ? 8 : 8 * maxh;
    ix->mcu_h = ncomp == 1 ? 8 : 8 * maxv;
    if (W != (uint32_t)ix->width || H != (uint32_t)ix->height)
        BAD("index for a %ux%u image, the SOF says %dx%d", H, W, ix->height, ix->width);
    if (!W || !H) BAD("empty image");
    if ((mcu & 0xFFFF) != (uint32_t)ix->mcu_w || mcu >> 16 != (uint32_t)ix->mcu_h)
        BAD("index MCU %ux%u, the sampling factors make %dx%d", mcu >> 16, mcu & 0xFFFF,
            ix->mcu_h, ix->mcu_w);
    ix->mcus_per_row = (int)((W + ix->mcu_w - 1) / ix->mcu_w);
    ix->mcu_rows = (int)((H + ix->mcu_h - 1) / ix->mcu_h);
    if (get_u32(blob + 12) != (uint32_t)ix->mcus_per_row ||
        get_u32(blob + 16) != (uint32_t)ix->mcu_rows)
        BAD("index of %u x %u MCUs, the image has %d x %d", get_u32(blob + 16),
            get_u32(blob + 12), ix->mcu_rows, ix->mcus_per_row);
    const uint32_t k = get_u32(blob + 20);
    if (k == 0 || k > (uint32_t)ix->mcus_per_row || ix->mcus_per_row % k)
        BAD("restart interval %u does not divide an MCU row of %d", k, ix->mcus_per_row);
    if (dri != (int)k) BAD("the DRI says %d MCUs per restart interval, the index %u", dri, k);
    ix->interval = (int)k;
    ix->segs_per_row = ix->mcus_per_row / (int)k;
    if (get_u32(blob + 24) != ix->scan_offset)
        BAD("index says the scan starts at byte %u, it starts at %zu", get_u32(blob + 24),
            ix->scan_offset);
    ix->scan_len = get_u32(blob + 28);
    if (ix->scan_len > len - ix->scan_offset || len - ix->scan_offset - ix->scan_len < 2)
        BAD("index puts the end of the scan at byte %zu, past the %zu-byte file",
            ix->scan_offset + ix->scan_len, len);
    const uint8_t *eoi = data + ix->scan_offset + ix->scan_len;
    if (eoi[0] != 0xFF || eoi[1] != 0xD9)
        BAD("no EOI where the index puts the end of the scan (byte %zu)",
            ix->scan_offset + ix->scan_len);
    ix->lens_len = get_u32(blob + 32);
    if (blob_len != 40 + 8 * (uint64_t)ix->mcu_rows + ix->lens_len)
        BAD("index of %zu bytes, its fields make %llu", blob_len,
            (unsigned long long)(40 + 8 * (uint64_t)ix->mcu_rows + ix->lens_len));
    ix->rows = blob + 40;
    ix->lens = ix->rows + 8 * (size_t)ix->mcu_rows;
    /* Every row starts right after the restart marker that ends the row above:
     * FF D0+n can only be a marker (entropy-coded FF bytes are stuffed with 00),
     * and its number must be the segment's.  O(rows), cheap for any image. */
    uint32_t prev_off = 0, prev_lens = 0;
    for (int r = 0; r < ix->mcu_rows; r++) {
        const uint32_t off = get_u32(ix->rows + 8 * (size_t)r);
        const uint32_t lo = get_u32(ix->rows + 8 * (size_t)r + 4);
        if (r == 0 ? off != 0 || lo != 0 : off <= prev_off || lo <= prev_lens)
            BAD("index rows out of order at MCU row %d", r);
        if (off >= ix->scan_len || lo >= ix->lens_len)
            BAD("index offset of MCU row %d out of bounds", r);
        if (r > 0) {
            const uint8_t *mk = data + ix->scan_offset + off - 2;
            const int want = (int)(((uint64_t)r * ix->segs_per_row - 1) & 7);
            if (off < 2 || mk[0] != 0xFF || mk[1] != 0xD0 + want)
                BAD("no RST%d before MCU row %d where the index puts it", want, r);
        }
        prev_off = off;
        prev_lens = lo;
    }
    return 1;
}

/* ---- the seeker: a kernel decoder plus the sub-image buffer ----------------- */

struct en_seeker {
    en_decoder *d;
    en_buf sub;   /* the assembled sub-image */
    en_buf blob;  /* an index split over several APP9 segments */
    en_seek_stats stats;
    char why[256];
};

en_seeker *en_seeker_new(void) {
    en_seeker *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->d = en_decoder_new();
    if (!s->d) {
        free(s);
        return NULL;
    }
    return s;
}

void en_seeker_free(en_seeker *s) {
    if (!s) return;
    en_decoder_free(s->d);
    en_buf_free(&s->sub);
    en_buf_free(&s->blob);
    free(s);
}

en_decoder *en_seeker_decoder(en_seeker *s) { return s->d; }
const char *en_seeker_why(const en_seeker *s) { return s->why; }
en_seek_stats en_seeker_stats(const en_seeker *s) { return s->stats; }

int en_seeker_parse(en_seeker *s, const uint8_t *data, size_t len, en_seek_index *ix) {
    return en_seek_parse(data, len, ix, &s->blob, s->why, sizeof s->why);
}

/* Header segments a sub-image keeps: tables, frame, restart interval, scan,
 * and the JFIF / Adobe markers that say how to convert colours.  The index
 * itself, EXIF, ICC and comments stay behind. */
static int keep_segment(int m) {
    return m == 0xDB || m == 0xC4 || m == 0xC0 || m == 0xC1 || m == 0xDD || m == 0xDA ||
           m == 0xE0 || m == 0xEE;
}

static void put_u16be(uint8_t *p, unsigned v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

/* Sub-image of MCU rows [r0, r1), columns [c0, c1) into s->sub; ix parsed. */
static int assemble(en_seeker *s, const uint8_t *data, const en_seek_index *ix, int r0, int r1,
                    int c0, int c1, size_t *out_len) {
    char *why = s->why;
    const size_t whycap = sizeof s->why;
    const int k = ix->interval;
    if (r0 < 0 || r1 > ix->mcu_rows || r0 >= r1 || c0 < 0 || c1 > ix->mcus_per_row ||
        c0 >= c1 || c0 % k || (c1 % k && c1 != ix->mcus_per_row))
        BAD("MCU rows [%d, %d) and columns [%d, %d) are not whole restart segments of a "
            "%dx%d-MCU image (interval %d)", r0, r1, c0, c1, ix->mcu_rows, ix->mcus_per_row, k);
    const int s0 = c0 / k, s1 = (c1 + k - 1) / k; /* segments of each row */
    /* Upper bound: the headers, plus each row's bytes from its first segment to
     * the end of the row, plus markers. */
    size_t need = ix->scan_offset + 2;
    for (int r = r0; r < r1; r++) {
        const uint32_t a = get_u32(ix->rows + 8 * (size_t)r);
        const uint32_t b = r + 1 < ix->mcu_rows ? get_u32(ix->rows + 8 * (size_t)(r + 1))
                                                : (uint32_t)ix->scan_len;
        need += b - a + 2;
    }
    if (en_buf_reserve(&s->sub, need)) BAD("out of memory for a %zu-byte sub-image", need);
    uint8_t *o = s->sub.p;
    size_t w = 0;
    o[w++] = 0xFF;
    o[w++] = 0xD8;
    const int sub_w = (c1 == ix->mcus_per_row ? ix->width : c1 * ix->mcu_w) - c0 * ix->mcu_w;
    const int sub_h = (r1 == ix->mcu_rows ? ix->height : r1 * ix->mcu_h) - r0 * ix->mcu_h;
    for (size_t p = 2; p < ix->scan_offset;) {
        const int m = data[p + 1];
        const size_t seg = (size_t)data[p + 2] << 8 | data[p + 3];
        if (keep_segment(m)) {
            memcpy(o + w, data + p, seg + 2);
            if (m == 0xC0 || m == 0xC1) {
                put_u16be(o + w + 5, (unsigned)sub_h);
                put_u16be(o + w + 7, (unsigned)sub_w);
            }
            w += seg + 2;
        }
        p += seg + 2;
    }
    const uint8_t *scan = data + ix->scan_offset, *lend = ix->lens + ix->lens_len;
    const uint64_t nseg = (uint64_t)ix->segs_per_row * ix->mcu_rows;
    unsigned t = 0; /* restart markers written */
    int first = 1;
    uint64_t copied = 0;
    for (int r = r0; r < r1; r++) {
        uint64_t off = get_u32(ix->rows + 8 * (size_t)r);
        const uint64_t row_end = r + 1 < ix->mcu_rows ? get_u32(ix->rows + 8 * (size_t)(r + 1))
                                                      : ix->scan_len;
        const uint8_t *lp = ix->lens + get_u32(ix->rows + 8 * (size_t)r + 4);
        /* Walk the whole row: its lengths must add up to where the next row
         * starts, and every segment must end in its own restart marker, or
         * the index does not describe this file. */
        for (int j = 0; j < ix->segs_per_row; j++) {
            const int64_t n = get_varint(&lp, lend);
            const uint64_t sidx = (uint64_t)r * ix->segs_per_row + j;
            const int last = sidx + 1 == nseg;
            if (n < (last ? 1 : 3) || off + (uint64_t)n > row_end)
                BAD("segment %llu of MCU row %d: length out of bounds",
                    (unsigned long long)sidx, r);
            if (!last) {
                const uint8_t *mk = scan + off + n - 2;
                if (mk[0] != 0xFF || mk[1] != 0xD0 + (int)(sidx & 7))
                    BAD("segment %llu does not end in RST%d where the index says",
                        (unsigned long long)sidx, (int)(sidx & 7));
            }
            if (j >= s0 && j < s1) {
                const size_t body = (size_t)n - (last ? 0 : 2);
                if (!first) {
                    o[w++] = 0xFF;
                    o[w++] = (uint8_t)(0xD0 + (t++ & 7));
                }
                first = 0;
                memcpy(o + w, scan + off, body);
                w += body;
                copied += body;
            }
            off += (uint64_t)n;
        }
        if (off != row_end)
            BAD("the segment lengths of MCU row %d add up to %llu bytes, the row has %llu", r,
                (unsigned long long)(off - get_u32(ix->rows + 8 * (size_t)r)),
                (unsigned long long)(row_end - get_u32(ix->rows + 8 * (size_t)r)));
    }
    o[w++] = 0xFF;
    o[w++] = 0xD9;
    s->stats.bytes_in += copied;
    *out_len = w;
    return 0;
}

int en_seek_assemble(en_seeker *s, const uint8_t *data, size_t len, int r0, int r1, int c0,
                     int c1, const uint8_t **out, size_t *out_len) {
    en_seek_index ix;
    s->why[0] = '\0';
    const int r = en_seek_parse(data, len, &ix, &s->blob, s->why, sizeof s->why);
    if (r == 0) snprintf(s->why, sizeof s->why, "no seekable index in the file");
    if (r <= 0) return EN_ERR_DECODE;
    /* The sub-image keeps the file's DRI: the parser checked that it is the
     * index's interval, and the columns are whole segments of it. */
    if (assemble(s, data, &ix, r0, r1, c0, c1, out_len)) return EN_ERR_DECODE;
    *out = s->sub.p;
    return EN_OK;
}

/* ---- the crop ----------------------------------------------------------------- */

static int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

/* Plan the crop on the original exactly as crop_resize does, pick the MCUs
 * its pixels lie in plus EN_SEEK_SLACK pixels (at the DCT scale) on every side
 * that is not the image's edge, assemble them, and decode the sub-image with
 * the plan moved onto it.  The slack: a sub-image's edge is an image edge to
 * libjpeg, where fancy upsampling replicates the last chroma sample instead of
 * reading its neighbour, which changes the outermost pixel row or column; the
 * kernel keeps the same 2-pixel distance from the edges of its own ROI for the
 * same reason (EN_CROP_MARGIN).  Pixels further in depend only on their own
 * blocks and their chroma neighbours, which the sub-image holds (checked
 * bit-exact against the kernel over many thousand random crops, every
 * sampling and scale: tests/test_seekable.py). */
enum { EN_SEEK_SLACK = 2 };

static int seek_crop(en_seeker *s, const uint8_t *data, size_t len, const en_seek_index *ix,
                     en_box box, int out_h, int out_w, int flip, uint8_t *out, size_t stride) {
    en_decoder *d = s->d;
    const double eps = 1e-6;
    if (!(box.height > 0 && box.width > 0 && box.top >= -eps && box.left >= -eps &&
          box.top + box.height <= ix->height + eps && box.left + box.width <= ix->width + eps))
        return 1; /* let the kernel refuse it, in its words */
    /* Limits as the plain path applies them to the whole image: over one, it refuses. */
    if ((uint64_t)ix->width * ix->height > d->limits.max_pixels ||
        (uint64_t)ix->width * ix->height * 3 > d->limits.max_memory)
        return 1;
    const int denom = en_pick_scale(box, out_h, out_w);
    const int sw = ceil_div(ix->width, denom), sh = ceil_div(ix->height, denom);
    en_axis ax, ay;
    if (en_plan_axis(&d->rs, 1, box.left / denom, (box.left + box.width) / denom, sw, out_w,
                     &ax) ||
        en_plan_axis(&d->rs, 0, box.top / denom, (box.top + box.height) / denom, sh, out_h, &ay))
        return 1;
    const int k = ix->interval;
    int c0 = floor_div((ax.lo - EN_SEEK_SLACK) * denom, ix->mcu_w);
    int c1 = ceil_div((ax.hi + EN_SEEK_SLACK) * denom, ix->mcu_w);
    int r0 = floor_div((ay.lo - EN_SEEK_SLACK) * denom, ix->mcu_h);
    int r1 = ceil_div((ay.hi + EN_SEEK_SLACK) * denom, ix->mcu_h);
    c0 = c0 < 0 ? 0 : c0 / k * k;
    c1 = c1 >= ix->mcus_per_row ? ix->mcus_per_row : ceil_div(c1, k) * k;
    if (c1 > ix->mcus_per_row) c1 = ix->mcus_per_row;
    if (r0 < 0) r0 = 0;
    if (r1 > ix->mcu_rows) r1 = ix->mcu_rows;
    if (c0 == 0 && c1 == ix->mcus_per_row && r0 == 0 && r1 == ix->mcu_rows) {
        s->stats.whole++;
        return 1; /* every MCU: the file itself is the sub-image */
    }
    size_t sub_len;
    if (assemble(s, data, ix, r0, r1, c0, c1, &sub_len)) {
        s->stats.fallback++;
        return 1;
    }
    /* From here on the kernel decodes the sub-image: its errors are the file's. */
    begin(d, s->sub.p, sub_len);
    j_decompress_ptr ci = &d->cinfo;
    const int ox = c0 * ix->mcu_w / denom, oy = r0 * ix->mcu_h / denom;
    for (int i = 0; i < ax.out_size; i++) ax.first[i] -= ox;
    for (int i = 0; i < ay.out_size; i++) ay.first[i] -= oy;
    ax.lo -= ox;
    ax.hi -= ox;
    ay.lo -= oy;
    ay.hi -= oy;
    const int ssw = ceil_div((int)ci->image_width, denom);
    if (ax.lo < 0 || ay.lo < 0 || ax.hi > ssw || ay.hi > ceil_div((int)ci->image_height, denom))
        fail(d, EN_ERR_DECODE, "internal error: the crop is not inside its sub-image");
    decode_planned_crop(d, denom, &ax, &ay, flip, out, stride);
    s->stats.seek++;
    return 0;
}

/* The index, or why not: 1 sound, 0 none, -1 disagreeing (counted). */
static int seek_index(en_seeker *s, const uint8_t *data, size_t len, en_seek_index *ix) {
    s->why[0] = '\0';
    const int r = en_seek_parse(data, len, ix, &s->blob, s->why, sizeof s->why);
    if (r == 0) s->stats.plain++;
    if (r < 0) s->stats.fallback++;
    return r;
}

/* A fallback whose plain decode fails names the index's problem too. */
static int plain_failed(en_seeker *s, int st) {
    if (st && s->why[0]) {
        en_decoder *d = s->d;
        const size_t n = strlen(d->errmsg);
        snprintf(d->errmsg + n, sizeof d->errmsg - n, " (and its seekable index: %s)", s->why);
    }
    return st;
}

int en_seek_decode_crop(en_seeker *s, const uint8_t *data, size_t len, en_box box, int out_h,
                        int out_w, int flip, uint8_t *out, size_t stride) {
    en_seek_index ix;
    if (seek_index(s, data, len, &ix) > 0) {
        en_decoder *d = s->d;
        EN_GUARD(d);
        if (d->profiling) d->mark_ns = now_ns();
        if (!seek_crop(s, data, len, &ix, box, out_h, out_w, flip, out, stride)) return EN_OK;
    }
    return plain_failed(s, en_jpeg_decode_crop(s->d, data, len, box, out_h, out_w, flip, out,
                                               stride));
}

int en_seek_decode_random_crop(en_seeker *s, const uint8_t *data, size_t len, en_key key,
                               en_rrc_spec spec, int out_h, int out_w, uint8_t *out,
                               size_t stride, en_box *box, int *flip) {
    en_seek_index ix;
    if (seek_index(s, data, len, &ix) > 0) {
        en_decoder *d = s->d;
        EN_GUARD(d);
        if (d->profiling) d->mark_ns = now_ns();
        en_random_resized_crop(key, ix.height, ix.width, spec, box, flip);
        if (!seek_crop(s, data, len, &ix, *box, out_h, out_w, *flip, out, stride)) return EN_OK;
    }
    return plain_failed(s, en_jpeg_decode_random_crop(s->d, data, len, key, spec, out_h, out_w,
                                                      out, stride, box, flip));
}

int en_seek_decode_center_crop(en_seeker *s, const uint8_t *data, size_t len, int resize_side,
                               int out_h, int out_w, uint8_t *out, size_t stride, en_box *box) {
    en_seek_index ix;
    if (seek_index(s, data, len, &ix) > 0) {
        en_decoder *d = s->d;
        EN_GUARD(d);
        if (d->profiling) d->mark_ns = now_ns();
        *box = en_center_crop_box(ix.height, ix.width, resize_side, out_h, out_w);
        if (!seek_crop(s, data, len, &ix, *box, out_h, out_w, 0, out, stride)) return EN_OK;
    }
    return plain_failed(s, en_jpeg_decode_center_crop(s->d, data, len, resize_side, out_h,
                                                      out_w, out, stride, box));
}
