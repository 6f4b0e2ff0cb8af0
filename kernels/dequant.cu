// GGUF blocks to f32, bf16 or f16 on the GPU. Every value is decoded in f32 with every product
// and difference rounded on its own (__fmul_rn, __fsub_rn, __fadd_rn; the program is also
// compiled with --fmad=false), in the order glmcheck's CPU dequantizers use, so that the f32
// results are bit-identical to them; the bf16 and f16 kernels then round that f32 value to
// nearest even, two values per paired hardware conversion (`Out<T>::put`). Each source type has
// a kernel per output, `dq_<type>_<output>`: dq_q4_k_f32, dq_q4_k_bf16, dq_q4_k_f16.
//
// Launch shape (src/cuda/mod.rs, `dequant_launch`): thread blocks of DQ_THREADS threads, each
// block writing DQ_TILE consecutive output values, so ceil(n / DQ_TILE) of them. Each thread
// writes a group of 16 bytes at a time: four f32 values (a float4) or eight bf16/f16 values (a
// uint4), so that every store of a warp covers 512 consecutive bytes whatever the output, and a
// 16-bit output takes half the stores (and half the scale decodes) of an f32 one. The quantized
// types first copy the tile's blocks (a contiguous byte range) into shared memory with aligned
// 16-byte loads, whatever their block size, then decode four values at a time from there: a
// group never straddles a scale, so its scales are read from shared memory once per four
// values. `src` and `dst` must be 16-byte aligned (cudaMalloc'd); `n` is below 2^32; byte
// offsets into `src` are 64-bit.

#include "dtypes.cuh"

#define DQ_THREADS 256
#define DQ_TILE 4096

// IEEE half bits to float, exactly (subnormals, infinities and NaN payloads included), without
// branches: a subnormal m * 2^-24 is (2^-14 + m * 2^-24) - 2^-14, both exact f32 normals.
__device__ __forceinline__ float half_to_float(u32 h) {
    u32 o = (h & 0x7fff) << 13;
    u32 exp = o & (0x1fu << 23);
    u32 normal = o + (112u << 23);
    u32 inf_nan = o + (224u << 23);
    u32 sub = __float_as_uint(
        __fsub_rn(__uint_as_float(o + (113u << 23)), __uint_as_float(113u << 23)));
    u32 bits = exp == (0x1fu << 23) ? inf_nan : (exp == 0 ? sub : normal);
    return __uint_as_float(((h & 0x8000) << 16) | bits);
}

// Little-endian loads from shared memory at `p`, aligned as named.
__device__ __forceinline__ u32 ld16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld32(const u8* p) { return *(const u32*)p; }
// Four bytes at a 2-byte-aligned `p`.
__device__ __forceinline__ u32 ld32_2(const u8* p) { return ld16(p) | (ld16(p + 2) << 16); }

__device__ __forceinline__ float half_at(const u8* p) { return half_to_float(ld16(p)); }

// The four nibbles of bytes w at bit `shift` (0: low nibbles, 4: high), one per byte.
__device__ __forceinline__ u32 nibbles4(u32 w, int shift) { return (w >> shift) & 0x0f0f0f0f; }

// The IQ4 codebook's 16 levels as signed bytes, four per word, little-endian.
#define PACK4(a, b, c, d) \
    ((u32)(u8)(a) | ((u32)(u8)(b) << 8) | ((u32)(u8)(c) << 16) | ((u32)(u8)(d) << 24))
#define IQ4_L0 PACK4(-127, -104, -83, -65)
#define IQ4_L1 PACK4(-49, -35, -22, -10)
#define IQ4_L2 PACK4(1, 13, 25, 38)
#define IQ4_L3 PACK4(53, 69, 89, 113)

