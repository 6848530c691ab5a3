/*
 * `moeaudit forward`: the whole DeepSeek-V4 model on a sequence of tokens,
 * every layer's streams, blocks and index sets, and the logits, streamed
 * into one safetensors file (docs/model.md).
 *
 * Its options are a table (fwd_opts) read by the CLI's one parser; the
 * layer range and chunk list are parsed here. `--ep N` (under mpirun) runs
 * the same body, moe_forward_run, on every rank with the parallel driver of
 * tools/cmd_ep.c plugged in through moe_cli_fwd_par: this file knows nothing
 * of MPI.
 */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef moe_cli_fwd_args fwd_args;

static int parse_layers(const char *s, fwd_args *a) {
    long x, y;
    char buf[64];
    snprintf(buf, sizeof buf, "%s", s);
    char *dots = strstr(buf, "..");
    if (!dots) {
        if (!moe_cli_parse_int(buf, 0, 1000000, &x)) return -1;
        a->first = a->last = (int)x;
        return 0;
    }
    *dots = 0;
    if (!moe_cli_parse_int(buf, 0, 1000000, &x)) return -1;
    a->first = (int)x;
    if (!dots[2]) {
        a->open_end = true;
        return 0;
    }
    if (!moe_cli_parse_int(dots + 2, 0, 1000000, &y) || y < x) return -1;
    a->last = (int)y;
    return 0;
}

static int parse_chunks(const char *s, fwd_args *a) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    a->n_chunks = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        long v;
        if (a->n_chunks == 64 || !moe_cli_parse_int(tok, 1, 1L << 30, &v)) return -1;
        a->chunks[a->n_chunks++] = v;
    }
    return a->n_chunks ? 0 : -1;
}

typedef fwd_args A;

#define M_EP (1u << MOE_FWD_EP)

