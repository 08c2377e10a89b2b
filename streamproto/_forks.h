/* Fork detection for the native threads of streamproto._speedups
 * (_syncer.c, _sender.c): a fork keeps a Syncer's or SendThread's memory,
 * not its threads, so an object made before a fork must not be used after
 * it in the child.  Each object keeps the count of forks at its making
 * and compares it with sp_forks() at every call.  Asking getpid() there
 * instead was a system call at each submit and each completion: two on
 * every acknowledgement's path (doc/performance.rst, run O). */
#ifndef STREAMPROTO_FORKS_H
#define STREAMPROTO_FORKS_H

/* The forks this process's line made so far: bumped in each child by a
 * pthread_atfork handler that PyInit__speedups installs. */
unsigned long sp_forks(void);

#endif
