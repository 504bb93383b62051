/* kalos.h: a C client of a Kalos sidecar (docs/protocol.md), on the generated protocol header
 * (broker/kalos_protocol.h).
 *
 * A client attaches to the shared objects of one broker name after checking who owns them, leases
 * slots (each a lock byte the kernel holds for this process: a killed process never leaks one),
 * and sends recalls and writes through them. Every call takes a time budget in milliseconds for
 * the whole call (waiting for a slot, the sidecar's answer, every chunk of a write); a negative
 * budget means no limit. Every call returns a kalos_error; kalos_last_detail() says more.
 *
 *     int err;
 *     kalos_client *c = kalos_open("default", (uid_t)-1, &err);
 *     if (!c) { fprintf(stderr, "%s: %s\n", kalos_strerror(err), kalos_last_detail()); ... }
 *     int64_t ids[10]; float scores[10]; size_t n;
 *     err = kalos_recall(c, "user-7", query, kalos_dim(c), 10, 1000, ids, scores, &n);
 *     kalos_close(c);
 *
 * Threads: one client may be used by several threads at once; each call holds one of the
 * client's leased slots for its duration (kalos_options.slots; calls beyond that wait for a slot
 * within their budget). kalos_close must not race other calls on the same client.
 *
 * Processes: a client belongs to the process that opened it; in a forked child every call fails
 * with KALOS_E_INVALID (open one in the child).
 *
 * Timeouts: a call whose answer does not come within its budget returns KALOS_E_TIMEOUT and
 * leaves its request in the slot, as the protocol requires; the slot is used again only after
 * the sidecar's late answer has been consumed (and discarded) by a later call, within that call's
 * budget. Closing the client hands such a slot to the sidecar's reaper (owner_pid = -1).
 *
 * Sidecar restarts: a client does not re-attach. Once its sidecar has stopped or died, calls
 * return KALOS_E_UNAVAILABLE; close the client and open a new one (writes in flight when it died
 * may or may not have been applied: upsert and delete are idempotent, so retrying is safe).
 *
 * Metrics: every call's latency (from the call to the result in hand) is recorded in its slot's
 * stats block, as the protocol describes, so the sidecar's /metrics count the calls of C clients
 * beside those of Python clients (op labels recall, recall_many, upsert, delete).
 */
#ifndef KALOS_H
#define KALOS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library's exported functions (it is built with -fvisibility=hidden). */
#if defined(__GNUC__)
#define KALOS_API __attribute__((visibility("default")))
#else
#define KALOS_API
#endif

typedef struct kalos_client kalos_client;

/* What a call returns. The protocol's status codes map onto these as broker/layout.py maps them
 * onto the Python client's exceptions (kalos_error_of_status). */
typedef enum kalos_error {
    KALOS_OK = 0,
    /* The caller's arguments: a bad name, namespace, dim, k, row count, id, a NaN or infinite
     * value, a NULL pointer, a forked process; or the sidecar's DIM_MISMATCH, K_OUT_OF_RANGE,
     * TOO_MANY_QUERIES, NOT_FINITE, BAD_ID. Nothing was applied. */
    KALOS_E_INVALID = 1,
    /* No sidecar serves the name (none, still starting, stopping, or dead). */
    KALOS_E_UNAVAILABLE = 2,
    /* The objects belong to another user or are open to others: refused before a byte was
     * written (whoever made them could read the queries and forge the answers). */
    KALOS_E_UNTRUSTED = 3,
    /* Not a Kalos segment, another protocol version, a geometry that does not add up, an answer
     * that breaks the protocol (generation echo, counts out of bounds); or the sidecar's
     * BAD_REQUEST (e.g. a payload that is not valid JSON) or UNKNOWN_OP. */
    KALOS_E_PROTOCOL = 4,
    /* No slot, or no answer, within the call's budget; or the sidecar's NOT_APPLIED. */
    KALOS_E_TIMEOUT = 5,
    /* The sidecar's UNKNOWN_NAMESPACE, which a current sidecar never answers: a recall of a
     * namespace that does not exist answers KALOS_OK and no hits. Kept for older sidecars. */
    KALOS_E_UNKNOWN_NAMESPACE = 6,
    /* A payload over the sidecar's --payload-limit or a slot's blob area (checked before
     * anything is sent), or the sidecar's PAYLOAD_TOO_LARGE. */
    KALOS_E_PAYLOAD_TOO_LARGE = 7,
    /* Other processes lease the slots this client asked for (kalos_open). */
    KALOS_E_SLOTS_EXHAUSTED = 8,
    /* The sidecar failed on the request: BACKEND_ERROR, STORE_ERROR, CAPACITY, SERVER_ERROR. */
    KALOS_E_SERVER = 9,
    /* An operating system call failed unexpectedly, or memory ran out (errno in the detail). */
    KALOS_E_SYSTEM = 10,
} kalos_error;

