/*
 * AMX BF16 tiles for the bf16-activation entry: Y[t, j] = sum_k X[t, k] * W[j, k]
 * with X bf16, W MXFP4 / NVFP4 / BF16, through TDPBF16PS, for every n.
 * The other formats, and f32 activations, run the AVX-512 kernels.
 *
 * Roles (C = A . B with A = m x k, B = k x n, as Intel names TDPBF16PS's operands):
 *   A  16 weight rows x 32 bf16 (64 bytes a row): one 32-column "step" of 16
 *      rows, decoded by the AVX-512 bf16 decoder (e2m1_bf16.h: FP4 words in
 *      e2m1_perm order, BF16 in column order) into a panel in the workspace.
 *   B  16 pairs x Nc tokens (Nc = min(n, 16)): the activations of one step,
 *      packed once per call to bf16 pairs in A's word order ("VNNI" layout:
 *      row kp holds (x[col(2 kp)], x[col(2 kp + 1)]) of every token; loaded
 *      by TILELOADDT1, MOE_AMX_BSTREAM below); for
 *      Nc = 16 written whole by a 16 x 16 transpose in registers (3.0-3.9x
 *      faster than a scatter per token on the Xeon of docs/performance.md).
 *   C  16 rows x Nc tokens of fp32 accumulators.
 * Register blocking: 2 A tiles (32 rows) x 2 B tiles (2 token blocks) into 4
 * C tiles. Loops: row block of 32 -> K block of 8 steps (256 columns,
 * decoded into one of two 16 KiB panels) -> token-block pairs (C tiles
 * loaded from / stored to the workspace between K blocks, exact) -> steps;
 * the next K block's panel is decoded in one share of rows per token-block
 * pair, a few rows after each step's tile products, so that the AVX-512
 * decode runs while the tiles work (MOE_AMX_DSPLIT below). At most 16 tokens (one
 * token block): 3 row blocks of 16 instead (three accumulator chains), C
 * tiles kept in registers along the row (amx_narrow).
 *
 * Operation sequence per output (token t, row j) (kernel contract 2: the same
 * whatever n, r0, r1, the blocking or the thread; Intel SDM, TDPBF16PS):
 *   c = +0
 *   for each step s = 0, 1, ..., ceil(cols / 32) - 1 (the last one
 *   zero-padded on both operands):
 *     e = +0, o = +0
 *     for kp = 0 .. 15:  e = e + a[2 kp] * b[2 kp];  o = o + a[2 kp + 1] * b[2 kp + 1]
 *     c = c + (e + o)
 *   y = c, and NVFP4 only y = y * scale2 (an ordinary fp32 multiply).
 * a[p] = the decoded weight of column 32 s + col(p), b[p] = the bf16
 * activation of that column; col(p) = e2m1_perm(p) for FP4, p for BF16.
 * Every "+" above is one fp32 operation rounded to nearest even, with inputs
 * below 2^-126 in magnitude read as zero and results below 2^-126 flushed to
 * zero (DAZ = FTZ = 1; MXCSR is neither read nor written); the products are
 * exact (bf16 x bf16 has at most 16 significant bits), so e and o are chains
 * of fused multiply-adds. tests/test-kernels.c holds the same sequence in
 * scalar code (amx_model) and checks the kernel against it bit for bit on
 * AMX hardware, and the model against float64 everywhere.
 *
 * Invariants (kernel contract):
 *  1. Never allocates. Workspace (gemm_amx_ws): the packed activations
 *     (ceil(n / Nc) x steps x 16 x Nc pairs: 8 KiB per token at 4096
 *     columns), two panels (64 KiB), the C staging (32 x tokens fp32).
 *  2. The sequence above depends on w only; the tile shapes depend on n
 *     (Nc) but not the operations on each output: a token's pairs meet the
 *     same weights in the same steps in any column of any token block.
 *  3. Decoded weights equal the reference's (NVFP4: before scale2) bit for
 *     bit, as the avx512 bf16 path's (the same decoder).
 *  4. Each call configures the tiles (ldtilecfg) and releases them
 *     (tilerelease) before returning; the tile state is never left live.
 * Needs AVX-512 F/BW/VL/DQ/VBMI/BF16, AMX-TILE, AMX-BF16 and the tile state
 * granted by Linux (dispatch.c checks and asks for it).
 */
#include "cpu/avx512/e2m1_bf16.h"

#include <immintrin.h>

#ifdef MOE_AMX_EMULATE
/* tests/test-amx-emu: this file against software tiles (tests/amx_emulate.h,
 * included ahead of this file by tests/amx_emu_kernel*.c: the library names
 * no test header), under another table name, so that its logic runs on CPUs
 * without AMX (the builds with other variants name their own table through
 * MOE_AMX_TABLE_NAME, below) */
#ifndef MOE_AMX_TABLE_NAME
#define moe_cpu_amx_table moe_cpu_amx_emulated_table
const moe_cpu_kernels *moe_cpu_amx_emulated_table(void);
#endif
#ifndef MOE_HAVE_AMX
#define MOE_HAVE_AMX 1
#endif
#endif

#ifdef MOE_AMX_TABLE_NAME
/* bench/amx_parts: this file built again under another table name, with
 * the compile-time variants below set otherwise, to time them side by side */
