/* Test-only JPEG writer over the system libjpeg: the variants Pillow cannot write.
 * usage: IN OUT W H NCOMP INCS JPEGCS QUALITY SAMPLING PROG ARITH RESTART_ROWS ADOBE */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

static J_COLOR_SPACE cs(const char *s) {
    if (!strcmp(s, "gray")) return JCS_GRAYSCALE;
    if (!strcmp(s, "rgb")) return JCS_RGB;
    if (!strcmp(s, "ycc")) return JCS_YCbCr;
    if (!strcmp(s, "cmyk")) return JCS_CMYK;
    if (!strcmp(s, "ycck")) return JCS_YCCK;
    fprintf(stderr, "unknown colour space %s\n", s);
    exit(2);
}

int main(int argc, char **argv) {
    if (argc != 14) { fprintf(stderr, "bad usage\n"); return 2; }
    int w = atoi(argv[3]), h = atoi(argv[4]), nc = atoi(argv[5]);
    int prog = atoi(argv[10]), arith = atoi(argv[11]), restart = atoi(argv[12]);
    int adobe = atoi(argv[13]);
    size_t n = (size_t)w * h * nc;
    unsigned char *px = malloc(n);
    FILE *f = fopen(argv[1], "rb");
    if (!px || !f || fread(px, 1, n, f) != n) { fprintf(stderr, "short input\n"); return 1; }
    fclose(f);
    FILE *out = fopen(argv[2], "wb");
    if (!out) return 1;
    struct jpeg_compress_struct c;
    struct jpeg_error_mgr jerr;
    c.err = jpeg_std_error(&jerr);
    jpeg_create_compress(&c);
    jpeg_stdio_dest(&c, out);
    c.image_width = w;
    c.image_height = h;
    c.input_components = nc;
    c.in_color_space = cs(argv[6]);
    jpeg_set_defaults(&c);
    jpeg_set_colorspace(&c, cs(argv[7]));
    if (adobe >= 0) c.write_Adobe_marker = adobe;
    jpeg_set_quality(&c, atoi(argv[8]), TRUE);
    if (strcmp(argv[9], "-")) {               /* "h0xv0,h1xv1,..." */
        const char *p = argv[9];
        for (int ci = 0; ci < c.num_components && *p; ci++) {
            int hs, vs, used;
            if (sscanf(p, "%dx%d%n", &hs, &vs, &used) != 2) return 2;
            c.comp_info[ci].h_samp_factor = hs;
            c.comp_info[ci].v_samp_factor = vs;
            p += used;
            if (*p == ',') p++;
        }
    }
    c.arith_code = arith ? TRUE : FALSE;
    c.restart_in_rows = restart;
    c.dct_method = JDCT_ISLOW;
    if (prog == 1) {
        jpeg_simple_progression(&c);
    } else if (prog >= 2) {
        /* Many valid scans: one interleaved DC scan, then every AC coefficient of
         * every component in a scan of its own, refined bit by bit from
         * Al = prog - 2 down to 0: 1 + 63 * ncomp * (prog - 1) scans. */
        int al = prog - 2, ncomp = c.num_components;
        int nscans = 1 + 63 * ncomp * (al + 1);
        jpeg_scan_info *s = calloc(nscans, sizeof *s), *q = s;
        q->comps_in_scan = ncomp;
        for (int ci = 0; ci < ncomp; ci++) q->component_index[ci] = ci;
        q++;
        for (int ci = 0; ci < ncomp; ci++)
            for (int k = 1; k < 64; k++)
                for (int bit = al; bit >= 0; bit--, q++) {
                    q->comps_in_scan = 1;
                    q->component_index[0] = ci;
                    q->Ss = q->Se = k;
                    q->Ah = bit == al ? 0 : bit + 1;
                    q->Al = bit;
                }
        c.scan_info = s;
        c.num_scans = nscans;
    }
    jpeg_start_compress(&c, TRUE);
    while (c.next_scanline < c.image_height) {
        JSAMPROW row = px + (size_t)c.next_scanline * w * nc;
        jpeg_write_scanlines(&c, &row, 1);
    }
    jpeg_finish_compress(&c);
    jpeg_destroy_compress(&c);
    fclose(out);
    return 0;
}