static const moe_opt fwd_opts[] = {
    MOE_OPT_MODEL(A, "checkpoint directory (config.json in transformers' or DeepSeek's schema, safetensors\n"
                     "in either naming, BF16 / FP8 128x128 / MXFP4 / NVFP4, sharded or not), or a bundled\n"
                     "checkpoint's name; default: dsv4-tiny"),
    MOE_OPT_INPUT(A, "safetensors with input_ids [T] (I32 or I64). With --layers A..B and A > 0 it may hold\n"
                     "layers.A.in [T, hc_mult, H] (the streams entering layer A, e.g. from another engine):\n"
                     "the run then starts at layer A. Default: --tokens T (40) tokens drawn from a fixed seed"),
    MOE_OPT_OUTPUT(A, "write, F64 with --precision ref and F32 with f32 (written atomically; '-': the bytes\n"
                      "to stdout):\n"
                      "  layers.{i}.{in,out}       [T, hc_mult, H] streams into / out of layer i\n"
                      "  layers.{i}.attn.{in,out}  [T, H] attention block's normed input, output\n"
                      "  layers.{i}.ffn.{in,out}   [T, H] MoE block's normed input, output\n"
                      "  layers.{i}.index_topk     [T, index_topk] I32: CSA entries kept, -1 none\n"
                      "  logits                    [T, vocab] if the range ends at the last layer"),
    MOE_OPT_PRECISION(A, "ref: float64 (default); f32: float32 arithmetic throughout"),
    MOE_OPT_LAYERS(A, "A..B: write layers A..B (also A, or A..); the run computes 0..B (or starts at A from\n"
                      "IN's layers.A.in); logits only when B is the last layer. Default: all.\n"
                      "mtp: run the whole model, then MTP block 0 (DeepSeek's MTPBlock: position t mixes the\n"
                      "last layer's streams at t with the embedding of token t+1) and write mtp.0.in,\n"
                      ".attn.in, .attn.out, [.index_topk,] .ffn.in, .ffn.out, .out and mtp.0.logits, each\n"
                      "[T - 1, ...] (row t predicts token t + 2)"),
    {"chunks", "N1,N2,..", MOE_OPT_STR, offsetof(A, chunks_s), 0, 0, NULL, 0,
     "feed the sequence in chunks (prefill N1, then N2, ...; the last size repeats until T is\n"
     "reached), carrying the caches as a serving engine does. In float64 any chunking gives the\n"
     "one-shot outputs", NULL},
    {"tokens", "T", MOE_OPT_INT, offsetof(A, tokens), 1, 1L << 24, NULL, 0, "tokens of the built-in input (default 40)", NULL},
    {"replay-index", "FILE", MOE_OPT_STR, offsetof(A, replay), 0, 0, NULL, 0,
     "use the index sets layers.{i}.index_topk [T, index_topk] of FILE on CSA layers instead of\n"
     "the indexer's own (another engine's, or an oracle's where scores tie); each must be -1 or\n"
     "an entry visible to its row, none twice in a row, on a CSA layer: every tensor is checked\n"
     "before the run starts", NULL},
    {"ep", "N", MOE_OPT_INT, offsetof(A, ep), 1, 1 << 20, NULL, M_EP,
     "expert parallelism over N MPI ranks: mpirun -np N moeaudit forward --ep N ...; every\n"
     "layer's routed experts split over the ranks, each mapping only its own experts' tensors;\n"
     "every rank runs the dense parts (attention, mHC, norms, head), rank 0 reads IN and writes\n"
     "OUT: the same bytes as one process. The model directory (and --replay-index FILE) must be\n"
     "readable on every rank. Prints each rank's experts, mapped shards and resident bytes", NULL},
    {"placement", "FILE", MOE_OPT_STR, offsetof(A, placement), 0, 0, NULL, M_EP,
     "expert-to-rank map of every layer: \"EXPERT RANK\" lines or a JSON array (default:\n"
     "contiguous ranges)", NULL},
    {"threads", "N", MOE_OPT_INT, offsetof(A, c.threads), 1, 4096, NULL, 0,
     "OpenMP threads (default: OMP_NUM_THREADS, else all cores); with --ep, per rank (ranks\n"
     "sharing a machine should share its cores)", NULL},
    {"isa", "I", MOE_OPT_STR, offsetof(A, c.isa), 0, 0, NULL, 0,
     "CPU kernel table of every linear, attention product and MoE block: ref, avx2 or avx512\n"
     "(default: the best this CPU has, or MOE_ISA). float64 outputs have the same bits on\n"
     "each; float32 outputs are the table's", NULL},
    MOE_OPT_QUIET(A, "no per-layer table on stdout"),
};

static const char *const fwd_modes[] = {"one process", "--ep N", NULL};

static int fwd_main(int argc, char **argv);

const moe_cli_cmd moe_cli_forward = {
    "forward",
    "the whole DeepSeek-V4 model on a token sequence: every layer's streams, blocks, logits (--ep N)",
    "moeaudit forward [--model DIR] [--input IN] [--output OUT] [--precision ref|f32]\n"
    "                 [--layers A..B|mtp] [--chunks N1,N2,...] [--tokens T] [--replay-index FILE]\n"
    "                 [--threads N] [--isa I] [--quiet]\n"
    "mpirun -np N moeaudit forward --ep N [--placement FILE] [the options above]",
    "Run the whole DeepSeek-V4 model (embedding, every layer's mHC streams, attention - sliding window,\n"
    "CSA with the lightning indexer, HCA - and MoE block, the hc head, norm and LM head) on the tokens of\n"
    "IN, exactly (float64) or in float32 (docs/model.md). Prints one line per layer: attention type,\n"
    "entries read per query, output RMS.",
    fwd_opts,
    (int)(sizeof fwd_opts / sizeof fwd_opts[0]),
    fwd_modes,
    "Exit status: 0 success, 1 failure, 2 usage or input error (the message names file, tensor, value).",
    fwd_main,
};