#define moe_cpu_amx_table MOE_AMX_TABLE_NAME
const moe_cpu_kernels *moe_cpu_amx_table(void);
#endif

/* Compile-time variants (the operations on each output are the same in all;
 * only the packing, the blocking and where the decode runs differ):
 *   MOE_AMX_KB      steps per K block of the 2 x 2 path (8: two 16 KiB
 *                   panels, which stay in L1 now that the B tiles do not
 *                   evict them (MOE_AMX_BSTREAM): 5-9% faster than 16 at 16
 *                   threads on the Xeon in four A/B pairs, fourteenth
 *                   session of docs/performance.md, builds v18 against v16;
 *                   16 was the default from run H, 4-6% faster than 8 while
 *                   the B tiles went through L1; 32 and 128: builds v19, v15)
 *   MOE_AMX_PACK_T  1: B tiles of 16 tokens written by a 16 x 16 transpose in
 *                   registers; 0: by one 16-dword scatter per token and step
 *   MOE_AMX_DSPLIT  1: the next K block's decode split into one share per
 *                   token-block pair, each after that pair's tile products;
 *                   2: each share spread over the pair's steps (rows of it
 *                   after each step's products); 3: as 2 with the share cut
 *                   into equal runs of chunks (not whole rows) and the
 *                   panels one pipeline across row blocks (the next row
 *                   block's first panel decoded during this one's last K
 *                   block, where 0-2 decode it alone); 0: all of it after
 *                   the last pair's
 *   MOE_AMX_TPIPE   1: the 2 x 2 step's products in B-major order with the
 *                   next step's tiles loaded as each is freed; 2: that and
 *                   the B tiles of two steps ahead prefetched into L1;
 *                   0: the four loads, then the four products
 *   MOE_AMX_BSTREAM 1: the 2 x 2 path's B tiles (the packed activations,
 *                   streamed from L2 once per row block) loaded with
 *                   TILELOADDT1, the load that hints the data will not be
 *                   reused, so that they do not push the weights' panel out
 *                   of L1 (the tile loop alone 63% -> 81-91% of the unit,
 *                   the block at T = 4096 7-11% faster on the Xeon of
 *                   docs/performance.md, fourteenth session); 0: TILELOADD
 *                   as the other tiles
 *   MOE_AMX_PFW     the decode's prefetch of the next K block of each weight
 *                   row: 1 into L1 (_MM_HINT_T0), 2 into L2 (_MM_HINT_T1:
 *                   leaves L1's fill buffers to the B tiles' loads from L2),
 *                   0 none (the hardware prefetchers alone) */
#ifndef MOE_AMX_KB
#define MOE_AMX_KB 8
#endif
#ifndef MOE_AMX_PACK_T
#define MOE_AMX_PACK_T 1
#endif
#ifndef MOE_AMX_DSPLIT
#define MOE_AMX_DSPLIT 2
#endif
#ifndef MOE_AMX_TPIPE
#define MOE_AMX_TPIPE 0
#endif
#ifndef MOE_AMX_PFW
#define MOE_AMX_PFW 1
#endif
#ifndef MOE_AMX_BSTREAM
#define MOE_AMX_BSTREAM 1
#endif
#if MOE_AMX_BSTREAM
#define AMX_LOAD_B(t, base, stride) _tile_stream_loadd(t, base, stride)
#else
#define AMX_LOAD_B(t, base, stride) _tile_loadd(t, base, stride)
#endif

#ifdef MOE_HAVE_AMX

/* The AVX-512 table's f32 entry (gemm_avx512.c). */
void moe_cpu_avx512_gemm(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n,
                         float *Y, int64_t ldy);

#define MOE_TGT_AMX                                                                                             \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,fma,f16c")))

enum {
    AMX_STEP = 32,  /* columns per step (one A tile row, 64 bytes) */
    AMX_KB = MOE_AMX_KB, /* steps per K block: 8 = 256 columns (MOE_AMX_KB above) */
    AMX_ROWS = 32,  /* weight rows per row block: 2 A tiles */
};

/* Tile configuration, palette 1 (the layout ldtilecfg reads: 64 bytes). */
typedef struct moe_amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} moe_amx_cfg;
_Static_assert(sizeof(moe_amx_cfg) == 64, "tile configuration is 64 bytes");

/* gcc's tile load and ldtilecfg intrinsics do not tell the compiler that
 * they read memory: this barrier, placed after the stores they depend on,
 * keeps those stores before them. */
#define AMX_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

/* Tiles: C[rb][tb] = 2 rb + tb, A[rb] = 4 + rb, B[tb] = 6 + tb (literal
 * numbers: the intrinsics paste them into the instruction text). */
#define T_C00 0
#define T_C01 1
#define T_C10 2
#define T_C11 3
#define T_A0 4
#define T_A1 5
#define T_B0 6
#define T_B1 7

static bool amx_fmt(const moe_weight *w) {
    return w->fmt == MOE_WFMT_MXFP4 || w->fmt == MOE_WFMT_NVFP4 || w->fmt == MOE_WFMT_BF16;
}

/* The workspace's parts for a call of n tokens on a weight of `cols` columns. */
typedef struct amx_layout {
    int64_t steps, nc, nb;     /* 32-column steps; tokens per block (Nc); token blocks */
    size_t b_off, p_off, c_off, bytes;
} amx_layout;

