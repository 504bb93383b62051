/* kalos.clients._cslot: the client's byte work on the slot path, compiled (issue 25).
 *
 * Byte work only: every decision (routing, batching, timeouts, cancellation, re-attach,
 * coalescing, which ops go this way) stays in Python (clients/_exchange.py, clients/pool.py);
 * clients/_transport.py is the only caller and maps OSError to Kalos errors. What is here:
 *
 *   Sem        a named POSIX semaphore the sidecar created: sem_open of an existing name (never
 *              O_CREAT), post / trywait / wait(timeout) / close. A close while another thread
 *              waits is deferred until that wait returns (no sem_t is unmapped under a waiter).
 *   Slot       one leased slot of a mapped segment: post (header fields, POSTED, the request
 *              post, the doorbell if the sidecar sleeps), post_rows (a recall's rows, then the
 *              same), answered (DONE and the response post consumed), read_hits (generation
 *              echo, blob_len and n_results bounds, status, then new ids/scores arrays and Hits),
 *              record (the stats block), set_free.
 *   as_row(s)  the fast check of float32 vectors (what kalos.broker.validation.as_vectors
 *              returns for them): a (1, dim) view of one vector, or the (n, dim) matrix itself,
 *              or None for anything else (Python then applies the full rule, and its errors).
 *
 * Offsets inside the control block and stats block come from kalos_protocol.h (generated from
 * broker/layout.py); the segment geometry (where this slot's blocks and areas are) is passed in
 * from Layout, and checked against the buffer here. PROTOCOL exposes every constant compiled in,
 * so the loader (and tests/unit/test_cslot.py) refuse a build made against another layout.
 *
 * Everything the sidecar (or anyone able to write the segment) wrote is untrusted: each field is
 * read once, checked, then used; nothing read from shared memory sizes a copy unchecked.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kalos_protocol.h"

/* glibc >= 2.30 waits on CLOCK_MONOTONIC (a wall-clock step cannot stretch a wait). */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
#define KALOS_HAVE_CLOCKWAIT 1
#endif

#define N_BOUNDS (KALOS_HIST_BUCKETS - 1) /* the last bucket is +Inf */

/* -------------------------------------------------------------------------------- shared words */

static inline uint32_t ld32(const char *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_RELAXED); }
static inline uint64_t ld64(const char *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_RELAXED); }
static inline void st32(char *p, uint32_t v) { __atomic_store_n((uint32_t *)p, v, __ATOMIC_RELAXED); }
static inline void st64(char *p, uint64_t v) { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELAXED); }

static PyObject *ProtocolError; /* kalos.broker.errors.ProtocolError, given by configure() */
static PyObject *HitsType;      /* kalos.clients.results.Hits, given by configure() */

/* ------------------------------------------------------------------------------------------ Sem */

typedef struct {
    PyObject_HEAD
    sem_t *sem;
    PyObject *name;
    int waiters; /* threads inside wait() with the GIL released */
    int closed;
} SemObject;

static PyTypeObject SemType;

static PyObject *sem_error(SemObject *s, int err) {
    errno = err;
    return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, s->name);
}

static int sem_usable(SemObject *s) {
    if (s->closed || s->sem == NULL) {
        sem_error(s, EBADF);
        return 0;
    }
    return 1;
}

static void sem_really_close(SemObject *s) {
    if (s->sem != NULL && s->waiters == 0) {
        sem_close(s->sem);
        s->sem = NULL;
    }
}

static int Sem_init(SemObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name", NULL};
    PyObject *name;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "U:Sem", kwlist, &name)) return -1;
    const char *cname = PyUnicode_AsUTF8(name);
    if (cname == NULL) return -1;
    if (self->sem != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Sem is initialised once");
        return -1;
    }
    Py_INCREF(name);
    Py_XSETREF(self->name, name);
    sem_t *sem = sem_open(cname, 0); /* attach only: the sidecar creates, a client never does */
    if (sem == SEM_FAILED) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
        return -1;
    }
    self->sem = sem;
    return 0;
}

