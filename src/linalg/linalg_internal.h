/*
 * Internal to src/linalg: the float64 GEMM's register tiles (one ISA per
 * file) and the decode-and-pack step that feeds them (pack.c).
 *
 * Invariants:
 *  1. Every tile computes, for each of its outputs, the one sequence
 *       acc = first ? +0.0 : Y[t, j]
 *       for k = 0 .. kc-1:  acc = fma(X[t, k], Wp[k, j], acc)
 *       Y[t, j] = acc
 *     with fma the correctly rounded IEEE fused multiply-add (one rounding).
 *     So a dot product split into K blocks of any size, computed by any
 *     ISA's tile at any tile position, gives the same bits as one scalar
 *     fma chain over k = 0 .. K-1 from +0.0.
 *  2. Tiles never allocate, never read X rows past mr or Wp columns past
 *     the packed panel, and never write Y columns past nr.
 *  3. The packed panel holds exactly moe_weight_row_f64's values (pack.c
 *     states how each format is decoded); padding rows are +0.0 and never
 *     reach Y (masked stores).
 */
#ifndef MOE_LINALG_DGEMM_INTERNAL_H
#define MOE_LINALG_DGEMM_INTERNAL_H

#include "moeaudit.h"
#include "cpu/kernels.h"

#include <math.h>
#include <string.h>

#include <stdbool.h>
#include <stdint.h>

/*
 * One register tile: tokens t < mr (1 <= mr <= kernel mr), rows j < nr
 * (1 <= nr <= kernel nr):
 *   Wp: [kc, NR] float64, the packed panel (row j of W in column j), 64-byte
 *       aligned, NR = the kernel's nr
 *   X:  [mr, ldx] float64 (this tile's first token, at its column k0)
 *   Y:  [mr, ldy] float64 (this tile's first token, at its row j0)
 *   first: start from +0.0 (the first K block) instead of Y's partial sums
 */
typedef void (*moe_dgemm_tile_fn)(int64_t kc, const double *Wp, const double *X, int64_t ldx, int mr, double *Y,
                                  int64_t ldy, int nr, bool first);

/* Decode-and-pack (see moe_dgemm_pack below). */
typedef void (*moe_dgemm_pack_fn)(const moe_weight *w, int64_t r0, int64_t nrows, int64_t k0, int64_t kc, int nr,
                                  double *Wp);

/* Pack from float64 vectors given by pointer (see moe_dgemm_pack_ptrs). */
typedef void (*moe_dgemm_pack_ptrs_fn)(const double *const *v, bool by_cols, int64_t r0, int64_t nrows, int64_t k0,
                                       int64_t kc, int nr, double *Wp);

typedef struct moe_dgemm_kernel {
    const char *isa;        /* "ref", "avx2", "avx512" */
    int mr, nr;             /* the largest tile: tokens x rows */
    moe_dgemm_tile_fn tile;
    moe_dgemm_pack_fn pack; /* moe_dgemm_pack or a SIMD twin with the same output bits */
    moe_dgemm_pack_ptrs_fn pack_ptrs; /* moe_dgemm_pack_ptrs or a SIMD twin (copies: same bits) */
} moe_dgemm_kernel;

/* The scalar tile (dgemm_ref.c): fma() from libm, 4 x 4. Always present. */
const moe_dgemm_kernel *moe_dgemm_ref(void);
/* AVX2 + FMA (avx2/dgemm_avx2.c): 6 tokens x 8 rows (two ymm per token). */
const moe_dgemm_kernel *moe_dgemm_avx2(void);
/* AVX-512F (avx512/dgemm_avx512.c): 8 tokens x 24 rows (three zmm per token). */
const moe_dgemm_kernel *moe_dgemm_avx512(void);

/*
 * Decode rows r0 .. r0+nrows-1, columns k0 .. k0+kc-1 of w into panels of
 * nr rows: Wp[p * kc * nr + k * nr + j] = W[r0 + p * nr + j, k0 + k]
 * (float64, moe_weight_row_f64's value bit for bit, NaN payloads aside);
 * rows past nrows up to a multiple of nr are +0.0.
 *   Wp: [ceil(nrows / nr), kc, nr]
 * FP4 formats need k0 and kc even (the driver uses even K blocks).
 * The scalar definition (pack.c); SIMD twins must give the same bits.
 */
