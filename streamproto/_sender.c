/*
 * Small answers sent on a native thread (streamproto.core.sendthread).
 *
 * Why: a server answering many small requests spends half its reactor
 * thread in send(2).  On loopback, and on any machine where the peer waits
 * for its answer, the sending call also does the receiving side's work
 * (the TCP receive path, the wake-up of the peer's thread): measured on a
 * Styx server under wrk, 42% of the reactor thread was send(2) and 38% was
 * Python.  Here the reactor copies an answer into a job and goes on; one
 * native thread, which never takes the GIL, makes the sends.
 *
 * The thread only ever sends what the socket takes at once
 * (MSG_DONTWAIT).  The first send of a connection that would block, or
 * fails, blocks the connection here: that job's rest and every later job
 * of the connection come back, unsent and in order, to the reactor, which
 * sends them the usual way (a writer registered with the reactor) and then
 * unblocks the connection.  The reactor learns of it from an eventfd, and
 * only then: a connection whose sends all went through costs no report.
 *
 * A connection owns a duplicate of the socket's descriptor.  Closing it is
 * the thread's job once every job of the connection is done, so that a
 * descriptor number is never reused under a job still queued for it.
 *
 * One lock guards everything; the sends themselves run outside it.
 * Linux only (eventfd, MSG_NOSIGNAL); elsewhere the module has no
 * SendThread and answers are sent from the reactor thread.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include "_forks.h"
#include <structmember.h>

#include "_sender.h"

#if defined(__linux__)
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

struct conn;
typedef struct held held;

typedef struct sjob {
    struct sjob *next;
    struct conn *c;
    size_t len, off;
    int result;           /* send_job's */
    char data[];
} sjob;

typedef struct sshared {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    sjob *todo, *todo_tail;
    struct conn *ready;   /* connections the reactor must look at */
    int idle;             /* the thread waits for a job */
    int running;          /* the thread was started and has not exited */
    int closing;
    int refs;             /* the object, the thread, each connection */
    int efd;
} sshared;

typedef struct conn {
    sshared *s;
    long long token;
    int fd;
    int inflight;         /* jobs queued or being sent */
    int blocked;          /* a send would block or failed: no more jobs */
    int error;            /* errno of a failed send, or 0 */
    int want_settle;      /* report when inflight reaches 0 */
    int closed;           /* the object let go: close fd at inflight 0 */
    int held_out;         /* a held answer waits for its fsync (see held) */
    sjob *back, *back_tail;   /* jobs that came back unsent */
    int listed;           /* on s->ready */
    struct conn *rprev, *rnext;
} conn;

/* called with s->lock held: off the ready list, if on it */
static void unlist(sshared *s, conn *c) {
    if (!c->listed)
        return;
    if (c->rprev)
        c->rprev->rnext = c->rnext;
    else
        s->ready = c->rnext;
    if (c->rnext)
        c->rnext->rprev = c->rprev;
    c->rprev = c->rnext = NULL;
    c->listed = 0;
}