static void Sem_dealloc(SemObject *self) {
    sem_really_close(self);
    Py_XDECREF(self->name);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int sem_post_checked(SemObject *s) {
    if (!sem_usable(s)) return -1;
    if (sem_post(s->sem) != 0) {
        sem_error(s, errno);
        return -1;
    }
    return 0;
}

/* 1 taken, 0 not posted, -1 error set */
static int sem_trywait_checked(SemObject *s) {
    if (!sem_usable(s)) return -1;
    for (;;) {
        if (sem_trywait(s->sem) == 0) return 1;
        if (errno == EAGAIN) return 0;
        if (errno != EINTR) {
            sem_error(s, errno);
            return -1;
        }
    }
}

static PyObject *Sem_post(SemObject *self, PyObject *Py_UNUSED(ignored)) {
    if (sem_post_checked(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Sem_trywait(SemObject *self, PyObject *Py_UNUSED(ignored)) {
    int r = sem_trywait_checked(self);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyObject *Sem_wait(SemObject *self, PyObject *arg) {
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (timeout != timeout) {
        PyErr_SetString(PyExc_ValueError, "timeout is NaN");
        return NULL;
    }
    if (timeout <= 0) return Sem_trywait(self, NULL);
    if (!sem_usable(self)) return NULL;
    struct timespec ts;
#ifdef KALOS_HAVE_CLOCKWAIT
    clockid_t clock = CLOCK_MONOTONIC;
#else
    clockid_t clock = CLOCK_REALTIME; /* sem_timedwait's clock */
#endif
    clock_gettime(clock, &ts);
    if (timeout > 1e9) timeout = 1e9;
    double whole = (double)(time_t)timeout;
    ts.tv_sec += (time_t)whole;
    ts.tv_nsec += (long)((timeout - whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    sem_t *sem = self->sem;
    int rc, err;
    self->waiters++;
    Py_BEGIN_ALLOW_THREADS
#ifdef KALOS_HAVE_CLOCKWAIT
    rc = sem_clockwait(sem, clock, &ts);
#else
    rc = sem_timedwait(sem, &ts);
#endif
    err = errno;
    Py_END_ALLOW_THREADS
    self->waiters--;
    if (self->closed) sem_really_close(self); /* closed by another thread meanwhile */
    if (rc == 0) Py_RETURN_TRUE;
    if (err == ETIMEDOUT) Py_RETURN_FALSE;
    if (err == EINTR) { /* as posix_ipc's SignalError: no post; a signal handler may raise */
        if (PyErr_CheckSignals() < 0) return NULL;
        Py_RETURN_FALSE;
    }
    return sem_error(self, err);
}

static PyObject *Sem_close(SemObject *self, PyObject *Py_UNUSED(ignored)) {
    self->closed = 1;
    sem_really_close(self);
    Py_RETURN_NONE;
}

static PyMethodDef Sem_methods[] = {
    {"post", (PyCFunction)Sem_post, METH_NOARGS, "sem_post (OSError on failure)."},
    {"trywait", (PyCFunction)Sem_trywait, METH_NOARGS, "sem_trywait: True if a post was taken."},
    {"wait", (PyCFunction)Sem_wait, METH_O,
     "Wait up to timeout seconds (GIL released): True if a post was taken; False on timeout or "
     "an interrupting signal."},
    {"close", (PyCFunction)Sem_close, METH_NOARGS,
     "sem_close, deferred while another thread waits; closing twice is fine."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Sem_members[] = {
    {"name", T_OBJECT, offsetof(SemObject, name), READONLY, "the POSIX name"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SemType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kalos.clients._cslot.Sem",
    .tp_basicsize = sizeof(SemObject),
    .tp_dealloc = (destructor)Sem_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A named POSIX semaphore that exists already (sem_open without O_CREAT).",
    .tp_methods = Sem_methods,
    .tp_members = Sem_members,
    .tp_init = (initproc)Sem_init,
    .tp_new = PyType_GenericNew,
};

/* post() of a native Sem, else the object's release() (the unit tests' fake semaphores). */
static int post_any(SemObject *native, PyObject *obj) {
    if (native != NULL) return sem_post_checked(native);
    PyObject *r = PyObject_CallMethod(obj, "release", NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* 1 taken, 0 not, -1 error: trywait() of a native Sem, else the object's try_acquire(). */
static int trywait_any(SemObject *native, PyObject *obj) {
    if (native != NULL) return sem_trywait_checked(native);
    PyObject *r = PyObject_CallMethod(obj, "try_acquire", NULL);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* ----------------------------------------------------------------------------------------- Slot */

typedef struct {
    PyObject_HEAD
    Py_buffer buf; /* the segment, held: it cannot be unmapped under this object */
    int have_buf;
    char *ctl;   /* control block */
    char *stats; /* stats block */
    char *data;  /* data area */
    const char *sleeping; /* header: sidecar_sleeping */
    long index;
    uint32_t dim, max_k, max_queries;
    uint64_t blob_bytes;
    Py_ssize_t q_off, rid_off, rs_off;
    uint64_t bounds[N_BOUNDS]; /* LATENCY_BOUNDS_NS */
    PyObject *req, *resp, *bell;
    SemObject *req_n, *resp_n, *bell_n; /* the same when native, else NULL */
} SlotObject;

static PyTypeObject SlotType;

static SemObject *as_native(PyObject *o) {
    return (o != NULL && Py_TYPE(o) == &SemType) ? (SemObject *)o : NULL;
}

static int in_bounds(Py_ssize_t off, Py_ssize_t size, Py_ssize_t len) {
    return off >= 0 && size >= 0 && off <= len && size <= len - off;
}

static int Slot_init(SlotObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buffer",       "index",         "control_base",  "stats_base",
                             "data_base",    "slot_bytes",    "query_offset",  "ids_offset",
                             "result_ids_offset", "result_scores_offset", "blob_offset", "dim",
                             "max_k",        "max_queries",   "blob_bytes",    "sleeping_offset",
                             "bounds",       "req",           "resp",          "bell",
                             NULL};
    PyObject *buffer, *bounds, *req, *resp, *bell;
    long index;
    Py_ssize_t cb, sb, db, slot_bytes, q_off, id_off, rid_off, rs_off, b_off, sleeping;
    unsigned long dim, max_k, max_q;
    unsigned long long blob_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Ol" "nnnnnnnnn" "kkk" "K" "n" "OOOO:Slot", kwlist, &buffer, &index,
                                     &cb, &sb, &db, &slot_bytes, &q_off, &id_off, &rid_off, &rs_off,
                                     &b_off, &dim, &max_k, &max_q, &blob_bytes, &sleeping, &bounds,
                                     &req, &resp, &bell))
        return -1;
    if (self->have_buf) {
        PyErr_SetString(PyExc_RuntimeError, "Slot is initialised once");
        return -1;
    }
    if (dim < 1 || dim > 65536 || max_k < 1 || max_k > 16384 || max_q < 1 || max_q > 4096) {
        PyErr_SetString(PyExc_ValueError, "slot geometry out of range");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->buf, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) return -1;
    self->have_buf = 1;
    Py_ssize_t len = self->buf.len;
    /* Every area this object touches lies inside the buffer, and every word is aligned. */
    Py_ssize_t qbytes = (Py_ssize_t)(4 * (uint64_t)max_q * dim);
    Py_ssize_t rbytes = (Py_ssize_t)((uint64_t)max_q * max_k);
    int ok = in_bounds(cb, KALOS_CONTROL_BYTES, len) && in_bounds(sb, KALOS_STATS_BYTES, len) &&
             in_bounds(db, slot_bytes, len) && in_bounds(q_off, qbytes, slot_bytes) &&
             in_bounds(id_off, 8 * (Py_ssize_t)max_q, slot_bytes) &&
             in_bounds(rid_off, 8 * rbytes, slot_bytes) && in_bounds(rs_off, 4 * rbytes, slot_bytes) &&
             blob_bytes <= (uint64_t)PY_SSIZE_T_MAX && in_bounds(b_off, (Py_ssize_t)blob_bytes, slot_bytes) &&
             in_bounds(sleeping, 4, len);
    uintptr_t base = (uintptr_t)self->buf.buf;
    if (!ok || (base + cb) % 8 || (base + sb) % 8 || (base + db + rid_off) % 8 || (base + db + rs_off) % 4 ||
        (base + db + q_off) % 4 || (base + sleeping) % 4) {
        PyErr_SetString(PyExc_ValueError, "slot areas outside the segment, or misaligned");
        return -1;
    }
    PyObject *seq = PySequence_Fast(bounds, "bounds must be a sequence");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != N_BOUNDS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "bounds: %d latency bucket bounds expected", N_BOUNDS);
        return -1;
    }
    for (int j = 0; j < N_BOUNDS; j++) {
        self->bounds[j] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, j));
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    char *p = (char *)self->buf.buf;
    self->ctl = p + cb;
    self->stats = p + sb;
    self->data = p + db;
    self->sleeping = p + sleeping;
    self->index = index;
    self->dim = (uint32_t)dim;
    self->max_k = (uint32_t)max_k;
    self->max_queries = (uint32_t)max_q;
    self->blob_bytes = blob_bytes;
    self->q_off = q_off;
    self->rid_off = rid_off;
    self->rs_off = rs_off;
    Py_INCREF(req);
    Py_INCREF(resp);
    Py_INCREF(bell);
    self->req = req;
    self->resp = resp;
    self->bell = bell;
    self->req_n = as_native(req);
    self->resp_n = as_native(resp);
    self->bell_n = as_native(bell);
    return 0;
}

static void Slot_dealloc(SlotObject *self) {
    if (self->have_buf) PyBuffer_Release(&self->buf);
    Py_XDECREF(self->req);
    Py_XDECREF(self->resp);
    Py_XDECREF(self->bell);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An int argument in 0..max, else ValueError (a u32 field cannot hold it). */
static int uarg(PyObject *o, uint64_t max, const char *what, uint64_t *out) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < 0 || (uint64_t)v > max) {
        PyErr_Format(PyExc_ValueError, "%s out of range for its field", what);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns() */
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* The request header, POSTED, the request post, the doorbell if the sidecar sleeps. The data
 * areas are written already. Arguments checked by the caller. */
static int write_and_post(SlotObject *s, uint64_t gen, uint32_t op, const char *ns, Py_ssize_t ns_len,
                          uint32_t k, uint32_t nq, uint32_t flags, uint32_t blob_len) {
    char *c = s->ctl;
    st32(c + KALOS_SLOT_STATE, KALOS_SLOTSTATE_WRITING);
    st64(c + KALOS_SLOT_GENERATION, gen);
    st32(c + KALOS_SLOT_OP, op);
    st32(c + KALOS_SLOT_K, k);
    st32(c + KALOS_SLOT_NQ, nq);
    st32(c + KALOS_SLOT_FLAGS, flags);
    st32(c + KALOS_SLOT_BLOB_LEN, blob_len);
    st32(c + KALOS_SLOT_NS_LEN, (uint32_t)ns_len);
    memcpy(c + KALOS_SLOT_NAMESPACE, ns, (size_t)ns_len);
    st64(c + KALOS_SLOT_T_POST_NS, now_ns());
    /* Order matters: every field above, then POSTED (a release store: the compiler and the CPU
     * keep the writes above before it), then req (a full fence), then the doorbell only if the
     * sidecar announced that it sleeps (the handshake in docs/protocol.md). */
    __atomic_store_n((uint32_t *)(c + KALOS_SLOT_STATE), (uint32_t)KALOS_SLOTSTATE_POSTED, __ATOMIC_RELEASE);
    if (post_any(s->req_n, s->req) < 0) return -1;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n((const uint32_t *)s->sleeping, __ATOMIC_SEQ_CST)) {
        if (post_any(s->bell_n, s->bell) < 0) return -1;
    }
    return 0;
}

static int parse_gen(PyObject *o, uint64_t *gen) {
    *gen = PyLong_AsUnsignedLongLong(o);
    return (*gen == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int ns_arg(PyObject *o, const char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "namespace must be bytes");
        return -1;
    }
    *p = PyBytes_AS_STRING(o);
    *n = PyBytes_GET_SIZE(o);
    if (*n > KALOS_NAMESPACE_BYTES) {
        PyErr_Format(PyExc_ValueError, "namespace of %zd bytes (at most %d)", *n, KALOS_NAMESPACE_BYTES);
        return -1;
    }
    return 0;
}

/* post(generation, op, ns, k, nq, flags, blob_len) */
static PyObject *Slot_post(SlotObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "post(generation, op, ns, k, nq, flags, blob_len)");
        return NULL;
    }
    uint64_t gen, op, k, nq, flags, blob_len;
    const char *ns;
    Py_ssize_t ns_len;
    if (parse_gen(args[0], &gen) < 0 || uarg(args[1], UINT32_MAX, "op", &op) < 0 ||
        ns_arg(args[2], &ns, &ns_len) < 0 || uarg(args[3], UINT32_MAX, "k", &k) < 0 ||
        uarg(args[4], UINT32_MAX, "nq", &nq) < 0 || uarg(args[5], UINT32_MAX, "flags", &flags) < 0 ||
        uarg(args[6], UINT32_MAX, "blob_len", &blob_len) < 0)
        return NULL;
    if (write_and_post(self, gen, (uint32_t)op, ns, ns_len, (uint32_t)k, (uint32_t)nq, (uint32_t)flags,
                       (uint32_t)blob_len) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* rows: a C-contiguous, aligned, native float32 ndarray of shape (n, dim), 1 <= n <= max_queries. */
static int rows_arg(SlotObject *s, PyObject *o, PyArrayObject **out) {
    if (!PyArray_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "rows must be a numpy array");
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != NPY_FLOAT32 || !PyArray_ISNOTSWAPPED(a) || PyArray_NDIM(a) != 2 ||
        !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || PyArray_DIM(a, 1) != (npy_intp)s->dim ||
        PyArray_DIM(a, 0) < 1 || PyArray_DIM(a, 0) > (npy_intp)s->max_queries) {
        PyErr_Format(PyExc_ValueError,
                     "rows must be a C-contiguous float32 array of shape (n, %u), n in 1..%u", s->dim,
                     s->max_queries);
        return -1;
    }
    *out = a;
    return 0;
}

/* post_rows(generation, rows, k, ns, flags): a recall whose request is its rows and header
 * fields (no filter blob, no fleet position). */
static PyObject *Slot_post_rows(SlotObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "post_rows(generation, rows, k, ns, flags)");
        return NULL;
    }
    uint64_t gen, k, flags;
    PyArrayObject *rows;
    const char *ns;
    Py_ssize_t ns_len;
    if (parse_gen(args[0], &gen) < 0 || rows_arg(self, args[1], &rows) < 0 ||
        uarg(args[2], UINT32_MAX, "k", &k) < 0 || ns_arg(args[3], &ns, &ns_len) < 0 ||
        uarg(args[4], UINT32_MAX, "flags", &flags) < 0)
        return NULL;
    npy_intp nq = PyArray_DIM(rows, 0);
    memcpy(self->data + self->q_off, PyArray_DATA(rows), (size_t)nq * self->dim * 4);
    if (write_and_post(self, gen, KALOS_OP_RECALL, ns, ns_len, (uint32_t)k, (uint32_t)nq, (uint32_t)flags, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Slot_is_done(SlotObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(ld32(self->ctl + KALOS_SLOT_STATE) == KALOS_SLOTSTATE_DONE);
}

/* DONE, and its response post consumed (the fence before reading); no system call before DONE. */
static PyObject *Slot_answered(SlotObject *self, PyObject *Py_UNUSED(ignored)) {
    if (__atomic_load_n((const uint32_t *)(self->ctl + KALOS_SLOT_STATE), __ATOMIC_ACQUIRE) !=
        KALOS_SLOTSTATE_DONE)
        Py_RETURN_FALSE;
    int r = trywait_any(self->resp_n, self->resp);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyObject *Slot_set_free(SlotObject *self, PyObject *Py_UNUSED(ignored)) {
    __atomic_store_n((uint32_t *)(self->ctl + KALOS_SLOT_STATE), (uint32_t)KALOS_SLOTSTATE_FREE, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* A new 1-d array of n items copied from src. */
static PyObject *copied(int type, npy_intp n, const void *src, size_t itemsize) {
    PyObject *a = PyArray_SimpleNew(1, &n, type);
    if (a != NULL && n) memcpy(PyArray_DATA((PyArrayObject *)a), src, (size_t)n * itemsize);
    return a;
}

static PyObject *make_hits(const char *ids, const char *scores, npy_intp n) {
    PyObject *a = copied(NPY_INT64, n, ids, 8);
    if (a == NULL) return NULL;
    PyObject *b = copied(NPY_FLOAT32, n, scores, 4);
    if (b == NULL) {
        Py_DECREF(a);
        return NULL;
    }
    PyObject *argv[2] = {a, b};
    PyObject *h = PyObject_Vectorcall(HitsType, argv, 2, NULL);
    Py_DECREF(a);
    Py_DECREF(b);
    return h;
}

typedef struct {
    Py_ssize_t rows;
    uint64_t k;
    int single;
} Share;

/* shares: a sequence of clients._coalesce.Share (rows, k, single, ...), rows adding up to nq.
 * Returns a PyMem array of their (rows, k, single), or NULL with an error set. */
static Share *parse_shares(PyObject *obj, uint64_t nq, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(obj, "shares must be a sequence of (rows, k, single, ...)");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    Share *out = PyMem_New(Share, m > 0 ? m : 1);
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) < 3) {
            PyErr_SetString(PyExc_TypeError, "shares must be a sequence of (rows, k, single, ...)");
            goto fail;
        }
        uint64_t rows, k;
        int single = PyObject_IsTrue(PyTuple_GET_ITEM(it, 2));
        if (single < 0 || uarg(PyTuple_GET_ITEM(it, 0), nq, "rows", &rows) < 0 ||
            uarg(PyTuple_GET_ITEM(it, 1), UINT32_MAX, "k", &k) < 0)
            goto fail;
        out[i].rows = (Py_ssize_t)rows;
        out[i].k = k;
        out[i].single = single;
        total += rows;
    }
    if (total != nq) { /* clients._coalesce.split's error */
        PyErr_Format(PyExc_ValueError, "%llu rows of hits for %llu rows asked", (unsigned long long)nq,
                     (unsigned long long)total);
        goto fail;
    }
    Py_DECREF(seq);
    *count = m;
    return out;
fail:
    Py_DECREF(seq);
    PyMem_Free(out);
    return NULL;
}

/* read_hits(generation, nq, k, single, shares=None): the answer of a consumed recall without
 * payloads. Checks, in the order clients/_transport.py + clients/_requests.py check them: the
 * generation echo, blob_len within the blob area, the status (not OK: returns None, and Python
 * maps the status to its error), n_results <= k; then Hits (single) or a list of nq Hits, each
 * with new ids (int64) and scores (float32) arrays of n_results items. With shares (a shared
 * slot: clients._coalesce.Share per caller, in row order), the list is already split per caller
 * as clients._coalesce.split splits it: one Hits (single) or a list per caller, each cut to the
 * caller's own k. */
static PyObject *Slot_read_hits(SlotObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "read_hits(generation, nq, k, single, shares=None)");
        return NULL;
    }
    uint64_t gen, nq, k;
    if (parse_gen(args[0], &gen) < 0 || uarg(args[1], self->max_queries, "nq", &nq) < 0 ||
        uarg(args[2], self->max_k, "k", &k) < 0)
        return NULL;
    int single = PyObject_IsTrue(args[3]);
    if (single < 0) return NULL;
    if (HitsType == NULL || ProtocolError == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_cslot.configure() was not called");
        return NULL;
    }
    if (nq < 1 || (single && nq != 1)) {
        PyErr_SetString(PyExc_ValueError, "nq out of range for its field");
        return NULL;
    }
    Share *shares = NULL;
    Py_ssize_t n_shares = 0;
    if (nargs == 5 && args[4] != Py_None) {
        shares = parse_shares(args[4], nq, &n_shares);
        if (shares == NULL) return NULL;
    }
    PyObject *out = NULL;
    const char *c = self->ctl;
    uint64_t rgen = ld64(c + KALOS_SLOT_RESP_GENERATION);
    if (rgen != gen) {
        PyErr_Format(ProtocolError, "slot %ld: response for request %llu, expected %llu", self->index,
                     (unsigned long long)rgen, (unsigned long long)gen);
        goto done;
    }
    uint32_t blob_len = ld32(c + KALOS_SLOT_BLOB_LEN);
    if (blob_len > self->blob_bytes) {
        PyErr_Format(ProtocolError, "slot %ld: blob_len %u beyond the blob area of %llu bytes", self->index, blob_len,
                     (unsigned long long)self->blob_bytes);
        goto done;
    }
    int32_t status = (int32_t)ld32(c + KALOS_SLOT_STATUS);
    if (status != KALOS_STATUS_OK) {
        Py_INCREF(Py_None);
        out = Py_None;
        goto done;
    }
    uint32_t n = ld32(c + KALOS_SLOT_N_RESULTS);
    if (n > k) {
        PyErr_Format(ProtocolError, "slot %ld: %u results per query for k=%llu", self->index, n,
                     (unsigned long long)k);
        goto done;
    }
    const char *rid = self->data + self->rid_off, *rs = self->data + self->rs_off;
    size_t row_ids = 8 * (size_t)self->max_k, row_scores = 4 * (size_t)self->max_k;
    if (single && shares == NULL) {
        out = make_hits(rid, rs, n);
        goto done;
    }
    if (shares == NULL) {
        out = PyList_New((Py_ssize_t)nq);
        if (out == NULL) goto done;
        for (uint64_t i = 0; i < nq; i++) {
            PyObject *h = make_hits(rid + i * row_ids, rs + i * row_scores, n);
            if (h == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            PyList_SET_ITEM(out, (Py_ssize_t)i, h);
        }
        goto done;
    }
    out = PyList_New(n_shares);
    if (out == NULL) goto done;
    uint64_t row = 0;
    for (Py_ssize_t j = 0; j < n_shares; j++) {
        npy_intp cut = shares[j].k < n ? (npy_intp)shares[j].k : (npy_intp)n;
        PyObject *item;
        if (shares[j].single) { /* its first row (a recall has one) */
            item = shares[j].rows ? make_hits(rid + row * row_ids, rs + row * row_scores, cut) : NULL;
            if (!shares[j].rows) PyErr_SetString(PyExc_ValueError, "a caller of one recall with no row");
        } else {
            item = PyList_New(shares[j].rows);
            for (Py_ssize_t r = 0; item != NULL && r < shares[j].rows; r++) {
                PyObject *h = make_hits(rid + (row + r) * row_ids, rs + (row + r) * row_scores, cut);
                if (h == NULL) {
                    Py_CLEAR(item);
                    break;
                }
                PyList_SET_ITEM(item, r, h);
            }
        }
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, j, item);
        row += (uint64_t)shares[j].rows;
    }
done:
    PyMem_Free(shares);
    return out;
}

/* ClientSlot.record's effect on the stats block (see docs/protocol.md, "Client stats block"):
 * lat_in (with PyLong_AsLongLongAndOverflow's overflow) of a request of kind op (checked). A
 * counter that cannot be incremented (an earlier owner left it at 2^64-1), or a negative latency,
 * zeroes the whole block, as the Python path does when its memoryview refuses the value. */
static void do_record(SlotObject *self, long long lat_in, int overflow, int ok, int timed_out, uint64_t op) {
    char *st = self->stats;
    if (!ok) {
        char *w = st + (timed_out ? KALOS_STATS_TIMEOUT_COUNT : KALOS_STATS_ERR_COUNT) + 8 * op;
        uint64_t v = ld64(w);
        if (v == UINT64_MAX)
            memset(st, 0, KALOS_STATS_BYTES);
        else
            st64(w, v + 1);
        return;
    }
    if (overflow < 0 || (!overflow && lat_in < 0)) { /* cannot be stored: the Python path resets */
        memset(st, 0, KALOS_STATS_BYTES);
        return;
    }
    uint64_t lat = (overflow > 0 || (uint64_t)lat_in >= KALOS_RING_NS_MAX) ? KALOS_RING_NS_MAX : (uint64_t)lat_in;
    int lo = 0, hi = N_BOUNDS; /* bisect_left(LATENCY_BOUNDS_NS, lat) */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (self->bounds[mid] < lat)
            lo = mid + 1;
        else
            hi = mid;
    }
    char *hw = st + KALOS_HIST_OFFSET + 8 * ((size_t)op * KALOS_HIST_BUCKETS + (size_t)lo);
    char *sw = st + KALOS_STATS_LAT_SUM_NS + 8 * op;
    char *cw = st + KALOS_STATS_LAT_COUNT;
    uint64_t h = ld64(hw), sum = ld64(sw), n = ld64(cw);
    if (h == UINT64_MAX || sum > UINT64_MAX - lat || n == UINT64_MAX) {
        memset(st, 0, KALOS_STATS_BYTES);
        return;
    }
    st64(hw, h + 1);
    st64(sw, sum + lat);
    st64(st + KALOS_RING_OFFSET + 8 * (n % KALOS_RING_LEN), op << KALOS_RING_OP_SHIFT | lat);
    /* last: the sidecar reads the ring up to this index */
    __atomic_store_n((uint64_t *)cw, n + 1, __ATOMIC_RELEASE);
}

/* record(latency_ns, ok, timed_out, op): one finished request. */
static PyObject *Slot_record(SlotObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "record(latency_ns, ok, timed_out, op)");
        return NULL;
    }
    int overflow = 0;
    long long lat_in = PyLong_AsLongLongAndOverflow(args[0], &overflow);
    if (lat_in == -1 && PyErr_Occurred()) return NULL;
    int ok = PyObject_IsTrue(args[1]);
    int timed_out = PyObject_IsTrue(args[2]);
    if (ok < 0 || timed_out < 0) return NULL;
    uint64_t op;
    if (uarg(args[3], KALOS_LATENCY_OPS - 1, "op", &op) < 0) return NULL;
    do_record(self, lat_in, overflow, ok, timed_out, op);
    Py_RETURN_NONE;
}

/* record_shares(now, shares, gone, ok, op_single, op_many): the callers of a shared slot, each as
 * record(now - its t0, ...) of its own kind (op_single for a recall, op_many for recall_many),
 * a caller that went away (gone[i]) as a timeout. shares: clients._coalesce.Share (rows, k,
 * single, t0). */
static PyObject *Slot_record_shares(SlotObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "record_shares(now, shares, gone, ok, op_single, op_many)");
        return NULL;
    }
    long long now = PyLong_AsLongLong(args[0]);
    if (now == -1 && PyErr_Occurred()) return NULL;
    int ok = PyObject_IsTrue(args[3]);
    if (ok < 0) return NULL;
    uint64_t op_single, op_many;
    if (uarg(args[4], KALOS_LATENCY_OPS - 1, "op", &op_single) < 0 ||
        uarg(args[5], KALOS_LATENCY_OPS - 1, "op", &op_many) < 0)
        return NULL;
    PyObject *shares = PySequence_Fast(args[1], "shares must be a sequence");
    if (shares == NULL) return NULL;
    PyObject *gone = PySequence_Fast(args[2], "gone must be a sequence");
    if (gone == NULL) {
        Py_DECREF(shares);
        return NULL;
    }
    Py_ssize_t m = PySequence_Fast_GET_SIZE(shares);
    PyObject *result = NULL;
    if (PySequence_Fast_GET_SIZE(gone) != m) {
        PyErr_SetString(PyExc_ValueError, "one gone flag per share");
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) { /* all checked before any is recorded */
        PyObject *it = PySequence_Fast_GET_ITEM(shares, i);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) < 4 || !PyLong_Check(PyTuple_GET_ITEM(it, 3))) {
            PyErr_SetString(PyExc_TypeError, "shares must be a sequence of (rows, k, single, t0)");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(shares, i);
        int single = PyObject_IsTrue(PyTuple_GET_ITEM(it, 2));
        int left = PyObject_IsTrue(PySequence_Fast_GET_ITEM(gone, i));
        long long t0 = PyLong_AsLongLong(PyTuple_GET_ITEM(it, 3));
        if (single < 0 || left < 0 || (t0 == -1 && PyErr_Occurred())) goto done;
        /* now - t0 as Python computes it: exact, then clamped as record() clamps it */
        long long lat;
        int overflow = 0;
        if (__builtin_sub_overflow(now, t0, &lat)) overflow = (t0 < 0) ? 1 : -1;
        do_record(self, lat, overflow, left ? 0 : ok, left, single ? op_single : op_many);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    Py_DECREF(shares);
    Py_DECREF(gone);
    return result;
}

