/* The int8 codec's two hot loops in C: the same IEEE float32 operations, in the same order,
 * as the torch path in blockwise.py (Int8Codec), so both give byte-identical payloads and
 * bit-identical decodes; tests/test_codec_native.py checks that. Built by setup.py as an
 * optional extension (compiled with -ffp-contract=off: no fused multiply-add may change a
 * rounding); without it the codec takes the torch path.
 *
 * encode(x, block, header) -> bytes | None
 *     x: a C-contiguous float32 buffer. Returns header + ceil(n / block) float32 scales +
 *     n int8 codes, written straight into the returned bytes object; None when a block's
 *     1 / scale overflows (absmax below ~4e-37), where the caller takes the general path.
 *     Raises ValueError on a non-finite input.
 * decode(payload, offset, block, out) -> None
 *     Writes code * scale of each of len(out) codes at payload[offset + 4 * n_blocks:] into
 *     the writable float32 buffer out; the scales sit at payload[offset:]. The caller has
 *     checked the header, the length and the scales.
 *
 * The coordinator's fused intake (diloco/wire/held.py): a push's payloads are kept as they
 * arrived and added into the round's float64 sum without a float32 copy in between.
 * accumulate(payload, offset, block, n, acc, alpha) -> None
 *     acc[i] += (double)(code_i * scale) * alpha for the n int8 codes laid out as decode's:
 *     the value decode gives, widened and scaled in float64 (no fused multiply-add, so the
 *     same bits on every machine). acc: a writable float64 buffer of n values.
 * accumulate_nibbles(payload, offset, block, n, table, acc, alpha) -> None
 *     The same for two 4-bit codes per byte (element 2i in the low nibble of byte i): the
 *     value table[code] * scale (table: 16 float32, the codec's levels) as the codec decodes it.
 * accumulate_sparse(positions, values, acc, alpha) -> None
 *     acc[positions[i]] += (double)values[i] * alpha: int64 positions (checked by the caller
 *     to lie in acc), float32 values.
 * accumulate_f32(payload, acc, alpha) -> None
 *     acc[i] += (double)x_i * alpha for the little-endian float32 values of payload.
 * finite_f32(payload) -> bool
 *     Every float32 value of payload is finite (its exponent bits are not all ones).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_CODE 127.0f
/* Adding 1.5 * 2**23 to |y| <= 128 rounds y to the nearest integer (ties to even) and
 * leaves that integer in the low byte of the float's bit pattern. */
#define ROUNDING_MAGIC 12582912.0f

/* max |x| over n values, as max over the bit patterns with the sign cleared: non-negative
 * floats order as their bit patterns do, and inf or nan (exponent all ones) orders above
 * every finite value, so one integer reduction (which vectorizes) gives both. */
static float block_absmax(const float *x, Py_ssize_t n, int *finite) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t a = bits[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    if (m >= 0x7F800000u) *finite = 0;
    float absmax;
    memcpy(&absmax, &m, 4);
    return absmax;
}

static float scale_of(float absmax) {
    float s = absmax / MAX_CODE;
    while (s * MAX_CODE > absmax) s = nextafterf(s, 0.0f);
    return s;
}

static void quantize(const float *x, Py_ssize_t n, float inv, int8_t *codes) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float y = x[i] * inv + ROUNDING_MAGIC;
        uint32_t bits;
        memcpy(&bits, &y, 4);
        codes[i] = (int8_t)(uint8_t)(bits & 0xFF);
    }
}