/* Returns -1 to go on, else the exit code. */
static int parse_args(int argc, char **argv, fwd_args *a) {
    memset(a, 0, sizeof *a);
    a->c = moe_cli_common_default();
    a->precision = MOE_PREC_REF;
    a->first = a->last = -1;
    a->tokens = 40;
    bool seen[MOE_CLI_MAX_OPTS] = {false};
    int rc = moe_cli_parse(&moe_cli_forward, argc, argv, a, seen);
    if (rc >= 0) return rc;
    if ((rc = moe_cli_check_modes(&moe_cli_forward, seen, a->ep > 0 ? MOE_FWD_EP : MOE_FWD_ONE)) >= 0) return rc;
    a->input = a->c.input;
    a->output = a->c.output;
    a->threads = a->c.threads;
    if (a->c.precision) {
        const moe_cli_prec *p = moe_cli_prec_find(a->c.precision, MOE_PU_BLOCK);
        if (!p) return moe_cli_prec_bad("forward", "precision", a->c.precision, MOE_PU_BLOCK);
        a->precision = !strcmp(p->name, "ref") ? MOE_PREC_REF : MOE_PREC_F32;
    }
    const char *v = a->c.layers;
    if (v && !strcmp(v, "mtp")) a->mtp = true;
    else if (v && parse_layers(v, a)) return moe_cli_usage("forward", "--layers %s: expected A..B, A.., A or mtp (layer indices)", v);
    if (a->chunks_s && parse_chunks(a->chunks_s, a))
        return moe_cli_usage("forward", "--chunks %s: expected positive token counts N1,N2,...", a->chunks_s);
    return -1;
}

/* ------------------------------------------------------------ the sink */

#define FWD_WHATS 8

typedef struct fwd_out {
    const moe_fwd_config *cfg;
    int64_t T;
    bool f32;
    moe_st_stream *st;                 /* NULL without --output */
    int *slot;                         /* [(n_layers + 1) * FWD_WHATS]: entry index or -1 (row n_layers: logits) */
    moe_st_entry *entries;
    char (*names)[64];
    int n_entries;
    void *buf;                         /* conversion buffer */
    size_t buf_cap;
    /* summary, per layer */
    double *ss_attn, *ss_ffn, *ss_out; /* sums of squares */
    int64_t *rows, *kept, *visible, *window;
} fwd_out;

/* Slot rows: layers 0..n-1, n: the main logits and the MTP block's tensors, n + 1: the MTP logits. */
static int slot_of(const fwd_out *o, int layer, moe_fwd_what w) {
    const int nl = o->cfg->n_layers;
    int l = layer < 0 ? nl : (layer == nl && w == MOE_FWD_LOGITS) ? nl + 1 : layer;
    return o->slot[l * FWD_WHATS + (int)w];
}

static moe_status sink(void *ctx, const moe_fwd_tensor *t, moe_error *err) {
    fwd_out *o = ctx;
    if ((int)t->what >= FWD_WHATS) return MOE_OK; /* probe rows: none asked for here */
    const int l = t->layer;
    const int64_t n = t->rows * t->row_elems;
    if (l >= 0) {
        double *acc = t->what == MOE_FWD_ATTN_OUT ? o->ss_attn : t->what == MOE_FWD_FFN_OUT ? o->ss_ffn
                      : t->what == MOE_FWD_OUT   ? o->ss_out : NULL;
        for (int64_t i = 0; acc && i < n; i++) acc[l] += t->data[i] * t->data[i];
        if (t->what == MOE_FWD_OUT) o->rows[l] += t->rows;
        if (t->what == MOE_FWD_INDEX_TOPK)
            for (int64_t i = 0; i < n; i++) o->kept[l] += t->idata[i] >= 0;
        if (t->what == MOE_FWD_ATTN_OUT) {
            const int r = o->cfg->ratio[l], win = o->cfg->window;
            for (int64_t p = t->row0; p < t->row0 + t->rows; p++) {
                o->window[l] += p + 1 < win ? p + 1 : win;
                if (r) o->visible[l] += (p + 1) / r;
            }
            if (o->cfg->attn[l] == MOE_ATTN_HCA) o->kept[l] = o->visible[l];
        }
    }
    if (!o->st) return MOE_OK;
    int s = slot_of(o, l, t->what);
    if (s < 0) return MOE_OK;
    size_t esz = t->idata ? 4 : o->f32 ? 4 : 8;
    size_t nb = (size_t)n * esz;
    const void *src = t->idata ? (const void *)t->idata : (const void *)t->data;
    if (!t->idata && o->f32) {
        if (nb > o->buf_cap) {
            void *b = realloc(o->buf, nb);
            if (!b) {
                if (err) snprintf(err->msg, sizeof err->msg, "out of memory converting %s", o->names[s]);
                return MOE_ERR_NOMEM;
            }
            o->buf = b;
            o->buf_cap = nb;
        }
        for (int64_t i = 0; i < n; i++) ((float *)o->buf)[i] = (float)t->data[i];
        src = o->buf;
    }
    return moe_st_stream_put(o->st, (size_t)s, (uint64_t)t->row0 * (uint64_t)t->row_elems * esz, src, nb, err);
}

