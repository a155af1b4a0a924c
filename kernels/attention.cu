// Fused causal attention (the FlashAttention-2 algorithm), forward and backward, with grouped
// query heads (GQA): cutp.ops.causal_attention_forward/backward's kernels on a GPU.
//
//   o = softmax(mask(cap(scale * q k^T))) v     per query head and the KV head of its group
//
// The mask is cutp's attention mask rule (struct Mask): causal, an optional sliding window, and
// optional documents (packed sequences: a key is seen only from a query of its document); cap is
// the optional logit soft cap, softcap * tanh(x / softcap).
//
// Nothing T x T is ever stored: the forward walks the key/value tiles of a query tile with an
// online softmax (running row max m and sum l, the accumulated output rescaled by exp(m_old -
// m_new) when the max grows) and writes o and the row's log-sum-exp lse = m + log(l); the
// backward recomputes each tile's probabilities from q k^T and lse.
//   attention_forward     grid (B * Hkv * G, query tiles); key tiles outside the causal band or
//                         the window, or with none of the query tile's documents, are never
//                         visited, the others masked; the longest rows first.
//   attention_backward_rowdot  D[row] = sum(dO * O) over the head dim (FA-2's precompute).
//   attention_backward_dq grid (B * Hkv * G, query tiles): per query tile, over its key tiles,
//                         dS = P * (dP - D) with dP = dO v^T, dq = scale * dS k.
//   attention_backward_dkdv grid (B * Hkv, key tiles): per key tile of a KV head, over the G
//                         query heads of its group and their query tiles that see its keys,
//                         dv = P^T dO, dk = scale * dS^T q: a shared KV head's gradient is summed
//                         in the block, never copied per query head, and never needs atomics.
// One tile of context parallelism's ring attention runs on the same kernels: the causal rule is a
// diagonal shift (query row i sees keys j <= diag + i: Tk - Tq for the one-rank attention, 0 for
// a ring's diagonal tile, Tk for a full one; a row that sees no key gets o = 0, lse = -inf), the
// dropout counters take the whole sequence's
// strides, the backward takes the merged lse and rowdot, and the outputs may be float32 for
// 16-bit inputs, added to the ring's accumulators (Out).
// dq and dk/dv in two kernels rather than dq by float atomics: deterministic results (the
// price: S and dP computed twice). Attention-probability dropout is applied in place (the masks of
// cutp.ops.dropout_forward_rows, recomputed from the counter hash in the backward: no mask stored).
//
// Head dims: D of q and k (the scores' sum), DV of v, o and dO (MLA's differ: 192 and 128); every
// tile, accumulator and loop over a head dim takes the operand's own.
// Layout: a tile is R rows (R = 16 x the block's warps); each warp owns a band of 16 rows of
// every tile product ("band_gemm"): float32 inputs multiply on the CUDA cores (each lane two or
// four columns of the band, all 16 rows, in registers), bfloat16 inputs on the tensor cores
// (nvcuda::wmma, m16n16k16, float accumulation). Accumulators (o, dq, dk, dv) and score tiles
// live in float32 shared memory, so the wmma fragment layout, which CUDA leaves unspecified,
// never matters. Shared tiles are padded (see the *_ld helpers) against bank conflicts and to
// keep every wmma pointer 32-byte aligned. The launcher (kernels/attention.py) sizes the dynamic
// shared memory with the same formulas (attention_shared_bytes) and picks R per kernel and head
// dim. Offsets of q, k, v, o and the gradients are 64-bit strides (views of a fused QKV
// projection's output need no copy); the head dim is contiguous.
#define CUTP_TENSOR_CORES
#include "common.cuh"