static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer xb, hb;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "y*ny*", &xb, &block, &hb)) return NULL;
    PyObject *result = NULL;
    if (block < 1 || xb.len % 4) {
        PyErr_SetString(PyExc_ValueError, "int8 native encode: block must be >= 1 and x float32");
        goto done;
    }
    const float *x = (const float *)xb.buf;
    Py_ssize_t n = xb.len / 4, n_blocks = (n + block - 1) / block;
    result = PyBytes_FromStringAndSize(NULL, hb.len + 4 * n_blocks + n);
    if (!result) goto done;
    char *out = PyBytes_AS_STRING(result);
    memcpy(out, hb.buf, hb.len);
    float *scales = (float *)(out + hb.len); /* the header is 8 bytes: aligned */
    int8_t *codes = (int8_t *)(out + hb.len + 4 * n_blocks);
    int finite = 1, general = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        Py_ssize_t start = b * block, len = n - start < block ? n - start : block;
        float absmax = block_absmax(x + start, len, &finite);
        float s = scale_of(absmax);
        scales[b] = s;
        float inv = s > 0.0f ? 1.0f / s : 0.0f;
        if (isinf(inv)) general = 1;
        if (!finite || general) break;
        quantize(x + start, len, inv, codes + start);
    }
    Py_END_ALLOW_THREADS
    if (!finite) {
        PyErr_SetString(PyExc_ValueError, "non-finite input");
        Py_CLEAR(result);
    } else if (general) {
        Py_CLEAR(result);
        result = Py_NewRef(Py_None);
    }
done:
    PyBuffer_Release(&xb);
    PyBuffer_Release(&hb);
    return result;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer pb, ob;
    Py_ssize_t offset, block;
    if (!PyArg_ParseTuple(args, "y*nnw*", &pb, &offset, &block, &ob)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = ob.len / 4, n_blocks = block > 0 ? (n + block - 1) / block : 0;
    if (block < 1 || ob.len % 4 || offset < 0 || pb.len != offset + 4 * n_blocks + n) {
        PyErr_SetString(PyExc_ValueError, "int8 native decode: payload length, block or out do not agree");
        goto done;
    }
    float *out = (float *)ob.buf;
    const char *p = (const char *)pb.buf + offset;
    const int8_t *codes = (const int8_t *)(p + 4 * n_blocks);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        float s;
        memcpy(&s, p + 4 * b, 4); /* the payload need not be aligned */
        Py_ssize_t start = b * block, end = n - start < block ? n : start + block;
        for (Py_ssize_t i = start; i < end; i++) out[i] = (float)codes[i] * s;
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&ob);
    return result;
}

