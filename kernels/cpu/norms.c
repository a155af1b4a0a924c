/* LayerNorm and RMSNorm over the last axis on the CPU, forward and backward: cutp.ops.layernorm's
 * and cutp.ops.rmsnorm's compiled path (their NumPy code is the reference). A row's statistics and
 * its output in two passes over the row (NumPy: five to eight, each over the whole block).
 *
 * LayerNorm: mean m = sum(x) / C, rstd r = 1 / sqrt(sum((x - m)^2) / C + eps), y = (x - m) r w + b;
 * backward with xh = (x - m) r and g = dy w: dx = r (g - mean(g) - xh mean(g xh)), dw += dy xh,
 * db += dy. RMSNorm: r = 1 / sqrt(sum(x^2) / C + eps), y = x r w; dx = r (g - xh mean(g xh)).
 * A row's sums run over VL lanes (lane l: elements l, VL + l, ... in order), the lanes then
 * pairwise: a fixed order. dw and db add the rows of one call in row order, in double (float32
 * too: each row's product rounded to REAL, the sum not); the op adds the calls' double parts in
 * block order (blocks fixed by the shape, not the thread count) and rounds once. weight / bias
 * NULL: none. Rows [row0, row1) of contiguous [N, C] arrays per call. Flags and the
 * self-inclusion as in attention.c.
 */
#ifndef REAL
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SELF "norms.c"
#include "twice.h"

#else /* ---- the body, once per REAL ------------------------------------------------------- */

#include "vec.h"

/* x[c .. c + VL) of a row of C, zeros past its end */
static inline VEC SUF(at)(const REAL *x, int64_t c, int64_t C) {
    return C - c >= VL ? SUF(load)(x + c) : SUF(load_n)(x + c, C - c);
}

static inline void SUF(put)(REAL *x, int64_t c, int64_t C, VEC v) {
    if (C - c >= VL)
        SUF(store)(x + c, v);
    else
        SUF(store_n)(x + c, v, C - c);
}

/* acc[0 .. m) += the first m lanes of v, in double (the weight / bias gradients' sums over rows:
 * float32 rows of 768 summed over thousands of rows drift in float) */
static inline void SUF(add_wide)(double *acc, VEC v, int64_t m) {
#if REAL_IS_DOUBLE
    if (m == VL) {
        SUF(store)(acc, SUF(load)(acc) + v);
        return;
    }
#else
    typedef double wide __attribute__((vector_size(32)));
    if (m == VL) {
        wide lo, hi;
        memcpy(&lo, acc, sizeof lo);
        memcpy(&hi, acc + 4, sizeof hi);
        lo += __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), wide);
        hi += __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), wide);
        memcpy(acc, &lo, sizeof lo);
        memcpy(acc + 4, &hi, sizeof hi);
        return;
    }
#endif
    REAL l[VL];
    memcpy(l, &v, sizeof v);
    for (int64_t j = 0; j < m; j++) acc[j] += (double)l[j];
}

void SUF(layernorm_forward)(const REAL *x, const REAL *w, const REAL *b, REAL *y, REAL *mean, REAL *rstd, int64_t C,
                            REAL eps, int64_t row0, int64_t row1) {
    const REAL inv_c = (REAL)1 / (REAL)C;
    for (int64_t r = row0; r < row1; r++) {
        const REAL *xr = x + r * C;
        REAL *yr = y + r * C;
        VEC s = {0};
        for (int64_t c = 0; c < C; c += VL) s += SUF(at)(xr, c, C);
        const REAL m = SUF(lanes)(s) * inv_c;
        VEC q = {0};
        for (int64_t c = 0; c < C; c += VL) {
            const VEC h = SUF(at)(xr, c, C) - m;
            q += SUF(select)(SUF(splat)(c) + SUF(ramp)() < (REAL)C, h * h, SUF(splat)(0));  /* past the row: 0 */
        }
        const REAL rs = (REAL)1 / SQRT(SUF(lanes)(q) * inv_c + eps);
        for (int64_t c = 0; c < C; c += VL) {
            VEC h = (SUF(at)(xr, c, C) - m) * rs;
            if (w) h *= SUF(at)(w, c, C);
            if (b) h += SUF(at)(b, c, C);
            SUF(put)(yr, c, C, h);
        }
        mean[r] = m;
        rstd[r] = rs;
    }
}

