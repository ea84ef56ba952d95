/*
 * Leftmost-bin first fit over a flat max segment tree.
 *
 * The planner (tightpack/core/planner.py) owns the semantics and calls this kernel only through
 * `first_fit_bins`; this file holds the one loop that cannot be vectorized: every item depends on
 * the bins the previous items left behind.
 *
 * Semantics (identical to a linear scan over the open bins, contract section 2.5):
 *   - an item goes to the lowest-index open bin whose remaining capacity is >= its length;
 *   - otherwise it opens a new bin whose remaining capacity is `capacity - length` (negative for an
 *     oversize item, so that bin never accepts another positive-length item);
 *   - a zero-length item joins the first open bin with remaining capacity >= 0.
 *
 * Arguments come through the buffer protocol (no numpy headers needed): a read-only int64 buffer
 * of lengths, the capacity, a writable int64 buffer receiving each item's bin index, and the most
 * bins the caller allows (the tree is sized from it). Returns the number of bins opened.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#define UNOPENED INT64_MIN

static Py_ssize_t first_fit_kernel(const int64_t *lengths, Py_ssize_t n, int64_t capacity,
                                   int64_t *bins, int64_t *tree, Py_ssize_t leaves, Py_ssize_t max_bins) {
    Py_ssize_t opened = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t length = lengths[i];
        Py_ssize_t node = 1;
        Py_ssize_t bin;
        if (tree[1] >= length) {
            while (node < leaves) {
                node <<= 1;
                if (tree[node] < length) node |= 1;
            }
            bin = node - leaves;
            tree[node] -= length;
        } else {
            if (opened == max_bins) return -1;
            bin = opened++;
            node = bin + leaves;
            tree[node] = capacity - length;
        }
        bins[i] = bin;
        for (node >>= 1; node >= 1; node >>= 1) {
            const int64_t left = tree[2 * node], right = tree[2 * node + 1];
            const int64_t best = left >= right ? left : right;
            if (tree[node] == best) break;
            tree[node] = best;
        }
    }
    return opened;
}

static PyObject *first_fit(PyObject *self, PyObject *args) {
    Py_buffer lengths, bins;
    long long capacity;
    Py_ssize_t max_bins;
    if (!PyArg_ParseTuple(args, "y*Lw*n", &lengths, &capacity, &bins, &max_bins)) return NULL;
    PyObject *result = NULL;
    if (lengths.len % sizeof(int64_t) != 0 || bins.len != lengths.len) {
        PyErr_SetString(PyExc_ValueError, "first_fit: expects int64 buffers of equal size");
        goto done;
    }
    const Py_ssize_t n = lengths.len / (Py_ssize_t)sizeof(int64_t);
    if (max_bins < 1) max_bins = 1;
    Py_ssize_t leaves = 1;
    while (leaves < max_bins) leaves <<= 1;
    int64_t *tree = malloc(sizeof(int64_t) * 2 * (size_t)leaves);
    if (tree == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < 2 * leaves; k++) tree[k] = UNOPENED;
    Py_ssize_t opened;
    Py_BEGIN_ALLOW_THREADS
    opened = first_fit_kernel((const int64_t *)lengths.buf, n, (int64_t)capacity, (int64_t *)bins.buf, tree,
                              leaves, max_bins);
    Py_END_ALLOW_THREADS
    free(tree);
    if (opened < 0) {
        PyErr_SetString(PyExc_RuntimeError, "first_fit: the bin bound was too small (internal error)");
        goto done;
    }
    result = PyLong_FromSsize_t(opened);
done:
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&bins);
    return result;
}

/* Counting sort of items by bin, stable: order_out lists the items of bin 0, then bin 1, ...;
 * offsets_out (n_bins + 1 entries) delimits them. */
static PyObject *group_by_bin(PyObject *self, PyObject *args) {
    Py_buffer bins, order, offsets;
    if (!PyArg_ParseTuple(args, "y*w*w*", &bins, &order, &offsets)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = bins.len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t n_bins = offsets.len / (Py_ssize_t)sizeof(int64_t) - 1;
    if (bins.len % sizeof(int64_t) != 0 || order.len != bins.len || n_bins < 0) {
        PyErr_SetString(PyExc_ValueError, "group_by_bin: expects int64 buffers (bins, order of equal size, offsets)");
        goto done;
    }
    const int64_t *b = bins.buf;
    int64_t *o = order.buf, *off = offsets.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k <= n_bins; k++) off[k] = 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        if (b[i] < 0 || b[i] >= n_bins) bad = 1;
        else off[b[i] + 1]++;
    }
    if (!bad) {
        for (Py_ssize_t k = 0; k < n_bins; k++) off[k + 1] += off[k];
        for (Py_ssize_t i = 0; i < n; i++) o[off[b[i]]++] = i;
        for (Py_ssize_t k = n_bins; k > 0; k--) off[k] = off[k - 1];
        off[0] = 0;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "group_by_bin: a bin index is out of range");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&bins);
    PyBuffer_Release(&order);
    PyBuffer_Release(&offsets);
    return result;
}

static PyMethodDef methods[] = {
    {"first_fit", first_fit, METH_VARARGS,
     "first_fit(lengths: int64 buffer, capacity: int, bins_out: int64 buffer, max_bins: int) -> bins opened"},
    {"group_by_bin", group_by_bin, METH_VARARGS,
     "group_by_bin(bins: int64 buffer, order_out: int64 buffer, offsets_out: int64 buffer) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_firstfit", "Leftmost-bin first fit kernel.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__firstfit(void) { return PyModule_Create(&module); }
