/* AdamW over flat buffers on the CPU: cutp.ops.adamw's compiled path (its NumPy code is the
 * reference). One pass over p, g, m and v (NumPy: ~14 passes over each block). Each element is
 * computed in the NumPy path's order of operations, each rounded once, without fused
 * multiply-adds (the cflags line), and with the constants the NumPy path rounds to REAL before it
 * uses them (given by the caller): the NumPy path's bits exactly, at any thread count.
 *
 *   gs = g * grad_scale (scale 1: g)     m = m b1 + gs (1 - b1)      v = v b2 + (gs gs) (1 - b2)
 *   p = p decay (decay 1: skipped)       p -= (m / (sqrt(v) inv_sqrt_bc2 + eps)) step_size
 *
 * Elements [i0, i1) per call. Also the sum of squares of the gradient norm (below). Flags and the
 * self-inclusion as in attention.c.
 */
/* cflags: -ffp-contract=off */
#ifndef REAL
#include <math.h>
#include <stdint.h>

#define SELF "adamw.c"
#include "twice.h"

#else /* ---- the body, once per REAL ------------------------------------------------------- */

void SUF(adamw)(REAL *restrict p, const REAL *restrict g, REAL *restrict m, REAL *restrict v, REAL grad_scale,
                int scaled, REAL b1, REAL one_minus_b1, REAL b2, REAL one_minus_b2, REAL decay, int decays,
                REAL inv_sqrt_bc2, REAL eps, REAL step_size, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        const REAL gs = scaled ? g[i] * grad_scale : g[i];
        const REAL t1 = gs * one_minus_b1;
        REAL mi = m[i] * b1;
        mi = mi + t1;
        REAL t2 = gs * gs;
        t2 = t2 * one_minus_b2;
        REAL vi = v[i] * b2;
        vi = vi + t2;
        REAL pi = p[i];
        if (decays) pi = pi * decay;
        REAL d = SQRT(vi);
        d = d * inv_sqrt_bc2;
        d = d + eps;
        d = mi / d;
        d = d * step_size;
        p[i] = pi - d;
        m[i] = mi;
        v[i] = vi;
    }
}

/* sum of x[i]^2 over [i0, i1) in double (the gradient norm's terms): each square formed in double
 * (exact for float32), summed over 8 lanes (lane l: i0 + l, i0 + 8 + l, ... in order), then the
 * lanes pairwise: a fixed order */
double SUF(sum_squares)(const REAL *restrict x, int64_t i0, int64_t i1) {
    double l[8] = {0};
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8)
        for (int j = 0; j < 8; j++) {
            const double v = (double)x[i + j];
            l[j] = l[j] + v * v;
        }
    for (int j = 0; i + j < i1; j++) {
        const double v = (double)x[i + j];
        l[j] = l[j] + v * v;
    }
    for (int w = 4; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) l[j] += l[j + w];
    return l[0];
}
#endif
