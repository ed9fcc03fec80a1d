/*
 * The decoder object, and the policy that turns libjpeg's reports into its
 * statuses: fatal errors, warnings (harmless or data loss) and the progress
 * calls that bound a progressive file's scans.
 *
 * Error handling: libjpeg reports fatal errors by calling error_exit, which
 * must not return.  We longjmp back to the public function that called into
 * libjpeg; each such function sets its own jump point, so the jump never
 * crosses a frame that is not ours (in particular, never a Cython frame).
 */
#include "en_decoder.h"

#include <stdlib.h>
#include <string.h>

#include <jerror.h> /* message codes, to name unsupported variants */

/* libjpeg hands callbacks a j_common_ptr to the embedded cinfo, which is the
 * first member, so the decoder is one cast away. */
static en_decoder *owner(j_common_ptr c) { return (en_decoder *)c; }

/* libjpeg names unsupported coding processes only by their SOF marker
 * ("SOF type 0xc3"); the contract is to refuse them by name. */
static const char *unsupported_name(struct jpeg_error_mgr *err) {
    if (err->msg_code == JERR_BAD_PRECISION)
        return "only 8-bit JPEG is supported, not 12-bit or 16-bit";
    if (err->msg_code != JERR_SOF_UNSUPPORTED) return NULL;
    switch (err->msg_parm.i[0]) {
    case 0xc3: case 0xcb: return "lossless JPEG is not supported";
    case 0xc7: case 0xcf: return "hierarchical lossless JPEG is not supported";
    case 0xc5: case 0xc6: case 0xcd: case 0xce: return "hierarchical JPEG is not supported";
    default: return NULL;
    }
}

static void on_error_exit(j_common_ptr c) {
    en_decoder *d = owner(c);
    char buf[JMSG_LENGTH_MAX];
    (*c->err->format_message)(c, buf);
    const char *name = unsupported_name(c->err);
    if (name)
        fail(d, EN_ERR_DECODE, "%s (%s)", buf, name);
    fail(d, EN_ERR_DECODE, "%s", buf);
}

/* ---- warnings: harmless or data loss ---------------------------------------
 *
 * libjpeg reports recoverable problems as warnings (emit_message level -1) and
 * decodes on, padding what it could not read with grey or zero coefficients.
 * Strict mode refuses only the warnings that lose or corrupt image data; the
 * rest are counted (en_decoder_harmless_warnings) and the decode goes on.  The
 * decision uses the message code and the decoder's state, never the text:
 *
 * Harmless (no pixel depends on the bytes involved):
 *   JWRN_EXTRANEOUS_DATA before the first scan (input_scan_number == 0: no SOS
 *     read yet) when the marker that follows (msg_parm.i[1]) is a header
 *     segment: APPn, COM, DQT, DHT, DAC, SOFn, SOS, DRI.  Junk between header
 *     segments (padding after an EXIF block, stray bytes before a DQT) is
 *     outside every table and every scan, and libjpeg skips it whole.
 *   JWRN_JFIF_MAJOR, JWRN_ADOBE_XFORM: unknown APP0 / APP14 contents (libjpeg
 *     falls back to the default colour transform, exactly as Pillow does);
 *   JWRN_BOGUS_ICC: a malformed ICC profile (the kernel never reads it).
 *   (EXIF/APP1 contents are never parsed by libjpeg: a malformed EXIF block
 *   raises no warning at all, only header junk after it if its length is
 *   short.)
 *
 * Data loss (refused in strict mode; lenient mode decodes what libjpeg gives):
 *   JWRN_JPEG_EOF (the data ends early, rows padded with grey), JWRN_HIT_MARKER
 *   (a scan ends before its last MCU), JWRN_HUFF_BAD_CODE / JWRN_ARITH_BAD_CODE
 *   (corrupt entropy data), JWRN_MUST_RESYNC (wrong marker where a restart
 *   marker was expected), JWRN_NOT_SEQUENTIAL, JWRN_BOGUS_PROGRESSION (scans
 *   that cannot make a complete image), any warning code not named above, and
 *   JWRN_EXTRANEOUS_DATA once a scan has started (input_scan_number > 0):
 *   - before RSTn: junk inside a scan, where a restart marker was expected;
 *   - before EOI or the next scan's markers while the scan is incomplete
 *     (input_iMCU_row < total_iMCU_rows): the scan ends in junk;
 *   - before EOI or the next scan's markers after a complete scan: the bytes
 *     of the scan outnumber what its blocks decode from.  Junk appended by an
 *     encoder would look the same, but this surplus is what corrupt entropy
 *     data leaves: measured on photographs with one corrupted byte or a few
 *     inserted or deleted mid-scan, it was the only warning for 147 of 157
 *     arithmetic-coded, 45 of 128 progressive and 191 of 736 sequential
 *     files (all with garbled blocks), and no real-world harmless file in the
 *     report that led here had it (all four had junk between header
 *     segments).  Counting it harmless would let most corrupt scans through.
 *   - before any other marker (one that cannot follow a header).
 */

