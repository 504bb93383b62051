/* kalos.sidecar_cuda._cserve: the sidecar's byte work on the slot path, compiled (see setup.py).
 * Skeleton: filled in by the compiled slot path work (issue 25). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kalos_protocol.h"

static struct PyModuleDef cserve_module = {
    PyModuleDef_HEAD_INIT, "_cserve", "The sidecar's slot byte work, compiled.", -1, NULL,
};

PyMODINIT_FUNC PyInit__cserve(void) {
    PyObject *m = PyModule_Create(&cserve_module);
    if (m && PyModule_AddIntConstant(m, "PROTOCOL_VERSION", KALOS_PROTOCOL_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
