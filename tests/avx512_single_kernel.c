/*
 * test-kernels' second build of the AVX-512 kernels: src/cpu/avx512/
 * gemm_avx512.c with MOE_AVX512_E2M1_PAIR=0 (every E2M1 chunk its own step,
 * the kernels as they were before the paired decode), its public names
 * renamed, so that test_avx512_pairs can compare the library's paired
 * tiles with the single steps bit for bit.
 */
#define MOE_AVX512_E2M1_PAIR 0
#define moe_cpu_avx512_table moe_cpu_avx512_single_table
#define moe_cpu_avx512_gemm moe_cpu_avx512_single_gemm
#define moe_cpu_e2m1_bf16_tab moe_cpu_e2m1_bf16_single_tab

#include "../src/cpu/avx512/gemm_avx512.c"
