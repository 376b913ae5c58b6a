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
 *
 * The coordinator's blockwise commit (diloco/coordinator/commit_blocks.py): the outer step,
 * the downlink's error feedback and the norms, element by element over a block of a tensor,
 * with small scratch buffers instead of full-size temporaries. The same IEEE float32
 * operations as torch's SGD with Nesterov momentum (torch/optim/sgd.py
 * _single_tensor_sgd, whose add-with-alpha is a fused multiply-add: explicit fmaf here),
 * WeightedMean.mean and ErrorFeedback, in the same order; commit_blocks checks that bit for
 * bit against torch on this machine before it uses them, and takes torch's path otherwise.
 * sumsq_f32(x, lanes) -> None
 *     lanes[i % 16] += (double)x[i] * (double)x[i] (lanes: 16 writable float64). A norm is
 *     the square root of the sum, over tensors in order, of lanes_sum of each tensor's lanes;
 *     the lanes of a tensor taken in blocks that start at multiples of 16 are the same as of
 *     one call over it.
 * lanes_sum(lanes) -> float
 *     The 16 lanes added in a fixed tree.
 * outer_pass(sums, W, mom, mom_mode, write_mom, mu, nlr, theta, resid, beta, x_out, lanes_g,
 *            lanes_u, cb, stats) -> None
 *     For n elements (theta: n float32, sums: n float64): g = (float)(sums / W);
 *     mom_mode 0 (no momentum): v = g; 1 (no buffer yet): b = g, 2: b = mom * mu + g, then
 *     v = fmaf(mu, b, g) (b written to mom when write_mom); u = fmaf(nlr, v, theta) - theta;
 *     mom_mode 3 (an averaging round: θ − mean Δ, no outer step): u = -g;
 *     x = u + resid (beta 1) or u + resid * beta (resid None: x = u), written to x_out when
 *     given. lanes_g and lanes_u (None or 16 float64) take g's and u's squares as sumsq_f32
 *     does; with cb > 0, stats (2 float64) takes, per block of cb elements of x from the
 *     start, count * absmax^2 into stats[0], and 1 into stats[1] where an x is not finite.
 * outer_apply(x, sent, theta, resid_out, lanes) -> None
 *     theta += sent (in place); resid_out = x - sent when given; lanes (None or 16 float64)
 *     take sent's squares as sumsq_f32 does.
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

/* ---- the blockwise commit ---------------------------------------------------------- */

#define LANES 16
#define TILE 512 /* elements computed at a time into the stack buffers below: a multiple of LANES */

static inline __attribute__((always_inline)) void sumsq_acc(const float *x, Py_ssize_t n, double *lanes) {
    double acc[LANES];
    memcpy(acc, lanes, sizeof acc);
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            double v = x[i + j];
            acc[j] += v * v;
        }
    for (int j = 0; i + j < n; j++) {
        double v = x[i + j];
        acc[j] += v * v;
    }
    memcpy(lanes, acc, sizeof acc);
}

