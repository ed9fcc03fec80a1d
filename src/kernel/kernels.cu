// The CUDA kernels of the GPU backend (loaded by echo_native/cuda.py through NVRTC).
//
// The same text is also built by the host C++ compiler: in the tests
// (tests/cuda_host.cpp maps the CUDA keywords and runs the grid in loops), so
// that every kernel is checked on the CPU against the NumPy and native paths
// even where no GPU is present, and in the package, where the augmentation
// programs' functions are the CPU path too (src/kernel/en_ops.cpp).  That is
// why the code only uses what both sides have: fixed-size integer types, float
// math from <math.h>, bit casts through __float_as_uint (an intrinsic on the
// device, memcpy on the host) and integer atomicAdd (a plain add where threads
// run one at a time).  Neither side fuses a multiply and an add on its own:
// NVRTC runs with --fmad=false (NVRTC_OPTIONS in cuda.py), the host builds with
// -ffp-contract=off, so the only fused operation is the fmaf written in
// normalize and both sides round alike.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// Pillow's bilinear filter, support 1, stretched by the shrink factor.
__device__ __forceinline__ float tri(float x) {
    x = fabsf(x);
    return x < 1.0f ? 1.0f - x : 0.0f;
}

// Re-augmentation of echoed canvases: for batch item b crop
// boxes[b] = (top, left, height, width) out of canvas entries[b] of the echo
// buffer, resize it to out_h x out_w with Pillow's antialiased bilinear
// filter, mirror it when flips[b], and write uint8 RGB.
//
// The grid is one-dimensional: each item has ceil(out_h * out_w / blockDim.x)
// consecutive blocks of blockIdx.x.  (The batch is not put on gridDim.y, which
// stops at 65,535; gridDim.x goes to 2^31 - 1.)
//
// One thread per output pixel computes its own weights over its filter
// window.  That is one weighted sum in float, rounded once, where Pillow
// rounds between its horizontal and vertical passes: the two agree within
// 1-2 levels.  The window bounds are computed in double because boxes are
// fractional and canvases can be a few thousand pixels wide; the weights
// only need float.
extern "C" __global__ void crop_resize(
        const u8* __restrict__ pixels, i64 entry_bytes,
        const i64* __restrict__ entries, const int* __restrict__ shapes,
        const double* __restrict__ boxes, const u8* __restrict__ flips,
        int out_h, int out_w, u8* __restrict__ out) {
    const int per_item = (out_h * out_w + (int)blockDim.x - 1) / (int)blockDim.x;
    const int b = (int)blockIdx.x / per_item;
    const int idx = ((int)blockIdx.x - b * per_item) * (int)blockDim.x + (int)threadIdx.x;
    if (idx >= out_h * out_w) return;
    const int oy = idx / out_w, ox = idx - oy * out_w;
    const u8* src = pixels + entries[b] * entry_bytes;
    const int h = shapes[2 * b], w = shapes[2 * b + 1];
    const double sy = boxes[4 * b + 2] / out_h, sx = boxes[4 * b + 3] / out_w;
    const double fy = sy > 1.0 ? sy : 1.0, fx = sx > 1.0 ? sx : 1.0;
    const int col = flips[b] ? out_w - 1 - ox : ox;
    const double cy = boxes[4 * b] + (oy + 0.5) * sy;
    const double cx = boxes[4 * b + 1] + (col + 0.5) * sx;
    int y0 = (int)(cy - fy + 0.5), y1 = (int)(cy + fy + 0.5);
    int x0 = (int)(cx - fx + 0.5), x1 = (int)(cx + fx + 0.5);
    y0 = y0 < 0 ? 0 : y0;
    x0 = x0 < 0 ? 0 : x0;
    y1 = y1 > h ? h : y1;
    x1 = x1 > w ? w : x1;
    // Filter coordinates relative to the window start keep float precise.
    const float ify = (float)(1.0 / fy), ifx = (float)(1.0 / fx);
    const float dy = (float)(y0 - cy + 0.5), dx = (float)(x0 - cx + 0.5);
    float wxs = 0.0f;
    for (int x = x0; x < x1; x++) wxs += tri((dx + (float)(x - x0)) * ifx);
    float wys = 0.0f, r = 0.0f, g = 0.0f, bl = 0.0f;
    for (int y = y0; y < y1; y++) {
        const float wy = tri((dy + (float)(y - y0)) * ify);
        if (wy == 0.0f) continue;
        wys += wy;
        const u8* p = src + ((i64)y * w + x0) * 3;
        float rr = 0.0f, gg = 0.0f, bb = 0.0f;
        for (int x = x0; x < x1; x++, p += 3) {
            const float wx = tri((dx + (float)(x - x0)) * ifx);
            rr += wx * p[0];
            gg += wx * p[1];
            bb += wx * p[2];
        }
        r += wy * rr;
        g += wy * gg;
        bl += wy * bb;
    }
    const float norm = (wys > 0.0f && wxs > 0.0f) ? 1.0f / (wys * wxs) : 0.0f;
    u8* o = out + ((i64)b * out_h * out_w + idx) * 3;
    o[0] = (u8)fminf(fmaxf(floorf(r * norm + 0.5f), 0.0f), 255.0f);
    o[1] = (u8)fminf(fmaxf(floorf(g * norm + 0.5f), 0.0f), 255.0f);
    o[2] = (u8)fminf(fmaxf(floorf(bl * norm + 0.5f), 0.0f), 255.0f);
}