static amx_layout amx_layout_of(int64_t cols, int64_t n) {
    amx_layout l;
    l.steps = (cols + AMX_STEP - 1) / AMX_STEP;
    l.nc = n < 16 ? n : 16;
    l.nb = (n + l.nc - 1) / l.nc;
    size_t b = (size_t)(l.nb * l.steps * 16 * l.nc) * 4;    /* packed B: [nb][steps][16][Nc] pairs */
    size_t p = (size_t)2 * 2 * AMX_KB * 16 * 64;             /* 2 panels: [2][AMX_KB][16 rows][32 words]; the
                                                                narrow path's two [3][4][16][32] fit too */
    size_t c = (size_t)(l.nb * AMX_ROWS * l.nc) * 4;        /* C staging: [nb][32 rows][Nc] fp32 */
    if (l.nb == 1) c = (size_t)(48 * l.nc) * 4;              /* narrow path: [48 rows][Nc] */
    l.b_off = 0;
    l.p_off = (b + 63) & ~(size_t)63;
    l.c_off = l.p_off + p;
    l.bytes = l.c_off + ((c + 63) & ~(size_t)63);
    return l;
}

static size_t gemm_amx_ws(const moe_weight *w, int64_t n) {
    if (!amx_fmt(w) || n <= 0) return 0;
    return amx_layout_of(w->cols, n).bytes;
}

#if MOE_AMX_PACK_T
/* amx_pack for Nc = 16: per token block and step, the 16 tokens' pair
 * vectors (token i: pair kp in dword kp) transposed in registers to the
 * tile's 16 rows (row kp: pair kp of token i in dword i), stored whole;
 * tokens past n are zero vectors. The same bytes as the scatter. */
static MOE_TGT_AMX void amx_pack_t(const amx_layout *l, const float *X, int64_t ldx, int64_t n, int64_t cols,
                                   __m512i pidx, uint32_t *B) {
    for (int64_t tb = 0; tb < l->nb; tb++) {
        int64_t nt = n - tb * 16 < 16 ? n - tb * 16 : 16;
        for (int64_t s = 0; s < l->steps; s++) {
            int64_t k = s * AMX_STEP, m = cols - k;
            __mmask16 ml = (__mmask16)(m >= 16 ? 0xFFFF : (1u << m) - 1);
            __mmask16 mh = (__mmask16)(m >= 32 ? 0xFFFF : m <= 16 ? 0 : (1u << (m - 16)) - 1);
            __m512i r[16], t[16];
            for (int i = 0; i < 16; i++) {
                if (i >= nt) {
                    r[i] = _mm512_setzero_si512();
                    continue;
                }
                const float *x = X + (tb * 16 + i) * ldx + k;
                __m512 lo = _mm512_maskz_loadu_ps(ml, x), hi = _mm512_maskz_loadu_ps(mh, x + 16);
                r[i] = _mm512_permutexvar_epi16(pidx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
            /* 16 x 16 dwords: within 128-bit lanes (2 stages), then across
             * lanes (2 stages); out[4 L + c] = lane L of every group */
            for (int i = 0; i < 16; i += 2) {
                t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
                t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
            }
            for (int g = 0; g < 16; g += 4) {
                r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
                r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
                r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
                r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
            }
            /* r[4 g + c] lane L: rows 4 g .. 4 g + 3 of column 4 L + c */
            uint32_t *bt = B + (size_t)((tb * l->steps + s) * 256);
            for (int c = 0; c < 4; c++) {
                __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
                __m512i x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
                __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
                __m512i y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
                _mm512_store_si512(bt + (0 + c) * 16, _mm512_shuffle_i32x4(x0, y0, 0x88));
                _mm512_store_si512(bt + (4 + c) * 16, _mm512_shuffle_i32x4(x1, y1, 0x88));
                _mm512_store_si512(bt + (8 + c) * 16, _mm512_shuffle_i32x4(x0, y0, 0xdd));
                _mm512_store_si512(bt + (12 + c) * 16, _mm512_shuffle_i32x4(x1, y1, 0xdd));
            }
        }
    }
}
#endif

/* Pack X [n, ldx] (bf16 values) into B tiles: token t of block t / Nc,
 * column t % Nc, pairs in the decoder's word order; zeros past cols and in
 * the last block's missing tokens. */
static MOE_TGT_AMX void amx_pack(const amx_layout *l, const float *X, int64_t ldx, int64_t n, int64_t cols,
                                 bool perm, uint32_t *B) {
    uint16_t pi[32] __attribute__((aligned(64)));
    for (int p = 0; p < 32; p++) pi[p] = (uint16_t)(perm ? e2m1_perm(p) : p);
    const __m512i pidx = _mm512_load_si512(pi);
    const __m512i rowoff = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)l->nc));
    int64_t tile = 16 * l->nc; /* pairs per B tile */
#if MOE_AMX_PACK_T
    if (l->nc == 16) {
        amx_pack_t(l, X, ldx, n, cols, pidx, B);
        return;
    }
