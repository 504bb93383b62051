/* kalos.c: the C client of a Kalos sidecar. Written from docs/protocol.md; every offset, code and
 * constant comes from the generated header (broker/kalos_protocol.h), so a rebuild follows a change
 * of broker/layout.py.
 *
 * Everything in the segment was written by another process (the sidecar, or any process of the
 * same user): each value is read once, checked, and only the checked copy is used.
 */
#define _GNU_SOURCE /* F_OFD_SETLK / F_OFD_GETLK */
#include "kalos.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kalos_protocol.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the Kalos protocol is little-endian; this client reads the segment natively"
#endif

#define NS_PER_MS 1000000ULL
/* A blocked wait looks at the sidecar's liveness this often. */
#define SLICE_NS (50 * NS_PER_MS)
/* Every holder keeps the claim lock (flock) for microseconds: a longer hold is a stopped or frozen
 * process, which no call may wait behind (docs/protocol.md, "Leases and liveness"). */
#define FLOCK_WAIT_NS (50 * NS_PER_MS)
/* How often kalos_open looks again at a sidecar that is loading or absent. */
#define RETRY_NS (10 * NS_PER_MS)
#define MAX_BROKER_NAME 40

/* ------------------------------------------------------------------------------------------ */
/* Errors: the code is returned, the detail kept per thread (kalos_open has no client to keep it). */

static _Thread_local char detail_text[1024];

static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail_text, sizeof detail_text, fmt, ap);
    va_end(ap);
    return code;
}

const char *kalos_last_detail(void) { return detail_text; }

const char *kalos_strerror(int err) {
    switch (err) {
    case KALOS_OK: return "ok";
    case KALOS_E_INVALID: return "invalid request";
    case KALOS_E_UNAVAILABLE: return "broker unavailable";
    case KALOS_E_UNTRUSTED: return "untrusted broker objects";
    case KALOS_E_PROTOCOL: return "protocol error";
    case KALOS_E_TIMEOUT: return "timed out";
    case KALOS_E_UNKNOWN_NAMESPACE: return "unknown namespace";
    case KALOS_E_PAYLOAD_TOO_LARGE: return "payload too large";
    case KALOS_E_SLOTS_EXHAUSTED: return "slots exhausted";
    case KALOS_E_SERVER: return "sidecar error";
    case KALOS_E_SYSTEM: return "system error";
    default: return "unknown error code";
    }
}

int kalos_error_of_status(int status) {
    switch (status) {
    case KALOS_STATUS_OK: return KALOS_OK;
    case KALOS_STATUS_DIM_MISMATCH:
    case KALOS_STATUS_K_OUT_OF_RANGE:
    case KALOS_STATUS_TOO_MANY_QUERIES:
    case KALOS_STATUS_NOT_FINITE:
    case KALOS_STATUS_BAD_ID: return KALOS_E_INVALID;
    case KALOS_STATUS_UNKNOWN_NAMESPACE: return KALOS_E_UNKNOWN_NAMESPACE;
    case KALOS_STATUS_PAYLOAD_TOO_LARGE: return KALOS_E_PAYLOAD_TOO_LARGE;
    case KALOS_STATUS_BACKEND_ERROR:
    case KALOS_STATUS_STORE_ERROR:
    case KALOS_STATUS_CAPACITY:
    case KALOS_STATUS_SERVER_ERROR: return KALOS_E_SERVER;
    case KALOS_STATUS_NOT_APPLIED: return KALOS_E_TIMEOUT;
    default: return KALOS_E_PROTOCOL; /* BAD_REQUEST, UNKNOWN_OP, and codes this client does not know */
    }
}

static const char *status_name(int status) {
    switch (status) {
    case KALOS_STATUS_OK: return "OK";
    case KALOS_STATUS_BAD_REQUEST: return "BAD_REQUEST";
    case KALOS_STATUS_DIM_MISMATCH: return "DIM_MISMATCH";
    case KALOS_STATUS_K_OUT_OF_RANGE: return "K_OUT_OF_RANGE";
    case KALOS_STATUS_TOO_MANY_QUERIES: return "TOO_MANY_QUERIES";
    case KALOS_STATUS_NOT_FINITE: return "NOT_FINITE";
    case KALOS_STATUS_UNKNOWN_NAMESPACE: return "UNKNOWN_NAMESPACE";
    case KALOS_STATUS_PAYLOAD_TOO_LARGE: return "PAYLOAD_TOO_LARGE";
    case KALOS_STATUS_BACKEND_ERROR: return "BACKEND_ERROR";
    case KALOS_STATUS_UNKNOWN_OP: return "UNKNOWN_OP";
    case KALOS_STATUS_STORE_ERROR: return "STORE_ERROR";
    case KALOS_STATUS_CAPACITY: return "CAPACITY";
    case KALOS_STATUS_BAD_ID: return "BAD_ID";
    case KALOS_STATUS_SERVER_ERROR: return "SERVER_ERROR";
    case KALOS_STATUS_NOT_APPLIED: return "NOT_APPLIED";
    default: return NULL;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Shared memory access. Fields are naturally aligned; atomics keep the compiler from tearing,
 * caching or reordering them. The state word is the protocol's hand-over: written last with
 * release, read first with acquire; the semaphore operations are the fences between processes. */

static inline uint32_t ld32(const uint8_t *p) {
    return __atomic_load_n((const uint32_t *)(const void *)p, __ATOMIC_ACQUIRE);
}
static inline uint64_t ld64(const uint8_t *p) {
    return __atomic_load_n((const uint64_t *)(const void *)p, __ATOMIC_ACQUIRE);
}
static inline void st32(uint8_t *p, uint32_t v) { __atomic_store_n((uint32_t *)(void *)p, v, __ATOMIC_RELEASE); }
static inline void st64(uint8_t *p, uint64_t v) { __atomic_store_n((uint64_t *)(void *)p, v, __ATOMIC_RELEASE); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* 0: no limit. */
static uint64_t deadline_of(int timeout_ms, uint64_t t0) {
    if (timeout_ms < 0) return 0;
    return t0 + (uint64_t)timeout_ms * NS_PER_MS;
}

/* ------------------------------------------------------------------------------------------ */
/* The client. */

typedef struct kalos_slot {
    uint32_t index;
    sem_t *req, *resp;
    uint8_t *ctl;   /* control block */
    uint8_t *stats; /* client stats block (only the lease owner writes it) */
    uint8_t *data;  /* data area */
    uint64_t generation;
    int pending; /* a request whose caller gave up is still in the slot */
    int taken;   /* a call holds the slot */
} kalos_slot;

struct kalos_client {
    char name[MAX_BROKER_NAME + 1];
    int shm_fd, leases_fd;
    uint8_t *base;
    size_t size;
    sem_t *bell;
    kalos_geometry g;
    uint64_t ids_off, rids_off, rscores_off, blob_off; /* within a data area */
    uint32_t payload_limit, metric;
    pid_t pid;
    uint64_t start_ticks;
    uint64_t spin_ns;
    kalos_slot *slots;
    unsigned n_leased;
    pthread_mutex_t mu; /* guards the slots' taken/pending flags */
    pthread_cond_t freed;
};

static uint8_t *hdr(const kalos_client *c, unsigned off) { return c->base + off; }

/* ------------------------------------------------------------------------------------------ */
/* Names and owners. */

static int valid_broker_name(const char *s) {
    size_t n = 0;
    for (; s[n]; n++) {
        char ch = s[n];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
              ch == '-'))
            return 0;
        if (n >= MAX_BROKER_NAME) return 0;
    }
    return n >= 1;
}

/* The namespace's length, or 0 if it is not [A-Za-z0-9_.:@-]{1,64}. */
static size_t namespace_len(const char *s) {
    size_t n = 0;
    if (!s) return 0;
    for (; s[n]; n++) {
        char ch = s[n];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
              ch == '.' || ch == ':' || ch == '@' || ch == '-'))
            return 0;
        if (n >= KALOS_NAMESPACE_BYTES) return 0;
    }
    return n;
}