// float -> IEEE half, round to nearest even (what NumPy's astype does).
__device__ __forceinline__ u16 half_bits(float f) {
    const u32 x = __float_as_uint(f);
    const u32 sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (u16)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (a >= 0x38800000u) {                               // normal half
        const u32 rem = a & 0x1fffu;
        u32 h = (a - 0x38000000u) >> 13;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
        return (u16)(sign | h);
    }
    const u32 e = a >> 23;
    if (e < 102u) return (u16)sign;                       // below half of the smallest subnormal
    const u32 m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;
    const u32 rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
    u32 h = m >> shift;
    if (rem > halfway || (rem == halfway && (h & 1u))) h++;
    return (u16)(sign | h);
}

// float -> bfloat16, round to nearest even (what torch's .to(torch.bfloat16) does).
__device__ __forceinline__ u16 bfloat16_bits(float f) {
    const u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);  // quiet NaN
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// float32 -> bfloat16 bits, `count` values, one thread each: the last step of a
// batch mixed in float32 for bfloat16 output (the pipeline's Mix), rounded as
// normalize rounds its kind 2.
extern "C" __global__ void to_bfloat16(const float* __restrict__ src, i64 count,
                                       u16* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) out[i] = bfloat16_bits(src[i]);
}

// (x / 255 - mean) / std in one pass: x * scale[c] + shift[c] with one
// rounding (fmaf), written NHWC or NCHW as float32 (kind 0), float16 (1) or
// bfloat16 (2).  One thread per pixel of the (n, hw) NHWC uint8 input.
extern "C" __global__ void normalize(
        const u8* __restrict__ src, i64 pixels, int hw, int nchw,
        const float* __restrict__ coef, int kind, void* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pixels) return;
    const i64 b = i / hw, p = i - b * hw;
    for (int c = 0; c < 3; c++) {
        const float v = fmaf((float)src[3 * i + c], coef[c], coef[3 + c]);
        const i64 o = nchw ? (b * 3 + c) * hw + p : 3 * i + c;
        if (kind == 0) ((float*)out)[o] = v;
        else if (kind == 1) ((u16*)out)[o] = half_bits(v);
        else ((u16*)out)[o] = bfloat16_bits(v);
    }
}

