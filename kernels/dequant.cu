// GGUF blocks to f32 on the GPU, one thread per output element. Every product and difference is
// rounded on its own (__fmul_rn, __fsub_rn; the program is also compiled with --fmad=false), in
// the order glmcheck's CPU dequantizers use, so that the f32 results are bit-identical to them.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef unsigned long long usize;

// IEEE half bits to float, exactly (subnormals, infinities and NaN included).
__device__ float half_to_float(u16 h) {
    unsigned int sign = (unsigned int)(h & 0x8000) << 16;
    unsigned int exp = (h >> 10) & 0x1f;
    unsigned int man = h & 0x3ff;
    unsigned int bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        // Subnormal: normalise the mantissa.
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400) == 0);
        bits = sign | ((unsigned int)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    return __uint_as_float(bits);
}

// The output element of this thread (32-bit index arithmetic: a launch covers fewer than 2^32
// values; byte offsets are 64-bit), returning when it is past the end.
#define ELEMENT(e, n)                                         \
    unsigned int e = blockIdx.x * blockDim.x + threadIdx.x; \
    if (e >= n) return

__device__ float half_at(const u8* b, usize at) {
    return half_to_float((u16)b[at] | ((u16)b[at + 1] << 8));
}

// The 4-bit code of element i (of 32) from 16 bytes q: element i low, i + 16 high.
__device__ int nibble32(const u8* q, int i) {
    return i < 16 ? (q[i] & 0x0f) : (q[i - 16] >> 4);
}

extern "C" __global__ void dq_f32(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)4 * e;
    dst[e] = __uint_as_float((unsigned int)b[0] | ((unsigned int)b[1] << 8) |
                             ((unsigned int)b[2] << 16) | ((unsigned int)b[3] << 24));
}

extern "C" __global__ void dq_f16(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    dst[e] = half_at(src, (usize)2 * e);
}

extern "C" __global__ void dq_bf16(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    usize at = (usize)2 * e;
    unsigned int bits = (unsigned int)src[at] | ((unsigned int)src[at + 1] << 8);
    dst[e] = __uint_as_float(bits << 16);
}

// Q8_0: 34-byte blocks of 32: f16 d, 32 int8 q; d * q.
extern "C" __global__ void dq_q8_0(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)34 * (e / 32);
    dst[e] = __fmul_rn(half_at(b, 0), (float)(signed char)b[2 + e % 32]);
}

// Q4_0: 18-byte blocks of 32: f16 d, 16 bytes of nibbles (element i low, i + 16 high); d * (q - 8).
extern "C" __global__ void dq_q4_0(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)18 * (e / 32);
    int i = e % 32;
    int q = nibble32(b + 2, i);
    dst[e] = __fmul_rn(half_at(b, 0), (float)(q - 8));
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block's 12 packed bytes.
__device__ void scale_min(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 0x3f;
        *m = s[j + 4] & 0x3f;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

// Code q of sub-block j of a Q4_K/Q5_K block b: d * scale * q - dmin * min.
__device__ float k_scaled(const u8* b, int j, int q) {
    int sc, m;
    scale_min(b + 4, j, &sc, &m);
    float dl = __fmul_rn(half_at(b, 0), (float)sc);
    float ml = __fmul_rn(half_at(b, 2), (float)m);
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

// Q4_K: 144-byte blocks of 256: f16 d, f16 dmin, 12 bytes of scales and mins, then 4 chunks of
// 32 bytes holding 64 elements each (sub-block 2c in the low nibbles, 2c + 1 in the high).
extern "C" __global__ void dq_q4_k(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)144 * (e / 256);
    int k = e % 256, c = k / 64, half = (k % 64) / 32, i = k % 32;
    u8 byte = b[16 + 32 * c + i];
    dst[e] = k_scaled(b, 2 * c + half, half ? (byte >> 4) : (byte & 0x0f));
}

// Q6_K: 210-byte blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
// scales, f16 d; per half of 128, four rows of 32.
extern "C" __global__ void dq_q6_k(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)210 * (e / 256);
    int k = e % 256, h = k / 128, r = (k % 128) / 32, i = k % 32;
    int low = (b[64 * h + 32 * (r % 2) + i] >> (4 * (r / 2))) & 0x0f;
    int high = (b[128 + 32 * h + i] >> (2 * r)) & 3;
    int q = low | (high << 4);
    float dl = __fmul_rn(half_at(b, 208), (float)(signed char)b[192 + 8 * h + 2 * r + i / 16]);
    dst[e] = __fmul_rn(dl, (float)(q - 32));
}

// Q5_0: 22-byte blocks of 32: f16 d, a u32 of fifth bits (bit i for element i), 16 bytes of low
// nibbles; d * (q - 16).
extern "C" __global__ void dq_q5_0(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)22 * (e / 32);
    int i = e % 32;
    int low = nibble32(b + 6, i);
    int fifth = (b[2 + i / 8] >> (i % 8)) & 1;
    dst[e] = __fmul_rn(half_at(b, 0), (float)((low | (fifth << 4)) - 16));
}

