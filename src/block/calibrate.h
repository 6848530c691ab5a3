/*
 * Calibration of static activation scales (src/block/calibrate.c): the
 * amaxes ModelOpt's NVFP4 export turns into input_scale, for the in-memory
 * quantizer (moe_layer_calibrate_nvfp4) and for moe_quantize_checkpoint.
 */
#ifndef MOE_BLOCK_CALIBRATE_H
#define MOE_BLOCK_CALIBRATE_H

#include "io/quantize.h" /* moe_calib_amax, moe_nvfp4_input_scale */
#include "moeaudit.h"


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


#endif