// ---- per-image augmentation programs -------------------------------------------------
//
// Row b of a batch carries a program of `steps` operations: codes[b * steps + k]
// and eight float arguments args[(b * steps + k) * 8 ...].  Step k of every row
// is three launches (cuda.py, CudaDevice.augment): ops_histogram, where some
// row's op reads its image's histogram; ops_tables, where some row's op is a
// per-channel lookup table; ops_apply, from one buffer into the other, so that
// AFFINE and SHARPNESS read unmodified neighbours.  The CPU path
// (src/kernel/en_ops.cpp) runs each image's whole program with the same
// functions, one image at a time; a row's result never depends on another row,
// so the two give the same bytes.
//
// The histogram is counted with integer atomics and the tables are derived by
// one thread per (image, channel) from it: no float is ever summed in an order
// that depends on the schedule, and no launch needs shared memory or a barrier
// (the test harness runs a grid one thread at a time).
//
// Rounding: every op that makes a non-integer value computes it in float and
// rounds it half up (floor(x + 0.5)), clamped to 0 .. 255.  Pillow truncates
// in its blends, so Brightness, Contrast, Color and Sharpness sit up to one
// level above Pillow's.
//
// No fmaf, floorf, fminf or fmaxf in these kernels: a portable x86-64 build
// has no fma or round instruction, and fminf's NaN rule is not minss's, so the
// host compiler calls libm for each, which costs more than the rest of a pixel.
// Products and sums are written out (neither compiler fuses them), clamps are
// comparisons, and floors are conversions of values known to be >= 0.

#include "en_opcodes.h"  // OP_* codes and OP_ARGS, defined once

// floor(x + 0.5) clamped to 0 .. 255 (NaN -> 0): clamped first, the floor of a
// value >= 0 is its truncation.
//
// The colour ops below are templates over the value type F: float here and on
// the device, and on the host also a vector of floats (GCC's vector extension,
// src/kernel/en_ops.cpp), where the same expressions run on several pixels at
// once with the same IEEE operations, so they round alike.  Every choice is a
// select between two computed values (a ? b : c works on both types), and the
// helpers below, overloaded for the vector type before this file is included,
// are the only operations that are spelled differently.
__device__ __forceinline__ float ops_like(float, float v) { return v; }  // v, as type F
__device__ __forceinline__ float ops_trunc(float x) { return (float)(int)x; }  // x in 0 .. 2^31

template <class F>
__device__ __forceinline__ F ops_clamp_level(const F& v) {  // v + 0.5 clamped to 0 .. 255
    const F zero = ops_like(v, 0.0f), top = ops_like(v, 255.0f);
    F x = v + 0.5f;
    x = x > zero ? x : zero;
    return x < top ? x : top;
}

__device__ __forceinline__ u8 round_u8(float x) { return (u8)(int)ops_clamp_level(x); }

// The op reads its image's per-channel histogram (en_opcodes.h says which).
__device__ __forceinline__ bool op_counts(int code) {
#define EN_OP_COUNTS_(name, c, counts, maps) || (counts && code == c)
    return false EN_OP_LIST(EN_OP_COUNTS_);
#undef EN_OP_COUNTS_
}

// The op is a lookup table per channel (made by ops_table).
__device__ __forceinline__ bool op_maps(int code) {
#define EN_OP_MAPS_(name, c, counts, maps) || (maps && code == c)
    return false EN_OP_LIST(EN_OP_MAPS_);
#undef EN_OP_MAPS_
}

// ITU-R 601 luma in float, one evaluation order on both sides.
template <class F>
__device__ __forceinline__ F luma_rgb(const F& r, const F& g, const F& b) {
    return 0.299f * r + 0.587f * g + 0.114f * b;
}

__device__ __forceinline__ float luma(const u8* px) {
    return luma_rgb((float)px[0], (float)px[1], (float)px[2]);
}

// One pixel into its image's (3, 256) histogram.
__device__ __forceinline__ void ops_count(const u8* px, int* hist) {
    atomicAdd(hist + px[0], 1);
    atomicAdd(hist + 256 + px[1], 1);
    atomicAdd(hist + 512 + px[2], 1);
}

// The mean luma of an image from its exact integer channel sums s[3], one double
// expression, so the value cannot depend on how the pixels were counted (the
// host sums the channels directly, the device reads them off the histogram).
__device__ __forceinline__ float ops_mean_of_sums(const i64* s, i64 hw) {
    const double m = 0.299 * (double)s[0] + 0.587 * (double)s[1] + 0.114 * (double)s[2];
    return (float)(m / (double)hw);
}