/* called with s->lock held; unlocks it */
static void s_release(sshared *s) {
    int last = --s->refs == 0;
    pthread_mutex_unlock(&s->lock);
    if (!last)
        return;
    for (sjob *j = s->todo; j;) { sjob *n = j->next; free(j); j = n; }
    close(s->efd);
    pthread_cond_destroy(&s->wake);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

/* called with s->lock held: the connection is done for good (its
 * reference to s is the caller's to drop) */
static void conn_free(conn *c) {
    unlist(c->s, c);
    for (sjob *j = c->back; j;) { sjob *n = j->next; free(j); j = n; }
    if (c->fd >= 0)
        close(c->fd);
    free(c);
}

/* called with s->lock held: tell the reactor to look at c */
static void report(sshared *s, conn *c) {
    /* a list through the connections: nothing to allocate here, so a
     * report cannot be lost (a lost one would leave the connection's
     * answers waiting for good) */
    if (!c->listed) {
        c->listed = 1;
        c->rprev = NULL;
        c->rnext = s->ready;
        if (s->ready)
            s->ready->rprev = c;
        s->ready = c;
    }
    uint64_t one = 1;
    ssize_t ignored = write(s->efd, &one, sizeof one);
    (void)ignored;
}

/* one job, outside the lock: 1 if it was all sent, 0 if not (the socket
 * would block, or the connection is blocked), -errno if a send failed */
static int send_job(sjob *j) {
    conn *c = j->c;
    /* only this thread sets blocked while the connection has jobs out, and
     * only the reactor clears it, when none are: atomics, not the lock */
    if (__atomic_load_n(&c->blocked, __ATOMIC_ACQUIRE))
        return 0;
    while (j->off < j->len) {
        ssize_t n = send(c->fd, j->data + j->off, j->len - j->off,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            j->off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        /* no later job of the connection may go before this one's rest */
        __atomic_store_n(&c->blocked, 1, __ATOMIC_RELEASE);
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return -errno;
        return 0;
    }
    return 1;
}

/* with s->lock held, after a job of c is done: at its last, free a
 * connection let go, or report one that blocked or that the reactor
 * waits to settle.  The caller holds a reference to s besides c's (the
 * send thread, or a held answer's), so dropping c's is never the last. */
static void settle_after(sshared *s, conn *c) {
    if (c->inflight)
        return;
    if (c->closed) {
        conn_free(c);
        s->refs--;
    } else if (c->blocked || c->want_settle) {
        c->want_settle = 0;
        report(s, c);
    }
}

/* with s->lock held: a job is done, sent or not */
static void finish(sshared *s, sjob *j, int sent) {
    conn *c = j->c;
    c->inflight--;
    if (sent > 0) {
        free(j);
    } else {
        if (sent < 0 && !c->error)
            c->error = -sent;
        j->next = NULL;
        if (c->back_tail)
            c->back_tail->next = j;
        else
            c->back = j;
        c->back_tail = j;
    }
    settle_after(s, c);
}

/* A job of c carrying a copy of data; NULL without memory. */
static sjob *new_job(conn *c, const void *data, size_t len) {
    sjob *j = malloc(sizeof *j + len);
    if (!j)
        return NULL;
    j->next = NULL;
    j->c = c;
    j->len = len;
    j->off = 0;
    memcpy(j->data, data, len);
    return j;
}

/* With s->lock held: whether c takes no more jobs now.  The thread
 * blocked it (only ever while jobs of it were out: the caller's fallback
 * keeps them in order), or it stops, or an answer held for an fsync must
 * go first (the same fallback: what was refused comes back once that one
 * is done). */
static int refuses(sshared *s, conn *c) {
    return __atomic_load_n(&c->blocked, __ATOMIC_ACQUIRE) || s->closing || c->held_out;
}

/* With s->lock held: j at the end of the thread's queue; 1 if the thread
 * must be woken, which the caller does after the unlock (woken under it,
 * the thread would at once wait for the lock: a second wake-up before
 * the send). */
static int queue_job(sshared *s, sjob *j) {
    j->next = NULL;
    if (s->todo_tail)
        s->todo_tail->next = j;
    else
        s->todo = j;
    s->todo_tail = j;
    int wake = s->idle;
    s->idle = 0;
    return wake;
}

static void *sender_main(void *arg) {
    sshared *s = (sshared *)arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (!s->todo && !s->closing) {
            s->idle = 1;
            pthread_cond_wait(&s->wake, &s->lock);
        }
        s->idle = 0;
        if (!s->todo)
            break;                /* closing, and nothing left to send */
        sjob *first = s->todo;
        s->todo = s->todo_tail = NULL;
        pthread_mutex_unlock(&s->lock);
        /* the sends without the lock, then their bookkeeping under it
         * once: the reactor takes the lock for every write it hands over,
         * and a lock taken and left for every send would make it wait */
        for (sjob *j = first; j; j = j->next)
            j->result = send_job(j);
        pthread_mutex_lock(&s->lock);
        for (sjob *j = first; j;) {
            sjob *next = j->next;
            finish(s, j, j->result);
            j = next;
        }
    }
    s->running = 0;
    s_release(s);
    return NULL;
}

/* -- SendThread --------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    sshared *s;
    unsigned long forks;    /* sp_forks() when made */
} SendThreadObject;

