/*
 * `mpirun -np N moeaudit forward --ep N ...`: the whole-model forward with
 * every layer's routed experts spread over N MPI processes (the library's
 * moe_ep_forward plugged into the forward's MoE call). `forward` itself
 * (tools/cmd_forward.c) runs unchanged on every rank through the hooks of
 * moe_fwd_par: rank 0 reads the input and writes the one output file,
 * byte-identical to the single process's; this file is the MPI glue and the
 * per-rank memory report.
 */
#include "cli.h"
#include "cmd_forward.h"
#include "cmd_mpi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MOE_HAVE_MPI

int moe_cmd_forward_ep(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeaudit forward: --ep needs MPI support, which this build lacks "
                    "(install libopenmpi-dev and openmpi-bin, then rebuild)\n");
    return EXIT_USAGE;
}

#else

#include "cli_mpi.h"
#include "moeaudit_mpi.h"

#include <limits.h>
#include <stdbool.h>
#include <sys/stat.h>

typedef struct fwd_ep {
    const char *placement;   /* --placement FILE or NULL */
    moe_ep_forward *x;       /* after attach */
    int rank, size;
    int first;               /* first block opened */
} fwd_ep;

static moe_status h_agree(void *ctx, moe_status st, moe_error *err) {
    (void)ctx;
    return moe_mpi_agree(MPI_COMM_WORLD, st, err);
}

