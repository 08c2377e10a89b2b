/*
 * The floor under bench/latency.py's HTTP produce->ack figures: the least
 * a server can do for a one-record POST answered after an fsync.
 *
 * Why: the goal "p99 at 50% load within twice one fsync" was missed by
 * every server measured, ours and the Go reference alike.  This one shows
 * what the machine itself allows: one thread, epoll, no parsing beyond
 * finding each request's end, no JSON, no log format.  Each wake-up reads
 * every ready connection, appends the bodies of the complete requests to
 * one file (one write each), fsyncs it once (a group commit: what arrived
 * during the fsync goes in the next), and only then answers them, each
 * with the same fixed response.
 *
 * usage: floor PORT FILE
 *
 * Listens on 127.0.0.1:PORT until killed; answers any request that has a
 * Content-Length (the body is what it appends), keep-alive, pipelined.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_CONNS 1024
#define BUFFER (1 << 16)

static const char ANSWER[] =
    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 33\r\n\r\n"
    "{\n  \"position\": 0,\n  \"count\": 1\n}";

struct conn {
    int fd;
    char in[BUFFER];
    size_t in_len;
    int answers;            /* requests appended, to answer after the fsync */
};

static struct conn *conns[MAX_CONNS];

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* Append the bodies of the complete requests in c->in; count them. */
static void take_requests(struct conn *c, int log_fd) {
    size_t at = 0;
    for (;;) {
        char *start = c->in + at;
        size_t left = c->in_len - at;
        char *end = memmem(start, left, "\r\n\r\n", 4);
        if (!end)
            break;
        size_t head = (size_t)(end - start) + 4;
        size_t length = 0;
        for (char *p = start; p < end; p++) {
            if ((p == start || p[-1] == '\n') && strncasecmp(p, "content-length:", 15) == 0) {
                length = strtoul(p + 15, NULL, 10);
                break;
            }
        }
        if (left < head + length)
            break;
        if (write(log_fd, start + head, length) != (ssize_t)length)
            die("write");
        c->answers++;
        at += head + length;
    }
    memmove(c->in, c->in + at, c->in_len - at);
    c->in_len -= at;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: floor PORT FILE\n");
        return 2;
    }
    int log_fd = open(argv[2], O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0)
        die("open");
    int listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1]))};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(listener, 128) < 0)
        die("listen");
    int epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = listener};
    epoll_ctl(epfd, EPOLL_CTL_ADD, listener, &ev);
    struct epoll_event events[MAX_CONNS];
    for (;;) {
        int n = epoll_wait(epfd, events, MAX_CONNS, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        int pending = 0;
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd == listener) {
                int s;
                while ((s = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
                    if (s >= MAX_CONNS) {
                        close(s);
                        continue;
                    }
                    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conns[s] = calloc(1, sizeof(struct conn));
                    conns[s]->fd = s;
                    struct epoll_event cev = {.events = EPOLLIN, .data.fd = s};
                    epoll_ctl(epfd, EPOLL_CTL_ADD, s, &cev);
                }
                continue;
            }
            struct conn *c = conns[fd];
            ssize_t got = recv(fd, c->in + c->in_len, BUFFER - c->in_len, 0);
            if (got <= 0) {
                if (got < 0 && (errno == EAGAIN || errno == EINTR))
                    continue;
                epoll_ctl(epfd, EPOLL_CTL_DEL, fd, NULL);
                close(fd);
                free(c);
                conns[fd] = NULL;
                continue;
            }
            c->in_len += (size_t)got;
            take_requests(c, log_fd);
            pending += c->answers;
        }
        if (!pending)
            continue;
        if (fsync(log_fd) < 0)
            die("fsync");
        for (int fd = 0; fd < MAX_CONNS; fd++) {
            struct conn *c = conns[fd];
            for (; c && c->answers; c->answers--) {
                /* a loopback socket takes these few bytes at once */
                if (send(fd, ANSWER, sizeof ANSWER - 1, MSG_NOSIGNAL) < 0)
                    break;
            }
        }
    }
}
