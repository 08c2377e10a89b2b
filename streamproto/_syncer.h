/* The Syncer type of streamproto._speedups (_syncer.c). */
#ifndef STREAMPROTO_SYNCER_H
#define STREAMPROTO_SYNCER_H
#include <Python.h>

/* Adds the Syncer type to the module (nothing on systems without eventfd). */
int add_syncer(PyObject *module);

#endif