// The mean luma of an image from its histogram.
__device__ __forceinline__ float ops_mean(const int* hist, i64 hw) {
    i64 s[3] = {0, 0, 0};
    for (int c = 0; c < 3; c++)
        for (int v = 1; v < 256; v++) s[c] += (i64)v * hist[256 * c + v];
    return ops_mean_of_sums(s, hw);
}

// ImageEnhance.Contrast's table about the mean luma m.
__device__ __forceinline__ void ops_contrast_table(float f, float m, u8* lut) {
    for (int v = 0; v < 256; v++) lut[v] = round_u8(m + f * ((float)v - m));
}

// The 256-entry lookup table of channel c for a table op with arguments a,
// from the image's histogram (ops that count) of hw pixels.
__device__ __forceinline__ void ops_table(int code, const float* a, const int* hist, i64 hw,
                                          int c, u8* lut) {
    const int* h = hist + 256 * c;
    if (code == OP_BRIGHTNESS) {
        const float f = a[0];
        for (int v = 0; v < 256; v++) lut[v] = round_u8((float)v * f);
    } else if (code == OP_CONTRAST) {
        ops_contrast_table(a[0], ops_mean(hist, hw), lut);
    } else if (code == OP_POSTERIZE) {
        // Bits outside 1 .. 8 are refused by the bindings; clamped here so that a
        // bad argument can never shift out of range.
        const int bits = a[0] >= 8.0f ? 8 : a[0] >= 1.0f ? (int)a[0] : 1;
        const int mask = (0xff << (8 - bits)) & 0xff;
        for (int v = 0; v < 256; v++) lut[v] = (u8)(v & mask);
    } else if (code == OP_SOLARIZE) {
        const float t = a[0];
        for (int v = 0; v < 256; v++) lut[v] = (u8)((float)v >= t ? 255 - v : v);
    } else if (code == OP_AUTOCONTRAST) {
        // ImageOps.autocontrast(cutoff=0): stretch the occupied range lo .. hi.
        int lo = 0, hi = 255;
        while (lo < 256 && h[lo] == 0) lo++;
        while (hi >= 0 && h[hi] == 0) hi--;
        if (hi <= lo) {
            for (int v = 0; v < 256; v++) lut[v] = (u8)v;
        } else {
            const float scale = 255.0f / (float)(hi - lo);
            for (int v = 0; v < 256; v++) lut[v] = round_u8((float)(v - lo) * scale);
        }
    } else if (code == OP_EQUALIZE) {
        // ImageOps.equalize: integer steps over the histogram but its last occupied bin.
        int last = 255;
        while (last > 0 && h[last] == 0) last--;
        const i64 step = (hw - h[last]) / 255;
        if (step == 0) {
            for (int v = 0; v < 256; v++) lut[v] = (u8)v;
        } else {
            i64 n = step / 2;
            for (int v = 0; v < 256; v++) {
                const i64 q = n / step;
                lut[v] = (u8)(q > 255 ? 255 : q);
                n += h[v];
            }
        }
    } else {
        for (int v = 0; v < 256; v++) lut[v] = (u8)v;
    }
}