/* Options of kalos_open_with. Start from KALOS_OPTIONS_INIT. */
typedef struct kalos_options {
    /* The user the sidecar runs as: (uid_t)-1 for this process's effective uid (every object
     * must then be closed to the group and to others: mode 0600), or a dedicated user's uid
     * (objects shared with its group, --shm-mode 0660, never with others). */
    uid_t sidecar_uid;
    /* Slots leased at open: the most calls in flight at once over this client (0 counts as 1). */
    unsigned slots;
    /* How long kalos_open waits for a sidecar to serve the name (none yet, or one still loading)
     * and for slots the sidecar is reclaiming from processes that exited: 0 tries once, a
     * negative value waits without limit. */
    int connect_timeout_ms;
    /* How long a call polls its slot after posting before it blocks on the slot's response
     * semaphore (microseconds; 0: block at once). Polling catches a quick answer without a
     * wake-up, which costs tens of microseconds on a VM, at the price of a busy core meanwhile. */
    unsigned spin_us;
} kalos_options;

#define KALOS_OPTIONS_INIT {(uid_t)-1, 1, 0, 250}

/* Attach to broker `name` ([A-Za-z0-9_-]{1,40}) with one slot, trying once. `sidecar_uid` as in
 * kalos_options. Returns NULL and sets *err (if err is not NULL) on failure:
 * KALOS_E_UNAVAILABLE, KALOS_E_UNTRUSTED, KALOS_E_PROTOCOL, KALOS_E_SLOTS_EXHAUSTED,
 * KALOS_E_INVALID, KALOS_E_SYSTEM. */
KALOS_API kalos_client *kalos_open(const char *name, uid_t sidecar_uid, int *err);

/* kalos_open with options (NULL: KALOS_OPTIONS_INIT). */
KALOS_API kalos_client *kalos_open_with(const char *name, const kalos_options *opts, int *err);

/* Give the leases back and detach (a slot whose request is still in flight goes to the sidecar's
 * reaper). NULL is fine. Must not race other calls on `c`. */
KALOS_API void kalos_close(kalos_client *c);

/* The sidecar's geometry and metric, from its header: the vector dimension, the largest k, the
 * rows of one recall_many, the slots this client leases, and what scores mean ("dot", "cosine" or
 * "l2"). */
KALOS_API size_t kalos_dim(const kalos_client *c);
KALOS_API unsigned kalos_max_k(const kalos_client *c);
KALOS_API size_t kalos_max_queries(const kalos_client *c);
KALOS_API unsigned kalos_slots(const kalos_client *c);
KALOS_API const char *kalos_metric(const kalos_client *c);

/* Exact top-k of one vector `query` of `dim` floats (dim must be the sidecar's) in namespace
 * `ns` ([A-Za-z0-9_.:@-]{1,64}), k in 1..kalos_max_k. Writes the hits, best first, to
 * ids_out[0..n) and scores_out[0..n) (room for k each) and n = min(k, rows) to *n_out. Higher
 * scores are better in every metric. A namespace that was never written (or was dropped) holds
 * no rows: KALOS_OK with *n_out = 0, not an error. Errors: KALOS_E_INVALID, KALOS_E_TIMEOUT,
 * KALOS_E_UNAVAILABLE, KALOS_E_PROTOCOL, KALOS_E_SERVER (KALOS_E_UNKNOWN_NAMESPACE only from a
 * sidecar older than that rule). */
