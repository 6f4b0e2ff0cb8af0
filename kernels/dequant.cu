// GGUF blocks to f32 on the GPU, one thread per output element. Every product and difference is
// rounded on its own (__fmul_rn, __fsub_rn; the program is also compiled with --fmad=false), in
// the order glmcheck's CPU dequantizers use, so that the f32 results are bit-identical to them.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned long long u64;

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

__device__ float half_at(const u8* b, int at) {
    return half_to_float((u16)b[at] | ((u16)b[at + 1] << 8));
}

extern "C" __global__ void dq_f32(const u8* src, float* dst, u64 n) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const u8* b = src + 4 * e;
    dst[e] = __uint_as_float((unsigned int)b[0] | ((unsigned int)b[1] << 8) |
                             ((unsigned int)b[2] << 16) | ((unsigned int)b[3] << 24));
}

extern "C" __global__ void dq_f16(const u8* src, float* dst, u64 n) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    dst[e] = half_at(src, 2 * e);
}

extern "C" __global__ void dq_bf16(const u8* src, float* dst, u64 n) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    unsigned int bits = (unsigned int)src[2 * e] | ((unsigned int)src[2 * e + 1] << 8);
    dst[e] = __uint_as_float(bits << 16);
}

// Q8_0: 34-byte blocks of 32: f16 d, 32 int8 q; d * q.
extern "C" __global__ void dq_q8_0(const u8* src, float* dst, u64 n) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const u8* b = src + 34 * (e / 32);
    dst[e] = __fmul_rn(half_at(b, 0), (float)(signed char)b[2 + e % 32]);
}

// Q4_0: 18-byte blocks of 32: f16 d, 16 bytes of nibbles (element i low, i + 16 high); d * (q - 8).
extern "C" __global__ void dq_q4_0(const u8* src, float* dst, u64 n) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const u8* b = src + 18 * (e / 32);
    int i = e % 32;
    int q = i < 16 ? (b[2 + i] & 0x0f) : (b[2 + i - 16] >> 4);
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

// Q4_K: 144-byte blocks of 256: f16 d, f16 dmin, 12 bytes of scales and mins, then 4 chunks of
// 32 bytes holding 64 elements each (sub-block 2c in the low nibbles, 2c + 1 in the high).
extern "C" __global__ void dq_q4_k(const u8* src, float* dst, u64 n) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const u8* b = src + 144 * (e / 256);
    int k = e % 256, c = k / 64, half = (k % 64) / 32, i = k % 32;
    int sc, m;
    scale_min(b + 4, 2 * c + half, &sc, &m);
    float dl = __fmul_rn(half_at(b, 0), (float)sc);
    float ml = __fmul_rn(half_at(b, 2), (float)m);
    u8 byte = b[16 + 32 * c + i];
    int q = half ? (byte >> 4) : (byte & 0x0f);
    dst[e] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

// Q6_K: 210-byte blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
// scales, f16 d; per half of 128, four rows of 32.
extern "C" __global__ void dq_q6_k(const u8* src, float* dst, u64 n) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const u8* b = src + 210 * (e / 256);
    int k = e % 256, h = k / 128, r = (k % 128) / 32, i = k % 32;
    int low = (b[64 * h + 32 * (r % 2) + i] >> (4 * (r / 2))) & 0x0f;
    int high = (b[128 + 32 * h + i] >> (2 * r)) & 3;
    int q = low | (high << 4);
    float dl = __fmul_rn(half_at(b, 208), (float)(signed char)b[192 + 8 * h + 2 * r + i / 16]);
    dst[e] = __fmul_rn(dl, (float)(q - 32));
}
