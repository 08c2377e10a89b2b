/*
 * Optional C accelerator for the per-record loops that profiles showed to
 * dominate: framing records as [prefix][u32 BE size][payload] and scanning
 * such frames back, and Lumberjack's JSON frames scanned and their events
 * spliced into log records.  streamproto.core.framing holds the pure-Python
 * versions, with identical behaviour, and uses these when they build.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE     /* preadv2 and RWF_NOWAIT */
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "_forks.h"
#include "_syncer.h"
#include "_sender.h"

static inline void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24); p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8); p[3] = (unsigned char)v;
}

static inline uint32_t get_be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* The number of records that `lengths` (native uint32 sizes) cuts `data`
 * into, or -1 with ValueError set when the two do not match: what every
 * function taking a (lengths, data) pair checks before trusting either. */
static Py_ssize_t record_count(const Py_buffer *lengths, const Py_buffer *data) {
    if (lengths->len % 4) {
        PyErr_SetString(PyExc_ValueError, "lengths must hold uint32 values");
        return -1;
    }
    Py_ssize_t n = lengths->len / 4;
    const uint32_t *lens = (const uint32_t *)lengths->buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) total += lens[i];
    if (total != data->len) {
        PyErr_SetString(PyExc_ValueError, "lengths do not add up to the data size");
        return -1;
    }
    return n;
}

/* frame_records(lengths: buffer of native uint32, data: buffer, prefix: bytes) -> bytes */
static PyObject *frame_records(PyObject *self, PyObject *args) {
    Py_buffer lengths, data, prefix;
    if (!PyArg_ParseTuple(args, "y*y*y*", &lengths, &data, &prefix))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = record_count(&lengths, &data);
    if (n < 0) goto done;
    const uint32_t *lens = (const uint32_t *)lengths.buf;
    Py_ssize_t size = data.len + n * (prefix.len + 4);
    out = PyBytes_FromStringAndSize(NULL, size);
    if (!out) goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *r = (const unsigned char *)data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (prefix.len) { memcpy(w, prefix.buf, prefix.len); w += prefix.len; }
        put_be32(w, lens[i]); w += 4;
        memcpy(w, r, lens[i]); w += lens[i]; r += lens[i];
    }
done:
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&data);
    PyBuffer_Release(&prefix);
    return out;
}

/*
 * scan_frames(buf, start, prefix: bytes, max_size, max_records[, head])
 *   -> (lengths: bytes of native uint32, data: bytes, end, status)
 * Reads consecutive [prefix][u32 BE size][payload] frames from buf[start:].
 * data starts with head (payloads the caller decoded before: a record that
 * straddled two reads), so that joining them costs no second copy.
 * status: 0 = stopped at a frame not yet complete (or max_records),
 *         1 = stopped at bytes that do not start with prefix (caller decides),
 *         2 = a size above max_size (protocol error at `end`).
 */
static PyObject *scan_frames(PyObject *self, PyObject *args) {
    Py_buffer buf, prefix, head = {0};
    Py_ssize_t start, max_records;
    unsigned long long max_size;
    if (!PyArg_ParseTuple(args, "y*ny*Kn|y*", &buf, &start, &prefix, &max_size, &max_records,
                          &head))
        return NULL;
    PyObject *result = NULL, *lens_obj = NULL, *data_obj = NULL;
    const unsigned char *b = (const unsigned char *)buf.buf;
    Py_ssize_t len = buf.len, pos = start, count = 0, data_len = 0;
    int status = 0;
    if (start < 0 || start > len) {
        PyErr_SetString(PyExc_ValueError, "start out of range");
        goto done;
    }
    /* first pass: count frames and payload bytes */
    Py_ssize_t hdr = prefix.len + 4;
    while (max_records < 0 || count < max_records) {
        if (len - pos < hdr) {
            if (len - pos > 0 && memcmp(b + pos, prefix.buf,
                    (len - pos) < prefix.len ? (len - pos) : prefix.len) != 0)
                status = 1;
            break;
        }
        if (prefix.len && memcmp(b + pos, prefix.buf, prefix.len) != 0) { status = 1; break; }
        uint32_t sz = get_be32(b + pos + prefix.len);
        if ((unsigned long long)sz > max_size) { status = 2; break; }
        if (len - pos - hdr < (Py_ssize_t)sz) break;
        pos += hdr + sz; data_len += sz; count++;
    }
    lens_obj = PyBytes_FromStringAndSize(NULL, count * 4);
    data_obj = PyBytes_FromStringAndSize(NULL, head.len + data_len);
    if (!lens_obj || !data_obj) goto done;
    uint32_t *lw = (uint32_t *)PyBytes_AS_STRING(lens_obj);
    unsigned char *dw = (unsigned char *)PyBytes_AS_STRING(data_obj);
    if (head.len) memcpy(dw, head.buf, head.len);
    dw += head.len;
    Py_ssize_t p = start;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t sz = get_be32(b + p + prefix.len);
        lw[i] = sz;
        memcpy(dw, b + p + hdr, sz);
        dw += sz; p += hdr + sz;
    }
    result = Py_BuildValue("(OOni)", lens_obj, data_obj, pos, status);
