/*
 * The checkpoint quantizer's way in for the rooms above io (src/io/quantize.c).
 *
 * Writing a quantized checkpoint is io's (floor 2); calibrating NVFP4 input
 * scales needs the router and the experts (src/block/calibrate.c, floor 5).
 * So the writer takes the calibration as functions its caller hands it
 * (moe_quant_calibrator), and the public moe_quantize_checkpoint(_with) is
 * defined in src/block/calibrate.c, which passes its own.
 */
#ifndef MOE_IO_QUANTIZE_H
#define MOE_IO_QUANTIZE_H

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

/* The calibration the writer calls for NVFP4 copies (all four required;
 * their contracts: src/block/calibrate.h). */
typedef struct moe_quant_calibrator {
    moe_status (*swiglu_amax)(const moe_weight *w1, const moe_weight *w3, double limit, const float *X, int64_t n,
                              float *amax_in, float *amax_mid, moe_error *err);
    moe_status (*layer_amax)(const moe_layer *L, const double *hidden, const int64_t *ids, int64_t T,
                             moe_calib_amax *out, moe_error *err);
    void (*fill_uncalibrated)(moe_calib_amax *a);
    void (*amax_free)(moe_calib_amax *a);
} moe_quant_calibrator;

/* moe_quantize_checkpoint_with (include/moeaudit.h) with the calibration
 * cal (NULL: an NVFP4 copy is MOE_ERR_ARG, nothing written). */
moe_status moe_quantize_checkpoint_calib(const char *in_dir, const char *out_dir, const moe_quant_opts *o,
                                         const moe_quant_file_opts *fo, const moe_quant_calibrator *cal,
                                         moe_quant_report *rep, moe_error *err);

/* ModelOpt: input_scale = amax / (6 * 448) in fp32; an all-zero or
 * non-finite amax gets 1 / (6 * 448), as an amax of 1 would, so the scale
 * stays usable. */
float moe_nvfp4_input_scale(float amax);

#endif
