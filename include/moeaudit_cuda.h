/*
 * moeaudit_cuda.h: the MoE block on an NVIDIA GPU (Hopper, sm_90a).
 *
 * Worked example: upload a layer, run T tokens, read the same outputs as the
 * CPU block (moe_block_run) fills.
 *
 *     moe_cuda_layer *g = NULL;
 *     if (moe_cuda_layer_upload(L, &g, &err) != MOE_OK) { ... }
 *     moe_run_opts o = moe_run_opts_default();
 *     o.act = MOE_ACT_BF16;                    // or MOE_ACT_FP8
 *     moe_block_out out;
 *     moe_block_out_init(&out, L, T, &o, &err);
 *     if (moe_cuda_block_run(g, hidden, input_ids, T, &o, &out, &err) != MOE_OK) { ... }
 *     moe_block_out_free(&out);
 *     moe_cuda_layer_free(g);
 *
 * What the GPU computes (docs/performance-cuda.md has the numbers):
 *  - router: logits in fp32 (fp32 hidden, fp32 gate weights), scores, biased
 *    and grouped top-k and hash routing in fp32 with the reference's order
 *    (score desc, id asc, NaN last), renormalization with MOE_RENORM_EPS;
 *  - experts: tensor-core operands are bf16: activations are rounded to bf16
 *    (MOE_ACT_EXACT and MOE_ACT_BF16) or to E4M3 per 128 values
 *    (MOE_ACT_FP8: power-of-two scale, exact in bf16; MOE_ACT_FP8_F32SCALE:
 *    fp32 scale, then rounded to bf16), weights are decoded on the fly
 *    (BF16, FP8 128x128 tiles, MXFP4, NVFP4; F32/F16/F64 weights are rounded
 *    to BF16 at upload), accumulation is fp32, the SwiGLU clamp is applied as
 *    in the reference, and the SwiGLU output is rounded like the input;
 *    except FP8 weights, and MXFP4 weights transcoded to E4M3 at upload
 *    (moe_cuda_layer_note), with FP8 activations on the grouped GEMMs (AUTO from
 *    T = 8, MXFP4 from T = 32; WGMMA): E4M3 codes times E4M3 codes on the FP8 tensor cores,
 *    whose accumulator keeps about 10-14 bits of each 128-column block, the
 *    blocks summed in fp32 with the activation and weight scales (no bf16
 *    rounding of either); the shared expert keeps the bf16 operands;
 *  - combine: per token in column order, fp32, with the scaling contract of
 *    moe_contract_for, so outputs do not depend on the
 *    batch a token sits in.
 * Results are deterministic: no atomics take part in any sum.
 *
 * Thread safety: a moe_cuda_layer serialises its calls on its own stream and
 * workspace; use one per host thread. All functions return MOE_ERR_UNSUPPORTED
 * when the library was built without CUDA or no device is present.
 */
#ifndef MOEAUDIT_CUDA_H
#define MOEAUDIT_CUDA_H

#include "moeaudit.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_cuda_layer moe_cuda_layer;

/* Number of CUDA devices (0 when none, or no driver). Never fails. */
int moe_cuda_device_count(void);
/* Name and compute capability of the current device into buf [n]. */
moe_status moe_cuda_device_info(char *buf, size_t n, moe_error *err);

/* Copy layer L to the current device: router (fp32), bias, tid2eid, routed
 * and shared experts in a padded device layout (rows to 128, columns to 64;
 * zeros). Every routed expert must share one weight format per projection.
 * The device copy owns its memory; L may be freed afterwards.
 * MOE_ERR_UNSUPPORTED: no device, or a format the GPU path lacks. */
moe_status moe_cuda_layer_upload(const moe_layer *L, moe_cuda_layer **out, moe_error *err);
void moe_cuda_layer_free(moe_cuda_layer *g); /* NULL is a no-op */

