// The CUDA kernels of the GPU backend (loaded by echo_native/cuda.py through NVRTC).
//
// The same text is also built by the host C++ compiler in the tests
// (tests/cuda_host.h maps the CUDA keywords and runs the grid in loops), so
// that every kernel is checked on the CPU against the NumPy and native paths
// even where no GPU is present.  That is why the code only uses what both
// sides have: fixed-size integer types, float math from <math.h> and bit
// casts through __float_as_uint (an intrinsic on the device, memcpy on the host).
// Neither side fuses a multiply and an add on its own: NVRTC runs with
// --fmad=false (NVRTC_OPTIONS in cuda.py), the host build with
// -ffp-contract=off, so the only fused operation is the fmaf written below and
// both sides round alike.

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
