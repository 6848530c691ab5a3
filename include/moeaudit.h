/*
 * moeaudit: run and audit DeepSeek-style Mixture-of-Experts blocks.
 *
 * Worked example: load a checkpoint, run layer 3 on T tokens, exactly.
 *
 *     moe_error err;
 *     moe_model *m = NULL;
 *     if (moe_model_open("tests/data/dsv4-tiny", &m, &err) != MOE_OK) {
 *         fprintf(stderr, "%s\n", err.msg);
 *         return 1;
 *     }
 *     const moe_layer *L = NULL;
 *     if (moe_model_layer(m, 3, &L, &err) != MOE_OK) { ... }
 *     moe_run_opts o = moe_run_opts_default();       // float64 reference,
 *                                                     // router owns the factor
 *     moe_block_out out;
 *     if (moe_block_out_init(&out, L, T, &o, &err) != MOE_OK) { ... }
 *     // hidden: double [T, H]; input_ids: int64 [T] (hash layers), or NULL
 *     if (moe_block_run(L, hidden, input_ids, T, &o, &out, &err) != MOE_OK) { ... }
 *     // out.moe_out [T, H], out.topk_ids [T, out.n_cols], ...
 *     moe_block_out_free(&out);
 *     moe_model_free(m);
 *
 * Conventions: every fallible call returns moe_status and, when `err` is not
 * NULL, fills err->msg with a sentence naming the file, tensor and value at
 * fault. The library never prints and never exits. Arrays are row-major and
 * dense; the shape is given in a comment beside each pointer.
 */
#ifndef MOEAUDIT_H
#define MOEAUDIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOEAUDIT_VERSION "0.1.0"

/* ------------------------------------------------------------------ status */

typedef enum moe_status {
    MOE_OK = 0,
    MOE_ERR_IO,          /* open/read/mmap/write failed */
    MOE_ERR_FORMAT,      /* a file's bytes break its format (safetensors, JSON) */
    MOE_ERR_MISSING,     /* a tensor or config key that must exist does not */
    MOE_ERR_SHAPE,       /* a tensor has the wrong shape */
    MOE_ERR_DTYPE,       /* a tensor has a dtype we cannot use there */
    MOE_ERR_CONFIG,      /* config.json value out of range or inconsistent */
    MOE_ERR_INPUT,       /* caller's input is invalid (token id >= vocab, ...) */
    MOE_ERR_NOMEM,       /* allocation failed */
    MOE_ERR_INVARIANT,   /* the scaling contract check failed */
    MOE_ERR_UNSUPPORTED, /* valid but not implemented (yet) */
    MOE_ERR_ARG          /* invalid argument combination */
} moe_status;

/* Caller-owned error message buffer. No global last-error exists. */
typedef struct moe_error {
    char msg[512];
} moe_error;

/* Static string naming the status ("ok", "i/o error", ...). Never NULL. */
const char *moe_status_str(moe_status s);

/* ------------------------------------------------------------------ dtypes */

typedef enum moe_dtype {
    MOE_DTYPE_BOOL,
    MOE_DTYPE_U8,
    MOE_DTYPE_I8,
    MOE_DTYPE_U16,
    MOE_DTYPE_I16,
    MOE_DTYPE_U32,
    MOE_DTYPE_I32,
    MOE_DTYPE_U64,
    MOE_DTYPE_I64,
    MOE_DTYPE_F16,
    MOE_DTYPE_BF16,
    MOE_DTYPE_F32,
    MOE_DTYPE_F64,
    MOE_DTYPE_F8_E4M3,
    MOE_DTYPE_F8_E5M2,
    MOE_DTYPE_F8_E8M0,
    MOE_DTYPE_COUNT
} moe_dtype;

/* Size of one element in bytes. */
size_t moe_dtype_size(moe_dtype t);
/* The safetensors name ("BF16", "F8_E4M3", ...). */
const char *moe_dtype_name(moe_dtype t);
/* Parse a safetensors dtype name; accepts "E8M0" as an alias of F8_E8M0.
 * Returns false for unknown names. */
bool moe_dtype_from_name(const char *name, moe_dtype *out);
/* Element i of a float-typed buffer (F64, F32, F16, BF16) as double.
 * Other dtypes abort through MOE_ASSERT: callers check moe_dtype_is_float. */
double moe_load_f64(const void *data, moe_dtype t, size_t i);
bool moe_dtype_is_float(moe_dtype t); /* F64, F32, F16, BF16 */
bool moe_dtype_is_int(moe_dtype t);   /* I8..I64, U8..U64 */
/* Element i of an integer buffer as int64 (U64 above INT64_MAX saturates). */
int64_t moe_load_i64(const void *data, moe_dtype t, size_t i);

/* ------------------------------------------------ deterministic random numbers */

/* splitmix64: the project's one seeded generator (synthetic models, the
 * CLI's built-in inputs, probes, tests), public so that any program can draw
 * the same numbers. Advances *s and returns 64 random bits. */
static inline uint64_t moe_splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Approximately N(0, 1): the sum of four splitmix64 uniforms, centred and
 * scaled (the built-in inputs and the tests draw from this). */
static inline double moe_splitmix64_gauss4(uint64_t *s) {
    double u = 0;
    for (int k = 0; k < 4; k++) u += (double)(moe_splitmix64(s) >> 11) * 0x1.0p-53;
    return (u - 2.0) * 1.7320508075688772; /* sqrt(3) */
}

/* ------------------------------------------------------------ safetensors */

#define MOE_MAX_DIMS 8
/* Headers larger than this are rejected as hostile (real ones are < 10 MiB). */
#define MOE_ST_MAX_HEADER (100u * 1024u * 1024u)

typedef struct moe_st_tensor {
    const char *name;          /* owned by the file handle */
    moe_dtype dtype;
    int ndim;
    int64_t shape[MOE_MAX_DIMS];
    uint64_t nbytes;           /* product(shape) * dtype size, validated */
    const void *data;          /* points into the mapping; valid until close */
} moe_st_tensor;

/* A tensor whose dtype string names no moe_dtype (a newer safetensors dtype
 * such as "F4" or "C64", or a typo): kept aside so that the rest of its file
 * stays readable. Its bytes cannot be interpreted; a lookup of its name
 * through moe_ckpt_find fails with MOE_ERR_DTYPE naming it and its dtype. */
typedef struct moe_st_unknown {
    const char *name;          /* owned by the file handle */
    const char *dtype;         /* the dtype string as written (owned by the file handle) */
    int ndim;
    int64_t shape[MOE_MAX_DIMS];
    uint64_t nbytes;           /* length of its data_offsets range (not checked against the shape) */
} moe_st_unknown;

/* Longest dtype string accepted (longer ones are MOE_ERR_FORMAT). */
#define MOE_ST_MAX_DTYPE_NAME 32

typedef struct moe_st_file moe_st_file;

/* Map and validate a safetensors file: 8-byte little-endian header length
 * within the file and <= MOE_ST_MAX_HEADER, header is a JSON object (trailing
 * space padding allowed), names unique and non-empty, shape entries integers
 * in [0, 2^53], at most MOE_MAX_DIMS of them, shape product x dtype size ==
 * byte range, ranges inside the data section, no two non-empty ranges
 * overlapping; any breach is MOE_ERR_FORMAT, OS failures MOE_ERR_IO. A
 * dtype string (1 to MOE_ST_MAX_DTYPE_NAME characters) that is no moe_dtype
 * does not fail the file: that tensor is listed by moe_st_unknown_at (its
 * shape and range validated as above, its size unchecked) and is absent from
 * moe_st_count / moe_st_at / moe_st_find. On success *out owns the
 * mapping; on failure *out is untouched. Tensor data is not aligned: read it
 * with memcpy (moe_load_*). The file must not be truncated while mapped.
 * Thread safety: a handle may be read from many threads once opened. */
moe_status moe_st_open(const char *path, moe_st_file **out, moe_error *err);
/* The same validation over a caller-owned buffer (not copied: it must outlive
 * the handle). `label` names the buffer in messages. Used by the fuzzer. */
moe_status moe_st_open_buffer(const void *buf, size_t len, const char *label,
                              moe_st_file **out, moe_error *err);