/* Expert-path selection: AUTO takes the GEMV kernels (one pass over the
 * expert weights per assignment) for small T and the grouped tensor-core
 * GEMMs otherwise, and for FP4 weights the grouped GEMV (one pass per
 * expert for up to 4 of its tokens) in between; the others force one
 * (tests, bench). The grouped GEMMs run on Hopper's wgmma (WGMMA: a
 * persistent, warp-specialized kernel, weight tiles brought by the bulk
 * tensor copy engine (TMA), FP8 / FP4 weights decoded into shared memory by
 * the two MMA warpgroups beside their MMAs); WGMMA_PD forces the same
 * kernel with the decode in the producer warpgroup (the earlier decode),
 * WGMMA_CP that one with every byte loaded by the producer's cp.async (the
 * earlier load path); both kept for comparison, same results bit for bit;
 * MMA forces the older mma.sync GEMM. FP8 weights with FP8 activations
 * (act fp8 / fp8-f32scale) take, on WGMMA and AUTO, the FP8 tensor-core
 * GEMMs (activation codes and per-128 scales straight into wgmma e4m3 x
 * e4m3, fp32 promotion per 128 columns); WGMMA_BF16 forces for them the
 * bf16-operand kernel of WGMMA (activations rounded through E4M3, then
 * multiplied as bf16; for other formats or activations it is WGMMA). The GEMV of
 * FP4 weights runs on the tensor cores (a dot product per scale block);
 * GEMV_F32 forces the fp32-FMA GEMV for them too (the one BF16 and FP8
 * weights always take). GROUPED applies to FP4 weights only (others take
 * GEMV). */
typedef enum moe_cuda_path {
    MOE_CUDA_PATH_AUTO,
    MOE_CUDA_PATH_GEMV,
    MOE_CUDA_PATH_MMA,
    MOE_CUDA_PATH_GEMV_F32,
    MOE_CUDA_PATH_GROUPED,
    MOE_CUDA_PATH_WGMMA,
    MOE_CUDA_PATH_WGMMA_CP,
    MOE_CUDA_PATH_WGMMA_PD,
    MOE_CUDA_PATH_WGMMA_BF16
} moe_cuda_path;
void moe_cuda_layer_set_path(moe_cuda_layer *g, moe_cuda_path p);

/* How the small-T GEMV chain (gate/up GEMV, down GEMV, combine) is
 * launched, a bit set (default MOE_CUDA_SMALLT_PDL; 0 is the earlier
 * launch, plain kernels in stream order, kept for the A/B): PDL launches
 * the down GEMV and the combine as programmatic dependents (they start as
 * the kernel before them drains, ask for their first weights, then wait
 * for its output); L2 has every warp of the per-assignment FP4 GEMVs
 * (T <= 8) ask L2 for its weight rows a few K steps ahead of its register
 * loads (measured 3-11% slower at T = 1 on the H200,
 * docs/performance-cuda.md: off by default, kept for the A/B). Results
 * are the same bits either way. Unknown bits are ignored. Not thread-safe
 * against a run on the same layer. */
enum { MOE_CUDA_SMALLT_PDL = 1, MOE_CUDA_SMALLT_L2 = 2 };
void moe_cuda_layer_set_smallt_launch(moe_cuda_layer *g, unsigned flags);

/* Token rows per tile of the bf16-operand wgmma GEMMs, every weight format
 * (paths AUTO and WGMMA; not the FP8 tensor-core GEMMs): 128, 256 (each
 * weight tile read, and FP8 / FP4 decoded, once per 256 positions of an
 * expert instead of per 128: half the weight traffic where experts hold
 * 129-256 positions), or 0, the default: 256 where the positions average
 * at least 128 per expert. Other values mean 0; other paths ignore it. The
 * same bits either way. Not thread-safe against a run on the same layer. */
void moe_cuda_layer_set_wg_tokens(moe_cuda_layer *g, int tokens);

/* The token rows per tile (128 or 256) the routed experts' bf16-operand
 * wgmma GEMMs take for T tokens with activations `act` on the layer's
 * current path and setting, or 0 where another kernel runs them (the
 * GEMVs, mma.sync, the FP8 tensor-core GEMMs). No device work;
 * thread-safe against concurrent readers of g. */
int moe_cuda_layer_wg_tokens_at(const moe_cuda_layer *g, int64_t T, moe_act_prec act);

/* What the routed experts' tensor cores multiply for T tokens with
 * activations `act` on the layer's current path: "fp8" where the FP8
 * tensor-core GEMMs run (FP8 weights, act fp8 / fp8-f32scale, path AUTO or
 * WGMMA at a T that takes the grouped GEMMs), "fp8 (mxfp4 transcoded)"
 * where they run on MXFP4 weights transcoded at upload (the same values:
 * moe_cuda_layer_note), else "bf16" (also the GEMVs, whose fp32 FMAs are
 * held to the bf16 rate). A static string; no device work; thread-safe
 * against concurrent readers of g. */
