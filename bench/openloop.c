/*
 * An open-loop HTTP load generator for bench/latency.py (--client c).
 *
 * The Python client's own lateness (its timers, its garbage, the GIL) was
 * larger than the differences it measured: 2.4-3.6 ms send lag at p99
 * against servers whose p99 differed by 0.3 ms.  This one sends one-record
 * POST /logs/NAME/records requests on keep-alive connections at a fixed
 * rate, each at its planned time (request i at start + i / rate, round
 * robin over the connections, pipelined: a late answer never delays the
 * next send), and counts each answer's latency from that planned time (no
 * coordinated omission).  One thread, epoll, an absolute timerfd; no
 * allocation per request.
 *
 * usage: openloop PORT LOG RATE SECONDS CONNECTIONS SIZE OUT
 *
 * OUT receives one little-endian uint32 pair per request, in the order of
 * their answers: (latency from the planned time, send lag), microseconds.
 * Exit status 0 when every request was answered 2xx, 1 otherwise (what
 * went wrong on stderr).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define RECV_BUFFER (1 << 16)

struct conn {
    int fd;
    /* the planned times (ns) of the requests sent and not answered, a ring */
    uint64_t *planned;
    uint32_t *lag;
    size_t head, count, capacity;
    /* what the socket did not take yet */
    char *out;
    size_t out_len, out_capacity;
    char in[RECV_BUFFER];
    size_t in_len;
    int want_out;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

static int epfd;
static FILE *out_file;
static uint64_t answered, failed;

static void watch(struct conn *c, int index) {
    struct epoll_event ev = {.events = EPOLLIN | (c->want_out ? EPOLLOUT : 0),
                             .data.u32 = (uint32_t)index};
    if (epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev) < 0)
        die("epoll_ctl");
}

static void flush_out(struct conn *c, int index) {
    while (c->out_len) {
        ssize_t n = send(c->fd, c->out, c->out_len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            die("send");
        }
        memmove(c->out, c->out + n, c->out_len - (size_t)n);
        c->out_len -= (size_t)n;
    }
    int want = c->out_len != 0;
    if (want != c->want_out) {
        c->want_out = want;
        watch(c, index);
    }
}

static void queue_request(struct conn *c, int index, const char *request, size_t length,
                          uint64_t planned, uint32_t lag) {
    if (c->count == c->capacity) {
        size_t capacity = c->capacity * 2;
        uint64_t *p = malloc(capacity * sizeof *p);
        uint32_t *l = malloc(capacity * sizeof *l);
        if (!p || !l)
            die("malloc");
        for (size_t i = 0; i < c->count; i++) {
            p[i] = c->planned[(c->head + i) % c->capacity];
            l[i] = c->lag[(c->head + i) % c->capacity];
        }
        free(c->planned);
        free(c->lag);
        c->planned = p;
        c->lag = l;
        c->head = 0;
        c->capacity = capacity;
    }
    size_t slot = (c->head + c->count) % c->capacity;
    c->planned[slot] = planned;
    c->lag[slot] = lag;
    c->count++;
    if (c->out_len == 0) {
        /* the usual case: straight to the socket */
        ssize_t n = send(c->fd, request, length, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                die("send");
            n = 0;
        }
        request += n;
        length -= (size_t)n;
        if (!length)
            return;
    }
    if (c->out_len + length > c->out_capacity) {
        size_t capacity = (c->out_len + length) * 2;
        char *b = realloc(c->out, capacity);
        if (!b)
            die("realloc");
        c->out = b;
        c->out_capacity = capacity;
    }
    memcpy(c->out + c->out_len, request, length);
    c->out_len += length;
    flush_out(c, index);
}

/* the length of the first whole response in c->in (Content-Length only), 0 if none yet */
static size_t response_size(struct conn *c) {
    char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
    if (!end)
        return 0;
    size_t head = (size_t)(end - c->in) + 4;
    size_t body = 0;
    for (char *p = c->in; p < end; p++) {
        if ((p == c->in || p[-1] == '\n') && strncasecmp(p, "content-length:", 15) == 0) {
            body = strtoul(p + 15, NULL, 10);
            break;
        }
    }
    return c->in_len >= head + body ? head + body : 0;
}