namespace attn_impl {

constexpr int BAND = 16;  // rows per warp: the wmma tile's height

// Row strides (elements) of the shared tiles. Inputs: float rows D + 1 (a lane per row of an
// n-by-k read walks the banks), bf16 rows D + 8 (wmma's ldm must be a multiple of 16 bytes).
template <typename T>
__host__ __device__ constexpr int input_ld(int D) {
    return sizeof(T) == 4 ? D + 1 : D + 8;
}
__host__ __device__ constexpr int score_ld(int R) { return R + 4; }   // float score tiles
__host__ __device__ constexpr int prob_ld(int R) { return R + 8; }    // bf16 probability tiles
__host__ __device__ constexpr int accum_ld(int D) { return D + 4; }   // float accumulators

// C[16][N] = (ACC ? C : 0) + A[16][K] op(B); op(B) = B^T with B stored [N][K] (NT), else B [K][N];
// row strides LDC, LDA, LDB (compile-time, like every tile shape here). One warp; every lane must
// call it. float: a lane computes columns lane + 32 j of all 16 rows.
template <int N, int K, bool NT, bool ACC, int LDC, int LDA, int LDB>
__device__ __forceinline__ void band_gemm(float* C, const float* A, const float* B) {
    constexpr int J = N / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    float acc[BAND][J];
#pragma unroll
    for (int r = 0; r < BAND; ++r)
#pragma unroll
        for (int j = 0; j < J; ++j) acc[r][j] = ACC ? C[r * LDC + lane + WARP_SIZE * j] : 0.0f;
    for (int k = 0; k < K; ++k) {
        float b[J];
#pragma unroll
        for (int j = 0; j < J; ++j) b[j] = NT ? B[(lane + WARP_SIZE * j) * LDB + k] : B[k * LDB + lane + WARP_SIZE * j];
#pragma unroll
        for (int r = 0; r < BAND; ++r) {
            const float a = A[r * LDA + k];
#pragma unroll
            for (int j = 0; j < J; ++j) acc[r][j] += a * b[j];
        }
    }
#pragma unroll
    for (int r = 0; r < BAND; ++r)
#pragma unroll
        for (int j = 0; j < J; ++j) C[r * LDC + lane + WARP_SIZE * j] = acc[r][j];
}

// B's fragment layout: B^T stored [N][K] is B column-major (NVRTC has no <type_traits>).
template <bool NT>
struct BLayout {
    using type = nvcuda::wmma::row_major;
};
template <>
struct BLayout<true> {
    using type = nvcuda::wmma::col_major;
};

// bf16: tensor cores, one 16 x 16 output fragment at a time through float shared memory.
template <int N, int K, bool NT, bool ACC, int LDC, int LDA, int LDB>
__device__ __forceinline__ void band_gemm(float* C, const __nv_bfloat16* A, const __nv_bfloat16* B) {
    using namespace nvcuda;
    for (int n0 = 0; n0 < N; n0 += 16) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
        if (ACC) {
            wmma::load_matrix_sync(c, C + n0, LDC, wmma::mem_row_major);
        } else {
            wmma::fill_fragment(c, 0.0f);
        }
        for (int k0 = 0; k0 < K; k0 += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, typename BLayout<NT>::type> b;
            wmma::load_matrix_sync(a, A + k0, LDA);
            wmma::load_matrix_sync(b, NT ? B + n0 * LDB + k0 : B + k0 * LDB + n0, LDB);
            wmma::mma_sync(c, a, b, c);
        }
        wmma::store_matrix_sync(C + n0, c, LDC, wmma::mem_row_major);
    }
}

// Rows [t0, t0 + R) of one head (row t at base + t * st, D contiguous elements) into a shared
// tile of row stride ld; rows t >= t_end are zeros. Every thread of the block takes part.
template <typename T, int D, int R>
__device__ __forceinline__ void load_tile(T* tile, const T* base, long long st, int t0, int t_end) {
    constexpr int LD = input_ld<T>(D);
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
        const int r = e / D, c = e % D;
        const int t = t0 + r;
        tile[r * LD + c] = t < t_end ? base[t * st + c] : from_float<T>(0.0f);
    }
}

// Where a kernel's probability-like operand (P, dS) lives: float kernels overwrite the float
// score tile in place (each lane rewrites exactly the elements it read), bf16 kernels need a
// bf16 copy for the tensor cores.
template <typename T>
struct ProbTile {
    static constexpr bool separate = sizeof(T) != 4;
    __host__ __device__ static constexpr int ld(int R) { return separate ? prob_ld(R) : score_ld(R); }
};

// The attention-probability dropout: probability (head h, query row i, key j) of batch row b is
// counter offsets[b] + h head_stride + i row_stride + j of dropout_keep. The launcher's defaults
// (head_stride Tq Tk, row_stride Tk) are cutp.ops.dropout_forward_rows's masks of the [H, Tq, Tk]
// probabilities (H = Hkv * G local heads); a ring tile passes the whole sequence's strides (T^2, T)
// with its first query's and key's global places folded into offsets[b]. offsets null: no dropout.
struct ProbDropout {
    const long long* offsets;
    unsigned long long seed;
    unsigned int threshold;
    float scale;  // 1 / (1 - p), 0 for p = 1
    long long head_stride, row_stride;

    // The factor of probability (head h of batch row b, query row i, key j): scale or 0; 1 without dropout.
    __device__ __forceinline__ float factor(long long b, long long h, int i, int j) const {
        if (offsets == nullptr) return 1.0f;
        const unsigned long long index = (unsigned long long)(h * head_stride + i * row_stride + j);
        return dropout_keep(seed, (unsigned long long)offsets[b], index, threshold) ? scale : 0.0f;
    }
};

// Which keys a query row sees, and the scores' soft cap (cutp's attention mask rule, in a tile's
// local rows): key j is visible from query row i iff diag + i - window < j <= diag + i (diag =
// q_first - k_first, the global places of the first query and key; window >= 1, the launcher's
// "no window" is one no row reaches) and, with documents, q_docs[b][i] == k_docs[b][j] (int32
// document ids of the batch row, non-decreasing along the sequence). softcap > 0: a score x =
// scale q.k becomes softcap tanh(x / softcap) before the mask and the softmax.
struct Mask {
    int diag, window;
    float softcap;
    const int* q_docs;  // [B, Tq] and [B, Tk], or both null: one document per row
    const int* k_docs;

