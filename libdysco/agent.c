/*
 * agent.c: requests to the Dysco agent, and dysco_splice.
 *
 * A request is one HTTP/1.1 exchange over the agent's Unix socket:
 * POST /v1/sessions/splice with a JSON body, "Connection: close", and the
 * whole answer read before closing. Automatic requests (LD_PRELOAD mode)
 * go through a queue to one background thread, so the proxy's calls never
 * wait for the agent; dysco_splice sends its request in the caller's thread.
 *
 * The library talks to the agent with the real functions, never through
 * its own wrappers.
 */
#define _GNU_SOURCE
#include "dysco.h"
#include "internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <net/if.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* Bound on one exchange with the agent (connect, send, answer). */
#define AGENT_TIMEOUT_SEC 5
/* Bound on the queue of automatic requests. */
#define QUEUE_MAX 1024
/* At exit, wait this long at most for queued requests to be sent. */
#define DRAIN_MS 2000

/* ---- naming sockets ---- */

static void format_addr(const struct sockaddr_storage *ss, char *out, size_t outlen)
{
	char host[INET6_ADDRSTRLEN + IF_NAMESIZE + 2];
	if (ss->ss_family == AF_INET) {
		const struct sockaddr_in *s = (const struct sockaddr_in *)ss;
		inet_ntop(AF_INET, &s->sin_addr, host, sizeof(host));
		snprintf(out, outlen, "%s:%u", host, ntohs(s->sin_port));
		return;
	}
	const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)ss;
	if (IN6_IS_ADDR_V4MAPPED(&s->sin6_addr)) {
		inet_ntop(AF_INET, &s->sin6_addr.s6_addr[12], host, sizeof(host));
		snprintf(out, outlen, "%s:%u", host, ntohs(s->sin6_port));
		return;
	}
	inet_ntop(AF_INET6, &s->sin6_addr, host, sizeof(host));
	if (s->sin6_scope_id != 0) {
		/* Zone: the interface name if it is plain, else its index. */
		char ifname[IF_NAMESIZE];
		size_t l = strlen(host);
		int plain = if_indextoname(s->sin6_scope_id, ifname) != NULL;
		for (const char *c = ifname; plain && *c; c++)
			if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
			      *c == '-' || *c == '_' || *c == '.'))
				plain = 0;
		if (plain)
			snprintf(host + l, sizeof(host) - l, "%%%s", ifname);
		else
			snprintf(host + l, sizeof(host) - l, "%%%u", s->sin6_scope_id);
	}
	snprintf(out, outlen, "[%s]:%u", host, ntohs(s->sin6_port));
}

int tuple_of(int fd, struct dysco_tuple *t)
{
	int dom = 0, proto = 0;
	socklen_t l1 = sizeof(dom), l2 = sizeof(proto);
	if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &dom, &l1) < 0 ||
	    getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &l2) < 0) {
		if (errno == ENOTSOCK || errno == ENOPROTOOPT)
			errno = EINVAL;
		return -1;
	}
	if ((dom != AF_INET && dom != AF_INET6) || proto != IPPROTO_TCP) {
		errno = EINVAL;
		return -1;
	}
	struct sockaddr_storage a, b;
	socklen_t la = sizeof(a), lb = sizeof(b);
	memset(&a, 0, sizeof(a));
	memset(&b, 0, sizeof(b));
	if (getsockname(fd, (struct sockaddr *)&a, &la) < 0 || getpeername(fd, (struct sockaddr *)&b, &lb) < 0)
		return -1;
	format_addr(&a, t->local, sizeof(t->local));
	format_addr(&b, t->remote, sizeof(t->remote));
	return 0;
}

/* ---- failures ---- */

enum fail_kind { FAIL_CONNECT, FAIL_IO, FAIL_AGENT, FAIL_QUEUE, FAIL_THREAD, FAIL_KINDS };
static unsigned long fail_count[FAIL_KINDS];

/* fail_log logs the first failure of each kind, then the 2nd, 4th, 8th...
 * (every one with DYSCO_DEBUG), so that a missing agent does not flood
 * the proxy's stderr. */