// The codebook levels of four codes (0..15, one per byte of c), as four signed bytes: byte
// permutes of the table in registers, where a table in memory indexed per lane would serialize.
__device__ __forceinline__ u32 iq4_levels(u32 c) {
    // The four codes as the four nibbles of a selector.
    u32 s = c | (c >> 4);
    s = __byte_perm(s, 0, 0x4420);
    u32 lo = __byte_perm(IQ4_L0, IQ4_L1, s & 0x7777);  // levels 0..7
    u32 hi = __byte_perm(IQ4_L2, IQ4_L3, s & 0x7777);  // levels 8..15
    // Byte j from hi where code j has bit 3 set.
    return __byte_perm(lo, hi, 0x3210 | ((s & 0x8888) >> 1));
}

// Integer to float without the conversion instruction, which issues at a quarter of the rate
// of an add: x sits in the mantissa of 2^23, and subtracting 2^23 + offset leaves x - offset,
// exactly (every operand and the result are integers below 2^24 in magnitude).
#define TWO_23 8388608.0f
__device__ __forceinline__ float int_minus(u32 x, float offset) {
    return __fsub_rn(__uint_as_float(0x4b000000u | x), TWO_23 + offset);
}

// The four bytes of w, each minus `offset`, as floats: each byte moved into the mantissa of
// 2^23 by one byte permute, then as in `int_minus`.
__device__ __forceinline__ float4 bytes_minus(u32 w, float offset) {
    float o = TWO_23 + offset;
    return make_float4(__fsub_rn(__uint_as_float(__byte_perm(w, 0x4b000000u, 0x7650)), o),
                       __fsub_rn(__uint_as_float(__byte_perm(w, 0x4b000000u, 0x7651)), o),
                       __fsub_rn(__uint_as_float(__byte_perm(w, 0x4b000000u, 0x7652)), o),
                       __fsub_rn(__uint_as_float(__byte_perm(w, 0x4b000000u, 0x7653)), o));
}

// The four bytes of w as signed bytes, as floats: flipping the sign bit maps -128..127 to
// 0..255 in order.
__device__ __forceinline__ float4 signed_bytes(u32 w) { return bytes_minus(w ^ 0x80808080u, 128.0f); }

// d * x for the four values of x.
__device__ __forceinline__ float4 times4(float d, float4 x) {
    return make_float4(__fmul_rn(d, x.x), __fmul_rn(d, x.y), __fmul_rn(d, x.z), __fmul_rn(d, x.w));
}

// d * x + m and d * x - m for the four values of x, the product rounded before the sum.
__device__ __forceinline__ float4 plus4(float d, float4 x, float m) {
    return make_float4(__fadd_rn(__fmul_rn(d, x.x), m), __fadd_rn(__fmul_rn(d, x.y), m),
                       __fadd_rn(__fmul_rn(d, x.z), m), __fadd_rn(__fmul_rn(d, x.w), m));
}
__device__ __forceinline__ float4 minus4(float d, float4 x, float m) {
    return make_float4(__fsub_rn(__fmul_rn(d, x.x), m), __fsub_rn(__fmul_rn(d, x.y), m),
                       __fsub_rn(__fmul_rn(d, x.z), m), __fsub_rn(__fmul_rn(d, x.w), m));
}

