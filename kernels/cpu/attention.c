/* Causal attention on the CPU, forward and backward: cutp.ops.attention's compiled path.
 *
 *   o = softmax(scale * q k^T, causal) v      per query head and the KV head it is grouped under
 *
 * The NumPy code in cutp/ops/attention.py (the blocked path) is the reference (llm.c's habit: the
 * simple version beside the fast one); this file computes the same formula a tile of QR query rows
 * at a time: their scores, softmax and output in one pass, keeping the probabilities packed (row
 * i: its Tk - Tq + i + 1 visible keys) for the backward. The products are small register-blocked
 * matrix products (QR rows x 2 vectors of keys or head-dim columns, the accumulators in
 * registers), written with GCC/Clang vector types (vec.h).
 *
 * Layout (element strides, head dim contiguous): q [B, nkv, g, Tq, hd], k, v [B, nkv, Tk, hd]
 * (views of the QKV projection's output: any strides), o and the gradients likewise. One call
 * works on the KV heads [first, last) of the flattened (B x nkv); the ops' thread pool hands each
 * thread some ranges (ctypes releases the GIL). A KV head's results depend on its own data only,
 * never on the ranges or the thread count: runs are bit-identical at any number of threads.
 *
 * Built with cc -O3 -march=native -fno-math-errno (cutp/ops/compiled.py), NOT -ffast-math: every
 * sum runs in the order written (a dot product over the head dim in d order, a row's output over
 * its keys in key order, dk / dv over the query rows in row order and the g query heads in
 * order). Row sums split over lanes (softmax's) name their lanes and combine them in a fixed
 * order. GCC contracts a * b + c into fused multiply-adds (-ffp-contract=fast, its default in GNU
 * C): deterministic on one machine, within the tests' tolerances of NumPy's separate roundings.
 *
 * The file is compiled once per type: it includes itself with REAL float, then double.
 */
#ifndef REAL
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* query rows per tile: each key row loaded serves QR queries. 6: the product's 6 x 2 accumulators,
 * its 2 key vectors and a broadcast take 15 of AVX2's 16 vector registers (gpt2's attention,
 * one thread: 4 -> 6 made the forward 19%, the backward 18% faster; 8 spills and is as slow as 4).
 * Any QR gives the same bits: every sum runs over the same terms in the same order. */
#define QR 6

#define SELF "attention.c"
#include "twice.h"

#else /* ---- the body, once per REAL ------------------------------------------------------- */

#include "vec.h"

/* c[r][j] = scale * sum over i < k, in i order, of a[r][i] b[i][j], for the QR rows of a (row
 * stride lda) and the columns j < n of b (row stride ldb, a multiple of W, zero-padded past n),
 * c's rows at b's stride. The scores (a = q, b = k transposed, k = hd) and the mixes (a = p,
 * b = v or k, k = the keys, scale 1: exact) are both this product. */
static void SUF(tile_product)(const REAL *restrict a, int64_t lda, int64_t k, const REAL *restrict b, int64_t ldb,
                              int64_t n, REAL scale, REAL *restrict c) {
    for (int64_t j0 = 0; j0 < n; j0 += W) {
        VEC acc[QR][2] = {{{0}}};
        for (int64_t i = 0; i < k; i++) {
            const VEC b0 = SUF(load)(b + i * ldb + j0), b1 = SUF(load)(b + i * ldb + j0 + VL);
            for (int r = 0; r < QR; r++) {
                const VEC x = SUF(splat)(a[r * lda + i]);
                acc[r][0] += x * b0;
                acc[r][1] += x * b1;
            }
        }
        for (int r = 0; r < QR; r++) {
            SUF(store)(c + r * ldb + j0, acc[r][0] * SUF(splat)(scale));
            SUF(store)(c + r * ldb + j0 + VL, acc[r][1] * SUF(splat)(scale));
        }
    }
}

/* acc[j][:] += sum over the QR rows, in order, of c[r][j] x[r][:], for keys j < n (acc [n][hp],
 * x [QR][hp]) */