/* docs/protocol.md, "Objects": owned by the expected uid, and closed to others (and to the group
 * unless the sidecar runs as a dedicated user). */
static int check_owner(const kalos_client *c, const struct stat *st, uid_t expected, int group_ok, const char *what,
                       const char *path) {
    if (st->st_uid != expected)
        return fail(KALOS_E_UNTRUSTED,
                    "broker '%s': %s %s belongs to uid %u, not to the expected uid %u; refusing to attach (nothing "
                    "was sent). Whoever made it could read the queries and forge the answers. If the sidecar runs "
                    "as another user, pass its uid; if the object is stale or foreign, have its owner (or root) "
                    "remove it: `kalos cleanup %s`",
                    c->name, what, path, (unsigned)st->st_uid, (unsigned)expected, c->name);
    if (st->st_mode & (group_ok ? 0007 : 0077))
        return fail(KALOS_E_UNTRUSTED,
                    "broker '%s': %s %s has mode %04o, open to %s; refusing to attach (nothing was sent): "
                    "`kalos cleanup %s`",
                    c->name, what, path, (unsigned)(st->st_mode & 07777),
                    group_ok ? "other users" : "its group or other users", c->name);
    return KALOS_OK;
}

/* /proc/self/stat field 22: the start time in clock ticks since boot (0 if unknown). The command
 * name (field 2) may hold spaces and parentheses: fields are counted after the last ')'. */
static uint64_t start_ticks_of_self(void) {
    char buf[2048];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    p++;
    /* After ')': " S ppid ..." : field 3 is the first; field 22 is the 20th after it. */
    for (int field = 3; field < 22; field++) {
        p = strchr(p + 1, ' ');
        if (!p) return 0;
    }
    return strtoull(p + 1, NULL, 10);
}

/* ------------------------------------------------------------------------------------------ */
/* Locks: the claim lock (flock of the segment) and the lease file's byte locks (OFD locks). */

static int claim_lock(kalos_client *c) {
    uint64_t end = now_ns() + FLOCK_WAIT_NS, pause = 100000;
    for (;;) {
        if (flock(c->shm_fd, LOCK_EX | LOCK_NB) == 0) return KALOS_OK;
        if (errno == EINTR) continue;
        if (errno != EWOULDBLOCK)
            return fail(KALOS_E_SYSTEM, "broker '%s': claim lock: %s", c->name, strerror(errno));
        if (now_ns() >= end)
            return fail(KALOS_E_UNAVAILABLE,
                        "broker '%s': the slots' claim lock has been held by another process for over %llu ms (a "
                        "stopped or frozen client?)",
                        c->name, (unsigned long long)(FLOCK_WAIT_NS / NS_PER_MS));
        sleep_ns(pause);
        if (pause < 5 * NS_PER_MS) pause *= 2;
    }
}

static void claim_unlock(kalos_client *c) { (void)flock(c->shm_fd, LOCK_UN); }

static struct flock byte_lock(short type, uint64_t byte) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)byte;
    fl.l_len = 1;
    return fl;
}

/* 1 taken, 0 held by another open file description, -1 error (errno). */
static int try_lock_byte(int fd, uint64_t byte) {
    struct flock fl = byte_lock(F_WRLCK, byte);
    if (fcntl(fd, F_OFD_SETLK, &fl) == 0) return 1;
    return (errno == EAGAIN || errno == EACCES) ? 0 : -1;
}

static void unlock_byte(int fd, uint64_t byte) {
    struct flock fl = byte_lock(F_UNLCK, byte);
    (void)fcntl(fd, F_OFD_SETLK, &fl);
}

/* ------------------------------------------------------------------------------------------ */
/* Liveness (docs/protocol.md, "Header"): the state, the sidecar's lock byte, the heartbeat. */

static int check_alive(kalos_client *c) {
    uint32_t state = ld32(hdr(c, KALOS_HDR_STATE));
    if (state == KALOS_SIDECARSTATE_STOPPING || state == KALOS_SIDECARSTATE_STOPPED ||
        state == KALOS_SIDECARSTATE_FAILED)
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': the sidecar is %s", c->name,
                    state == KALOS_SIDECARSTATE_STOPPING  ? "stopping"
                    : state == KALOS_SIDECARSTATE_STOPPED ? "stopped"
                                                          : "failed");
    struct flock fl = byte_lock(F_WRLCK, c->g.n_slots);
    if (fcntl(c->leases_fd, F_OFD_GETLK, &fl) != 0)
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': lease file: %s", c->name, strerror(errno));
    if (fl.l_type == F_UNLCK)
        return fail(KALOS_E_UNAVAILABLE,
                    "broker '%s': the sidecar (pid %lld) is gone (its lease-file lock was released): close this "
                    "client and open a new one",
                    c->name, (long long)(int64_t)ld64(hdr(c, KALOS_HDR_SIDECAR_PID)));
    uint64_t beat = ld64(hdr(c, KALOS_HDR_HEARTBEAT_NS)), now = now_ns();
    if (now > beat && now - beat > KALOS_HEARTBEAT_STALE_NS)
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': the sidecar's heartbeat is %.1f s old", c->name,
                    (double)(now - beat) / 1e9);
    return KALOS_OK;
}

/* Cheap (no system call): has the heartbeat been quiet for several periods? Then check_alive
 * before posting, so that no request is sent to a dead sidecar. */
static int quiet(const kalos_client *c) {
    uint64_t beat = ld64(hdr(c, KALOS_HDR_HEARTBEAT_NS)), now = now_ns();
    return now > beat && now - beat > 4 * KALOS_HEARTBEAT_NS;
}

/* ------------------------------------------------------------------------------------------ */
/* Attaching. */