    // Key j of document kdoc seen from query row i of document qdoc.
    __device__ __forceinline__ bool visible(int i, int j, int qdoc, int kdoc) const {
        return j <= diag + i && j > diag + i - window && qdoc == kdoc;
    }
    // The capped score of x, and in dcap its derivative (1 - tanh^2; 1 without a cap).
    __device__ __forceinline__ float capped(float x, float& dcap) const {
        if (softcap <= 0.0f) {
            dcap = 1.0f;
            return x;
        }
        const float t = tanhf(x / softcap);
        dcap = 1.0f - t * t;
        return softcap * t;
    }
    // The document id of row t of batch row b of a [B, n] table (0 without documents).
    __device__ __forceinline__ static int doc(const int* docs, long long b, long long n, int t) {
        return docs == nullptr ? 0 : docs[b * n + t];
    }
    // Whether a tile's query rows [q0, q1] and keys [k0, k1] (inclusive, in range) can meet a
    // document: ids are non-decreasing, so a tile's documents are those from its first row's to
    // its last row's. Block-uniform.
    __device__ __forceinline__ bool docs_meet(long long b, int Tq, int Tk, int q0, int q1, int k0, int k1) const {
        if (q_docs == nullptr) return true;
        return doc(k_docs, b, Tk, k1) >= doc(q_docs, b, Tq, q0) && doc(k_docs, b, Tk, k0) <= doc(q_docs, b, Tq, q1);
    }
    // The first key any of query rows [q0, q1] sees (may be <= 0), and one past the last (may be < 1).
    __device__ __forceinline__ int first_key(int q0) const { return diag + q0 - window + 1; }
    __device__ __forceinline__ int end_key(int q1) const { return diag + q1 + 1; }
    // The first query row that sees any of keys [k0, k1], and one past the last.
    __device__ __forceinline__ int first_query(int k0) const { return k0 - diag; }
    __device__ __forceinline__ int end_query(int k1) const { return k1 - diag + window; }
};

// Where a kernel writes an output: storage of the input type (t), or float32 (f, for 16-bit inputs:
// the ring attention's float32 tiles and accumulators), overwritten or, with acc, added to (one
// thread per element: deterministic). Exactly one of t, f is non-null.
template <typename T>
struct Out {
    T* t;
    float* f;
    int acc;
    __device__ __forceinline__ void store(long long i, float x) const {
        if (f != nullptr) {
            f[i] = acc ? f[i] + x : x;
        } else {
            t[i] = from_float<T>(acc ? to_float(t[i]) + x : x);
        }
    }
};

template <typename T, int D, int DV, int R>
__device__ void forward(Out<T> o, float* lse, const T* q, const T* k, const T* v, int Hkv, int G, int Tq, int Tk,
                        Mask mask,
                        long long q_sb, long long q_sh, long long q_sg, long long q_st, long long k_sb, long long k_sh,
                        long long k_st, long long v_sb, long long v_sh, long long v_st, float scale,
                        ProbDropout drop) {
    constexpr int LD = input_ld<T>(D), VLD = input_ld<T>(DV), SLD = score_ld(R), OLD = accum_ld(DV);
    extern __shared__ __align__(32) unsigned char smem[];
    T* Qs = reinterpret_cast<T*>(smem);
    T* Ks = Qs + R * LD;
    T* Vs = Ks + R * LD;
    float* Ss = reinterpret_cast<float*>(Vs + R * VLD);
    float* Os = Ss + R * SLD;
    T* Ps = ProbTile<T>::separate ? reinterpret_cast<T*>(Os + R * OLD) : reinterpret_cast<T*>(Ss);
    constexpr int PLD = ProbTile<T>::ld(R);
    int* kdoc_s = reinterpret_cast<int*>(ProbTile<T>::separate ? reinterpret_cast<float*>(Ps + R * PLD) : Os + R * OLD);

    const long long bh = blockIdx.x;  // (b, hk, g) of the query head: on x, whose limit is 2^31 - 1
    const long long b = bh / ((long long)Hkv * G), hk = (bh / G) % Hkv, g = bh % G;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * R;  // the longest rows first
    const T* qb = q + b * q_sb + hk * q_sh + g * q_sg;
    const T* kb = k + b * k_sb + hk * k_sh;
    const T* vb = v + b * v_sb + hk * v_sh;

    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int r = lane >> 1, half = lane & 1;  // this lane's row of the warp's band, and which columns
    const int row = warp * BAND + r;
    const int qdoc = q0 + row < Tq ? Mask::doc(mask.q_docs, b, Tq, q0 + row) : 0;
    float* Ob = Os + warp * BAND * OLD;
    float* Sb = Ss + warp * BAND * SLD;
    T* Pb = Ps + warp * BAND * PLD;

    load_tile<T, D, R>(Qs, qb, q_st, q0, Tq);
    for (int e = lane; e < BAND * DV; e += WARP_SIZE) Ob[(e / DV) * OLD + e % DV] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    // Key tiles [k_begin, k_end) hold every key a row of this tile sees: those wholly outside the
    // causal band or the window are never visited, nor (below) those with none of its documents.
    const int q_last = min(q0 + R, Tq) - 1;
    const int k_begin = max(0, mask.first_key(q0)), k_end = min(Tk, mask.end_key(q_last));
    for (int k0 = k_begin - k_begin % R; k0 < k_end; k0 += R) {
        if (!mask.docs_meet(b, Tq, Tk, q0, q_last, k0, min(k0 + R, Tk) - 1)) continue;
        __syncthreads();  // every warp is done with the previous K, V tiles
        load_tile<T, D, R>(Ks, kb, k_st, k0, Tk);
        load_tile<T, DV, R>(Vs, vb, v_st, k0, Tk);
        for (int i = threadIdx.x; i < R; i += blockDim.x) kdoc_s[i] = k0 + i < Tk ? Mask::doc(mask.k_docs, b, Tk, k0 + i) : -1;
        __syncthreads();
        band_gemm<R, D, true, false, SLD, LD, LD>(Sb, Qs + warp * BAND * LD, Ks);
        __syncwarp();
        // Online softmax of the band's row: this lane has columns half, half + 2, ...
        float s[R / 2];
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < R / 2; ++j) {
            const int c = 2 * j + half, key = k0 + c;
            float dcap;
            const float x = mask.capped(Sb[r * SLD + c] * scale, dcap);
            s[j] = (key < Tk && mask.visible(q0 + row, key, qdoc, kdoc_s[c])) ? x : -INFINITY;
            tile_max = fmaxf(tile_max, s[j]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 1));
        // -inf while the row has seen no key (a window or a document can hide a whole tile from
        // it): its p and alpha are then exp(-inf) = 0, never exp(-inf + inf)
        const float m_new = fmaxf(m, tile_max);
        const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
        float row_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < R / 2; ++j) {
            const float p = expf(s[j] - m_ref);
            row_sum += p;  // the softmax's sum: before dropout
            const float f = drop.factor(b, hk * G + g, q0 + row, k0 + 2 * j + half);
            Pb[r * PLD + 2 * j + half] = from_float<T>(p * f);
        }
        row_sum += __shfl_xor_sync(FULL_MASK, row_sum, 1);
        const float alpha = expf(m - m_ref);  // 0 on the row's first seen tile (m = -inf)
        l = l * alpha + row_sum;
        m = m_new;
        // O rows *= alpha, a row at a time (the lanes over its columns)
        for (int rr = 0; rr < BAND; ++rr) {
            const float a = __shfl_sync(FULL_MASK, alpha, 2 * rr);
            for (int d = lane; d < DV; d += WARP_SIZE) Ob[rr * OLD + d] *= a;
        }
        __syncwarp();
        band_gemm<DV, R, false, true, OLD, PLD, VLD>(Ob, Pb, Vs);
    }
    __syncwarp();
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // a row that sees no key: o = 0, lse = -inf
    for (int rr = 0; rr < BAND; ++rr) {
        const float inv = __shfl_sync(FULL_MASK, inv_l, 2 * rr);
        const int t = q0 + warp * BAND + rr;
        if (t < Tq) {
            const long long orow = (((b * Tq + t) * Hkv + hk) * G + g) * DV;  // token-major [B, Tq, Hkv, G, DV]
            for (int d = lane; d < DV; d += WARP_SIZE) o.store(orow + d, Ob[rr * OLD + d] * inv);
        }
    }
    if (half == 0 && q0 + row < Tq) lse[bh * Tq + q0 + row] = l > 0.0f ? m + logf(l) : -INFINITY;
}