/* dw / db (NULL: none): this call's rows' sums, in row order */
void SUF(layernorm_backward)(const REAL *x, const REAL *w, const REAL *mean, const REAL *rstd, const REAL *dy, REAL *dx,
                             double *dw, double *db, int64_t C, int64_t row0, int64_t row1) {
    const REAL inv_c = (REAL)1 / (REAL)C;
    if (dw) memset(dw, 0, sizeof(double) * C);
    if (db) memset(db, 0, sizeof(double) * C);
    for (int64_t r = row0; r < row1; r++) {
        const REAL *xr = x + r * C, *dr = dy + r * C;
        const REAL m = mean[r], rs = rstd[r];
        VEC sg = {0}, sgx = {0};
        for (int64_t c = 0; c < C; c += VL) {
            const VEC xh = (SUF(at)(xr, c, C) - m) * rs, d = SUF(at)(dr, c, C);
            const VEC g = w ? d * SUF(at)(w, c, C) : d;
            sg += g;
            sgx += SUF(select)(SUF(splat)(c) + SUF(ramp)() < (REAL)C, g * xh, SUF(splat)(0));
            const int64_t m = C - c < VL ? C - c : VL;
            if (dw) SUF(add_wide)(dw + c, d * xh, m);
            if (db) SUF(add_wide)(db + c, d, m);
        }
        const REAL gm = SUF(lanes)(sg) * inv_c, gx = SUF(lanes)(sgx) * inv_c;
        for (int64_t c = 0; c < C; c += VL) {
            const VEC xh = (SUF(at)(xr, c, C) - m) * rs, d = SUF(at)(dr, c, C);
            const VEC g = w ? d * SUF(at)(w, c, C) : d;
            SUF(put)(dx + r * C, c, C, (g - xh * gx - gm) * rs);
        }
    }
}

void SUF(rmsnorm_forward)(const REAL *x, const REAL *w, REAL *y, REAL *rstd, int64_t C, REAL eps, int64_t row0,
                          int64_t row1) {
    const REAL inv_c = (REAL)1 / (REAL)C;
    for (int64_t r = row0; r < row1; r++) {
        const REAL *xr = x + r * C;
        VEC q = {0};
        for (int64_t c = 0; c < C; c += VL) {
            const VEC v = SUF(at)(xr, c, C);
            q += v * v;
        }
        const REAL rs = (REAL)1 / SQRT(SUF(lanes)(q) * inv_c + eps);
        for (int64_t c = 0; c < C; c += VL) {
            VEC h = SUF(at)(xr, c, C) * rs;
            if (w) h *= SUF(at)(w, c, C);
            SUF(put)(y + r * C, c, C, h);
        }
        rstd[r] = rs;
    }
}

void SUF(rmsnorm_backward)(const REAL *x, const REAL *w, const REAL *rstd, const REAL *dy, REAL *dx, double *dw,
                           int64_t C, int64_t row0, int64_t row1) {
    const REAL inv_c = (REAL)1 / (REAL)C;
    if (dw) memset(dw, 0, sizeof(double) * C);
    for (int64_t r = row0; r < row1; r++) {
        const REAL *xr = x + r * C, *dr = dy + r * C;
        const REAL rs = rstd[r];
        VEC sgx = {0};
        for (int64_t c = 0; c < C; c += VL) {
            const VEC xh = SUF(at)(xr, c, C) * rs, d = SUF(at)(dr, c, C);
            sgx += (w ? d * SUF(at)(w, c, C) : d) * xh;
            if (dw) SUF(add_wide)(dw + c, d * xh, C - c < VL ? C - c : VL);
        }
        const REAL gx = SUF(lanes)(sgx) * inv_c;
        for (int64_t c = 0; c < C; c += VL) {
            const VEC xh = SUF(at)(xr, c, C) * rs, d = SUF(at)(dr, c, C);
            const VEC g = w ? d * SUF(at)(w, c, C) : d;
            SUF(put)(dx + r * C, c, C, (g - xh * gx) * rs);
        }
    }
}
#endif
