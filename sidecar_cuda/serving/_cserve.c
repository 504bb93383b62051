/* kalos.sidecar_cuda.serving._cserve: the sidecar's byte work on the slot path, compiled (see setup.py).
 *
 * One object, SlotIO, made once at start over the mapped segment: it finds the posted slots,
 * takes them (sem_trywait of each request semaphore: the fence before a request is read), marks
 * a batch BUSY while copying its control blocks out (the snapshot every decision then reads),
 * gathers query rows into a staging buffer, writes a uniform batch's answers, and publishes
 * answers (stamps, state DONE, sem_post of each response semaphore). Every decision stays in
 * Python (kalos.sidecar_cuda.serving.pipeline, .batching); the Python twin of this object is
 * kalos.sidecar_cuda.serving.slotio.PySlotIO, and a unit test compares the bytes both write.
 *
 * Offsets: the control-block fields come from kalos_protocol.h (generated from broker/layout.py;
 * SlotIO.layout() reports the values compiled in, and kalos.sidecar_cuda.serving.slotio refuses a build
 * that disagrees with the layout); the data-area offsets are passed in from broker.layout.Layout
 * at construction, so nothing here computes an offset of its own.
 *
 * Untrusted input: every byte of a slot may have been written by a hostile client. Nothing here
 * indexes memory by a value read from a slot: slot and row indices come from the caller and are
 * bounds-checked against the geometry before any byte is touched (a bad one is a ValueError and
 * nothing is written); values read from a slot (k, generation) are only copied or compared.
 *
 * The semaphores are the ones the sidecar created (kalos.sidecar_cuda.serving.objects), opened again by
 * name without O_CREAT: glibc hands back the same mapping, so these are the same sem_t. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kalos_protocol.h"

/* Bounds of the geometry accepted (broker.layout.Layout.check allows less), so that every
 * product of them below fits in 64 bits. */
#define MAX_SLOTS (1u << 20)
#define MAX_DIM (1u << 20)
#define MAX_K (1u << 20)
#define MAX_QUERIES (1u << 20)

typedef struct {
    PyObject_HEAD
    Py_buffer seg; /* the mapped segment, held (exported) until close() */
    int open;
    uint32_t n_slots, dim, max_k, max_queries;
    uint64_t control_offset, data_offset, slot_bytes;
    uint64_t query_offset, result_ids_offset, result_scores_offset;
    sem_t **req;  /* n_slots entries each; SEM_FAILED never stored */
    sem_t **resp;
} SlotIO;

/* ------------------------------------------------------------------ field access */

static inline uint8_t *ctl(const SlotIO *s, int64_t i) {
    return (uint8_t *)s->seg.buf + s->control_offset + (uint64_t)i * KALOS_CONTROL_BYTES;
}

static inline uint8_t *data(const SlotIO *s, int64_t i) {
    return (uint8_t *)s->seg.buf + s->data_offset + (uint64_t)i * s->slot_bytes;
}

/* The state word is shared with clients that poll it: atomic loads and stores (the buffer is
 * checked to be 8-byte aligned, and the field offsets are multiples of their size). */
static inline uint32_t load_state(const uint8_t *c) {
    return __atomic_load_n((const uint32_t *)(c + KALOS_SLOT_STATE), __ATOMIC_RELAXED);
}

/* DONE is the last field written before the post: a release store, so that a client reading
 * state == DONE also sees the answer (the post remains the protocol's fence). */
static inline void store_state(uint8_t *c, uint32_t v, int order) {
    __atomic_store_n((uint32_t *)(c + KALOS_SLOT_STATE), v, order);
}

static inline void put_u32(uint8_t *c, int off, uint32_t v) { memcpy(c + off, &v, 4); }
static inline void put_i32(uint8_t *c, int off, int32_t v) { memcpy(c + off, &v, 4); }
static inline void put_u64(uint8_t *c, int off, uint64_t v) { memcpy(c + off, &v, 8); }
static inline uint32_t get_u32(const uint8_t *c, int off) {
    uint32_t v;
    memcpy(&v, c + off, 4);
    return v;
}
static inline uint64_t get_u64(const uint8_t *c, int off) {
    uint64_t v;
    memcpy(&v, c + off, 8);
    return v;
}

static uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ argument buffers */

static int is_int64_format(const char *f) {
    if (f == NULL) return 0;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return (f[0] == 'q' || f[0] == 'l') && f[1] == '\0';
}

static int is_float32_format(const char *f) {
    if (f == NULL) return 0;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f[0] == 'f' && f[1] == '\0';
}

/* A C-contiguous 1-d int64 array (an intp index array). */
static int get_index(PyObject *o, Py_buffer *v, int writable, const char *what) {
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (v->ndim != 1 || v->itemsize != 8 || !is_int64_format(v->format)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous 1-d int64 array", what);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

/* A C-contiguous 2-d array of int64 ('q') or float32 ('f'). */
static int get_matrix(PyObject *o, Py_buffer *v, char kind, const char *what) {
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    int ok = v->ndim == 2 && (kind == 'q' ? v->itemsize == 8 && is_int64_format(v->format)
                                          : v->itemsize == 4 && is_float32_format(v->format));
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous 2-d %s array", what, kind == 'q' ? "int64" : "float32");
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static int check_open(SlotIO *s) {
    if (!s->open) {
        PyErr_SetString(PyExc_ValueError, "the slot I/O is closed");
        return -1;
    }
    return 0;
}

/* Every index of a slot array inside [0, n_slots). */
static int check_slots(const SlotIO *s, const int64_t *idx, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        if (idx[j] < 0 || (uint64_t)idx[j] >= s->n_slots) {
            PyErr_Format(PyExc_ValueError, "slot index %lld outside 0..%u", (long long)idx[j], s->n_slots - 1);
            return -1;
        }
    }
    return 0;
}

static int check_rows(const SlotIO *s, const int64_t *rows, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        if (rows[j] < 0 || (uint64_t)rows[j] >= s->max_queries) {
            PyErr_Format(PyExc_ValueError, "row index %lld outside 0..%u", (long long)rows[j], s->max_queries - 1);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ life */

static void close_all(SlotIO *s) {
    if (s->req != NULL || s->resp != NULL) {
        for (uint32_t i = 0; i < s->n_slots; i++) {
            if (s->req != NULL && s->req[i] != NULL) sem_close(s->req[i]);
            if (s->resp != NULL && s->resp[i] != NULL) sem_close(s->resp[i]);
        }
    }
    PyMem_Free(s->req);
    PyMem_Free(s->resp);
    s->req = s->resp = NULL;
    if (s->open) {
        PyBuffer_Release(&s->seg);
        s->open = 0;
    }
}

static int open_sems(sem_t **out, PyObject *names, uint32_t n, const char *what) {
    PyObject *seq = PySequence_Fast(names, "semaphore names must be a sequence of str");
    if (seq == NULL) return -1;
    if ((uint64_t)PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd names for %u slots", what, PySequence_Fast_GET_SIZE(seq), n);
        Py_DECREF(seq);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        const char *name = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
        if (name == NULL) {
            Py_DECREF(seq);
            return -1;
        }
        sem_t *sem = sem_open(name, 0); /* exists: the sidecar created it (never O_CREAT here) */
        if (sem == SEM_FAILED) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
            Py_DECREF(seq);
            return -1;
        }
        out[i] = sem;
    }
    Py_DECREF(seq);
    return 0;
}

static int SlotIO_init(SlotIO *s, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"segment",     "n_slots",          "dim",
                             "max_k",       "max_queries",      "control_offset",
                             "data_offset", "slot_bytes",       "query_offset",
                             "result_ids_offset", "result_scores_offset", "req_names",
                             "resp_names",  NULL};
    PyObject *segment, *req_names, *resp_names;
    unsigned long long n_slots, dim, max_k, max_queries, control_offset, data_offset, slot_bytes, query_offset,
        result_ids_offset, result_scores_offset;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O$KKKKKKKKKKOO", kwlist, &segment, &n_slots, &dim, &max_k,
                                     &max_queries, &control_offset, &data_offset, &slot_bytes, &query_offset,
                                     &result_ids_offset, &result_scores_offset, &req_names, &resp_names))
        return -1;
    close_all(s); /* (__init__ called twice) */
    if (n_slots < 1 || n_slots > MAX_SLOTS || dim < 1 || dim > MAX_DIM || max_k < 1 || max_k > MAX_K ||
        max_queries < 1 || max_queries > MAX_QUERIES) {
        PyErr_SetString(PyExc_ValueError, "geometry out of range");
        return -1;
    }
    if (PyObject_GetBuffer(segment, &s->seg, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    s->open = 1;
    s->n_slots = (uint32_t)n_slots;
    s->dim = (uint32_t)dim;
    s->max_k = (uint32_t)max_k;
    s->max_queries = (uint32_t)max_queries;
    s->control_offset = control_offset;
    s->data_offset = data_offset;
    s->slot_bytes = slot_bytes;
    s->query_offset = query_offset;
    s->result_ids_offset = result_ids_offset;
    s->result_scores_offset = result_scores_offset;
    uint64_t len = (uint64_t)s->seg.len;
    /* Each term is bounded before it is added (no wrap-around with any argument values). */
    int ok = ((uintptr_t)s->seg.buf % 8 == 0) && control_offset % 8 == 0 && data_offset % 8 == 0 &&
             slot_bytes % 8 == 0 && query_offset % 4 == 0 && result_ids_offset % 8 == 0 &&
             result_scores_offset % 4 == 0 && control_offset <= len && data_offset <= len && slot_bytes <= len &&
             n_slots * KALOS_CONTROL_BYTES <= len - control_offset &&
             (slot_bytes == 0 ? 0 : n_slots <= (len - data_offset) / slot_bytes) && query_offset <= slot_bytes &&
             max_queries * dim * 4 <= slot_bytes - query_offset && result_ids_offset <= slot_bytes &&
             max_queries * max_k * 8 <= slot_bytes - result_ids_offset && result_scores_offset <= slot_bytes &&
             max_queries * max_k * 4 <= slot_bytes - result_scores_offset;
    if (!ok) {
        close_all(s);
        PyErr_SetString(PyExc_ValueError, "the geometry does not fit the segment (or is misaligned)");
        return -1;
    }
    s->req = PyMem_Calloc(n_slots, sizeof(sem_t *));
    s->resp = PyMem_Calloc(n_slots, sizeof(sem_t *));
    if (s->req == NULL || s->resp == NULL) {
        close_all(s);
        PyErr_NoMemory();
        return -1;
    }
    if (open_sems(s->req, req_names, s->n_slots, "req_names") < 0 ||
        open_sems(s->resp, resp_names, s->n_slots, "resp_names") < 0) {
        close_all(s);
        return -1;
    }
    return 0;
}

static void SlotIO_dealloc(SlotIO *s) {
    close_all(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *SlotIO_close(SlotIO *s, PyObject *Py_UNUSED(ignored)) {
    close_all(s);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ taking a batch */

static PyObject *SlotIO_scan(SlotIO *s, PyObject *out_obj) {
    if (check_open(s) < 0) return NULL;
    Py_buffer out;
    if (get_index(out_obj, &out, 1, "out") < 0) return NULL;
    if ((uint64_t)out.shape[0] < s->n_slots) {
        PyErr_SetString(PyExc_ValueError, "out must hold n_slots indices");
        PyBuffer_Release(&out);
        return NULL;
    }
    int64_t *o = out.buf;
    Py_ssize_t n = 0;
    for (uint32_t i = 0; i < s->n_slots; i++)
        if (load_state(ctl(s, i)) == KALOS_SLOTSTATE_POSTED) o[n++] = i;
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(n);
}

static PyObject *SlotIO_take(SlotIO *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(idx, n)");
        return NULL;
    }
    if (check_open(s) < 0) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    Py_buffer idx;
    if (get_index(args[0], &idx, 1, "idx") < 0) return NULL;
    int64_t *x = idx.buf;
    if (n < 0 || n > idx.shape[0] || check_slots(s, x, n) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "n outside 0..len(idx)");
        PyBuffer_Release(&idx);
        return NULL;
    }
    Py_ssize_t m = 0;
    int err = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        int r;
        do r = sem_trywait(s->req[x[j]]);
        while (r < 0 && errno == EINTR);
        if (r == 0)
            x[m++] = x[j]; /* (m <= j: compacted in place) */
        else if (errno != EAGAIN) {
            err = errno; /* not posted yet is EAGAIN; anything else is a broken semaphore */
            break;
        }
    }
    PyBuffer_Release(&idx);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(m);
}

static PyObject *SlotIO_snapshot(SlotIO *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "snapshot(sel, t_pick, rec)");
        return NULL;
    }
    if (check_open(s) < 0) return NULL;
    unsigned long long t_pick = PyLong_AsUnsignedLongLong(args[1]);
    if (t_pick == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer sel, rec;
    if (get_index(args[0], &sel, 0, "sel") < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &rec, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&sel);
        return NULL;
    }
    const int64_t *x = sel.buf;
    Py_ssize_t n = sel.shape[0];
    PyObject *ret = NULL;
    if ((uint64_t)rec.len != (uint64_t)n * KALOS_CONTROL_BYTES) {
        PyErr_SetString(PyExc_ValueError, "rec must hold one control block per slot of sel");
    } else if (check_slots(s, x, n) == 0) {
        uint8_t *r = rec.buf;
        for (Py_ssize_t j = 0; j < n; j++) {
            uint8_t *c = ctl(s, x[j]);
            store_state(c, KALOS_SLOTSTATE_BUSY, __ATOMIC_RELAXED);
            put_u64(c, KALOS_SLOT_T_PICK_NS, t_pick);
            memcpy(r + (uint64_t)j * KALOS_CONTROL_BYTES, c, KALOS_CONTROL_BYTES);
        }
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&rec);
    PyBuffer_Release(&sel);
    return ret;
}

