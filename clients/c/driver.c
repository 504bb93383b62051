/* driver.c: the library driven by line commands on stdin, one answer per command on stdout; what
 * tests/ipc/test_c_client.py runs (and a way to poke a sidecar by hand). Floats may be written in
 * any form strtof reads; scores are printed in hexadecimal (%a), exactly.
 *
 *   open NAME UID SLOTS CONNECT_MS SPIN_US   UID -1: this process's; answers "ok DIM MAX_K MAX_Q METRIC SLOTS"
 *   recall NS K TIMEOUT_MS DIM V...          "ok N ID SCORE ..." (N hits)
 *   recall_many NS K TIMEOUT_MS NQ DIM V...  "ok N NQ", then NQ lines "ID SCORE ..."
 *   upsert NS TIMEOUT_MS N DIM ID... V... [PAYLOAD...]   PAYLOAD: hex of the JSON, or - for none;
 *                                            "ok WRITTEN"
 *   delete NS TIMEOUT_MS N ID...             "ok DELETED"
 *   embed TIMEOUT_MS N TEXT...               TEXT: hex of the UTF-8, - for ""; "ok N DIM V..." (N x DIM, %a)
 *   parallel NS K TIMEOUT_MS THREADS NQ DIM V...   NQ recalls from THREADS threads on the one client
 *                                            (query j on thread j % THREADS): "ok NQ", then per query
 *                                            "N ID SCORE ..." or "err NAME"
 *   forked NS K DIM V...                     a recall from a forked child: "NAME DETAIL" of what it gets
 *   status CODE                              the kalos_error name kalos_error_of_status gives
 *   hold                                     "holding", then waits for a signal (the kill test)
 *   close                                    "ok"
 * A failed command answers "err NAME DONE DETAIL" (NAME: KALOS_E_..., DONE: rows a write applied).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kalos.h"

static const char *error_name(int err) {
    static const char *names[] = {
        "KALOS_OK",           "KALOS_E_INVALID",           "KALOS_E_UNAVAILABLE",     "KALOS_E_UNTRUSTED",
        "KALOS_E_PROTOCOL",   "KALOS_E_TIMEOUT",           "KALOS_E_UNKNOWN_NAMESPACE", "KALOS_E_PAYLOAD_TOO_LARGE",
        "KALOS_E_SLOTS_EXHAUSTED", "KALOS_E_SERVER",       "KALOS_E_SYSTEM",
    };
    return err >= 0 && err < (int)(sizeof names / sizeof *names) ? names[err] : "UNKNOWN";
}

static char *save;
static char *next_word(void) { return strtok_r(NULL, " \t\n", &save); }

static int next_long(long long *out) {
    char *w = next_word(), *end;
    if (!w) return 0;
    errno = 0;
    *out = strtoll(w, &end, 10);
    return errno == 0 && *end == 0;
}

static int next_floats(float *out, size_t n) {
    for (size_t i = 0; i < n; i++) {
        char *w = next_word(), *end;
        if (!w) return 0;
        out[i] = strtof(w, &end);
        if (*end) return 0;
    }
    return 1;
}

static int next_ids(int64_t *out, size_t n) {
    for (size_t i = 0; i < n; i++) {
        long long v;
        if (!next_long(&v)) return 0;
        out[i] = v;
    }
    return 1;
}

static char *unhex(const char *h) {
    size_t n = strlen(h) / 2;
    char *s = malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(h + 2 * i, "%2x", &v);
        s[i] = (char)v;
    }
    s[n] = 0;
    return s;
}

static void fail_line(int err, unsigned long long done) {
    printf("err %s %llu %s\n", error_name(err), done, kalos_last_detail());
}

static void print_hits(const int64_t *ids, const float *scores, size_t n) {
    for (size_t i = 0; i < n; i++) printf(" %" PRId64 " %a", ids[i], (double)scores[i]);
}

typedef struct parallel_job {
    kalos_client *c;
    const char *ns;
    const float *q;
    size_t nq, dim, first, step;
    unsigned k;
    int timeout;
    int64_t *ids;
    float *scores;
    size_t *n;
    int *err;
} parallel_job;

static void *parallel_thread(void *arg) {
    parallel_job *a = arg;
    for (size_t j = a->first; j < a->nq; j += a->step)
        a->err[j] = kalos_recall(a->c, a->ns, a->q + j * a->dim, a->dim, a->k, a->timeout, a->ids + j * a->k,
                                 a->scores + j * a->k, &a->n[j]);
    return NULL;
}

static void parallel(kalos_client *c) {
    char *ns = next_word();
    long long k, timeout, threads, nq, dim;
    if (!ns || !next_long(&k) || !next_long(&timeout) || !next_long(&threads) || !next_long(&nq) || !next_long(&dim) ||
        k < 1 || threads < 1 || threads > 64 || nq < 1 || dim < 1 || nq * dim > 1 << 24 || nq * k > 1 << 24) {
        printf("bad command\n");
        return;
    }
    float *q = malloc((size_t)(nq * dim) * sizeof *q);
    int64_t *ids = malloc((size_t)(nq * k) * sizeof *ids);
    float *scores = malloc((size_t)(nq * k) * sizeof *scores);
    size_t *n = calloc((size_t)nq, sizeof *n);
    int *err = calloc((size_t)nq, sizeof *err);
    if (!next_floats(q, (size_t)(nq * dim))) {
        printf("bad command\n");
    } else {
        pthread_t tid[64];
        parallel_job jobs[64];
        for (long long t = 0; t < threads; t++) {
            jobs[t] = (parallel_job){c, ns, q, (size_t)nq, (size_t)dim, (size_t)t, (size_t)threads, (unsigned)k,
                                     (int)timeout, ids, scores, n, err};
            pthread_create(&tid[t], NULL, parallel_thread, &jobs[t]);
        }
        for (long long t = 0; t < threads; t++) pthread_join(tid[t], NULL);
        printf("ok %lld\n", nq);
        for (long long j = 0; j < nq; j++) {
            if (err[j]) {
                printf("err %s\n", error_name(err[j]));
                continue;
            }
            printf("%zu", n[j]);
            print_hits(ids + j * k, scores + j * k, n[j]);
            printf("\n");
        }
    }
    free(q);
    free(ids);
    free(scores);
    free(n);
    free(err);
}

int main(void) {
    kalos_client *c = NULL;
    char *line = NULL;
    size_t cap = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (getline(&line, &cap, stdin) > 0) {
        char *cmd = strtok_r(line, " \t\n", &save);
        if (!cmd) continue;
        if (!strcmp(cmd, "open")) {
            char *name = next_word();
            long long uid, slots, connect_ms, spin_us;
            if (!name || !next_long(&uid) || !next_long(&slots) || !next_long(&connect_ms) || !next_long(&spin_us)) {
                printf("bad command\n");
                continue;
            }
            kalos_options o = KALOS_OPTIONS_INIT;
            o.sidecar_uid = uid < 0 ? (uid_t)-1 : (uid_t)uid;
            o.slots = (unsigned)slots;
            o.connect_timeout_ms = (int)connect_ms;
            o.spin_us = (unsigned)spin_us;
            int err;
            kalos_close(c);
            c = kalos_open_with(name, &o, &err);
            if (c)
                printf("ok %zu %u %zu %s %u\n", kalos_dim(c), kalos_max_k(c), kalos_max_queries(c), kalos_metric(c),
                       kalos_slots(c));
            else
                fail_line(err, 0);
        } else if (!strcmp(cmd, "recall") || !strcmp(cmd, "recall_many")) {
            int many = !strcmp(cmd, "recall_many");
            char *ns = next_word();
            long long k, timeout, nq = 1, dim;
            if (!ns || !next_long(&k) || !next_long(&timeout) || (many && !next_long(&nq)) || !next_long(&dim) ||
                k < 0 || nq < 0 || dim < 0 || nq * dim > 1 << 24 || nq * k > 1 << 24) {
                printf("bad command\n");
                continue;
            }
            float *q = malloc(((size_t)nq * dim + 1) * sizeof *q);
            int64_t *ids = malloc(((size_t)nq * k + 1) * sizeof *ids);
            float *scores = malloc(((size_t)nq * k + 1) * sizeof *scores);
            size_t n;
            if (!next_floats(q, (size_t)(nq * dim))) {
                printf("bad command\n");
            } else {
                int err = many ? kalos_recall_many(c, ns, q, (size_t)nq, (size_t)dim, (unsigned)k, (int)timeout, ids,
                                                   scores, &n)
                               : kalos_recall(c, ns, q, (size_t)dim, (unsigned)k, (int)timeout, ids, scores, &n);
                if (err) {
                    fail_line(err, 0);
                } else if (many) {
                    printf("ok %zu %lld\n", n, nq);
                    for (long long j = 0; j < nq; j++) {
                        print_hits(ids + j * k, scores + j * k, n);
                        printf("\n");
                    }
                } else {
                    printf("ok %zu", n);
                    print_hits(ids, scores, n);
                    printf("\n");
                }
            }
            free(q);
            free(ids);
            free(scores);
        } else if (!strcmp(cmd, "upsert")) {
            char *ns = next_word();
            long long timeout, n, dim;
            if (!ns || !next_long(&timeout) || !next_long(&n) || !next_long(&dim) || n < 0 || dim < 0 ||
                n * dim > 1 << 24) {
                printf("bad command\n");
                continue;
            }
            int64_t *ids = malloc(((size_t)n + 1) * sizeof *ids);
            float *v = malloc(((size_t)(n * dim) + 1) * sizeof *v);
            char **payloads = NULL;
            int ok = next_ids(ids, (size_t)n) && next_floats(v, (size_t)(n * dim));
            char *w = ok ? next_word() : NULL;
            if (w) {
                payloads = calloc((size_t)n + 1, sizeof *payloads);
                for (long long i = 0; i < n && w; i++, w = i < n ? next_word() : NULL)
                    payloads[i] = strcmp(w, "-") ? unhex(w) : NULL;
            }
            if (!ok) {
                printf("bad command\n");
            } else {
                uint64_t written;
                int err = kalos_upsert(c, ns, ids, v, (size_t)n, (size_t)dim, (const char *const *)payloads,
                                       (int)timeout, &written);
                if (err)
                    fail_line(err, (unsigned long long)written);
                else
                    printf("ok %llu\n", (unsigned long long)written);
            }
            for (long long i = 0; payloads && i < n; i++) free(payloads[i]);
            free(payloads);
            free(ids);
            free(v);
        } else if (!strcmp(cmd, "delete")) {
            char *ns = next_word();
            long long timeout, n;
            if (!ns || !next_long(&timeout) || !next_long(&n) || n < 0 || n > 1 << 24) {
                printf("bad command\n");
                continue;
            }
            int64_t *ids = malloc(((size_t)n + 1) * sizeof *ids);
            if (!next_ids(ids, (size_t)n)) {
                printf("bad command\n");
            } else {
                uint64_t deleted;
                int err = kalos_delete(c, ns, ids, (size_t)n, (int)timeout, &deleted);
                if (err)
                    fail_line(err, (unsigned long long)deleted);
                else
                    printf("ok %llu\n", (unsigned long long)deleted);
            }
            free(ids);
        } else if (!strcmp(cmd, "embed")) {
            long long timeout, n;
            if (!next_long(&timeout) || !next_long(&n) || n < 0 || n > 1 << 16) {
                printf("bad command\n");
                continue;
            }
            char **texts = calloc((size_t)n + 1, sizeof *texts);
            int ok = 1;
            for (long long i = 0; i < n && ok; i++) {
                char *w = next_word();
                ok = w != NULL && (texts[i] = strcmp(w, "-") ? unhex(w) : calloc(1, 1)) != NULL; /* -: "" */
            }
            size_t dim = kalos_embed_dim(c);
            float *v = malloc(((size_t)n * (dim ? dim : 1) + 1) * sizeof *v);
            if (!ok) {
                printf("bad command\n");
            } else {
                int err = kalos_embed(c, (const char *const *)texts, (size_t)n, (int)timeout, v);
                if (err) {
                    fail_line(err, 0);
                } else {
                    printf("ok %lld %zu", n, dim);
                    for (size_t i = 0; i < (size_t)n * dim; i++) printf(" %a", (double)v[i]);
                    printf("\n");
                }
            }
            for (long long i = 0; i < n; i++) free(texts[i]);
            free(texts);
            free(v);
        } else if (!strcmp(cmd, "parallel")) {
            parallel(c);
        } else if (!strcmp(cmd, "forked")) {
            char *ns = next_word();
            long long k, dim;
            float q[4096];
            if (!ns || !next_long(&k) || !next_long(&dim) || k < 1 || k > 4096 || dim < 1 || dim > 4096 ||
                !next_floats(q, (size_t)dim)) {
                printf("bad command\n");
                continue;
            }
            fflush(stdout);
            pid_t child = fork();
            if (child == 0) {
                int64_t ids[4096];
                float scores[4096];
                size_t n;
                int err = kalos_recall(c, ns, q, (size_t)dim, (unsigned)k, 1000, ids, scores, &n);
                printf("%s %s\n", error_name(err), err ? kalos_last_detail() : "");
                fflush(stdout);
                _exit(0);
            }
            waitpid(child, NULL, 0);
        } else if (!strcmp(cmd, "status")) {
            long long s;
            if (!next_long(&s)) {
                printf("bad command\n");
                continue;
            }
            printf("%s\n", error_name(kalos_error_of_status((int)s)));
        } else if (!strcmp(cmd, "hold")) {
            printf("holding\n");
            for (;;) pause();
        } else if (!strcmp(cmd, "close")) {
            kalos_close(c);
            c = NULL;
            printf("ok\n");
        } else {
            printf("bad command\n");
        }
    }
    kalos_close(c);
    free(line);
    return 0;
}