done:
    Py_XDECREF(lens_obj);
    Py_XDECREF(data_obj);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&prefix);
    if (head.obj) PyBuffer_Release(&head);
    return result;
}

/*
 * lumberjack_json(buf, start, version, max_frame, max_events)
 *   -> (seqs, lengths, data, end, status, need)
 * Consecutive Lumberjack JSON frames [version]['J'][u32 BE seq][u32 BE size]
 * [payload] from buf[start:]: their sequence numbers and sizes (bytes of
 * native uint32) and payloads concatenated, the index after the last one.
 * status: 0 = stopped before fewer than 2 bytes, a frame of another type
 *             or version, or after max_events frames (max_events <= 0: no
 *             limit);
 *         1 = the buffer ends inside a JSON frame: need is the index its
 *             end needs, or -1 when its header is cut;
 *         2 = a size above max_frame: end is where that frame starts, need
 *             is the size.
 * streamproto.lumberjack.runs.scan_json_py is the same in Python.
 */
static PyObject *lumberjack_json(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t start, max_events;
    int version;
    unsigned long long max_frame;
    if (!PyArg_ParseTuple(args, "y*niKn", &buf, &start, &version, &max_frame, &max_events))
        return NULL;
    PyObject *result = NULL, *seqs_obj = NULL, *lens_obj = NULL, *data_obj = NULL;
    const unsigned char *b = (const unsigned char *)buf.buf;
    Py_ssize_t len = buf.len, pos = start, count = 0, data_len = 0, need = 0;
    int status = 0;
    if (start < 0 || start > len) {
        PyErr_SetString(PyExc_ValueError, "start out of range");
        goto done;
    }
    /* first pass: count frames and payload bytes */
    for (;;) {
        if (len - pos < 2 || b[pos] != version || b[pos + 1] != 'J') break;
        if (len - pos < 10) { status = 1; need = -1; break; }
        uint32_t sz = get_be32(b + pos + 6);
        if ((unsigned long long)sz > max_frame) { status = 2; need = sz; break; }
        if (len - pos - 10 < (Py_ssize_t)sz) { status = 1; need = pos + 10 + sz; break; }
        pos += 10 + sz; data_len += sz; count++;
        if (max_events > 0 && count == max_events) break;
    }
    seqs_obj = PyBytes_FromStringAndSize(NULL, count * 4);
    lens_obj = PyBytes_FromStringAndSize(NULL, count * 4);
    data_obj = PyBytes_FromStringAndSize(NULL, data_len);
    if (!seqs_obj || !lens_obj || !data_obj) goto done;
    uint32_t *sw = (uint32_t *)PyBytes_AS_STRING(seqs_obj);
    uint32_t *lw = (uint32_t *)PyBytes_AS_STRING(lens_obj);
    unsigned char *dw = (unsigned char *)PyBytes_AS_STRING(data_obj);
    Py_ssize_t p = start;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t sz = get_be32(b + p + 6);
        sw[i] = get_be32(b + p + 2);
        lw[i] = sz;
        memcpy(dw, b + p + 10, sz);
        dw += sz; p += 10 + sz;
    }
    result = Py_BuildValue("(OOOnin)", seqs_obj, lens_obj, data_obj, pos, status, need);
done:
    Py_XDECREF(seqs_obj);
    Py_XDECREF(lens_obj);
    Py_XDECREF(data_obj);
    PyBuffer_Release(&buf);
    return result;
}

/*
 * splice(lengths, data, head, prefix, suffix, tail) -> (out, out_lengths)
 * out = head + (prefix + record + suffix for each record) + tail, the
 * records being data cut at lengths (native uint32); out_lengths: each
 * record's size plus len(prefix) + len(suffix), as bytes of native uint32.
 * streamproto.lumberjack.runs.splice_py is the same in Python.
 */
