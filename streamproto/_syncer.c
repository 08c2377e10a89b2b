/*
 * The file store's group commit without the interpreter: fsync on native
 * threads that never take the GIL, each finished job announced on an
 * eventfd the reactor watches (streamproto.log.syncer.NativeSyncer).
 *
 * Why: with the fsync on a Python thread, every group commit changes the
 * GIL's hands twice.  The thread pool's worker needs the interpreter to
 * start (to call os.fsync) and again to return (callFromThread), and while
 * the reactor thread is busy each of those waits up to a switch interval
 * (streamproto.core.gil).  That wait is added to every acknowledgement's
 * latency.  Here the reactor hands a job over under a mutex, a native
 * thread runs the fsyncs, and the reactor learns of it from epoll, like
 * any other readable descriptor.
 *
 * Lanes: each log submits its jobs on a lane of its own.  A lane's jobs
 * run one at a time and in order, and whatever the lane has queued when
 * its running job ends starts at once, on the same thread, as one run of
 * fsyncs (the union of the jobs' files, then the directory): the next
 * group commit starts the moment the last one ends, without waiting for
 * the reactor to learn of it and hand the next one over.  That round trip
 * was in every acknowledgement's latency under load, and halved the
 * fsyncs a server could run (doc/performance.rst, run N).  Each merged
 * job is still reported on its own, in the order submitted.  Lane 0 is no
 * lane: such a job runs alone, whenever a thread is free.
 *
 * Linux only (eventfd); elsewhere the module has no Syncer and the store
 * keeps its thread pool.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include "_forks.h"

#include "_syncer.h"
#include "_sender.h"

#if defined(__linux__)
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

typedef struct job {
    struct job *next;
    long long id;
    long long lane;     /* 0: none */
    int nfds;
    int *fds;
    char *dir;          /* a directory to fsync after the files, or NULL */
    int error;          /* the errno of the first failure, or 0 */
    double seconds;     /* how long the fsyncs took; -1 for a job that ran
                         * merged into the one before it (timed there) */
    int nheld;
    int answered;       /* its held answers were sent from here */
    held **helds;       /* answers to send once durable (_sender.c), until
                         * the thread takes them */
} job;

/* What the threads share with the Python object.  It outlives the object
 * while a thread still runs: the last of them (object included) frees it. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    job *todo, *todo_tail;
    job *done, *done_tail;
    int queued;         /* jobs in todo */
    int threads;        /* threads running */
    int idle;           /* threads waiting for a job */
    int max_threads;
    int closing;
    int refs;           /* the object, and each thread */
    int efd;
    long long *busy;    /* the lanes running now, one slot a thread (0: free) */
    long long *failed;  /* lanes a run failed on: their held answers are
                         * never sent after that (a later fsync's success
                         * does not make what the failed one lost durable) */
    int nfailed;
    int no_answers;     /* a failed lane could not be remembered */
} shared;

typedef struct {
    PyObject_HEAD
    shared *s;
    long long next_id;
    unsigned long forks;    /* sp_forks() when made */
} SyncerObject;

static void free_job(job *j) {
    for (int i = 0; i < j->nheld; i++)
        held_drop(j->helds[i]);
    free(j->helds);
    free(j->fds);
    free(j->dir);
    free(j);
}