// The paired hardware conversion: two f32 values rounded to nearest even in one instruction,
// `lo` into the low half. Finite values and infinities round as `store` rounds them; a NaN
// becomes the canonical NaN (the dequantization check takes any NaN for any NaN).
__device__ __forceinline__ u32 pair_bits(bf16*, float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ u32 pair_bits(f16*, float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// How output T is written: G values (16 bytes) per group, group g being values G*g..G*g+G-1;
// `put` stores a group decoded in f32 as G / 4 float4s.
template <class T>
struct Out {
    static constexpr int G = 8;
    static __device__ __forceinline__ void put(T* dst, u32 g, const float4* v) {
        ((uint4*)dst)[g] = make_uint4(pair_bits((T*)0, v[0].x, v[0].y),
                                      pair_bits((T*)0, v[0].z, v[0].w),
                                      pair_bits((T*)0, v[1].x, v[1].y),
                                      pair_bits((T*)0, v[1].z, v[1].w));
    }
};
template <>
struct Out<float> {
    static constexpr int G = 4;
    static __device__ __forceinline__ void put(float* dst, u32 g, const float4* v) {
        ((float4*)dst)[g] = v[0];
    }
};

// Thread blocks resident per SM that every kernel must allow: 8 of DQ_THREADS fill an SM's
// 2048 threads, at 32 registers a thread. Left to itself the compiler takes 56 for the quantized
// types (4 blocks an SM, half the threads to hide the loads' latency); at 32 nothing spills.
#define DQ_BLOCKS_PER_SM 8

// The kernel `dq_<name>_<O>`: `run` (a dequant_plain or dequant_tile) writing O values.
#define DQ_OUT(name, O, run)                                                                 \
    extern "C" __global__ void __launch_bounds__(DQ_THREADS, DQ_BLOCKS_PER_SM)                \
        dq_##name##_##O(const u8* __restrict__ src, O* __restrict__ dst, u64 n) {             \
        run(src, dst, n);                                                                     \
    }
// The three kernels of source type `name`: dq_<name>_f32, dq_<name>_bf16, dq_<name>_f16.
#define DQ(name, run) DQ_OUT(name, f32, run) DQ_OUT(name, bf16, run) DQ_OUT(name, f16, run)

// ---------------------------------------------------------------------------------------------
// Unquantized types: four values per D::Word loaded (16 bytes for F32, 8 for F16 and BF16), all
// of a thread's loads issued before its stores; a last, partial group (n not a multiple of G)
// value by value, each a D::Value decoded by D::one.

template <class D, class O>
__device__ __forceinline__ void dequant_plain(const u8* __restrict__ src, O* __restrict__ dst,
                                              u64 n) {
    typedef typename D::Word Word;
    typedef typename D::Value Value;
    constexpr int G = Out<O>::G, FOURS = G / 4, PER = DQ_TILE / G / DQ_THREADS;
    // Group v of this thread: `first + v * DQ_THREADS` of the output.
    u32 first = blockIdx.x * (DQ_TILE / G) + threadIdx.x;
    Word w[PER][FOURS];
#pragma unroll
    for (int v = 0; v < PER; v++) {
        u32 g = first + v * DQ_THREADS;
        if ((u64)G * g + G <= n) {
#pragma unroll
            for (int u = 0; u < FOURS; u++) w[v][u] = __ldg((const Word*)src + FOURS * g + u);
        }
    }
#pragma unroll
    for (int v = 0; v < PER; v++) {
        u32 g = first + v * DQ_THREADS;
        if ((u64)G * g + G <= n) {
            float4 f[FOURS];
#pragma unroll
            for (int u = 0; u < FOURS; u++) f[u] = D::four(w[v][u]);
            Out<O>::put(dst, g, f);
        } else {
            // The last, partial group.
            for (u64 e = (u64)G * g; e < n; e++) store(dst + e, D::one(((const Value*)src)[e]));
        }
    }
}

struct F32 {
    typedef uint4 Word;
    typedef u32 Value;
    static __device__ __forceinline__ float4 four(uint4 w) {
        return make_float4(__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z),
                           __uint_as_float(w.w));
    }
    static __device__ __forceinline__ float one(u32 x) { return __uint_as_float(x); }
};
DQ(f32, dequant_plain<F32>)

struct F16 {
    typedef uint2 Word;
    typedef u16 Value;
    static __device__ __forceinline__ float4 four(uint2 w) {
        return make_float4(half_to_float(w.x & 0xffff), half_to_float(w.x >> 16),
                           half_to_float(w.y & 0xffff), half_to_float(w.y >> 16));
    }
    static __device__ __forceinline__ float one(u32 x) { return half_to_float(x); }
};
DQ(f16, dequant_plain<F16>)

struct BF16 {
    typedef uint2 Word;
    typedef u16 Value;
    static __device__ __forceinline__ float4 four(uint2 w) {
        return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                           __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
    }
    static __device__ __forceinline__ float one(u32 x) { return __uint_as_float(x << 16); }
};
DQ(bf16, dequant_plain<BF16>)