static moe_status out_init(fwd_out *o, const moe_fwd_config *c, int64_t T, bool f32, int first, int last, bool logits,
                           bool mtp, moe_error *err) {
    memset(o, 0, sizeof *o);
    o->cfg = c;
    o->T = T;
    o->f32 = f32;
    const int nl = c->n_layers;
    o->slot = malloc(sizeof(int) * (size_t)(nl + 2) * FWD_WHATS);
    int cap = (last - first + 2) * 7 + 2;
    o->entries = calloc((size_t)cap, sizeof *o->entries);
    o->names = calloc((size_t)cap, sizeof *o->names);
    o->ss_attn = calloc((size_t)nl + 1, sizeof(double));
    o->ss_ffn = calloc((size_t)nl + 1, sizeof(double));
    o->ss_out = calloc((size_t)nl + 1, sizeof(double));
    o->rows = calloc((size_t)nl + 1, sizeof(int64_t));
    o->kept = calloc((size_t)nl + 1, sizeof(int64_t));
    o->visible = calloc((size_t)nl + 1, sizeof(int64_t));
    o->window = calloc((size_t)nl + 1, sizeof(int64_t));
    if (!o->slot || !o->entries || !o->names || !o->ss_attn || !o->ss_ffn || !o->ss_out || !o->rows || !o->kept ||
        !o->visible || !o->window) {
        snprintf(err->msg, sizeof err->msg, "out of memory for the output of %lld tokens", (long long)T);
        return MOE_ERR_NOMEM;
    }
    for (int i = 0; i < (nl + 2) * FWD_WHATS; i++) o->slot[i] = -1;
    static const moe_fwd_what order[] = {MOE_FWD_IN, MOE_FWD_ATTN_IN, MOE_FWD_ATTN_OUT, MOE_FWD_INDEX_TOPK,
                                         MOE_FWD_FFN_IN, MOE_FWD_FFN_OUT, MOE_FWD_OUT};
    const moe_dtype fd = f32 ? MOE_DTYPE_F32 : MOE_DTYPE_F64;
    /* the MTP block's tensors (layer n_layers) have one row less: the last position has no next token */
    const int l0 = mtp ? nl : first, l1 = mtp ? nl : last;
    const int64_t rows = mtp ? T - 1 : T;
    for (int l = l0; l <= l1; l++)
        for (int k = 0; k < 7; k++) {
            moe_fwd_what w = order[k];
            if (w == MOE_FWD_INDEX_TOPK && c->attn[l] != MOE_ATTN_CSA) continue;
            moe_st_entry *e = &o->entries[o->n_entries];
            if (l == nl) snprintf(o->names[o->n_entries], sizeof o->names[0], "mtp.0.%s", moe_fwd_what_name(w));
            else snprintf(o->names[o->n_entries], sizeof o->names[0], "layers.%d.%s", l, moe_fwd_what_name(w));
            e->name = o->names[o->n_entries];
            e->shape[0] = rows;
            if (w == MOE_FWD_IN || w == MOE_FWD_OUT) {
                e->ndim = 3;
                e->shape[1] = c->hc_mult;
                e->shape[2] = c->hidden;
                e->dtype = fd;
            } else if (w == MOE_FWD_INDEX_TOPK) {
                e->ndim = 2;
                e->shape[1] = c->index_topk;
                e->dtype = MOE_DTYPE_I32;
            } else {
                e->ndim = 2;
                e->shape[1] = c->hidden;
                e->dtype = fd;
            }
            o->slot[l * FWD_WHATS + (int)w] = o->n_entries++;
        }
    if (logits || mtp) {
        moe_st_entry *e = &o->entries[o->n_entries];
        snprintf(o->names[o->n_entries], sizeof o->names[0], mtp ? "mtp.0.logits" : "logits");
        e->name = o->names[o->n_entries];
        e->ndim = 2;
        e->shape[0] = rows;
        e->shape[1] = c->vocab;
        e->dtype = fd;
        o->slot[(mtp ? nl + 1 : nl) * FWD_WHATS + (int)MOE_FWD_LOGITS] = o->n_entries++;
    }
    return MOE_OK;
}

