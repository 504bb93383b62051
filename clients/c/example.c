/* example.c: the C client in a few lines. Upserts 100 records of pseudo-random vectors (ids
 * 0..99, a JSON payload each) into a namespace, then prints the top 5 of record 7's vector.
 *
 *     kalos serve --name demo --dim 64 --ephemeral &
 *     ./build/example demo            # NAME [NAMESPACE]
 *
 * Prints "metric dot dim 64", then one "id score" line per hit, best first.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kalos.h"

#define ROWS 100
#define K 5

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s NAME [NAMESPACE]\n", argv[0]);
        return 2;
    }
    const char *ns = argc > 2 ? argv[2] : "c-example";
    int err;
    kalos_client *c = kalos_open(argv[1], (uid_t)-1, &err); /* the sidecar runs as this user */
    if (!c) {
        fprintf(stderr, "open: %s: %s\n", kalos_strerror(err), kalos_last_detail());
        return 1;
    }
    size_t dim = kalos_dim(c); /* the sidecar's --dim */
    float *vectors = malloc(ROWS * dim * sizeof *vectors);
    int64_t ids[ROWS];
    char text[ROWS][32];
    const char *payloads[ROWS];
    uint32_t x = 12345; /* a small xorshift generator: the same rows on every run */
    for (size_t i = 0; i < ROWS * dim; i++) {
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        vectors[i] = (float)x / 4294967296.0f - 0.5f;
    }
    for (int i = 0; i < ROWS; i++) {
        ids[i] = i;
        snprintf(text[i], sizeof text[i], "{\"row\": %d}", i);
        payloads[i] = text[i];
    }
    uint64_t written;
    err = kalos_upsert(c, ns, ids, vectors, ROWS, dim, payloads, 5000, &written);
    if (err) {
        fprintf(stderr, "upsert: %s: %s (%llu written)\n", kalos_strerror(err), kalos_last_detail(),
                (unsigned long long)written);
        return 1;
    }
    int64_t hit_ids[K];
    float scores[K];
    size_t n;
    err = kalos_recall(c, ns, vectors + 7 * dim, dim, K, 1000, hit_ids, scores, &n);
    if (err) {
        fprintf(stderr, "recall: %s: %s\n", kalos_strerror(err), kalos_last_detail());
        return 1;
    }
    printf("metric %s dim %zu\n", kalos_metric(c), dim);
    for (size_t i = 0; i < n; i++) printf("%lld %.9g\n", (long long)hit_ids[i], scores[i]);
    free(vectors);
    kalos_close(c);
    return 0;
}
