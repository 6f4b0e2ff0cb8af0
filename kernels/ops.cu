// The element-wise and per-row ops of the CUDA backend, for activations held in f32, bf16 or f16.
// Each kernel reads its dtype, computes in f32 in the order glmcheck's CPU ops use (the program is
// compiled with --fmad=false and IEEE division and square root), and rounds its result to the
// dtype to nearest even (`store` of dtypes.cuh): what the CPU backend's emulated bf16/f16 modes
// do, computed here independently.

#include "dtypes.cuh"

// Threads per block of the row kernels; a power of two for the tree sum.
#define ROW_THREADS 256

// The sum of every thread's `v` over the block, in a fixed tree order (the same result on every
// run), returned to every thread.
__device__ float block_sum(float v, float* scratch) {
    scratch[threadIdx.x] = v;
    __syncthreads();
    for (u32 half = ROW_THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) scratch[threadIdx.x] += scratch[threadIdx.x + half];
        __syncthreads();
    }
    float total = scratch[0];
    __syncthreads();
    return total;
}

// RMSNorm of row blockIdx.x: w * (x * 1 / sqrt(mean(x^2) + eps)).
template <typename T>
__device__ void rms_norm(const T* x, const T* w, T* y, u32 cols, float eps) {
    __shared__ float scratch[ROW_THREADS];
    const T* row = x + (u64)blockIdx.x * cols;
    T* out = y + (u64)blockIdx.x * cols;
    float acc = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += ROW_THREADS) {
        float v = to_f32(row[c]);
        acc += v * v;
    }
    float mean_sq = block_sum(acc, scratch) / (float)cols;
    float inv = 1.0f / sqrtf(mean_sq + eps);
    for (u32 c = threadIdx.x; c < cols; c += ROW_THREADS) {
        store(&out[c], to_f32(w[c]) * (to_f32(row[c]) * inv));
    }
}

// LayerNorm of row blockIdx.x with weight and bias, biased variance.
template <typename T>
__device__ void layer_norm(const T* x, const T* w, const T* b, T* y, u32 cols, float eps) {
    __shared__ float scratch[ROW_THREADS];
    const T* row = x + (u64)blockIdx.x * cols;
    T* out = y + (u64)blockIdx.x * cols;
    float acc = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += ROW_THREADS) acc += to_f32(row[c]);
    float mean = block_sum(acc, scratch) / (float)cols;
    acc = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += ROW_THREADS) {
        float d = to_f32(row[c]) - mean;
        acc += d * d;
    }
    float var = block_sum(acc, scratch) / (float)cols;
    float inv = 1.0f / sqrtf(var + eps);
    for (u32 c = threadIdx.x; c < cols; c += ROW_THREADS) {
        store(&out[c], (to_f32(row[c]) - mean) * inv * to_f32(w[c]) + to_f32(b[c]));
    }
}

#define ELEMENT(e, n)                                     \
    u32 e = blockIdx.x * blockDim.x + threadIdx.x;        \
    if (e >= n) return

// silu(gate) * up, silu(g) = g / (1 + exp(-g)).
template <typename T>
__device__ void silu_mul(const T* gate, const T* up, T* y, u32 n) {
    ELEMENT(e, n);
    float g = to_f32(gate[e]);
    store(&y[e], g / (1.0f + expf(-g)) * to_f32(up[e]));
}

template <typename T>
__device__ void add(const T* a, const T* b, T* y, u32 n) {
    ELEMENT(e, n);
    store(&y[e], to_f32(a[e]) + to_f32(b[e]));
}

// kv_b from llama.cpp's split form, f32 in, the dtype out: head h's rows are attn_k_b[h]
// transposed (`[nope, kv_lora]` from `[kv_lora, nope]`), then attn_v_b[h] (`[v, kv_lora]`).
template <typename T>
__device__ void assemble_kv_b(const float* k_b, const float* v_b, T* y, u32 kv_lora, u32 nope,
                              u32 v, u32 n) {
    ELEMENT(e, n);
    u32 c = e % kv_lora, r = (e / kv_lora) % (nope + v), h = e / (kv_lora * (nope + v));
    float x = r < nope ? k_b[((u64)h * kv_lora + c) * nope + r]
                       : v_b[((u64)h * v + (r - nope)) * kv_lora + c];
    store(&y[e], x);
}

