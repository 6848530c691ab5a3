/*
 * Calibration of static activation scales (src/block/calibrate.c): the
 * amaxes ModelOpt's NVFP4 export turns into input_scale, for the in-memory
 * quantizer (moe_layer_calibrate_nvfp4) and for moe_quantize_checkpoint.
 */
#ifndef MOE_BLOCK_CALIBRATE_H
#define MOE_BLOCK_CALIBRATE_H

#include "moeaudit.h"

/* Per routed expert of a layer: the input amaxes of GEMM1 (in13, shared by
 * w1 and w3) and GEMM2 (in2) over the tokens routed to it, and how many
 * tokens that was; the shared expert's over every token. */
typedef struct moe_calib_amax {
    int E;
    float *in13, *in2;     /* [E] */
    int64_t *tokens;       /* [E] */
    float shared_in13, shared_in2;
} moe_calib_amax;

/* amax of X [n, H] and of SwiGLU(w1 . x, w3 . x) (clamped by limit > 0) over
 * its rows, float32 GEMMs of the best kernel table. */
moe_status moe_swiglu_amax(const moe_weight *w1, const moe_weight *w3, double limit, const float *X, int64_t n,
                           float *amax_in, float *amax_mid, moe_error *err);

/* Route hidden [T, H] (ids [T] on hash layers) through L's router (float64)
 * and fill *out (moe_calib_amax_free). */
moe_status moe_layer_calib_amax(const moe_layer *L, const double *hidden, const int64_t *ids, int64_t T,
                                moe_calib_amax *out, moe_error *err);
void moe_calib_amax_free(moe_calib_amax *a);

/* ModelOpt's fallback for experts no token reached: the largest amax of
 * the calibrated experts, per projection. */
void moe_calib_fill_uncalibrated(moe_calib_amax *a);

/* input_scale = amax / (6 * 448) (fp32); amax 0 or not finite: 1 / (6 * 448). */
float moe_nvfp4_input_scale(float amax);

#endif
