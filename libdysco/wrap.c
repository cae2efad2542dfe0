/*
 * wrap.c: the wrappers of the C library's socket, I/O and splice functions.
 *
 * Every wrapper calls the real function first (found with dlsym(RTLD_NEXT))
 * and then records the result, keeping errno as the real function left it.
 * With DYSCO_DISABLE=1 the wrappers only call the real functions.
 */
#undef _FORTIFY_SOURCE /* we define read, recv, ... ourselves */
#define _GNU_SOURCE
#include "internal.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <netinet/in.h>

struct real_fns dysco_real;
int dysco_disabled;
int dysco_debug;
int dysco_trigger = TRIGGER_AUTO;
char dysco_agent_socket[108] = "@dysco-agent";
int dysco_inited;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void atfork_prepare(void)
{
	agent_atfork_prepare();
	track_atfork_prepare();
}

static void atfork_parent(void)
{
	track_atfork_parent();
	agent_atfork_parent();
}

static void atfork_child(void)
{
	track_atfork_child();
	agent_atfork_child();
}

#define RESOLVE(field, name) (*(void **)&dysco_real.field = dlsym(RTLD_NEXT, name))

static void do_init(void)
{
	RESOLVE(socket, "socket");
	RESOLVE(accept, "accept");
	RESOLVE(accept4, "accept4");
	RESOLVE(connect, "connect");
	RESOLVE(read, "read");
	RESOLVE(readv, "readv");
	RESOLVE(recv, "recv");
	RESOLVE(recvfrom, "recvfrom");
	RESOLVE(recvmsg, "recvmsg");
	RESOLVE(write, "write");
	RESOLVE(writev, "writev");
	RESOLVE(send, "send");
	RESOLVE(sendto, "sendto");
	RESOLVE(sendmsg, "sendmsg");
	RESOLVE(splice, "splice");
	RESOLVE(close, "close");
	RESOLVE(dup, "dup");
	RESOLVE(dup2, "dup2");
	RESOLVE(dup3, "dup3");
	RESOLVE(pipe, "pipe");
	RESOLVE(pipe2, "pipe2");
	RESOLVE(read_chk, "__read_chk");
	RESOLVE(recv_chk, "__recv_chk");
	RESOLVE(recvfrom_chk, "__recvfrom_chk");

	const char *v = getenv("DYSCO_DISABLE");
	dysco_disabled = v && *v && strcmp(v, "0") != 0;
	v = getenv("DYSCO_DEBUG");
	if (v && *v)
		dysco_debug = atoi(v) > 0 ? atoi(v) : (strcmp(v, "0") != 0);
	v = getenv("DYSCO_SPLICE_TRIGGER");
	if (v && *v) {
		if (strcmp(v, "first") == 0)
			dysco_trigger = TRIGGER_FIRST;
		else if (strcmp(v, "both") == 0)
			dysco_trigger = TRIGGER_BOTH;
		else if (strcmp(v, "auto") != 0)
			dysco_log("DYSCO_SPLICE_TRIGGER=%s: expected \"auto\", \"both\" or \"first\"; using \"auto\"", v);
	}
	v = getenv("DYSCO_AGENT_SOCKET");
	if (v && *v) {
		if (strlen(v) >= sizeof(dysco_agent_socket))
			dysco_log("DYSCO_AGENT_SOCKET is longer than %zu bytes; using %s",
				  sizeof(dysco_agent_socket) - 1, dysco_agent_socket);
		else
			strcpy(dysco_agent_socket, v);
	}
	pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
	__atomic_store_n(&dysco_inited, 1, __ATOMIC_RELEASE);
	if (dysco_debug)
		dysco_log("loaded: agent %s%s, trigger %s", dysco_agent_socket,
			  dysco_disabled ? ", disabled (pass-through)" : "",
			  dysco_trigger == TRIGGER_BOTH ? "both" : dysco_trigger == TRIGGER_FIRST ? "first" : "auto");
}

void dysco_init(void)
{
	pthread_once(&init_once, do_init);
}

__attribute__((constructor)) static void dysco_ctor(void)
{
	dysco_init();
}

void dysco_log(const char *fmt, ...)
{
	int saved = errno;
	char buf[1024];
	int n = snprintf(buf, sizeof(buf), "libdysco[%d]: ", (int)getpid());
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	if (m < 0)
		m = 0;
	n += m;
	if (n > (int)sizeof(buf) - 2)
		n = (int)sizeof(buf) - 2;
	buf[n++] = '\n';
	ssize_t r = dysco_real.write ? dysco_real.write(2, buf, (size_t)n)
				     : syscall(SYS_write, 2, buf, (size_t)n);
	(void)r;
	errno = saved;
}

/*
 * CALL_REAL calls the real function, failing with ENOSYS if it could not be
 * found, and leaves its result in r. AFTER runs the tracking code with errno
 * saved (errno is as the real function left it when cond is tested),
 * unless disabled.
 */