static moe_status h_bcast(void *ctx, void *buf, size_t n, moe_error *err) {
    (void)ctx;
    if (n > INT_MAX) {
        snprintf(err->msg, sizeof err->msg, "a broadcast of %zu bytes is over the MPI count limit", n);
        return MOE_ERR_UNSUPPORTED;
    }
    if (MPI_Bcast(buf, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS) {
        snprintf(err->msg, sizeof err->msg, "MPI_Bcast of the input failed");
        return MOE_ERR_IO;
    }
    return MOE_OK;
}

/* E of block `layer`, from its router alone. */
static moe_status block_experts(moe_fwd *f, int layer, int *E, moe_error *err) {
    moe_layer *L = NULL;
    moe_status st = moe_model_layer_experts(moe_fwd_model(f), layer, 0, 0, &L, err);
    if (st == MOE_OK) *E = L->cfg.n_experts;
    moe_layer_free(L);
    return st;
}

static moe_status h_attach(void *ctx, moe_fwd *f, moe_fwd_opts *o, int first, moe_error *err) {
    fwd_ep *p = ctx;
    int E = 0;
    moe_status st = moe_mpi_agree(MPI_COMM_WORLD, block_experts(f, first, &E, err), err);
    moe_ep_placement pl = {0, 0, NULL};
    if (st == MOE_OK) st = moe_mpi_agree(MPI_COMM_WORLD, moe_cli_ep_placement(p->placement, E, p->size, p->rank, &pl, err), err);
    if (st == MOE_OK) st = moe_ep_forward_open(f, first, o->last_layer, o->mtp, MPI_COMM_WORLD, &pl, &p->x, err);
    moe_ep_placement_free(&pl);
    if (st == MOE_OK) {
        moe_ep_forward_attach(p->x, o);
        p->first = first;
    }
    return st;
}

static moe_status h_settle(void *ctx, moe_status st, moe_error *err) {
    fwd_ep *p = ctx;
    return moe_ep_forward_settle(p->x, st, err);
}

static void h_release(void *ctx) {
    fwd_ep *p = ctx;
    moe_ep_forward_free(p->x);
    p->x = NULL;
}

/* ------------------------------------------------------- memory report */

/* Bytes of the checkpoint's shard files resident in this process: the Rss
 * of their mappings in /proc/self/smaps (found by inode and file name), or
 * -1 where smaps is unreadable. */
static double resident_bytes(moe_ckpt *ck) {
    FILE *fp = fopen("/proc/self/smaps", "r");
    if (!fp) return -1;
    const size_t n = moe_ckpt_n_shards(ck);
    unsigned long *ino = calloc(n ? n : 1, sizeof *ino);
    if (!ino) {
        fclose(fp);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        char path[8192];
        struct stat sb;
        snprintf(path, sizeof path, "%s/%s", moe_ckpt_dir(ck), moe_ckpt_shard_file(ck, i));
        ino[i] = stat(path, &sb) == 0 ? (unsigned long)sb.st_ino : 0;
    }
    double sum = 0;
    bool ours = false;
    char line[8192];
    while (fgets(line, sizeof line, fp)) {
        unsigned long lo, hi, inode;
        int used = 0;
        /* a mapping: "lo-hi perms offset dev inode   path" */
        if (sscanf(line, "%lx-%lx %*s %*s %*s %lu %n", &lo, &hi, &inode, &used) == 3 && used > 0) {
            char *name = line + used;
            name[strcspn(name, "\n")] = 0;
            const char *base = strrchr(name, '/');
            base = base ? base + 1 : name;
            ours = false;
            for (size_t i = 0; i < n && !ours; i++)
                ours = ino[i] && inode == ino[i] && !strcmp(base, moe_ckpt_shard_file(ck, i));
            continue;
        }
        double kb;
        if (ours && sscanf(line, "Rss: %lf kB", &kb) == 1) sum += kb * 1024.0;
    }
    fclose(fp);
    free(ino);
    return sum;
}

/* Shards of the checkpoint this process has mapped, and their file bytes. */
static void mapped_shards(moe_ckpt *ck, double *count, double *bytes) {
    *count = 0;
    *bytes = 0;
    for (size_t i = 0; i < moe_ckpt_n_shards(ck); i++) {
        if (!moe_ckpt_shard_mapped(ck, i)) continue;
        char path[8192];
        struct stat sb;
        (*count)++;
        snprintf(path, sizeof path, "%s/%s", moe_ckpt_dir(ck), moe_ckpt_shard_file(ck, i));
        if (stat(path, &sb) == 0) *bytes += (double)sb.st_size;
    }
}

/* "0..3" or "0..1,4..5": the experts of block `layer` on `rank` (truncated). */
static void held_ranges(const moe_ep_placement *pl, int rank, char *buf, size_t cap) {
    size_t at = 0;
    buf[0] = 0;
    for (int e = 0; e < pl->n_experts && at + 1 < cap;) {
        if (pl->owner[e] != rank) { e++; continue; }
        int e1 = e;
        while (e1 + 1 < pl->n_experts && pl->owner[e1 + 1] == rank) e1++;
        int w = e1 > e ? snprintf(buf + at, cap - at, "%s%d..%d", at ? "," : "", e, e1)
                       : snprintf(buf + at, cap - at, "%s%d", at ? "," : "", e);
        if (w < 0 || (size_t)w >= cap - at) break;
        at += (size_t)w;
        e = e1 + 1;
    }
    if (!buf[0]) snprintf(buf, cap, "none");
}

enum { R_HELD, R_TOTAL, R_BYTES, R_SHARDS, R_SHARD_BYTES, R_RESIDENT, R_MOE_S, R_SENT, R_TOKENS, R_N };

static void h_report(void *ctx, moe_fwd *f) {
    fwd_ep *p = ctx;
    moe_ep_forward_info info;
    moe_ep_forward_get_info(p->x, &info);
    moe_ckpt *ck = moe_model_ckpt(moe_fwd_model(f));
    double mine[R_N];
    mine[R_HELD] = (double)info.experts_held;
    mine[R_TOTAL] = (double)info.experts_total;
    mine[R_BYTES] = (double)info.routed_bytes;
    mapped_shards(ck, &mine[R_SHARDS], &mine[R_SHARD_BYTES]);
    mine[R_RESIDENT] = resident_bytes(ck);
    mine[R_MOE_S] = info.sum.total_s;
    mine[R_SENT] = (double)info.sum.bytes_sent;
    mine[R_TOKENS] = (double)info.sum.tokens;
    double *all = p->rank == 0 ? calloc((size_t)p->size * R_N, sizeof *all) : NULL;
    MPI_Gather(mine, R_N, MPI_DOUBLE, all, R_N, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (p->rank != 0 || !all) return;
    const moe_ep_layer *l = moe_ep_forward_layer(p->x, p->first);
    const moe_ep_placement *pl = l ? moe_ep_layer_placement(l) : NULL;
    double sent = 0, toks = 0;
    for (int r = 0; r < p->size; r++) {
        sent += all[r * R_N + R_SENT];
        toks += all[r * R_N + R_TOKENS];
    }
    printf("expert parallelism: %d ranks, %d MoE blocks, %s placement; %.0f bytes between ranks per token and "
           "block\n", p->size, info.n_blocks, p->placement ? p->placement : "contiguous",
           toks > 0 ? sent / toks : 0.0);
    printf("rank  experts (block %d)  held of all   routed-expert bytes  shards mapped    shard bytes   resident "
           "from shards   MoE s\n", p->first);
    for (int r = 0; r < p->size; r++) {
        const double *v = all + r * R_N;
        char ranges[64] = "?", res[32];
        if (pl) held_ranges(pl, r, ranges, sizeof ranges);
        if (v[R_RESIDENT] < 0) snprintf(res, sizeof res, "n/a");
        else snprintf(res, sizeof res, "%.0f", v[R_RESIDENT]);
        printf("%4d  %-18s  %5.0f / %-5.0f %19.0f  %6.0f of %-4zu %13.0f  %20s  %6.3f\n", r, ranges, v[R_HELD],
               v[R_TOTAL], v[R_BYTES], v[R_SHARDS], moe_ckpt_n_shards(ck), v[R_SHARD_BYTES], res, v[R_MOE_S]);
    }
    fflush(stdout);
    free(all);
}

/* ----------------------------------------------------------------- run */

int moe_cmd_forward_ep(int argc, char **argv) {
    long ep = 0;
    fwd_ep p = {0};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            moe_fwd_par quiet = {.rank = 0, .size = 1};
            return moe_cmd_forward_par(argc, argv, &quiet); /* prints the help, nothing else */
        }
        if (i + 1 >= argc) continue; /* forward's own parser says what is wrong */
        if (!strcmp(argv[i], "--ep")) {
            if (!moe_cli_parse_int(argv[i + 1], 1, 1 << 20, &ep))
                return moe_cli_usage("forward", "--ep %s: not a rank count", argv[i + 1]);
        } else if (!strcmp(argv[i], "--placement")) {
            p.placement = argv[i + 1];
        }
        if (!strncmp(argv[i], "--", 2)) i++; /* skip the value */
    }
    bool inited = false;
    int rc = moe_cli_mpi_start("forward", ep, &inited, &p.rank, &p.size);
    if (rc != EXIT_OKAY) return moe_cli_mpi_finish(rc, inited);
    if (p.rank != 0) {
        FILE *q = freopen("/dev/null", "w", stdout); /* rank 0 speaks for every rank */
        (void)q;
    }
    moe_fwd_par par = {.rank = p.rank, .size = p.size, .ctx = &p, .agree = h_agree, .bcast = h_bcast,
                       .attach = h_attach, .settle = h_settle, .report = h_report, .release = h_release};
    rc = moe_cmd_forward_par(argc, argv, &par);
    return moe_cli_mpi_finish(rc, inited);
}

#endif /* MOE_HAVE_MPI */