static PyObject *SlotIO_gather(SlotIO *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "gather(slots, rows, out)");
        return NULL;
    }
    if (check_open(s) < 0) return NULL;
    Py_buffer sl, rw = {0}, out;
    int have_rows = args[1] != Py_None;
    if (get_index(args[0], &sl, 0, "slots") < 0) return NULL;
    if (have_rows && get_index(args[1], &rw, 0, "rows") < 0) {
        PyBuffer_Release(&sl);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&sl);
        if (have_rows) PyBuffer_Release(&rw);
        return NULL;
    }
    Py_ssize_t m = sl.shape[0];
    const int64_t *xs = sl.buf;
    const int64_t *xr = have_rows ? rw.buf : NULL;
    PyObject *ret = NULL;
    if (out.ndim != 2 || out.itemsize != 4 || !is_float32_format(out.format) || out.shape[0] != m ||
        (uint64_t)out.shape[1] != s->dim) {
        PyErr_SetString(PyExc_ValueError, "out must be a contiguous float32 array of (len(slots), dim)");
    } else if (have_rows && rw.shape[0] != m) {
        PyErr_SetString(PyExc_ValueError, "rows must be as long as slots");
    } else if (check_slots(s, xs, m) == 0 && (!have_rows || check_rows(s, xr, m) == 0)) {
        size_t row_bytes = (size_t)s->dim * 4;
        uint8_t *o = out.buf;
        for (Py_ssize_t j = 0; j < m; j++) {
            const uint8_t *src = data(s, xs[j]) + s->query_offset + (xr ? (uint64_t)xr[j] * row_bytes : 0);
            memcpy(o + (uint64_t)j * row_bytes, src, row_bytes);
        }
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&out);
    if (have_rows) PyBuffer_Release(&rw);
    PyBuffer_Release(&sl);
    return ret;
}

