/* The SendThread type of streamproto._speedups (_sender.c). */
#ifndef STREAMPROTO_SENDER_H
#define STREAMPROTO_SENDER_H
#include <Python.h>

/* Adds the SendThread type to the module (nothing on systems without eventfd). */
int add_sender(PyObject *module);

#if defined(__linux__)
/* An answer held for an fsync (SendSocket.hold); the syncer (_syncer.c)
 * finishes it from its thread.  Opaque outside _sender.c. */
typedef struct held held;

/* With the GIL: the held answer of a Held object, given to a syncer's job
 * (once: a second claim, or a finished one, is a ValueError), with a
 * reference for the job; NULL with an exception set otherwise. */
held *held_claim(PyObject *obj);
/* Without the GIL, any thread: the job's verdict, then its list. */
void held_set_durable(held *h, int durable);
void held_link(held *h, held *next);
/* Without the GIL, no lock held: finish each held answer of the list
 * (sent if durable, else cancelled), in order, dropping the job's
 * references. */
void held_finish_listed(held *first);
/* The job's reference dropped without a verdict: cancelled if pending. */
void held_drop(held *h);
#endif

#endif
