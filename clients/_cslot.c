/* kalos.clients._cslot: the client's byte work on the slot path, compiled (see setup.py).
 * Skeleton: filled in by the compiled slot path work (issue 25). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kalos_protocol.h"

static struct PyModuleDef cslot_module = {
    PyModuleDef_HEAD_INIT, "_cslot", "The client's slot byte work, compiled.", -1, NULL,
};

PyMODINIT_FUNC PyInit__cslot(void) {
    PyObject *m = PyModule_Create(&cslot_module);
    if (m && PyModule_AddIntConstant(m, "PROTOCOL_VERSION", KALOS_PROTOCOL_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