// ---------------------------------------------------------------------------------------------
// Quantized types: D::BS values in D::TS-byte blocks, each block in D::SUBS sub-blocks of
// consecutive values that share a scale (and a min). The tile's DQ_TILE / BS blocks are copied
// to shared memory; then D::scale(block, j) decodes sub-block j's scale and min (a float2: x
// the scale, y the min or 0) once for the tile, into shared memory as well, where every group
// of the sub-block's values would decode them again (two f16 values, packed 6-bit fields: more
// instructions than the values' own decode); then each four values of output are decoded by
// D::four(block, k, o, s): values k + o .. k + o + 3 of the block, k being where the thread's
// group starts (a multiple of 4 or 8), o 0 or 4, and s their sub-block's scale and min. A group
// never straddles a sub-block (each holds 16 or more aligned values).

template <class D, class O>
__device__ __forceinline__ void dequant_tile(const u8* __restrict__ src, O* __restrict__ dst,
                                             u64 n) {
    constexpr int BS = D::BS, TS = D::TS;
    constexpr int BLOCKS = DQ_TILE / BS;
    // The tile's bytes, plus up to 15 before them to start on a 16-byte boundary.
    constexpr int WORDS = (BLOCKS * TS + 15) / 16 + 1;
    __shared__ uint4 tile[WORDS];

    u64 blocks = n / BS;
    u64 first = (u64)blockIdx.x * BLOCKS;
    int count = (int)min((u64)BLOCKS, blocks - first);
    u64 start = first * TS;              // byte offset of the tile's first block
    u64 end = start + (u64)count * TS;   // one past its last byte
    u64 total = blocks * TS;             // bytes in `src`
    u64 aligned = start & ~(u64)15;
    int words = (int)((end - aligned + 15) / 16);
    for (int w = threadIdx.x; w < words; w += DQ_THREADS) {
        u64 at = aligned + (u64)16 * w;
        if (at + 16 <= total) {
            tile[w] = __ldg((const uint4*)(src + at));
        } else {
            // The last word of `src`, byte by byte so as not to read past it (and written
            // byte by byte, so that this rare path holds no registers of its own).
            u8* bytes = (u8*)&tile[w];
            for (int i = 0; i < 16; i++) bytes[i] = at + i < total ? src[at + i] : 0;
        }
    }
    __syncthreads();

    const u8* base = (const u8*)tile + (start - aligned);
    constexpr int SUB = BS / D::SUBS;  // values per sub-block
    static_assert(DQ_TILE / SUB <= DQ_THREADS, "one thread per sub-block of the tile");
    __shared__ float2 scales[DQ_TILE / SUB];
    if (threadIdx.x < count * D::SUBS) {
        u32 s = threadIdx.x;
        scales[s] = D::scale(base + (s / D::SUBS) * TS, s % D::SUBS);
    }
    __syncthreads();

    O* out = dst + first * BS;
    constexpr int G = Out<O>::G, FOURS = G / 4;
    u32 groups = count * (BS / G);
#pragma unroll
    for (int v = 0; v < DQ_TILE / G / DQ_THREADS; v++) {
        u32 g = threadIdx.x + v * DQ_THREADS;
        if (g < groups) {
            u32 k = G * g;
            const u8* block = base + (k / BS) * TS;
            float4 f[FOURS];
#pragma unroll
            for (int u = 0; u < FOURS; u++) f[u] = D::four(block, k % BS, 4 * u, scales[k / SUB]);
            Out<O>::put(out, g, f);
        }
    }
}

// Q8_0: 34-byte blocks of 32: f16 d, 32 int8 q; d * q.
struct Q8_0 {
    static constexpr int BS = 32, TS = 34, SUBS = 1;
    static __device__ __forceinline__ float2 scale(const u8* b, u32) {
        return make_float2(half_at(b), 0.0f);
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k0, u32 o, float2 s) {
        u32 q = ld32_2(b + 2 + k0 + o);
        return times4(s.x, signed_bytes(q));
    }
};
DQ(q8_0, dequant_tile<Q8_0>)