static void detach(kalos_client *c) {
    if (c->slots) {
        for (unsigned i = 0; i < c->n_leased; i++) {
            if (c->slots[i].req) sem_close(c->slots[i].req);
            if (c->slots[i].resp) sem_close(c->slots[i].resp);
        }
        free(c->slots);
    }
    if (c->bell) sem_close(c->bell);
    if (c->leases_fd >= 0) close(c->leases_fd); /* drops every lease lock this client still holds */
    if (c->base) munmap(c->base, c->size);
    if (c->shm_fd >= 0) close(c->shm_fd);
    pthread_cond_destroy(&c->freed);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* Open the segment, check its owner, header and geometry, the semaphores' and the lease file's
 * owners. Nothing is written. */
static int open_objects(kalos_client *c, uid_t expected, int group_ok) {
    char path[128];
    snprintf(path, sizeof path, "/kalos.%s", c->name);
    c->shm_fd = shm_open(path, O_RDWR | O_CLOEXEC, 0);
    if (c->shm_fd < 0) {
        if (errno == ENOENT)
            return fail(KALOS_E_UNAVAILABLE,
                        "no sidecar serves broker '%s' (start one: `kalos serve --name %s --ephemeral`, or "
                        "`--data-dir DIR` instead of --ephemeral to keep the records)",
                        c->name, c->name);
        if (errno == EACCES)
            return fail(KALOS_E_UNAVAILABLE, "broker '%s': %s (objects are mode 0600: run as the sidecar's user)",
                        c->name, strerror(errno));
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': %s", c->name, strerror(errno));
    }
    struct stat st;
    if (fstat(c->shm_fd, &st) != 0) return fail(KALOS_E_SYSTEM, "broker '%s': fstat: %s", c->name, strerror(errno));
    int rc = check_owner(c, &st, expected, group_ok, "shared memory", path);
    if (rc) return rc;
    /* The sidecar creates the segment, sizes it, and writes the magic last. */
    if (st.st_size == 0)
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': the sidecar is still starting (or died while starting: "
                    "`kalos cleanup %s`)", c->name, c->name);
    if (st.st_size < KALOS_HEADER_BYTES)
        return fail(KALOS_E_PROTOCOL, "broker '%s': segment of %lld bytes is not a Kalos segment", c->name,
                    (long long)st.st_size);
    c->size = (size_t)st.st_size;
    void *m = mmap(NULL, c->size, PROT_READ | PROT_WRITE, MAP_SHARED, c->shm_fd, 0);
    if (m == MAP_FAILED) return fail(KALOS_E_SYSTEM, "broker '%s': mmap: %s", c->name, strerror(errno));
    c->base = m;

    uint64_t magic = ld64(hdr(c, KALOS_HDR_MAGIC));
    if (magic == 0)
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': the sidecar is still starting (or died while starting: "
                    "`kalos cleanup %s`)", c->name, c->name);
    if (magic != KALOS_MAGIC) return fail(KALOS_E_PROTOCOL, "broker '%s': bad magic; not a Kalos segment", c->name);
    uint32_t version = ld32(hdr(c, KALOS_HDR_VERSION));
    if (version != KALOS_PROTOCOL_VERSION)
        return fail(KALOS_E_PROTOCOL,
                    "broker '%s' speaks protocol version %u, this client speaks %u: build the client from the "
                    "kalos version matching the sidecar",
                    c->name, version, (unsigned)KALOS_PROTOCOL_VERSION);
    if (ld32(hdr(c, KALOS_HDR_HEADER_BYTES)) != KALOS_HEADER_BYTES ||
        ld32(hdr(c, KALOS_HDR_DTYPE)) != KALOS_DTYPE_FLOAT32)
        return fail(KALOS_E_PROTOCOL, "broker '%s': header size or dtype differs from this client's", c->name);
    if (ld32(hdr(c, KALOS_HDR_HIST_BUCKETS)) != KALOS_HIST_BUCKETS ||
        ld32(hdr(c, KALOS_HDR_RING_LEN)) != KALOS_RING_LEN)
        return fail(KALOS_E_PROTOCOL, "broker '%s': latency layout differs from this client's", c->name);
    c->g.n_slots = ld32(hdr(c, KALOS_HDR_N_SLOTS));
    c->g.dim = ld32(hdr(c, KALOS_HDR_DIM));
    c->g.max_k = ld32(hdr(c, KALOS_HDR_MAX_K));
    c->g.max_queries = ld32(hdr(c, KALOS_HDR_MAX_QUERIES));
    c->g.blob_bytes = ld64(hdr(c, KALOS_HDR_BLOB_BYTES));
    /* Within the limits nothing below overflows; then the sizes must agree exactly. */
    if (!kalos_geometry_ok(&c->g) || ld64(hdr(c, KALOS_HDR_SLOT_BYTES)) != kalos_slot_bytes(&c->g) ||
        ld64(hdr(c, KALOS_HDR_DATA_OFFSET)) != kalos_data_offset(&c->g) || kalos_total_bytes(&c->g) != c->size)
        return fail(KALOS_E_PROTOCOL,
                    "broker '%s': header geometry (%llu slots, dim %llu, max_k %llu, max_queries %llu, blob %llu) "
                    "does not match the segment (%zu bytes)",
                    c->name, (unsigned long long)c->g.n_slots, (unsigned long long)c->g.dim,
                    (unsigned long long)c->g.max_k, (unsigned long long)c->g.max_queries,
                    (unsigned long long)c->g.blob_bytes, c->size);
    c->ids_off = kalos_ids_offset(&c->g);
    c->rids_off = kalos_result_ids_offset(&c->g);
    c->rscores_off = kalos_result_scores_offset(&c->g);
    c->blob_off = kalos_blob_offset(&c->g);
    c->payload_limit = ld32(hdr(c, KALOS_HDR_PAYLOAD_LIMIT));
    c->metric = ld32(hdr(c, KALOS_HDR_METRIC));

    /* Every semaphore, before any is opened (glibc keeps /NAME as /dev/shm/sem.NAME). */
    for (uint64_t i = 0; i <= 2 * c->g.n_slots; i++) {
        char sem_file[160];
        if (i == 0)
            snprintf(sem_file, sizeof sem_file, "/dev/shm/sem.kalos.%s.bell", c->name);
        else
            snprintf(sem_file, sizeof sem_file, "/dev/shm/sem.kalos.%s.%llu.%s", c->name,
                     (unsigned long long)((i - 1) / 2), (i % 2) ? "req" : "resp");
        if (stat(sem_file, &st) != 0) {
            if (errno == ENOENT) return fail(KALOS_E_UNAVAILABLE, "broker '%s' is going away", c->name);
            return fail(KALOS_E_SYSTEM, "broker '%s': stat %s: %s", c->name, sem_file, strerror(errno));
        }
        rc = check_owner(c, &st, expected, group_ok, "semaphore", sem_file);
        if (rc) return rc;
    }
    snprintf(path, sizeof path, "/kalos.%s.bell", c->name);
    c->bell = sem_open(path, 0);
    if (c->bell == SEM_FAILED) {
        c->bell = NULL;
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': doorbell: %s", c->name, strerror(errno));
    }
    snprintf(path, sizeof path, "/dev/shm/kalos.%s.leases", c->name);
    c->leases_fd = open(path, O_RDWR | O_CLOEXEC);
    if (c->leases_fd < 0) {
        if (errno == ENOENT) return fail(KALOS_E_UNAVAILABLE, "broker '%s' is going away", c->name);
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': lease file: %s", c->name, strerror(errno));
    }
    if (fstat(c->leases_fd, &st) != 0)
        return fail(KALOS_E_SYSTEM, "broker '%s': fstat: %s", c->name, strerror(errno));
    return check_owner(c, &st, expected, group_ok, "lease file", path);
}