__attribute__((format(printf, 2, 3))) static void fail_log(int kind, const char *fmt, ...)
{
	unsigned long n = __atomic_add_fetch(&fail_count[kind], 1, __ATOMIC_RELAXED);
	if ((n & (n - 1)) != 0 && !dysco_debug)
		return;
	char msg[768];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (n > 1)
		dysco_log("%s (%lu times so far)", msg, n);
	else
		dysco_log("%s", msg);
}

/* ---- one exchange ---- */

static int build_request(const struct dysco_request *r, char *buf, size_t len)
{
	char body[768];
	int bl = snprintf(body, sizeof(body),
			  "{\"in\":{\"local\":\"%s\",\"remote\":\"%s\"},"
			  "\"out\":{\"local\":\"%s\",\"remote\":\"%s\"},"
			  "\"delta\":%lld,\"delta_rev\":%lld,\"wait\":false}",
			  r->in.local, r->in.remote, r->out.local, r->out.remote, (long long)r->delta,
			  (long long)r->delta_rev);
	if (bl < 0 || (size_t)bl >= sizeof(body))
		return -1;
	int n = snprintf(buf, len,
			 "POST /v1/sessions/splice HTTP/1.1\r\n"
			 "Host: dysco-agent\r\n"
			 "User-Agent: libdysco\r\n"
			 "Content-Type: application/json\r\n"
			 "Content-Length: %d\r\n"
			 "Connection: close\r\n"
			 "\r\n"
			 "%s",
			 bl, body);
	if (n < 0 || (size_t)n >= len)
		return -1;
	return n;
}

/* agent_address fills sa from DYSCO_AGENT_SOCKET: "@name" is abstract. */
static socklen_t agent_address(struct sockaddr_un *sa)
{
	memset(sa, 0, sizeof(*sa));
	sa->sun_family = AF_UNIX;
	const char *s = dysco_agent_socket;
	size_t l = strlen(s);
	if (s[0] == '@') {
		/* sun_path[0] = '\0', then the name, no terminator. */
		memcpy(sa->sun_path + 1, s + 1, l - 1);
		return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + l);
	}
	memcpy(sa->sun_path, s, l);
	return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + l + 1);
}

/*
 * agent_peer_ok checks, with SO_PEERCRED, that the process serving the
 * connected socket fd runs as the agent's user: root, or the uid in
 * DYSCO_AGENT_UID. Any local user can bind the name of an abstract socket
 * before the agent does; nothing is sent to such an impostor.
 */
static int agent_peer_ok(int fd)
{
	const char *v = getenv("DYSCO_AGENT_UID");
	unsigned long want = 0;
	if (v && *v) {
		char *end;
		errno = 0;
		want = strtoul(v, &end, 10);
		if (errno || *end || want > 0xffffffffUL) {
			fail_log(FAIL_AGENT, "DYSCO_AGENT_UID=%s is not a user id; nothing sent to %s", v,
				 dysco_agent_socket);
			return 0;
		}
	}
	struct ucred cred;
	socklen_t len = sizeof(cred);
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
		fail_log(FAIL_AGENT, "cannot read the credentials of the process serving %s: %s; nothing sent to it",
			 dysco_agent_socket, strerror(errno));
		return 0;
	}
	if ((unsigned long)cred.uid != want) {
		fail_log(FAIL_AGENT,
			 "%s is served by pid %d of uid %u, not by the agent's uid %lu: another user bound the name "
			 "before the agent; nothing sent to it",
			 dysco_agent_socket, (int)cred.pid, (unsigned)cred.uid, want);
		return 0;
	}
	return 1;
}

/*
 * exchange sends one request and reads the answer. It returns 0, or an errno
 * value with the failure logged: ECONNREFUSED (no agent), ETIMEDOUT, EACCES
 * (the socket is served by another user than the agent's), EIO (error
 * answer, unreadable answer, connection lost) or another errno.
 */