// D[row] = sum_d dO[row, d] * O[row, d] in float: a warp per (query head, row).
template <typename T, int D>
__device__ void backward_rowdot(float* out, const T* o, const T* dout, int Hkv, int G, int Tq, long long o_sb,
                                long long o_sh, long long o_sg, long long o_st, long long do_sb, long long do_sh,
                                long long do_sg, long long do_st, long long n_rows) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= n_rows) return;  // whole warps: no barrier or full-mask operation follows for them
    const long long t = row % Tq, bh = row / Tq;
    const long long b = bh / ((long long)Hkv * G), hk = (bh / G) % Hkv, g = bh % G;
    const T* orow = o + b * o_sb + hk * o_sh + g * o_sg + t * o_st;
    const T* drow = dout + b * do_sb + hk * do_sh + g * do_sg + t * do_st;
    float acc = 0.0f;
    for (int d = lane; d < D; d += WARP_SIZE) acc += to_float(orow[d]) * to_float(drow[d]);
    acc = warp_reduce_sum(acc);
    if (lane == 0) out[row] = acc;
}

template <typename T, int D, int DV, int R>
__device__ void backward_dq(Out<T> dq, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                            const float* rowdot, int Hkv, int G, int Tq, int Tk, Mask mask, long long q_sb,
                            long long q_sh, long long q_sg, long long q_st, long long k_sb, long long k_sh, long long k_st,
                            long long v_sb, long long v_sh, long long v_st, long long do_sb, long long do_sh,
                            long long do_sg, long long do_st, long long dq_sb, long long dq_sh, long long dq_sg,
                            long long dq_st, float scale, ProbDropout drop) {
    constexpr int LD = input_ld<T>(D), VLD = input_ld<T>(DV), SLD = score_ld(R), OLD = accum_ld(D);
    extern __shared__ __align__(32) unsigned char smem[];
    T* Qs = reinterpret_cast<T*>(smem);
    T* dOs = Qs + R * LD;
    T* Ks = dOs + R * VLD;
    T* Vs = Ks + R * LD;
    float* Ss = reinterpret_cast<float*>(Vs + R * VLD);
    float* dPs = Ss + R * SLD;
    float* dQs = dPs + R * SLD;
    T* Ps = ProbTile<T>::separate ? reinterpret_cast<T*>(dQs + R * OLD) : reinterpret_cast<T*>(Ss);
    constexpr int PLD = ProbTile<T>::ld(R);
    int* kdoc_s = reinterpret_cast<int*>(ProbTile<T>::separate ? reinterpret_cast<float*>(Ps + R * PLD) : dQs + R * OLD);

    const long long bh = blockIdx.x;
    const long long b = bh / ((long long)Hkv * G), hk = (bh / G) % Hkv, g = bh % G;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * R;
    const T* kb = k + b * k_sb + hk * k_sh;
    const T* vb = v + b * v_sb + hk * v_sh;

    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int r = lane >> 1, half = lane & 1;
    const int t = q0 + warp * BAND + r;
    const int qdoc = t < Tq ? Mask::doc(mask.q_docs, b, Tq, t) : 0;
    const float row_lse = t < Tq ? lse[bh * Tq + t] : 0.0f;
    const float row_dot = t < Tq ? rowdot[bh * Tq + t] : 0.0f;
    float* dQb = dQs + warp * BAND * OLD;
    float* Sb = Ss + warp * BAND * SLD;
    float* dPb = dPs + warp * BAND * SLD;
    T* Pb = Ps + warp * BAND * PLD;

    load_tile<T, D, R>(Qs, q + b * q_sb + hk * q_sh + g * q_sg, q_st, q0, Tq);
    load_tile<T, DV, R>(dOs, dout + b * do_sb + hk * do_sh + g * do_sg, do_st, q0, Tq);
    for (int e = lane; e < BAND * D; e += WARP_SIZE) dQb[(e / D) * OLD + e % D] = 0.0f;
    const int q_last = min(q0 + R, Tq) - 1;  // the forward's key tiles
    const int k_begin = max(0, mask.first_key(q0)), k_end = min(Tk, mask.end_key(q_last));
    for (int k0 = k_begin - k_begin % R; k0 < k_end; k0 += R) {
        if (!mask.docs_meet(b, Tq, Tk, q0, q_last, k0, min(k0 + R, Tk) - 1)) continue;
        __syncthreads();
        load_tile<T, D, R>(Ks, kb, k_st, k0, Tk);
        load_tile<T, DV, R>(Vs, vb, v_st, k0, Tk);
        for (int i = threadIdx.x; i < R; i += blockDim.x) kdoc_s[i] = k0 + i < Tk ? Mask::doc(mask.k_docs, b, Tk, k0 + i) : -1;
        __syncthreads();
        band_gemm<R, D, true, false, SLD, LD, LD>(Sb, Qs + warp * BAND * LD, Ks);
        band_gemm<R, DV, true, false, SLD, VLD, VLD>(dPb, dOs + warp * BAND * VLD, Vs);
        __syncwarp();
#pragma unroll
        for (int j = 0; j < R / 2; ++j) {
            const int c = 2 * j + half, key = k0 + c;
            const bool seen = key < Tk && t < Tq && mask.visible(t, key, qdoc, kdoc_s[c]);
            float dcap;  // the soft cap's derivative: dS of the raw score = dS of the capped one * dcap
            const float x = mask.capped(Sb[r * SLD + c] * scale, dcap);
            const float p = seen ? expf(x - row_lse) : 0.0f;
            const float f = drop.factor(b, hk * G + g, t, key);  // dropout's gradient: dP * factor
            Pb[r * PLD + c] = from_float<T>(p * (dPb[r * SLD + c] * f - row_dot) * dcap);
        }
        __syncwarp();
        band_gemm<D, R, false, true, OLD, PLD, LD>(dQb, Pb, Ks);
    }
    __syncwarp();
    for (int rr = 0; rr < BAND; ++rr) {
        const int tt = q0 + warp * BAND + rr;
        if (tt < Tq) {
            const long long out = b * dq_sb + hk * dq_sh + g * dq_sg + tt * dq_st;
            for (int d = lane; d < D; d += WARP_SIZE) dq.store(out + d, dQb[rr * OLD + d] * scale);
        }
    }
}