/* Give back the leases of slots[0..n): under the claim lock, a slot with nothing in flight is
 * freed (owner_start, owner_pid = 0), one with a request in flight is abandoned to the reaper
 * (owner_pid = -1); then the lock bytes are released. With the claim lock held elsewhere only the
 * lock bytes are released: the reaper then frees the slots as a dead owner's. */
static void give_back(kalos_client *c, kalos_slot *slots, unsigned n) {
    char kept[sizeof detail_text]; /* the caller's detail outlives a busy claim lock's */
    memcpy(kept, detail_text, sizeof kept);
    int locked = claim_lock(c) == KALOS_OK;
    memcpy(detail_text, kept, sizeof kept);
    for (unsigned i = 0; i < n && locked; i++) {
        kalos_slot *s = &slots[i];
        if ((int64_t)ld64(s->ctl + KALOS_SLOT_OWNER_PID) != (int64_t)c->pid) continue;
        if (s->pending || ld32(s->ctl + KALOS_SLOT_STATE) != KALOS_SLOTSTATE_FREE) {
            st64(s->ctl + KALOS_SLOT_OWNER_PID, (uint64_t)(int64_t)KALOS_OWNER_ABANDONED);
        } else {
            st64(s->ctl + KALOS_SLOT_OWNER_START, 0);
            st64(s->ctl + KALOS_SLOT_OWNER_PID, 0);
        }
    }
    for (unsigned i = 0; i < n; i++) unlock_byte(c->leases_fd, slots[i].index);
    if (locked) claim_unlock(c);
}

/* Lease `want` slots (docs/protocol.md, "Leases and liveness"): under the claim lock, for a slot
 * with owner_pid == 0 and state FREE, take its lock byte, then write owner_start, then owner_pid. */
static int lease(kalos_client *c, unsigned want) {
    if (want > c->g.n_slots)
        return fail(KALOS_E_INVALID,
                    "%u slots asked for; broker '%s' has %llu: ask for fewer (fewer still if other processes use it "
                    "too) or start the sidecar with more --slots",
                    want, c->name, (unsigned long long)c->g.n_slots);
    c->slots = calloc(want, sizeof *c->slots);
    if (!c->slots) return fail(KALOS_E_SYSTEM, "out of memory");
    int rc = claim_lock(c);
    if (rc) return rc;
    unsigned got = 0;
    for (uint64_t i = 0; i < c->g.n_slots && got < want; i++) {
        uint8_t *ctl = c->base + kalos_control_base(i);
        if (ld64(ctl + KALOS_SLOT_OWNER_PID) != 0 || ld32(ctl + KALOS_SLOT_STATE) != KALOS_SLOTSTATE_FREE) continue;
        int t = try_lock_byte(c->leases_fd, i);
        if (t < 0) {
            rc = fail(KALOS_E_SYSTEM, "broker '%s': lease lock: %s", c->name, strerror(errno));
            break;
        }
        if (t == 0) continue; /* held by a process that inherited it: not free */
        st64(ctl + KALOS_SLOT_OWNER_START, c->start_ticks);
        st64(ctl + KALOS_SLOT_OWNER_PID, (uint64_t)(int64_t)c->pid);
        kalos_slot *s = &c->slots[got++];
        s->index = (uint32_t)i;
        s->ctl = ctl;
        s->stats = c->base + kalos_stats_base(&c->g, i);
        s->data = c->base + kalos_data_base(&c->g, i);
        s->generation = ld64(ctl + KALOS_SLOT_GENERATION); /* numbering goes on from the last owner's */
    }
    claim_unlock(c);
    c->n_leased = got;
    if (rc == KALOS_OK && got < want)
        rc = fail(KALOS_E_SLOTS_EXHAUSTED,
                  "broker '%s': %u slot(s) asked for, %u of its %llu free (other processes lease the rest, or "
                  "the sidecar is still reclaiming them from processes that exited)",
                  c->name, want, got, (unsigned long long)c->g.n_slots);
    for (unsigned i = 0; i < got && rc == KALOS_OK; i++) {
        char path[128];
        kalos_slot *s = &c->slots[i];
        snprintf(path, sizeof path, "/kalos.%s.%u.req", c->name, s->index);
        s->req = sem_open(path, 0);
        if (s->req == SEM_FAILED) s->req = NULL;
        snprintf(path, sizeof path, "/kalos.%s.%u.resp", c->name, s->index);
        s->resp = sem_open(path, 0);
        if (s->resp == SEM_FAILED) s->resp = NULL;
        if (!s->req || !s->resp)
            rc = fail(KALOS_E_UNAVAILABLE, "broker '%s': slot %u: %s", c->name, s->index, strerror(errno));
    }
    if (rc) {
        give_back(c, c->slots, got);
        for (unsigned i = 0; i < got; i++) {
            if (c->slots[i].req) sem_close(c->slots[i].req);
            if (c->slots[i].resp) sem_close(c->slots[i].resp);
        }
        free(c->slots);
        c->slots = NULL;
        c->n_leased = 0;
    }
    return rc;
}

/* One attempt: open, wait for READY (within the deadline), lease. */
static int attach_once(kalos_client *c, uid_t expected, int group_ok, unsigned want, uint64_t deadline) {
    int rc = open_objects(c, expected, group_ok);
    if (rc) return rc;
    for (;;) {
        uint32_t state = ld32(hdr(c, KALOS_HDR_STATE));
        rc = check_alive(c);
        if (rc) return rc;
        if (state == KALOS_SIDECARSTATE_READY) break;
        if (deadline == 0 || now_ns() >= deadline)
            return fail(KALOS_E_UNAVAILABLE, "broker '%s': the sidecar is still starting (loading)", c->name);
        sleep_ns(5 * NS_PER_MS);
    }
    return lease(c, want);
}

static kalos_client *new_client(const char *name, unsigned spin_us) {
    kalos_client *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    snprintf(c->name, sizeof c->name, "%s", name);
    c->shm_fd = c->leases_fd = -1;
    c->pid = getpid();
    c->start_ticks = start_ticks_of_self();
    c->spin_ns = (uint64_t)spin_us * 1000ULL;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->freed, &ca);
    pthread_condattr_destroy(&ca);
    return c;
}