static PyMethodDef Slot_methods[] = {
    {"post", (PyCFunction)(void (*)(void))Slot_post, METH_FASTCALL,
     "post(generation, op, ns, k, nq, flags, blob_len): header fields, POSTED, the request post, "
     "the doorbell if the sidecar sleeps (the data areas are written already)."},
    {"post_rows", (PyCFunction)(void (*)(void))Slot_post_rows, METH_FASTCALL,
     "post_rows(generation, rows, k, ns, flags): a recall's rows into the queries area, then as post."},
    {"is_done", (PyCFunction)Slot_is_done, METH_NOARGS, "state == DONE"},
    {"answered", (PyCFunction)Slot_answered, METH_NOARGS, "DONE, and its response post consumed."},
    {"set_free", (PyCFunction)Slot_set_free, METH_NOARGS, "state = FREE"},
    {"read_hits", (PyCFunction)(void (*)(void))Slot_read_hits, METH_FASTCALL,
     "read_hits(generation, nq, k, single, shares=None) -> Hits | list[Hits] | list[Hits | list[Hits]] "
     "| None (None: an error status; shares: split per caller)."},
    {"record", (PyCFunction)(void (*)(void))Slot_record, METH_FASTCALL,
     "record(latency_ns, ok, timed_out, op): account one finished request in the stats block."},
    {"record_shares", (PyCFunction)(void (*)(void))Slot_record_shares, METH_FASTCALL,
     "record_shares(now, shares, gone, ok, op_single, op_many): record each caller of a shared slot."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kalos.clients._cslot.Slot",
    .tp_basicsize = sizeof(SlotObject),
    .tp_dealloc = (destructor)Slot_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One leased slot of a mapped segment: the client's byte work on it.",
    .tp_methods = Slot_methods,
    .tp_init = (initproc)Slot_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------------ module functions */

/* x, when it is exactly a numpy.ndarray of native float32, C-contiguous, aligned, of ndim
 * dimensions, every element finite; else NULL (no error set). */
static PyArrayObject *finite_f32(PyObject *x, int ndim) {
    if (Py_TYPE(x) != &PyArray_Type) return NULL;
    PyArrayObject *a = (PyArrayObject *)x;
    if (PyArray_TYPE(a) != NPY_FLOAT32 || !PyArray_ISNOTSWAPPED(a) || PyArray_NDIM(a) != ndim ||
        !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a))
        return NULL;
    const uint32_t *u = (const uint32_t *)PyArray_DATA(a);
    npy_intp n = PyArray_SIZE(a);
    uint32_t bad = 0;
    for (npy_intp i = 0; i < n; i++) bad |= ((u[i] & 0x7f800000u) == 0x7f800000u); /* NaN or inf */
    return bad ? NULL : a;
}

/* as_row(x, dim): x[None, :] when x is one finite float32 vector of shape (dim,) (the fast path
 * of kalos.broker.validation.as_vectors for recall); None for anything else. */
static PyObject *as_row(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "as_row(x, dim)");
        return NULL;
    }
    Py_ssize_t dim = PyLong_AsSsize_t(args[1]);
    if (dim == -1 && PyErr_Occurred()) return NULL;
    PyArrayObject *a = finite_f32(args[0], 1);
    if (a == NULL || PyArray_DIM(a, 0) != dim) Py_RETURN_NONE;
    npy_intp dims[2] = {1, dim};
    PyArray_Descr *descr = PyArray_DESCR(a);
    Py_INCREF(descr);
    int flags = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | (PyArray_ISWRITEABLE(a) ? NPY_ARRAY_WRITEABLE : 0);
    PyObject *view = PyArray_NewFromDescr(&PyArray_Type, descr, 2, dims, NULL, PyArray_DATA(a), flags, NULL);
    if (view == NULL) return NULL;
    Py_INCREF(args[0]);
    if (PyArray_SetBaseObject((PyArrayObject *)view, args[0]) < 0) {
        Py_DECREF(view);
        return NULL;
    }
    return view;
}