#define CALL_REAL(fn, ...)                                                     \
	dysco_ensure_init();                                                   \
	if (!dysco_real.fn) {                                                  \
		errno = ENOSYS;                                                \
		return -1;                                                     \
	}                                                                      \
	r = dysco_real.fn(__VA_ARGS__)

#define AFTER(cond, code)                                                      \
	do {                                                                   \
		if (!dysco_disabled) {                                         \
			int saved_errno_ = errno;                              \
			if (cond) {                                            \
				code;                                          \
			}                                                      \
			errno = saved_errno_;                                  \
		}                                                              \
	} while (0)

/*
 * REFUSE_WRITE fails a write function with EPIPE, before calling it, when
 * the bytes would change a stream whose removal was asked for by more than
 * the delta sent with the request (track_write_refused): they would reach
 * the other end on the old path, and the ends, joined with the delta, would
 * then disagree on the stream.
 */
#define REFUSE_WRITE(fd, n)                                                    \
	do {                                                                   \
		dysco_ensure_init();                                           \
		if (!dysco_disabled && track_write_refused((fd), (n))) {       \
			errno = EPIPE;                                         \
			return -1;                                             \
		}                                                              \
	} while (0)

static size_t iov_len(const struct iovec *iov, int iovcnt)
{
	size_t n = 0;
	for (int i = 0; iov && i < iovcnt; i++)
		n += iov[i].iov_len;
	return n;
}

static int socket_kind(int domain, int type, int protocol)
{
	if ((domain == AF_INET || domain == AF_INET6) && (type & 0xf) == SOCK_STREAM &&
	    (protocol == 0 || protocol == IPPROTO_TCP))
		return KIND_TCP;
	return KIND_OTHER;
}

/* Receives that leave the data in the socket or are not stream data. */
static int not_consumed(int flags)
{
	return flags & (MSG_PEEK | MSG_ERRQUEUE);
}

DYSCO_EXPORT int socket(int domain, int type, int protocol)
{
	int r;
	CALL_REAL(socket, domain, type, protocol);
	AFTER(r >= 0, track_new_fd(r, socket_kind(domain, type, protocol), "socket"));
	return r;
}

DYSCO_EXPORT int accept(int fd, __SOCKADDR_ARG addr, socklen_t *len)
{
	int r;
	CALL_REAL(accept, fd, addr, len);
	AFTER(r >= 0, track_new_fd(r, track_kind(fd) == KIND_TCP ? KIND_TCP : KIND_UNKNOWN, "accept"));
	return r;
}

DYSCO_EXPORT int accept4(int fd, __SOCKADDR_ARG addr, socklen_t *len, int flags)
{
	int r;
	CALL_REAL(accept4, fd, addr, len, flags);
	AFTER(r >= 0, track_new_fd(r, track_kind(fd) == KIND_TCP ? KIND_TCP : KIND_UNKNOWN, "accept4"));
	return r;
}

DYSCO_EXPORT int connect(int fd, __CONST_SOCKADDR_ARG addr, socklen_t len)
{
	int r;
	CALL_REAL(connect, fd, addr, len);
	AFTER(dysco_debug && (r == 0 || errno == EINPROGRESS) && track_kind(fd) == KIND_TCP,
	      dysco_log("fd %d: connect%s", fd, r == 0 ? "ed" : " in progress"));
	return r;
}

DYSCO_EXPORT ssize_t read(int fd, void *buf, size_t n)
{
	ssize_t r;
	CALL_REAL(read, fd, buf, n);
	AFTER(r > 0, track_read(fd, r, "read"));
	return r;
}

DYSCO_EXPORT ssize_t __read_chk(int fd, void *buf, size_t n, size_t buflen)
{
	ssize_t r;
	CALL_REAL(read_chk, fd, buf, n, buflen);
	AFTER(r > 0, track_read(fd, r, "read"));
	return r;
}

DYSCO_EXPORT ssize_t readv(int fd, const struct iovec *iov, int iovcnt)
{
	ssize_t r;
	CALL_REAL(readv, fd, iov, iovcnt);
	AFTER(r > 0, track_read(fd, r, "readv"));
	return r;
}

DYSCO_EXPORT ssize_t recv(int fd, void *buf, size_t n, int flags)
{
	ssize_t r;
	CALL_REAL(recv, fd, buf, n, flags);
	AFTER(r > 0 && !not_consumed(flags), track_read(fd, r, "recv"));
	return r;
}

DYSCO_EXPORT ssize_t __recv_chk(int fd, void *buf, size_t n, size_t buflen, int flags)
{
	ssize_t r;
	CALL_REAL(recv_chk, fd, buf, n, buflen, flags);
	AFTER(r > 0 && !not_consumed(flags), track_read(fd, r, "recv"));
	return r;
}