template <typename T, int D, int DV, int R>
__device__ void backward_dkdv(Out<T> dk, Out<T> dv, const T* q, const T* k, const T* v, const T* dout,
                              const float* lse, const float* rowdot, int Hkv, int G, int Tq, int Tk, Mask mask,
                              long long q_sb, long long q_sh,
                              long long q_sg, long long q_st, long long k_sb, long long k_sh, long long k_st,
                              long long v_sb, long long v_sh, long long v_st, long long do_sb, long long do_sh,
                              long long do_sg, long long do_st, long long dk_sb, long long dk_sh, long long dk_st,
                              long long dv_sb, long long dv_sh, long long dv_st, float scale, ProbDropout drop) {
    constexpr int LD = input_ld<T>(D), VLD = input_ld<T>(DV), SLD = score_ld(R), OLD = accum_ld(D),
                  VOLD = accum_ld(DV);
    extern __shared__ __align__(32) unsigned char smem[];
    T* Ks = reinterpret_cast<T*>(smem);
    T* Vs = Ks + R * LD;
    T* Qs = Vs + R * VLD;
    T* dOs = Qs + R * LD;
    float* STs = reinterpret_cast<float*>(dOs + R * VLD);  // S^T: [keys][queries]
    float* dPTs = STs + R * SLD;
    float* dKs = dPTs + R * SLD;
    float* dVs = dKs + R * OLD;
    float* lse_s = dVs + R * VOLD;
    float* dot_s = lse_s + R;
    T* PTs = ProbTile<T>::separate ? reinterpret_cast<T*>(dot_s + R) : reinterpret_cast<T*>(STs);
    T* dSTs = ProbTile<T>::separate ? PTs + R * prob_ld(R) : reinterpret_cast<T*>(dPTs);
    constexpr int PLD = ProbTile<T>::ld(R);
    int* qdoc_s = reinterpret_cast<int*>(ProbTile<T>::separate ? reinterpret_cast<float*>(dSTs + R * PLD) : dot_s + R);

    const long long bk = blockIdx.x;  // (b, hk)
    const long long b = bk / Hkv, hk = bk % Hkv;
    const int k0 = (gridDim.y - 1 - blockIdx.y) * R;  // the most query tiles first

    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int r = lane >> 1, half = lane & 1;
    const int kpos = k0 + warp * BAND + r;
    const int kdoc = kpos < Tk ? Mask::doc(mask.k_docs, b, Tk, kpos) : 0;
    float* STb = STs + warp * BAND * SLD;
    float* dPTb = dPTs + warp * BAND * SLD;
    float* dKb = dKs + warp * BAND * OLD;
    float* dVb = dVs + warp * BAND * VOLD;
    T* PTb = PTs + warp * BAND * PLD;
    T* dSTb = dSTs + warp * BAND * PLD;

    load_tile<T, D, R>(Ks, k + b * k_sb + hk * k_sh, k_st, k0, Tk);
    load_tile<T, DV, R>(Vs, v + b * v_sb + hk * v_sh, v_st, k0, Tk);
    for (int e = lane; e < BAND * D; e += WARP_SIZE) dKb[(e / D) * OLD + e % D] = 0.0f;
    for (int e = lane; e < BAND * DV; e += WARP_SIZE) dVb[(e / DV) * VOLD + e % DV] = 0.0f;
    // Query tiles [q_begin, q_end) hold every query row that sees a key of this tile (those outside
    // the causal band or the window never visited, nor those with none of its documents).
    const int k_last = min(k0 + R, Tk) - 1;
    const int q_begin = max(0, mask.first_query(k0)), q_end = min(Tq, mask.end_query(k_last));
    for (int g = 0; g < G; ++g) {
        const long long bh = bk * G + g;
        const T* qb = q + b * q_sb + hk * q_sh + g * q_sg;
        const T* db = dout + b * do_sb + hk * do_sh + g * do_sg;
        for (int q0 = q_begin - q_begin % R; q0 < q_end; q0 += R) {
            if (!mask.docs_meet(b, Tq, Tk, q0, min(q0 + R, Tq) - 1, k0, k_last)) continue;
            __syncthreads();  // every warp is done with the previous Q, dO tiles
            load_tile<T, D, R>(Qs, qb, q_st, q0, Tq);
            load_tile<T, DV, R>(dOs, db, do_st, q0, Tq);
            for (int i = threadIdx.x; i < R; i += blockDim.x) {
                lse_s[i] = q0 + i < Tq ? lse[bh * Tq + q0 + i] : 0.0f;
                dot_s[i] = q0 + i < Tq ? rowdot[bh * Tq + q0 + i] : 0.0f;
                qdoc_s[i] = q0 + i < Tq ? Mask::doc(mask.q_docs, b, Tq, q0 + i) : -1;
            }
            __syncthreads();
            band_gemm<R, D, true, false, SLD, LD, LD>(STb, Ks + warp * BAND * LD, Qs);
            band_gemm<R, DV, true, false, SLD, VLD, VLD>(dPTb, Vs + warp * BAND * VLD, dOs);
            __syncwarp();
#pragma unroll
            for (int j = 0; j < R / 2; ++j) {
                const int c = 2 * j + half, t = q0 + c;
                const bool seen = t < Tq && kpos < Tk && mask.visible(t, kpos, qdoc_s[c], kdoc);
                float dcap;
                const float x = mask.capped(STb[r * SLD + c] * scale, dcap);
                const float p = seen ? expf(x - lse_s[c]) : 0.0f;
                const float f = drop.factor(b, hk * G + g, t, kpos);
                const float ds = p * (dPTb[r * SLD + c] * f - dot_s[c]) * dcap;
                PTb[r * PLD + c] = from_float<T>(p * f);
                dSTb[r * PLD + c] = from_float<T>(ds);
            }
            __syncwarp();
            band_gemm<DV, R, false, true, VOLD, PLD, VLD>(dVb, PTb, dOs);
            band_gemm<D, R, false, true, OLD, PLD, LD>(dKb, dSTb, Qs);
        }
    }
    __syncwarp();
    for (int rr = 0; rr < BAND; ++rr) {
        const int key = k0 + warp * BAND + rr;
        if (key < Tk) {
            const long long dkrow = b * dk_sb + hk * dk_sh + key * dk_st;
            const long long dvrow = b * dv_sb + hk * dv_sh + key * dv_st;
            for (int d = lane; d < D; d += WARP_SIZE) dk.store(dkrow + d, dKb[rr * OLD + d] * scale);
            for (int d = lane; d < DV; d += WARP_SIZE) dv.store(dvrow + d, dVb[rr * VOLD + d]);
        }
    }
}

}  // namespace attn_impl

