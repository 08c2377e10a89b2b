/* The SendThread type of streamproto._speedups (_sender.c). */
#ifndef STREAMPROTO_SENDER_H
#define STREAMPROTO_SENDER_H
#include <Python.h>

/* Adds the SendThread type to the module (nothing on systems without eventfd). */
int add_sender(PyObject *module);

#endif