void moe_st_close(moe_st_file *f); /* NULL is a no-op */
size_t moe_st_count(const moe_st_file *f);
const moe_st_tensor *moe_st_at(const moe_st_file *f, size_t i);
/* NULL when absent. */
const moe_st_tensor *moe_st_find(const moe_st_file *f, const char *name);
/* The tensors of unknown dtype, in header order; NULL when absent. */
size_t moe_st_count_unknown(const moe_st_file *f);
const moe_st_unknown *moe_st_unknown_at(const moe_st_file *f, size_t i);
const moe_st_unknown *moe_st_find_unknown(const moe_st_file *f, const char *name);
const char *moe_st_path(const moe_st_file *f);
/* Value of a string entry of "__metadata__", or NULL. */
const char *moe_st_metadata(const moe_st_file *f, const char *key);

/* ----------------------------------------------------------- output files */

/*
 * Every file the library or the CLI writes goes through one atomic writer:
 *  - the bytes go to a temporary file created exclusively (O_CREAT | O_EXCL |
 *    O_NOFOLLOW, a random name ".<name>.tmp.<random>" in the destination's
 *    directory): a symlink or file planted at any name is never followed nor
 *    overwritten;
 *  - commit: flush, fsync, rename over the destination, fsync the directory.
 *    The destination is either its old bytes or the complete new ones, never
 *    a partial file; on every failure the temporary file is removed;
 *  - a destination that exists and is not a regular file (a directory, FIFO,
 *    device, socket) is refused before anything is written. A symlink at the
 *    destination is replaced, never written through.
 * A handle is used by one thread at a time.
 */
typedef struct moe_out_file moe_out_file;

/* Create the temporary file for `path`. MOE_ERR_ARG for an empty path or a
 * destination that is not a regular file, MOE_ERR_IO when the directory
 * does not take a new file (the message names path and cause). On failure
 * *out is untouched and nothing exists on disk. */
moe_status moe_out_open(const char *path, moe_out_file **out, moe_error *err);
/* Append n bytes. A failure (disk full, ...) is MOE_ERR_IO naming the cause;
 * the handle then only aborts (commit returns the first error). */
moe_status moe_out_write(moe_out_file *f, const void *data, size_t n, moe_error *err);
/* Write n bytes at byte `offset` of the file (random access: a streamed
 * safetensors file fills its tensors in any order); failures as
 * moe_out_write. */
moe_status moe_out_pwrite(moe_out_file *f, const void *data, size_t n, uint64_t offset, moe_error *err);
/* A stdio stream for text writers (reports): a memory stream whose bytes
 * are appended after any moe_out_write bytes at commit. Owned by f; never
 * fclose it. NULL when out of memory (commit then fails). */
FILE *moe_out_stream(moe_out_file *f);
/* Make the file: write the stream's bytes, fsync, close, rename onto the
 * destination, fsync its directory. Always frees f. On failure the
 * destination keeps its old content (or stays absent), the temporary file is
 * removed, and MOE_ERR_IO names the step and cause. */
moe_status moe_out_commit(moe_out_file *f, moe_error *err);
/* Drop everything written; the destination is untouched. NULL is a no-op. */
void moe_out_abort(moe_out_file *f);
/* The destination path of f (owned by f). */
const char *moe_out_path(const moe_out_file *f);

/* A whole file of n bytes at once, atomically (moe_out_open + write + commit). */
moe_status moe_write_file(const char *path, const void *data, size_t n, moe_error *err);

/* MOE_ERR_ARG when writing `out` would replace one of inputs [n] (the same
 * file: same device and inode, whatever the spelling or link; NULL entries
 * are skipped). A message names both paths. Absent files never match. */
moe_status moe_out_check_inputs(const char *out, const char *const *inputs, size_t n, moe_error *err);

/* Tensor `name` of f widened to double: a float tensor (F64, F32, F16, BF16)
 * with ndim dimensions, dimension d equal to shape[d] where shape[d] >= 0
 * and free where shape[d] < 0 (its size is then written into shape[d]).
 * *out: a new buffer [product(shape)] (caller frees). Values are loaded as
 * stored, NaN and Inf included. MOE_ERR_MISSING when absent, MOE_ERR_DTYPE,
 * MOE_ERR_SHAPE (naming the file, tensor, the shape found and the one
 * needed), MOE_ERR_NOMEM; outputs untouched on failure. */
moe_status moe_st_read_f64(const moe_st_file *f, const char *name, int ndim, int64_t *shape, double **out,
                           moe_error *err);
/* The same for an integer tensor (any of I8..I64, U8..U64) as int64. */
moe_status moe_st_read_i64(const moe_st_file *f, const char *name, int ndim, int64_t *shape, int64_t **out,
                           moe_error *err);

/* One tensor to write. */
typedef struct moe_st_entry {
    const char *name;
    moe_dtype dtype;
    int ndim;
    int64_t shape[MOE_MAX_DIMS];
    const void *data;          /* product(shape) * dtype size bytes */
} moe_st_entry;

/* Write a safetensors file atomically (moe_out_open: an exclusive temporary
 * file in the destination's directory, fsync, rename). On failure the
 * destination is untouched and the temporary file removed.
 * Names must be unique, non-empty and not "__metadata__"; 0 <= ndim <=
 * MOE_MAX_DIMS; shape entries >= 0 (else MOE_ERR_ARG naming the tensor).
 * `metadata` is a NULL-terminated list of key, value string pairs for
 * "__metadata__" (written first), or NULL. Keys keep the entries' order; data
 * is laid out contiguously in that order after a header padded with spaces
 * to a multiple of 8 bytes. Data bytes are written as given (little-endian
 * hosts). */
moe_status moe_st_write(const char *path, const moe_st_entry *entries, size_t n,
                        const char *const *metadata, moe_error *err);

/* A safetensors file written as its tensors' bytes arrive, in any order
 * (outputs larger than memory, produced layer by layer or chunk by chunk).
 * moe_st_stream_open checks the entries as moe_st_write does (their data
 * pointers are ignored) and writes the header through the atomic writer
 * (moe_out_open: an exclusive temporary file beside path);
 * moe_st_stream_put writes nbytes of tensor i at byte offset within it;
 * moe_st_stream_finish checks that every tensor received exactly its bytes
 * (else MOE_ERR_ARG naming the first one short, and nothing is renamed),
 * then commits (fsync, rename onto path) and frees s; moe_st_stream_abort
 * removes the temporary file and frees s. The destination is never
 * partially written. Thread safety: one writer per stream. */
typedef struct moe_st_stream moe_st_stream;
moe_status moe_st_stream_open(const char *path, const moe_st_entry *entries, size_t n, const char *const *metadata,
                              moe_st_stream **out, moe_error *err);
moe_status moe_st_stream_put(moe_st_stream *s, size_t i, uint64_t offset, const void *data, size_t nbytes,
                             moe_error *err);
moe_status moe_st_stream_finish(moe_st_stream *s, moe_error *err);
void moe_st_stream_abort(moe_st_stream *s); /* NULL is a no-op */

/* ------------------------------------------------------ checkpoint (dir) */

/* A checkpoint directory: config.json (only its declared quantization is
 * read here, with hf_quant_config.json: quantization_config, expert_dtype,
 * ModelOpt's quantization; moe_model_open reads the rest) and, in order of
 * preference, model.safetensors, or
 * model.safetensors.index.json ({"weight_map": {tensor: shard-file}}) +
 * shards, or else every *.safetensors file except oracle_io*.safetensors,
 * sorted by name (the first file holding a name wins). Shards are mapped
 * lazily, on the first lookup of a tensor they hold, and stay mapped until
 * moe_ckpt_free; a shard that is missing or malformed is reported by the
 * lookup that needs it (so a partial download serves the tensors it has).
 * moe_ckpt_open fails with MOE_ERR_FORMAT for a malformed index, a shard
 * name with "/" or "..", or a config.json / hf_quant_config.json that is not
 * JSON, MOE_ERR_CONFIG for a quantization key of the wrong type (naming the
 * file and key), MOE_ERR_MISSING when no safetensors file exists,
 * MOE_ERR_IO when dir is not a readable directory.
 * Thread safety: none (lookups map shards); open all needed tensors first,
 * then share the moe_st_tensor pointers, which stay valid until free. */
typedef struct moe_ckpt moe_ckpt;