static PyObject *splice(PyObject *self, PyObject *args) {
    Py_buffer lengths, data, head, prefix, suffix, tail;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*", &lengths, &data, &head, &prefix, &suffix,
                          &tail))
        return NULL;
    PyObject *out = NULL, *lens_obj = NULL, *result = NULL;
    Py_ssize_t n = record_count(&lengths, &data);
    if (n < 0) goto done;
    const uint32_t *lens = (const uint32_t *)lengths.buf;
    Py_ssize_t extra = prefix.len + suffix.len;
    if (extra > 0xFFFFFFFFLL) {
        PyErr_SetString(PyExc_ValueError, "prefix and suffix too long");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((unsigned long long)lens[i] + (unsigned long long)extra > 0xFFFFFFFFULL) {
            PyErr_SetString(PyExc_ValueError, "a record would exceed 4 GiB");
            goto done;
        }
    }
    out = PyBytes_FromStringAndSize(NULL, head.len + data.len + n * extra + tail.len);
    lens_obj = PyBytes_FromStringAndSize(NULL, n * 4);
    if (!out || !lens_obj) goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    uint32_t *lw = (uint32_t *)PyBytes_AS_STRING(lens_obj);
    const unsigned char *r = (const unsigned char *)data.buf;
    if (head.len) { memcpy(w, head.buf, head.len); w += head.len; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (prefix.len) { memcpy(w, prefix.buf, prefix.len); w += prefix.len; }
        memcpy(w, r, lens[i]); w += lens[i]; r += lens[i];
        if (suffix.len) { memcpy(w, suffix.buf, suffix.len); w += suffix.len; }
        lw[i] = (uint32_t)(lens[i] + extra);
    }
    if (tail.len) memcpy(w, tail.buf, tail.len);
    result = PyTuple_Pack(2, out, lens_obj);
done:
    Py_XDECREF(out);
    Py_XDECREF(lens_obj);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&data);
    PyBuffer_Release(&head);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&suffix);
    PyBuffer_Release(&tail);
    return result;
}

/*
 * send_frames(fd, lengths, data, prefix, index, skip)
 *   -> (index, skip, sent)
 * Sends records index.. of (lengths, data) as [prefix][u32 BE size][payload]
 * frames with one sendmsg on the non-blocking socket fd, the payloads
 * straight from data (no framed copy): up to SEND_FRAMES_MAX records a call.
 * skip: bytes of record index's frame already sent by an earlier call.
 * Returns where the next call starts and the bytes sent (0 when the socket
 * would block).  The GIL is released around sendmsg.
 */
#define SEND_FRAMES_MAX 512
static PyObject *send_frames(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer lengths, data, prefix;
    Py_ssize_t index, skip;
    if (!PyArg_ParseTuple(args, "iy*y*y*nn", &fd, &lengths, &data, &prefix, &index, &skip))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = lengths.len / 4;
    const uint32_t *lens = (const uint32_t *)lengths.buf;
    Py_ssize_t hdr = prefix.len + 4;
    if (lengths.len % 4 || index < 0 || index > n || skip < 0 || hdr > 16) {
        PyErr_SetString(PyExc_ValueError, "bad arguments");
        goto done;
    }
    /* the data offset of record index */
    Py_ssize_t off = 0;
    for (Py_ssize_t i = 0; i < index; i++) off += lens[i];
    unsigned char headers[SEND_FRAMES_MAX][16];
    struct iovec iov[2 * SEND_FRAMES_MAX];
    int niov = 0;
    Py_ssize_t planned = 0, s = skip, o = off;
    const unsigned char *d = (const unsigned char *)data.buf;
    for (Py_ssize_t i = index; i < n && i - index < SEND_FRAMES_MAX; i++) {
        unsigned char *h = headers[i - index];
        if (o + (Py_ssize_t)lens[i] > data.len) {
            PyErr_SetString(PyExc_ValueError, "lengths exceed the data");
            goto done;
        }
        if (prefix.len) memcpy(h, prefix.buf, prefix.len);
        put_be32(h + prefix.len, lens[i]);
        if (s < hdr) {
            iov[niov].iov_base = h + s;
            iov[niov].iov_len = hdr - s;
            niov++; planned += hdr - s;
            s = 0;
        } else {
            s -= hdr;
        }
        if (lens[i] > s) {
            iov[niov].iov_base = (void *)(d + o + s);
            iov[niov].iov_len = lens[i] - s;
            niov++; planned += lens[i] - s;
        }
        s = 0;
        o += lens[i];
    }
    ssize_t sent = 0;
    if (niov) {
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = niov;
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        do {
            sent = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        } while (sent < 0 && errno == EINTR);
        err = errno;
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (err == EAGAIN || err == EWOULDBLOCK) {
                sent = 0;
            } else {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
                goto done;
            }
        }
    }
    /* advance (index, skip) by sent bytes */
    Py_ssize_t left = sent + skip;
    while (index < n) {
        Py_ssize_t frame = hdr + lens[index];
        if (left < frame) break;
        left -= frame;
        index++;
    }
    result = Py_BuildValue("(nnn)", index, index < n ? left : (Py_ssize_t)0, (Py_ssize_t)sent);
