/* Internal pieces of the indexer shared by indexer.c and needle.c. */
#ifndef MOE_INDEXER_IMPL_H
#define MOE_INDEXER_IMPL_H

#include "moeaudit_indexer.h"

#define MOE_IDX_MAX_HEADS 256
#define MOE_IDX_MAX_DIM 4096

/* One score from prepared operands.
 *   qT [dim, heads]: the query's heads, rotated and rounded, transposed
 *   w  [heads], kr [dim]: one rotated and rounded key */
double moe_idx_score1_ref(const double *qT, const double *w, const double *kr, int heads, int dim);
float moe_idx_score1(const float *qT, const float *w, const float *kr, int heads, int dim, moe_idx_accum mode);

/* Rotate (when hadamard) and transpose q [heads, dim] into qT [dim, heads]. */
void moe_idx_prep_q_ref(const double *q, int heads, int dim, bool hadamard, double *tmp, double *qT);
/* fp32 twin that also rounds per `quant`; tmp [dim], scratch moe_idx_quant_scratch(dim). */
void moe_idx_prep_q(const double *q, int heads, int dim, bool hadamard, moe_idx_quant quant, float *tmp,
                    void *scratch, float *qT);
/* One key k [dim] to out [dim]: fp32, rotated, rounded. */
void moe_idx_prep_k(const double *k, int dim, bool hadamard, moe_idx_quant quant, void *scratch, float *out);

#endif