static PyObject *accumulate(PyObject *self, PyObject *args) {
    Py_buffer pb, ab;
    Py_ssize_t offset, block, n;
    double alpha;
    if (!PyArg_ParseTuple(args, "y*nnnw*d", &pb, &offset, &block, &n, &ab, &alpha)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_blocks = block > 0 ? (n + block - 1) / block : 0;
    if (block < 1 || n < 0 || ab.len != 8 * n || offset < 0 || pb.len != offset + 4 * n_blocks + n) {
        PyErr_SetString(PyExc_ValueError, "int8 native accumulate: payload length, block or acc do not agree");
        goto done;
    }
    double *acc = (double *)ab.buf;
    const char *p = (const char *)pb.buf + offset;
    const int8_t *codes = (const int8_t *)(p + 4 * n_blocks);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        float s;
        memcpy(&s, p + 4 * b, 4);
        Py_ssize_t start = b * block, end = n - start < block ? n : start + block;
        for (Py_ssize_t i = start; i < end; i++) {
            float v = (float)codes[i] * s;
            acc[i] += (double)v * alpha;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&ab);
    return result;
}

static PyObject *accumulate_nibbles(PyObject *self, PyObject *args) {
    Py_buffer pb, tb, ab;
    Py_ssize_t offset, block, n;
    double alpha;
    if (!PyArg_ParseTuple(args, "y*nnny*w*d", &pb, &offset, &block, &n, &tb, &ab, &alpha)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_blocks = block > 0 ? (n + block - 1) / block : 0;
    if (block < 1 || n < 0 || ab.len != 8 * n || tb.len != 16 * 4 || offset < 0 || pb.len != offset + 4 * n_blocks + (n + 1) / 2) {
        PyErr_SetString(PyExc_ValueError, "native accumulate_nibbles: payload length, block, table or acc do not agree");
        goto done;
    }
    double *acc = (double *)ab.buf;
    float table[16];
    memcpy(table, tb.buf, sizeof table);
    const unsigned char *p = (const unsigned char *)pb.buf + offset;
    const unsigned char *codes = p + 4 * n_blocks;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        float s;
        memcpy(&s, p + 4 * b, 4);
        Py_ssize_t start = b * block, end = n - start < block ? n : start + block;
        for (Py_ssize_t i = start; i < end; i++) {
            unsigned char byte = codes[i >> 1];
            float v = table[(i & 1) ? byte >> 4 : byte & 15] * s;
            acc[i] += (double)v * alpha;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&ab);
    return result;
}

static PyObject *accumulate_sparse(PyObject *self, PyObject *args) {
    Py_buffer ib, vb, ab;
    double alpha;
    if (!PyArg_ParseTuple(args, "y*y*w*d", &ib, &vb, &ab, &alpha)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t k = vb.len / 4, n = ab.len / 8;
    if (vb.len % 4 || ib.len != 8 * k || ab.len % 8) {
        PyErr_SetString(PyExc_ValueError, "native accumulate_sparse: positions, values and acc do not agree");
        goto done;
    }
    const int64_t *pos = (const int64_t *)ib.buf;
    const float *val = (const float *)vb.buf;
    double *acc = (double *)ab.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (pos[i] < 0 || pos[i] >= n) {
            PyErr_SetString(PyExc_ValueError, "native accumulate_sparse: a position outside acc");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) acc[pos[i]] += (double)val[i] * alpha;
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&ib);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&ab);
    return result;
}

static PyObject *accumulate_f32(PyObject *self, PyObject *args) {
    Py_buffer pb, ab;
    double alpha;
    if (!PyArg_ParseTuple(args, "y*w*d", &pb, &ab, &alpha)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = pb.len / 4;
    if (pb.len % 4 || ab.len != 8 * n) {
        PyErr_SetString(PyExc_ValueError, "native accumulate_f32: payload and acc do not agree");
        goto done;
    }
    double *acc = (double *)ab.buf;
    const char *p = (const char *)pb.buf;
    Py_BEGIN_ALLOW_THREADS
    if (((uintptr_t)p & 3) == 0) {
        const float *x = (const float *)p;
        for (Py_ssize_t i = 0; i < n; i++) acc[i] += (double)x[i] * alpha;
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            float v;
            memcpy(&v, p + 4 * i, 4);
            acc[i] += (double)v * alpha;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&ab);
    return result;
}

static PyObject *finite_f32(PyObject *self, PyObject *args) {
    Py_buffer pb;
    if (!PyArg_ParseTuple(args, "y*", &pb)) return NULL;
    Py_ssize_t n = pb.len / 4;
    const unsigned char *p = (const unsigned char *)pb.buf;
    uint32_t bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, p + 4 * i, 4);
        bad |= (uint32_t)((bits & 0x7F800000u) == 0x7F800000u);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pb);
    return PyBool_FromLong(!bad);
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "int8 blockwise encode (see the file's comment)"},
    {"decode", decode, METH_VARARGS, "int8 blockwise decode (see the file's comment)"},
    {"accumulate", accumulate, METH_VARARGS, "int8 blockwise decode added into float64 (see the file's comment)"},
    {"accumulate_nibbles", accumulate_nibbles, METH_VARARGS, "4-bit blockwise decode added into float64 (see the file's comment)"},
    {"accumulate_sparse", accumulate_sparse, METH_VARARGS, "sparse float32 values added into float64 (see the file's comment)"},
    {"accumulate_f32", accumulate_f32, METH_VARARGS, "float32 values added into float64 (see the file's comment)"},
    {"finite_f32", finite_f32, METH_VARARGS, "every float32 value is finite (see the file's comment)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__int8_native(void) { return PyModule_Create(&module); }