static int exchange(const struct dysco_request *r)
{
	char req[1024];
	int reqlen = build_request(r, req, sizeof(req));
	if (reqlen < 0) {
		fail_log(FAIL_IO, "request too long");
		return EIO;
	}
	int fd = dysco_real.socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		int e = errno;
		fail_log(FAIL_CONNECT, "cannot create a socket for the agent: %s", strerror(e));
		return e;
	}
	/* The descriptor bypasses the wrappers: forget any stale entry. */
	track_new_fd(fd, KIND_OTHER, NULL);
	struct timeval tv = {.tv_sec = AGENT_TIMEOUT_SEC};
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));

	int err = 0;
	struct sockaddr_un sa;
	socklen_t salen = agent_address(&sa);
	if (dysco_real.connect(fd, (struct sockaddr *)&sa, salen) < 0) {
		err = errno;
		if (err == ENOENT)
			err = ECONNREFUSED;
		if (err == EAGAIN || err == EINPROGRESS)
			err = ETIMEDOUT;
		fail_log(FAIL_CONNECT,
			 "cannot reach the Dysco agent on %s: %s (is the agent running in this network "
			 "namespace?); the sessions with %s and %s are not spliced",
			 dysco_agent_socket, strerror(err), r->in.remote, r->out.remote);
		goto out;
	}
	if (!agent_peer_ok(fd)) {
		err = EACCES;
		goto out;
	}
	for (int off = 0; off < reqlen;) {
		ssize_t n = dysco_real.send(fd, req + off, (size_t)(reqlen - off), MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			err = (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) ? ETIMEDOUT : EIO;
			fail_log(FAIL_IO, "sending the splice request to the agent on %s: %s", dysco_agent_socket,
				 n < 0 ? strerror(errno) : "connection closed");
			goto out;
		}
		off += (int)n;
	}
	/* Read the whole answer; keep its beginning. */
	char ans[4096];
	size_t al = 0;
	for (;;) {
		char tmp[1024];
		ssize_t n = dysco_real.recv(fd, tmp, sizeof(tmp), 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			err = (errno == EAGAIN || errno == EWOULDBLOCK) ? ETIMEDOUT : EIO;
			fail_log(FAIL_IO, "reading the agent's answer on %s: %s", dysco_agent_socket,
				 err == ETIMEDOUT ? "no answer in time" : strerror(errno));
			goto out;
		}
		if (n == 0)
			break;
		size_t keep = sizeof(ans) - 1 - al;
		if ((size_t)n < keep)
			keep = (size_t)n;
		memcpy(ans + al, tmp, keep);
		al += keep;
	}
	ans[al] = '\0';
	if (al == 0) {
		err = EIO;
		fail_log(FAIL_AGENT,
			 "the agent on %s closed the connection without answering (its API serves root "
			 "only: does the proxy drop privileges?)",
			 dysco_agent_socket);
		goto out;
	}
	int code = 0;
	char text[300];
	int verdict = parse_answer(ans, &code, text, sizeof(text));
	if (verdict == ANSWER_BAD) {
		err = EIO;
		fail_log(FAIL_AGENT, "unreadable answer from the agent on %s", dysco_agent_socket);
		goto out;
	}
	if (verdict == ANSWER_REFUSED) {
		err = EIO;
		fail_log(FAIL_AGENT, "the agent refused to splice %s -> %s with %s -> %s: HTTP %d: %s",
			 r->in.remote, r->in.local, r->out.local, r->out.remote, code,
			 text[0] ? text : "(no message)");
		goto out;
	}
	DLOG(1, "the agent took the splice of %s -> %s with %s -> %s (HTTP %d)", r->in.remote, r->in.local,
	     r->out.local, r->out.remote, code);
out:
	track_close(fd);
	dysco_real.close(fd);
	return err;
}

/* ---- the background thread ---- */

static struct dysco_request queue[QUEUE_MAX];
static int qhead, qlen, busy, worker_running;
static pthread_mutex_t qmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t qcv = PTHREAD_COND_INITIALIZER;   /* work to do */
static pthread_cond_t qdone = PTHREAD_COND_INITIALIZER; /* one request done */

void agent_atfork_prepare(void)
{
	pthread_mutex_lock(&qmu);
}

void agent_atfork_parent(void)
{
	pthread_mutex_unlock(&qmu);
}