static int is_header_marker(int m) {
    if (m >= 0xE0 && m <= 0xEF) return 1;                         /* APPn */
    if (m >= 0xC0 && m <= 0xCF && m != 0xC8) return 1;            /* SOFn, DHT, DAC */
    return m == 0xFE || m == 0xDB || m == 0xDA || m == 0xDD;      /* COM DQT SOS DRI */
}

/* NULL when the current warning is harmless, else what it costs the pixels. */
static const char *data_loss(j_decompress_ptr ci, const struct jpeg_error_mgr *err) {
    switch (err->msg_code) {
    case JWRN_JFIF_MAJOR:
    case JWRN_ADOBE_XFORM:
    case JWRN_BOGUS_ICC:
        return NULL;
    case JWRN_EXTRANEOUS_DATA: {
        const int m = err->msg_parm.i[1];
        if (m >= 0xD0 && m <= 0xD7)
            return "junk inside the entropy-coded data where a restart marker was expected: "
                   "the blocks of that restart interval are lost";
        if (ci->input_scan_number == 0) {
            if (is_header_marker(m)) return NULL;
            return "junk before a marker that cannot start an image";
        }
        if (ci->input_iMCU_row < ci->total_iMCU_rows)
            return "a scan ends in junk before its last MCU row: blocks are lost";
        return "surplus bytes at the end of a scan, more than its blocks decode from: "
               "what corrupt entropy-coded data leaves behind (garbled blocks)";
    }
    case JWRN_JPEG_EOF:
        return "the file ends before the image data does (decoding on, as strict=False does, "
               "would fill the missing rows with grey)";
    case JWRN_HIT_MARKER:
        return "a scan ends before the image is complete: missing blocks are filled in";
    case JWRN_HUFF_BAD_CODE:
#if JPEG_LIB_VERSION >= 70 || defined(D_ARITH_CODING_SUPPORTED)
    case JWRN_ARITH_BAD_CODE:
#endif
        return "corrupt entropy-coded data";
    case JWRN_MUST_RESYNC:
        return "restart markers out of sequence: blocks are lost";
    case JWRN_NOT_SEQUENTIAL:
    case JWRN_BOGUS_PROGRESSION:
        return "the scans cannot make a complete image";
    default:
        return "libjpeg substituted data";
    }
}

/* level < 0 is a warning (level >= 0 is tracing, ignored). */
static void on_message(j_common_ptr c, int level) {
    en_decoder *d = owner(c);
    if (level >= 0) return;
    const char *loss = c->is_decompressor ? data_loss((j_decompress_ptr)c, c->err)
                                          : "libjpeg substituted data";
    if (!loss) {
        d->harmless++;
        return;
    }
    d->warnings++;
    if (d->limits.strict) {
        char buf[JMSG_LENGTH_MAX];
        (*c->err->format_message)(c, buf);
        fail(d, EN_ERR_DECODE, "%s (strict mode: %s)", buf, loss);
    }
}

/* Progressive files are consumed scan by scan inside jpeg_start_decompress;
 * a file of thousands of tiny scans would otherwise keep a worker busy for
 * seconds.  libjpeg calls this between input passes. */
static void on_progress(j_common_ptr c) {
    en_decoder *d = owner(c);
    j_decompress_ptr ci = (j_decompress_ptr)c;
    if (ci->input_scan_number > d->limits.max_scans)
        fail(d, EN_ERR_LIMIT, "progressive JPEG has more than %d scans (max_scans)",
             d->limits.max_scans);
}

en_decoder *en_decoder_new(void) {
    en_decoder *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->cinfo.err = jpeg_std_error(&d->jerr);
    d->jerr.error_exit = on_error_exit;
    d->jerr.emit_message = on_message;
    d->progress.progress_monitor = on_progress;
    d->limits.max_pixels = EN_DEFAULT_MAX_PIXELS;
    d->limits.max_scans = EN_DEFAULT_MAX_SCANS;
    d->limits.strict = 1;
    d->limits.max_memory = EN_DEFAULT_MAX_MEMORY;
    if (setjmp(d->jump)) {
        free(d);
        return NULL;
    }
    jpeg_create_decompress(&d->cinfo);
    d->cinfo.progress = &d->progress;
    return d;
}

void en_decoder_free(en_decoder *d) {
    if (!d) return;
    jpeg_destroy_decompress(&d->cinfo);
    en_resampler_free(&d->rs);
    en_buf_free(&d->region);
    en_buf_free(&d->rowbuf);
    free(d);
}

void en_decoder_set_limits(en_decoder *d, en_limits limits) { d->limits = limits; }

void en_decoder_profile(en_decoder *d, int on) {
    if (on) memset(&d->prof, 0, sizeof d->prof); /* off keeps the counts for reading */
    d->profiling = on;
}

en_profile en_decoder_get_profile(const en_decoder *d) { return d->prof; }

en_limits en_decoder_get_limits(const en_decoder *d) { return d->limits; }
const char *en_decoder_errmsg(const en_decoder *d) { return d->errmsg; }
int en_decoder_warnings(const en_decoder *d) { return d->warnings; }
int en_decoder_harmless_warnings(const en_decoder *d) { return d->harmless; }
uint64_t en_decoder_last_memory(const en_decoder *d) { return d->last_memory; }
int en_decoder_last_scale(const en_decoder *d) { return d->last_scale; }
