/* 32-byte vectors of REAL (GCC / Clang vector extensions: one AVX register where there is one,
 * two SSE / NEON registers elsewhere), so that register-blocked accumulators stay in registers
 * and the exp below runs on whole vectors (a loop calling a scalar exp with its range checks is
 * not vectorised without -ffast-math). Included inside a REAL body: VEC, IVEC (the integer vector
 * of its comparisons), VL (lanes), W (2 VL: the width of a tile's column block), SUF(load) /
 * SUF(store) (unaligned), SUF(splat), SUF(select), SUF(vmax), SUF(exp_vec) and SUF(lanes). */
#undef VEC
#undef IVEC
#undef VL
#undef W
#define VEC SUF(vec)
#define IVEC SUF(ivec)
typedef REAL VEC __attribute__((vector_size(32)));
#if REAL_IS_DOUBLE
typedef int64_t IVEC __attribute__((vector_size(32)));
#else
typedef int32_t IVEC __attribute__((vector_size(32)));
#endif
#define VL ((int)(32 / sizeof(REAL)))
#define W (2 * VL)

static inline VEC SUF(load)(const REAL *p) {
    VEC v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void SUF(store)(REAL *p, VEC v) { memcpy(p, &v, sizeof v); }

static inline VEC SUF(splat)(REAL x) {
#if REAL_IS_DOUBLE
    return (VEC){x, x, x, x};
#else
    return (VEC){x, x, x, x, x, x, x, x};
#endif
}

/* mask ? a : b, lane by lane (mask lanes all ones or all zeros: a comparison's result) */
static inline VEC SUF(select)(IVEC mask, VEC a, VEC b) { return (VEC)((mask & (IVEC)a) | (~mask & (IVEC)b)); }

static inline VEC SUF(vmax)(VEC a, VEC b) { return SUF(select)(a > b, a, b); }

/* exp(x) lane by lane: x = n ln2 + r with n = round(x / ln2) (adding 1.5 * 2^mantissa-bits rounds
 * to nearest and leaves n in the low bits), exp(r) by its Taylor polynomial on |r| <= ln2 / 2
 * (degree 7 for float, 13 for double: truncation below 0.1 ulp; with Horner's roundings a few ulp
 * of the true exp, checked in tests/ops/test_cpu_kernels.py), times 2^n built in the exponent
 * bits. x below EXP_LO gives 0 (exp(EXP_LO) is near the smallest normal number: such terms count
 * for nothing beside a softmax row's largest, 1); x above -EXP_LO is clamped there. */
static inline VEC SUF(exp_vec)(VEC x) {
    const VEC lo = SUF(splat)(EXP_LO), hi = SUF(splat)(-EXP_LO);
    const IVEC hidden = x < lo;
    x = SUF(select)(hidden, lo, SUF(select)(x > hi, hi, x));
#if REAL_IS_DOUBLE
    const VEC magic = SUF(splat)(6755399441055744.0); /* 1.5 * 2^52 */
    const VEC t = x * 1.4426950408889634 + magic, n = t - magic;
    const VEC r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    VEC p = SUF(splat)(1.0 / 6227020800.0);
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    const IVEC two_n = ((IVEC)t + 1023) << 52;
#else
    const VEC magic = SUF(splat)(12582912.0f); /* 1.5 * 2^23 */
    const VEC t = x * 1.44269504f + magic, n = t - magic;
    const VEC r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    VEC p = SUF(splat)(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const IVEC two_n = ((IVEC)t + 127) << 23;
#endif
    return (VEC)((IVEC)(p * (VEC)two_n) & ~hidden);
}

/* the sum of acc's lanes, pairwise (lane l + VL/2 into lane l, ...): a fixed order */
static inline REAL SUF(lanes)(VEC acc) {
    REAL l[VL];
    memcpy(l, &acc, sizeof acc);
    for (int w = VL / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) l[i] += l[i + w];
    return l[0];
}

/* the first m (< VL) lanes of p, the rest zero / store only the first m lanes: a row's tail */
static inline VEC SUF(load_n)(const REAL *p, int64_t m) {
    VEC v = {0};
    memcpy(&v, p, sizeof(REAL) * m);
    return v;
}

static inline void SUF(store_n)(REAL *p, VEC v, int64_t m) { memcpy(p, &v, sizeof(REAL) * m); }

/* 0, 1, ..., VL - 1 */
static inline VEC SUF(ramp)(void) {
#if REAL_IS_DOUBLE
    return (VEC){0, 1, 2, 3};
#else
    return (VEC){0, 1, 2, 3, 4, 5, 6, 7};
#endif
}