DYSCO_EXPORT ssize_t recvfrom(int fd, void *buf, size_t n, int flags, __SOCKADDR_ARG addr,
			      socklen_t *len)
{
	ssize_t r;
	CALL_REAL(recvfrom, fd, buf, n, flags, addr, len);
	AFTER(r > 0 && !not_consumed(flags), track_read(fd, r, "recvfrom"));
	return r;
}

DYSCO_EXPORT ssize_t __recvfrom_chk(int fd, void *buf, size_t n, size_t buflen, int flags,
				    __SOCKADDR_ARG addr, socklen_t *len)
{
	ssize_t r;
	CALL_REAL(recvfrom_chk, fd, buf, n, buflen, flags, addr, len);
	AFTER(r > 0 && !not_consumed(flags), track_read(fd, r, "recvfrom"));
	return r;
}

DYSCO_EXPORT ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
	ssize_t r;
	CALL_REAL(recvmsg, fd, msg, flags);
	AFTER(r > 0 && !not_consumed(flags), track_read(fd, r, "recvmsg"));
	return r;
}

DYSCO_EXPORT ssize_t write(int fd, const void *buf, size_t n)
{
	ssize_t r;
	REFUSE_WRITE(fd, n);
	CALL_REAL(write, fd, buf, n);
	AFTER(r > 0, track_write(fd, r, "write"));
	return r;
}

DYSCO_EXPORT ssize_t writev(int fd, const struct iovec *iov, int iovcnt)
{
	ssize_t r;
	REFUSE_WRITE(fd, iov_len(iov, iovcnt));
	CALL_REAL(writev, fd, iov, iovcnt);
	AFTER(r > 0, track_write(fd, r, "writev"));
	return r;
}

DYSCO_EXPORT ssize_t send(int fd, const void *buf, size_t n, int flags)
{
	ssize_t r;
	REFUSE_WRITE(fd, n);
	CALL_REAL(send, fd, buf, n, flags);
	AFTER(r > 0, track_write(fd, r, "send"));
	return r;
}

DYSCO_EXPORT ssize_t sendto(int fd, const void *buf, size_t n, int flags,
			    __CONST_SOCKADDR_ARG addr, socklen_t len)
{
	ssize_t r;
	REFUSE_WRITE(fd, n);
	CALL_REAL(sendto, fd, buf, n, flags, addr, len);
	AFTER(r > 0, track_write(fd, r, "sendto"));
	return r;
}

DYSCO_EXPORT ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	ssize_t r;
	REFUSE_WRITE(fd, msg ? iov_len(msg->msg_iov, (int)msg->msg_iovlen) : 0);
	CALL_REAL(sendmsg, fd, msg, flags);
	AFTER(r > 0, track_write(fd, r, "sendmsg"));
	return r;
}

DYSCO_EXPORT ssize_t splice(int fd_in, loff_t *off_in, int fd_out, loff_t *off_out, size_t len,
			    unsigned int flags)
{
	ssize_t r;
	CALL_REAL(splice, fd_in, off_in, fd_out, off_out, len, flags);
	AFTER(r > 0, track_splice(fd_in, fd_out, r));
	return r;
}

DYSCO_EXPORT int close(int fd)
{
	dysco_ensure_init();
	if (!dysco_real.close) {
		errno = ENOSYS;
		return -1;
	}
	/* Forget the descriptor first: once closed, its number can be reused
	 * by another thread at once. */
	if (!dysco_disabled)
		track_close(fd);
	return dysco_real.close(fd);
}

DYSCO_EXPORT int dup(int fd)
{
	int r;
	CALL_REAL(dup, fd);
	AFTER(r >= 0, track_dup(fd, r));
	return r;
}

DYSCO_EXPORT int dup2(int fd, int fd2)
{
	int r;
	CALL_REAL(dup2, fd, fd2);
	AFTER(r >= 0 && fd != fd2, track_dup(fd, r));
	return r;
}

DYSCO_EXPORT int dup3(int fd, int fd2, int flags)
{
	int r;
	CALL_REAL(dup3, fd, fd2, flags);
	AFTER(r >= 0, track_dup(fd, r));
	return r;
}

DYSCO_EXPORT int pipe(int fds[2])
{
	int r;
	CALL_REAL(pipe, fds);
	AFTER(r == 0, (track_new_fd(fds[0], KIND_UNKNOWN, NULL), track_new_fd(fds[1], KIND_UNKNOWN, NULL)));
	return r;
}

DYSCO_EXPORT int pipe2(int fds[2], int flags)
{
	int r;
	CALL_REAL(pipe2, fds, flags);
	AFTER(r == 0, (track_new_fd(fds[0], KIND_UNKNOWN, NULL), track_new_fd(fds[1], KIND_UNKNOWN, NULL)));
	return r;
}