static void release(shared *s) {
    /* called with s->lock held; unlocks it */
    int last = --s->refs == 0;
    pthread_mutex_unlock(&s->lock);
    if (!last)
        return;
    for (job *j = s->todo; j;) { job *n = j->next; free_job(j); j = n; }
    for (job *j = s->done; j;) { job *n = j->next; free_job(j); j = n; }
    close(s->efd);
    free(s->busy);
    free(s->failed);
    pthread_cond_destroy(&s->wake);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int fsync_fd(int fd) {
    while (fsync(fd) < 0) {
        if (errno != EINTR)
            return errno;
    }
    return 0;
}

/* One run of a lane's jobs (a lone job for lane 0): each file once, in
 * the order first submitted (a log's older segment before its newer
 * one), then the directory if any job asked for it.  Every job of the run
 * gets its outcome. */
static void run_jobs(job *first) {
    double start = now();
    int error = 0;
    const char *dir = NULL;
    for (job *j = first; j && !error; j = j->next) {
        for (int i = 0; i < j->nfds && !error; i++) {
            int seen = 0;
            for (job *k = first; k != j && !seen; k = k->next)
                for (int m = 0; m < k->nfds && !seen; m++)
                    seen = k->fds[m] == j->fds[i];
            for (int m = 0; m < i && !seen; m++)
                seen = j->fds[m] == j->fds[i];
            if (!seen)
                error = fsync_fd(j->fds[i]);
        }
        if (j->dir && !dir)
            dir = j->dir;
    }
    if (dir && !error) {
        int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) {
            error = errno;
        } else {
            error = fsync_fd(fd);
            close(fd);
        }
    }
    double seconds = now() - start;
    for (job *j = first; j; j = j->next) {
        j->error = error;
        j->seconds = j == first ? seconds : -1.0;
    }
}

static int lane_busy(shared *s, long long lane) {
    for (int i = 0; lane && i < s->max_threads; i++)
        if (s->busy[i] == lane)
            return 1;
    return 0;
}

/* The first job on the queue a thread may run now (its lane not
 * running), or NULL; *prev (when given) is the job before it, or NULL.
 * Called with s->lock held. */
static job *first_free(shared *s, job **prev) {
    job *p = NULL;
    for (job *j = s->todo; j; p = j, j = j->next) {
        if (!lane_busy(s, j->lane)) {
            if (prev)
                *prev = p;
            return j;
        }
    }
    return NULL;
}

/* Take the first job a thread may run off the queue, with every later
 * job of its lane, linked in order; NULL when there is none.  Called with
 * s->lock held. */
static job *take_run(shared *s) {
    job *prev;
    job *j = first_free(s, &prev);
    if (!j)
        return NULL;
    job *run = NULL, **tail = &run;
    long long lane = j->lane;
    /* from j on: unlink j, and (on a lane) every later job of its lane */
    for (job *k = j; k;) {
        job *next = k->next;
        if (k == j || (lane && k->lane == lane)) {
            if (prev)
                prev->next = next;
            else
                s->todo = next;
            if (s->todo_tail == k)
                s->todo_tail = prev;
            s->queued--;
            k->next = NULL;
            *tail = k;
            tail = &k->next;
        } else {
            prev = k;
        }
        k = next;
    }
    return run;
}

static int lane_failed(shared *s, long long lane) {
    for (int i = 0; lane && i < s->nfailed; i++)
        if (s->failed[i] == lane)
            return 1;
    return 0;
}

/* With s->lock held, after a run: the held answers of its jobs, in order,
 * linked into one list with the verdict (durable: the run succeeded and
 * no run of its lane failed before), taken off the jobs, which the
 * reactor frees once it reads them. */
static held *take_answers(shared *s, job *run) {
    if (run->error && run->lane && !lane_failed(s, run->lane)) {
        long long *grown = realloc(s->failed, (size_t)(s->nfailed + 1) * sizeof *grown);
        if (grown) {
            s->failed = grown;
            s->failed[s->nfailed++] = run->lane;
        }
        else
            s->no_answers = 1;      /* not remembered: none are sent from here */
    }
    int durable = !run->error && !s->no_answers && !lane_failed(s, run->lane);
    held *first = NULL, *tail = NULL;
    for (job *j = run; j; j = j->next) {
        j->answered = durable && j->nheld > 0;
        for (int i = 0; i < j->nheld; i++) {
            held *h = j->helds[i];
            held_set_durable(h, durable);
            held_link(h, NULL);
            if (tail)
                held_link(tail, h);
            else
                first = h;
            tail = h;
        }
        j->nheld = 0;
    }
    return first;
}