const char *moe_cuda_layer_operands(const moe_cuda_layer *g, int64_t T, moe_act_prec act);

/* What the upload did beyond copying, or NULL: for MXFP4 routed experts,
 * either that they were transcoded to E4M3 codes with one power-of-two
 * scale per 128 x 128 tile (exactly the checkpoint's values; 2x the FP4
 * bytes more on the device; FP8 activations then run on the FP8 tensor
 * cores from T = 32 under AUTO, and on WGMMA), or, when a tile's E8M0 codes
 * span more than 14 binades or hold a NaN, that they were not (the first
 * such tile named) and FP8 activations stay on the bf16-operand kernels.
 * Owned by g; thread-safe against concurrent readers. */
const char *moe_cuda_layer_note(const moe_cuda_layer *g);

/* Device memory the layer's workspace takes for T tokens, in bytes. The
 * workspace is allocated by the run functions (never by the kernels) and
 * kept for the next call. */
size_t moe_cuda_workspace_size(const moe_cuda_layer *g, int64_t T, const moe_run_opts *opts);

/* Run the block on T tokens, host in, host out; the same contract as
 * moe_block_run (hidden double [T, H], input_ids int64 [T] on hash layers,
 * out sized by moe_block_out_init with the same opts). opts->precision is
 * ignored (the GPU path is the bf16/fp8-operand fp32-accumulation path);
 * check_invariants runs moe_block_check on the result. */
moe_status moe_cuda_block_run(moe_cuda_layer *g, const double *hidden, const int64_t *input_ids, int64_t T,
                              const moe_run_opts *opts, moe_block_out *out, moe_error *err);

/* moe_cuda_block_run under a variant (include/moeaudit_variant.h; tests and
 * diagnose only): the routing kernel and the contract honour its fault and
 * toggles as moe_block_run_variant does. v NULL: moe_cuda_block_run. */
typedef struct moe_variant moe_variant;
moe_status moe_cuda_block_run_variant(moe_cuda_layer *g, const double *hidden, const int64_t *input_ids, int64_t T,
                                      const moe_run_opts *opts, const moe_variant *v, moe_block_out *out,
                                      moe_error *err);

/* ------------------------------------------------------------ benchmark */

/* A layer with random valid weight codes drawn on the device (no host copy):
 * routed experts only (no router, no shared expert), for timing. fmt:
 * BF16, FP8_BLOCK (E8M0 tile scales), MXFP4 or NVFP4. */
moe_status moe_cuda_layer_random(moe_wfmt fmt, int hidden, int inter, int n_experts, int top_k, uint64_t seed,
                                 moe_cuda_layer **out, moe_error *err);

/* Time the routed experts (sort by expert, gate/up with SwiGLU, down with
 * the weighted combine) for T tokens: ids [n_sets, T, K] (distinct per
 * token), weights [n_sets, T, K]; iteration i uses set i % n_sets and runs
 * on device-resident bf16 inputs (random, fixed). With `graphs`, each set's
 * launches are captured once into a CUDA graph and replayed (no host launch
 * gaps, as engines run decode steps). times_ms [iters] receives each timed
 * iteration's device time (CUDA events) after `warmup` untimed ones. */
moe_status moe_cuda_bench_experts(moe_cuda_layer *g, int64_t T, moe_act_prec act, const int32_t *ids,
                                  const float *weights, int n_sets, int warmup, int iters, bool graphs,
                                  double *times_ms, moe_error *err);

/* The device's ceilings, measured now: device-to-device copy bandwidth
 * (bytes read + written per second, 2 GiB buffers, best of 10) and dense
 * bf16 GEMM rate through cuBLAS (8192^3, fp32 accumulation, best of 10; 0
 * when built without cuBLAS). */
moe_status moe_cuda_measure_ceilings(double *copy_bytes_per_s, double *bf16_flops_per_s, moe_error *err);

/* Dense FP8 GEMM rate through cuBLASLt, measured now: E4M3 x E4M3 with fp32
 * accumulation and bf16 output, 8192^3, best of 10 (the ceiling of an FP8
 * tensor-core path). *fp8_flops_per_s is 0 when built without cuBLASLt or
 * when cuBLASLt offers no FP8 algorithm (still MOE_OK). */
moe_status moe_cuda_measure_fp8_peak(double *fp8_flops_per_s, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MOEAUDIT_CUDA_H */
