/*
 * The decoder's state, shared by the two files that drive libjpeg with it:
 * en_decoder.c (its life, and what libjpeg's errors, warnings and progress
 * calls do to it) and en_jpeg.c (the decodes).  Internal: callers see the
 * opaque type of en_kernel.h.
 */
#ifndef EN_DECODER_H
#define EN_DECODER_H

#include "en_kernel.h"
#include "en_resize.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>

#include <jpeglib.h>

struct en_decoder {
    struct jpeg_decompress_struct cinfo;
    struct jpeg_error_mgr jerr;
    struct jpeg_progress_mgr progress;
    jmp_buf jump;
    en_limits limits;
    int status;        /* en_status of the failure being unwound */
    int warnings;      /* data-loss warnings (strict mode refuses the first) */
    int harmless;      /* harmless warnings: header junk, odd metadata */
    int last_scale;
    uint64_t last_memory; /* working memory the last header needs */
    int cmyk_inverted; /* Adobe CMYK is stored inverted */
    en_resampler rs;
    en_buf region;     /* decoded RGB pixels of the region of interest */
    en_buf rowbuf;     /* CMYK scanlines before conversion */
    int profiling;
    uint64_t mark_ns;  /* end of the last stage timed */
    en_profile prof;
    char errmsg[JMSG_LENGTH_MAX + 256];
};

/* Refuse the current call: the status and message are kept for the caller, and
 * the jump lands where the public entry point that called into libjpeg armed it
 * (EN_GUARD in en_jpeg.c), so no frame that is not ours is unwound.  Here, not
 * in one file, because libjpeg's callbacks and the decodes both refuse through it. */
static inline void fail(en_decoder *d, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->errmsg, sizeof d->errmsg, fmt, ap);
    va_end(ap);
    d->status = status;
    longjmp(d->jump, 1);
}

#endif