kalos_client *kalos_open_with(const char *name, const kalos_options *opts, int *err) {
    kalos_options o = KALOS_OPTIONS_INIT;
    if (opts) o = *opts;
    int dummy;
    if (!err) err = &dummy;
    if (!name || !valid_broker_name(name)) {
        *err = fail(KALOS_E_INVALID, "broker name must match ^[A-Za-z0-9_-]{1,40}$, got '%s'", name ? name : "(null)");
        return NULL;
    }
    uid_t expected = o.sidecar_uid == (uid_t)-1 ? geteuid() : o.sidecar_uid;
    int group_ok = o.sidecar_uid != (uid_t)-1;
    unsigned want = o.slots ? o.slots : 1;
    uint64_t deadline = o.connect_timeout_ms < 0 ? UINT64_MAX : now_ns() + (uint64_t)o.connect_timeout_ms * NS_PER_MS;
    if (o.connect_timeout_ms == 0) deadline = 0;
    for (;;) {
        kalos_client *c = new_client(name, o.spin_us);
        if (!c) {
            *err = fail(KALOS_E_SYSTEM, "out of memory");
            return NULL;
        }
        int rc = attach_once(c, expected, group_ok, want, deadline);
        if (rc == KALOS_OK) {
            *err = KALOS_OK;
            return c;
        }
        detach(c);
        /* A sidecar that is absent, starting or being replaced, and slots being reclaimed, are
         * worth waiting for; the rest is final. */
        int again = rc == KALOS_E_UNAVAILABLE || rc == KALOS_E_SLOTS_EXHAUSTED;
        if (!again || deadline == 0 || now_ns() + RETRY_NS >= deadline) {
            *err = rc;
            return NULL;
        }
        sleep_ns(RETRY_NS);
    }
}

kalos_client *kalos_open(const char *name, uid_t sidecar_uid, int *err) {
    kalos_options o = KALOS_OPTIONS_INIT;
    o.sidecar_uid = sidecar_uid;
    return kalos_open_with(name, &o, err);
}

void kalos_close(kalos_client *c) {
    if (!c) return;
    if (getpid() == c->pid) give_back(c, c->slots, c->n_leased);
    detach(c);
}

size_t kalos_dim(const kalos_client *c) { return c ? (size_t)c->g.dim : 0; }
unsigned kalos_max_k(const kalos_client *c) { return c ? (unsigned)c->g.max_k : 0; }
size_t kalos_max_queries(const kalos_client *c) { return c ? (size_t)c->g.max_queries : 0; }
unsigned kalos_slots(const kalos_client *c) { return c ? c->n_leased : 0; }