// Row rows[r] of x (rows of `cols` values) as row r of y: values moved, never computed.
template <typename T>
__device__ void gather_rows(const T* x, const u32* rows, T* y, u32 cols, u32 n) {
    ELEMENT(e, n);
    y[e] = x[(u64)rows[e / cols] * cols + e % cols];
}

#define OPS(T)                                                                                   \
    extern "C" __global__ void rms_norm_##T(const T* x, const T* w, T* y, u32 cols, float eps) { \
        rms_norm(x, w, y, cols, eps);                                                            \
    }                                                                                            \
    extern "C" __global__ void layer_norm_##T(const T* x, const T* w, const T* b, T* y,         \
                                              u32 cols, float eps) {                             \
        layer_norm(x, w, b, y, cols, eps);                                                       \
    }                                                                                            \
    extern "C" __global__ void silu_mul_##T(const T* gate, const T* up, T* y, u32 n) {          \
        silu_mul(gate, up, y, n);                                                                \
    }                                                                                            \
    extern "C" __global__ void add_##T(const T* a, const T* b, T* y, u32 n) { add(a, b, y, n); } \
    extern "C" __global__ void gather_rows_##T(const T* x, const u32* rows, T* y, u32 cols,      \
                                               u32 n) {                                          \
        gather_rows(x, rows, y, cols, n);                                                        \
    }                                                                                            \
    extern "C" __global__ void assemble_kv_b_##T(const float* k_b, const float* v_b, T* y,       \
                                                 u32 kv_lora, u32 nope, u32 v, u32 n) {          \
        assemble_kv_b(k_b, v_b, y, kv_lora, nope, v, n);                                         \
    }

OPS(f32)
OPS(bf16)
OPS(f16)

// Token blockIdx.x's row of the routed experts' weighted sum: its row of `sum` (zeros where
// `has_sum` is 0), then each expert output row it chose (`rows[p]`, the address of one row of
// `cols` values, for p in starts[token]..starts[token + 1], in the host's order) times its
// routing weight added in turn: `o + w·v`, the product rounded before the add (the program is
// compiled without contraction), as the host adds them. The sum stays in f32.
template <typename T>
__device__ void expert_sum(const float* sum, u32 has_sum, const u64* rows, const float* weights,
                           const u32* starts, float* out, u32 cols) {
    u32 token = blockIdx.x;
    u32 first = starts[token], last = starts[token + 1];
    for (u32 c = threadIdx.x; c < cols; c += ROW_THREADS) {
        u64 at = (u64)token * cols + c;
        float o = has_sum ? sum[at] : 0.0f;
        for (u32 p = first; p < last; p++) o += weights[p] * to_f32(((const T*)rows[p])[c]);
        out[at] = o;
    }
}

// f32 values rounded to the dtype to nearest even (`store`), as the host's rounding does.
template <typename T>
__device__ void round_to(const float* x, T* y, u32 n) {
    ELEMENT(e, n);
    store(&y[e], x[e]);
}

#define EXPERT_SUM(T)                                                                            \
    extern "C" __global__ void expert_sum_##T(const float* sum, u32 has_sum, const u64* rows,    \
                                              const float* weights, const u32* starts,           \
                                              float* out, u32 cols) {                            \
        expert_sum<T>(sum, has_sum, rows, weights, starts, out, cols);                           \
    }                                                                                            \
    extern "C" __global__ void round_to_##T(const float* x, T* y, u32 n) { round_to(x, y, n); }

EXPERT_SUM(f32)
EXPERT_SUM(bf16)
EXPERT_SUM(f16)

#define NEG_INF __int_as_float(0xff800000)

// The largest of every thread's `v` over the block, in a fixed tree order.
__device__ float block_max(float v, float* scratch) {
    scratch[threadIdx.x] = v;
    __syncthreads();
    for (u32 half = ROW_THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + half]);
        __syncthreads();
    }
    float total = scratch[0];
    __syncthreads();
    return total;
}