moe_status moe_ckpt_open(const char *dir, moe_ckpt **out, moe_error *err);

/* A file held in memory, as a directory would hold it. */
typedef struct moe_mem_file {
    const char *name;          /* a plain file name: "config.json", "model-00001-of-00002.safetensors" */
    const void *data;          /* [len] bytes, not copied */
    size_t len;
} moe_mem_file;

/* A checkpoint whose files are in memory (an engine's own buffers, the
 * fuzzers): files [n] play the directory's entries under the same rules as
 * moe_ckpt_open (model.safetensors, else the index, else every other
 * *.safetensors by name) and shards are parsed lazily from their buffers.
 * `label` (NULL: "<memory>") names it in messages. config.json and
 * hf_quant_config.json among files, when given, are its declared
 * quantization, as moe_ckpt_open reads them. files and every buffer must
 * outlive the handle. */
moe_status moe_ckpt_open_mem(const char *label, const moe_mem_file *files, size_t n, moe_ckpt **out,
                             moe_error *err);
void moe_ckpt_free(moe_ckpt *c);
/* Find a tensor by exact name; maps its shard on demand. Returns MOE_OK and
 * sets *t, or MOE_ERR_MISSING (with a message naming the tensor and dir, and
 * the shard when the index lists the tensor under a shard that lacks it)
 * when no shard holds it; MOE_ERR_DTYPE naming the tensor, its shard and its
 * dtype when the shard holds it with a dtype the reader does not know (the
 * shard's other tensors stay readable); the reader's error (naming the
 * shard and tensor) when its shard is missing or invalid. */
moe_status moe_ckpt_find(moe_ckpt *c, const char *name, const moe_st_tensor **t,
                         moe_error *err);
/* True when the index names the tensor or, without an index, some readable
 * shard holds it (shards are mapped to find out). No error path. */
bool moe_ckpt_has(moe_ckpt *c, const char *name);
/* A probe that keeps read errors: MOE_OK with *t the tensor, or *t = NULL
 * when no shard holds it (with an index: the index does not name it); the
 * reader's error (naming the shard and the tensor) when a shard that could
 * hold it cannot be read, so that a corrupt file is never taken for an
 * absent tensor. Use it wherever absence changes what is loaded. */
moe_status moe_ckpt_lookup(moe_ckpt *c, const char *name, const moe_st_tensor **t, moe_error *err);
const char *moe_ckpt_dir(const moe_ckpt *c);
/* The shards, in the order found (index order of first mention, or sorted
 * file names). moe_ckpt_shard maps shard i on demand. */
size_t moe_ckpt_n_shards(const moe_ckpt *c);
const char *moe_ckpt_shard_file(const moe_ckpt *c, size_t i);
moe_status moe_ckpt_shard(moe_ckpt *c, size_t i, moe_st_file **f, moe_error *err);
/* Whether shard i has been mapped so far (by a lookup that needed it): what
 * a process holding a share of a model has touched. No side effect. */
bool moe_ckpt_shard_mapped(const moe_ckpt *c, size_t i);
bool moe_ckpt_has_index(const moe_ckpt *c);

/* ------------------------------------------------------------ quantize */

typedef enum moe_qfmt { MOE_Q_NONE, MOE_Q_FP8, MOE_Q_MXFP4, MOE_Q_NVFP4 } moe_qfmt;
const char *moe_qfmt_name(moe_qfmt q);
bool moe_qfmt_parse(const char *s, moe_qfmt *q);

typedef struct moe_quant_opts {
    moe_qfmt experts;     /* routed experts: FP8, MXFP4 or NVFP4 (NONE copies) */
    moe_qfmt others;      /* shared experts and other linears: FP8 or NONE */
    int e2m1_round;       /* moe_e2m1_round (moe_formats.h); 0 = nearest-even */
    int mx_scale_rule;    /* moe_mx_scale_rule; 0 = ceil(log2(amax / 6)) (V4) */
} moe_quant_opts;

/* What moe_quantize_checkpoint_with adds for files (zero: the defaults). */
typedef struct moe_quant_file_opts {
    bool ue8m0;           /* HF V3 FP8: power-of-two fp32 scales and scale_fmt
                             "ue8m0" (DeepSeek-V3.1); false: amax / 448 (V3, R1) */
    const char *calib;    /* NVFP4 input scales: a safetensors file with the MoE
                             block inputs "hidden" [T, H] (+ "input_ids" [T] for
                             hash layers); NULL: built-in N(0, 1) tokens */
    int64_t calib_tokens; /* how many built-in tokens (0: 256) */
} moe_quant_file_opts;

typedef struct moe_quant_report {
    int n_tensors;        /* tensors read */
    int n_quantized;      /* linear weights quantized */
    uint64_t n_weights;   /* elements of the quantized tensors */
    uint64_t bytes_in;    /* bytes of the quantized tensors before */
    uint64_t bytes_out;   /* bytes of the quantized tensors and their scales after */
    const char *release;  /* the release whose conventions were written (static) */
    char calib[256];      /* NVFP4: what the input scales were calibrated on; "" otherwise */
    int n_uncalibrated;   /* NVFP4: experts no calibration token reached (given the
                             calibrated experts' largest amax, as ModelOpt does) */
} moe_quant_report;

/* Write a quantized copy of the BF16/F16/F32 checkpoint in_dir to out_dir
 * (created if needed; never in_dir) as the release it imitates writes it
 * (src/io/quantize.c lists each; docs/formats.md "What quantize writes"):
 *   V4 names + mxfp4 experts: deepseek-ai/DeepSeek-V4-Flash (I8 + E8M0
 *     .scale experts; FP8 + E8M0 .scale attention / indexer wq_b / shared /
 *     MTP projections with --others fp8; compressors, indexer.weights_proj
 *     BF16; expert_dtype, quantization_config with scale_fmt ue8m0);
 *   V4 names + nvfp4: nvidia/DeepSeek-V4-Flash-NVFP4 (U8 + weight_scale +
 *     weight_scale_2 + input_scale experts, moe_quant_algo "NVFP4",
 *     hf_quant_config.json MIXED_PRECISION);
 *   HF V3 names + fp8: deepseek-ai/DeepSeek-V3 (weight_scale_inv fp32;
 *     o->ue8m0: V3.1); + nvfp4: nvidia/DeepSeek-R1-FP4 (ModelOpt NVFP4 on
 *     experts, shared experts and dense MLPs, hf_quant_config.json NVFP4).
 * NVFP4 input scales are calibrated (moe_layer_calibrate_nvfp4's rule) on
 * built-in tokens, or on moe_quant_file_opts.calib. Shard files keep their
 * names, tensors sorted by name; each file is written atomically,
 * config.json last. rep->release names the release. */
moe_status moe_quantize_checkpoint(const char *in_dir, const char *out_dir, const moe_quant_opts *o,
                                   moe_quant_report *rep, moe_error *err);
/* The same with file options fo (NULL: all zero). */
moe_status moe_quantize_checkpoint_with(const char *in_dir, const char *out_dir, const moe_quant_opts *o,
                                        const moe_quant_file_opts *fo, moe_quant_report *rep, moe_error *err);

/* ----------------------------------------------------------------- model */

typedef enum moe_score_func {
    MOE_SCORE_SOFTMAX,
    MOE_SCORE_SIGMOID,
    MOE_SCORE_SQRTSOFTPLUS
} moe_score_func;

typedef enum moe_layer_kind {
    MOE_LAYER_DENSE,  /* no MoE block on this layer */
    MOE_LAYER_TOPK,   /* learned router, (grouped) top-k */
    MOE_LAYER_HASH    /* V4 hash routing through tid2eid */
} moe_layer_kind;

typedef enum moe_arch {
    MOE_ARCH_V3,      /* HF DeepSeek V3 names (model.layers.N.mlp.*) */
    MOE_ARCH_V4       /* DeepSeek V4 names (layers.N.ffn.*) */
} moe_arch;

/* Storage format of a linear weight [rows = out, cols = in]. The quantized
 * formats are the seam for the next stage: loaders recognise them and the
 * row decoders below define their values. */