const char *kalos_metric(const kalos_client *c) {
    if (!c) return "unknown";
    switch (c->metric) {
    case KALOS_METRIC_DOT: return "dot";
    case KALOS_METRIC_COSINE: return "cosine";
    case KALOS_METRIC_L2: return "l2";
    default: return "unknown";
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Latency accounting in the slot's stats block (docs/protocol.md, "Client stats block"). */

typedef enum { REC_OK, REC_ERROR, REC_TIMEOUT } rec_kind;

static void record(kalos_slot *s, unsigned op, rec_kind kind, uint64_t latency_ns) {
    uint8_t *st = s->stats;
    if (kind != REC_OK) {
        uint8_t *p = st + (kind == REC_TIMEOUT ? KALOS_STATS_TIMEOUT_COUNT : KALOS_STATS_ERR_COUNT) + 8 * op;
        uint64_t v = ld64(p);
        if (v == UINT64_MAX) goto reset;
        st64(p, v + 1);
        return;
    }
    uint64_t lat = latency_ns < KALOS_RING_NS_MAX ? latency_ns : KALOS_RING_NS_MAX;
    uint8_t *hist = st + KALOS_HIST_OFFSET + 8 * ((uint64_t)op * KALOS_HIST_BUCKETS + kalos_latency_bucket(lat));
    uint8_t *sum = st + KALOS_STATS_LAT_SUM_NS + 8 * op;
    uint64_t h = ld64(hist), total = ld64(sum), n = ld64(st + KALOS_STATS_LAT_COUNT);
    if (h == UINT64_MAX || total > UINT64_MAX - lat || n == UINT64_MAX) goto reset;
    st64(hist, h + 1);
    st64(sum, total + lat);
    st64(st + KALOS_RING_OFFSET + 8 * (n % KALOS_RING_LEN), (uint64_t)op << KALOS_RING_OP_SHIFT | lat);
    st64(st + KALOS_STATS_LAT_COUNT, n + 1); /* last: the exporter reads the ring up to this index */
    return;
reset:
    /* A counter an earlier owner left at its limit (what a client wrote is untrusted): the block
     * starts over; the exporter reads the decrease as a new owner's reset. */
    memset(st, 0, KALOS_STATS_BYTES);
}

/* ------------------------------------------------------------------------------------------ */
/* One request in one slot. */

/* Take a slot of this client (one with nothing in flight first) within the deadline. */
static int take_slot(kalos_client *c, uint64_t deadline, kalos_slot **out) {
    pthread_mutex_lock(&c->mu);
    for (;;) {
        kalos_slot *best = NULL;
        for (unsigned i = 0; i < c->n_leased; i++) {
            kalos_slot *s = &c->slots[i];
            if (s->taken) continue;
            if (!s->pending) {
                best = s;
                break;
            }
            if (!best) best = s;
        }
        if (best) {
            best->taken = 1;
            pthread_mutex_unlock(&c->mu);
            *out = best;
            return KALOS_OK;
        }
        if (deadline == 0) {
            pthread_cond_wait(&c->freed, &c->mu);
            continue;
        }
        if (now_ns() >= deadline) break;
        struct timespec ts = {(time_t)(deadline / 1000000000ULL), (long)(deadline % 1000000000ULL)};
        pthread_cond_timedwait(&c->freed, &c->mu, &ts);
    }
    pthread_mutex_unlock(&c->mu);
    return fail(KALOS_E_TIMEOUT, "broker '%s': no free slot within the time budget (this client leases %u; "
                "kalos_options.slots sets how many)", c->name, c->n_leased);
}

static void put_slot(kalos_client *c, kalos_slot *s) {
    pthread_mutex_lock(&c->mu);
    s->taken = 0;
    pthread_cond_signal(&c->freed);
    pthread_mutex_unlock(&c->mu);
}

/* Wait for the slot's answer and consume its response post (the fence before reading it): poll
 * for the spin window, then block on the semaphore in slices, checking liveness between them. */
static int await_answer(kalos_client *c, kalos_slot *s, uint64_t deadline) {
    uint64_t t0 = now_ns();
    while (now_ns() - t0 < c->spin_ns) {
        if (ld32(s->ctl + KALOS_SLOT_STATE) == KALOS_SLOTSTATE_DONE && sem_trywait(s->resp) == 0) return KALOS_OK;
        cpu_relax();
    }
    for (;;) {
        uint64_t now = now_ns(), slice = SLICE_NS;
        if (deadline && now >= deadline)
            return fail(KALOS_E_TIMEOUT, "broker '%s': no answer within the time budget", c->name);
        if (deadline && deadline - now < slice) slice = deadline - now;
        struct timespec ts; /* sem_timedwait counts on CLOCK_REALTIME; the deadline is monotonic */
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t nsec = (uint64_t)ts.tv_nsec + slice;
        ts.tv_sec += (time_t)(nsec / 1000000000ULL);
        ts.tv_nsec = (long)(nsec % 1000000000ULL);
        if (sem_timedwait(s->resp, &ts) == 0) return KALOS_OK;
        if (errno != ETIMEDOUT && errno != EINTR)
            return fail(KALOS_E_UNAVAILABLE, "broker '%s': slot %u: %s", c->name, s->index, strerror(errno));
        int rc = check_alive(c);
        if (rc) return rc;
    }
}

/* An answer is in (its response post consumed): the slot's state must say DONE and the answer
 * must be to this request. Returns the checked status, n_results and blob_len. */
static int answer_of(kalos_client *c, kalos_slot *s, int32_t *status, uint32_t *n, uint32_t *blob_len) {
    uint32_t state = ld32(s->ctl + KALOS_SLOT_STATE);
    uint64_t echo = ld64(s->ctl + KALOS_SLOT_RESP_GENERATION);
    *status = (int32_t)ld32(s->ctl + KALOS_SLOT_STATUS);
    *n = ld32(s->ctl + KALOS_SLOT_N_RESULTS);
    *blob_len = ld32(s->ctl + KALOS_SLOT_BLOB_LEN);
    if (state != KALOS_SLOTSTATE_DONE)
        return fail(KALOS_E_PROTOCOL, "broker '%s': slot %u: an answer was posted in state %u, not DONE", c->name,
                    s->index, state);
    if (echo != s->generation)
        return fail(KALOS_E_PROTOCOL, "broker '%s': slot %u: response for request %llu, expected %llu", c->name,
                    s->index, (unsigned long long)echo, (unsigned long long)s->generation);
    if (*blob_len > c->g.blob_bytes)
        return fail(KALOS_E_PROTOCOL, "broker '%s': slot %u: blob_len %u beyond the blob area (%llu bytes)", c->name,
                    s->index, *blob_len, (unsigned long long)c->g.blob_bytes);
    return KALOS_OK;
}

/* Before a new request: finish the one a caller gave up on (its late answer consumed and
 * dropped), within this call's budget. */
static int finish_pending(kalos_client *c, kalos_slot *s, uint64_t deadline) {
    if (!s->pending) return KALOS_OK;
    int rc = await_answer(c, s, deadline);
    if (rc) return rc;
    s->pending = 0;
    st32(s->ctl + KALOS_SLOT_STATE, KALOS_SLOTSTATE_FREE);
    return KALOS_OK;
}

/* Write the request's header fields and post it (docs/protocol.md, "A request"): every field,
 * then state POSTED, then the request semaphore, then the doorbell if the sidecar sleeps. The
 * data areas are already written. */
static int post(kalos_client *c, kalos_slot *s, uint32_t op, const char *ns, size_t ns_len, uint32_t k, uint32_t nq,
                uint32_t blob_len) {
    uint8_t *ctl = s->ctl;
    s->generation++;
    st64(ctl + KALOS_SLOT_GENERATION, s->generation);
    st32(ctl + KALOS_SLOT_OP, op);
    st32(ctl + KALOS_SLOT_K, k);
    st32(ctl + KALOS_SLOT_NQ, nq);
    st32(ctl + KALOS_SLOT_FLAGS, 0);
    st32(ctl + KALOS_SLOT_BLOB_LEN, blob_len);
    st32(ctl + KALOS_SLOT_NS_LEN, (uint32_t)ns_len);
    memcpy(ctl + KALOS_SLOT_NAMESPACE, ns, ns_len);
    st64(ctl + KALOS_SLOT_T_POST_NS, now_ns());
    st32(ctl + KALOS_SLOT_STATE, KALOS_SLOTSTATE_POSTED); /* last field */
    if (sem_post(s->req) != 0) {
        st32(ctl + KALOS_SLOT_STATE, KALOS_SLOTSTATE_FREE);
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': slot %u: %s", c->name, s->index, strerror(errno));
    }
    /* The Dekker handshake: POSTED and the post, a full fence, then the flag. sem_post is a full
     * fence on x86-64; this fence makes it one on every architecture. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (ld32(hdr(c, KALOS_HDR_SIDECAR_SLEEPING)) && sem_post(c->bell) != 0)
        return fail(KALOS_E_UNAVAILABLE, "broker '%s': doorbell: %s", c->name, strerror(errno));
    return KALOS_OK;
}

/* A request's parameters; the data areas are written by `fill` once the slot is ours. */
typedef struct request {
    uint32_t op, k, nq;
    unsigned latency_op;
    const char *ns;
    size_t ns_len;
    uint64_t t0; /* when the request's latency starts */
    /* request data */
    const float *vectors; /* nq x dim, or NULL */
    const int64_t *ids;   /* nq, or NULL */
    const char *const *payloads; /* nq JSON texts (NULL entries: none), or NULL */
    const char *const *texts;    /* nq texts of an EMBED (each with its NUL), or NULL */
    float *vectors_out;          /* an EMBED's answer: nq x dim */
    /* recall answers */
    int64_t *ids_out;
    float *scores_out;
    uint32_t n; /* n_results of the answer */
} request;

/* Copy the request's rows into the slot's data areas; returns blob_len. */
static uint32_t fill(kalos_client *c, kalos_slot *s, const request *r) {
    if (r->vectors) memcpy(s->data + kalos_query_offset(&c->g), r->vectors, (size_t)r->nq * c->g.dim * sizeof(float));
    if (r->ids) memcpy(s->data + c->ids_off, r->ids, (size_t)r->nq * sizeof(int64_t));
    uint32_t len = 0;
    if (r->texts) {
        uint8_t *blob = s->data + c->blob_off;
        for (uint32_t i = 0; i < r->nq; i++) {
            size_t n = strlen(r->texts[i]) + 1; /* with its NUL: texts end to end (docs/protocol.md) */
            memcpy(blob + len, r->texts[i], n);
            len += (uint32_t)n;
        }
    }
    if (r->payloads) {
        uint8_t *blob = s->data + c->blob_off;
        for (uint32_t i = 0; i < r->nq; i++) {
            const char *p = r->payloads[i] ? r->payloads[i] : "null";
            size_t n = strlen(p);
            if (i) blob[len++] = '\n';
            memcpy(blob + len, p, n);
            len += (uint32_t)n;
        }
    }
    return len;
}

/* Send one request and read its answer, within the deadline (0: none). */
static int roundtrip(kalos_client *c, request *r, uint64_t deadline) {
    if (getpid() != c->pid)
        return fail(KALOS_E_INVALID,
                    "this client was opened in process %lld and cannot be used in process %lld (a fork): open one "
                    "in each process after forking",
                    (long long)c->pid, (long long)getpid());
    kalos_slot *s = NULL;
    int rc = take_slot(c, deadline, &s);
    if (rc) return rc;
    rc = finish_pending(c, s, deadline);
    if (rc == KALOS_OK && quiet(c)) rc = check_alive(c);
    if (rc) {
        if (rc == KALOS_E_TIMEOUT) record(s, r->latency_op, REC_TIMEOUT, 0);
        put_slot(c, s);
        return rc;
    }
    st32(s->ctl + KALOS_SLOT_STATE, KALOS_SLOTSTATE_WRITING);
    uint32_t blob_len = fill(c, s, r);
    rc = post(c, s, r->op, r->ns, r->ns_len, r->k, r->nq, blob_len);
    if (rc == KALOS_OK) rc = await_answer(c, s, deadline);
    if (rc) {
        /* Posted and not answered: the request stays in the slot until its answer is consumed. */
        if (ld32(s->ctl + KALOS_SLOT_STATE) != KALOS_SLOTSTATE_FREE) s->pending = 1;
        if (rc == KALOS_E_TIMEOUT) record(s, r->latency_op, REC_TIMEOUT, 0);
        put_slot(c, s);
        return rc;
    }
    int32_t status;
    uint32_t n, blen;
    rc = answer_of(c, s, &status, &n, &blen);
    if (rc == KALOS_OK && status != KALOS_STATUS_OK) {
        const char *name = status_name(status);
        char text[512];
        size_t len = blen < sizeof text - 1 ? blen : sizeof text - 1;
        memcpy(text, s->data + c->blob_off, len);
        text[len] = 0;
        for (size_t i = 0; i < len; i++) /* the sidecar's text, printable whatever it holds */
            if ((unsigned char)text[i] < 0x20 || text[i] == 0x7f) text[i] = '?';
        if (name)
            rc = fail(kalos_error_of_status(status), "%s: %s", name, text);
        else
            rc = fail(KALOS_E_PROTOCOL, "status %d: %s", (int)status, text);
    }
    if (rc == KALOS_OK && n > (r->op == KALOS_OP_RECALL ? r->k : r->nq))
        rc = fail(KALOS_E_PROTOCOL, "broker '%s': slot %u: n_results %u for %u asked", c->name, s->index, n,
                  r->op == KALOS_OP_RECALL ? r->k : r->nq);
    if (rc == KALOS_OK && r->op == KALOS_OP_EMBED && n != r->nq)
        rc = fail(KALOS_E_PROTOCOL, "broker '%s': slot %u: %u vectors for %u texts", c->name, s->index, n, r->nq);
    if (rc == KALOS_OK && r->op == KALOS_OP_EMBED)
        memcpy(r->vectors_out, s->data + kalos_query_offset(&c->g), (size_t)n * c->g.dim * sizeof(float));
    if (rc == KALOS_OK && r->op == KALOS_OP_RECALL) {
        const uint8_t *ids = s->data + c->rids_off, *scores = s->data + c->rscores_off;
        for (uint32_t j = 0; j < r->nq; j++) {
            memcpy(r->ids_out + (size_t)j * r->k, ids + 8 * (size_t)j * c->g.max_k, 8 * (size_t)n);
            memcpy(r->scores_out + (size_t)j * r->k, scores + 4 * (size_t)j * c->g.max_k, 4 * (size_t)n);
        }
    }
    r->n = n;
    record(s, r->latency_op, rc == KALOS_OK ? REC_OK : REC_ERROR, now_ns() - r->t0);
    st32(s->ctl + KALOS_SLOT_STATE, KALOS_SLOTSTATE_FREE);
    put_slot(c, s);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* The calls. */

static int check_common(const kalos_client *c, const char *ns, size_t *ns_len) {
    if (!c) return fail(KALOS_E_INVALID, "no client (NULL)");
    *ns_len = namespace_len(ns);
    if (!*ns_len)
        return fail(KALOS_E_INVALID, "namespace must match ^[A-Za-z0-9_.:@-]{1,64}$, got '%s'", ns ? ns : "(null)");
    return KALOS_OK;
}

static int check_vectors(const kalos_client *c, const float *v, size_t rows, size_t dim, const char *what) {
    if (!v) return fail(KALOS_E_INVALID, "%s: NULL vectors", what);
    if (dim != c->g.dim)
        return fail(KALOS_E_INVALID, "%s: vectors of dim %zu; the sidecar's dim is %llu", what, dim,
                    (unsigned long long)c->g.dim);
    for (size_t i = 0; i < rows * dim; i++)
        if (!isfinite(v[i]))
            return fail(KALOS_E_INVALID, "%s: row %zu holds NaN or infinity", what, i / dim);
    return KALOS_OK;
}

static int check_ids(const int64_t *ids, size_t n, const char *what) {
    if (!ids) return fail(KALOS_E_INVALID, "%s: NULL ids", what);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0)
            return fail(KALOS_E_INVALID, "%s: ids must be >= 0, got %lld at %zu", what, (long long)ids[i], i);
    return KALOS_OK;
}

static int recall_rows(kalos_client *c, const char *ns, const float *q, size_t nq, size_t dim, unsigned k,
                       int timeout_ms, int64_t *ids_out, float *scores_out, size_t *n_out, unsigned latency_op,
                       const char *what) {
    uint64_t t0 = now_ns();
    size_t ns_len;
    int rc = check_common(c, ns, &ns_len);
    if (rc) return rc;
    if (k < 1 || k > c->g.max_k)
        return fail(KALOS_E_INVALID, "%s: k must be in 1..%llu, got %u", what, (unsigned long long)c->g.max_k, k);
    if (nq < 1 || nq > c->g.max_queries)
        return fail(KALOS_E_INVALID, "%s: %zu queries; 1..%llu fit one slot", what, nq,
                    (unsigned long long)c->g.max_queries);
    if (!ids_out || !scores_out || !n_out) return fail(KALOS_E_INVALID, "%s: NULL output", what);
    rc = check_vectors(c, q, nq, dim, what);
    if (rc) return rc;
    request r = {.op = KALOS_OP_RECALL, .k = k, .nq = (uint32_t)nq, .latency_op = latency_op, .ns = ns,
                 .ns_len = ns_len, .t0 = t0, .vectors = q, .ids_out = ids_out, .scores_out = scores_out};
    rc = roundtrip(c, &r, deadline_of(timeout_ms, t0));
    *n_out = rc == KALOS_OK ? r.n : 0;
    return rc;
}

int kalos_recall(kalos_client *c, const char *ns, const float *query, size_t dim, unsigned k, int timeout_ms,
                 int64_t *ids_out, float *scores_out, size_t *n_out) {
    return recall_rows(c, ns, query, 1, dim, k, timeout_ms, ids_out, scores_out, n_out, KALOS_LATENCYOP_RECALL,
                       "recall");
}

int kalos_recall_many(kalos_client *c, const char *ns, const float *queries, size_t nq, size_t dim, unsigned k,
                      int timeout_ms, int64_t *ids_out, float *scores_out, size_t *n_out) {
    return recall_rows(c, ns, queries, nq, dim, k, timeout_ms, ids_out, scores_out, n_out,
                       KALOS_LATENCYOP_RECALL_MANY, "recall_many");
}

/* The rows of one chunk from `lo`: at most max_queries, and payload lines that fit the blob. */
static size_t chunk_end(const kalos_client *c, const char *const *payloads, size_t lo, size_t n) {
    size_t hi = lo;
    uint64_t bytes = 0;
    while (hi < n && hi - lo < c->g.max_queries) {
        if (payloads) {
            uint64_t need = bytes + (hi > lo) + strlen(payloads[hi] ? payloads[hi] : "null");
            if (need > c->g.blob_bytes) break;
            bytes = need;
        }
        hi++;
    }
    return hi;
}

/* Chunks of one write, one after the other within one budget; each timed from its own sending. */
static int write_chunks(kalos_client *c, uint32_t op, const char *ns, size_t ns_len, const int64_t *ids,
                        const float *vectors, const char *const *payloads, size_t n, int timeout_ms,
                        uint64_t *done_out) {
    uint64_t deadline = deadline_of(timeout_ms, now_ns()), done = 0;
    int rc = KALOS_OK;
    for (size_t lo = 0; lo < n && rc == KALOS_OK;) {
        size_t hi = op == KALOS_OP_UPSERT ? chunk_end(c, payloads, lo, n)
                                          : (n - lo < c->g.max_queries ? n : lo + c->g.max_queries);
        if (hi == lo) { /* (every payload was checked to fit alone) */
            rc = fail(KALOS_E_PAYLOAD_TOO_LARGE, "upsert: the payload of row %zu does not fit a slot", lo);
            break;
        }
        if (deadline && now_ns() >= deadline) {
            rc = fail(KALOS_E_TIMEOUT, "broker '%s': the time budget ran out after %zu of %zu rows", c->name, lo, n);
            break;
        }
        request r = {.op = op, .nq = (uint32_t)(hi - lo), .ns = ns, .ns_len = ns_len, .t0 = now_ns(),
                     .latency_op = op == KALOS_OP_UPSERT ? KALOS_LATENCYOP_UPSERT : KALOS_LATENCYOP_DELETE,
                     .vectors = vectors ? vectors + lo * c->g.dim : NULL, .ids = ids + lo,
                     .payloads = payloads ? payloads + lo : NULL};
        rc = roundtrip(c, &r, deadline);
        if (rc == KALOS_OK) done += r.n;
        lo = hi;
    }
    if (done_out) *done_out = done;
    return rc;
}

int kalos_upsert(kalos_client *c, const char *ns, const int64_t *ids, const float *vectors, size_t n, size_t dim,
                 const char *const *payloads, int timeout_ms, uint64_t *written_out) {
    if (written_out) *written_out = 0;
    size_t ns_len;
    int rc = check_common(c, ns, &ns_len);
    if (rc) return rc;
    if (n < 1) return fail(KALOS_E_INVALID, "upsert: no rows");
    if ((rc = check_ids(ids, n, "upsert")) || (rc = check_vectors(c, vectors, n, dim, "upsert"))) return rc;
    for (size_t i = 0; payloads && i < n; i++) {
        if (!payloads[i]) continue;
        size_t len = strlen(payloads[i]);
        if (len == 0) return fail(KALOS_E_INVALID, "upsert: payload of row %zu is empty (NULL for none)", i);
        if (memchr(payloads[i], '\n', len))
            return fail(KALOS_E_INVALID, "upsert: payload of row %zu holds a newline (one JSON line each)", i);
        uint64_t limit = c->payload_limit && c->payload_limit < c->g.blob_bytes ? c->payload_limit : c->g.blob_bytes;
        if (len > limit)
            return fail(KALOS_E_PAYLOAD_TOO_LARGE,
                        "upsert: payload of row %zu is %zu bytes; the sidecar takes at most %llu (--payload-limit, "
                        "and the slot's blob area); nothing was sent",
                        i, len, (unsigned long long)limit);
    }
    return write_chunks(c, KALOS_OP_UPSERT, ns, ns_len, ids, vectors, payloads, n, timeout_ms, written_out);
}

int kalos_delete(kalos_client *c, const char *ns, const int64_t *ids, size_t n, int timeout_ms,
                 uint64_t *deleted_out) {
    if (deleted_out) *deleted_out = 0;
    size_t ns_len;
    int rc = check_common(c, ns, &ns_len);
    if (rc) return rc;
    if (n < 1) return fail(KALOS_E_INVALID, "delete: no ids");
    if ((rc = check_ids(ids, n, "delete"))) return rc;
    return write_chunks(c, KALOS_OP_DELETE, ns, ns_len, ids, NULL, NULL, n, timeout_ms, deleted_out);
}

size_t kalos_embed_dim(const kalos_client *c) { return c ? ld32(hdr(c, KALOS_HDR_EMBED_DIM)) : 0; }

int kalos_embed(kalos_client *c, const char *const *texts, size_t n, int timeout_ms, float *vectors_out) {
    uint64_t t0 = now_ns();
    if (!c) return fail(KALOS_E_INVALID, "no client (NULL)");
    if (!kalos_embed_dim(c))
        return fail(KALOS_E_INVALID, "broker '%s': the sidecar serves no embedding model (start it with --embed DIR)",
                    c->name);
    if (n < 1 || !texts || !vectors_out) return fail(KALOS_E_INVALID, "embed: no texts, or NULL output");
    for (size_t i = 0; i < n; i++) {
        if (!texts[i]) return fail(KALOS_E_INVALID, "embed: text %zu is NULL", i);
        size_t len = strlen(texts[i]), blank = 0;
        while (blank < len && strchr(" \t\n\r\v\f", texts[i][blank])) blank++;
        if (blank == len) return fail(KALOS_E_INVALID, "embed: text %zu is empty (or only whitespace)", i);
        if (len > KALOS_MAX_TEXT_BYTES || len + 1 > c->g.blob_bytes)
            return fail(KALOS_E_INVALID, "embed: text %zu is %zu bytes; the most is %d (and a slot's blob area)", i,
                        len, KALOS_MAX_TEXT_BYTES);
    }
    uint64_t deadline = deadline_of(timeout_ms, t0);
    for (size_t lo = 0; lo < n;) {
        size_t hi = lo;
        uint64_t bytes = 0;
        while (hi < n && hi - lo < c->g.max_queries && bytes + strlen(texts[hi]) + 1 <= c->g.blob_bytes)
            bytes += strlen(texts[hi++]) + 1;
        if (deadline && now_ns() >= deadline)
            return fail(KALOS_E_TIMEOUT, "broker '%s': the time budget ran out after %zu of %zu texts", c->name, lo, n);
        request r = {.op = KALOS_OP_EMBED, .nq = (uint32_t)(hi - lo), .latency_op = KALOS_LATENCYOP_OTHER, .ns = "",
                     .ns_len = 0, .t0 = now_ns(), .texts = texts + lo, .vectors_out = vectors_out + lo * c->g.dim};
        int rc = roundtrip(c, &r, deadline);
        if (rc) return rc;
        lo = hi;
    }
    return KALOS_OK;
}
