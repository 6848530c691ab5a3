/*
 * AVX-512 build of the fast quantizers: the bodies in
 * src/formats/quant_fast_impl.h compiled with this directory's AVX-512 flags
 * (GCC vectorizes them 16 lanes wide). Reached only through
 * src/formats/quant_fast.c after __builtin_cpu_supports checks.
 *
 * Invariants: see quant_fast_impl.h; nothing here but the entry points.
 */
#include "formats/quant_fast_impl.h"
#include "formats/quant_fast_internal.h"

MOE_QF_DEFINE_ENTRY_POINTS(avx512)