typedef enum moe_wfmt {
    MOE_WFMT_F64,
    MOE_WFMT_F32,
    MOE_WFMT_F16,
    MOE_WFMT_BF16,
    MOE_WFMT_FP8_BLOCK,   /* E4M3 with one multiply scale (fp32 or E8M0) per block of
                             block_rows x block_cols: 128x128 (V3, V4), 32x32 (V4.1),
                             1 x cols (per channel); per-tensor scales are spread over 128x128 */
    MOE_WFMT_MXFP4,       /* packed E2M1 + E8M0 per 32 (V4 experts) */
    MOE_WFMT_NVFP4        /* packed E2M1 + UE4M3 per 16 + fp32 per tensor */
} moe_wfmt;

typedef struct moe_weight {
    moe_wfmt fmt;
    int64_t rows, cols;        /* logical [out, in] */
    const void *data;          /* mapped storage, layout per fmt */
    const void *scale;         /* block scales or NULL */
    moe_dtype scale_dtype;
    int64_t scale_rows, scale_cols; /* tile grid of `scale` */
    float scale2;              /* NVFP4 per-tensor scale; 1 otherwise */
    const char *name;          /* tensor name, for messages (owned by model) */
    /* FP8_BLOCK: weight rows and columns per scale; 0 means 128 (descriptors
     * built before the field existed). Fast kernels take 128 x 128 only and
     * leave other blocks to the reference kernel. */
    int32_t block_rows, block_cols;
    /* NVFP4 from compressed-tensors: weight_global_scale G. The value is
     * e2m1 * ue4m3 / G (the float64 decoder divides); scale2 = fp32(1 / G)
     * serves the float32 paths, as engines fold it. 0 for ModelOpt. */
    double global_scale;
    /* The static NVFP4 scale of this linear's input activations, amax /
     * (6 * 448): ModelOpt NVFP4's input_scale, 1 / compressed-tensors'
     * input_global_scale, or moe_layer_calibrate_nvfp4's; 0 when there is
     * none (ModelOpt FP8's input_scale, amax / 448 for static FP8
     * activations, is not recorded). */
    float input_scale;
    /* NVFP4 activations (MOE_ACT_NVFP4): the input scale a fused-MoE engine
     * applies to this expert GEMM's input, the layer's largest over its
     * routed experts (TensorRT-LLM, FlashInfer); set by the layer builders;
     * 0: input_scale. */
    float act_scale;
    /* How the checkpoint stores it ("bf16", "fp8 128x128 e8m0 (.scale)",
     * "nvfp4 (ModelOpt)", ...): a static string for messages and reports,
     * or NULL. */
    const char *scheme;
} moe_weight;

/* Row r of w as double, exactly as the format defines it. out: [w->cols]. */
void moe_weight_row_f64(const moe_weight *w, int64_t r, double *out);
/* Row r of w as float (exact for BF16/F16/FP8/FP4; rounded for F64). */
void moe_weight_row_f32(const moe_weight *w, int64_t r, float *out);

typedef struct moe_block_config {
    moe_layer_kind kind;
    int hidden;                /* H */
    int inter;                 /* I of a routed expert */
    int shared_inter;          /* I of the shared branch (n_shared * I), 0 if none */
    int n_experts;             /* E */
    int top_k;                 /* K */
    int n_shared;              /* number of shared experts (summed in one MLP) */
    int n_group, topk_group;   /* V3 grouped routing; 1, 1 when ungrouped */
    int vocab;                 /* rows of tid2eid on hash layers */
    moe_score_func score;
    bool renormalize;          /* norm_topk_prob */
    bool has_bias;             /* correction bias used for selection */
    double scaling;            /* routed_scaling_factor s */
    double swiglu_limit;       /* L; 0 = no clamp */
} moe_block_config;

typedef struct moe_layer {
    int index;
    moe_block_config cfg;
    moe_weight gate;           /* router [E, H] */
    const double *bias;        /* [E] correction bias, NULL when absent */
    const int32_t *tid2eid;    /* [vocab, K], hash layers only */
    const moe_weight *w1;      /* [E] gate projections [I, H] */
    const moe_weight *w3;      /* [E] up projections   [I, H] */
    const moe_weight *w2;      /* [E] down projections [H, I] */
    moe_weight sw1, sw3, sw2;  /* shared expert (rows = 0 when none) */
    /* NVFP4 checkpoints: experts whose gate and up weight_scale_2 differ. The
     * library computes each projection with its own scale (exact); an engine
     * with one fused gate/up GEMM must rescale the smaller one's block scales
     * to the larger weight_scale_2, losing up to nvfp4_reconcile_loss
     * (relative change of a block scale, UE4M3 rounding). */
    int nvfp4_scale2_mismatch;
    double nvfp4_reconcile_loss;
} moe_layer;

typedef struct moe_model_info {
    moe_arch arch;
    const char *model_type;    /* config "model_type" (of text_config when the config nests one) */
    int n_layers;              /* num_hidden_layers: layers 0 .. n_layers - 1 */
    int hidden;
    int vocab;
    int n_mtp;                 /* num_nextn_predict_layers: the MTP blocks are layers
                                  n_layers .. n_layers + n_mtp - 1 (V4 mtp.K.*, HF V3
                                  model.layers.<n_layers + K>.*) */
} moe_model_info;

/*
 * Limits on what a config.json may ask for. Each is checked when the config
 * is read, before anything is sized from it; a value past one is
 * MOE_ERR_CONFIG naming the key, the value and the limit. They bound the
 * router's fixed scratch (top-k, groups) and keep every product of
 * dimensions far inside int and size_t; published checkpoints are far below
 * them (DeepSeek V3: H 7168, I 2048, E 256, K 8, 8 groups, 61 layers, vocab
 * 129280; tests/data and docs/formats.md list the V4 shapes).
 */
#define MOE_MAX_HIDDEN  (1 << 16)   /* hidden_size */
#define MOE_MAX_INTER   (1 << 18)   /* moe_intermediate_size */
#define MOE_MAX_EXPERTS (1 << 14)   /* n_routed_experts */
#define MOE_MAX_TOPK    256         /* num_experts_per_tok */
#define MOE_MAX_GROUPS  1024        /* n_group, topk_group */
#define MOE_MAX_SHARED  64          /* n_shared_experts */
#define MOE_MAX_LAYERS  4096        /* num_hidden_layers */
#define MOE_MAX_VOCAB   (1 << 24)   /* vocab_size (and tid2eid rows) */

typedef struct moe_model moe_model;

/* Open a checkpoint directory and read config.json (cJSON; a config that
 * nests the text model under "text_config" is read from there). Layers load
 * on demand. */
moe_status moe_model_open(const char *dir, moe_model **out, moe_error *err);
void moe_model_free(moe_model *m);
/* The same from files [n] in memory (moe_ckpt_open_mem's rules; the file
 * named "config.json" is the config). Buffers must outlive the model. */
moe_status moe_model_open_mem(const char *label, const moe_mem_file *files, size_t n, moe_model **out,
                              moe_error *err);
const moe_model_info *moe_model_get_info(const moe_model *m);
/* Kind of layer i from the config alone (no tensors read). */
moe_status moe_model_layer_kind(const moe_model *m, int layer, moe_layer_kind *kind,
                                moe_error *err);
/* Find a checkpoint tensor by name, trying `name` as given and with the
 * "model." prefix added or removed (V4 checkpoints come both ways). */
moe_status moe_model_find(moe_model *m, const char *name, const moe_st_tensor **t, moe_error *err);
/* The model's config.json as text (for modules that read their own keys with
 * cJSON); owned by the model. */
const char *moe_model_config_json(const moe_model *m);
/* The model's checkpoint (its shards, mapped on demand), owned by the model:
 * the whole-model forward reads its attention tensors from the same
 * mappings. Thread safety as moe_ckpt's. */
moe_ckpt *moe_model_ckpt(moe_model *m);
/* Load (once) and return layer `layer`'s MoE block; layers n_layers and up
 * are the MTP blocks (moe_model_info.n_mtp). MOE_ERR_ARG for a dense layer
 * or an index out of range; MOE_ERR_MISSING (naming what was looked for)
 * when the checkpoint lacks the block's router. Routed experts are read one
 * tensor per expert or, where a port wrote transformers' stacked
 * parameters, as views of "experts.gate_up_proj" [E, 2I, H] and
 * "experts.down_proj" [E, H, I]. The layer is owned by the model. Not
 * thread-safe against concurrent first loads of the same model. */
