/*
 * The one table that grades an audited path, shared by `moeaudit audit` and
 * the tests (tests/test-audit.c asserts each class lands where it says).
 *
 * Output error is graded by its signal-to-quantization-noise ratio,
 * SQNR = -10 log10(NMSE), NMSE = sum (path - ref)^2 / sum ref^2 over the
 * block's output:
 *   PASS      SQNR >= 25 dB (RMS error <= 5.6 %): what bf16 activations
 *             (~50 dB) and FP8 E4M3 activations or weights (measured 26-30
 *             dB on the fixtures with outlier channels: 3 mantissa bits,
 *             2^-4 relative rounding, RMS ~2^-4/sqrt(3) against values spread
 *             below their block's amax) cost: the production V3 recipe.
 *   MARGINAL  SQNR >= 12 dB (RMS error <= 25 %): FP4 E2M1 weights (~15-20
 *             dB: 1 mantissa bit) land here; usable, not free.
 *   FAIL      below. Contract breaks are not left to this table: the
 *             audit runs every path with the invariant check on, and a
 *             violation is FAIL whatever the SQNR (a factor never applied
 *             can cost as little as ~14 dB when the shared expert dominates
 *             the output; applied twice, ~6 dB at s = 1.5).
 * Routing flips (tokens whose expert set differs from float64) are graded
 * by fraction: PASS <= 1 %, MARGINAL <= 5 %, FAIL above. A row's grade is
 * the worse of the two.
 */
#ifndef MOE_AUDIT_TOLERANCES_H
#define MOE_AUDIT_TOLERANCES_H

#define MOE_GRADE_PASS_SQNR_DB 25.0
#define MOE_GRADE_MARGINAL_SQNR_DB 12.0
#define MOE_GRADE_PASS_FLIPS 0.01
#define MOE_GRADE_MARGINAL_FLIPS 0.05

#endif