// torchvision's adjust_hue on one pixel, in the 0 .. 255 scale: RGB -> HSV,
// h = (h + shift) mod 1, back.  The hue is kept in sixths (h6 = 6 h, the HSV
// sector and the position in it), its difference of channels divided once by
// max - min; with v = max and s = (max - min) / max the HSV -> RGB corners
// v (1 - s), v (1 - s f) and v (1 - s (1 - f)) are min, max - (max - min) f
// and max - (max - min) (1 - f): no division by v.
//
// Written without branches (every choice is a select, the grey case included:
// there max - min = 0 makes every corner max, the pixel itself), so that the
// host build runs it over a row of pixels in vector registers; the device
// evaluates the same expressions, so both round alike.
template <class F>
__device__ __forceinline__ void ops_hue_rgb(const F& r, const F& g, const F& b, float shift,
                                            F* o) {
    const F zero = ops_like(r, 0.0f), one = ops_like(r, 1.0f), two = ops_like(r, 2.0f),
            four = ops_like(r, 4.0f), six = ops_like(r, 6.0f);
    F hi = r > g ? r : g, lo = r < g ? r : g;
    hi = hi > b ? hi : b;
    lo = lo < b ? lo : b;
    const F cr = hi - lo;
    const F den = cr > zero ? cr : one;  // grey: any non-zero divisor, the pixel stays
    const F gb = g - b, br = b - r, rg = r - g;
    F num = hi == g ? br : rg, base = hi == g ? two : four;
    num = hi == r ? gb : num;
    base = hi == r ? zero : base;
    F h6 = base + num / den;  // in -1 .. 5
    F up = h6 + 6.0f;
    h6 = h6 < zero ? up : h6;
    h6 = h6 + 6.0f * shift;  // -3 .. 9 for a checked shift
    up = h6 + 6.0f;
    const F down = h6 - 6.0f;
    h6 = h6 < zero ? up : h6;
    h6 = h6 >= six ? down : h6;
    // 0 <= h6 < 6 for a checked shift: truncation is the floor.  An unchecked one
    // (NaN, huge) is kept in range before any conversion to int.
    h6 = h6 < six ? h6 : zero;
    h6 = h6 > zero ? h6 : zero;
    const F f = h6 - ops_trunc(h6);
    const F q = hi - cr * f, t = hi - cr * (1.0f - f);
    // Per channel, the corner of each sector k (k <= h6 < k + 1): hi, q, lo or t.
    // (A mask per sector, each its own declaration: bool & bool is an int.)
    const F three = ops_like(r, 3.0f), five = ops_like(r, 5.0f);
    const auto s0 = h6 < one;
    const auto s1 = (h6 >= one) & (h6 < two);
    const auto s2 = (h6 >= two) & (h6 < three);
    const auto s3 = (h6 >= three) & (h6 < four);
    const auto s4 = (h6 >= four) & (h6 < five);
    const auto s5 = h6 >= five;
    F v0 = s4 ? t : lo, v1 = s3 ? q : lo, v2 = s5 ? q : lo;
    v0 = s1 ? q : v0;
    v1 = s0 ? t : v1;
    v2 = s2 ? t : v2;
    o[0] = (s0 | s5) ? hi : v0;
    o[1] = (s1 | s2) ? hi : v1;
    o[2] = (s3 | s4) ? hi : v2;
}

__device__ __forceinline__ void ops_hue(const u8* px, float shift, u8* o) {
    float v[3];
    ops_hue_rgb((float)px[0], (float)px[1], (float)px[2], shift, v);
    o[0] = round_u8(v[0]);
    o[1] = round_u8(v[1]);
    o[2] = round_u8(v[2]);
}

// ImageEnhance.Color (saturation) of one channel value v of a pixel of luma g.
template <class F>
__device__ __forceinline__ F ops_saturate(const F& v, const F& g, float f) {
    return g + f * (v - g);
}