moe_status moe_model_layer(moe_model *m, int layer, const moe_layer **out,
                           moe_error *err);
/* A caller-owned copy of layer `layer` holding only routed experts
 * [e_begin, e_end) (expert parallelism: a rank maps only its share; the
 * others are empty descriptors with rows = 0). Router, bias, tid2eid and the
 * shared expert are loaded. Free with moe_layer_free. Running such a layer
 * through moe_block_run is a contract violation unless every token routes
 * inside the range: use it with the expert-level API. */
moe_status moe_model_layer_experts(moe_model *m, int layer, int e_begin, int e_end, moe_layer **out,
                                   moe_error *err);
void moe_layer_free(moe_layer *L);
/* A caller-owned copy of the MoE block of DeepSeek V4's MTP block k
 * ("mtp.k.ffn.*", with or without "model."): score-routed (top-k, its
 * gate.bias when present), index n_layers + k. Free with moe_layer_free.
 * MOE_ERR_MISSING when the checkpoint has no such block. */
moe_status moe_model_mtp_layer(moe_model *m, int k, moe_layer **out, moe_error *err);
/* The same block holding only routed experts [e_begin, e_end) (expert
 * parallelism, as moe_model_layer_experts; the range [0, 0) loads router,
 * bias and shared expert alone). MOE_ERR_ARG for a range outside [0, E). */
moe_status moe_model_mtp_layer_experts(moe_model *m, int k, int e_begin, int e_end, moe_layer **out,
                                       moe_error *err);

/* Quantize a layer in memory: routed experts to o->experts, the shared
 * expert to o->others (MOE_Q_NONE keeps it), the router untouched. The new
 * layer owns its quantized buffers but shares router, bias, tid2eid and any
 * unquantized weights with src, which must outlive it. FP8 scales are E8M0
 * on V4 (sqrtsoftplus) layers, fp32 otherwise. Free with moe_layer_free. */
moe_status moe_layer_quantize(const moe_layer *src, const moe_quant_opts *o, moe_layer **out, moe_error *err);

/* Static NVFP4 activation scales for a caller-owned layer L (one from
 * moe_layer_quantize): route hidden [T, H] (ids [T] on hash layers) through
 * ref's router and experts (ref: the unquantized layer, as ModelOpt
 * calibrates the BF16 model; NULL: L itself) and set every routed expert's
 * input_scale = amax / (6 * 448) of its GEMM inputs over the tokens routed
 * to it (w1 and w3 share one; experts no token reached take the largest of
 * the calibrated ones, per projection), the shared expert's over all
 * tokens, then the layer's act_scale fields (moe_layer_act_scales).
 * MOE_ERR_INPUT when no token reaches any expert. */
moe_status moe_layer_calibrate_nvfp4(moe_layer *L, const moe_layer *ref, const double *hidden, const int64_t *ids,
                                     int64_t T, moe_error *err);

/* Set the act_scale of L's weights from their input_scale: routed experts
 * the layer's largest per GEMM (TensorRT-LLM and FlashInfer quantize a
 * fused MoE's activations with one global scale per GEMM), the shared
 * expert its own (gate/up merged: the larger). Every layer builder calls
 * it; call it again after changing input scales. */
void moe_layer_act_scales(moe_layer *L);

/* --------------------------------------------------------------- inspect */

#define MOE_INSPECT_MAX_FAMILIES 64
#define MOE_INSPECT_MAX_RUNS 16
#define MOE_INSPECT_MAX_NOTES 8

/* One tensor family stored one way: "routed experts" x "mxfp4 (I8 + .scale
 * F8_E8M0)" x 768. Linears carry their storage scheme (scales counted with
 * them), other tensors their dtype. */
typedef struct moe_inspect_family {
    char family[32];
    char scheme[128];
    int count;
    char example[160];         /* one tensor of the family */
} moe_inspect_family;

typedef struct moe_inspect_layer {
    int index;                 /* MTP blocks follow the n_layers layers */
    bool mtp;
    moe_layer_kind kind;       /* from config.json */
    bool present;              /* the checkpoint holds tensors of this layer */
    char attention[40];        /* "sliding window", "CSA (ratio 4) + indexer", "HCA (ratio 128)", "MLA", ... */
    char experts[128];         /* the routed experts' scheme ("" for dense layers) */
    char runnable[192];        /* "yes", or "no: <why>" */
} moe_inspect_layer;

typedef struct moe_inspect_run {
    char what[48];             /* "run / audit / diagnose", "--act nvfp4 ...", "quantize ...", ... */
    bool ok;
    char why[320];
} moe_inspect_run;

/* What a checkpoint is, from config.json, the quant config files and the
 * safetensors headers (moe_inspect_dir). Fixed arrays except layers. */
typedef struct moe_inspect {
    char dir[1024];
    char architecture[64], model_type[64];
    moe_arch arch;
    bool nested_config;        /* the text model's keys under text_config */
    int n_layers, n_mtp, n_hash, hidden, moe_inter, n_experts, top_k, n_shared, vocab;
    char scoring[24];
    double scaling;
    int n_shards;
    bool indexed;
    int64_t n_tensors;
    uint64_t bytes;
    char declared[400];        /* the declared quantization in one line */
    int n_contradictions;      /* linears whose storage contradicts the declaration */
    char contradictions[MOE_INSPECT_MAX_NOTES][420];
    int n_unknown;             /* tensors of a dtype the reader does not know */
    char unknown[MOE_INSPECT_MAX_NOTES][240];
    int n_bad_shards;          /* shards that could not be opened */
    char bad_shards[MOE_INSPECT_MAX_NOTES][512];
    int n_layer_info;
    moe_inspect_layer *layers; /* [n_layer_info] = n_layers + n_mtp */
    int n_families;
    moe_inspect_family families[MOE_INSPECT_MAX_FAMILIES];
    int n_runs;
    moe_inspect_run runs[MOE_INSPECT_MAX_RUNS];
} moe_inspect;

/* Describe the checkpoint in dir without reading tensor data (headers and
 * config files only): fast on a 46-shard release. A shard that cannot be
 * opened, a tensor of unknown dtype or a contradiction with the declared
 * quantization is reported in *r, not as an error; errors are those of
 * moe_model_open / moe_ckpt_open (the config or index cannot be read).
 * Free with moe_inspect_free. */
moe_status moe_inspect_dir(const char *dir, moe_inspect *r, moe_error *err);
/* The same for a checkpoint whose files are in memory (moe_ckpt_open_mem's
 * rules; `label` names it in r->dir and messages). */
moe_status moe_inspect_mem(const char *label, const moe_mem_file *files, size_t n, moe_inspect *r, moe_error *err);
void moe_inspect_free(moe_inspect *r);
/* The report as a JSON object (malloc'd; caller frees) / as text to f. */
char *moe_inspect_json(const moe_inspect *r);
moe_status moe_inspect_report_text(FILE *f, const moe_inspect *r);

/* ------------------------------------------------------ synthetic models */

typedef struct moe_synth_opts {
    moe_arch arch;             /* V4: sqrtsoftplus, hash + top-k layers; V3: sigmoid, grouped */
    int hidden, inter, n_experts, top_k;
    int n_layers, n_hash_layers; /* V4: the first n_hash_layers are hash-routed */
    int vocab;                 /* tid2eid rows */
    int n_group, topk_group;   /* V3 grouping */
    double scaling, swiglu_limit;
    uint64_t seed;
} moe_synth_opts;

/* A small V4 model: H 128, I 64, E 8, K 2, one hash and one top-k layer. */
moe_synth_opts moe_synth_opts_default(void);
/* DeepSeek-V4-Flash shapes: H 4096, I 2048, K 6, s 1.5, swiglu_limit 10,
 * one hash layer and one top-k layer, n_experts routed experts. */
moe_synth_opts moe_synth_opts_v4flash(int n_experts);
/* Build layer `layer` of the synthetic model in memory (BF16 weights owned by
 * the layer; free with moe_layer_free). Deterministic in (o->seed, layer),
 * whatever the thread count. */
moe_status moe_synth_layer(const moe_synth_opts *o, int layer, moe_layer **out, moe_error *err);
/* Write a BF16 checkpoint directory (config.json + model.safetensors) with
 * random weights drawn for realistic (non-uniform) routing; deterministic in
 * o->seed. One shared expert per layer. */