static void out_free(fwd_out *o) {
    moe_st_stream_abort(o->st);
    free(o->slot);
    free(o->entries);
    free(o->names);
    free(o->buf);
    free(o->ss_attn);
    free(o->ss_ffn);
    free(o->ss_out);
    free(o->rows);
    free(o->kept);
    free(o->visible);
    free(o->window);
    memset(o, 0, sizeof *o);
}

/* ------------------------------------------------------------- inputs */

typedef struct fwd_in {
    int64_t T;
    int64_t *ids;
    double *streams;   /* [T, hc_mult, H] or NULL */
} fwd_in;

/* Rank 0: the input file through the library's reader (moe_fwd_input_read). */
static int read_ids(const char *path, const moe_fwd_config *c, int first, fwd_in *in) {
    moe_error err;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    moe_fwd_input fi;
    st = moe_fwd_input_read(f, c, first, &fi, &err);
    moe_st_close(f);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    in->T = fi.T;
    in->ids = fi.ids;
    in->streams = fi.streams;
    return EXIT_OKAY;
}

/* ---------------------------------------------------------------- run */

/* The bytes of the file at path to stdout. */
static bool copy_to_stdout(const char *path) {
    FILE *f = fopen(path, "rb");
    char buf[1 << 16];
    size_t got;
    bool ok = f != NULL;
    while (ok && (got = fread(buf, 1, sizeof buf, f)) > 0) ok = fwrite(buf, 1, got, stdout) == got;
    if (f) fclose(f);
    ok = fflush(stdout) == 0 && ok;
    if (!ok) fprintf(stderr, "moeaudit forward: stdout: writing the safetensors bytes failed\n");
    return ok;
}

/* ------------------------------------------------- one or several ranks */

/* Rank 0 (or the single process) reads, prints and writes. */
static bool is_root(const moe_cli_fwd_par *p) { return !p || p->rank == 0; }

/* One process: st itself; several: the ranks' statuses agreed. */
static moe_status agree(const moe_cli_fwd_par *p, moe_status st, moe_error *err) {
    return p ? p->agree(p->ctx, st, err) : st;
}

/* Print a failure (rank 0 only: the agreed message is every rank's) and return its exit code. */
static int fail(const moe_cli_fwd_par *p, moe_status st, const moe_error *err) {
    return is_root(p) ? moe_cli_fail(st, err) : moe_cli_exit_code(st);
}