done:
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&data);
    PyBuffer_Release(&prefix);
    return result;
}

/*
 * The first genrand_int32() after init_genrand(seed >>> 0), as npm
 * mersenne-twister 1.1.0's `new Twister(seed).random_int()`: only state
 * words 0, 1 and 397 matter for the first output, so seeding stops at 397
 * and one twist step is computed instead of 624.
 */
static uint32_t mt19937_first_u32(uint32_t s) {
    uint32_t x = s, m1, y;
    x = 1812433253u * (x ^ (x >> 30)) + 1u;
    m1 = x;
    for (uint32_t i = 2; i <= 397; i++) x = 1812433253u * (x ^ (x >> 30)) + i;
    y = (s & 0x80000000u) | (m1 & 0x7fffffffu);
    y = x ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

static PyObject *mt19937_first(PyObject *self, PyObject *arg) {
    unsigned long long seed = PyLong_AsUnsignedLongLongMask(arg);  /* seed >>> 0 */
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(mt19937_first_u32((uint32_t)seed));
}

#if defined(RWF_NOWAIT)
/*
 * pread_cached(fd, n, offset) -> bytes: pread, but only what the page cache
 * holds (preadv2 with RWF_NOWAIT).  Returns fewer than n bytes only at the
 * end of the file; raises BlockingIOError when any of the range would have
 * to come from the disk (the caller reads it in a thread instead).  Why C:
 * os.preadv needs a bytearray, which Python zero-fills before the read
 * (a second pass over every byte).
 */
static PyObject *pread_cached(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t n;
    long long offset;
    if (!PyArg_ParseTuple(args, "inL", &fd, &n, &offset))
        return NULL;
    if (n < 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "negative size or offset");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL)
        return NULL;
    char *buf = PyBytes_AS_STRING(out);
    Py_ssize_t got = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (got < n) {
        struct iovec iov = {buf + got, (size_t)(n - got)};
        ssize_t r = preadv2(fd, &iov, 1, (off_t)(offset + got), RWF_NOWAIT);
        if (r < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (r == 0) break;          /* the end of the file */
        got += r;                   /* part of it cached: ask for the rest */
    }
    Py_END_ALLOW_THREADS
    if (err) {
        Py_DECREF(out);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);  /* EAGAIN: BlockingIOError */
    }
    if (got < n && _PyBytes_Resize(&out, got) < 0)
        return NULL;
    return out;
}
#endif

static PyMethodDef methods[] = {
    {"mt19937_first", mt19937_first, METH_O,
     "mt19937_first(seed) -> npm mersenne-twister's first random_int() for that seed"},
    {"frame_records", frame_records, METH_VARARGS,
     "frame_records(lengths, data, prefix) -> bytes of [prefix][u32 BE size][payload]*"},
    {"send_frames", send_frames, METH_VARARGS,
     "send_frames(fd, lengths, data, prefix, index, skip) -> (index, skip, sent)"},
    {"scan_frames", scan_frames, METH_VARARGS,
     "scan_frames(buf, start, prefix, max_size, max_records[, head]) -> (lengths, data, end, status)"},
    {"lumberjack_json", lumberjack_json, METH_VARARGS,
     "lumberjack_json(buf, start, version, max_frame, max_events)"
     " -> (seqs, lengths, data, end, status, need)"},
    {"splice", splice, METH_VARARGS,
     "splice(lengths, data, head, prefix, suffix, tail) -> (out, out_lengths)"},
#if defined(RWF_NOWAIT)
    {"pread_cached", pread_cached, METH_VARARGS,
     "pread_cached(fd, n, offset) -> bytes from the page cache, or BlockingIOError"},
#endif
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "streamproto._speedups", "Optional C accelerator.", -1, methods
};

#if defined(__linux__)
#include <pthread.h>

static volatile unsigned long forks;

static void forked(void) {
    forks++;
}

unsigned long sp_forks(void) {
    return forks;
}
#endif

PyMODINIT_FUNC PyInit__speedups(void) {
#if defined(__linux__)
    /* once: the module is initialised once a process (and kept) */
    static int watching;
    if (!watching) {
        int err = pthread_atfork(NULL, NULL, forked);
        if (err) {
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        watching = 1;
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && (add_syncer(m) < 0 || add_sender(m) < 0))
        Py_CLEAR(m);
    return m;
}
