// The augmentation programs of echo_native/backends/kernels.cu on the CPU.
//
// kernels.cu is included as it is: the CUDA keywords become plain C++, and
// instead of walking a launch grid each image runs its whole program here,
// one op over all of its pixels at a time, through the same device functions
// (ops_count, ops_table, ops_pixel) the kernels call.  A row never reads
// another row, so the bytes are those of the GPU's step-by-step launches
// (tests/test_cuda_kernels.py compares them with the emulated launches).
// Built with -ffp-contract=off (setup.py): no multiply and add is fused
// beyond the fmaf the source writes, as NVRTC's --fmad=false on the device.
#include "en_ops.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define __global__
#define __device__
#define __forceinline__ inline __attribute__((always_inline))

// The grid variables of the __global__ kernels, which this file compiles (hidden,
// -fvisibility=hidden) but never calls.
namespace {
struct dim3_ { unsigned x, y, z; };
const dim3_ blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1};

inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}

// One image at a time, on one thread: a plain increment is the atomic.
inline int atomicAdd(int* p, int v) {
    const int old = *p;
    *p += v;
    return old;
}
}  // namespace

#include "kernels.cu"

namespace {

const char* const OP_NAMES[OP_COUNT] = {
    "NONE", "BRIGHTNESS", "CONTRAST", "SATURATION", "HUE", "GRAYSCALE", "ERASE",
    "SHARPNESS", "POSTERIZE", "SOLARIZE", "AUTOCONTRAST", "EQUALIZE", "AFFINE"};

// One op over every pixel of an image; Code is a constant, so the compiler
// drops ops_pixel's dispatch from the loop.
template <int Code>
void apply_image(const float* a, const u8* __restrict__ src, u8* __restrict__ dst,
                 const u8* __restrict__ lut, int h, int w) {
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) ops_pixel(Code, a, src, dst, lut, h, w, y, x);
}

void apply_op(int code, const float* a, const u8* src, u8* dst, const u8* lut, int h, int w) {
    switch (code) {
        case OP_BRIGHTNESS:  // every table op is one loop: a lookup per channel
        case OP_CONTRAST:
        case OP_POSTERIZE:
        case OP_SOLARIZE:
        case OP_AUTOCONTRAST:
        case OP_EQUALIZE: apply_image<OP_BRIGHTNESS>(a, src, dst, lut, h, w); break;
        case OP_SATURATION: apply_image<OP_SATURATION>(a, src, dst, lut, h, w); break;
        case OP_HUE: apply_image<OP_HUE>(a, src, dst, lut, h, w); break;
        case OP_GRAYSCALE: apply_image<OP_GRAYSCALE>(a, src, dst, lut, h, w); break;
        case OP_ERASE: apply_image<OP_ERASE>(a, src, dst, lut, h, w); break;
        case OP_SHARPNESS: apply_image<OP_SHARPNESS>(a, src, dst, lut, h, w); break;
        case OP_AFFINE: apply_image<OP_AFFINE>(a, src, dst, lut, h, w); break;
        default: apply_image<OP_NONE>(a, src, dst, lut, h, w); break;
    }
}

// Whole numbers up to 2^24 are exact in float, and so are their sums.
const float EXACT = 16777216.0f;

bool whole(float v) { return isfinite(v) && floorf(v) == v && fabsf(v) <= EXACT; }
bool level(float v) { return v >= 0.0f && v <= 255.0f; }  // false for NaN

// Why the arguments a of op `code` are refused, or NULL.
const char* refusal(int code, const float* a, int* which) {
    *which = 0;
    switch (code) {
        case OP_BRIGHTNESS:
        case OP_CONTRAST:
        case OP_SATURATION:
        case OP_SHARPNESS:
            return isfinite(a[0]) && a[0] >= 0.0f ? NULL : "factor must be finite and >= 0";
        case OP_HUE:
            return a[0] >= -0.5f && a[0] <= 0.5f ? NULL : "hue shift must be in -0.5 .. 0.5";
        case OP_ERASE:
            for (*which = 0; *which < 4; (*which)++)
                if (!whole(a[*which]))
                    return "top, left, height and width must be whole numbers within "
                           "+-2^24";
            for (*which = 2; *which < 4; (*which)++)
                if (a[*which] < 0.0f) return "height and width must be >= 0";
            for (*which = 4; *which < 7; (*which)++)
                if (!level(a[*which])) return "fill must be in 0 .. 255";
            return NULL;
        case OP_POSTERIZE:
            return whole(a[0]) && a[0] >= 1.0f && a[0] <= 8.0f
                       ? NULL : "bits must be a whole number in 1 .. 8";
        case OP_SOLARIZE:
            return isfinite(a[0]) ? NULL : "threshold must be finite";
        case OP_AFFINE:
            for (*which = 0; *which < 6; (*which)++)
                if (!isfinite(a[*which])) return "the map's coefficients must be finite";
            *which = 6;
            return level(a[6]) ? NULL : "fill must be in 0 .. 255";
        default:
            return NULL;
    }
}

}  // namespace

extern "C" int en_op_count(void) { return OP_COUNT; }

extern "C" const char* en_op_name(int code) {
    return code >= 0 && code < OP_COUNT ? OP_NAMES[code] : NULL;
}

extern "C" int en_ops_check(const int32_t* codes, const float* args, int64_t n, int steps,
                            int h, int w, char* msg, size_t cap) {
    // Histogram counts are int: an image holds fewer than 2^31 pixels.
    if (h < 1 || w < 1 || h > 65535 || w > 65535 || (int64_t)h * w >= ((int64_t)1 << 31)) {
        snprintf(msg, cap, "images must be 1 .. 65535 pixels high and wide with fewer than "
                 "2^31 pixels, got %d x %d", h, w);
        return -1;
    }
    for (int64_t b = 0; b < n; b++)
        for (int k = 0; k < steps; k++) {
            const int code = codes[b * steps + k];
            const float* a = args + (b * steps + k) * EN_OP_ARGS;
            if (code < 0 || code >= OP_COUNT) {
                snprintf(msg, cap, "row %lld, step %d: op code %d is not one of 0 .. %d",
                         (long long)b, k, code, OP_COUNT - 1);
                return -1;
            }
            int which;
            const char* why = refusal(code, a, &which);
            if (why) {
                snprintf(msg, cap, "row %lld, step %d: %s %s, got args[%d] = %g", (long long)b,
                         k, OP_NAMES[code], why, which, (double)a[which]);
                return -1;
            }
        }
    return 0;
}

extern "C" void en_ops_apply(uint8_t* images, int64_t n, int h, int w, const int32_t* codes,
                             const float* args, int steps, uint8_t* scratch) {
    const i64 hw = (i64)h * w;
    int hist[768];
    u8 lut[768];
    for (int64_t b = 0; b < n; b++) {
        u8* image = images + 3 * hw * b;
        u8 *cur = image, *other = scratch;
        for (int k = 0; k < steps; k++) {
            const int code = codes[b * steps + k];
            const float* a = args + (b * steps + k) * EN_OP_ARGS;
            if (code == OP_NONE) continue;  // what a copy would give
            if (op_counts(code)) {
                memset(hist, 0, sizeof hist);
                for (i64 p = 0; p < hw; p++) ops_count(cur + 3 * p, hist);
            }
            if (op_maps(code))
                for (int c = 0; c < 3; c++) ops_table(code, a, hist, hw, c, lut + 256 * c);
            apply_op(code, a, cur, other, lut, h, w);
            u8* t = cur;
            cur = other;
            other = t;
        }
        if (cur != image) memcpy(image, cur, (size_t)(3 * hw));
    }
}