// Q4_0: 18-byte blocks of 32: f16 d, 16 bytes of nibbles (element i low, i + 16 high);
// d * (q - 8).
struct Q4_0 {
    static constexpr int BS = 32, TS = 18, SUBS = 1;
    static __device__ __forceinline__ float2 scale(const u8* b, u32) {
        return make_float2(half_at(b), 0.0f);
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k0, u32 o, float2 s) {
        u32 k = k0 + o;
        u32 q = nibbles4(ld32_2(b + 2 + (k & 15)), k & 16 ? 4 : 0);
        return times4(s.x, bytes_minus(q, 8.0f));
    }
};
DQ(q4_0, dequant_tile<Q4_0>)

// Q4_1: 20-byte blocks of 32: f16 d, f16 m, 16 bytes of nibbles; d * q + m, the product
// rounded before the sum.
struct Q4_1 {
    static constexpr int BS = 32, TS = 20, SUBS = 1;
    static __device__ __forceinline__ float2 scale(const u8* b, u32) {
        return make_float2(half_at(b), half_at(b + 2));
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k0, u32 o, float2 s) {
        u32 k = k0 + o;
        u32 q = nibbles4(ld32(b + 4 + (k & 15)), k & 16 ? 4 : 0);
        return plus4(s.x, bytes_minus(q, 0.0f), s.y);
    }
};
DQ(q4_1, dequant_tile<Q4_1>)

// The 5-bit codes k..k+3 of a Q5_0/Q5_1 block: fifth bits `qh` (bit i for element i), low
// nibbles in 16 bytes `ql` (element i low, i + 16 high), one code per byte.
__device__ __forceinline__ u32 five_bit4(u32 qh, u32 ql4, u32 k) {
    u32 low = nibbles4(ql4, k & 16 ? 4 : 0);
    u32 h = (qh >> k) & 0xf;  // the fifth bits of elements k..k+3
    u32 high = (h & 1) | ((h & 2) << 7) | ((h & 4) << 14) | ((h & 8) << 21);
    return low | (high << 4);
}

// Q5_0: 22-byte blocks of 32: f16 d, a u32 of fifth bits, 16 bytes of low nibbles;
// d * (q - 16).
struct Q5_0 {
    static constexpr int BS = 32, TS = 22, SUBS = 1;
    static __device__ __forceinline__ float2 scale(const u8* b, u32) {
        return make_float2(half_at(b), 0.0f);
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k0, u32 o, float2 s) {
        u32 k = k0 + o;
        u32 q = five_bit4(ld32_2(b + 2), ld32_2(b + 6 + (k & 15)), k);
        return times4(s.x, bytes_minus(q, 16.0f));
    }
};
DQ(q5_0, dequant_tile<Q5_0>)

// Q5_1: 24-byte blocks of 32: f16 d, f16 m, a u32 of fifth bits, 16 bytes of low nibbles;
// d * q + m.
struct Q5_1 {
    static constexpr int BS = 32, TS = 24, SUBS = 1;
    static __device__ __forceinline__ float2 scale(const u8* b, u32) {
        return make_float2(half_at(b), half_at(b + 2));
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k0, u32 o, float2 s) {
        u32 k = k0 + o;
        u32 q = five_bit4(ld32(b + 4), ld32(b + 8 + (k & 15)), k);
        return plus4(s.x, bytes_minus(q, 0.0f), s.y);
    }
};
DQ(q5_1, dequant_tile<Q5_1>)

// IQ4_NL: 18-byte blocks of 32: f16 d, 16 bytes of codebook nibbles; d * level.
struct IQ4_NL {
    static constexpr int BS = 32, TS = 18, SUBS = 1;
    static __device__ __forceinline__ float2 scale(const u8* b, u32) {
        return make_float2(half_at(b), 0.0f);
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k0, u32 o, float2 s) {
        u32 k = k0 + o;
        u32 l = iq4_levels(nibbles4(ld32_2(b + 2 + (k & 15)), k & 16 ? 4 : 0));
        return times4(s.x, signed_bytes(l));
    }
};
DQ(iq4_nl, dequant_tile<IQ4_NL>)

