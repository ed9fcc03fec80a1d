#ifndef EN_ROI_CEILING_H
#define EN_ROI_CEILING_H
/* Decode rows/cols of a crop at 1/denom scale; returns rows decoded or < 0. */
int roi_decode_only(const unsigned char *data, unsigned long len, int top, int left, int height,
                    int width, int denom, unsigned char *scratch, unsigned long scratch_cap);
#endif