// The sum of every lane's `v` over a warp, in a fixed butterfly order, in every lane.
__device__ float warp_sum(float v) {
    for (u32 m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// MLA attention of position blockIdx.x, head blockIdx.y: softmax(q·kᵀ·scale)·v over the keys
// `keys` names for the position (−1: none), the context in f32. The query head sits in shared
// memory after the scores; each warp scores one key at a time, its lanes across the key's
// dims (reads of a key row coalesced), the nope and rope dot products summed apart as the CPU
// does. Dynamic shared memory: `slots` scores, then the query's nope + rope values. Only where
// *nonfinite is set: the cache holds a NaN or an infinity, which the GEMMs would spread.
template <typename T>
__device__ void attention(const u32* nonfinite, const T* q, const T* kv, const T* k_rope,
                          const int* keys, float* out, u32 heads, u32 nope, u32 rope, u32 vd,
                          u32 slots, float scale) {
    if (*nonfinite == 0) return;
    extern __shared__ float probs[];
    __shared__ float scratch[ROW_THREADS];
    u32 i = blockIdx.x, head = blockIdx.y;
    u32 qk = nope + rope, stride = heads * (nope + vd);
    const T* qh = q + (u64)i * heads * qk + (u64)head * qk;
    float* query = probs + slots;
    for (u32 d = threadIdx.x; d < qk; d += ROW_THREADS) query[d] = to_f32(qh[d]);
    __syncthreads();
    const int* chosen = keys + (u64)i * slots;
    u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float best = NEG_INF;
    for (u32 s = warp; s < slots; s += ROW_THREADS / 32) {
        int j = chosen[s];
        float score = NEG_INF;
        if (j >= 0) {
            const T* k = kv + (u64)j * stride + (u64)head * (nope + vd);
            const T* kr = k_rope + (u64)j * rope;
            float dot_nope = 0.0f, dot_rope = 0.0f;
            for (u32 d = lane; d < nope; d += 32) dot_nope += query[d] * to_f32(k[d]);
            for (u32 d = lane; d < rope; d += 32) dot_rope += query[nope + d] * to_f32(kr[d]);
            score = (warp_sum(dot_nope) + warp_sum(dot_rope)) * scale;
        }
        if (lane == 0) probs[s] = score;
        best = fmaxf(best, score);
    }
    best = block_max(best, scratch);
    float sum = 0.0f;
    for (u32 s = threadIdx.x; s < slots; s += ROW_THREADS) {
        float e = probs[s] == NEG_INF ? 0.0f : expf(probs[s] - best);
        probs[s] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    for (u32 d = threadIdx.x; d < vd; d += ROW_THREADS) {
        float acc = 0.0f;
        for (u32 s = 0; s < slots; s++) {
            float p = probs[s] / sum;
            if (p != 0.0f) acc += p * to_f32(kv[(u64)chosen[s] * stride + (u64)head * (nope + vd) + nope + d]);
        }
        out[((u64)i * heads + head) * vd + d] = acc;
    }
}

#define ATTENTION(T)                                                                            \
    extern "C" __global__ void attention_##T(const u32* nonfinite, const T* q, const T* kv,    \
                                             const T* k_rope, const int* keys, float* out,     \
                                             u32 heads, u32 nope, u32 rope, u32 vd, u32 slots, \
                                             float scale) {                                    \
        attention(nonfinite, q, kv, k_rope, keys, out, heads, nope, rope, vd, slots, scale);    \
    }

ATTENTION(f32)
ATTENTION(bf16)
ATTENTION(f16)

// The scores of query blockIdx.x (of a chunk of `rows`), head blockIdx.y, against every cached
// key (`scores`, head-major: [heads][rows][positions], the sums of the no-RoPE and RoPE
// products cuBLAS left there) become its attention weights in place: scaled, −∞ where the
// query's row of `mask` (a bit per key) has no bit, then softmax'd as the CPU does (the largest,
// exp(score − largest), their sum in a fixed tree order, each divided by it). A key the query
// does not see gets exp(−∞) = 0; a row whose largest is −∞ or NaN becomes NaN, as on the CPU.
extern "C" __global__ void attention_softmax(float* scores, const u32* mask, u32 rows,
                                             u32 positions, u32 words, float scale) {
    __shared__ float scratch[ROW_THREADS];
    u32 i = blockIdx.x, head = blockIdx.y;
    float* row = scores + ((u64)head * rows + i) * positions;
    const u32* seen = mask + (u64)i * words;
    float best = NEG_INF;
    for (u32 j = threadIdx.x; j < positions; j += ROW_THREADS) {
        float x = (seen[j / 32] >> (j % 32)) & 1u ? row[j] * scale : NEG_INF;
        row[j] = x;
        best = fmaxf(best, x);
    }
    best = block_max(best, scratch);
    float sum = 0.0f;
    for (u32 j = threadIdx.x; j < positions; j += ROW_THREADS) {
        float e = expf(row[j] - best);
        row[j] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    for (u32 j = threadIdx.x; j < positions; j += ROW_THREADS) row[j] = row[j] / sum;
}

// Sets *flag where any of the `n` values of `x` is NaN or infinite.
extern "C" __global__ void any_nonfinite_f32(const float* x, u32 n, u32* flag) {
    ELEMENT(e, n);
    if (!isfinite(x[e])) *flag = 1;
}

// Each query's row of `mask` (a bit per cached position) as the list of positions it sees, in
// ascending order as the CPU visits them, then −1 up to `slots`: the keys of `attention` above,
// where *nonfinite is set. Nothing otherwise (the GEMMs' context stands), so that the choice
// between the two needs no trip to the host.
extern "C" __global__ void mask_keys(const u32* nonfinite, const u32* mask, int* keys, u32 rows,
                                     u32 words, u32 slots) {
    if (*nonfinite == 0) return;
    ELEMENT(i, rows);
    const u32* seen = mask + (u64)i * words;
    int* out = keys + (u64)i * slots;
    u32 n = 0;
    for (u32 w = 0; w < words; w++) {
        for (u32 bits = seen[w]; bits != 0 && n < slots; bits &= bits - 1) {
            out[n++] = (int)(w * 32 + __ffs(bits) - 1);
        }
    }
    for (; n < slots; n++) out[n] = -1;
}

// Heads whose dot products `indexer_scores_f32` runs side by side.
#define HEAD_GROUP 16

// The DSA indexer's score of query blockIdx.y (position start + blockIdx.y) against key
// blockIdx.x · blockDim.x + threadIdx.x: Σ_h (w_h · head_scale) · relu(q_h · k · scale), −∞ past
// the query's position. In the CPU's order (`indexer_scores_core`): each dot product and the
// sum over heads from −0 in sequence, every product and sum rounded on its own (--fmad=false),
// relu(x) = x > 0 ? x : +0; so that the two agree bit for bit. The dot products of HEAD_GROUP
// heads run side by side, each key value read once for all of them: each is still its own
// sequence over the dims, and the heads are still summed in order, but the group's sums are
// independent chains the GPU overlaps. The query's heads and weights sit in dynamic shared
// memory, read by every thread alike.
extern "C" __global__ void indexer_scores_f32(const float* q, const float* keys, const float* w,
                                              float* out, u32 total, u32 heads, u32 dim,
                                              u32 start, float scale, float head_scale) {
    extern __shared__ float query[];
    u32 i = blockIdx.y, width = heads * dim;
    for (u32 e = threadIdx.x; e < width; e += blockDim.x) query[e] = q[(u64)i * width + e];
    for (u32 e = threadIdx.x; e < heads; e += blockDim.x) query[width + e] = w[(u64)i * heads + e];
    __syncthreads();
    u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= total) return;
    float score = NEG_INF;
    if (j <= start + i) {
        const float* k = keys + (u64)j * dim;
        score = -0.0f;
        for (u32 h0 = 0; h0 < heads; h0 += HEAD_GROUP) {
            u32 group = min(HEAD_GROUP, heads - h0);
            float dot[HEAD_GROUP];
#pragma unroll
            for (u32 g = 0; g < HEAD_GROUP; g++) dot[g] = -0.0f;
            for (u32 d = 0; d < dim; d++) {
                float kd = k[d];
#pragma unroll
                for (u32 g = 0; g < HEAD_GROUP; g++) {
                    if (g < group) dot[g] = dot[g] + query[(h0 + g) * dim + d] * kd;
                }
            }
#pragma unroll
            for (u32 g = 0; g < HEAD_GROUP; g++) {
                if (g < group) {
                    float r = dot[g] * scale;
                    score = score + query[width + h0 + g] * head_scale * (r > 0.0f ? r : 0.0f);
                }
            }
        }
    }
    out[(u64)i * total + j] = score;
}

// RoPE on f32 rows in place, one thread per (row, head, pair): each row's heads of `width`
// values, the rope dims from `offset`, row r at position start + r; pair i rotated by angle
// position · inv_freq[i] (in f32, as the CPU computes it), cos and sin scaled by `scale`;
// interleaved pairs (x[2i], x[2i+1]) or NeoX halves (x[i], x[i + half]).
extern "C" __global__ void rope_f32(float* x, const float* inv_freq, u32 rows, u32 width,
                                    u32 heads, u32 offset, u32 half, u32 start,
                                    u32 interleaved, float scale) {
    u32 n = rows * heads * half;
    ELEMENT(e, n);
    u32 i = e % half, head = (e / half) % heads, row = e / (half * heads);
    float angle = (float)(start + row) * inv_freq[i];
    float s = sinf(angle) * scale, c = cosf(angle) * scale;
    float* h = x + (u64)row * heads * width + (u64)head * width + offset;
    u32 a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    float x0 = h[a], x1 = h[b];
    h[a] = x0 * c - x1 * s;
    h[b] = x1 * c + x0 * s;
}

// A recorded stage's statistics on the GPU, in the order the host's `trace::stats` takes them,
// so that a stage left on the GPU gets the host's numbers bit for bit without its values
// crossing the bus. Values are the dtype's widened to f32 as the host widens them, then to f64.
// Chunks of STATS_CHUNK values, each summed in STATS_LANES lanes (value j of a chunk into lane
// j mod STATS_LANES, each lane in order). A lane's sum is one sequence, so a block takes a
// chunk: all its STATS_THREADS threads load a tile of the chunk into shared memory (coalesced),
// then the first STATS_LANES threads add their lanes' values of the tile in order.
#define STATS_CHUNK 65536
#define STATS_LANES 16
#define STATS_THREADS 256
#define STATS_TILE 4096

// A value widened to f32 as the host widens it when it fetches the values: exactly, and an f16
// NaN with its payload kept and the quiet bit set (the GPU's own conversion makes every NaN one
// canonical NaN, which the content hash would tell apart).
__device__ __forceinline__ float host_f32(float x) { return x; }
__device__ __forceinline__ float host_f32(bf16 x) { return to_f32(x); }
__device__ __forceinline__ float host_f32(f16 x) {
    u32 sign = (u32)(x.bits & 0x8000u) << 16, man = x.bits & 0x3ffu;
    if ((x.bits & 0x7c00u) == 0x7c00u && man != 0) {
        return __uint_as_float(sign | 0x7fc00000u | (man << 13));
    }
    return to_f32(x);
}

#define POS_INF_D __longlong_as_double(0x7ff0000000000000ll)
#define NEG_INF_D __longlong_as_double(0xfff0000000000000ll)

// Each tile of chunk `chunk` widened into shared memory (coalesced loads by the whole block)
// and handed to `use(tile, count, at)` on every thread, `at` the index of its first value.
template <typename T, typename Use>
__device__ void each_tile(const T* x, u64 n, u64 chunk, Use use) {
    __shared__ float tile[STATS_TILE];
    u64 begin = chunk * STATS_CHUNK, end = min(begin + STATS_CHUNK, n);
    for (u64 at = begin; at < end; at += STATS_TILE) {
        u32 count = (u32)min((u64)STATS_TILE, end - at);
        for (u32 i = threadIdx.x; i < count; i += STATS_THREADS) tile[i] = host_f32(x[at + i]);
        __syncthreads();
        use(tile, count, at);
        __syncthreads();
    }
}

// Every value of chunk `chunk` handed to `add` on its lane's thread (the first STATS_LANES
// threads), each lane's values in order.
template <typename T, typename Add>
__device__ void each_lane_value(const T* x, u64 n, u64 chunk, Add add) {
    each_tile(x, n, chunk, [&](const float* tile, u32 count, u64) {
        if (threadIdx.x < STATS_LANES) {
            for (u32 i = threadIdx.x; i < count; i += STATS_LANES) add((double)tile[i]);
        }
    });
}

// The sketch (`trace::stats::sketch` of the host): each finite value added with its sign to its
// bucket, both from SplitMix64 of the value's index, each bucket's values in index order within
// a chunk. The block computes a tile's slots (bucket, sign in the top bit) into shared memory;
// the second warp, a thread per bucket, adds the tile's values of its bucket in order while the
// first adds the moments' lanes.
#define SKETCH_BUCKETS 32
#define SKETCH_WARP_FIRST 32

__device__ __forceinline__ u8 sketch_slot(u64 i) {
    u64 z = (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (u8)((z % SKETCH_BUCKETS) | ((z >> 63) << 7));
}

// Chunk `chunk`'s lanes: counts [finite, nan, zeros] and sums [sum, sum of squares, min, max],
// each a row of STATS_LANES per chunk; and its sketch's SKETCH_BUCKETS sums.
template <typename T>
__device__ void stage_sums(const T* x, u64 n, u64 chunk, u64* counts, double* sums,
                           double* sketch) {
    __shared__ u8 slots[STATS_TILE];
    u64 finite = 0, nan = 0, zeros = 0;
    double sum = 0.0, sq = 0.0, lo = POS_INF_D, hi = NEG_INF_D, bucket = 0.0;
    u32 mine = threadIdx.x - SKETCH_WARP_FIRST;
    bool sketching = threadIdx.x >= SKETCH_WARP_FIRST && mine < SKETCH_BUCKETS;
    each_tile(x, n, chunk, [&](const float* tile, u32 count, u64 at) {
        for (u32 i = threadIdx.x; i < count; i += STATS_THREADS) slots[i] = sketch_slot(at + i);
        __syncthreads();
        if (threadIdx.x < STATS_LANES) {
            for (u32 i = threadIdx.x; i < count; i += STATS_LANES) {
                double v = (double)tile[i];
                bool fin = isfinite(v);
                double f = fin ? v : 0.0;
                sum = __dadd_rn(sum, f);
                sq = __dadd_rn(sq, __dmul_rn(f, f));
                if (fin) {
                    lo = v < lo ? v : lo;
                    hi = v > hi ? v : hi;
                }
                finite += fin;
                nan += isnan(v);
                zeros += v == 0.0;
            }
        } else if (sketching) {
            for (u32 i = 0; i < count; i++) {
                u8 s = slots[i];
                double v = (double)tile[i];
                if ((s & 0x7f) == mine && isfinite(v)) bucket = __dadd_rn(bucket, s >> 7 ? -v : v);
            }
        }
    });
    if (sketching) sketch[chunk * SKETCH_BUCKETS + mine] = bucket;
    u32 lane = threadIdx.x;
    if (lane >= STATS_LANES) return;
    u64* c = counts + chunk * 3 * STATS_LANES + lane;
    c[0] = finite;
    c[STATS_LANES] = nan;
    c[2 * STATS_LANES] = zeros;
    double* s = sums + chunk * 4 * STATS_LANES + lane;
    s[0] = sum;
    s[STATS_LANES] = sq;
    s[2 * STATS_LANES] = lo;
    s[3 * STATS_LANES] = hi;
}

// The mean of the finite values from every chunk's lanes, merged as the host merges them: each
// chunk's lanes in order from +0, then the chunks in order; 0 when none is finite. Every thread
// of the block calls it and gets it; the block loads the lanes of 16 chunks at a time, its
// first thread adds them in order.
__device__ double merged_mean(const u64* counts, const double* sums, u64 chunks) {
    __shared__ double part[STATS_THREADS];
    __shared__ u64 seen[STATS_THREADS];
    __shared__ double mean;
    const u64 per = STATS_THREADS / STATS_LANES;
    double total = 0.0;
    u64 finite = 0;
    for (u64 c0 = 0; c0 < chunks; c0 += per) {
        u64 c = c0 + threadIdx.x / STATS_LANES, l = threadIdx.x % STATS_LANES;
        if (c < chunks) {
            part[threadIdx.x] = sums[c * 4 * STATS_LANES + l];
            seen[threadIdx.x] = counts[c * 3 * STATS_LANES + l];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (u64 k = 0; k < per && c0 + k < chunks; k++) {
                double s = 0.0;
                for (u32 i = 0; i < STATS_LANES; i++) {
                    s = __dadd_rn(s, part[k * STATS_LANES + i]);
                    finite += seen[k * STATS_LANES + i];
                }
                total = c0 + k == 0 ? s : __dadd_rn(total, s);
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) mean = finite > 0 ? __ddiv_rn(total, (double)finite) : 0.0;
    __syncthreads();
    return mean;
}

// Chunk `chunk`'s lanes' sums of squared deviations from `mean` over their finite values.
template <typename T>
__device__ void stage_deviations(const T* x, u64 n, u64 chunk, double mean, double* out) {
    double acc = 0.0;
    each_lane_value(x, n, chunk, [&](double v) {
        double d = __dadd_rn(v, -mean);
        acc = __dadd_rn(acc, isfinite(v) ? __dmul_rn(d, d) : 0.0);
    });
    if (threadIdx.x < STATS_LANES) out[chunk * STATS_LANES + threadIdx.x] = acc;
}

// The content hash's lanes (`lane_hash` of the host): the values' f32 bytes in pieces of
// HASH_PIECE bytes, each piece's little-endian u64 words fed word w to lane w mod HASH_LANES
// with xxHash64's round, the last word zero-padded. A block per piece, a thread per lane, its
// words loaded HASH_BATCH at a time (the loads overlap, the rounds stay in order); the host
// merges each piece's lanes and the pieces.
#define HASH_PIECE (1 << 20)
#define HASH_LANES 256
#define XX_P1 0x9E3779B185EBCA87ull
#define XX_P2 0xC2B2AE3D27D4EB4Full
#define HASH_BATCH 16

template <typename T>
__device__ __forceinline__ u64 hash_word(const T* x, u64 n, u64 e) {
    u64 lo = __float_as_uint(host_f32(x[e]));
    u64 hi = e + 1 < n ? __float_as_uint(host_f32(x[e + 1])) : 0;
    return lo | (hi << 32);
}

template <typename T>
__device__ void stage_hash_lanes(const T* x, u64 n, u64 piece, u64* lanes) {
    u64 lane = threadIdx.x;
    u64 bytes = n * 4, begin = piece * HASH_PIECE;
    u64 len = min((u64)HASH_PIECE, bytes - begin);
    u64 words = (len + 7) / 8, first = begin / 4;
    u64 acc = XX_P1 + XX_P2;
    for (u64 w0 = lane; w0 < words; w0 += HASH_BATCH * HASH_LANES) {
        u64 word[HASH_BATCH];
#pragma unroll
        for (u32 k = 0; k < HASH_BATCH; k++) {
            u64 w = w0 + k * HASH_LANES;
            word[k] = w < words ? hash_word(x, n, first + 2 * w) : 0;
        }
#pragma unroll
        for (u32 k = 0; k < HASH_BATCH; k++) {
            if (w0 + k * HASH_LANES >= words) break;
            acc += word[k] * XX_P2;
            acc = ((acc << 31) | (acc >> 33)) * XX_P1;
        }
    }
    lanes[piece * HASH_LANES + lane] = acc;
}

// A stage's statistics in two launches (each a driver call on the host's critical path): the
// first pass, a block per chunk's sums then a block per hash piece; the second, each chunk's
// block merging the mean itself (the same order, the same bits; the first block stores it for
// the host's check) before its deviations.
#define STAGE_STATS(T)                                                                         \
    extern "C" __global__ void stage_sums_hash_##T(const T* x, u64 n, u64 chunks, u64* counts, \
                                                   double* sums, double* sketch, u64* lanes) { \
        if (blockIdx.x < chunks) {                                                             \
            stage_sums(x, n, blockIdx.x, counts, sums, sketch);                                \
        } else {                                                                               \
            stage_hash_lanes(x, n, blockIdx.x - chunks, lanes);                                \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void stage_deviations_##T(const T* x, u64 n, const u64* counts,      \
                                                    const double* sums, u64 chunks,            \
                                                    double* mean, double* out) {               \
        double m = merged_mean(counts, sums, chunks);                                          \
        if (blockIdx.x == 0 && threadIdx.x == 0) *mean = m;                                    \
        stage_deviations(x, n, blockIdx.x, m, out);                                            \
    }

STAGE_STATS(f32)
STAGE_STATS(bf16)
STAGE_STATS(f16)

// Columns from..from + len of each head (heads of `width` values side by side), one after
// another: the rotated RoPE dims of a query, recorded apart; kv_a's latent and RoPE key.
#define HEAD_COLUMNS(T)                                                                         \
    extern "C" __global__ void head_columns_##T(const T* x, T* y, u32 width, u32 from, u32 len, \
                                                u32 n) {                                        \
        ELEMENT(e, n);                                                                          \
        y[e] = x[(u64)(e / len) * width + from + e % len];                                      \
    }

HEAD_COLUMNS(f32)
HEAD_COLUMNS(bf16)
HEAD_COLUMNS(f16)

// Values widened to f32 as the host widens them (an op that computes in f32 in place, RoPE, on
// an output left on the GPU in the dtype: a value it passes through keeps the host's bits).
#define WIDEN(T)                                                        \
    extern "C" __global__ void widen_##T(const T* x, float* y, u32 n) { \
        ELEMENT(e, n);                                                  \
        y[e] = host_f32(x[e]);                                          \
    }

WIDEN(f32)
WIDEN(bf16)
WIDEN(f16)