static void SUF(tile_spread)(const REAL *restrict c, int64_t ld, const REAL *restrict x, int64_t hp, int64_t n,
                             REAL *restrict acc) {
    for (int64_t d0 = 0; d0 < hp; d0 += W) {
        VEC xr[QR][2];
        for (int r = 0; r < QR; r++) {
            xr[r][0] = SUF(load)(x + r * hp + d0);
            xr[r][1] = SUF(load)(x + r * hp + d0 + VL);
        }
        for (int64_t j = 0; j < n; j++) {
            VEC a0 = SUF(load)(acc + j * hp + d0), a1 = SUF(load)(acc + j * hp + d0 + VL);
            for (int r = 0; r < QR; r++) {
                const VEC y = SUF(splat)(c[r * ld + j]);
                a0 += y * xr[r][0];
                a1 += y * xr[r][1];
            }
            SUF(store)(acc + j * hp + d0, a0);
            SUF(store)(acc + j * hp + d0 + VL, a1);
        }
    }
}

/* sum of x[0 .. nv VL) by lanes (lane l sums x[l], x[VL + l], ... in order), then the lanes
 * pairwise: an order of our own, not the compiler's */
static REAL SUF(lane_sum)(const REAL *x, int64_t nv) {
    VEC acc = {0};
    for (int64_t c = 0; c < nv; c++) acc += SUF(load)(x + c * VL);
    return SUF(lanes)(acc);
}

/* row sr[0 .. L) (room for whole vectors) into its softmax; sr[L .. n) zero */
static void SUF(softmax_row)(REAL *sr, int64_t L, int64_t n) {
    const int64_t nv = (L + VL - 1) / VL;
    for (int64_t j = L; j < nv * VL; j++) sr[j] = -(REAL)1e30;  /* past the row: exp gives 0 */
    VEC m = SUF(load)(sr);
    for (int64_t c = 1; c < nv; c++) m = SUF(vmax)(m, SUF(load)(sr + c * VL));
    REAL top = m[0];  /* (a max in any order is the same number) */
    for (int i = 1; i < VL; i++) top = m[i] > top ? m[i] : top;
    const VEC mv = SUF(splat)(top);
    for (int64_t c = 0; c < nv; c++) SUF(store)(sr + c * VL, SUF(exp_vec)(SUF(load)(sr + c * VL) - mv));
    const VEC inv = SUF(splat)((REAL)1 / SUF(lane_sum)(sr, nv));
    for (int64_t c = 0; c < nv; c++) SUF(store)(sr + c * VL, SUF(load)(sr + c * VL) * inv);
    for (int64_t j = nv * VL; j < n; j++) sr[j] = 0;
}

/* the n rows x[j] (row stride xs, hd wide) into t: transposed [hd][ld] when `transpose`, else
 * [n][hp]; zero padding to ld columns / hp columns */
static void SUF(copy_rows)(const REAL *x, int64_t xs, int64_t n, int64_t hd, REAL *t, int64_t ld, int64_t hp,
                           int transpose) {
    memset(t, 0, sizeof(REAL) * (transpose ? hp * ld : n * hp));
    for (int64_t j = 0; j < n; j++) {
        const REAL *xj = x + j * xs;
        if (transpose)
            for (int64_t d = 0; d < hd; d++) t[d * ld + j] = xj[d];
        else
            memcpy(t + j * hp, xj, sizeof(REAL) * hd);
    }
}

/* rows [i0, i0 + rows) of x (row stride xs, hd wide) into the tile t [QR][hp], zeros elsewhere */
static void SUF(copy_tile)(const REAL *x, int64_t xs, int64_t i0, int rows, int64_t hd, REAL *t, int64_t hp) {
    memset(t, 0, sizeof(REAL) * QR * hp);
    for (int r = 0; r < rows; r++) memcpy(t + r * hp, x + (i0 + r) * xs, sizeof(REAL) * hd);
}

/* n REALs of scratch, 64-byte aligned (aligned_alloc wants a multiple of the alignment) */
static REAL *SUF(scratch)(int64_t n) { return aligned_alloc(64, (sizeof(REAL) * n + 63) / 64 * 64); }

static int64_t SUF(packed_at)(int64_t i, int64_t shift) { return i * (shift + 1) + i * (i - 1) / 2; }