// IQ4_XS: 136-byte blocks of 256: f16 d, a u16 of 2-bit scale tops, 4 bytes of 4-bit scale
// lows, then per 32 elements 16 bytes of codebook nibbles; scales are 6-bit minus 32;
// (d * scale) * level.
struct IQ4_XS {
    static constexpr int BS = 256, TS = 136, SUBS = 8;
    static __device__ __forceinline__ float2 scale(const u8* b, u32 j) {
        u32 tops = ld16(b + 2);
        u32 low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0f;
        // The 6-bit scale minus 32.
        return make_float2(
            __fmul_rn(half_at(b), int_minus(low | (((tops >> (2 * j)) & 3) << 4), 32.0f)), 0.0f);
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k, u32 o, float2 s) {
        u32 j = k / 32, i = k % 32 + o;
        u32 l = iq4_levels(nibbles4(ld32(b + 8 + 16 * j + (i & 15)), i & 16 ? 4 : 0));
        return times4(s.x, signed_bytes(l));
    }
};
DQ(iq4_xs, dequant_tile<IQ4_XS>)

// Q2_K: 84-byte blocks of 256: 16 bytes of 4-bit scale (low) and min (high), 64 bytes of
// 2-bit codes (per 128 elements, 32 bytes: row r at bits 2r), f16 d, f16 dmin;
// (d * scale) * q - dmin * min.
struct Q2_K {
    static constexpr int BS = 256, TS = 84, SUBS = 16;
    // Sub-block j (values 16j..16j+15: h = j / 8, r = j % 8 / 2) has byte j.
    static __device__ __forceinline__ float2 scale(const u8* b, u32 j) {
        u32 sm = b[j];
        return make_float2(__fmul_rn(half_at(b + 80), int_minus(sm & 0x0f, 0.0f)),
                           __fmul_rn(half_at(b + 82), int_minus(sm >> 4, 0.0f)));
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k, u32 o, float2 s) {
        u32 h = k / 128, r = (k % 128) / 32, i = k % 32;
        u32 q = (ld32(b + 16 + 32 * h + i + o) >> (2 * r)) & 0x03030303;
        return minus4(s.x, bytes_minus(q, 0.0f), s.y);
    }
};
DQ(q2_k, dequant_tile<Q2_K>)

// Q3_K: 110-byte blocks of 256: 32 bytes of high bits (set: no -4 offset; row j at bit j),
// 64 bytes of 2-bit codes, 12 bytes of 6-bit scales (minus 32), f16 d; (d * scale) * (q - off).
struct Q3_K {
    static constexpr int BS = 256, TS = 110, SUBS = 16;
    // Sub-block g (values 16g..16g+15) has 6-bit scale g of the 12 bytes at 96.
    static __device__ __forceinline__ float2 scale(const u8* b, u32 g) {
        const u8* s = b + 96;
        u32 low = (s[g % 8] >> (4 * (g / 8))) & 0x0f;
        u32 high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        return make_float2(__fmul_rn(half_at(b + 108), int_minus(low | (high << 4), 32.0f)), 0.0f);
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k, u32 o, float2 s) {
        u32 h = k / 128, r = (k % 128) / 32, i = k % 32;
        u32 row = 4 * h + r;
        u32 codes = (ld32_2(b + 32 + 32 * h + i + o) >> (2 * r)) & 0x03030303;
        // A set high bit cancels the -4: code + 4 * bit - 4, the high bit as bit 2 of the byte.
        u32 set = (ld32_2(b + i + o) >> row) & 0x01010101;
        return times4(s.x, bytes_minus(codes | (set << 2), 4.0f));
    }
};
DQ(q3_k, dequant_tile<Q3_K>)

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block's 12 packed bytes: sub-blocks
// 0-3 from bytes j and j + 4, 4-7 from bytes j + 4 and their top bits in j - 4 and j. Computed
// both ways and selected, since the lanes of a warp decode every sub-block of a block at once
// (a branch would run both sides one after the other).
__device__ __forceinline__ void scale_min(const u8* s, u32 j, u32* sc, u32* m) {
    u32 i = j & 3;
    u32 a = s[i], c = s[i + 4], e = s[i + 8];
    bool low = j < 4;
    *sc = low ? a & 0x3f : (e & 0x0f) | ((a >> 2) & 0x30);
    *m = low ? c & 0x3f : (e >> 4) | ((c >> 2) & 0x30);
}