static void read_answers(struct conn *c) {
    for (;;) {
        ssize_t n = recv(c->fd, c->in + c->in_len, sizeof c->in - c->in_len, 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            die("recv");
        }
        if (n == 0) {
            fprintf(stderr, "openloop: the server closed a connection\n");
            exit(1);
        }
        uint64_t now = now_ns();
        c->in_len += (size_t)n;
        size_t size;
        while ((size = response_size(c)) != 0) {
            if (!c->count) {
                fprintf(stderr, "openloop: an answer nobody asked for\n");
                exit(1);
            }
            int status = c->in_len > 12 ? atoi(c->in + 9) : 0;
            if (status < 200 || status > 299) {
                if (failed++ < 5)
                    fprintf(stderr, "openloop: HTTP %d\n", status);
            }
            uint64_t planned = c->planned[c->head];
            uint32_t pair[2] = {(uint32_t)((now - planned) / 1000), c->lag[c->head]};
            if (fwrite(pair, sizeof pair, 1, out_file) != 1)
                die("fwrite");
            c->head = (c->head + 1) % c->capacity;
            c->count--;
            answered++;
            memmove(c->in, c->in + size, c->in_len - size);
            c->in_len -= size;
        }
        if (c->in_len == sizeof c->in) {
            fprintf(stderr, "openloop: an answer larger than %d bytes\n", RECV_BUFFER);
            exit(1);
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: openloop PORT LOG RATE SECONDS CONNECTIONS SIZE OUT\n");
        return 2;
    }
    int port = atoi(argv[1]);
    const char *log_name = argv[2];
    double rate = atof(argv[3]), seconds = atof(argv[4]);
    int connections = atoi(argv[5]);
    size_t size = strtoul(argv[6], NULL, 10);
    if (port <= 0 || rate <= 0 || seconds <= 0 || connections <= 0) {
        fprintf(stderr, "openloop: PORT, RATE, SECONDS and CONNECTIONS must be positive\n");
        return 2;
    }
    out_file = fopen(argv[7], "wb");
    if (!out_file)
        die(argv[7]);

    char head[512];
    int head_len = snprintf(head, sizeof head,
                            "POST /logs/%s/records HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                            "Content-Type: application/octet-stream\r\n"
                            "Content-Length: %zu\r\n\r\n", log_name, port, size);
    if (head_len <= 0 || (size_t)head_len >= sizeof head) {
        fprintf(stderr, "openloop: log name too long\n");
        return 2;
    }
    size_t request_len = (size_t)head_len + size;
    char *request = malloc(request_len);
    if (!request)
        die("malloc");
    memcpy(request, head, (size_t)head_len);
    memset(request + head_len, 'x', size);

    epfd = epoll_create1(0);
    if (epfd < 0)
        die("epoll_create1");
    struct conn *conns = calloc((size_t)connections, sizeof *conns);
    if (!conns)
        die("calloc");
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < connections; i++) {
        struct conn *c = &conns[i];
        c->fd = socket(AF_INET, SOCK_STREAM, 0);
        if (c->fd < 0)
            die("socket");
        if (connect(c->fd, (struct sockaddr *)&address, sizeof address) < 0)
            die("connect");
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        /* non-blocking from here: sends are never waited for */
        if (fcntl(c->fd, F_SETFL, O_NONBLOCK) < 0)
            die("fcntl");
        c->capacity = 1024;
        c->planned = malloc(c->capacity * sizeof *c->planned);
        c->lag = malloc(c->capacity * sizeof *c->lag);
        if (!c->planned || !c->lag)
            die("malloc");
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(epfd, EPOLL_CTL_ADD, c->fd, &ev) < 0)
            die("epoll_ctl");
    }
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    if (tfd < 0)
        die("timerfd_create");
    struct epoll_event tev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, tfd, &tev) < 0)
        die("epoll_ctl");

    uint64_t total = (uint64_t)(rate * seconds);
    if (total == 0)
        total = 1;
    double interval = 1e9 / rate;
    uint64_t start = now_ns() + 50000000u;   /* 50 ms from now */
    uint64_t next = 0;                       /* the next request to send */
    uint64_t drain_deadline = 0;
    struct itimerspec at = {0};
    int armed = 0;
    while (answered < total) {
        if (next < total && !armed) {
            uint64_t planned = start + (uint64_t)(next * interval);
            at.it_value.tv_sec = (time_t)(planned / 1000000000u);
            at.it_value.tv_nsec = (long)(planned % 1000000000u);
            if (timerfd_settime(tfd, TFD_TIMER_ABSTIME, &at, NULL) < 0)
                die("timerfd_settime");
            armed = 1;
        }
        if (next == total && !drain_deadline)
            drain_deadline = now_ns() + 30000000000u;   /* 30 s for the last answers */
        if (drain_deadline && now_ns() > drain_deadline) {
            fprintf(stderr, "openloop: %llu of %llu requests unanswered after 30 s\n",
                    (unsigned long long)(total - answered), (unsigned long long)total);
            return 1;
        }
        struct epoll_event events[64];
        int n = epoll_wait(epfd, events, 64, 1000);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        for (int e = 0; e < n; e++) {
            uint32_t index = events[e].data.u32;
            if (index == UINT32_MAX) {
                uint64_t expirations;
                if (read(tfd, &expirations, sizeof expirations) < 0 && errno != EAGAIN)
                    die("read timerfd");
                armed = 0;
                uint64_t now = now_ns();
                /* every request due by now, each stamped with its own planned time */
                while (next < total) {
                    uint64_t planned = start + (uint64_t)(next * interval);
                    if (planned > now)
                        break;
                    int i = (int)(next % (uint64_t)connections);
                    queue_request(&conns[i], i, request, request_len, planned,
                                  (uint32_t)((now - planned) / 1000));
                    next++;
                }
                continue;
            }
            struct conn *c = &conns[index];
            if (events[e].events & EPOLLOUT)
                flush_out(c, (int)index);
            if (events[e].events & (EPOLLIN | EPOLLHUP | EPOLLERR))
                read_answers(c);
        }
    }
    if (fclose(out_file) != 0)
        die("fclose");
    if (failed) {
        fprintf(stderr, "openloop: %llu of %llu answers were not 2xx\n",
                (unsigned long long)failed, (unsigned long long)total);
        return 1;
    }
    return 0;
}
