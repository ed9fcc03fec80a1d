/*
 * Per-image augmentation programs on the CPU: echo_native/backends/kernels.cu
 * (the CUDA kernels' arithmetic) built for the host, so that both devices
 * compute every op with the same source.  Never includes Python.h.
 *
 * A batch is n images of h x w RGB uint8, C-contiguous; row b runs `steps`
 * ops: codes[b * steps + k], arguments args[(b * steps + k) * EN_OP_ARGS ...].
 * The op codes and their arguments are listed in kernels.cu and
 * echo_native/backends/ops_codes.py.
 */
#ifndef EN_OPS_H
#define EN_OPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EN_OP_ARGS 8

/* Number of op codes (codes are 0 .. en_op_count() - 1) and their names. */
int en_op_count(void);
const char *en_op_name(int code);

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
