/* GeLU (tanh form, with or without GPT-2's bias) and SwiGLU on the CPU, forward and backward:
 * cutp.ops.gelu's and cutp.ops.swiglu's compiled path. Their NumPy code is the reference; each
 * element here makes one pass (NumPy: 8-12 passes over the block, each a ufunc).
 *
 * GeLU: y = 0.5 x (1 + tanh(u)), u = x (K + C K x^2), computed as y = x s with
 * s = sigmoid(2u) = 1 / (1 + exp(-2u)) (= (1 + tanh u) / 2, no cancellation where tanh u is
 * near -1); t = 2 s - 1 (tanh u) is kept for the backward, as the NumPy path keeps its tanh:
 * gelu'(x) = (1 + t) (0.5 + d (1 - t)), d = x (K/2 + 3/2 C K x^2). db sums dx's rows in row order.
 * SwiGLU: y = silu(g) up with silu(g) = g / (1 + e), e = exp(-g) (-g clamped to 80 / 700 as the
 * NumPy path does; e kept for the backward): d_gate = dy up sigmoid(g) (1 + g (1 - sigmoid(g))),
 * d_up = dy silu(g), 1 - sigmoid(g) = e sigmoid(g).
 *
 * Rows [row0, row1) of contiguous [N, C] arrays per call (the ops' pool runs several ranges);
 * every element is computed alone, so results do not depend on the ranges. Flags and the
 * self-inclusion as in attention.c (no -ffast-math: the written order of each sum holds).
 */
#ifndef REAL
#include <stdint.h>
#include <string.h>

#define SELF "activations.c"
#include "twice.h"

#else /* ---- the body, once per REAL ------------------------------------------------------- */

#include "vec.h"

#undef EXP_CLAMP
#if REAL_IS_DOUBLE
#define EXP_CLAMP 700.0 /* exp(-gate) clamped as the NumPy path does */
#else
#define EXP_CLAMP 80.0f
#endif

#define GELU_K ((REAL)0.7978845608028654)  /* sqrt(2 / pi) */
#define GELU_C ((REAL)0.044715)

/* pre = x + b (b NULL: x itself, pre may then be NULL), t = tanh(u), y = gelu */
void SUF(gelu_tanh_forward)(const REAL *x, const REAL *b, REAL *pre, REAL *t, REAL *y, int64_t C, int64_t row0,
                            int64_t row1) {
    for (int64_t r = row0; r < row1; r++)
        for (int64_t c = 0; c < C; c += VL) {
            const int64_t m = C - c < VL ? C - c : VL, at = r * C + c;
            VEC p = m == VL ? SUF(load)(x + at) : SUF(load_n)(x + at, m);
            if (b) p += m == VL ? SUF(load)(b + c) : SUF(load_n)(b + c, m);
            const VEC u = (p * p * (GELU_C * GELU_K) + GELU_K) * p;
            const VEC s = 1 / (1 + SUF(exp_vec)(u * -2));
            const VEC th = s * 2 - 1, out = p * s;
            if (m == VL) {
                if (b) SUF(store)(pre + at, p);
                SUF(store)(t + at, th);
                SUF(store)(y + at, out);
            } else {
                if (b) SUF(store_n)(pre + at, p, m);
                SUF(store_n)(t + at, th, m);
                SUF(store_n)(y + at, out, m);
            }
        }
}

/* dx = dy gelu'(pre) from the kept t; db (NULL: none) = the column sums of dx over the rows, in
 * row order */
void SUF(gelu_tanh_backward)(const REAL *pre, const REAL *t, const REAL *dy, REAL *dx, REAL *db, int64_t C,
                             int64_t row0, int64_t row1) {
    if (db) memset(db, 0, sizeof(REAL) * C);
    for (int64_t r = row0; r < row1; r++)
        for (int64_t c = 0; c < C; c += VL) {
            const int64_t m = C - c < VL ? C - c : VL, at = r * C + c;
            VEC p, th, g;
            if (m == VL) {
                p = SUF(load)(pre + at), th = SUF(load)(t + at), g = SUF(load)(dy + at);
            } else {
                p = SUF(load_n)(pre + at, m), th = SUF(load_n)(t + at, m), g = SUF(load_n)(dy + at, m);
            }
            const VEC d = (p * p * ((REAL)1.5 * GELU_C * GELU_K) + (REAL)0.5 * GELU_K) * p;
            g *= (1 + th) * (d * (1 - th) + (REAL)0.5);
            if (m == VL) {
                SUF(store)(dx + at, g);
                if (db) SUF(store)(db + c, SUF(load)(db + c) + g);
            } else {
                SUF(store_n)(dx + at, g, m);
                if (db) SUF(store_n)(db + c, SUF(load_n)(db + c, m) + g, m);
            }
        }
}

/* gate_up [N, 2F] -> y [N, F] = silu(gate) up, e [N, F] = exp(-gate) (clamped) */
void SUF(swiglu_forward)(const REAL *gate_up, REAL *y, REAL *e, int64_t F, int64_t row0, int64_t row1) {
    for (int64_t r = row0; r < row1; r++)
        for (int64_t c = 0; c < F; c += VL) {
            const int64_t m = F - c < VL ? F - c : VL, at = r * F + c;
            const REAL *g0 = gate_up + r * 2 * F + c;
            const VEC g = m == VL ? SUF(load)(g0) : SUF(load_n)(g0, m);
            const VEC up = m == VL ? SUF(load)(g0 + F) : SUF(load_n)(g0 + F, m);
            const VEC neg = -g, clamp = SUF(splat)(EXP_CLAMP);
            const VEC ex = SUF(exp_vec)(SUF(select)(neg > clamp, clamp, neg));
            const VEC out = g / (ex + 1) * up;
            if (m == VL) {
                SUF(store)(e + at, ex);
                SUF(store)(y + at, out);
            } else {
                SUF(store_n)(e + at, ex, m);
                SUF(store_n)(y + at, out, m);
            }
        }
}

/* d [N, 2F] = (d_gate ; d_up) from gate_up, the kept e and dy [N, F] */
void SUF(swiglu_backward)(const REAL *gate_up, const REAL *e, const REAL *dy, REAL *d, int64_t F, int64_t row0,
                          int64_t row1) {
    for (int64_t r = row0; r < row1; r++)
        for (int64_t c = 0; c < F; c += VL) {
            const int64_t m = F - c < VL ? F - c : VL, at = r * F + c;
            const REAL *g0 = gate_up + r * 2 * F + c;
            REAL *d0 = d + r * 2 * F + c;
            VEC g, up, ex, dyv;
            if (m == VL) {
                g = SUF(load)(g0), up = SUF(load)(g0 + F), ex = SUF(load)(e + at), dyv = SUF(load)(dy + at);
            } else {
                g = SUF(load_n)(g0, m), up = SUF(load_n)(g0 + F, m), ex = SUF(load_n)(e + at, m);
                dyv = SUF(load_n)(dy + at, m);
            }
            const VEC sig = 1 / (ex + 1);
            const VEC dg = (g * (ex * sig) + 1) * sig * up * dyv, du = g * sig * dyv;
            if (m == VL) {
                SUF(store)(d0, dg);
                SUF(store)(d0 + F, du);
            } else {
                SUF(store_n)(d0, dg, m);
                SUF(store_n)(d0 + F, du, m);
            }
        }
}
#endif