typedef struct {
    PyObject_HEAD
    conn *c;
    PyObject *thread;     /* the SendThread: it outlives its sockets */
} SendSocketObject;

static PyTypeObject SendSocketType;

static int st_check(SendThreadObject *self) {
    if (!self->s) {
        PyErr_SetString(PyExc_RuntimeError, "SendThread closed");
        return -1;
    }
    if (self->forks != sp_forks()) {
        PyErr_SetString(PyExc_RuntimeError, "SendThread used in a forked process");
        return -1;
    }
    return 0;
}

static int SendThread_init(SendThreadObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":SendThread", kwlist))
        return -1;
    if (self->s) {
        PyErr_SetString(PyExc_RuntimeError, "SendThread already initialised");
        return -1;
    }
    sshared *s = calloc(1, sizeof *s);
    if (!s) {
        PyErr_NoMemory();
        return -1;
    }
    s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (s->efd < 0) {
        free(s);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    s->refs = 1;
    self->s = s;
    self->forks = sp_forks();
    return 0;
}

static PyObject *SendThread_socket(SendThreadObject *self, PyObject *args) {
    int fd;
    long long token;
    if (!PyArg_ParseTuple(args, "iL:socket", &fd, &token))
        return NULL;
    if (st_check(self) < 0)
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    sshared *s = self->s;
    int err = 0;
    pthread_mutex_lock(&s->lock);
    if (!s->running && !s->closing) {
        /* started at the first connection, after any daemonising fork */
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        err = pthread_create(&t, &attr, sender_main, s);
        pthread_attr_destroy(&attr);
        if (!err) {
            s->running = 1;
            s->refs++;
        }
    }
    pthread_mutex_unlock(&s->lock);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    SendSocketObject *sock = PyObject_New(SendSocketObject, &SendSocketType);
    if (!sock)
        return NULL;
    conn *c = calloc(1, sizeof *c);
    if (!c) {
        sock->c = NULL;
        sock->thread = NULL;
        Py_DECREF(sock);
        return PyErr_NoMemory();
    }
    c->s = s;
    c->token = token;
    c->fd = fd;
    pthread_mutex_lock(&s->lock);
    s->refs++;
    pthread_mutex_unlock(&s->lock);
    sock->c = c;
    Py_INCREF(self);
    sock->thread = (PyObject *)self;
    return (PyObject *)sock;
}

