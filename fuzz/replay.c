/*
 * Replays fuzzer inputs without libFuzzer, so that CTest runs every kept
 * reproducer (fuzz/regress-<target>/) and the seed corpus (fuzz/corpus-
 * <target>/) through the same target code in the normal and the sanitizer
 * builds: `replay-<target> DIR|FILE ...`. A target aborts on a broken
 * property, a sanitizer on undefined behaviour; either fails the test.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int run_file(const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0) { perror(path); return 1; }
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); return 1; }
    size_t n = (size_t)sb.st_size;
    uint8_t *b = malloc(n ? n : 1);
    size_t got = b ? fread(b, 1, n, f) : 0;
    fclose(f);
    if (!b || got != n) { fprintf(stderr, "%s: short read\n", path); free(b); return 1; }
    LLVMFuzzerTestOneInput(b, n);
    free(b);
    return 0;
}

static int cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv) {
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    int files = 0, bad = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0) continue; /* no reproducers kept for this target yet */
        if (!S_ISDIR(sb.st_mode)) { bad += run_file(argv[i]); files++; continue; }
        DIR *d = opendir(argv[i]);
        if (!d) { perror(argv[i]); return 1; }
        char **names = NULL;
        size_t n = 0, cap = 0;
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            if (de->d_name[0] == '.' || strstr(de->d_name, ".md")) continue;
            if (n == cap) names = realloc(names, (cap = cap ? 2 * cap : 64) * sizeof *names);
            names[n] = malloc(strlen(argv[i]) + strlen(de->d_name) + 2);
            sprintf(names[n++], "%s/%s", argv[i], de->d_name);
        }
        closedir(d);
        qsort(names, n, sizeof *names, cmp);
        for (size_t k = 0; k < n; k++) {
            bad += run_file(names[k]);
            files++;
            free(names[k]);
        }
        free(names);
    }
    printf("%d inputs replayed, %d unreadable\n", files, bad);
    return bad ? 1 : 0;
}
