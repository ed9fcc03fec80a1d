/*
 * Per-image augmentation programs on the CPU: kernels.cu (the CUDA kernels'
 * arithmetic) built for the host, so that both devices compute every op with
 * the same source.  Never includes Python.h.
 *
 * A batch is n images of h x w RGB uint8, C-contiguous; row b runs `steps`
 * ops: codes[b * steps + k], arguments args[(b * steps + k) * OP_ARGS ...].
 * The op codes and their arguments: en_opcodes.h.
 */
#ifndef EN_OPS_H
#define EN_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "en_opcodes.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of op codes (codes are 0 .. en_op_count() - 1), their names, and whether an
 * op reads its image's histogram / is a lookup table per channel (en_opcodes.h). */
int en_op_count(void);
const char *en_op_name(int code);
int en_op_counts(int code);
int en_op_maps(int code);

/* The CUDA source of kernels.cu with en_opcodes.h in place: what NVRTC compiles on a
 * GPU, the same text this library's CPU path is built from. */
const char *en_cuda_source(void);

/* 0 when every code and argument is valid for an h x w image; else -1 and the
 * first bad (row, step) with its value in msg. */
int en_ops_check(const int32_t *codes, const float *args, int64_t n, int steps, int h, int w,
                 char *msg, size_t cap);

/* Run the programs in place, image after image.  scratch holds h * w * 3 bytes.
 * Call en_ops_check first: this one never fails and never reads outside the
 * images whatever the arguments, but only checked ones mean anything. */
void en_ops_apply(uint8_t *images, int64_t n, int h, int w, const int32_t *codes,
                  const float *args, int steps, uint8_t *scratch);

#ifdef __cplusplus
}
#endif
#endif