/* ------------------------------------------------------------------ answers */

static PyObject *SlotIO_answer_recalls(SlotIO *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "answer_recalls(sel, rec, ids, scores, slots, rows)");
        return NULL;
    }
    if (check_open(s) < 0) return NULL;
    Py_buffer sel, rec, ids, sc, sl = {0}, rw = {0};
    int have_rows = args[4] != Py_None;
    int got = 0; /* buffers obtained, released in reverse */
    PyObject *ret = NULL;
    if (get_index(args[0], &sel, 0, "sel") < 0) goto done;
    got = 1;
    if (PyObject_GetBuffer(args[1], &rec, PyBUF_C_CONTIGUOUS) < 0) goto done;
    got = 2;
    if (get_matrix(args[2], &ids, 'q', "ids") < 0) goto done;
    got = 3;
    if (get_matrix(args[3], &sc, 'f', "scores") < 0) goto done;
    got = 4;
    if (have_rows) {
        if (args[5] == Py_None) {
            PyErr_SetString(PyExc_TypeError, "slots and rows go together");
            goto done;
        }
        if (get_index(args[4], &sl, 0, "slots") < 0) goto done;
        got = 5;
        if (get_index(args[5], &rw, 0, "rows") < 0) goto done;
        got = 6;
    }
    Py_ssize_t n = sel.shape[0];
    Py_ssize_t m = ids.shape[0];
    Py_ssize_t kk = ids.shape[1];
    const int64_t *xsel = sel.buf;
    const int64_t *xs = have_rows ? sl.buf : xsel;
    const int64_t *xr = have_rows ? rw.buf : NULL;
    if ((uint64_t)rec.len != (uint64_t)n * KALOS_CONTROL_BYTES) {
        PyErr_SetString(PyExc_ValueError, "rec must hold one control block per slot of sel");
        goto done;
    }
    if (sc.shape[0] != m || sc.shape[1] != kk || (uint64_t)kk > s->max_k) {
        PyErr_SetString(PyExc_ValueError, "ids and scores must have one shape (queries, kk), kk <= max_k");
        goto done;
    }
    if (have_rows ? (sl.shape[0] != m || rw.shape[0] != m) : m != n) {
        PyErr_SetString(PyExc_ValueError, "one row of results per query: (slots, rows) or sel");
        goto done;
    }
    if (check_slots(s, xsel, n) < 0 || check_slots(s, xs, m) < 0 || (xr && check_rows(s, xr, m) < 0)) goto done;
    {
        const uint8_t *pi = ids.buf, *ps = sc.buf;
        size_t bi = (size_t)kk * 8, bs = (size_t)kk * 4;
        for (Py_ssize_t j = 0; j < m; j++) {
            uint8_t *d = data(s, xs[j]);
            uint64_t row = xr ? (uint64_t)xr[j] : 0;
            memcpy(d + s->result_ids_offset + row * s->max_k * 8, pi + (uint64_t)j * bi, bi);
            memcpy(d + s->result_scores_offset + row * s->max_k * 4, ps + (uint64_t)j * bs, bs);
        }
        const uint8_t *r = rec.buf;
        for (Py_ssize_t j = 0; j < n; j++) {
            const uint8_t *rj = r + (uint64_t)j * KALOS_CONTROL_BYTES; /* the request as taken */
            uint8_t *c = ctl(s, xsel[j]);
            uint32_t k = get_u32(rj, KALOS_SLOT_K);
            put_i32(c, KALOS_SLOT_STATUS, KALOS_STATUS_OK);
            put_u32(c, KALOS_SLOT_N_RESULTS, k < (uint64_t)kk ? k : (uint32_t)kk);
            put_u32(c, KALOS_SLOT_BLOB_LEN, 0);
            put_u64(c, KALOS_SLOT_RESP_GENERATION, get_u64(rj, KALOS_SLOT_GENERATION));
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (got >= 6) PyBuffer_Release(&rw);
    if (got >= 5) PyBuffer_Release(&sl);
    if (got >= 4) PyBuffer_Release(&sc);
    if (got >= 3) PyBuffer_Release(&ids);
    if (got >= 2) PyBuffer_Release(&rec);
    if (got >= 1) PyBuffer_Release(&sel);
    return ret;
}

/* Post every response semaphore of sel. A failed post (EOVERFLOW: only a client that posted its
 * own response semaphore up to the limit can cause one) does not stop the others; the first is
 * reported after all. The GIL is kept: a post costs well under a microsecond, or a futex wake of
 * a blocked client, and handing the GIL to another thread could leave the serving thread waiting
 * up to a switch interval to get it back. */
static int post_all(SlotIO *s, const int64_t *x, Py_ssize_t n) {
    int err = 0;
    for (Py_ssize_t j = 0; j < n; j++)
        if (sem_post(s->resp[x[j]]) < 0 && !err) err = errno;
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *SlotIO_deliver(SlotIO *s, PyObject *sel_obj) {
    if (check_open(s) < 0) return NULL;
    Py_buffer sel;
    if (get_index(sel_obj, &sel, 0, "sel") < 0) return NULL;
    const int64_t *x = sel.buf;
    Py_ssize_t n = sel.shape[0];
    if (check_slots(s, x, n) < 0) {
        PyBuffer_Release(&sel);
        return NULL;
    }
    uint64_t t_done = monotonic_ns();
    for (Py_ssize_t j = 0; j < n; j++) {
        uint8_t *c = ctl(s, x[j]);
        put_u32(c, KALOS_SLOT_BATCH_SIZE, (uint32_t)n);
        put_u64(c, KALOS_SLOT_T_DONE_NS, t_done);
        store_state(c, KALOS_SLOTSTATE_DONE, __ATOMIC_RELEASE); /* last field written */
    }
    int r = post_all(s, x, n);
    PyBuffer_Release(&sel);
    return r < 0 ? NULL : PyLong_FromUnsignedLongLong(t_done);
}

static PyObject *SlotIO_answer_single(SlotIO *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "answer_single(slot, ids, scores)");
        return NULL;
    }
    if (check_open(s) < 0) return NULL;
    Py_ssize_t slot = PyLong_AsSsize_t(args[0]);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    int64_t x = slot;
    if (check_slots(s, &x, 1) < 0) return NULL;
    Py_buffer ids, sc;
    if (get_matrix(args[1], &ids, 'q', "ids") < 0) return NULL;
    if (get_matrix(args[2], &sc, 'f', "scores") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    Py_ssize_t kk = ids.shape[1];
    PyObject *ret = NULL;
    if (ids.shape[0] != 1 || sc.shape[0] != 1 || sc.shape[1] != kk || (uint64_t)kk > s->max_k) {
        PyErr_SetString(PyExc_ValueError, "ids and scores must have one shape (1, kk), kk <= max_k");
    } else {
        uint8_t *d = data(s, x), *c = ctl(s, x);
        memcpy(d + s->result_ids_offset, ids.buf, (size_t)kk * 8); /* 1. the answer */
        memcpy(d + s->result_scores_offset, sc.buf, (size_t)kk * 4);
        put_i32(c, KALOS_SLOT_STATUS, KALOS_STATUS_OK);
        put_u32(c, KALOS_SLOT_N_RESULTS, (uint32_t)kk);
        put_u32(c, KALOS_SLOT_BLOB_LEN, 0);
        put_u64(c, KALOS_SLOT_RESP_GENERATION, get_u64(c, KALOS_SLOT_GENERATION));
        put_u32(c, KALOS_SLOT_BATCH_SIZE, 1); /* 2. the stamps */
        uint64_t t_done = monotonic_ns();
        put_u64(c, KALOS_SLOT_T_DONE_NS, t_done);
        store_state(c, KALOS_SLOTSTATE_DONE, __ATOMIC_RELEASE); /* 3. last field, then 4. the post */
        if (post_all(s, &x, 1) == 0) ret = PyLong_FromUnsignedLongLong(t_done);
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&ids);
    return ret;
}

/* ------------------------------------------------------------------ what was compiled in */

/* The header's values this file uses, and the widths it assumes for the fields, so that
 * kalos.sidecar_cuda.serving.slotio can refuse a build made from another layout. */
static PyObject *SlotIO_layout(PyObject *Py_UNUSED(cls), PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue(
        "{s:i,s:i,s:(ii),s:(ii),s:(ii),s:(ii),s:(ii),s:(ii),s:(ii),s:(ii),s:(ii),s:(ii),s:i,s:i,s:i,s:i}",
        "KALOS_PROTOCOL_VERSION", KALOS_PROTOCOL_VERSION, "KALOS_CONTROL_BYTES", KALOS_CONTROL_BYTES,
        "state", KALOS_SLOT_STATE, 4, "generation", KALOS_SLOT_GENERATION, 8, "k", KALOS_SLOT_K, 4, "status",
        KALOS_SLOT_STATUS, 4, "t_pick_ns", KALOS_SLOT_T_PICK_NS, 8, "t_done_ns", KALOS_SLOT_T_DONE_NS, 8,
        "blob_len", KALOS_SLOT_BLOB_LEN, 4, "n_results", KALOS_SLOT_N_RESULTS, 4, "resp_generation",
        KALOS_SLOT_RESP_GENERATION, 8, "batch_size", KALOS_SLOT_BATCH_SIZE, 4, "KALOS_SLOTSTATE_POSTED",
        KALOS_SLOTSTATE_POSTED, "KALOS_SLOTSTATE_BUSY", KALOS_SLOTSTATE_BUSY, "KALOS_SLOTSTATE_DONE",
        KALOS_SLOTSTATE_DONE, "KALOS_STATUS_OK", KALOS_STATUS_OK);
}

/* ------------------------------------------------------------------ a mixed search's ids */

/* map_ids(tables, rows, out): out[j, c] = tables[j][rows[j, c]], and -1 where rows[j, c] < 0 (no
 * hit): the ids of a mixed-namespace search's rows, each query's from its own namespace's row ids.
 * The rows come from the backend, not from a client; a row past its table is still refused
 * (ValueError), never read. */
static PyObject *SlotIO_map_ids(SlotIO *Py_UNUSED(s), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "map_ids(tables, rows, out)");
        return NULL;
    }
    PyObject *tables = args[0];
    if (!PyList_Check(tables)) {
        PyErr_SetString(PyExc_TypeError, "tables must be a list of int64 arrays");
        return NULL;
    }
    Py_buffer rw, out;
    if (get_matrix(args[1], &rw, 'q', "rows") < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&rw);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t q = rw.shape[0], k = rw.shape[1];
    if (out.ndim != 2 || out.itemsize != 8 || !is_int64_format(out.format) || out.shape[0] != q ||
        out.shape[1] != k) {
        PyErr_SetString(PyExc_ValueError, "out must be a contiguous int64 array shaped as rows");
    } else if (PyList_GET_SIZE(tables) != q) {
        PyErr_SetString(PyExc_ValueError, "tables must hold one table per row of rows");
    } else {
        const int64_t *r = rw.buf;
        int64_t *o = out.buf;
        int bad = 0;
        for (Py_ssize_t j = 0; j < q && !bad; j++) {
            Py_buffer t;
            if (get_index(PyList_GET_ITEM(tables, j), &t, 0, "each table") < 0) {
                bad = 1;
                break;
            }
            const int64_t *ids = t.buf;
            Py_ssize_t n = t.shape[0];
            for (Py_ssize_t c = 0; c < k; c++) {
                int64_t x = r[j * k + c];
                if (x < 0) {
                    o[j * k + c] = -1;
                } else if (x >= n) {
                    PyErr_Format(PyExc_ValueError, "row %lld of query %zd is past its table's %zd rows", (long long)x, j, n);
                    bad = 1;
                    break;
                } else {
                    o[j * k + c] = ids[x];
                }
            }
            PyBuffer_Release(&t);
        }
        if (!bad) {
            ret = Py_None;
            Py_INCREF(ret);
        }
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&rw);
    return ret;
}