static void *worker(void *arg) {
    shared *s = (shared *)arg;
    pthread_mutex_lock(&s->lock);
    int slot = 0;
    while (s->busy[slot] != -1)    /* this thread's place among the lanes */
        slot++;
    s->busy[slot] = 0;
    for (;;) {
        job *run;
        while (!(run = take_run(s)) && !(s->closing && !s->todo)) {
            s->idle++;
            pthread_cond_wait(&s->wake, &s->lock);
            s->idle--;
        }
        if (!run)
            break;              /* closing, and nothing left to sync */
        s->busy[slot] = run->lane;
        /* more than this run may be waiting for a thread */
        if (s->idle && first_free(s, NULL))
            pthread_cond_signal(&s->wake);
        pthread_mutex_unlock(&s->lock);
        run_jobs(run);
        pthread_mutex_lock(&s->lock);
        s->busy[slot] = 0;
        held *answers = take_answers(s, run);
        job *last = run;
        while (last->next)
            last = last->next;
        if (s->done_tail)
            s->done_tail->next = run;
        else
            s->done = run;
        s->done_tail = last;
        pthread_mutex_unlock(&s->lock);
        /* the answers first: the reactor's wake-up (the eventfd) cost them
         * about 70 us when it went before them (doc/performance.rst, run
         * P).  The jobs are on the done list already, so a reactor that
         * serves a read before it learns of them from the eventfd finds
         * them there (Syncer.peek: the log's end is never behind an answer
         * a client has) */
        if (answers)
            held_finish_listed(answers);
        /* the counter cannot overflow at one a run; a failed write leaves
         * nothing to do but what the next run's write does */
        uint64_t one = 1;
        ssize_t ignored = write(s->efd, &one, sizeof one);
        (void)ignored;
        pthread_mutex_lock(&s->lock);
        /* what the lane queued meanwhile is this thread's next take */
    }
    /* threads waiting for a lane this one ran may be the last to exit */
    pthread_cond_broadcast(&s->wake);
    s->busy[slot] = -1;
    s->threads--;
    release(s);
    return NULL;
}

static int Syncer_init(SyncerObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_threads", NULL};
    int max_threads = 8;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i:Syncer", kwlist, &max_threads))
        return -1;
    if (max_threads < 1) {
        PyErr_SetString(PyExc_ValueError, "max_threads must be at least 1");
        return -1;
    }
    if (self->s) {
        PyErr_SetString(PyExc_RuntimeError, "Syncer already initialised");
        return -1;
    }
    shared *s = calloc(1, sizeof *s);
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
    s->busy = malloc(max_threads * sizeof *s->busy);
    if (!s->busy) {
        close(s->efd);
        free(s);
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < max_threads; i++)
        s->busy[i] = -1;        /* no thread in the slot */
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    s->max_threads = max_threads;
    s->refs = 1;
    self->s = s;
    self->forks = sp_forks();
    return 0;
}

static int check(SyncerObject *self) {
    if (!self->s) {
        PyErr_SetString(PyExc_RuntimeError, "Syncer not initialised");
        return -1;
    }
    if (self->forks != sp_forks()) {
        /* a fork keeps the memory, not the threads */
        PyErr_SetString(PyExc_RuntimeError, "Syncer used in a forked process");
        return -1;
    }
    return 0;
}

/* The job's held answers, from a sequence of Held objects; -1 with an
 * exception set (those claimed so far are dropped with the job). */