/* as_rows(x, dim, max_rows): x itself when it is a finite float32 matrix of shape (n, dim),
 * 1 <= n <= max_rows (as_vectors' result for recall_many, without its copies); None otherwise. */
static PyObject *as_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "as_rows(x, dim, max_rows)");
        return NULL;
    }
    Py_ssize_t dim = PyLong_AsSsize_t(args[1]);
    if (dim == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t max_rows = PyLong_AsSsize_t(args[2]);
    if (max_rows == -1 && PyErr_Occurred()) return NULL;
    PyArrayObject *a = finite_f32(args[0], 2);
    if (a == NULL || PyArray_DIM(a, 1) != dim || PyArray_DIM(a, 0) < 1 || PyArray_DIM(a, 0) > max_rows)
        Py_RETURN_NONE;
    Py_INCREF(args[0]);
    return args[0];
}

/* configure(ProtocolError, Hits): the classes this module raises and builds (it imports nothing
 * of kalos itself, so it can be loaded and checked before them). */
static PyObject *configure(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "configure(ProtocolError, Hits): two classes");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(ProtocolError, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(HitsType, args[1]);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"as_row", (PyCFunction)(void (*)(void))as_row, METH_FASTCALL,
     "as_row(x, dim) -> x[None, :] for one finite float32 vector of shape (dim,), else None."},
    {"as_rows", (PyCFunction)(void (*)(void))as_rows, METH_FASTCALL,
     "as_rows(x, dim, max_rows) -> x for a finite float32 (n, dim) matrix, n in 1..max_rows, else None."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(ProtocolError, Hits): the classes raised and built."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cslot_module = {
    PyModuleDef_HEAD_INIT, "_cslot", "The client's slot byte work, compiled.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

/* Every constant of kalos_protocol.h this file uses, by the name broker/layout.py gives it. */
static int add_protocol(PyObject *m) {
    PyObject *d = PyDict_New();
    if (d == NULL) return -1;
    struct {
        const char *name;
        unsigned long long value;
    } consts[] = {
        {"PROTOCOL_VERSION", KALOS_PROTOCOL_VERSION},
        {"CONTROL_BYTES", KALOS_CONTROL_BYTES},
        {"STATS_BYTES", KALOS_STATS_BYTES},
        {"NAMESPACE_BYTES", KALOS_NAMESPACE_BYTES},
        {"HIST_OFFSET", KALOS_HIST_OFFSET},
        {"HIST_BUCKETS", KALOS_HIST_BUCKETS},
        {"RING_OFFSET", KALOS_RING_OFFSET},
        {"RING_LEN", KALOS_RING_LEN},
        {"RING_OP_SHIFT", KALOS_RING_OP_SHIFT},
        {"RING_NS_MAX", KALOS_RING_NS_MAX},
        {"LATENCY_OPS", KALOS_LATENCY_OPS},
        {"slot.state", KALOS_SLOT_STATE},
        {"slot.op", KALOS_SLOT_OP},
        {"slot.generation", KALOS_SLOT_GENERATION},
        {"slot.k", KALOS_SLOT_K},
        {"slot.nq", KALOS_SLOT_NQ},
        {"slot.status", KALOS_SLOT_STATUS},
        {"slot.flags", KALOS_SLOT_FLAGS},
        {"slot.t_post_ns", KALOS_SLOT_T_POST_NS},
        {"slot.blob_len", KALOS_SLOT_BLOB_LEN},
        {"slot.n_results", KALOS_SLOT_N_RESULTS},
        {"slot.resp_generation", KALOS_SLOT_RESP_GENERATION},
        {"slot.ns_len", KALOS_SLOT_NS_LEN},
        {"slot.namespace", KALOS_SLOT_NAMESPACE},
        {"stats.lat_count", KALOS_STATS_LAT_COUNT},
        {"stats.lat_sum_ns", KALOS_STATS_LAT_SUM_NS},
        {"stats.err_count", KALOS_STATS_ERR_COUNT},
        {"stats.timeout_count", KALOS_STATS_TIMEOUT_COUNT},
        {"SlotState.FREE", KALOS_SLOTSTATE_FREE},
        {"SlotState.WRITING", KALOS_SLOTSTATE_WRITING},
        {"SlotState.POSTED", KALOS_SLOTSTATE_POSTED},
        {"SlotState.DONE", KALOS_SLOTSTATE_DONE},
        {"Op.RECALL", KALOS_OP_RECALL},
        {"Status.OK", KALOS_STATUS_OK},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(consts[i].value);
        if (v == NULL || PyDict_SetItemString(d, consts[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObject(m, "PROTOCOL", d) < 0) {
        Py_DECREF(d);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__cslot(void) {
    import_array();
    if (PyType_Ready(&SemType) < 0 || PyType_Ready(&SlotType) < 0) return NULL;
    PyObject *m = PyModule_Create(&cslot_module);
    if (m == NULL) return NULL;
    Py_INCREF(&SemType);
    Py_INCREF(&SlotType);
    if (PyModule_AddIntConstant(m, "PROTOCOL_VERSION", KALOS_PROTOCOL_VERSION) < 0 ||
        PyModule_AddObject(m, "Sem", (PyObject *)&SemType) < 0 ||
        PyModule_AddObject(m, "Slot", (PyObject *)&SlotType) < 0 || add_protocol(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