/* Bytes in slices under the MPI count limit. */
static moe_status bcast(const moe_cli_fwd_par *p, void *buf, size_t n, moe_error *err) {
    for (size_t at = 0; at < n; at += (size_t)1 << 30) {
        size_t k = n - at < (size_t)1 << 30 ? n - at : (size_t)1 << 30;
        moe_status st = p->bcast(p->ctx, (char *)buf + at, k, err);
        if (st != MOE_OK) return st;
    }
    return MOE_OK;
}

/* Rank 0 read the input (rc, its messages printed); every rank gets it. */
static int share_input(const moe_cli_fwd_par *p, const moe_fwd_config *c, int rc, fwd_in *in) {
    if (!p) return rc;
    moe_error err = {""};
    int64_t hdr[3] = {rc, in->T, in->streams != NULL};
    moe_status st = p->bcast(p->ctx, hdr, sizeof hdr, &err);
    if (st != MOE_OK) return fail(p, st, &err);
    if (hdr[0] != EXIT_OKAY) return (int)hdr[0];
    const size_t ns = (size_t)hdr[1] * (size_t)c->hc_mult * (size_t)c->hidden;
    if (p->rank) {
        in->T = hdr[1];
        in->ids = malloc((size_t)in->T * sizeof *in->ids);
        in->streams = hdr[2] ? malloc(ns * sizeof(double)) : NULL;
        if (!in->ids || (hdr[2] && !in->streams)) {
            snprintf(err.msg, sizeof err.msg, "out of memory for the input of %lld tokens", (long long)in->T);
            st = MOE_ERR_NOMEM;
        }
    }
    st = agree(p, st, &err);
    if (st == MOE_OK) st = bcast(p, in->ids, (size_t)in->T * sizeof *in->ids, &err);
    if (st == MOE_OK && hdr[2]) st = bcast(p, in->streams, ns * sizeof(double), &err);
    return st == MOE_OK ? EXIT_OKAY : fail(p, st, &err);
}