// ---- entry points: {forward, backward_dq, backward_dkdv} x {f32, bf16} x head dims -------------
// Head dims (D of q, k; DV of v, o): 64 and 128 (DV = D: *_d64, *_d128), and MLA's D = 192, DV =
// 128 (*_d192v128; its rowdot is *_d128's, over o's DV). Tile rows R: 64 for the forward up to
// D = 128, 32 beyond; 64 (head dim 64) or 32 (larger) for the backward, whose blocks hold twice
// the tiles (kernels/attention.py, attention_tile_rows). Threads: 2 x R.
// The mask (attn_impl::Mask): query row i sees keys diag + i - window < j <= diag + i (Tk - Tq:
// the last Tq positions; 0: a ring's diagonal tile; Tk: every key), of its document when q_docs,
// k_docs are given; softcap > 0 caps the scores. Outputs: one of the T pointer and the float32 one (*_f32) is
// null; accumulate adds the result to the output instead of overwriting it.
#define ATTN_DROP_PARAMS                                                                                        \
    const long long *drop_offsets, unsigned long long drop_seed, unsigned int drop_threshold, float drop_scale, \
        long long drop_head_stride, long long drop_row_stride
#define ATTN_DROPOUT                                                                                            \
    attn_impl::ProbDropout{drop_offsets, drop_seed, drop_threshold, drop_scale, drop_head_stride, drop_row_stride}
