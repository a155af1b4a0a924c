/* Compiles the including file's body twice, REAL float (entry points *_f32) then double (*_f64):
 * the file defines SELF (its own name) and includes this outside its body, which it guards with
 * #ifndef REAL. In a body: REAL, SUF(name) (the suffixed name), REAL_IS_DOUBLE, EXP_LO (vec.h's
 * exp gives 0 below it) and SQRT (math.h's, for REAL: the includer includes math.h). */
#define REAL float
#define SUF(name) name##_f32
#define EXP_LO (-87.0f)
#define REAL_IS_DOUBLE 0
#define SQRT sqrtf
#include SELF
#undef REAL
#undef SUF
#undef EXP_LO
#undef REAL_IS_DOUBLE
#undef SQRT

#define REAL double
#define SUF(name) name##_f64
#define EXP_LO (-708.0)
#define REAL_IS_DOUBLE 1
#define SQRT sqrt
#include SELF