static PyObject *SendThread_ready(SendThreadObject *self, PyObject *unused) {
    if (st_check(self) < 0)
        return NULL;
    sshared *s = self->s;
    /* the list is filled under the lock (the thread never needs the GIL,
     * so holding both is safe) and emptied only once it is filled: with no
     * memory for it, the connections stay listed for the next call.  It
     * is made before the lock is taken: making a list may run the
     * collector, and a SendSocket it frees takes the lock to close */
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    uint64_t count;
    ssize_t ignored = read(s->efd, &count, sizeof count);   /* EAGAIN: none */
    (void)ignored;
    pthread_mutex_lock(&s->lock);
    for (conn *c = s->ready; out && c; c = c->rnext) {
        PyObject *t = PyLong_FromLongLong(c->token);
        if (!t || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    if (out) {
        while (s->ready)
            unlist(s, s->ready);
    } else if (s->ready) {
        uint64_t one = 1;
        ignored = write(s->efd, &one, sizeof one);   /* look again */
    }
    pthread_mutex_unlock(&s->lock);
    return out;
}

static PyObject *SendThread_forked(SendThreadObject *self, PyObject *unused) {
    return PyBool_FromLong(self->forks != sp_forks());
}

static PyObject *SendThread_fileno(SendThreadObject *self, PyObject *unused) {
    if (st_check(self) < 0)
        return NULL;
    return PyLong_FromLong(self->s->efd);
}

static void st_stop(SendThreadObject *self) {
    sshared *s = self->s;
    if (!s)
        return;
    self->s = NULL;
    pthread_mutex_lock(&s->lock);
    s->closing = 1;     /* the thread sends what is queued, then exits */
    pthread_cond_signal(&s->wake);
    s_release(s);
}

static PyObject *SendThread_close(SendThreadObject *self, PyObject *unused) {
    if (self->s && self->forks != sp_forks()) {
        self->s = NULL;   /* a fork's copy: the thread and lock are the parent's */
        Py_RETURN_NONE;
    }
    st_stop(self);
    Py_RETURN_NONE;
}

static void SendThread_dealloc(SendThreadObject *self) {
    if (self->s && self->forks == sp_forks())
        st_stop(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef SendThread_methods[] = {
    {"socket", (PyCFunction)SendThread_socket, METH_VARARGS,
     "socket(fd, token) -> SendSocket: sends to fd (which it then owns) on the thread"},
    {"ready", (PyCFunction)SendThread_ready, METH_NOARGS,
     "ready() -> [token]: sockets that settled (see SendSocket), clearing fileno()'s readiness"},
    {"forked", (PyCFunction)SendThread_forked, METH_NOARGS,
     "forked() -> whether this process forked since the SendThread was made (its\n"
     "thread stayed in the parent: it refuses to be used here)"},
    {"fileno", (PyCFunction)SendThread_fileno, METH_NOARGS,
     "fileno() -> the eventfd that is readable when a socket settled"},
    {"close", (PyCFunction)SendThread_close, METH_NOARGS,
     "close(): the thread sends what was queued, then exits"},
    {NULL, NULL, 0, NULL}
};

static PyTypeObject SendThreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "streamproto._speedups.SendThread",
    .tp_doc = "sends on a native thread, sockets that need the reactor on an eventfd",
    .tp_basicsize = sizeof(SendThreadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SendThread_init,
    .tp_dealloc = (destructor)SendThread_dealloc,
    .tp_methods = SendThread_methods,
};

/* -- held answers ------------------------------------------------------
 *
 * An answer made before the fsync it acknowledges, sent by the thread that
 * ran that fsync the moment it succeeded (the file store's syncer,
 * _syncer.c), rather than by the reactor once it learns of it.  At low
 * load that took the reactor's wake-up from the syncer's eventfd, and the
 * Python of the acknowledgement, out of the answer's latency
 * (doc/performance.rst, run P).
 *
 * SendSocket.hold(data) takes the connection's next place: the job counts
 * as in flight, and every later send() of the connection comes back to
 * the reactor's queue until it is done, so nothing overtakes it.  The
 * syncer's thread then finishes it: sent there and then when the
 * connection has nothing else out (what the socket does not take comes
 * back to the reactor, as any job's rest), queued for the send thread
 * behind what it has, or, when the fsync failed, cancelled, and the
 * reactor answers the usual way.  A held answer is shared by the Python
 * object and the syncer's job: the last of them frees it. */

struct held {
    int refs;             /* atomics: the Held object, a syncer's job */
    int state;            /* HELD_*, under s->lock */
    int claimed;          /* given to a syncer (at most once) */
    int durable;          /* the syncer's verdict (its thread's own) */
    sjob *j;              /* while pending */
    sshared *s;           /* a reference of its own */
    struct held *next;    /* the syncer's list of answers to finish */
};

enum { HELD_PENDING = 0, HELD_SENT = 1, HELD_CANCELLED = 2 };

static void held_decref(held *h) {
    if (__atomic_sub_fetch(&h->refs, 1, __ATOMIC_ACQ_REL))
        return;
    sshared *s = h->s;
    pthread_mutex_lock(&s->lock);
    s_release(s);
    free(h);
}

/* any thread, without the GIL; s->lock must not be held */
void held_finish(held *h, int durable) {
    sshared *s = h->s;
    pthread_mutex_lock(&s->lock);
    if (h->state != HELD_PENDING) {
        pthread_mutex_unlock(&s->lock);
        return;
    }
    sjob *j = h->j;
    conn *c = j->c;
    h->j = NULL;
    if (!durable || s->closing || c->closed) {
        /* the reactor answers (or nobody is left to answer) */
        h->state = HELD_CANCELLED;
        c->held_out = 0;
        c->inflight--;
        free(j);
        settle_after(s, c);
        pthread_mutex_unlock(&s->lock);
        return;
    }
    h->state = HELD_SENT;
    int wake = 0;
    if (c->inflight == 1 && !__atomic_load_n(&c->blocked, __ATOMIC_ACQUIRE)) {
        /* nothing of the connection ahead of it: sent on this thread,
         * which saves the send thread's wake-up too.  held_out stays set
         * until it is done: a send() meanwhile (the reactor, told of the
         * fsync, answering the next request) comes back to the reactor's
         * queue rather than racing it on the send thread. */
        pthread_mutex_unlock(&s->lock);
        int sent = send_job(j);
        pthread_mutex_lock(&s->lock);
        c->held_out = 0;
        finish(s, j, sent);
    } else {
        /* behind the connection's jobs out, on the send thread, which
         * sends in order whatever is queued after it */
        c->held_out = 0;
        wake = queue_job(s, j);
    }
    pthread_mutex_unlock(&s->lock);
    if (wake)
        pthread_cond_signal(&s->wake);
}

void held_set_durable(held *h, int durable) {
    h->durable = durable;
}

void held_finish_listed(held *first) {
    /* in order: the answers of one connection are never two at once, but
     * those of several connections go out in the order their appends
     * were made */
    for (held *h = first; h;) {
        held *next = h->next;
        held_finish(h, h->durable);
        held_decref(h);
        h = next;
    }
}

void held_link(held *h, held *next) {
    h->next = next;
}

void held_drop(held *h) {
    held_finish(h, 0);
    held_decref(h);
}

typedef struct {
    PyObject_HEAD
    held *h;
} HeldObject;

static PyTypeObject HeldType;

held *held_claim(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &HeldType)) {
        PyErr_SetString(PyExc_TypeError, "not a held answer (SendSocket.hold)");
        return NULL;
    }
    held *h = ((HeldObject *)obj)->h;
    pthread_mutex_lock(&h->s->lock);
    int ok = !h->claimed && h->state == HELD_PENDING;
    if (ok)
        h->claimed = 1;
    pthread_mutex_unlock(&h->s->lock);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "held answer already given or finished");
        return NULL;
    }
    __atomic_add_fetch(&h->refs, 1, __ATOMIC_ACQ_REL);
    h->next = NULL;
    h->durable = 0;
    return h;
}

