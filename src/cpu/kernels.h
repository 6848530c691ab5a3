/*
 * Fast CPU kernels behind a dispatch table (one ISA per file; docs/architecture.md).
 *
 * A table starts filled with the scalar references (gemm_ref.c) and is
 * overridden entry by entry per ISA. Each call names its ISA (moe_isa, from
 * moe_run_opts.isa) and gets that table from moe_cpu_table (dispatch.c):
 * per-call dispatch, no global table.
 *
 * Kernel contract (all entries):
 *  1. Never allocate; never print. Shapes and strides are explicit. Scratch
 *     beyond a few KiB of stack comes from the caller: gemm_bf16act takes a
 *     workspace of bf16act_ws(w, n) bytes (see there).
 *  2. Deterministic: every output element is produced by the same sequence of
 *     floating-point operations whatever n, r0, r1 and the thread that runs
 *     it, so results do not depend on batch composition or thread count.
 *     A table therefore never switches arithmetic on n: a crossover between
 *     two instruction sets (AMX tiles above some n, AVX-512 below) would give
 *     a token different bits in a batch of 2 than in one of 200. The choice
 *     may depend on the weight (format, shape) and on the table only.
 *  3. The weight is decoded inside the kernel (never materialised as a whole
 *     dequantized matrix); values equal moe_weight_row_f32's exactly, only the
 *     summation order of the dot products differs from the reference.
 */
#ifndef MOE_CPU_KERNELS_H
#define MOE_CPU_KERNELS_H

#include "moeaudit.h"

#include <stddef.h>

/*
 * Y[t, j] = sum_k X[t, k] * W[r0 + j, k]   for t < n, j < r1 - r0
 *   w:  [rows, cols] weight in any moe_wfmt
 *   X:  [n, ldx] float32, the first w->cols columns used (activations already
 *       rounded to their precision by the caller: bf16 or fp8 values are
 *       exactly representable in float)
 *   Y:  [n, ldy] float32, columns 0 .. r1 - r0 written
 */
typedef void (*moe_gemm_fn)(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx,
                            int64_t n, float *Y, int64_t ldy);

/*
 * The same product with a caller-owned workspace:
 *   ws: bf16act_ws(w, n) bytes, 64-byte aligned, owned by this call until
 *       it returns (one workspace per concurrent call: per thread); its
 *       contents on entry do not matter and on return are unspecified.
 * The size depends on the weight's format and shape and on n only (never on
 * r0, r1), grows at most linearly in n, and is 0 where the kernel needs
 * none (ws may then be NULL).
 */
typedef void (*moe_gemm_ws_fn)(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx,
                               int64_t n, float *Y, int64_t ldy, void *ws);
typedef size_t (*moe_gemm_ws_size_fn)(const moe_weight *w, int64_t n);

/*
 * gemm_bf16act: the product when every X[t, k] (k < w->cols) is a bf16
 * value (the caller rounded the activations with moe_act_prec MOE_ACT_BF16;
 * other values are rounded to bf16, nearest even). NULL when the table has
 * none (ref, avx2, or a CPU without AVX512_BF16): callers then use gemm.
 *
 * avx512 (src/cpu/avx512/gemm_avx512.c states the exact sequence): MXFP4,
 * NVFP4 and BF16 weights are decoded to bf16 (exact: NVFP4 without scale2)
 * and multiplied by vdpbf16ps; the other formats, and rows wider than 32768,
 * run gemm's arithmetic (the choice depends on w only).
 *   Reduction order: per (token, row) 16 fp32 lanes; lane i takes, for each
 *   32-column chunk in order, two columns of that chunk (the pair's second
 *   one first), then the lanes are summed by gemm's fixed tree; NVFP4 then
 *   multiplies by scale2 once.
 *   Rounding: each product is exact and added with one fp32 round-to-
 *   nearest-even (a fused multiply-add); denormal inputs (weights,
 *   activations, accumulator) read as zero and denormal results flush to
 *   zero (vdpbf16ps ignores MXCSR).
 *
 * amx (src/cpu/amx/gemm_amx.c states the exact sequence): MXFP4, NVFP4 and
 * BF16 weights (exact in bf16, NVFP4 without scale2) are decoded to bf16
 * tiles and multiplied by TDPBF16PS, for every n; the other formats run the
 * avx512 entry (gemm's arithmetic). Per (token, row), for each 32-column
 * step in order: the 16 even-position products and the 16 odd-position ones
 * are summed in two fp32 chains from zero, the two sums added, and that
 * added to the output's accumulator; every add rounds to nearest even with
 * denormals read as zero and flushed (the instruction's definition in
 * Intel's SDM; checked bit for bit on an Emerald Rapids Xeon).
 *
 * Contracts 1 and 2 hold as for gemm; contract 3 becomes: decoded weights
 * equal the reference's except that values below 2^-126 in magnitude count
 * as zero (MXFP4 scale codes 0 and 1 only) and NVFP4's scale2 moves to the
 * output.
 */
/*
 * The SwiGLU of the f32 experts over one row, in place:
 *   g[i] = moe_swiglu_f32(g[i], u[i], limit)   for i < n
 *   g: [n] float32, the gate in, the activation out; u: [n] float32, the up
 *   projection (read only; must not overlap g); limit <= 0 or NaN: no clamp.
 * Every entry gives moe_swiglu_f32's bits (formats/mathf.h) for every input
 * (NaN results are NaN; which NaN payload survives two NaN operands is not
 * part of the contract), whatever n and the alignment: the tail is the
 * same arithmetic. Contract 1 holds (no allocation); any thread may call.
 */
typedef void (*moe_swiglu_fn)(float *g, const float *u, int64_t n, float limit);

typedef struct moe_cpu_kernels {
    const char *isa;                 /* "ref", "avx2", "avx512", "amx" (moe_isa_name of the ISA) */
    moe_gemm_fn gemm;                /* see above */
    moe_gemm_ws_fn gemm_bf16act;     /* bf16 activations, or NULL */
    moe_gemm_ws_size_fn bf16act_ws;  /* its workspace bytes; set iff gemm_bf16act is */
    moe_swiglu_fn swiglu;            /* the SwiGLU (see above); NULL: the reference one (moe_cpu_swiglu) */
} moe_cpu_kernels;

/* The scalar reference table (always available). */
const moe_cpu_kernels *moe_cpu_ref(void);
/* The table of `isa` on this CPU (MOE_ISA_AUTO: avx512, else avx2, else ref;
 * amx only by name: dispatch.c says why) into *k; ->isa names the ISA taken. MOE_ERR_UNSUPPORTED (saying what is
 * available) when the CPU or build lacks it, as moe_isa_resolve. Tables are
 * immutable and live for the process: any number of threads may use one. */
moe_status moe_cpu_table(moe_isa isa, const moe_cpu_kernels **k, moe_error *err);

/* k's swiglu entry, or the reference table's when k has none (a table built
 * outside dispatch.c, such as the tests' recording tables). */
static inline moe_swiglu_fn moe_cpu_swiglu(const moe_cpu_kernels *k) {
    return k->swiglu ? k->swiglu : moe_cpu_ref()->swiglu;
}

#endif
