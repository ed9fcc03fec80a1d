// Runs src/kernel/kernels.cu on the CPU: the CUDA keywords become plain C++,
// and each launch walks its grid in loops, one "thread" at a time.  The
// kernels are written so that this is the same arithmetic as on the device
// (explicit fmaf, no fast-math, no contraction: -ffp-contract=off here, --fmad=false
// in NVRTC), which tests/test_cuda_kernels.py checks
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

// Threads run one at a time: a plain increment is the atomic.
static inline int atomicAdd(int* p, int v) {
    const int old = *p;
    *p += v;
    return old;
}

#include "kernels.cu"

// CUDA's limits on a launch (gridDim.x, gridDim.y, threads per block): a launch
// beyond them fails on the device, so it fails here too (returns nonzero).
static const unsigned long long MAX_GRID_X = 2147483647ull, MAX_GRID_Y = 65535ull,
                                MAX_BLOCK = 1024ull;

template <typename Kernel>
static int launch(unsigned long long gx, unsigned long long gy, unsigned long long bx,
                  Kernel kernel) {
    if (gx < 1 || gx > MAX_GRID_X || gy < 1 || gy > MAX_GRID_Y || bx < 1 || bx > MAX_BLOCK)
        return 1;  // cudaErrorInvalidValue
    gridDim = {(unsigned)gx, (unsigned)gy, 1};
    blockDim = {(unsigned)bx, 1, 1};
    for (unsigned y = 0; y < gy; y++)
        for (unsigned x = 0; x < gx; x++)
            for (unsigned t = 0; t < bx; t++) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                kernel();
            }
    return 0;
}

// Every kernel's launcher takes the launch (gridDim.x, gridDim.y, blockDim.x) and then
// the kernel's own parameters, in order: tests/fake_cupy.py calls host_<kernel> with
// the arguments of a launch as it finds them in the kernel's signature.
extern "C" int host_crop_resize(unsigned long long gx, unsigned long long gy,
                                unsigned long long bx, const u8* pixels, i64 entry_bytes,
                                const i64* entries, const int* shapes, const double* boxes,
                                const u8* flips, int out_h, int out_w, u8* out) {
    return launch(gx, gy, bx, [&] {
        crop_resize(pixels, entry_bytes, entries, shapes, boxes, flips, out_h, out_w, out);
    });
}

extern "C" int host_normalize(unsigned long long gx, unsigned long long gy,
                              unsigned long long bx, const u8* src, i64 pixels, int hw,
                              int nchw, const float* coef, int kind, void* out) {
    return launch(gx, gy, bx, [&] { normalize(src, pixels, hw, nchw, coef, kind, out); });
}

extern "C" int host_to_bfloat16(unsigned long long gx, unsigned long long gy,
                                unsigned long long bx, const float* src, i64 count, u16* out) {
    return launch(gx, gy, bx, [&] { to_bfloat16(src, count, out); });
}

extern "C" int host_ops_histogram(unsigned long long gx, unsigned long long gy,
                                  unsigned long long bx, const u8* src, i64 pixels, int hw,
                                  const int* codes, int steps, int k, int* hist) {
    return launch(gx, gy, bx, [&] { ops_histogram(src, pixels, hw, codes, steps, k, hist); });
}

extern "C" int host_ops_tables(unsigned long long gx, unsigned long long gy,
                               unsigned long long bx, const int* codes, const float* args,
                               int steps, int k, i64 n, int hw, const int* hist, u8* luts) {
    return launch(gx, gy, bx, [&] { ops_tables(codes, args, steps, k, n, hw, hist, luts); });
}

extern "C" int host_ops_apply(unsigned long long gx, unsigned long long gy,
                              unsigned long long bx, const u8* src, u8* dst, i64 pixels, int h,
                              int w, const int* codes, const float* args, int steps, int k,
                              const u8* luts) {
    return launch(gx, gy, bx, [&] {
        ops_apply(src, dst, pixels, h, w, codes, args, steps, k, luts);
    });
}

extern "C" void host_half_array(const float* in, u16* out, i64 n) {
    for (i64 i = 0; i < n; i++) out[i] = half_bits(in[i]);
}

extern "C" void host_bfloat16_array(const float* in, u16* out, i64 n) {
    for (i64 i = 0; i < n; i++) out[i] = bfloat16_bits(in[i]);
}