static int held_state(HeldObject *self) {
    held *h = self->h;
    pthread_mutex_lock(&h->s->lock);
    int state = h->state;
    pthread_mutex_unlock(&h->s->lock);
    return state;
}

static PyObject *Held_get_sent(HeldObject *self, void *closure) {
    return PyBool_FromLong(held_state(self) == HELD_SENT);
}

static PyObject *Held_get_pending(HeldObject *self, void *closure) {
    return PyBool_FromLong(held_state(self) == HELD_PENDING);
}

static PyObject *Held_cancel(HeldObject *self, PyObject *unused) {
    held_finish(self->h, 0);
    Py_RETURN_NONE;
}

static void Held_dealloc(HeldObject *self) {
    if (self->h) {
        /* not given to a syncer, or the syncer dropped it: nobody else
         * would ever finish it (and the connection would wait for good) */
        if (!self->h->claimed)
            held_finish(self->h, 0);
        held_decref(self->h);
    }
    PyObject_Free(self);
}

static PyMethodDef Held_methods[] = {
    {"cancel", (PyCFunction)Held_cancel, METH_NOARGS,
     "cancel(): a pending answer is not sent (the reactor answers instead)"},
    {NULL, NULL, 0, NULL}
};

static PyGetSetDef Held_getset[] = {
    {"sent", (getter)Held_get_sent, NULL,
     "True once handed to the socket (sent, queued, or come back to the reactor's queue)", NULL},
    {"pending", (getter)Held_get_pending, NULL, "True until sent or cancelled", NULL},
    {NULL, NULL, NULL, NULL, NULL}
};

static PyTypeObject HeldType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "streamproto._speedups.Held",
    .tp_doc = "an answer sent once the fsync it waits for succeeds (SendSocket.hold)",
    .tp_basicsize = sizeof(HeldObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Held_dealloc,
    .tp_methods = Held_methods,
    .tp_getset = Held_getset,
};