moe_status moe_synth_write(const char *dir, const moe_synth_opts *o, moe_error *err);

/* -------------------------------------------------------- scaling contract */

/*
 * Who multiplies the routed branch by routed_scaling_factor s. Exactly one
 * owner does, exactly once; the shared branch is never scaled. The router and
 * the runner both read this one value (docs/semantics.md section 2).
 */
typedef enum moe_scale_owner {
    MOE_SCALE_ROUTER,  /* router emits w with sum(w) = s */
    MOE_SCALE_RUNNER,  /* router emits sum(w) = 1; runner multiplies its weighted sum */
    MOE_SCALE_OUTPUT   /* router emits sum(w) = 1; the block scales routed, then adds shared */
} moe_scale_owner;

const char *moe_scale_owner_name(moe_scale_owner o);
bool moe_scale_owner_parse(const char *s, moe_scale_owner *o);

/* The multipliers a contract implies: router_mult folds into the emitted
 * weights, runner_mult multiplies every column the runner sums (fused shared
 * column included), output_mult multiplies the routed sum before shared is
 * added, fused_shared_w is the emitted weight of a fused shared column. */
typedef struct moe_contract {
    double router_mult, runner_mult, output_mult, fused_shared_w;
} moe_contract;

/* MOE_ERR_ARG for OUTPUT with fused shared experts (not expressible). */
moe_status moe_contract_for(moe_scale_owner o, bool fuse_shared, double s,
                            moe_contract *c, moe_error *err);

/* ------------------------------------------------------------- block run */

typedef enum moe_precision {
    MOE_PREC_REF,  /* float64 everywhere: the definition */
    MOE_PREC_F32   /* float32, tokens grouped by expert */
} moe_precision;

/* Precision of the activations that enter the expert GEMMs (the block input
 * for gate/up, the SwiGLU output for down). The values are rounded; the
 * arithmetic stays that of the path (float64 or float32). */
typedef enum moe_act_prec {
    MOE_ACT_EXACT,       /* no rounding beyond the path's own */
    MOE_ACT_BF16,        /* bf16, nearest-even */
    MOE_ACT_FP8,         /* E4M3 per 128 values, power-of-two scale (V3.1+, V4) */
    MOE_ACT_FP8_F32SCALE,/* E4M3 per 128 values, fp32 scale amax / 448 (V3) */
    /* NVFP4 activations (W4A4) with the checkpoint's static input_scale:
     * E2M1 with a UE4M3 scale per 16 values from the block amax and the
     * global scale 1 / input_scale (moe_nvfp4_act_quant_row). Routed experts
     * must carry input scales (ModelOpt NVFP4 checkpoints do;
     * moe_layer_calibrate_nvfp4 sets them), else the run is MOE_ERR_MISSING;
     * a shared expert without one keeps its activations. */
    MOE_ACT_NVFP4,       /* one input scale per expert GEMM for the whole layer, the
                            largest over its experts (TensorRT-LLM, FlashInfer) */
    MOE_ACT_NVFP4_EXPERT /* each expert's own input scale (vLLM's CUTLASS MoE) */
} moe_act_prec;

const char *moe_act_prec_name(moe_act_prec a);
bool moe_act_prec_parse(const char *s, moe_act_prec *a);

/* Precision of the router's GEMM, beside the path's own arithmetic. */
typedef enum moe_router_prec {
    MOE_ROUTER_PATH,        /* the path's precision (float64 or float32) */
    MOE_ROUTER_BF16_INPUT,  /* hidden rounded to bf16 before the gate GEMM (fp32 accumulation) */
    MOE_ROUTER_BF16_LOGITS  /* ... and the logits rounded to bf16 (a bf16 F.linear) */
} moe_router_prec;

/* The CPU kernels of the f32 path (src/cpu: one kernel table per ISA). A
 * run names its ISA in moe_run_opts.isa; nothing is global. MOE_ISA in the
 * environment is read by the CLI only, as its default. */
typedef enum moe_isa {
    MOE_ISA_AUTO,   /* the best this CPU supports: avx512, else avx2, else ref */
    MOE_ISA_REF,    /* the scalar reference kernels (always available) */
    MOE_ISA_AVX2,   /* AVX2 + FMA + F16C */
    MOE_ISA_AVX512, /* AVX-512 F/BW/VL/DQ/VBMI (+ BF16 dot products when the CPU has AVX512_BF16) */
    MOE_ISA_AMX     /* AMX BF16 tiles for bf16 activations (by name only: AUTO stays avx512) */
} moe_isa;

/* "auto", "ref", "avx2", "avx512", "amx"; "?" for other values. */
const char *moe_isa_name(moe_isa isa);
/* Parse one of those names. MOE_ERR_ARG names the value and the choices. */
moe_status moe_isa_parse(const char *s, moe_isa *isa, moe_error *err);
/* The ISA a run of `isa` takes on this CPU (AUTO: the best available) into
 * *out. MOE_ERR_UNSUPPORTED when this CPU or build lacks it (the message
 * says what is available), MOE_ERR_ARG for a value outside the enum; *out
 * untouched on failure. Thread-safe (CPU detection runs once). */
moe_status moe_isa_resolve(moe_isa isa, moe_isa *out, moe_error *err);

/* Added to sum(w) when renormalizing the top-k weights (SGLang, HF and
 * TensorRT-LLM use it; moeaudit_variant.h can change it). */
#define MOE_RENORM_EPS 1e-20

/* How a block runs: production choices only. Faults and what-if toggles of
 * other engines live in moe_variant (moeaudit_variant.h), which only the
 * tests and moe_diagnose pass. */
typedef struct moe_run_opts {
    moe_precision precision;
    moe_isa isa;               /* CPU kernels of the f32 path; MOE_ISA_AUTO: the best (ref ignores it) */
    moe_router_prec router;    /* router GEMM precision */
    moe_act_prec act;          /* activation rounding at the expert GEMMs */
    moe_scale_owner owner;
    bool fuse_shared;          /* shared expert(s) as routed column(s) E + j */
    bool check_invariants;     /* verify the contract on every token */
} moe_run_opts;

moe_run_opts moe_run_opts_default(void);

/* The block's outputs. All arrays allocated by moe_block_out_init. */
typedef struct moe_block_out {
    int64_t T;
    int H, E;
    int n_cols;                /* K, or K + n_shared with fuse_shared */
    double *router_logits;     /* [T, E] gate logits (computed on hash layers too) */
    int32_t *topk_ids;         /* [T, n_cols] as the router emits them (fused: ids E + j) */
    double *topk_weights;      /* [T, n_cols] as the router emits them under the owner */
    double *eff_weights;       /* [T, n_cols] weights after every multiplication applied */
    double *routed_out;        /* [T, H] sum_j eff_j * expert_j(x): scaled routed branch */
    double *shared_out;        /* [T, H] shared expert(s) alone, unscaled */
    double *moe_out;           /* [T, H] routed + shared as the block combines them */
} moe_block_out;

moe_status moe_block_out_init(moe_block_out *o, const moe_layer *L, int64_t T,
                              const moe_run_opts *opts, moe_error *err);
void moe_block_out_free(moe_block_out *o);

/* A block's input read from a file (`run --input`, engine dumps). */
typedef struct moe_block_input {
    int64_t T;                 /* tokens, >= 1 */
    int H;
    double *hidden;            /* [T, H] */
    int64_t *ids;              /* [T], or NULL when the file has no ids tensor */
    int64_t n_nonfinite;       /* tokens with a NaN or Inf in hidden (their outputs will be NaN) */
    int64_t first_nonfinite;   /* the first such token, -1 when none */
} moe_block_input;

/* Read tensor `hidden_name` [T, H] (F64, F32, F16, BF16; T >= 1) and, when
 * present, `ids_name` [T] (I32 or I64) of f into *in (owned: free with
 * moe_block_input_free). Token ids are checked against a layer's vocabulary
 * by moe_block_run, not here. MOE_ERR_MISSING, MOE_ERR_DTYPE, MOE_ERR_SHAPE,
 * MOE_ERR_INPUT (0 tokens), MOE_ERR_NOMEM with the file and tensor named;
 * *in zeroed on failure. */
moe_status moe_block_input_read(const moe_st_file *f, const char *hidden_name, const char *ids_name, int H,
                                moe_block_input *in, moe_error *err);