/* y = exp(x) for n elements by exp_vec (the tests' window on it: its ulps against libm's) */
void SUF(exp_array)(const REAL *x, REAL *y, int64_t n) {
    REAL pad[VL];
    for (int64_t i = 0; i < n; i += VL) {
        const int64_t m = n - i < VL ? n - i : VL;
        memset(pad, 0, sizeof pad);
        memcpy(pad, x + i, sizeof(REAL) * m);
        const VEC e = SUF(exp_vec)(SUF(load)(pad));
        memcpy(y + i, &e, sizeof(REAL) * m);
    }
}

/* Forward over KV heads [first, last). Strides in elements: qs = q's (b, h, g, t), ks / vs = k's /
 * v's (b, h, t), os = o's (b, h, g, t). probs: per (b, h, g) the packed rows. */
int SUF(attention_forward)(const REAL *q, const int64_t *qs, const REAL *k, const int64_t *ks, const REAL *v,
                           const int64_t *vs, REAL *o, const int64_t *os, REAL *probs, int64_t B, int64_t nkv,
                           int64_t g, int64_t Tq, int64_t Tk, int64_t hd, REAL scale, int64_t first, int64_t last) {
    (void)B;
    const int64_t shift = Tk - Tq, ld = (Tk + W - 1) / W * W, hp = (hd + W - 1) / W * W;
    const int64_t per_head = SUF(packed_at)(Tq, shift);
    REAL *kt = SUF(scratch)(hp * ld + Tk * hp + QR * ld + 2 * QR * hp);
    if (!kt) return 1;
    REAL *vp = kt + hp * ld, *s = vp + Tk * hp, *qt = s + QR * ld, *out = qt + QR * hp;
    for (int64_t bh = first; bh < last; bh++) {
        const int64_t b = bh / nkv, h = bh % nkv;
        SUF(copy_rows)(k + b * ks[0] + h * ks[1], ks[2], Tk, hd, kt, ld, hp, 1);
        SUF(copy_rows)(v + b * vs[0] + h * vs[1], vs[2], Tk, hd, vp, ld, hp, 0);
        for (int64_t gi = 0; gi < g; gi++) {
            const REAL *qb = q + b * qs[0] + h * qs[1] + gi * qs[2];
            REAL *ob = o + b * os[0] + h * os[1] + gi * os[2];
            REAL *pb = probs + (bh * g + gi) * per_head;
            for (int64_t i0 = 0; i0 < Tq; i0 += QR) {
                const int rows = Tq - i0 < QR ? (int)(Tq - i0) : QR;
                SUF(copy_tile)(qb, qs[3], i0, rows, hd, qt, hp);  /* (a short last tile: zero rows) */
                const int64_t n = shift + i0 + rows;  /* keys the tile's last row sees */
                SUF(tile_product)(qt, hp, hd, kt, ld, n, scale, s);
                for (int r = 0; r < QR; r++) {
                    REAL *sr = s + r * ld;
                    const int64_t L = r < rows ? shift + i0 + r + 1 : 0;  /* the keys row r sees */
                    if (L) {
                        SUF(softmax_row)(sr, L, n);
                        memcpy(pb + SUF(packed_at)(i0 + r, shift), sr, sizeof(REAL) * L);
                    } else {
                        for (int64_t j = 0; j < n; j++) sr[j] = 0;  /* past the last query row */
                    }
                }
                SUF(tile_product)(s, ld, n, vp, hp, hp, 1, out);
                for (int r = 0; r < rows; r++)
                    for (int64_t d = 0; d < hd; d++) ob[(i0 + r) * os[3] + d] = out[r * hp + d];
            }
        }
    }
    free(kt);
    return 0;
}

/* Backward over KV heads [first, last): dq like q, dk / dv like k / v (strides dqs, dks, dvs), do
 * with strides dos; probs the forward's. dk and dv sum the g query heads in order. */
