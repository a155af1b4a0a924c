/* Softmax cross-entropy over a logits shard on the CPU, forward statistics and backward:
 * cutp.ops.cross_entropy's compiled path for ce_shard_forward / ce_shard_backward (their NumPy
 * code is the reference). Forward: two passes over a row (its max, then the sum of exp(x - max)
 * and of x, the row still in cache); backward: one pass writing the gradient (in place when out
 * is the logits). NumPy: five to seven passes over each block.
 *
 * Forward, row i over its n_valid leading columns: row_max = max x (-inf when every x is -inf),
 * sum_exp = sum exp(x - row_max) (0 for a row of -inf), sum_logits = sum x (sum_logits NULL:
 * not wanted). The sums run over VL lanes (lane l: columns l, VL + l, ... in order) and then the
 * lanes pairwise, in double for float32 (a row of 50,257 classes: no float accumulation error),
 * so a row's sums never depend on the threads. NaN logits give a NaN sum.
 * Backward: out = coef exp(x - row_max) - smooth (smooth NULL: no label smoothing), minus hit at
 * the row's target column (target < 0: none); columns [n_valid, width) and rows whose scale is 0 get
 * exactly 0 (what the NumPy path writes, even where such a row holds inf or NaN).
 * Rows [row0, row1) of [N, width] arrays with row strides ldx / ldo (contiguous columns) per call.
 * Flags and the self-inclusion as in attention.c.
 */
#ifndef REAL
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SELF "cross_entropy.c"
#include "twice.h"

#else /* ---- the body, once per REAL ------------------------------------------------------- */

#include "vec.h"

#undef CHUNK
#define CHUNK 32 /* vectors summed in REAL before their sum goes into the double lanes */

/* Sums in double: ACC holds VL double lanes (float32: two vectors of 4, the lanes in order) */
#undef ACC
#if REAL_IS_DOUBLE
#define ACC VEC
static inline void SUF(accumulate)(ACC *acc, VEC v) { *acc += v; }
#else
typedef double f32_dvec __attribute__((vector_size(32)));
typedef float f32_half __attribute__((vector_size(16)));
typedef struct { f32_dvec lo, hi; } f32_acc;
#define ACC f32_acc
static inline void SUF(accumulate)(ACC *acc, VEC v) {
    acc->lo += __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), f32_dvec);
    acc->hi += __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), f32_dvec);
}
#endif

/* the lanes of acc added pairwise (lane l + VL/2 into l, ...): a fixed order */
static inline double SUF(pairwise)(ACC acc) {
#if REAL_IS_DOUBLE
    return SUF(lanes)(acc);
#else
    const f32_dvec s = acc.lo + acc.hi;
    return (s[0] + s[2]) + (s[1] + s[3]);
#endif
}

void SUF(ce_forward)(const REAL *x, int64_t ldx, int64_t n_valid, REAL *row_max, REAL *sum_exp, REAL *sum_logits,
                     int64_t row0, int64_t row1) {
    const int64_t full = n_valid - n_valid % VL;
    for (int64_t r = row0; r < row1; r++) {
        const REAL *xr = x + r * ldx;
        VEC mv = SUF(splat)(-INFINITY), m1 = mv, m2 = mv, m3 = mv; /* four chains: the max is exact in any order */
        int64_t c4 = 0;
        for (; c4 + 4 * VL <= full; c4 += 4 * VL) {
            mv = SUF(vmax)(mv, SUF(load)(xr + c4));
            m1 = SUF(vmax)(m1, SUF(load)(xr + c4 + VL));
            m2 = SUF(vmax)(m2, SUF(load)(xr + c4 + 2 * VL));
            m3 = SUF(vmax)(m3, SUF(load)(xr + c4 + 3 * VL));
        }
        for (int64_t c = c4; c < full; c += VL) mv = SUF(vmax)(mv, SUF(load)(xr + c));
        mv = SUF(vmax)(SUF(vmax)(mv, m1), SUF(vmax)(m2, m3));
        REAL l[VL], mx = -INFINITY;
        memcpy(l, &mv, sizeof mv);
        for (int j = 0; j < VL; j++) mx = l[j] > mx ? l[j] : mx;
        for (int64_t c = full; c < n_valid; c++) mx = xr[c] > mx ? xr[c] : mx;
        const REAL shift = mx == -INFINITY ? 0 : mx;
        ACC se, sx; /* per lane: REAL sums of runs of CHUNK vectors (two chains), each run added in double */
        memset(&se, 0, sizeof se);
        memset(&sx, 0, sizeof sx);
        for (int64_t c0 = 0; c0 < full; c0 += CHUNK * VL) {
            const int64_t c1 = c0 + CHUNK * VL < full ? c0 + CHUNK * VL : full;
            VEC e0 = {0}, e1 = {0}, x0 = {0}, x1 = {0};
            int64_t c = c0;
            for (; c + 2 * VL <= c1; c += 2 * VL) {
                const VEC v0 = SUF(load)(xr + c), v1 = SUF(load)(xr + c + VL);
                e0 += SUF(exp_vec)(v0 - shift);
                e1 += SUF(exp_vec)(v1 - shift);
                x0 += v0;
                x1 += v1;
            }
            if (c < c1) {
                const VEC v0 = SUF(load)(xr + c);
                e0 += SUF(exp_vec)(v0 - shift);
                x0 += v0;
            }
            SUF(accumulate)(&se, e0 + e1);
            if (sum_logits) SUF(accumulate)(&sx, x0 + x1);
        }
        if (full < n_valid) { /* the tail: lanes past the row add 0 */
            const int64_t m = n_valid - full;
            const VEC v = SUF(load_n)(xr + full, m);
            SUF(accumulate)(&se, SUF(select)(SUF(ramp)() < (REAL)m, SUF(exp_vec)(v - shift), SUF(splat)(0)));
            if (sum_logits) SUF(accumulate)(&sx, v);
        }
        row_max[r] = mx;
        sum_exp[r] = (REAL)SUF(pairwise)(se);
        if (sum_logits) sum_logits[r] = (REAL)SUF(pairwise)(sx);
    }
}

void SUF(ce_backward)(const REAL *x, int64_t ldx, REAL *out, int64_t ldo, int64_t n_valid, int64_t width,
                      const int64_t *target, const REAL *row_max, const REAL *row_scale, const REAL *coef,
                      const REAL *smooth, const REAL *hit, int64_t row0, int64_t row1) {
    const int64_t full = n_valid - n_valid % VL;
    for (int64_t r = row0; r < row1; r++) {
        const REAL *xr = x + r * ldx;
        REAL *o = out + r * ldo;
        if (row_scale[r] == 0) {
            memset(o, 0, sizeof(REAL) * width);
            continue;
        }
        const VEC mv = SUF(splat)(row_max[r]), cv = SUF(splat)(coef[r]), sv = SUF(splat)(smooth ? smooth[r] : 0);
        for (int64_t c = 0; c < full; c += VL) {
            VEC e = SUF(exp_vec)(SUF(load)(xr + c) - mv) * cv;
            if (smooth) e -= sv;
            SUF(store)(o + c, e);
        }
        if (full < n_valid) {
            VEC e = SUF(exp_vec)(SUF(load_n)(xr + full, n_valid - full) - mv) * cv;
            if (smooth) e -= sv;
            SUF(store_n)(o + full, e, n_valid - full);
        }
        if (n_valid < width) memset(o + n_valid, 0, sizeof(REAL) * (width - n_valid));
        if (target[r] >= 0) o[target[r]] -= hit[r];
    }
}
#endif
