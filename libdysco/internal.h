/*
 * libdysco internals: shared by wrap.c (the wrappers), track.c (per-fd
 * accounting and splice directions) and agent.c (requests to the agent).
 * See include/dysco.h for what the library does and docs/libdysco.md.
 */
#ifndef LIBDYSCO_INTERNAL_H
#define LIBDYSCO_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <stdint.h>
#include <stdarg.h>
#include <sys/types.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* Everything but the wrappers and dysco_splice stays inside the library. */
#pragma GCC visibility push(hidden)

#define DYSCO_EXPORT __attribute__((visibility("default")))

/* Tracked descriptors: 0 .. DYSCO_MAX_FD-1. */
#define DYSCO_MAX_FD 65536

/* The C library's functions, resolved with dlsym(RTLD_NEXT). */
struct real_fns {
	int (*socket)(int, int, int);
	int (*accept)(int, __SOCKADDR_ARG, socklen_t *);
	int (*accept4)(int, __SOCKADDR_ARG, socklen_t *, int);
	int (*connect)(int, __CONST_SOCKADDR_ARG, socklen_t);
	ssize_t (*read)(int, void *, size_t);
	ssize_t (*readv)(int, const struct iovec *, int);
	ssize_t (*recv)(int, void *, size_t, int);
	ssize_t (*recvfrom)(int, void *, size_t, int, __SOCKADDR_ARG, socklen_t *);
	ssize_t (*recvmsg)(int, struct msghdr *, int);
	ssize_t (*write)(int, const void *, size_t);
	ssize_t (*writev)(int, const struct iovec *, int);
	ssize_t (*send)(int, const void *, size_t, int);
	ssize_t (*sendto)(int, const void *, size_t, int, __CONST_SOCKADDR_ARG, socklen_t);
	ssize_t (*sendmsg)(int, const struct msghdr *, int);
	ssize_t (*splice)(int, loff_t *, int, loff_t *, size_t, unsigned int);
	int (*close)(int);
	int (*dup)(int);
	int (*dup2)(int, int);
	int (*dup3)(int, int, int);
	int (*pipe)(int[2]);
	int (*pipe2)(int[2], int);
	ssize_t (*read_chk)(int, void *, size_t, size_t);
	ssize_t (*recv_chk)(int, void *, size_t, size_t, int);
	ssize_t (*recvfrom_chk)(int, void *, size_t, size_t, int, __SOCKADDR_ARG, socklen_t *);
};

extern struct real_fns dysco_real;

/* Configuration, from the environment (dysco_init). */
extern int dysco_disabled;     /* DYSCO_DISABLE=1 */
extern int dysco_debug;        /* DYSCO_DEBUG level */
/* DYSCO_SPLICE_TRIGGER: when an automatic request is sent (track.c). */
enum dysco_trigger_rule { TRIGGER_AUTO = 0, TRIGGER_BOTH, TRIGGER_FIRST };
extern int dysco_trigger;
extern char dysco_agent_socket[108];

/* dysco_init resolves the real functions and reads the environment, once. */
void dysco_init(void);
extern int dysco_inited;
static inline void dysco_ensure_init(void)
{
	if (!__atomic_load_n(&dysco_inited, __ATOMIC_ACQUIRE))
		dysco_init();
}

/* Logging to stderr, "libdysco[pid]: ..." in one write; errno is kept. */
void dysco_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define DLOG(level, ...)                                                       \
	do {                                                                   \
		if (dysco_debug >= (level))                                    \
			dysco_log(__VA_ARGS__);                                \
	} while (0)

/* track.c: per-fd accounting. */
enum fd_kind { KIND_UNKNOWN = 0, KIND_TCP, KIND_PIPE, KIND_OTHER };
/* track_new_fd resets fd's entry for a new descriptor (socket, accept,
 * pipe); kind may be KIND_UNKNOWN: it is then found on first use. */
void track_new_fd(int fd, int kind, const char *how);
/* track_kind classifies fd (cached until close). */
int track_kind(int fd);
void track_dup(int oldfd, int newfd);             /* newfd becomes a copy of oldfd */
void track_close(int fd);                         /* fd is being closed */
void track_read(int fd, ssize_t n, const char *how);
void track_write(int fd, ssize_t n, const char *how);
/* track_write_refused tells whether writing n bytes to fd with a write
 * function must be refused: fd's pair had its automatic request, and the
 * bytes would change the stream by more than the delta sent (the write is
 * logged once per descriptor). */
int track_write_refused(int fd, size_t n);
void track_splice(int fd_in, int fd_out, ssize_t n);
/* track_explicit marks the pair for dysco_splice and returns the tracked
 * reverse delta (written(fd_in) - read(fd_out)). */
int64_t track_explicit(int fd_in, int fd_out);

/* agent.c: requests. */
struct dysco_tuple {
	char local[80];
	char remote[80];
};
struct dysco_request {
	struct dysco_tuple in, out;
	int64_t delta, delta_rev;
};
/* tuple_of fills t from a connected TCP socket; -1 with errno on failure
 * (EINVAL: not an IPv4/IPv6 TCP socket). */
int tuple_of(int fd, struct dysco_tuple *t);
/* agent_send_async queues a request for the background thread. */
void agent_send_async(const struct dysco_request *r);
/* agent_send_sync sends a request and reads the answer; 0 or -1 with errno. */
int agent_send_sync(const struct dysco_request *r);

/* answer.c: parse_answer reads the NUL-terminated beginning of the agent's
 * answer: ANSWER_OK (2xx), ANSWER_REFUSED (another status; text gets the
 * body's "error" string, printable ASCII, NUL-terminated within textlen) or
 * ANSWER_BAD (no HTTP/1.x status line). code gets the status. */
enum { ANSWER_OK = 0, ANSWER_REFUSED, ANSWER_BAD };
int parse_answer(const char *ans, int *code, char *text, size_t textlen);

/* Locks kept consistent across fork (pthread_atfork, set up by dysco_init). */
void track_atfork_prepare(void);
void track_atfork_parent(void);
void track_atfork_child(void);
void agent_atfork_prepare(void);
void agent_atfork_parent(void);
void agent_atfork_child(void);

#pragma GCC visibility pop

#endif