void agent_atfork_child(void)
{
	/* The worker is not in the child, and the queued requests are the
	 * parent's to send. */
	pthread_mutex_unlock(&qmu);
	pthread_cond_init(&qcv, NULL);
	pthread_cond_init(&qdone, NULL);
	qhead = qlen = busy = worker_running = 0;
}

static void *worker(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&qmu);
	for (;;) {
		while (qlen == 0)
			pthread_cond_wait(&qcv, &qmu);
		struct dysco_request r = queue[qhead];
		qhead = (qhead + 1) % QUEUE_MAX;
		qlen--;
		busy = 1;
		pthread_mutex_unlock(&qmu);
		exchange(&r);
		pthread_mutex_lock(&qmu);
		busy = 0;
		pthread_cond_broadcast(&qdone);
	}
	return NULL;
}

/* start_worker starts the thread with every signal blocked, so that the
 * proxy's signals go to the proxy's threads; under qmu. */
static int start_worker(void)
{
	pthread_attr_t attr;
	pthread_t th;
	sigset_t all, old;
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&attr, 256 * 1024);
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	int e = pthread_create(&th, &attr, worker, NULL);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&attr);
	if (e == 0) {
		worker_running = 1;
		pthread_setname_np(th, "libdysco");
	}
	return e;
}

void agent_send_async(const struct dysco_request *r)
{
	pthread_mutex_lock(&qmu);
	if (qlen == QUEUE_MAX) {
		pthread_mutex_unlock(&qmu);
		fail_log(FAIL_QUEUE, "%d requests wait for the agent: splice of %s -> %s dropped", QUEUE_MAX,
			 r->in.remote, r->out.remote);
		return;
	}
	if (!worker_running) {
		int e = start_worker();
		if (e != 0) {
			pthread_mutex_unlock(&qmu);
			fail_log(FAIL_THREAD, "cannot start the thread that talks to the agent: %s; splice of %s -> %s dropped",
				 strerror(e), r->in.remote, r->out.remote);
			return;
		}
	}
	queue[(qhead + qlen) % QUEUE_MAX] = *r;
	qlen++;
	pthread_cond_signal(&qcv);
	pthread_mutex_unlock(&qmu);
}

/* At exit, give queued requests a moment to reach the agent: a proxy that
 * ends right after splicing still leaves the path cleanly. */
__attribute__((destructor)) static void drain(void)
{
	pthread_mutex_lock(&qmu);
	if (worker_running) {
		struct timespec dl;
		clock_gettime(CLOCK_REALTIME, &dl);
		dl.tv_sec += DRAIN_MS / 1000;
		dl.tv_nsec += (long)(DRAIN_MS % 1000) * 1000000L;
		if (dl.tv_nsec >= 1000000000L) {
			dl.tv_sec++;
			dl.tv_nsec -= 1000000000L;
		}
		while ((qlen > 0 || busy) && pthread_cond_timedwait(&qdone, &qmu, &dl) == 0)
			;
	}
	pthread_mutex_unlock(&qmu);
}

/* ---- the explicit call ---- */

int agent_send_sync(const struct dysco_request *r)
{
	int e = exchange(r);
	if (e != 0) {
		errno = e;
		return -1;
	}
	return 0;
}

DYSCO_EXPORT int dysco_splice(int fd_in, int fd_out, int delta)
{
	dysco_ensure_init();
	struct dysco_request r;
	memset(&r, 0, sizeof(r));
	if (tuple_of(fd_in, &r.in) < 0 || tuple_of(fd_out, &r.out) < 0)
		return -1;
	if (fd_in == fd_out || (strcmp(r.in.local, r.out.local) == 0 && strcmp(r.in.remote, r.out.remote) == 0)) {
		errno = EINVAL;
		return -1;
	}
	r.delta = delta;
	r.delta_rev = dysco_disabled ? 0 : track_explicit(fd_in, fd_out);
	DLOG(1, "dysco_splice(%d, %d, %d): %s -> %s with %s -> %s, delta_rev %lld", fd_in, fd_out, delta,
	     r.in.remote, r.in.local, r.out.local, r.out.remote, (long long)r.delta_rev);
	return agent_send_sync(&r);
}