#endif
    if (n % l->nc) memset(B + (size_t)((l->nb - 1) * l->steps * tile), 0, (size_t)(l->steps * tile) * 4);
    for (int64_t t = 0; t < n; t++) {
        const float *x = X + t * ldx;
        uint32_t *bt = B + (size_t)((t / l->nc) * l->steps * tile + t % l->nc);
        for (int64_t s = 0; s < l->steps; s++) {
            int64_t k = s * AMX_STEP, m = cols - k;
            __mmask16 ml = (__mmask16)(m >= 16 ? 0xFFFF : (1u << m) - 1);
            __mmask16 mh = (__mmask16)(m >= 32 ? 0xFFFF : m <= 16 ? 0 : (1u << (m - 16)) - 1);
            __m512 lo = _mm512_maskz_loadu_ps(ml, x + k), hi = _mm512_maskz_loadu_ps(mh, x + k + 16);
            __m512i v = _mm512_permutexvar_epi16(pidx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_i32scatter_epi32(bt + s * tile, rowoff, v, 4);
        }
    }
}

/* Decode steps sa .. ks-1 of the K block that starts at step k0 (chunks
 * k0+sa .. k0+ks-1) of the panel rows ra .. rb-1 (of 16 nrb: row r is
 * weight row j0 + r) into those steps of the panel [nrb][kb][16][32 words]
 * (kb >= ks steps per row block); rows past nr are zero. */
static inline __attribute__((always_inline)) MOE_TGT_AMX void
amx_decode_rows_fmt(const moe_wfmt fmt, const moe_weight *w, int64_t j0, int64_t nr, int64_t ra, int64_t rb, int64_t k0,
                    int64_t sa, int64_t ks, int64_t kb, const uint16_t *tab, uint16_t *panel) {
    const __m512i sh = e2m1_bf16_shifts();
    int64_t cols = w->cols, nfull = cols / AMX_STEP, m = cols % AMX_STEP;
    for (int64_t r = ra; r < rb; r++) {
        uint16_t *dst = panel + (size_t)((r / 16) * kb * 16 + r % 16) * 32;
        if (r >= nr) {
            for (int64_t s = sa; s < ks; s++) _mm512_store_si512(dst + s * 16 * 32, _mm512_setzero_si512());
            continue;
        }
        moe_cpu_row rc = moe_cpu_row_of(fmt, w, j0 + r);
        const bf_rows rw = {rc.q, rc.s8, 0, 0};
        /* the next ks - sa chunks of this row after these (with sa = 0: the
         * next K block): the hardware prefetchers lose track of 32 or 48
         * interleaved row streams */
#if MOE_AMX_PFW
        const int64_t bpc = fmt == MOE_WFMT_BF16 ? 64 : 16, spc = fmt == MOE_WFMT_NVFP4 ? 2 : 1;
#define AMX_PFW_HINT (MOE_AMX_PFW == 2 ? _MM_HINT_T1 : _MM_HINT_T0)
        for (int64_t o = 0; o < (ks - sa) * bpc; o += 64)
            _mm_prefetch((const char *)(rc.q + (k0 + ks) * bpc + o), AMX_PFW_HINT);
        if (fmt != MOE_WFMT_BF16) _mm_prefetch((const char *)(rc.s8 + (k0 + ks) * spc), AMX_PFW_HINT);
#endif
        /* the whole chunks, then the partial last one (if in this block) */
        int64_t sf = nfull - k0 < ks ? nfull - k0 : ks;
        for (int64_t s = sa; s < sf; s++)
            _mm512_store_si512(dst + s * 16 * 32, bf_decode_chunk(fmt, &rw, 0, tab, k0 + s, sh));
        for (int64_t s = sf < sa ? sa : sf; s < ks; s++)
            _mm512_store_si512(dst + s * 16 * 32, bf_decode_edge(fmt, &rw, 0, tab, k0 + s, m, sh));
    }
}

/* amx_decode_rows_fmt with the format a constant in each copy: no test of
 * the format per 32 weights (the loop of a runtime format tested it and
 * took three branches per chunk). */
static MOE_TGT_AMX void amx_decode_part(const moe_wfmt fmt, const moe_weight *w, int64_t j0, int64_t nr, int64_t ra,
                                        int64_t rb, int64_t k0, int64_t sa, int64_t ks, int64_t kb,
                                        const uint16_t *tab, uint16_t *panel) {
    switch (fmt) {
    case MOE_WFMT_MXFP4: amx_decode_rows_fmt(MOE_WFMT_MXFP4, w, j0, nr, ra, rb, k0, sa, ks, kb, tab, panel); break;
    case MOE_WFMT_NVFP4: amx_decode_rows_fmt(MOE_WFMT_NVFP4, w, j0, nr, ra, rb, k0, sa, ks, kb, tab, panel); break;
    default: amx_decode_rows_fmt(MOE_WFMT_BF16, w, j0, nr, ra, rb, k0, sa, ks, kb, tab, panel); break;
    }
}

/* Whole rows ra .. rb-1 of the K block (amx_decode_part with sa = 0). */
static MOE_TGT_AMX void amx_decode_rows(const moe_wfmt fmt, const moe_weight *w, int64_t j0, int64_t nr, int64_t ra,
                                        int64_t rb, int64_t k0, int64_t ks, int64_t kb, const uint16_t *tab,
                                        uint16_t *panel) {
    amx_decode_part(fmt, w, j0, nr, ra, rb, k0, 0, ks, kb, tab, panel);
}

