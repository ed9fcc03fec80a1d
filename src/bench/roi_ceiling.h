#ifndef EN_ROI_CEILING_H
#define EN_ROI_CEILING_H

/* What roi_decode_only does after skipping to the crop's first row. */
enum roi_mode {
    ROI_RGB = 0,     /* read the crop's rows as RGB, stop after the last (the ceiling) */
    ROI_YCC = 1,     /* the same in YCbCr; libjpeg then interleaves the planes in a C
                        loop, which costs about what its SIMD colour conversion does,
                        so this does not time the conversion by difference */
    ROI_ENTROPY = 2, /* skip the crop's rows too: entropy decoding, no IDCT or colour */
    ROI_FINISH = 3,  /* ROI_RGB, then decode to the end of the file and check for warnings */
    ROI_STORE = 4,   /* ROI_RGB, keeping every row: the crop stored in `scratch`, as a
                        decoder that returns it does (the others reuse one row) */
};

/* Decode rows/cols of a crop at 1/denom scale; returns rows decoded, or < 0:
 * -1 libjpeg failed, -2 `scratch` is too small (*need: the bytes it takes),
 * -3 (ROI_FINISH) warnings. */
int roi_decode_only(const unsigned char *data, unsigned long len, int top, int left, int height,
                    int width, int denom, int mode, unsigned char *scratch,
                    unsigned long scratch_cap, unsigned long *need);
#endif