KALOS_API int kalos_recall(kalos_client *c, const char *ns, const float *query, size_t dim, unsigned k,
                           int timeout_ms, int64_t *ids_out, float *scores_out, size_t *n_out);

/* Top-k of `nq` vectors (row-major, nq x dim; nq in 1..kalos_max_queries) in one slot and one
 * round trip. Query j's hits are ids_out[j*k + 0..n) and scores_out[j*k + 0..n) (room for nq*k
 * each); *n_out = hits per query, the same for every query. Errors as kalos_recall. */
KALOS_API int kalos_recall_many(kalos_client *c, const char *ns, const float *queries, size_t nq, size_t dim,
                                unsigned k, int timeout_ms, int64_t *ids_out, float *scores_out, size_t *n_out);

/* Insert or replace `n` records (ids >= 0, vectors n x dim, row-major) in namespace `ns`, which
 * is created if new. `payloads`: NULL, or n JSON texts (one line each; NULL for none), each at
 * most the sidecar's --payload-limit. Everything is checked before the first request is sent;
 * rows go in chunks (max_queries rows and a blob area of payloads each), one after the other
 * within the one budget, and none is sent after one fails. *written_out (may be NULL) = records
 * written by the chunks that succeeded: on an error, the rows of those chunks were applied and
 * the failed chunk's were not, except after KALOS_E_TIMEOUT, KALOS_E_UNAVAILABLE or
 * KALOS_E_SERVER, when it may have been (docs/protocol.md, "A write answered with an error").
 * Duplicate ids: the last row wins. */
KALOS_API int kalos_upsert(kalos_client *c, const char *ns, const int64_t *ids, const float *vectors, size_t n,
                           size_t dim, const char *const *payloads, int timeout_ms, uint64_t *written_out);

/* Delete the records of `n` ids (>= 0) from namespace `ns`, in chunks of max_queries ids as for
 * kalos_upsert. *deleted_out (may be NULL) = records that existed (an unknown namespace: 0). */
KALOS_API int kalos_delete(kalos_client *c, const char *ns, const int64_t *ids, size_t n, int timeout_ms,
                           uint64_t *deleted_out);

/* The vectors of `n` texts under the sidecar's embedding model (kalos serve --embed): each text
 * 1 to KALOS_MAX_TEXT_BYTES bytes of UTF-8 (a C string: no NUL inside), not only whitespace;
 * vectors_out gets n x kalos_embed_dim floats, in order. The texts go in chunks (max_queries texts
 * and a blob area each), one after the other within the one budget; the sidecar embeds every
 * client's pending texts together. Errors: KALOS_E_INVALID (no model: kalos_embed_dim is 0; a text
 * NULL, empty, too long), KALOS_E_PROTOCOL (the sidecar refused a text, e.g. invalid UTF-8: the
 * detail names it), and those of kalos_recall. */
KALOS_API int kalos_embed(kalos_client *c, const char *const *texts, size_t n, int timeout_ms, float *vectors_out);

/* The dimension of the sidecar's embedding model (its header's embed_dim), 0: it serves none. */
KALOS_API size_t kalos_embed_dim(const kalos_client *c);

/* A short English description of a kalos_error. */
KALOS_API const char *kalos_strerror(int err);

/* What the calling thread's last failed call (kalos_open included) said in detail: the sidecar's
 * error text prefixed with its status name, or the client's reason. Valid until the thread's
 * next call. */
KALOS_API const char *kalos_last_detail(void);

/* The kalos_error for a protocol status code (KALOS_STATUS_*; an unknown code: KALOS_E_PROTOCOL). */
KALOS_API int kalos_error_of_status(int status);

#ifdef __cplusplus
}
#endif

#endif /* KALOS_H */