#define ATTN_MASK_PARAMS int diag, int window, float softcap, const int *q_docs, const int *k_docs
#define ATTN_MASK attn_impl::Mask{diag, window, softcap, q_docs, k_docs}

#define ATTN_FWD_PARAMS(T)                                                                                      \
    T *o, float *o_f32, float *lse, const T *q, const T *k, const T *v, int Hkv, int G, int Tq, int Tk,        \
        ATTN_MASK_PARAMS, long long q_sb, long long q_sh, long long q_sg, long long q_st, long long k_sb,              \
        long long k_sh, long long k_st, long long v_sb, long long v_sh, long long v_st, float scale,          \
        ATTN_DROP_PARAMS
#define ATTN_FWD_ARGS(T)                                                                                        \
    attn_impl::Out<T>{o, o_f32, 0}, lse, q, k, v, Hkv, G, Tq, Tk, ATTN_MASK, q_sb, q_sh, q_sg, q_st, k_sb, k_sh,   \
        k_st, v_sb, v_sh, v_st, scale, ATTN_DROPOUT

extern "C" __global__ void __launch_bounds__(128) attention_forward_f32_d64(ATTN_FWD_PARAMS(float)) {
    attn_impl::forward<float, 64, 64, 64>(ATTN_FWD_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(128) attention_forward_f32_d128(ATTN_FWD_PARAMS(float)) {
    attn_impl::forward<float, 128, 128, 64>(ATTN_FWD_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(128) attention_forward_bf16_d64(ATTN_FWD_PARAMS(__nv_bfloat16)) {
    attn_impl::forward<__nv_bfloat16, 64, 64, 64>(ATTN_FWD_ARGS(__nv_bfloat16));
}
extern "C" __global__ void __launch_bounds__(128) attention_forward_bf16_d128(ATTN_FWD_PARAMS(__nv_bfloat16)) {
    attn_impl::forward<__nv_bfloat16, 128, 128, 64>(ATTN_FWD_ARGS(__nv_bfloat16));
}
// MLA (DeepSeek-V3): q, k of head dim 192 (128 + the rotary 64), v and o of 128; 32-row tiles
// (64 rows of three 192-wide float tiles would pass sm_80's 163 KiB of shared memory).
extern "C" __global__ void __launch_bounds__(64) attention_forward_f32_d192v128(ATTN_FWD_PARAMS(float)) {
    attn_impl::forward<float, 192, 128, 32>(ATTN_FWD_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(64) attention_forward_bf16_d192v128(ATTN_FWD_PARAMS(__nv_bfloat16)) {
    attn_impl::forward<__nv_bfloat16, 192, 128, 32>(ATTN_FWD_ARGS(__nv_bfloat16));
}

#define ATTN_ROWDOT_PARAMS(T)                                                                                   \
    float *out, const T *o, const T *dout, int Hkv, int G, int Tq, long long o_sb, long long o_sh,             \
        long long o_sg, long long o_st, long long do_sb, long long do_sh, long long do_sg, long long do_st,    \
        long long n_rows
#define ATTN_ROWDOT_ARGS out, o, dout, Hkv, G, Tq, o_sb, o_sh, o_sg, o_st, do_sb, do_sh, do_sg, do_st, n_rows

extern "C" __global__ void __launch_bounds__(256) attention_backward_rowdot_f32_d64(ATTN_ROWDOT_PARAMS(float)) {
    attn_impl::backward_rowdot<float, 64>(ATTN_ROWDOT_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) attention_backward_rowdot_f32_d128(ATTN_ROWDOT_PARAMS(float)) {
    attn_impl::backward_rowdot<float, 128>(ATTN_ROWDOT_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) attention_backward_rowdot_bf16_d64(
    ATTN_ROWDOT_PARAMS(__nv_bfloat16)) {
    attn_impl::backward_rowdot<__nv_bfloat16, 64>(ATTN_ROWDOT_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) attention_backward_rowdot_bf16_d128(
    ATTN_ROWDOT_PARAMS(__nv_bfloat16)) {
    attn_impl::backward_rowdot<__nv_bfloat16, 128>(ATTN_ROWDOT_ARGS);
}

#define ATTN_DQ_PARAMS(T)                                                                                       \
    T *dq, float *dq_f32, int accumulate, const T *q, const T *k, const T *v, const T *dout, const float *lse, \
        const float *rowdot, int Hkv, int G, int Tq, int Tk, ATTN_MASK_PARAMS, long long q_sb, long long q_sh, \
        long long q_sg, long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb,        \
        long long v_sh, long long v_st, long long do_sb, long long do_sh, long long do_sg, long long do_st,    \
        long long dq_sb, long long dq_sh, long long dq_sg, long long dq_st, float scale, ATTN_DROP_PARAMS
#define ATTN_DQ_ARGS(T)                                                                                         \
    attn_impl::Out<T>{dq, dq_f32, accumulate}, q, k, v, dout, lse, rowdot, Hkv, G, Tq, Tk, ATTN_MASK, q_sb,     \
        q_sh,                                                                                                   \
        q_sg, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, do_sb, do_sh, do_sg, do_st, dq_sb, dq_sh, dq_sg, dq_st, \
        scale, ATTN_DROPOUT

extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_f32_d64(ATTN_DQ_PARAMS(float)) {
    attn_impl::backward_dq<float, 64, 64, 64>(ATTN_DQ_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(64) attention_backward_dq_f32_d128(ATTN_DQ_PARAMS(float)) {
    attn_impl::backward_dq<float, 128, 128, 32>(ATTN_DQ_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_bf16_d64(ATTN_DQ_PARAMS(__nv_bfloat16)) {
    attn_impl::backward_dq<__nv_bfloat16, 64, 64, 64>(ATTN_DQ_ARGS(__nv_bfloat16));
}
extern "C" __global__ void __launch_bounds__(64) attention_backward_dq_bf16_d128(ATTN_DQ_PARAMS(__nv_bfloat16)) {
    attn_impl::backward_dq<__nv_bfloat16, 128, 128, 32>(ATTN_DQ_ARGS(__nv_bfloat16));
}
extern "C" __global__ void __launch_bounds__(64) attention_backward_dq_f32_d192v128(ATTN_DQ_PARAMS(float)) {
    attn_impl::backward_dq<float, 192, 128, 32>(ATTN_DQ_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(64) attention_backward_dq_bf16_d192v128(
    ATTN_DQ_PARAMS(__nv_bfloat16)) {
    attn_impl::backward_dq<__nv_bfloat16, 192, 128, 32>(ATTN_DQ_ARGS(__nv_bfloat16));
}

#define ATTN_DKDV_PARAMS(T)                                                                                     \
    T *dk, T *dv, float *dk_f32, float *dv_f32, int accumulate, const T *q, const T *k, const T *v,            \
        const T *dout, const float *lse, const float *rowdot, int Hkv, int G, int Tq, int Tk, ATTN_MASK_PARAMS, \
        long long q_sb, long long q_sh, long long q_sg, long long q_st, long long k_sb, long long k_sh,        \
        long long k_st, long long v_sb, long long v_sh, long long v_st, long long do_sb, long long do_sh,      \
        long long do_sg, long long do_st, long long dk_sb, long long dk_sh, long long dk_st, long long dv_sb,  \
        long long dv_sh, long long dv_st, float scale, ATTN_DROP_PARAMS
#define ATTN_DKDV_ARGS(T)                                                                                       \
    attn_impl::Out<T>{dk, dk_f32, accumulate}, attn_impl::Out<T>{dv, dv_f32, accumulate}, q, k, v, dout, lse, \
        rowdot, Hkv, G, Tq, Tk, ATTN_MASK, q_sb, q_sh, q_sg, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, do_sb,      \
        do_sh, do_sg, do_st, dk_sb, dk_sh, dk_st, dv_sb, dv_sh, dv_st, scale, ATTN_DROPOUT

extern "C" __global__ void __launch_bounds__(128) attention_backward_dkdv_f32_d64(ATTN_DKDV_PARAMS(float)) {
    attn_impl::backward_dkdv<float, 64, 64, 64>(ATTN_DKDV_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(64) attention_backward_dkdv_f32_d128(ATTN_DKDV_PARAMS(float)) {
    attn_impl::backward_dkdv<float, 128, 128, 32>(ATTN_DKDV_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(128) attention_backward_dkdv_bf16_d64(ATTN_DKDV_PARAMS(__nv_bfloat16)) {
    attn_impl::backward_dkdv<__nv_bfloat16, 64, 64, 64>(ATTN_DKDV_ARGS(__nv_bfloat16));
}
extern "C" __global__ void __launch_bounds__(64) attention_backward_dkdv_bf16_d128(
    ATTN_DKDV_PARAMS(__nv_bfloat16)) {
    attn_impl::backward_dkdv<__nv_bfloat16, 128, 128, 32>(ATTN_DKDV_ARGS(__nv_bfloat16));
}
extern "C" __global__ void __launch_bounds__(64) attention_backward_dkdv_f32_d192v128(ATTN_DKDV_PARAMS(float)) {
    attn_impl::backward_dkdv<float, 192, 128, 32>(ATTN_DKDV_ARGS(float));
}
extern "C" __global__ void __launch_bounds__(64) attention_backward_dkdv_bf16_d192v128(
    ATTN_DKDV_PARAMS(__nv_bfloat16)) {
    attn_impl::backward_dkdv<__nv_bfloat16, 192, 128, 32>(ATTN_DKDV_ARGS(__nv_bfloat16));
}