// Q2_K: 84-byte blocks of 256: 16 bytes of 4-bit scale (low) and min (high), 64 bytes of 2-bit
// codes (per 128 elements, 32 bytes: row r at bits 2r), f16 d, f16 dmin.
extern "C" __global__ void dq_q2_k(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)84 * (e / 256);
    int k = e % 256, h = k / 128, r = (k % 128) / 32, i = k % 32;
    int g = 2 * (4 * h + r) + i / 16;
    int q = (b[16 + 32 * h + i] >> (2 * r)) & 3;
    float dl = __fmul_rn(half_at(b, 80), (float)(b[g] & 0x0f));
    float ml = __fmul_rn(half_at(b, 82), (float)(b[g] >> 4));
    dst[e] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

// Q3_K: 110-byte blocks of 256: 32 bytes of high bits (set: no -4 offset; row j at bit j),
// 64 bytes of 2-bit codes, 12 bytes of 6-bit scales (minus 32), f16 d.
extern "C" __global__ void dq_q3_k(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)110 * (e / 256);
    int k = e % 256, h = k / 128, r = (k % 128) / 32, i = k % 32;
    int row = 4 * h + r, g = 2 * row + i / 16;
    const u8* s = b + 96;
    int low = (s[g % 8] >> (4 * (g / 8))) & 0x0f;
    int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    int scale = (signed char)(low | (high << 4)) - 32;
    int q = (b[32 + 32 * h + i] >> (2 * r)) & 3;
    int offset = (((b[i] >> row) & 1) ^ 1) << 2;
    dst[e] = __fmul_rn(__fmul_rn(half_at(b, 108), (float)scale), (float)(q - offset));
}

// Q5_K: 176-byte blocks of 256: Q4_K's d, dmin and packed scales, 32 bytes of fifth bits
// (element l of chunk c, half h at bit 2c + h of byte l), then Q4_K's nibbles.
extern "C" __global__ void dq_q5_k(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)176 * (e / 256);
    int k = e % 256, c = k / 64, half = (k % 64) / 32, l = k % 32;
    u8 byte = b[48 + 32 * c + l];
    int q = (half ? (byte >> 4) : (byte & 0x0f)) | (((b[16 + l] >> (2 * c + half)) & 1) << 4);
    dst[e] = k_scaled(b, 2 * c + half, q);
}

// The IQ4 codebook's 16 levels.
__constant__ signed char IQ4NL_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};

// IQ4_NL: 18-byte blocks of 32: f16 d, 16 bytes of codebook nibbles; d * level.
extern "C" __global__ void dq_iq4_nl(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)18 * (e / 32);
    int i = e % 32;
    int q = nibble32(b + 2, i);
    dst[e] = __fmul_rn(half_at(b, 0), (float)IQ4NL_LEVELS[q]);
}

// IQ4_XS: 136-byte blocks of 256: f16 d, a u16 of 2-bit scale tops, 4 bytes of 4-bit scale
// lows, then per 32 elements 16 bytes of codebook nibbles; scales are 6-bit minus 32.
extern "C" __global__ void dq_iq4_xs(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)136 * (e / 256);
    int k = e % 256, j = k / 32, i = k % 32;
    int tops = (int)b[2] | ((int)b[3] << 8);
    int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0f;
    int ls = (signed char)(low | (((tops >> (2 * j)) & 3) << 4)) - 32;
    const u8* q = b + 8 + 16 * j;
    int code = nibble32(q, i);
    float dl = __fmul_rn(half_at(b, 0), (float)ls);
    dst[e] = __fmul_rn(dl, (float)IQ4NL_LEVELS[code]);
}

// Q4_1: 20-byte blocks of 32: f16 d, f16 m, 16 bytes of nibbles; d * q + m, the product rounded
// before the sum.
extern "C" __global__ void dq_q4_1(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)20 * (e / 32);
    int i = e % 32;
    int q = nibble32(b + 4, i);
    dst[e] = __fadd_rn(__fmul_rn(half_at(b, 0), (float)q), half_at(b, 2));
}

// Q5_1: 24-byte blocks of 32: f16 d, f16 m, a u32 of fifth bits, 16 bytes of low nibbles;
// d * q + m.
extern "C" __global__ void dq_q5_1(const u8* src, float* dst, u64 n) {
    ELEMENT(e, n);
    const u8* b = src + (usize)24 * (e / 32);
    int i = e % 32;
    int low = nibble32(b + 8, i);
    int fifth = (b[4 + i / 8] >> (i % 8)) & 1;
    dst[e] = __fadd_rn(__fmul_rn(half_at(b, 0), (float)(low | (fifth << 4))), half_at(b, 2));
}