/* All 16 nrb rows of the panel (see amx_decode_rows). */
static MOE_TGT_AMX void amx_decode(const moe_wfmt fmt, const moe_weight *w, int64_t j0, int64_t nr, int64_t nrb,
                                   int64_t k0, int64_t ks, int64_t kb, const uint16_t *tab, uint16_t *panel) {
    amx_decode_rows(fmt, w, j0, nr, 0, 16 * nrb, k0, ks, kb, tab, panel);
}

/* A share of the next K block's decode, run inside amx_kblock (DSPLIT 2):
 * panel rows ra .. rb - 1, spread over the block's steps. */
typedef struct amx_dec {
    moe_wfmt fmt;
    const moe_weight *w;
    int64_t j0, nr, ra, rb, k1, ks1;
    const uint16_t *tab;
    uint16_t *panel;
} amx_dec;

#if MOE_AMX_DSPLIT == 3
/* The chunks of share d (rows ra .. rb-1 x ks1 steps, row after row) that
 * follow step s of ks: an equal part after each step (all by s = ks - 1). */
static MOE_TGT_AMX void amx_dec_chunks(const amx_dec *d, int64_t s, int64_t ks) {
    int64_t tot = (d->rb - d->ra) * d->ks1, i = tot * s / ks, e = tot * (s + 1) / ks;
    while (i < e) {
        int64_t r = d->ra + i / d->ks1, c = i % d->ks1, c1 = d->ks1 - c < e - i ? d->ks1 : c + (e - i);
        amx_decode_part(d->fmt, d->w, d->j0, d->nr, r, r + 1, d->k1, c, c1, AMX_KB, d->tab, d->panel);
        i += c1 - c;
    }
}
#define AMX_DEC_STEP(d, s, ks)                                                                                  \
    do {                                                                                                        \
        if (d) amx_dec_chunks(d, s, ks);                                                                        \
    } while (0)
#else
/* Rows of share d that follow step s of ks (all of them by s = ks - 1). */
#define AMX_DEC_STEP(d, s, ks)                                                                                  \
    do {                                                                                                        \
        if (d) {                                                                                                \
            int64_t a_ = (d)->ra + ((d)->rb - (d)->ra) * (s) / (ks);                                            \
            int64_t b_ = (d)->ra + ((d)->rb - (d)->ra) * ((s) + 1) / (ks);                                      \
            if (b_ > a_)                                                                                        \
                amx_decode_rows((d)->fmt, (d)->w, (d)->j0, (d)->nr, a_, b_, (d)->k1, (d)->ks1, AMX_KB, (d)->tab, \
                                (d)->panel);                                                                    \
        }                                                                                                       \
    } while (0)
#endif

/* One K block for the token blocks tb, tb + 1 (when tb1) and the row blocks
 * 0, 1 (when rb1): C tiles from the staging (or zero at k0 = 0), ks steps,
 * C tiles back to the staging. Tile numbers are immediates: one branch per
 * shape. */

