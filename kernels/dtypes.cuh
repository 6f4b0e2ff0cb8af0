// The storage dtypes of the kernels, shared by ops.cu and dequant.cu: f32, and bf16 and f16 held
// as their bits; `to_f32` widens a value exactly, `store` rounds an f32 to the dtype to nearest
// even, so that every kernel writing a dtype rounds as the CPU's emulated bf16/f16 do. Forced
// inline: the dequantization kernels round every value through `store` in registers.

#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef float f32;

struct bf16 {
    u16 bits;
};
struct f16 {
    u16 bits;
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float((u32)x.bits << 16); }
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

__device__ __forceinline__ void store(float* out, float v) { *out = v; }
__device__ __forceinline__ void store(bf16* out, float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        out->bits = (u16)((u >> 16) | 0x40);  // NaN stays a quiet NaN
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    out->bits = (u16)(u >> 16);
}
__device__ __forceinline__ void store(f16* out, float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    out->bits = h;
}
