/* Rotary position embedding on the CPU (HF's rotate_half layout), forward (R) and backward (R^T):
 * cutp.ops.rotary's compiled path for x [B, T, heads, hd] with a contiguous head dim (the QKV
 * buffer's q and k heads, any other strides) and per-token tables cos, sin [T, rd] shared by the
 * batch rows; its NumPy code is the reference. On a pair (x1, x2) = (x[i], x[i + rd/2]):
 * R: y1 = c1 x1 - s1 x2, y2 = s2 x1 + c2 x2; R^T: y1 = c1 x1 + s2 x2, y2 = c2 x2 - s1 x1 (c1 / c2
 * and s1 / s2 the tables' halves); elements past rd copied. In place when y is x (each pair read
 * before it is written). Rows (b, t) [row0, row1) of the B x T per call: every element computed
 * alone, so the split changes nothing. Flags and the self-inclusion as in attention.c, and no
 * fused multiply-adds (the line below): each output is two rounded products and one rounded sum,
 * the NumPy path's bits exactly (a model's rotary bits do not depend on the path).
 */
/* cflags: -ffp-contract=off */
#ifndef REAL
#include <stdint.h>
#include <string.h>

#define SELF "rotary.c"
#include "twice.h"

#else /* ---- the body, once per REAL ------------------------------------------------------- */

#include "vec.h"

/* xs / ys: x's and y's strides (b, t, head) in elements; cos, sin [T][rd] contiguous */
void SUF(rotary)(const REAL *x, const int64_t *xs, REAL *y, const int64_t *ys, const REAL *cos, const REAL *sin,
                 int64_t T, int64_t heads, int64_t hd, int64_t rd, int transpose, int64_t row0, int64_t row1) {
    const int64_t h2 = rd / 2;
    for (int64_t bt = row0; bt < row1; bt++) {
        const int64_t b = bt / T, t = bt % T;
        const REAL *c = cos + t * rd, *s = sin + t * rd;
        for (int64_t h = 0; h < heads; h++) {
            const REAL *xr = x + b * xs[0] + t * xs[1] + h * xs[2];
            REAL *yr = y + b * ys[0] + t * ys[1] + h * ys[2];
            for (int64_t i = 0; i < h2; i += VL) {
                const int64_t m = h2 - i < VL ? h2 - i : VL;
                const VEC x1 = m == VL ? SUF(load)(xr + i) : SUF(load_n)(xr + i, m);
                const VEC x2 = m == VL ? SUF(load)(xr + h2 + i) : SUF(load_n)(xr + h2 + i, m);
                const VEC c1 = m == VL ? SUF(load)(c + i) : SUF(load_n)(c + i, m);
                const VEC c2 = m == VL ? SUF(load)(c + h2 + i) : SUF(load_n)(c + h2 + i, m);
                const VEC s1 = m == VL ? SUF(load)(s + i) : SUF(load_n)(s + i, m);
                const VEC s2 = m == VL ? SUF(load)(s + h2 + i) : SUF(load_n)(s + h2 + i, m);
                const VEC y1 = transpose ? c1 * x1 + s2 * x2 : c1 * x1 - s1 * x2;
                const VEC y2 = transpose ? c2 * x2 - s1 * x1 : s2 * x1 + c2 * x2;
                if (m == VL) {
                    SUF(store)(yr + i, y1);
                    SUF(store)(yr + h2 + i, y2);
                } else {
                    SUF(store_n)(yr + i, y1, m);
                    SUF(store_n)(yr + h2 + i, y2, m);
                }
            }
            if (yr != xr)
                for (int64_t i = rd; i < hd; i++) yr[i] = xr[i];
        }
    }
}
#endif