static MOE_TGT_AMX void amx_kblock(const amx_layout *l, const uint32_t *B, const uint16_t *panel, float *Cs,
                                   int64_t tb, bool tb1, bool rb1, int64_t k0, int64_t ks, const amx_dec *d) {
    const long ldb = (long)(l->nc * 4), lda = 64, ldc = (long)(l->nc * 4);
    int64_t tile = 16 * l->nc;
    float *c00 = Cs + (size_t)(tb * AMX_ROWS * l->nc), *c10 = c00 + 16 * l->nc;
    float *c01 = c00 + AMX_ROWS * l->nc, *c11 = c01 + 16 * l->nc;
    const uint32_t *b0 = B + (size_t)(tb * l->steps * tile + k0 * tile), *b1 = b0 + l->steps * tile;
    AMX_MEMORY_BARRIER(); /* the panel, B and the staging are written */
    if (k0 == 0) {
        _tile_zero(T_C00);
        _tile_zero(T_C01);
        _tile_zero(T_C10);
        _tile_zero(T_C11);
    } else {
        _tile_loadd(T_C00, c00, ldc);
        if (tb1) _tile_loadd(T_C01, c01, ldc);
        if (rb1) _tile_loadd(T_C10, c10, ldc);
        if (rb1 && tb1) _tile_loadd(T_C11, c11, ldc);
    }
    const uint16_t *a0 = panel, *a1 = panel + AMX_KB * 16 * 32;
#if MOE_AMX_TPIPE
    if (rb1 && tb1) {
        /* the products that read B0 first, so that the next step's B0 (from
         * L2: the packed activations) loads while the two on B1 run; then
         * B1 and the A tiles (from the panel in L1) */
        _tile_loadd(T_A0, a0, lda);
        _tile_loadd(T_A1, a1, lda);
        AMX_LOAD_B(T_B0, b0, ldb);
        AMX_LOAD_B(T_B1, b1, ldb);
        for (int64_t s = 0; s < ks; s++) {
#if MOE_AMX_TPIPE == 2
            if (s + 2 < ks)
                for (int o = 0; o < 16; o++) {
                    _mm_prefetch((const char *)(b0 + (s + 2) * tile) + o * ldb, _MM_HINT_T0);
                    _mm_prefetch((const char *)(b1 + (s + 2) * tile) + o * ldb, _MM_HINT_T0);
                }
#endif
            _tile_dpbf16ps(T_C00, T_A0, T_B0);
            _tile_dpbf16ps(T_C10, T_A1, T_B0);
            if (s + 1 < ks) AMX_LOAD_B(T_B0, b0 + (s + 1) * tile, ldb);
            _tile_dpbf16ps(T_C01, T_A0, T_B1);
            _tile_dpbf16ps(T_C11, T_A1, T_B1);
            if (s + 1 < ks) {
                AMX_LOAD_B(T_B1, b1 + (s + 1) * tile, ldb);
                _tile_loadd(T_A0, a0 + (s + 1) * 16 * 32, lda);
                _tile_loadd(T_A1, a1 + (s + 1) * 16 * 32, lda);
            }
            AMX_DEC_STEP(d, s, ks);
        }
    } else
#endif
    if (rb1 && tb1) {
        for (int64_t s = 0; s < ks; s++) {
            _tile_loadd(T_A0, a0 + s * 16 * 32, lda);
            _tile_loadd(T_A1, a1 + s * 16 * 32, lda);
            AMX_LOAD_B(T_B0, b0 + s * tile, ldb);
            AMX_LOAD_B(T_B1, b1 + s * tile, ldb);
            _tile_dpbf16ps(T_C00, T_A0, T_B0);
            _tile_dpbf16ps(T_C01, T_A0, T_B1);
            _tile_dpbf16ps(T_C10, T_A1, T_B0);
            _tile_dpbf16ps(T_C11, T_A1, T_B1);
            AMX_DEC_STEP(d, s, ks);
        }
    } else if (rb1) {
        for (int64_t s = 0; s < ks; s++) {
            _tile_loadd(T_A0, a0 + s * 16 * 32, lda);
            _tile_loadd(T_A1, a1 + s * 16 * 32, lda);
            AMX_LOAD_B(T_B0, b0 + s * tile, ldb);
            _tile_dpbf16ps(T_C00, T_A0, T_B0);
            _tile_dpbf16ps(T_C10, T_A1, T_B0);
            AMX_DEC_STEP(d, s, ks);
        }
    } else if (tb1) {
        for (int64_t s = 0; s < ks; s++) {
            _tile_loadd(T_A0, a0 + s * 16 * 32, lda);
            AMX_LOAD_B(T_B0, b0 + s * tile, ldb);
            AMX_LOAD_B(T_B1, b1 + s * tile, ldb);
            _tile_dpbf16ps(T_C00, T_A0, T_B0);
            _tile_dpbf16ps(T_C01, T_A0, T_B1);
            AMX_DEC_STEP(d, s, ks);
        }
    } else {
        for (int64_t s = 0; s < ks; s++) {
            _tile_loadd(T_A0, a0 + s * 16 * 32, lda);
            AMX_LOAD_B(T_B0, b0 + s * tile, ldb);
            _tile_dpbf16ps(T_C00, T_A0, T_B0);
            AMX_DEC_STEP(d, s, ks);
        }
    }
    _tile_stored(T_C00, c00, ldc);
    if (tb1) _tile_stored(T_C01, c01, ldc);
    if (rb1) _tile_stored(T_C10, c10, ldc);
    if (rb1 && tb1) _tile_stored(T_C11, c11, ldc);
}

/*
 * n <= 16 (one token block): 3 row blocks of 16 (3 A tiles, 1 B, 3 C: three
 * independent accumulator chains) whose C tiles stay in registers across
 * the whole row; panels of AMX_KB_NARROW steps, double-buffered so that the
 * decode of the next one follows the current one's TDPBF16PS in program
 * order and overlaps them. The same operations per output as the 2 x 2 path
 * (only the blocking differs).
 */
enum { AMX_KB_NARROW = 4, AMX_ROWS_NARROW = 48 };
/* Tiles of the narrow path: C 0..2, A 3..5, B 6 (literal numbers). */
#define N_C0 0
#define N_C1 1
#define N_C2 2
#define N_A0 3
#define N_A1 4
#define N_A2 5
#define N_B 6

static MOE_TGT_AMX void amx_narrow(const moe_wfmt fmt, const moe_weight *w, const amx_layout *l, const uint32_t *B,
                                   uint16_t *panels, float *Cs, int64_t j0, int64_t nr, const uint16_t *tab) {
    const long ldb = (long)(l->nc * 4), lda = 64, ldc = (long)(l->nc * 4);
    const int64_t tile = 16 * l->nc, pstride = 3 * AMX_KB_NARROW * 16 * 32; /* words per panel */
    int64_t nrb = (nr + 15) / 16;
    _tile_zero(N_C0);
    _tile_zero(N_C1);
    _tile_zero(N_C2);
    int64_t ks = l->steps < AMX_KB_NARROW ? l->steps : AMX_KB_NARROW;
    amx_decode(fmt, w, j0, nr, nrb, 0, ks, AMX_KB_NARROW, tab, panels);
    for (int64_t k0 = 0, p = 0; k0 < l->steps; k0 += AMX_KB_NARROW, p ^= 1) {
        ks = l->steps - k0 < AMX_KB_NARROW ? l->steps - k0 : AMX_KB_NARROW;
        const uint16_t *a = panels + p * pstride;
        const uint32_t *b = B + (size_t)(k0 * tile);
        AMX_MEMORY_BARRIER(); /* this panel is written */
        for (int64_t s = 0; s < ks; s++) {
            _tile_loadd(N_B, b + s * tile, ldb);
            _tile_loadd(N_A0, a + s * 16 * 32, lda);
            _tile_dpbf16ps(N_C0, N_A0, N_B);
            if (nrb > 1) {
                _tile_loadd(N_A1, a + (AMX_KB_NARROW + s) * 16 * 32, lda);
                _tile_dpbf16ps(N_C1, N_A1, N_B);
            }
            if (nrb > 2) {
                _tile_loadd(N_A2, a + (2 * AMX_KB_NARROW + s) * 16 * 32, lda);
                _tile_dpbf16ps(N_C2, N_A2, N_B);
            }
        }
        int64_t k1 = k0 + AMX_KB_NARROW;
        if (k1 < l->steps) {
            int64_t ks1 = l->steps - k1 < AMX_KB_NARROW ? l->steps - k1 : AMX_KB_NARROW;
            AMX_MEMORY_BARRIER(); /* the tile loads above read the other panel */
            amx_decode(fmt, w, j0, nr, nrb, k1, ks1, AMX_KB_NARROW, tab, panels + (p ^ 1) * pstride);
        }
    }
    _tile_stored(N_C0, Cs, ldc);
    if (nrb > 1) _tile_stored(N_C1, Cs + 16 * l->nc, ldc);
    if (nrb > 2) _tile_stored(N_C2, Cs + 32 * l->nc, ldc);
}

