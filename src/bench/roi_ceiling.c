/*
 * The decode-only ceiling for benchmarks: libjpeg-turbo's ROI decode of a crop
 * at a DCT scale, written the plainest way, with no resize, flip or colour
 * work of ours.  Kept apart from the kernel on purpose, so the benchmark
 * compares the kernel against libjpeg-turbo and not against itself.
 *
 * The variants split libjpeg-turbo's own time into stages for the kernel's
 * profile (see roi_ceiling.h).
 */
#include "roi_ceiling.h"

#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <jpeglib.h>

struct jump_err {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
};

static void jump_exit(j_common_ptr c) { longjmp(((struct jump_err *)c->err)->jump, 1); }
/* libjpeg's own emit_message is what counts warnings (level -1): count them here. */
static void quiet(j_common_ptr c, int level) {
    if (level < 0) c->err->num_warnings++;
}

int roi_decode_only(const unsigned char *data, unsigned long len, int top, int left, int height,
                    int width, int denom, int mode, unsigned char *scratch,
                    unsigned long scratch_cap, unsigned long *need) {
    struct jpeg_decompress_struct ci;
    struct jump_err err;
    ci.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = jump_exit;
    /* Quiet, but counted: the finishing variant refuses what libjpeg warns about,
     * as any decoder that reports corrupt files must. */
    err.pub.emit_message = quiet;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&ci);
        return -1;
    }
    jpeg_create_decompress(&ci);
    jpeg_mem_src(&ci, data, len);
    jpeg_read_header(&ci, TRUE);
    /* libjpeg turns grayscale into RGB but not into YCbCr: leave those as RGB. */
    const int ycc = mode == ROI_YCC && ci.jpeg_color_space == JCS_YCbCr;
    ci.out_color_space = ycc ? JCS_YCbCr : JCS_RGB;
    ci.scale_num = 1;
    ci.scale_denom = (unsigned)denom;
    jpeg_start_decompress(&ci);
    JDIMENSION x0 = (JDIMENSION)(left / denom), w = (JDIMENSION)((width + denom - 1) / denom);
    if (x0 + w > ci.output_width) w = ci.output_width - x0;
    jpeg_crop_scanline(&ci, &x0, &w);
    int y0 = top / denom, rows = (height + denom - 1) / denom;
    if (y0 + rows > (int)ci.output_height) rows = (int)ci.output_height - y0;
    if (rows < 0) rows = 0; /* a crop below the image: nothing to decode */
    /* Rows never start on a 32-byte boundary: libjpeg-turbo's SIMD colour
     * conversion writes such a row with non-temporal stores, which made this
     * ceiling 12% slower whenever the scratch buffer happened to be aligned
     * (see region_rows in en_jpeg.c).  The fastest correct decode is the ceiling. */
    enum { ALIGN = 32, SKEW = 8 };
    const unsigned long row_bytes =
        ((unsigned long)ci.output_width * ci.output_components + ALIGN - 1) & ~(ALIGN - 1ul);
    *need = (mode == ROI_STORE ? row_bytes * (unsigned long)rows : row_bytes) + ALIGN + SKEW;
    if (*need > scratch_cap) {
        jpeg_destroy_decompress(&ci);
        return -2;
    }
    scratch += (ALIGN - (uintptr_t)scratch % ALIGN) % ALIGN + SKEW;
    if (y0) jpeg_skip_scanlines(&ci, (JDIMENSION)y0);
    if (mode == ROI_ENTROPY) {
        jpeg_skip_scanlines(&ci, (JDIMENSION)rows);
    } else {
        /* One row reused, to measure decoding and not storing, except ROI_STORE. */
        const unsigned long step = mode == ROI_STORE ? row_bytes : 0;
        for (int y = 0; y < rows; y++) {
            JSAMPROW row = scratch + step * (unsigned long)y;
            jpeg_read_scanlines(&ci, &row, 1);
        }
    }
    if (mode == ROI_FINISH) {
        /* What a decoder that checks the whole file does (TurboJPEG's cropping
         * decode): entropy-decode the rows below the crop, then read to EOI. */
        if (ci.output_scanline < ci.output_height)
            jpeg_skip_scanlines(&ci, ci.output_height - ci.output_scanline);
        jpeg_finish_decompress(&ci);
        if (err.pub.num_warnings) rows = -3;
    }
    jpeg_destroy_decompress(&ci);
    return rows;
}