void moe_block_input_free(moe_block_input *in); /* zeroed or NULL: no-op */

/*
 * Run one MoE block on T tokens.
 *   hidden    double [T, H]: the block input (after the FFN RMSNorm)
 *   input_ids int64 [T]: token ids; required on hash layers, else may be NULL
 * A NaN or Inf in one token's hidden state makes that token's outputs NaN and
 * leaves every other token untouched. A token id outside [0, vocab) on a hash
 * layer is MOE_ERR_INPUT naming the token. T = 0 is valid and does nothing.
 * The f32 path runs the kernels of opts->isa: MOE_ERR_UNSUPPORTED when this
 * CPU lacks them (moe_isa_resolve's message).
 * Outputs do not depend on which other tokens share the batch, nor on the
 * number of threads. Thread safety: concurrent calls on one layer are safe,
 * whatever ISA each names.
 */
moe_status moe_block_run(const moe_layer *L, const double *hidden,
                         const int64_t *input_ids, int64_t T,
                         const moe_run_opts *opts, moe_block_out *out,
                         moe_error *err);

/* Check the contract on finished outputs: for every token, the effective
 * routed weights equal s times the unscaled router weights (and so sum to s
 * when renormalizing) and the effective shared weight is 1; moe_out equals
 * routed_out + shared_out. MOE_ERR_INVARIANT names the first bad token. */
moe_status moe_block_check(const moe_layer *L, const moe_block_out *out,
                           const moe_run_opts *opts, moe_error *err);

/* Below this sum of its selected scores, a renormalized token's routing
 * weights lose more than 1e-6 of their sum to MOE_RENORM_EPS (sum / (sum +
 * 1e-20) < 1 - 1e-6): at logits near -800 every score underflows to 0 and
 * the routed branch is exactly 0 under the definition, while an engine
 * without the epsilon gives each selected expert 1/K. */
#define MOE_VANISH_SUM (1e6 * MOE_RENORM_EPS)

/* Tokens of finished outputs whose routing weights vanish that way (layers
 * that renormalize; 0 otherwise), and the first one into *first (-1 when
 * none; first may be NULL); -1 when out of memory. Callers say so instead
 * of letting a zero routed branch pass silently. Pure. */
int64_t moe_block_vanishing(const moe_layer *L, const moe_block_out *out, int64_t *first);

/* ------------------------------------------------------------- diagnose */

/* Verdicts of moe_diagnose, most specific first. */
typedef enum moe_verdict {
    MOE_VERDICT_OK,
    MOE_VERDICT_SCALE_DOUBLE,      /* routed branch scaled by s^2 */
    MOE_VERDICT_SCALE_MISSING,     /* routed branch not scaled */
    MOE_VERDICT_SHARED_WEIGHT,     /* shared expert weighted != 1 */
    MOE_VERDICT_NOT_RENORMALIZED,  /* top-k weights not renormalized */
    MOE_VERDICT_BIASED_WEIGHTS,    /* weights gathered from bias-corrected scores */
    MOE_VERDICT_WRONG_SCORE,       /* another scoring function */
    MOE_VERDICT_SELECTION,         /* expert sets differ beyond near-ties */
    MOE_VERDICT_UNEXPLAINED
} moe_verdict;
const char *moe_verdict_name(moe_verdict v);

/* How sure a finding is (docs/diagnose.md gives the rule that combines them). */
typedef enum moe_confidence {
    MOE_CONF_NONE,     /* not checked, or too few tokens: never votes */
    MOE_CONF_WEAK,     /* within the arithmetic noise: reported, never decides */
    MOE_CONF_STRONG,   /* beyond the noise by a wide margin, over enough tokens */
    MOE_CONF_EXACT     /* reproduced to the dump's storage precision */
} moe_confidence;
const char *moe_confidence_name(moe_confidence c);

/* The stages a dump is checked at. */
typedef enum moe_diag_stage {
    MOE_STAGE_ROUTER,     /* router_logits against the reference's */
    MOE_STAGE_SELECTION,  /* topk_ids: the expert sets */
    MOE_STAGE_WEIGHTS,    /* topk_weights against each routing hypothesis */
    MOE_STAGE_OUTPUT,     /* moe_out ~ a * routed + b * shared (routing flips resolved) */
    MOE_STAGE_COUNT
} moe_diag_stage;
const char *moe_diag_stage_name(moe_diag_stage s);

/* Tensors another engine dumped for one layer (any float dtype on disk). */
typedef struct moe_dump {
    int64_t T;
    int H, E;
    int layer;             /* N of a "layers.N." dump, -1 for unprefixed names */
    double *hidden;        /* [T, H] required */
    double *moe_out;       /* [T, H] required */
    int64_t *input_ids;    /* [T] or NULL */
    double *router_logits; /* [T, E] or NULL */
    int32_t *topk_ids;     /* [T, n_cols] or NULL; ids >= E are fused shared columns */
    double *topk_weights;  /* [T, n_cols] or NULL */
    int n_cols;
    double *routed_out;    /* [T, H] or NULL */
    double *shared_out;    /* [T, H] or NULL */
    /* storage dtypes: evidence of the engine's arithmetic (MOE_DTYPE_COUNT when absent) */
    moe_dtype hidden_dtype, moe_out_dtype, logits_dtype, weights_dtype;
} moe_dump;

/* Read one layer of a dump (safetensors). layer < 0: the unprefixed names
 * hidden, moe_out and optionally input_ids, router_logits, topk_ids,
 * topk_weights, routed_out, shared_out; layer >= 0: the same names under
 * "layers.<layer>.", or the unprefixed ones when the file has no "layers."
 * tensor at all. H and E are the layer's hidden size and expert count.
 * Errors name the file and tensor: MOE_ERR_MISSING (hidden or moe_out absent,
 * topk_weights without topk_ids), MOE_ERR_SHAPE, MOE_ERR_DTYPE, MOE_ERR_INPUT
 * (T = 0, an expert id outside [0, E + 64)); on error *d is zeroed and owns
 * nothing. Free with moe_dump_free. */
moe_status moe_dump_load_layer(const char *path, int layer, int H, int E, moe_dump *d, moe_error *err);
/* moe_dump_load_layer(path, -1, ...). */
moe_status moe_dump_load(const char *path, int H, int E, moe_dump *d, moe_error *err);
void moe_dump_free(moe_dump *d);
/* The layers N of a dump that holds "layers.N.hidden", ascending, into
 * layers[cap]; *n = how many (may exceed cap: only cap are written). *n = 0
 * for a dump with unprefixed names only. */
moe_status moe_dump_layers(const char *path, int *layers, int cap, int *n, moe_error *err);
/* Forget some of a loaded dump's optional tensors, to diagnose from less
 * evidence: `names` is a comma-separated list of input_ids, router_logits,
 * topk_ids (drops topk_weights too), topk_weights, routed_out, shared_out.
 * MOE_ERR_ARG names an unknown (or a required) tensor. */
moe_status moe_dump_drop(moe_dump *d, const char *names, moe_error *err);

#define MOE_DIAG_MAX_FINDINGS 24
typedef struct moe_finding {
    moe_diag_stage stage;
    char stage_name[16];   /* "router", "selection", "weights", "output" */
    char cls[32];          /* a verdict name, or "INFO" / "NOISE" */
    moe_confidence conf;
    bool votes;            /* takes part in the verdict (docs/diagnose.md) */
    int64_t tokens;        /* tokens the finding rests on */
    char detail[320];
    char evidence[320];
} moe_finding;

typedef struct moe_stage_report {
    bool checked;          /* the dump held what this stage needs */
    char note[256];        /* what was checked, or why not */
} moe_stage_report;

