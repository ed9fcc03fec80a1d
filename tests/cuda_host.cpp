// Runs echo_native/backends/kernels.cu on the CPU: the CUDA keywords become plain C++,
// and each launch walks its grid in loops, one "thread" at a time.  The
// kernels are written so that this is the same arithmetic as on the device
// (explicit fmaf, no fast-math), which tests/test_cuda_kernels.py checks
// against the NumPy and native paths.
#include <math.h>
#include <string.h>

struct uint3_ { unsigned x, y, z; };
static uint3_ blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline

static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}

#include "kernels.cu"

template <typename Kernel>
static void launch(unsigned gx, unsigned gy, unsigned bx, Kernel kernel) {
    gridDim = {gx, gy, 1};
    blockDim = {bx, 1, 1};
    for (unsigned y = 0; y < gy; y++)
        for (unsigned x = 0; x < gx; x++)
            for (unsigned t = 0; t < bx; t++) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                kernel();
            }
}

extern "C" void host_crop_resize(unsigned gx, unsigned gy, unsigned bx, const u8* pixels,
                                 i64 entry_bytes, const i64* entries, const int* shapes,
                                 const double* boxes, const u8* flips, int out_h, int out_w,
                                 u8* out) {
    launch(gx, gy, bx, [&] {
        crop_resize(pixels, entry_bytes, entries, shapes, boxes, flips, out_h, out_w, out);
    });
}

extern "C" void host_normalize(unsigned gx, unsigned bx, const u8* src, i64 pixels, int hw,
                               int nchw, const float* coef, int kind, void* out) {
    launch(gx, 1, bx, [&] { normalize(src, pixels, hw, nchw, coef, kind, out); });
}

extern "C" void host_half_array(const float* in, u16* out, i64 n) {
    for (i64 i = 0; i < n; i++) out[i] = half_bits(in[i]);
}

extern "C" void host_bfloat16_array(const float* in, u16* out, i64 n) {
    for (i64 i = 0; i < n; i++) out[i] = bfloat16_bits(in[i]);
}