static int claim_answers(job *j, PyObject *answers_obj) {
    PyObject *seq = PySequence_Fast(answers_obj, "answers must be a sequence of Held");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > INT_MAX) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    j->helds = malloc((n ? n : 1) * sizeof *j->helds);
    if (!j->helds) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        held *h = held_claim(PySequence_Fast_GET_ITEM(seq, i));
        if (!h) {
            Py_DECREF(seq);
            return -1;
        }
        j->helds[j->nheld++] = h;
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *Syncer_submit(SyncerObject *self, PyObject *args) {
    PyObject *fds_obj, *dir_obj, *answers_obj = NULL;
    long long lane = 0;
    if (!PyArg_ParseTuple(args, "OO|LO:submit", &fds_obj, &dir_obj, &lane, &answers_obj))
        return NULL;
    if (lane < 0) {
        PyErr_SetString(PyExc_ValueError, "lane must be 0 (none) or positive");
        return NULL;
    }
    if (check(self) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(fds_obj, "fds must be a sequence of file descriptors");
    if (!seq)
        return NULL;
    job *j = calloc(1, sizeof *j);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (!j || n > INT_MAX) {
        free(j);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    j->nfds = (int)n;
    j->fds = malloc((n ? n : 1) * sizeof(int));
    if (!j->fds) {
        free(j);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (fd == -1 && PyErr_Occurred()) {
            free_job(j);
            Py_DECREF(seq);
            return NULL;
        }
        if (fd < 0 || fd > INT_MAX) {
            free_job(j);
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "not a file descriptor");
            return NULL;
        }
        j->fds[i] = (int)fd;
    }
    Py_DECREF(seq);
    if (dir_obj != Py_None) {
        PyObject *path = NULL;
        if (!PyUnicode_FSConverter(dir_obj, &path)) {
            free_job(j);
            return NULL;
        }
        j->dir = strdup(PyBytes_AS_STRING(path));
        Py_DECREF(path);
        if (!j->dir) {
            free_job(j);
            return PyErr_NoMemory();
        }
    }
    if (answers_obj && answers_obj != Py_None && claim_answers(j, answers_obj) < 0) {
        free_job(j);
        return NULL;
    }
    j->id = ++self->next_id;
    j->lane = lane;
    shared *s = self->s;
    int err = 0;
    pthread_mutex_lock(&s->lock);
    /* a job behind its lane's running or queued one needs no thread of
     * its own: it runs with that lane's next run */
    int waits = 0;
    if (lane) {
        waits = lane_busy(s, lane);
        for (job *k = s->todo; k && !waits; k = k->next)
            waits = k->lane == lane;
    }
    if (!waits && s->queued + 1 > s->idle && s->threads < s->max_threads) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* fsync needs little stack: a small one for each of the threads */
        pthread_attr_setstacksize(&attr, 256 * 1024);
        err = pthread_create(&t, &attr, worker, s);
        pthread_attr_destroy(&attr);
        if (!err) {
            s->threads++;
            s->refs++;
        }
    }
    if (err && s->threads == 0) {
        pthread_mutex_unlock(&s->lock);
        free_job(j);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (s->todo_tail)
        s->todo_tail->next = j;
    else
        s->todo = j;
    s->todo_tail = j;
    s->queued++;
    pthread_mutex_unlock(&s->lock);
    /* after the unlock: a thread woken under it would at once wait for
     * the lock, a second wake-up in every acknowledgement's latency */
    if (!waits)
        pthread_cond_signal(&s->wake);
    return PyLong_FromLongLong(j->id);
}

static PyObject *Syncer_completed(SyncerObject *self, PyObject *unused) {
    if (check(self) < 0)
        return NULL;
    shared *s = self->s;
    uint64_t count;
    ssize_t ignored = read(s->efd, &count, sizeof count);   /* EAGAIN: none yet */
    (void)ignored;
    pthread_mutex_lock(&s->lock);
    job *first = s->done;
    s->done = s->done_tail = NULL;
    pthread_mutex_unlock(&s->lock);
    PyObject *out = PyList_New(0);
    for (job *j = first; out && j; j = j->next) {
        PyObject *item = Py_BuildValue("(Lid)", j->id, j->error, j->seconds);
        if (!item || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    if (!out) {
        /* no memory for the list: the jobs stay done, ahead of any done
         * since, and the eventfd is readable again so that the next call
         * reports them (freed here, their acknowledgements would never
         * come) */
        if (first) {
            job *last = first;
            while (last->next)
                last = last->next;
            pthread_mutex_lock(&s->lock);
            last->next = s->done;
            if (!s->done)
                s->done_tail = last;
            s->done = first;
            uint64_t one = 1;
            ignored = write(s->efd, &one, sizeof one);
            pthread_mutex_unlock(&s->lock);
        }
        return NULL;
    }
    for (job *j = first; j;) {
        job *next = j->next;
        free_job(j);
        j = next;
    }
    return out;
}

static PyObject *Syncer_peek(SyncerObject *self, PyObject *unused) {
    if (check(self) < 0)
        return NULL;
    shared *s = self->s;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    /* building the list under the lock: the threads never need the GIL */
    pthread_mutex_lock(&s->lock);
    for (job *j = s->done; out && j; j = j->next) {
        PyObject *item = Py_BuildValue("(LO)", j->id, j->answered ? Py_True : Py_False);
        if (!item || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    pthread_mutex_unlock(&s->lock);
    return out;
}

static PyObject *Syncer_forked(SyncerObject *self, PyObject *unused) {
    return PyBool_FromLong(self->forks != sp_forks());
}

static PyObject *Syncer_fileno(SyncerObject *self, PyObject *unused) {
    if (!self->s) {
        PyErr_SetString(PyExc_RuntimeError, "Syncer not initialised");
        return NULL;
    }
    return PyLong_FromLong(self->s->efd);
}

static void stop(SyncerObject *self) {
    shared *s = self->s;
    if (!s)
        return;
    self->s = NULL;
    pthread_mutex_lock(&s->lock);
    s->closing = 1;       /* the threads finish what is queued, then exit */
    pthread_cond_broadcast(&s->wake);
    release(s);
}

static PyObject *Syncer_close(SyncerObject *self, PyObject *unused) {
    if (self->s && self->forks != sp_forks()) {
        self->s = NULL;   /* a fork's copy: its threads and lock are the parent's */
        Py_RETURN_NONE;
    }
    stop(self);
    Py_RETURN_NONE;
}

static void Syncer_dealloc(SyncerObject *self) {
    if (self->s && self->forks == sp_forks())
        stop(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Syncer_methods[] = {
    {"submit", (PyCFunction)Syncer_submit, METH_VARARGS,
     "submit(fds, directory, lane=0, answers=()) -> job id: fsync the fds, then the directory\n"
     "(or None); a lane's jobs run in order, those queued behind a running one as one run.\n"
     "answers: SendSocket.hold()'s Held answers, sent from the thread once the job is\n"
     "durable (and no earlier run of its lane failed), cancelled otherwise"},
    {"completed", (PyCFunction)Syncer_completed, METH_NOARGS,
     "completed() -> [(job id, errno or 0, seconds)], clearing fileno()'s readiness"},
    {"peek", (PyCFunction)Syncer_peek, METH_NOARGS,
     "peek() -> [(job id, answered)]: the jobs done and not yet taken by completed(),\n"
     "in order, left in place; answered: its held answers were sent"},
    {"forked", (PyCFunction)Syncer_forked, METH_NOARGS,
     "forked() -> whether this process forked since the Syncer was made (its threads\n"
     "stayed in the parent: it refuses to be used here)"},
    {"fileno", (PyCFunction)Syncer_fileno, METH_NOARGS,
     "fileno() -> the eventfd that is readable when a job completed"},
    {"close", (PyCFunction)Syncer_close, METH_NOARGS,
     "close(): the threads finish what was submitted, then exit"},
    {NULL, NULL, 0, NULL}
};

static PyTypeObject SyncerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "streamproto._speedups.Syncer",
    .tp_doc = "fsync jobs on native threads, completions on an eventfd",
    .tp_basicsize = sizeof(SyncerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Syncer_init,
    .tp_dealloc = (destructor)Syncer_dealloc,
    .tp_methods = Syncer_methods,
};

int add_syncer(PyObject *module) {
    if (PyType_Ready(&SyncerType) < 0)
        return -1;
    Py_INCREF(&SyncerType);
    if (PyModule_AddObject(module, "Syncer", (PyObject *)&SyncerType) < 0) {
        Py_DECREF(&SyncerType);
        return -1;
    }
    return 0;
}

#else

int add_syncer(PyObject *module) {
    (void)module;
    return 0;
}

#endif