typedef struct moe_diagnosis {
    moe_verdict verdict;
    moe_confidence confidence;     /* of the finding that decided it */
    char sentence[640];            /* one sentence: what is wrong and where */
    int layer;
    double s;                      /* routed_scaling_factor */
    int64_t tokens, tokens_used;   /* tokens in the dump / fitted by the output stage */
    int64_t selection_mismatch;    /* tokens whose expert set differs (dump ids) */
    int64_t near_tie_flips;        /* of those, within the router's tie tolerance */
    int64_t flips_resolved;        /* without ids: tokens explained by a near-tie alternative set */
    int64_t tokens_unexplained;    /* tokens the fit leaves far above the noise */
    double tie_tolerance;          /* on the biased scores, from the router's precision */
    double fit_a, fit_b;           /* moe_out ~ a * routed_unit + b * shared */
    double residual;               /* ||moe_out - fit|| / ||moe_out|| over the fitted tokens */
    const char *noise;             /* "float32", "bf16", "fp8", "fp4" or NULL (static string) */
    char noise_evidence[256];      /* what the noise class rests on */
    char hypothesis[96];           /* the routing hypothesis the output stage fitted */
    moe_stage_report stages[MOE_STAGE_COUNT];
    int n_findings;
    moe_finding findings[MOE_DIAG_MAX_FINDINGS];
} moe_diagnosis;

/*
 * Recompute the float64 reference of layer L for the dump's tokens, stage by
 * stage, and explain the differences (docs/semantics.md section 2's failure
 * classes; the decision rule is docs/diagnose.md). Each stage whose tensors
 * the dump holds reports findings with a confidence; the verdict is the most
 * specific finding that votes. Without topk_ids the output stage finds, per
 * token, the near-tie expert set that explains moe_out.
 *   L    the layer (from the checkpoint the engine ran)
 *   d    the dump (moe_dump_load_layer), d->H must equal L's hidden size;
 *        hash layers need d->input_ids
 *   out  filled in full (caller-owned; no pointer into it outlives the call
 *        except the static out->noise string)
 * Pure computation, no state kept between calls: concurrent calls are safe.
 * MOE_ERR_SHAPE / MOE_ERR_INPUT for a dump that does not fit L, MOE_ERR_NOMEM. */
moe_status moe_diagnose(const moe_layer *L, const moe_dump *d, moe_diagnosis *out, moe_error *err);
/* The diagnosis as a JSON object (malloc'd string; caller frees), or NULL. */
char *moe_diagnosis_json(const moe_diagnosis *d);
/* Several layers' diagnoses as one JSON object {"layers": [...], "summary": {...}}
 * (malloc'd; caller frees), or NULL. */
char *moe_diagnoses_json(const moe_diagnosis *g, int n, const char *dump_path, const char *model_dir);
/* A self-contained HTML page (no script, no external resource) with the
 * per-layer verdicts, noise classes and fitted (a, b) as a table and an SVG
 * chart, written atomically to path (temp file, fsync, rename). MOE_ERR_IO
 * names the path; the destination is untouched on failure. */
moe_status moe_diagnoses_html(const char *path, const moe_diagnosis *g, int n, const char *dump_path,
                              const char *model_dir, moe_error *err);

/* ---------------------------------------------------------------- audit */

typedef enum moe_grade { MOE_GRADE_PASS, MOE_GRADE_MARGINAL, MOE_GRADE_FAIL } moe_grade;
const char *moe_grade_name(moe_grade g);
/* Grade by output SQNR (from NMSE) and routing-flip fraction, with the one
 * tolerance table of src/audit/tolerances.h. */
moe_grade moe_grade_of(double nmse, double flip_fraction);

/* A block runner with moe_block_run's contract (same arguments after ctx,
 * out sized by moe_block_out_init with the same opts): the extension point
 * through which the audit grades another device (a GPU, say) beside the CPU
 * paths. ctx is the path's runner_ctx. */
typedef moe_status (*moe_block_runner)(void *ctx, const moe_layer *L, const double *hidden, const int64_t *ids,
                                       int64_t T, const moe_run_opts *o, moe_block_out *out, moe_error *err);

/* One precision path of the audit: what differs from the float64 reference
 * on the checkpoint's own (BF16) weights. */
typedef struct moe_audit_path {
    char name[64];
    const char *id;            /* short stable name, "<group>.<what>" ("weights.mxfp4"): for --paths and scripts */
    const char *group;         /* "contract", "isa", "activations", "router", "weights", "combined", "cuda" */
    moe_precision precision;
    moe_act_prec act;
    moe_router_prec router;
    moe_qfmt weights;          /* routed experts, quantized from the checkpoint's weights */
    moe_qfmt shared;           /* shared expert */
    int e2m1_round, mx_scale_rule;
    moe_scale_owner owner;
    bool fuse_shared;
    moe_isa isa;               /* CPU kernels of the path (MOE_ISA_AUTO: the best; the CLI sets its default) */
    moe_block_runner runner;   /* NULL: moe_block_run; else runs the path (on the quantized layer) */
    void *runner_ctx;
    char patches[96];          /* the path as patches of moeaudit_patch.h's table ("" when it
                                  changes no precision): what `moeaudit bisect --patches` takes */
} moe_audit_path;

typedef struct moe_audit_row {
    int layer;
    moe_layer_kind kind;
    moe_audit_path path;
    moe_status status;         /* MOE_OK, or why the path could not run (note says) */
    double max_abs, max_rel;   /* max |path - ref|, and that over max |ref| */
    double nmse;               /* sum (path - ref)^2 / sum ref^2 */
    int64_t flips, tokens;     /* tokens whose expert set differs from float64 */
    moe_grade grade;
    double seconds;            /* wall time of the path's run */
    char note[512];
} moe_audit_row;

/* The default paths (every precision alone, then combined recipes); returns
 * how many were written (at most max). */
int moe_audit_default_paths(moe_audit_path *paths, int max);

/* Progress callback: done of total paths for this layer, the path starting. */
typedef void (*moe_audit_progress)(void *ctx, int done, int total, const char *what);

/* Audit layer L on T tokens (hidden [T, H], ids [T] for hash layers): run the
 * float64 reference, then each path; rows [n] receive one row per path. A
 * path that cannot run (a shape the format cannot hold, an ISA this CPU
 * lacks) gets a status and a note, not an error. Returns an error only when
 * the reference itself fails. */
moe_status moe_audit_layer(const moe_layer *L, const double *hidden, const int64_t *ids, int64_t T,
                           const moe_audit_path *paths, int n, moe_audit_row *rows, moe_audit_progress cb,
                           void *ctx, moe_error *err);

/* Harm order of two rows (qsort-style: < 0 when a is more harmful): a broken
 * contract first, then FAIL, MARGINAL, PASS, then lower SQNR, then more
 * routing flips; rows that could not run (status other than OK and
 * MOE_ERR_INVARIANT) last. Every report sorts by this. */
int moe_audit_harm_cmp(const moe_audit_row *a, const moe_audit_row *b);
/* The grade a row counts as: its grade, FAIL for a broken contract; *ran
 * (may be NULL) = false for a row that could not run (a shape the format
 * cannot hold, an ISA this CPU lacks), which counts in no grade. */
moe_grade moe_audit_row_grade(const moe_audit_row *r, bool *ran);

/* Counts of rows [n] by grade and the most harmful row: what a CI gate and
 * a headline need. */
typedef struct moe_audit_summary {
    int n_grade[3];            /* indexed by moe_grade; broken contracts count as FAIL */
    int n_broken;              /* of the FAILs, rows whose contract check failed */
    int n_not_run;
    const moe_audit_row *worst; /* into rows; NULL when no row ran */
} moe_audit_summary;
void moe_audit_summarize(const moe_audit_row *rows, int n, moe_audit_summary *s);

/* What a report says about the run as a whole. */
typedef struct moe_audit_meta {
    const char *model;         /* directory, or a description of the synthetic model */
    int64_t tokens;
    const char *isa;           /* the kernels of the paths whose isa is AUTO (moe_isa_name), or NULL */
    double seconds;            /* whole audit */
} moe_audit_meta;

/* Reports of rows [n] (any number of layers), sorted by harm within each
 * layer; written to a FILE the caller opened (the library prints nowhere
 * else). HTML is one self-contained page with inline SVG charts. */
moe_status moe_audit_report_text(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n);
moe_status moe_audit_report_json(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n);
moe_status moe_audit_report_html(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n);

#ifdef __cplusplus
}
#endif

#include "moeaudit_hc.h"      /* mHC hyper-connections (docs/semantics.md section 3) */
#include "moeaudit_indexer.h" /* lightning indexer and the needle probe (section 4) */
#include "moeaudit_model.h"   /* the whole DeepSeek-V4 model: attention, indexer, streams, logits */

#endif /* MOEAUDIT_H */