/* A row block's C staging [nb][32 rows][Nc] -> Y [n, ldy] (its nr rows;
 * NVFP4: times scale2, an ordinary fp32 multiply). */
static inline __attribute__((always_inline)) void amx_store_y(const moe_wfmt fmt, const amx_layout *l, const float *Cs,
                                                              int64_t n, float *Y, int64_t ldy, int64_t nr, float s2) {
    for (int64_t t = 0; t < n; t++) {
        const float *c = Cs + (size_t)((t / l->nc) * AMX_ROWS * l->nc + t % l->nc);
        float *y = Y + t * ldy;
        if (fmt == MOE_WFMT_NVFP4)
            for (int64_t r = 0; r < nr; r++) y[r] = c[r * l->nc] * s2;
        else
            for (int64_t r = 0; r < nr; r++) y[r] = c[r * l->nc];
    }
}

static MOE_TGT_AMX void gemm_amx_fmt(const moe_wfmt fmt, const moe_weight *w, int64_t r0, int64_t r1, const float *X,
                                     int64_t ldx, int64_t n, float *Y, int64_t ldy, void *ws) {
    amx_layout l = amx_layout_of(w->cols, n);
    uint32_t *B = (uint32_t *)((char *)ws + l.b_off);
    uint16_t *panel = (uint16_t *)((char *)ws + l.p_off);
    float *Cs = (float *)((char *)ws + l.c_off);
    const uint16_t *tab = fmt == MOE_WFMT_BF16 ? NULL : moe_cpu_e2m1_bf16_tab(fmt == MOE_WFMT_NVFP4);
    amx_pack(&l, X, ldx, n, w->cols, fmt != MOE_WFMT_BF16, B);

    moe_amx_cfg cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = T_C00; t <= T_C11; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = (uint16_t)(l.nc * 4);
    }
    for (int t = T_A0; t <= T_A1; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    for (int t = T_B0; t <= T_B1; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = (uint16_t)(l.nc * 4);
    }
    const float s2 = w->scale2;
    if (l.nb == 1) {
        /* the narrow configuration: A 3..5 (64 bytes), C 0..2 and B 6 (Nc pairs) */
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = t == 7 ? 0 : 16;
            cfg.colsb[t] = (uint16_t)(t == 7 ? 0 : t >= N_A0 && t <= N_A2 ? 64 : l.nc * 4);
        }
        AMX_MEMORY_BARRIER();
        _tile_loadconfig(&cfg);
        for (int64_t j0 = r0; j0 < r1; j0 += AMX_ROWS_NARROW) {
            int64_t nr = r1 - j0 < AMX_ROWS_NARROW ? r1 - j0 : AMX_ROWS_NARROW;
            amx_narrow(fmt, w, &l, B, panel, Cs, j0, nr, tab);
            for (int64_t t = 0; t < n; t++) {
                const float *c = Cs + t;
                float *y = Y + t * ldy + (j0 - r0);
                if (fmt == MOE_WFMT_NVFP4)
                    for (int64_t r = 0; r < nr; r++) y[r] = c[r * l.nc] * s2;
                else
                    for (int64_t r = 0; r < nr; r++) y[r] = c[r * l.nc];
            }
        }
        _tile_release();
        return;
    }
    AMX_MEMORY_BARRIER();
    _tile_loadconfig(&cfg);
    /* Double-buffered panels (p: the one the tiles read): the next panel is
     * decoded while this one's tile products run. The next panel is this
     * row block's next K block, or with MOE_AMX_DSPLIT 3 the next row
     * block's first (one pipeline over the call: only its first panel is
     * decoded alone); otherwise each row block's first panel is. */
    const int64_t pwords = 2 * AMX_KB * 16 * 32;
    int64_t p = 0;
    for (int64_t j0 = r0; j0 < r1; j0 += AMX_ROWS) {
        int64_t nr = r1 - j0 < AMX_ROWS ? r1 - j0 : AMX_ROWS;
        bool rb1 = nr > 16;
        if (MOE_AMX_DSPLIT != 3 || j0 == r0)
            amx_decode(fmt, w, j0, nr, rb1 ? 2 : 1, 0, l.steps < AMX_KB ? l.steps : AMX_KB, AMX_KB, tab,
                       panel + p * pwords);
        for (int64_t k0 = 0; k0 < l.steps; k0 += AMX_KB, p ^= 1) {
            int64_t ks = l.steps - k0 < AMX_KB ? l.steps - k0 : AMX_KB, k1 = k0 + AMX_KB;
            const uint16_t *pa = panel + p * pwords;
            uint16_t *pn = panel + (p ^ 1) * pwords;
#if MOE_AMX_DSPLIT >= 2
            /* the next panel's rows in one share per token-block pair,
             * spread over that pair's steps (AMX_DEC_STEP) */
            int64_t nj = j0, nk = k1;
            if (MOE_AMX_DSPLIT == 3 && nk >= l.steps) {
                nj = j0 + AMX_ROWS;
                nk = 0;
            }
            bool more = nj < r1 && nk < l.steps;
            int64_t nnr = !more ? 0 : r1 - nj < AMX_ROWS ? r1 - nj : AMX_ROWS, prow = nnr > 16 ? 32 : 16,
                    np = (l.nb + 1) / 2;
            amx_dec d = {fmt, w, nj, nnr, 0, 0, nk, l.steps - nk < AMX_KB ? l.steps - nk : AMX_KB, tab, pn};
            for (int64_t tb = 0, q = 0; tb < l.nb; tb += 2, q++) {
                d.ra = q * prow / np;
                d.rb = (q + 1) * prow / np;
                amx_kblock(&l, B, pa, Cs, tb, tb + 1 < l.nb, rb1, k0, ks, more ? &d : NULL);
            }
#elif MOE_AMX_DSPLIT
            /* the next K block's rows in one share per token-block pair,
             * each decoded after that pair's tile products are issued */
            const int64_t prow = rb1 ? 32 : 16, np = (l.nb + 1) / 2;
            for (int64_t tb = 0, q = 0; tb < l.nb; tb += 2, q++) {
                amx_kblock(&l, B, pa, Cs, tb, tb + 1 < l.nb, rb1, k0, ks, NULL);
                if (k1 < l.steps) {
                    AMX_MEMORY_BARRIER(); /* the tile loads of the last K block read the other panel */
                    int64_t ks1 = l.steps - k1 < AMX_KB ? l.steps - k1 : AMX_KB;
                    amx_decode_rows(fmt, w, j0, nr, q * prow / np, (q + 1) * prow / np, k1, ks1, AMX_KB, tab, pn);
                }
            }
#else
            for (int64_t tb = 0; tb < l.nb; tb += 2) amx_kblock(&l, B, pa, Cs, tb, tb + 1 < l.nb, rb1, k0, ks, NULL);
            if (k1 < l.steps) {
                AMX_MEMORY_BARRIER(); /* the tile loads above read the other panel */
                amx_decode(fmt, w, j0, nr, rb1 ? 2 : 1, k1, l.steps - k1 < AMX_KB ? l.steps - k1 : AMX_KB, AMX_KB, tab,
                           pn);
            }
#endif
        }
        amx_store_y(fmt, &l, Cs, n, Y + (j0 - r0), ldy, nr, s2);
    }
    _tile_release();
}