// Sub-block j of a Q4_K/Q5_K block b: d * scale and dmin * min.
__device__ __forceinline__ float2 k_scale(const u8* b, u32 j) {
    u32 sc, m;
    scale_min(b + 4, j, &sc, &m);
    return make_float2(__fmul_rn(half_at(b), int_minus(sc, 0.0f)),
                       __fmul_rn(half_at(b + 2), int_minus(m, 0.0f)));
}

// Q4_K: 144-byte blocks of 256: f16 d, f16 dmin, 12 bytes of scales and mins, then 4 chunks of
// 32 bytes holding 64 elements each (sub-block 2c in the low nibbles, 2c + 1 in the high).
struct Q4_K {
    static constexpr int BS = 256, TS = 144, SUBS = 8;
    static __device__ __forceinline__ float2 scale(const u8* b, u32 j) { return k_scale(b, j); }
    // (d * scale) * q - dmin * min.
    static __device__ __forceinline__ float4 four(const u8* b, u32 k, u32 o, float2 s) {
        u32 c = k / 64, half = (k % 64) / 32, i = k % 32 + o;
        u32 q = nibbles4(ld32(b + 16 + 32 * c + i), 4 * half);
        return minus4(s.x, bytes_minus(q, 0.0f), s.y);
    }
};
DQ(q4_k, dequant_tile<Q4_K>)

// Q5_K: 176-byte blocks of 256: Q4_K's d, dmin and packed scales, 32 bytes of fifth bits
// (element l of chunk c, half h at bit 2c + h of byte l), then Q4_K's nibbles.
struct Q5_K {
    static constexpr int BS = 256, TS = 176, SUBS = 8;
    static __device__ __forceinline__ float2 scale(const u8* b, u32 j) { return k_scale(b, j); }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k, u32 o, float2 s) {
        u32 c = k / 64, half = (k % 64) / 32, l = k % 32 + o, j = 2 * c + half;
        u32 low = nibbles4(ld32(b + 48 + 32 * c + l), 4 * half);
        u32 high = (ld32(b + 16 + l) >> j) & 0x01010101;
        return minus4(s.x, bytes_minus(low | (high << 4), 0.0f), s.y);
    }
};
DQ(q5_k, dequant_tile<Q5_K>)

// Q6_K: 210-byte blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
// scales, f16 d; per half of 128, four rows of 32; (d * scale) * (q - 32).
struct Q6_K {
    static constexpr int BS = 256, TS = 210, SUBS = 16;
    // Sub-block j (values 16j..16j+15) has the int8 scale at 192 + j.
    static __device__ __forceinline__ float2 scale(const u8* b, u32 j) {
        float scale = int_minus(b[192 + j] ^ 0x80u, 128.0f);
        return make_float2(__fmul_rn(half_at(b + 208), scale), 0.0f);
    }
    static __device__ __forceinline__ float4 four(const u8* b, u32 k, u32 o, float2 s) {
        u32 h = k / 128, r = (k % 128) / 32, at = k % 32 + o;
        u32 low = nibbles4(ld32_2(b + 64 * h + 32 * (r % 2) + at), 4 * (r / 2));
        u32 high = (ld32_2(b + 128 + 32 * h + at) >> (2 * r)) & 0x03030303;
        return times4(s.x, bytes_minus(low | (high << 4), 32.0f));
    }
};
DQ(q6_k, dequant_tile<Q6_K>)