void moe_dgemm_pack(const moe_weight *w, int64_t r0, int64_t nrows, int64_t k0, int64_t kc, int nr, double *Wp);
/* True for weights only moe_dgemm_pack decodes (the SIMD packs are written
 * for 128 x 128 FP8 tiles and NVFP4's scale2): FP8 blocks of another size,
 * compressed-tensors NVFP4 (global_scale > 0). moe_dgemm_block packs them
 * with moe_dgemm_pack on every ISA. */
bool moe_dgemm_pack_generic_only(const moe_weight *w);

/*
 * The same panels from plain float64 vectors:
 *   by_cols false ("rows"): output row n is v[n] [K]:  Wp[p][k][j] = v[r0 + p nr + j][k0 + k]
 *   by_cols true ("cols"):  input column k is v[k] [N]: Wp[p][k][j] = v[k0 + k][r0 + p nr + j]
 * rows past nrows are +0.0.
 */
void moe_dgemm_pack_ptrs(const double *const *v, bool by_cols, int64_t r0, int64_t nrows, int64_t k0, int64_t kc,
                         int nr, double *Wp);

/* Columns k0 .. k0+n-1 (n <= 32) of row r of w into dst [n], as
 * moe_dgemm_pack decodes them (the SIMD packs' edge path). */
void moe_dgemm_decode_row(const moe_weight *w, int64_t r, int64_t k0, int64_t n, double *dst);

/* E8M0 code e as float64: 2^(e - 127) (a normal double for every e <
 * 0xFF: its biased exponent e + 896 is built directly, the same value as
 * ldexp(1.0, e - 127) without the libm call), NaN for 0xFF. */
static inline double moe_dgemm_e8m0(uint8_t e) {
    if (e == 0xFF) return (double)NAN;
    uint64_t bits = (uint64_t)(e + 896u) << 52;
    double d;
    memcpy(&d, &bits, 8);
    return d;
}

/* Blocking of the driver: columns per K block (even: FP4 packs byte
 * pairs; a multiple of 8: the SIMD packs), rows per packed block at most
 * (72 x 1024 doubles = 576 KiB, L2-resident; a multiple of every NR).
 * Measured on Zen 4, one core, CPU time, FP8 weights (T = 256 / 4096):
 * KC 256 x 240 rows 51.5 / 49.3 GFLOP/s, 512 x 120 52.6 / 50.8,
 * 1024 x 72 53.7 / 52.7, 2048 x 48 53.6 / 53.2 (per-core peak 57.7):
 * longer K blocks park Y's partial sums less often. */
enum { MOE_DGEMM_KC = 1024, MOE_DGEMM_ROWS = 72 };
/* The widest tile of any kernel (AVX-512's 24 rows): every kernel's NR
 * divides it and it divides MOE_DGEMM_ROWS, so a block of r rows packs
 * into at most min(r rounded up to it, MOE_DGEMM_ROWS) rows (each ISA file
 * asserts its NR divides it). */
enum { MOE_DGEMM_NR_MAX = 24 };
_Static_assert(MOE_DGEMM_ROWS % MOE_DGEMM_NR_MAX == 0, "a packed block is whole tiles of every kernel");

/* Where the packed operand comes from: a stored weight (its rows are the
 * outputs), or float64 vectors (moe_dgemm_pack_ptrs' two forms). K: the
 * reduction length (w->cols for a weight). */
typedef struct moe_dgemm_src {
    const moe_weight *w;
    const double *const *v;
    bool by_cols;
    int64_t K;
} moe_dgemm_src;

/*
 * One block of the GEMM (dgemm.c): outputs r0 .. r1-1 (r1 - r0 <=
 * MOE_DGEMM_ROWS) for tokens t0 .. t1-1, every K block in order: pack,
 * then every tile. The fma chain of linalg_internal.h, invariant 1.
 *   X: [T, ldx] (row t at X + t * ldx), Y: [T, ldy] (column r for output r)
 *   Wp: MOE_DGEMM_ROWS x MOE_DGEMM_KC doubles, 64-byte aligned
 */
void moe_dgemm_block(const moe_dgemm_kernel *kr, const moe_dgemm_src *src, int64_t r0, int64_t r1, int64_t t0,
                     int64_t t1, const double *X, int64_t ldx, double *Y, int64_t ldy, double *Wp);

/* The float64 tile an ISA's kernel table selects. */
const moe_dgemm_kernel *moe_dgemm_for(const moe_cpu_kernels *k);

/* k, or the table of MOE_ISA_AUTO (the best this CPU supports) when k is
 * NULL. */
const moe_cpu_kernels *moe_dgemm_table(const moe_cpu_kernels *k);

#endif