static double lanes_total(const double *lanes) {
    double a[8], b[4];
    for (int j = 0; j < 8; j++) a[j] = lanes[j] + lanes[j + 8];
    for (int j = 0; j < 4; j++) b[j] = a[j] + a[j + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef struct {
    const double *sums;
    double W;
    float *mom;
    int mom_mode, write_mom, beta_one;
    float mu, nlr, beta;
    const float *theta, *resid;
    float *x_out;
    double *lanes_g, *lanes_u;
    Py_ssize_t n, cb;
    double *stats;
} PassArgs;

/* max |x| over n values as bits with the sign cleared (block_absmax's order, no flag). */
static inline __attribute__((always_inline)) uint32_t abs_bits_max(const float *x, Py_ssize_t n, uint32_t m) {
    const uint32_t *bits = (const uint32_t *)x;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t a = bits[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

static inline __attribute__((always_inline)) void outer_pass_loop(const PassArgs *a) {
    float g[TILE], b[TILE], u[TILE], xb[TILE];
    uint32_t amax = 0;
    Py_ssize_t in_block = 0; /* elements of the current cb-block seen */
    for (Py_ssize_t i0 = 0; i0 < a->n; i0 += TILE) {
        Py_ssize_t m = a->n - i0 < TILE ? a->n - i0 : TILE;
        const double *s = a->sums + i0;
        const float *th = a->theta + i0;
        for (Py_ssize_t j = 0; j < m; j++) g[j] = (float)(s[j] / a->W);
        if (a->lanes_g) sumsq_acc(g, m, a->lanes_g);
        const float *v = g;
        if (a->mom_mode == 1 || a->mom_mode == 2) {
            if (a->mom_mode == 2) {
                const float *mo = a->mom + i0;
                for (Py_ssize_t j = 0; j < m; j++) b[j] = mo[j] * a->mu + g[j];
            } else {
                memcpy(b, g, m * sizeof(float));
            }
            if (a->write_mom) memcpy(a->mom + i0, b, m * sizeof(float));
            for (Py_ssize_t j = 0; j < m; j++) b[j] = fmaf(a->mu, b[j], g[j]);
            v = b;
        }
        if (a->mom_mode == 3)
            for (Py_ssize_t j = 0; j < m; j++) u[j] = -v[j];
        else
            for (Py_ssize_t j = 0; j < m; j++) u[j] = fmaf(a->nlr, v[j], th[j]) - th[j];
        if (a->lanes_u) sumsq_acc(u, m, a->lanes_u);
        const float *x = u;
        if (a->resid) {
            const float *e = a->resid + i0;
            if (a->beta_one)
                for (Py_ssize_t j = 0; j < m; j++) xb[j] = u[j] + e[j];
            else
                for (Py_ssize_t j = 0; j < m; j++) xb[j] = u[j] + e[j] * a->beta;
            x = xb;
        }
        if (a->x_out) memcpy(a->x_out + i0, x, m * sizeof(float));
        if (a->cb > 0) {
            for (Py_ssize_t j = 0; j < m;) {
                Py_ssize_t take = a->cb - in_block < m - j ? a->cb - in_block : m - j;
                amax = abs_bits_max(x + j, take, amax);
                j += take;
                in_block += take;
                if (in_block == a->cb || i0 + j == a->n) {
                    float am;
                    memcpy(&am, &amax, 4);
                    if (amax >= 0x7F800000u) a->stats[1] = 1.0;
                    else a->stats[0] += (double)in_block * ((double)am * (double)am);
                    amax = 0;
                    in_block = 0;
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void outer_apply_loop(const float *x, const float *sent, float *theta, float *resid_out, double *lanes, Py_ssize_t n) {
    for (Py_ssize_t i0 = 0; i0 < n; i0 += TILE) {
        Py_ssize_t m = n - i0 < TILE ? n - i0 : TILE;
        const float *st = sent + i0;
        float *th = theta + i0;
        for (Py_ssize_t j = 0; j < m; j++) th[j] = th[j] + st[j];
        if (resid_out) {
            const float *xs = x + i0;
            float *r = resid_out + i0;
            for (Py_ssize_t j = 0; j < m; j++) r[j] = xs[j] - st[j];
        }
        if (lanes) sumsq_acc(st, m, lanes);
    }
}

/* The same loops compiled for x86 CPUs with FMA (fmaf one instruction, wider vectors) and
 * picked at run time; the arithmetic is the same IEEE operations either way. Elsewhere, one
 * build (aarch64's fmaf is an instruction). */
static void outer_pass_base(const PassArgs *a) { outer_pass_loop(a); }
static void outer_apply_base(const float *x, const float *s, float *t, float *r, double *l, Py_ssize_t n) { outer_apply_loop(x, s, t, r, l, n); }
static void sumsq_base(const float *x, Py_ssize_t n, double *lanes) { sumsq_acc(x, n, lanes); }
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) static void outer_pass_fma(const PassArgs *a) { outer_pass_loop(a); }
__attribute__((target("avx2,fma"))) static void outer_apply_fma(const float *x, const float *s, float *t, float *r, double *l, Py_ssize_t n) {
    outer_apply_loop(x, s, t, r, l, n);
}
__attribute__((target("avx2,fma"))) static void sumsq_fma(const float *x, Py_ssize_t n, double *lanes) { sumsq_acc(x, n, lanes); }
static int has_fma = 0;
#define PICK(name) (has_fma ? name##_fma : name##_base)
#else
#define PICK(name) name##_base
#endif

/* An optional buffer argument: None (b->buf = NULL, returns 0) or a contiguous buffer of
 * exactly ``bytes`` bytes (returns 1); -1 with an exception set otherwise. */
static int opt_buffer(PyObject *o, Py_buffer *b, int writable, Py_ssize_t bytes, const char *what) {
    b->buf = NULL;
    b->obj = NULL;
    if (o == Py_None) return 0;
    if (PyObject_GetBuffer(o, b, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (b->len != bytes) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, b->len, bytes);
        PyBuffer_Release(b);
        b->buf = NULL;
        b->obj = NULL;
        return -1;
    }
    return 1;
}

static void release_all(Py_buffer *bufs, int count) {
    for (int i = 0; i < count; i++)
        if (bufs[i].obj) PyBuffer_Release(&bufs[i]);
}

static PyObject *sumsq_f32(PyObject *self, PyObject *args) {
    Py_buffer xb, lb;
    PyObject *lanes;
    if (!PyArg_ParseTuple(args, "y*O", &xb, &lanes)) return NULL;
    int got = xb.len % 4 ? -1 : opt_buffer(lanes, &lb, 1, LANES * 8, "sumsq_f32: lanes");
    if (got > 0) {
        Py_BEGIN_ALLOW_THREADS
        PICK(sumsq)((const float *)xb.buf, xb.len / 4, (double *)lb.buf);
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&lb);
    } else if (got == 0 || xb.len % 4) {
        PyErr_SetString(PyExc_ValueError, "sumsq_f32: x must be float32 and lanes 16 float64");
    }
    PyBuffer_Release(&xb);
    return got > 0 ? Py_NewRef(Py_None) : NULL;
}

static PyObject *lanes_sum(PyObject *self, PyObject *args) {
    Py_buffer lb;
    if (!PyArg_ParseTuple(args, "y*", &lb)) return NULL;
    PyObject *result = NULL;
    if (lb.len != LANES * 8) PyErr_SetString(PyExc_ValueError, "lanes_sum: lanes must be 16 float64");
    else result = PyFloat_FromDouble(lanes_total((const double *)lb.buf));
    PyBuffer_Release(&lb);
    return result;
}

static PyObject *outer_pass(PyObject *self, PyObject *args) {
    Py_buffer sb, tb, bufs[6]; /* mom, resid, x_out, lanes_g, lanes_u, stats */
    PyObject *mom, *resid, *x_out, *lanes_g, *lanes_u, *stats;
    PassArgs a;
    double beta;
    if (!PyArg_ParseTuple(args, "y*dOiiffy*OdOOOnO", &sb, &a.W, &mom, &a.mom_mode, &a.write_mom, &a.mu, &a.nlr, &tb, &resid, &beta, &x_out, &lanes_g, &lanes_u,
                          &a.cb, &stats))
        return NULL;
    PyObject *result = NULL;
    for (int i = 0; i < 6; i++) bufs[i].obj = NULL;
    a.n = tb.len / 4;
    if (tb.len % 4 || sb.len != 8 * a.n || a.mom_mode < 0 || a.mom_mode > 3 || a.cb < 0) {
        PyErr_SetString(PyExc_ValueError, "outer_pass: sums (float64), theta (float32) or a mode do not agree");
        goto done;
    }
    int got[6];
    got[0] = opt_buffer(mom, &bufs[0], a.write_mom, 4 * a.n, "outer_pass: mom");
    got[1] = got[0] < 0 ? -1 : opt_buffer(resid, &bufs[1], 0, 4 * a.n, "outer_pass: resid");
    got[2] = got[1] < 0 ? -1 : opt_buffer(x_out, &bufs[2], 1, 4 * a.n, "outer_pass: x_out");
    got[3] = got[2] < 0 ? -1 : opt_buffer(lanes_g, &bufs[3], 1, LANES * 8, "outer_pass: lanes_g");
    got[4] = got[3] < 0 ? -1 : opt_buffer(lanes_u, &bufs[4], 1, LANES * 8, "outer_pass: lanes_u");
    got[5] = got[4] < 0 ? -1 : opt_buffer(stats, &bufs[5], 1, 2 * 8, "outer_pass: stats");
    if (got[5] < 0) goto done;
    if ((a.mom_mode == 2 || a.write_mom) && !got[0]) {
        PyErr_SetString(PyExc_ValueError, "outer_pass: this momentum mode needs mom");
        goto done;
    }
    if (a.cb > 0 && !got[5]) {
        PyErr_SetString(PyExc_ValueError, "outer_pass: cb > 0 needs stats");
        goto done;
    }
    a.sums = (const double *)sb.buf;
    a.theta = (const float *)tb.buf;
    a.mom = (float *)bufs[0].buf;
    a.resid = (const float *)bufs[1].buf;
    a.x_out = (float *)bufs[2].buf;
    a.lanes_g = (double *)bufs[3].buf;
    a.lanes_u = (double *)bufs[4].buf;
    a.stats = (double *)bufs[5].buf;
    a.beta_one = beta == 1.0;
    a.beta = (float)beta;
    Py_BEGIN_ALLOW_THREADS
    PICK(outer_pass)(&a);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release_all(bufs, 6);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&tb);
    return result;
}

static PyObject *outer_apply(PyObject *self, PyObject *args) {
    Py_buffer xb, sb, tb, bufs[2]; /* resid_out, lanes */
    PyObject *resid_out, *lanes;
    if (!PyArg_ParseTuple(args, "y*y*w*OO", &xb, &sb, &tb, &resid_out, &lanes)) return NULL;
    PyObject *result = NULL;
    bufs[0].obj = bufs[1].obj = NULL;
    Py_ssize_t n = tb.len / 4;
    if (tb.len % 4 || xb.len != tb.len || sb.len != tb.len) {
        PyErr_SetString(PyExc_ValueError, "outer_apply: x, sent and theta must be float32 of one length");
        goto done;
    }
    if (opt_buffer(resid_out, &bufs[0], 1, 4 * n, "outer_apply: resid_out") < 0 || opt_buffer(lanes, &bufs[1], 1, LANES * 8, "outer_apply: lanes") < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    PICK(outer_apply)((const float *)xb.buf, (const float *)sb.buf, (float *)tb.buf, (float *)bufs[0].buf, (double *)bufs[1].buf, n);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release_all(bufs, 2);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&tb);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "int8 blockwise encode (see the file's comment)"},
    {"decode", decode, METH_VARARGS, "int8 blockwise decode (see the file's comment)"},
    {"accumulate", accumulate, METH_VARARGS, "int8 blockwise decode added into float64 (see the file's comment)"},
    {"accumulate_nibbles", accumulate_nibbles, METH_VARARGS, "4-bit blockwise decode added into float64 (see the file's comment)"},
    {"accumulate_sparse", accumulate_sparse, METH_VARARGS, "sparse float32 values added into float64 (see the file's comment)"},
    {"accumulate_f32", accumulate_f32, METH_VARARGS, "float32 values added into float64 (see the file's comment)"},
    {"finite_f32", finite_f32, METH_VARARGS, "every float32 value is finite (see the file's comment)"},
    {"sumsq_f32", sumsq_f32, METH_VARARGS, "float32 squares added into 16 float64 lanes (see the file's comment)"},
    {"lanes_sum", lanes_sum, METH_VARARGS, "16 float64 lanes added in a fixed tree (see the file's comment)"},
    {"outer_pass", outer_pass, METH_VARARGS, "the blockwise commit's outer step over a block (see the file's comment)"},
    {"outer_apply", outer_apply, METH_VARARGS, "the blockwise commit's update applied over a block (see the file's comment)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__int8_native(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    has_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return PyModule_Create(&module);
}