/* -- SendSocket --------------------------------------------------------- */

static conn *sk_conn(SendSocketObject *self) {
    if (!self->c) {
        PyErr_SetString(PyExc_ValueError, "SendSocket closed");
        return NULL;
    }
    return self->c;
}

static PyObject *SendSocket_send(SendSocketObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*:send", &b))
        return NULL;
    conn *c = sk_conn(self);
    if (!c) {
        PyBuffer_Release(&b);
        return NULL;
    }
    sshared *s = c->s;
    if (b.len == 0) {
        PyBuffer_Release(&b);
        Py_RETURN_TRUE;
    }
    sjob *j = new_job(c, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    if (!j)
        return PyErr_NoMemory();
    pthread_mutex_lock(&s->lock);
    if (refuses(s, c)) {
        pthread_mutex_unlock(&s->lock);
        free(j);
        Py_RETURN_FALSE;
    }
    c->inflight++;
    int wake = queue_job(s, j);
    pthread_mutex_unlock(&s->lock);
    if (wake)
        pthread_cond_signal(&s->wake);
    Py_RETURN_TRUE;
}

static PyObject *SendSocket_hold(SendSocketObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*:hold", &b))
        return NULL;
    conn *c = sk_conn(self);
    if (!c) {
        PyBuffer_Release(&b);
        return NULL;
    }
    sshared *s = c->s;
    HeldObject *obj = PyObject_New(HeldObject, &HeldType);
    held *h = calloc(1, sizeof *h);
    sjob *j = new_job(c, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    if (!obj || !h || !j) {
        free(h);
        free(j);
        if (obj) {
            obj->h = NULL;
            Py_DECREF(obj);
        }
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&s->lock);
    if (refuses(s, c) || !s->running) {
        pthread_mutex_unlock(&s->lock);
        free(h);
        free(j);
        obj->h = NULL;
        Py_DECREF(obj);
        Py_RETURN_NONE;
    }
    c->inflight++;
    c->held_out = 1;
    s->refs++;
    h->refs = 1;
    h->state = HELD_PENDING;
    h->j = j;
    h->s = s;
    pthread_mutex_unlock(&s->lock);
    obj->h = h;
    return (PyObject *)obj;
}

static PyObject *SendSocket_returned(SendSocketObject *self, PyObject *unused) {
    conn *c = sk_conn(self);
    if (!c)
        return NULL;
    sshared *s = c->s;
    pthread_mutex_lock(&s->lock);
    if (c->inflight) {
        /* not settled: the thread reports the token once it is */
        c->want_settle = 1;
        pthread_mutex_unlock(&s->lock);
        Py_RETURN_NONE;
    }
    sjob *back = c->back;
    c->back = c->back_tail = NULL;
    int error = c->error;
    pthread_mutex_unlock(&s->lock);
    PyObject *list = PyList_New(0);
    for (sjob *j = back; list && j; j = j->next) {
        PyObject *data = PyBytes_FromStringAndSize(j->data + j->off,
                                                   (Py_ssize_t)(j->len - j->off));
        if (!data || PyList_Append(list, data) < 0)
            Py_CLEAR(list);
        Py_XDECREF(data);
    }
    if (!list) {
        /* keep them for the next call */
        pthread_mutex_lock(&s->lock);
        if (back) {
            sjob *tail = back;
            while (tail->next)
                tail = tail->next;
            tail->next = c->back;
            if (!c->back)
                c->back_tail = tail;
            c->back = back;
        }
        pthread_mutex_unlock(&s->lock);
        return NULL;
    }
    for (sjob *j = back; j;) { sjob *n = j->next; free(j); j = n; }
    PyObject *out = Py_BuildValue("(Ni)", list, error);
    return out;
}

static PyObject *SendSocket_unblock(SendSocketObject *self, PyObject *unused) {
    conn *c = sk_conn(self);
    if (!c)
        return NULL;
    sshared *s = c->s;
    pthread_mutex_lock(&s->lock);
    int ok = !c->inflight && !c->back && !c->error;
    if (ok)
        __atomic_store_n(&c->blocked, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&s->lock);
    return PyBool_FromLong(ok);
}

static PyObject *SendSocket_settle(SendSocketObject *self, PyObject *unused) {
    conn *c = sk_conn(self);
    if (!c)
        return NULL;
    sshared *s = c->s;
    pthread_mutex_lock(&s->lock);
    int settled = !c->inflight;
    if (!settled)
        c->want_settle = 1;
    pthread_mutex_unlock(&s->lock);
    return PyBool_FromLong(settled);
}

static void sk_close(SendSocketObject *self) {
    conn *c = self->c;
    if (!c)
        return;
    self->c = NULL;
    sshared *s = c->s;
    pthread_mutex_lock(&s->lock);
    c->closed = 1;
    if (c->inflight) {
        pthread_mutex_unlock(&s->lock);   /* the thread frees it */
        return;
    }
    conn_free(c);
    s_release(s);         /* may be the last reference, after a close() */
}

static PyObject *SendSocket_close(SendSocketObject *self, PyObject *unused) {
    sk_close(self);
    Py_RETURN_NONE;
}

static PyObject *SendSocket_get_inflight(SendSocketObject *self, void *closure) {
    conn *c = self->c;
    if (!c)
        return PyLong_FromLong(0);
    pthread_mutex_lock(&c->s->lock);
    int n = c->inflight;
    pthread_mutex_unlock(&c->s->lock);
    return PyLong_FromLong(n);
}

static PyObject *SendSocket_get_token(SendSocketObject *self, void *closure) {
    conn *c = sk_conn(self);
    return c ? PyLong_FromLongLong(c->token) : NULL;
}

static void SendSocket_dealloc(SendSocketObject *self) {
    sk_close(self);
    Py_XDECREF(self->thread);
    PyObject_Free(self);
}

static PyMethodDef SendSocket_methods[] = {
    {"send", (PyCFunction)SendSocket_send, METH_VARARGS,
     "send(data) -> True if queued for the thread, False if the socket is blocked"},
    {"hold", (PyCFunction)SendSocket_hold, METH_VARARGS,
     "hold(data) -> Held, or None when the socket cannot take one now: data waits for\n"
     "the fsync a Syncer job is given it with, and goes out from there"},
    {"returned", (PyCFunction)SendSocket_returned, METH_NOARGS,
     "returned() -> ([bytes not sent, in order], errno or 0); None while jobs are out"},
    {"unblock", (PyCFunction)SendSocket_unblock, METH_NOARGS,
     "unblock() -> True if the thread may send again (nothing out, nothing returned)"},
    {"settle", (PyCFunction)SendSocket_settle, METH_NOARGS,
     "settle() -> True if no job is out; else the thread reports the token when none is"},
    {"close", (PyCFunction)SendSocket_close, METH_NOARGS,
     "close(): the descriptor is closed once the jobs out are done"},
    {NULL, NULL, 0, NULL}
};

static PyGetSetDef SendSocket_getset[] = {
    {"inflight", (getter)SendSocket_get_inflight, NULL, "jobs queued or being sent", NULL},
    {"token", (getter)SendSocket_get_token, NULL, "the token ready() reports", NULL},
    {NULL, NULL, NULL, NULL, NULL}
};

static PyTypeObject SendSocketType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "streamproto._speedups.SendSocket",
    .tp_doc = "one connection's sends on a SendThread",
    .tp_basicsize = sizeof(SendSocketObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)SendSocket_dealloc,
    .tp_methods = SendSocket_methods,
    .tp_getset = SendSocket_getset,
};

int add_sender(PyObject *module) {
    if (PyType_Ready(&SendThreadType) < 0 || PyType_Ready(&SendSocketType) < 0)
        return -1;
    if (PyType_Ready(&HeldType) < 0)
        return -1;
    Py_INCREF(&SendThreadType);
    if (PyModule_AddObject(module, "SendThread", (PyObject *)&SendThreadType) < 0) {
        Py_DECREF(&SendThreadType);
        return -1;
    }
    return 0;
}

#else

int add_sender(PyObject *module) {
    (void)module;
    return 0;
}

#endif