int SUF(attention_backward)(const REAL *dout, const int64_t *dos, const REAL *q, const int64_t *qs, const REAL *k,
                            const int64_t *ks, const REAL *v, const int64_t *vs, const REAL *probs, REAL *dq,
                            const int64_t *dqs, REAL *dk, const int64_t *dks, REAL *dv, const int64_t *dvs, int64_t B,
                            int64_t nkv, int64_t g, int64_t Tq, int64_t Tk, int64_t hd, REAL scale, int64_t first,
                            int64_t last) {
    (void)B;
    const int64_t shift = Tk - Tq, ld = (Tk + W - 1) / W * W, hp = (hd + W - 1) / W * W;
    const int64_t per_head = SUF(packed_at)(Tq, shift);
    REAL *vt = SUF(scratch)(hp * ld + 3 * Tk * hp + 2 * QR * ld + 3 * QR * hp);
    if (!vt) return 1;
    REAL *kp = vt + hp * ld, *gk = kp + Tk * hp, *gv = gk + Tk * hp, *dp = gv + Tk * hp, *pt = dp + QR * ld,
         *qt = pt + QR * ld, *dot = qt + QR * hp, *gq = dot + QR * hp;
    for (int64_t bh = first; bh < last; bh++) {
        const int64_t b = bh / nkv, h = bh % nkv;
        SUF(copy_rows)(v + b * vs[0] + h * vs[1], vs[2], Tk, hd, vt, ld, hp, 1);
        SUF(copy_rows)(k + b * ks[0] + h * ks[1], ks[2], Tk, hd, kp, ld, hp, 0);
        memset(gk, 0, sizeof(REAL) * 2 * Tk * hp);
        for (int64_t gi = 0; gi < g; gi++) {
            const REAL *qb = q + b * qs[0] + h * qs[1] + gi * qs[2];
            const REAL *db = dout + b * dos[0] + h * dos[1] + gi * dos[2];
            REAL *dqb = dq + b * dqs[0] + h * dqs[1] + gi * dqs[2];
            const REAL *pb = probs + (bh * g + gi) * per_head;
            for (int64_t i0 = 0; i0 < Tq; i0 += QR) {
                const int rows = Tq - i0 < QR ? (int)(Tq - i0) : QR;
                SUF(copy_tile)(db, dos[3], i0, rows, hd, dot, hp);
                SUF(copy_tile)(qb, qs[3], i0, rows, hd, qt, hp);
                const int64_t n = shift + i0 + rows;
                SUF(tile_product)(dot, hp, hd, vt, ld, n, 1, dp);  /* dp = do v^T */
                for (int r = 0; r < QR; r++) {
                    REAL *pr = pt + r * ld, *dr = dp + r * ld;
                    const int64_t L = r < rows ? shift + i0 + r + 1 : 0;
                    const int64_t nv = (L + VL - 1) / VL;
                    if (L) memcpy(pr, pb + SUF(packed_at)(i0 + r, shift), sizeof(REAL) * L);
                    for (int64_t j = L; j < nv * VL || j < n; j++) pr[j] = 0;
                    /* softmax backward: ds = p (dp - sum(p dp)), times the scale (0 past the row) */
                    for (int64_t c = 0; c < nv; c++)
                        SUF(store)(dr + c * VL, SUF(load)(dr + c * VL) * SUF(load)(pr + c * VL));
                    const VEC D = SUF(splat)(SUF(lane_sum)(dr, nv)), sc = SUF(splat)(scale);
                    for (int64_t c = 0; c < nv; c++)
                        SUF(store)(dr + c * VL, (SUF(load)(dr + c * VL) - SUF(load)(pr + c * VL) * D) * sc);
                    for (int64_t j = nv * VL; j < n; j++) dr[j] = 0;
                }
                SUF(tile_product)(dp, ld, n, kp, hp, hp, 1, gq);    /* dq = ds k */
                SUF(tile_spread)(dp, ld, qt, hp, n, gk); /* dk += ds^T q */
                SUF(tile_spread)(pt, ld, dot, hp, n, gv); /* dv += p^T do */
                for (int r = 0; r < rows; r++)
                    for (int64_t d = 0; d < hd; d++) dqb[(i0 + r) * dqs[3] + d] = gq[r * hp + d];
            }
        }
        REAL *dkb = dk + b * dks[0] + h * dks[1], *dvb = dv + b * dvs[0] + h * dvs[1];
        for (int64_t j = 0; j < Tk; j++)
            for (int64_t d = 0; d < hd; d++) {
                dkb[j * dks[2] + d] = gk[j * hp + d];
                dvb[j * dvs[2] + d] = gv[j * hp + d];
            }
    }
    free(vt);
    return 0;
}
#endif