static PyMethodDef SlotIO_methods[] = {
    {"scan", (PyCFunction)SlotIO_scan, METH_O, "scan(out) -> n: the POSTED slots' indices into out[:n]."},
    {"take", (PyCFunction)(void (*)(void))SlotIO_take, METH_FASTCALL,
     "take(idx, n) -> m: try-wait the request semaphore of each slot of idx[:n]; the slots taken go to idx[:m]."},
    {"snapshot", (PyCFunction)(void (*)(void))SlotIO_snapshot, METH_FASTCALL,
     "snapshot(sel, t_pick, rec): mark the slots BUSY, stamp t_pick_ns, copy their control blocks into rec."},
    {"gather", (PyCFunction)(void (*)(void))SlotIO_gather, METH_FASTCALL,
     "gather(slots, rows, out): query row rows[j] (row 0 if rows is None) of slot slots[j] into out[j]."},
    {"answer_recalls", (PyCFunction)(void (*)(void))SlotIO_answer_recalls, METH_FASTCALL,
     "answer_recalls(sel, rec, ids, scores, slots, rows): the OK answers of a uniform batch (not published)."},
    {"deliver", (PyCFunction)SlotIO_deliver, METH_O,
     "deliver(sel) -> t_done_ns: batch_size, t_done_ns, state DONE, then post each response semaphore."},
    {"answer_single", (PyCFunction)(void (*)(void))SlotIO_answer_single, METH_FASTCALL,
     "answer_single(slot, ids, scores) -> t_done_ns: answer and publish one one-query recall."},
    {"map_ids", (PyCFunction)(void (*)(void))SlotIO_map_ids, METH_FASTCALL,
     "map_ids(tables, rows, out): out[j] = tables[j][rows[j]], -1 where rows[j] < 0."},
    {"close", (PyCFunction)SlotIO_close, METH_NOARGS, "Close the semaphores and release the segment (idempotent)."},
    {"layout", (PyCFunction)SlotIO_layout, METH_NOARGS | METH_STATIC,
     "The protocol values and field (offset, width) compiled in."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotIOType = {
    PyVarObject_HEAD_INIT(NULL, 0) /* (the macro ends with a comma) */
    .tp_name = "kalos.sidecar_cuda.serving._cserve.SlotIO",
    .tp_basicsize = sizeof(SlotIO),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The sidecar's slot byte work over one mapped segment (see the module source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SlotIO_init,
    .tp_dealloc = (destructor)SlotIO_dealloc,
    .tp_methods = SlotIO_methods,
};

static struct PyModuleDef cserve_module = {
    PyModuleDef_HEAD_INIT, "_cserve", "The sidecar's slot byte work, compiled.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cserve(void) {
    if (PyType_Ready(&SlotIOType) < 0) return NULL;
    PyObject *m = PyModule_Create(&cserve_module);
    if (m == NULL) return NULL;
    Py_INCREF(&SlotIOType);
    if (PyModule_AddObject(m, "SlotIO", (PyObject *)&SlotIOType) < 0 ||
        PyModule_AddIntConstant(m, "PROTOCOL_VERSION", KALOS_PROTOCOL_VERSION) < 0) {
        Py_DECREF(&SlotIOType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