int moe_forward_run(const moe_cli_fwd_args *ap, const moe_cli_fwd_par *par) {
    const fwd_args a = *ap;
    int rc;
    FILE *text = is_root(par) ? moe_cli_text(a.c.quiet, a.output && !strcmp(a.output, "-")) : NULL;
    char out_tmp[4096] = "";
    moe_error err = {""};
    moe_fwd *f = NULL;
    moe_status st = agree(par, moe_fwd_open(a.model, &f, &err), &err);
    if (st != MOE_OK) {
        moe_fwd_free(f);
        return fail(par, st, &err);
    }
    const moe_fwd_config *c = moe_fwd_get_config(f);
    moe_fwd_opts o = moe_fwd_opts_default(f);
    o.precision = a.precision;
    o.isa = a.isa;
    if (a.mtp) {
        o.mtp = true;
        o.logits = false;
        o.first_layer = o.last_layer = c->n_layers - 1;
    } else if (a.first >= 0) {
        o.first_layer = a.first;
        o.last_layer = a.open_end || a.last < 0 ? c->n_layers - 1 : a.last;
        if (o.first_layer >= c->n_layers || o.last_layer >= c->n_layers) {
            if (is_root(par))
                fprintf(stderr, "moeaudit: --layers: layers %d..%d are out of range: %s has %d layers (0..%d)\n",
                        o.first_layer, o.last_layer, a.model, c->n_layers, c->n_layers - 1);
            moe_fwd_free(f);
            return EXIT_USAGE;
        }
        o.logits = o.last_layer == c->n_layers - 1;
    }
    fwd_in in = {0};
    moe_st_file *rp_file = NULL;
    moe_fwd_replay rp = {0};
    fwd_out out = {0};
    moe_fwd_state *s = NULL;
    bool attached = false;
    const char *in_name = a.input ? a.input : "(built-in input)";
    /* rank 0 reads the input (every rank of a parallel run gets it) */
    rc = EXIT_OKAY;
    if (is_root(par) && a.input) {
        rc = read_ids(a.input, c, o.first_layer, &in);
    } else if (is_root(par)) {
        in.T = a.tokens;
        in.ids = malloc((size_t)in.T * sizeof *in.ids);
        if (!in.ids) {
            fprintf(stderr, "moeaudit: out of memory\n");
            rc = EXIT_FAIL;
        } else {
            uint64_t seed = MOE_CLI_SEED;
            for (int64_t t = 0; t < in.T; t++) in.ids[t] = (int64_t)(moe_cli_mix(&seed) % (uint64_t)c->vocab);
        }
    }
    rc = share_input(par, c, rc, &in);
    if (rc != EXIT_OKAY) goto done;
    if (a.replay) {
        /* every pick is checked before anything runs (moe_fwd_replay_init) */
        st = moe_st_open(a.replay, &rp_file, &err);
        if (st == MOE_OK) st = moe_fwd_replay_init(rp_file, c, in.T, &rp, &err);
        st = agree(par, st, &err);
        if (st != MOE_OK) { rc = fail(par, st, &err); goto done; }
        o.index = moe_fwd_replay_pick;
        o.index_ctx = &rp;
    }
    if (a.mtp && in.T < 2) {
        if (is_root(par))
            fprintf(stderr, "moeaudit: %s: --layers mtp needs at least 2 tokens (position t reads token t + 1)\n",
                    in_name);
        rc = EXIT_USAGE;
        goto done;
    }
    if (par) {
        /* the experts' shares, before any output exists: a rank that cannot map its experts leaves no file */
        st = par->attach(par->ctx, f, &o, in.streams ? o.first_layer : 0, &err);
        attached = true;
        if (st != MOE_OK) { rc = fail(par, st, &err); goto done; }
    }
    st = agree(par, out_init(&out, c, in.T, a.precision == MOE_PREC_F32, o.first_layer, o.last_layer, o.logits, a.mtp,
                             &err), &err);
    if (st != MOE_OK) { rc = fail(par, st, &err); goto done; }
    st = MOE_OK;
    if (a.output && is_root(par)) {
        static const char *const meta[] = {"producer", "moeaudit " MOEAUDIT_VERSION " forward", NULL};
        const char *opath = a.output;
        if (!strcmp(opath, "-")) { /* the whole file first, then its bytes to stdout */
            if (!moe_cli_private_tmp(out_tmp, sizeof out_tmp, "forward.safetensors")) { /* it said why */
                snprintf(err.msg, sizeof err.msg, "no private temporary directory for the bytes to stdout");
                st = MOE_ERR_IO;
            }
            opath = out_tmp;
        }
        if (st == MOE_OK) st = moe_st_stream_open(opath, out.entries, (size_t)out.n_entries, meta, &out.st, &err);
    }
    st = agree(par, st, &err);
    if (st != MOE_OK) { rc = fail(par, st, &err); goto done; }
    o.sink = sink;
    o.sink_ctx = &out;
    st = agree(par, moe_fwd_state_init(f, &o, &s, &err), &err);
    if (st != MOE_OK) { rc = fail(par, st, &err); goto done; }
    if (text) {
        fprintf(text, "model %s: %d layers, hidden %d, %d heads x %d (rope %d), window %d, vocab %d; %lld tokens%s, "
                "precision %s", a.model, c->n_layers, c->hidden, c->heads, c->head_dim, c->rope_dim, c->window,
                c->vocab, (long long)in.T, in.streams ? " (streams given)" : "",
                a.precision == MOE_PREC_REF ? "ref (float64)" : "f32");
        if (par) fprintf(text, "; experts over %d ranks", par->size);
        fprintf(text, "\n");
    }
    int64_t at = 0;
    int k = 0, n_runs = 0;
    while (at < in.T) {
        int64_t n = a.n_chunks ? a.chunks[k < a.n_chunks ? k : a.n_chunks - 1] : in.T;
        if (n > in.T - at) n = in.T - at;
        const double *sp = in.streams ? in.streams + (size_t)at * c->hc_mult * c->hidden : NULL;
        st = moe_fwd_run(f, s, in.ids + at, n, sp, &err);
        if (par) st = par->settle(par->ctx, st, &err);
        if (st == MOE_ERR_INPUT) {
            if (is_root(par)) fprintf(stderr, "moeaudit: %s: %s\n", in_name, err.msg);
            rc = moe_cli_exit_code(st);
            goto done;
        }
        if (st != MOE_OK) { rc = fail(par, st, &err); goto done; }
        at += n;
        k++;
        n_runs++;
    }
    if (n_runs > 1 && text) fprintf(text, "in %d chunks\n", n_runs);
    if (text) fprintf(text, "entries read per query (means): window rows, compressed entries kept of those visible\n");
    if (text) fprintf(text, "layer  attention  window  kept / visible   RMS: attn.out   ffn.out       out\n");
    for (int l = a.mtp ? c->n_layers : o.first_layer; text && l <= (a.mtp ? c->n_layers : o.last_layer); l++) {
        const double T = (double)(l == c->n_layers ? in.T - 1 : in.T), H = (double)c->hidden;
        char kind[32];
        if (c->attn[l] == MOE_ATTN_SLIDING) snprintf(kind, sizeof kind, "sliding");
        else snprintf(kind, sizeof kind, "%s/%d", moe_attn_type_name(c->attn[l]), c->ratio[l]);
        char lname[16];
        if (l == c->n_layers) snprintf(lname, sizeof lname, "mtp.0");
        else snprintf(lname, sizeof lname, "%d", l);
        fprintf(text, "%5s  %-9s  %6.1f  %6.1f / %-6.1f  %13.5g %9.5g %9.5g\n", lname, kind,
                (double)out.window[l] / T, (double)out.kept[l] / T, (double)out.visible[l] / T,
                sqrt(out.ss_attn[l] / (T * H)), sqrt(out.ss_ffn[l] / (T * H)),
                sqrt(out.ss_out[l] / (T * H * c->hc_mult)));
    }
    /* rank 0 finishes the file; every rank hears whether it could */
    st = MOE_OK;
    if (out.st) {
        moe_st_stream *w = out.st;
        out.st = NULL;
        st = moe_st_stream_finish(w, &err);
        if (st == MOE_OK && out_tmp[0] && !copy_to_stdout(out_tmp)) {
            snprintf(err.msg, sizeof err.msg, "stdout: writing the safetensors bytes failed");
            st = MOE_ERR_IO;
        }
    }
    st = agree(par, st, &err);
    if (st != MOE_OK) { rc = is_root(par) ? moe_cli_fail_out(st, &err) : EXIT_FAIL; goto done; } /* exit 1: the output */
    if (text && a.output && !out_tmp[0]) fprintf(text, "wrote %d tensors to %s\n", out.n_entries, a.output);
    if (par) par->report(par->ctx, f, text);
    rc = EXIT_OKAY;
done:
    moe_fwd_state_free(s);
    out_free(&out);
    moe_cli_private_tmp_done(out_tmp);
    moe_st_close(rp_file);
    free(in.ids);
    free(in.streams);
    if (attached) par->release(par->ctx);
    moe_fwd_free(f);
    return rc;
}

static int fwd_main(int argc, char **argv) {
    fwd_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc >= 0) return rc;
    if ((rc = moe_cli_apply_common("forward", &a.c, &a.isa)) >= 0) return rc;
    char model_path[4096];
    if (!(a.model = moe_cli_model_path(a.c.model, model_path, sizeof model_path))) return EXIT_USAGE;
    {
        const char *outs[1] = {a.output}, *ins[2] = {a.input, a.replay};
        if ((rc = moe_cli_check_outputs("forward", outs, 1, ins, 2, a.model)) >= 0) return rc;
    }
    if (a.ep > 0) return moe_forward_ep(&a, moe_forward_run);
    return moe_forward_run(&a, NULL);
}
