/*
 * The combine: one token's routed columns summed with their emitted weights,
 * the runner's and the output's factors applied, the shared expert added
 * (docs/contract.md).
 *
 * Invariants:
 *  1. Columns are summed in column order from per-(token, column) rows, so a
 *     token's output does not depend on its batch, the thread count or the
 *     rank that computed each column.
 *  2. The shared branch is never scaled: unfused it is added after the
 *     output factor; fused its column weight times runner_mult is 1.
 *  3. In the f32 path every step is rounded to float (a double op on float
 *     operands rounded to float is exactly the float op).
 */
#include "experts/experts.h"

static inline double rnd(bool f32, double v) { return f32 ? (double)(float)v : v; }

void moe_combine_token(const moe_contract *c, bool f32, int K, int C, int H, const double *tw, const void *const *ys,
                       const void *sh_row, double *ro, double *so, double *mo) {
    bool fused = C > K;
    for (int h = 0; h < H; h++) {
        double part = 0.0;
        for (int j = 0; j < K; j++) {
            double y = f32 ? (double)((const float *)ys[j])[h] : ((const double *)ys[j])[h];
            part = rnd(f32, part + rnd(f32, tw[j] * y));
        }
        double sh = sh_row ? (f32 ? (double)((const float *)sh_row)[h] : ((const double *)sh_row)[h]) : 0.0;
        so[h] = sh;
        ro[h] = rnd(f32, rnd(f32, part * c->runner_mult) * c->output_mult);
        if (fused) {
            double all = rnd(f32, part + rnd(f32, tw[K] * sh));
            mo[h] = rnd(f32, all * c->runner_mult);
        } else {
            mo[h] = rnd(f32, ro[h] + sh);
        }
    }
}