// Output pixel (y, x) of an h x w image after op `code` with arguments a:
// read from img, write to out (another buffer), lut = the image's (3, 256)
// tables for table ops.
// img and out are different buffers (every step is out of place): __restrict__
// lets the host build keep a pixel's channels in registers across the stores.
__device__ __forceinline__ void ops_pixel(int code, const float* a,
                                          const u8* __restrict__ img, u8* __restrict__ out,
                                          const u8* lut, int h, int w, int y, int x) {
    const i64 p = (i64)y * w + x;
    const u8* s = img + 3 * p;
    u8* o = out + 3 * p;
    if (op_maps(code)) {
        o[0] = lut[s[0]];
        o[1] = lut[256 + s[1]];
        o[2] = lut[512 + s[2]];
    } else if (code == OP_SATURATION) {
        const float f = a[0], g = luma(s);
        for (int c = 0; c < 3; c++) o[c] = round_u8(ops_saturate((float)s[c], g, f));
    } else if (code == OP_HUE) {
        ops_hue(s, a[0], o);
    } else if (code == OP_GRAYSCALE) {
        const u8 g = round_u8(luma(s));
        o[0] = o[1] = o[2] = g;
    } else if (code == OP_ERASE) {
        // a = (top, left, height, width, r, g, b): compared in float, so a
        // rectangle reaching past the image is clipped without ever indexing.
        const float fy = (float)y, fx = (float)x;
        if (fy >= a[0] && fy < a[0] + a[2] && fx >= a[1] && fx < a[1] + a[3]) {
            o[0] = round_u8(a[4]);
            o[1] = round_u8(a[5]);
            o[2] = round_u8(a[6]);
        } else {
            o[0] = s[0];
            o[1] = s[1];
            o[2] = s[2];
        }
    } else if (code == OP_SHARPNESS) {
        // ImageEnhance.Sharpness: blend with Pillow's SMOOTH (3x3, centre 5, /13,
        // rounded; the border is its own smooth image).  13 is odd: the integer
        // rounding (sum + 6) / 13 never meets a tie.
        if (y == 0 || x == 0 || y == h - 1 || x == w - 1) {
            o[0] = s[0];
            o[1] = s[1];
            o[2] = s[2];
            return;
        }
        const i64 row = 3 * (i64)w;
        const float f = a[0];
        for (int c = 0; c < 3; c++) {
            const u8* q = s + c;
            const int sum = q[-row - 3] + q[-row] + q[-row + 3] + q[-3] + 5 * q[0] + q[3] +
                            q[row - 3] + q[row] + q[row + 3];
            const int d = (sum + 6) / 13;
            o[c] = round_u8((float)d + f * (float)(q[0] - d));
        }
    } else if (code == OP_AFFINE) {
        // Image.transform(AFFINE, (a0 .. a5), NEAREST): the output pixel centre maps
        // to source (sx, sy); the pixel there, or fill a6 outside the image.  The
        // range test comes before any conversion to int (NaN fails it too).
        const float xc = (float)x + 0.5f, yc = (float)y + 0.5f;
        const float sx = a[0] * xc + a[1] * yc + a[2];
        const float sy = a[3] * xc + a[4] * yc + a[5];
        if (sx >= 0.0f && sx < (float)w && sy >= 0.0f && sy < (float)h) {
            int xi = (int)sx, yi = (int)sy;
            xi = xi < w ? xi : w - 1;
            yi = yi < h ? yi : h - 1;
            const u8* q = img + 3 * ((i64)yi * w + xi);
            o[0] = q[0];
            o[1] = q[1];
            o[2] = q[2];
        } else {
            o[0] = o[1] = o[2] = round_u8(a[6]);
        }
    } else {  // OP_NONE
        o[0] = s[0];
        o[1] = s[1];
        o[2] = s[2];
    }
}

// Step k, histograms: one thread per pixel of the (n, hw) batch; rows whose op
// counts add their pixel to hist[b] (zeroed before the launch).
extern "C" __global__ void ops_histogram(
        const u8* __restrict__ src, i64 pixels, int hw, const int* __restrict__ codes,
        int steps, int k, int* __restrict__ hist) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pixels) return;
    const i64 b = i / hw;
    if (!op_counts(codes[b * steps + k])) return;
    ops_count(src + 3 * i, hist + 768 * b);
}

// Step k, tables: one thread per (image, channel) of the n images.
extern "C" __global__ void ops_tables(
        const int* __restrict__ codes, const float* __restrict__ args, int steps, int k,
        i64 n, int hw, const int* __restrict__ hist, u8* __restrict__ luts) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= 3 * n) return;
    const i64 b = t / 3, row = b * steps + k;
    const int code = codes[row];
    if (!op_maps(code)) return;
    ops_table(code, args + OP_ARGS * row, hist + 768 * b, hw, (int)(t - 3 * b), luts + 256 * t);
}

// Step k, pixels: one thread per output pixel, src -> dst.
extern "C" __global__ void ops_apply(
        const u8* __restrict__ src, u8* __restrict__ dst, i64 pixels, int h, int w,
        const int* __restrict__ codes, const float* __restrict__ args, int steps, int k,
        const u8* __restrict__ luts) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pixels) return;
    const i64 hw = (i64)h * w, b = i / hw, p = i - b * hw;
    const int y = (int)(p / w), x = (int)(p - (i64)y * w);
    const i64 row = b * steps + k;
    ops_pixel(codes[row], args + OP_ARGS * row, src + 3 * hw * b, dst + 3 * hw * b,
              luts + 768 * b, h, w, y, x);
}