static void gemm_amx(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n, float *Y,
                     int64_t ldy, void *ws) {
    if (!amx_fmt(w)) {
        moe_cpu_avx512_gemm(w, r0, r1, X, ldx, n, Y, ldy);
        return;
    }
    MOE_ASSERT(r0 >= 0 && r0 <= r1 && r1 <= w->rows && n >= 0);
    MOE_ASSERT(w->fmt != MOE_WFMT_MXFP4 || w->cols % MOE_MXFP4_BLOCK == 0);
    MOE_ASSERT(w->fmt != MOE_WFMT_NVFP4 || w->cols % MOE_NVFP4_BLOCK == 0);
    if (r0 == r1 || n == 0) return;
    MOE_ASSERT(ws && ((uintptr_t)ws & 63) == 0);
    switch (w->fmt) {
    case MOE_WFMT_MXFP4: gemm_amx_fmt(MOE_WFMT_MXFP4, w, r0, r1, X, ldx, n, Y, ldy, ws); break;
    case MOE_WFMT_NVFP4: gemm_amx_fmt(MOE_WFMT_NVFP4, w, r0, r1, X, ldx, n, Y, ldy, ws); break;
    default: gemm_amx_fmt(MOE_WFMT_BF16, w, r0, r1, X, ldx, n, Y, ldy, ws); break;
    }
}

static const moe_cpu_kernels moe_amx_table = {
    .isa = "amx",
    .gemm = moe_cpu_avx512_gemm,
    .gemm_bf16act = gemm_amx,
    .bf16act_ws = gemm_amx_ws,
    .swiglu = moe_cpu_avx512_swiglu, /* the f32 SwiGLU is AVX-512's, as the f32 GEMMs */
};

const moe_cpu_kernels *moe_cpu_amx_table(void) { return &moe_amx_table; }

#else /* a compiler without AMX support: no table */

const moe_cpu_kernels *moe_cpu_amx_table(void) { return NULL; }

#endif
