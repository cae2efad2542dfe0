/*
 * track.c: what libdysco knows about each file descriptor.
 *
 * One entry per descriptor below DYSCO_MAX_FD:
 *  - its kind (TCP socket, pipe, anything else), found once and kept until
 *    the descriptor is closed;
 *  - for TCP sockets, the bytes read and written with the read and write
 *    functions (rd, wr) and with splice (rd_sp, wr_sp), and the socket its
 *    data is spliced to once known (to);
 *  - for pipes, the inode (both ends of a pipe share it) and the TCP socket
 *    that last spliced data into the pipe (src).
 *
 * splice(A -> pipe) records A as the pipe's source; splice(pipe -> B) finds
 * the source through the inode and so learns the direction A -> B. Once a
 * pair meets the trigger's rule (below), the pair is marked and one request
 * is queued for the agent.
 *
 * The rule (DYSCO_SPLICE_TRIGGER), checked at every splice(pipe -> B) of a
 * pair that had no request yet (paper §4.2: the request follows the second
 * splice call, the one that moves data):
 *  - auto (default): both directions spliced, or this one spliced and the
 *    other, B -> A, drained: every byte the proxy read from B it wrote to A
 *    (read/write functions and splice alike), and B's receive queue is
 *    empty (SIOCINQ). A plain download or upload through a splicing proxy
 *    leaves at its first spliced bytes; a proxy still holding or changing
 *    the other direction is left until that direction is drained or spliced
 *    too;
 *  - both: both directions spliced;
 *  - first: the first spliced direction, whatever the other holds.
 * After an automatic request, a write to either socket that would change
 * its stream by more than the delta sent is refused (EPIPE): the proxy
 * asked to leave and may relay what still comes on the old path, but not
 * change it (track_write_refused).
 *
 * Counters are atomics, so reads and writes on TCP sockets take no lock,
 * nor do splices once a socket's pair has had its request.
 * Everything else (resets, pipe sources, directions, marks) is under mu,
 * and every entry has a generation, bumped on each reset, so that a
 * reference to a descriptor number that was closed and reused is detected.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <linux/sockios.h>
#include <netinet/in.h>

struct fdent {
	uint8_t kind;      /* enum fd_kind; atomic */
	uint8_t triggered; /* TCP: a request was made for this socket's pair; atomic */
	uint8_t src_valid; /* pipe: src is set */
	uint8_t to_valid;  /* TCP: to is set */
	uint32_t gen;      /* bumped on every reset */
	uint64_t rd, wr;       /* TCP: read/write functions; atomic */
	uint64_t rd_sp, wr_sp; /* TCP: splice; atomic */
	uint64_t ino;          /* pipe: inode */
	int src;               /* pipe: TCP socket that fed it last */
	uint32_t src_gen;
	int link; /* pipe: the other end, where src is kept (cache) */
	uint32_t link_gen;
	int to; /* TCP: this socket's data is spliced to "to" */
	uint32_t to_gen;
	/* TCP, after an automatic request: writes must keep
	 * wr - rd(gpeer) <= glimit (the delta sent). */
	uint8_t guard;   /* atomic */
	uint8_t refused; /* a write was refused (logged); atomic */
	int gpeer;
	uint32_t gpeer_gen;
	int64_t glimit;
};

static struct fdent tab[DYSCO_MAX_FD];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int max_pipe_fd = -1; /* highest descriptor seen as a pipe; under mu */

void track_atfork_prepare(void)
{
	pthread_mutex_lock(&mu);
}

void track_atfork_parent(void)
{
	pthread_mutex_unlock(&mu);
}

void track_atfork_child(void)
{
	/* The forking thread, the child's only thread, holds it. */
	pthread_mutex_unlock(&mu);
}

static int in_range(int fd)
{
	return fd >= 0 && fd < DYSCO_MAX_FD;
}

static const char *kind_name(int k)
{
	switch (k) {
	case KIND_TCP:
		return "TCP socket";
	case KIND_PIPE:
		return "pipe";
	case KIND_OTHER:
		return "other";
	}
	return "unknown";
}

/* reset forgets everything about fd; under mu. */
static void reset(int fd)
{
	struct fdent *e = &tab[fd];
	uint32_t gen = e->gen + 1;
	__atomic_store_n(&e->kind, KIND_UNKNOWN, __ATOMIC_RELAXED);
	__atomic_store_n(&e->rd, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&e->wr, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&e->rd_sp, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&e->wr_sp, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&e->triggered, 0, __ATOMIC_RELAXED);
	e->src_valid = e->to_valid = 0;
	e->ino = 0;
	e->src = e->link = e->to = -1;
	e->src_gen = e->link_gen = e->to_gen = 0;
	__atomic_store_n(&e->guard, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&e->refused, 0, __ATOMIC_RELAXED);
	e->gpeer = -1;
	e->gpeer_gen = 0;
	e->glimit = 0;
	__atomic_store_n(&e->gen, gen, __ATOMIC_RELAXED);
}

/* classify finds fd's kind with fstat and getsockopt; errno may change. */
static int classify(int fd)
{
	struct fdent *e = &tab[fd];
	int k = __atomic_load_n(&e->kind, __ATOMIC_ACQUIRE);
	if (k != KIND_UNKNOWN)
		return k;
	struct stat st;
	if (fstat(fd, &st) < 0)
		return KIND_UNKNOWN; /* not open: nothing to remember */
	if (S_ISFIFO(st.st_mode)) {
		__atomic_store_n(&e->ino, (uint64_t)st.st_ino, __ATOMIC_RELAXED);
		k = KIND_PIPE;
	} else if (S_ISSOCK(st.st_mode)) {
		int dom = 0, proto = 0;
		socklen_t l1 = sizeof(dom), l2 = sizeof(proto);
		if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &dom, &l1) == 0 &&
		    getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &l2) == 0 &&
		    (dom == AF_INET || dom == AF_INET6) && proto == IPPROTO_TCP)
			k = KIND_TCP;
		else
			k = KIND_OTHER;
	} else {
		k = KIND_OTHER;
	}
	__atomic_store_n(&e->kind, (uint8_t)k, __ATOMIC_RELEASE);
	return k;
}

int track_kind(int fd)
{
	if (!in_range(fd))
		return KIND_UNKNOWN;
	return classify(fd);
}

void track_new_fd(int fd, int kind, const char *how)
{
	if (!in_range(fd))
		return;
	pthread_mutex_lock(&mu);
	reset(fd);
	if (kind != KIND_UNKNOWN)
		__atomic_store_n(&tab[fd].kind, (uint8_t)kind, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&mu);
	if (how && dysco_debug) {
		if (kind == KIND_UNKNOWN)
			kind = classify(fd);
		if (kind == KIND_TCP)
			dysco_log("fd %d: %s: %s", fd, how, kind_name(kind));
	}
}

void track_dup(int oldfd, int newfd)
{
	if (!in_range(newfd))
		return;
	pthread_mutex_lock(&mu);
	reset(newfd);
	if (in_range(oldfd)) {
		struct fdent *o = &tab[oldfd], *n = &tab[newfd];
		uint32_t gen = n->gen;
		int k = __atomic_load_n(&o->kind, __ATOMIC_ACQUIRE);
		__atomic_store_n(&n->triggered, __atomic_load_n(&o->triggered, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
		n->src_valid = o->src_valid;
		n->to_valid = o->to_valid;
		n->ino = o->ino;
		n->src = o->src;
		n->src_gen = o->src_gen;
		n->to = o->to;
		n->to_gen = o->to_gen;
		n->gpeer = o->gpeer;
		n->gpeer_gen = o->gpeer_gen;
		n->glimit = o->glimit;
		__atomic_store_n(&n->guard, __atomic_load_n(&o->guard, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
		__atomic_store_n(&n->rd, __atomic_load_n(&o->rd, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
		__atomic_store_n(&n->wr, __atomic_load_n(&o->wr, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
		__atomic_store_n(&n->rd_sp, __atomic_load_n(&o->rd_sp, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
		__atomic_store_n(&n->wr_sp, __atomic_load_n(&o->wr_sp, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
		n->gen = gen;
		if (k == KIND_PIPE && newfd > max_pipe_fd)
			max_pipe_fd = newfd;
		__atomic_store_n(&n->kind, (uint8_t)k, __ATOMIC_RELEASE);
		if (dysco_debug && k == KIND_TCP)
			dysco_log("fd %d: duplicate of fd %d", newfd, oldfd);
	}
	pthread_mutex_unlock(&mu);
}

void track_close(int fd)
{
	if (!in_range(fd))
		return;
	if (dysco_debug && __atomic_load_n(&tab[fd].kind, __ATOMIC_RELAXED) == KIND_TCP) {
		struct fdent *e = &tab[fd];
		dysco_log("fd %d: close: read %llu (+%llu spliced), written %llu (+%llu spliced)", fd,
			  (unsigned long long)__atomic_load_n(&e->rd, __ATOMIC_RELAXED),
			  (unsigned long long)__atomic_load_n(&e->rd_sp, __ATOMIC_RELAXED),
			  (unsigned long long)__atomic_load_n(&e->wr, __ATOMIC_RELAXED),
			  (unsigned long long)__atomic_load_n(&e->wr_sp, __ATOMIC_RELAXED));
	}
	/* Nothing to forget about descriptors never looked at (files...):
	 * no lock on their close. */
	if (__atomic_load_n(&tab[fd].kind, __ATOMIC_ACQUIRE) == KIND_UNKNOWN &&
	    !__atomic_load_n(&tab[fd].triggered, __ATOMIC_RELAXED))
		return;
	pthread_mutex_lock(&mu);
	reset(fd);
	pthread_mutex_unlock(&mu);
}

void track_read(int fd, ssize_t n, const char *how)
{
	if (!in_range(fd) || classify(fd) != KIND_TCP)
		return;
	__atomic_add_fetch(&tab[fd].rd, (uint64_t)n, __ATOMIC_RELAXED);
	DLOG(2, "fd %d: %s %zd", fd, how, n);
}

void track_write(int fd, ssize_t n, const char *how)
{
	if (!in_range(fd) || classify(fd) != KIND_TCP)
		return;
	__atomic_add_fetch(&tab[fd].wr, (uint64_t)n, __ATOMIC_RELAXED);
	DLOG(2, "fd %d: %s %zd", fd, how, n);
}

/* tcp_alive tells whether fd is still the TCP socket of generation gen;
 * under mu. */
static int tcp_alive(int fd, uint32_t gen)
{
	return in_range(fd) && tab[fd].gen == gen &&
	       __atomic_load_n(&tab[fd].kind, __ATOMIC_RELAXED) == KIND_TCP;
}

/* pipe_source returns the TCP socket that last spliced data into the pipe
 * that fd is the read end of, or -1; under mu. */
static int pipe_source(int fd)
{
	struct fdent *p = &tab[fd];
	const struct fdent *w = NULL;
	if (p->src_valid) {
		w = p; /* a FIFO opened for reading and writing */
	} else if (in_range(p->link) && tab[p->link].gen == p->link_gen &&
		   tab[p->link].kind == KIND_PIPE && tab[p->link].ino == p->ino && tab[p->link].src_valid) {
		w = &tab[p->link];
	} else {
		for (int i = 0; i <= max_pipe_fd; i++) {
			if (i != fd && tab[i].kind == KIND_PIPE && tab[i].ino == p->ino && tab[i].src_valid) {
				p->link = i;
				p->link_gen = tab[i].gen;
				w = &tab[i];
				break;
			}
		}
	}
	if (!w || !tcp_alive(w->src, w->src_gen))
		return -1;
	return w->src;
}

static void trigger(int in, int out, int64_t delta, int64_t delta_rev);
static int64_t delta_of(int from, int to);

/* drained tells whether the direction from -> to holds nothing the proxy
 * has yet to relay: every byte read from "from" was written to "to" (with
 * the read and write functions, and with splice, so nothing waits in a
 * pipe), and nothing waits in from's receive queue; under mu. */
static int drained(int from, int to)
{
	const struct fdent *f = &tab[from], *t = &tab[to];
	if (__atomic_load_n(&f->rd, __ATOMIC_RELAXED) != __atomic_load_n(&t->wr, __ATOMIC_RELAXED) ||
	    __atomic_load_n(&f->rd_sp, __ATOMIC_RELAXED) != __atomic_load_n(&t->wr_sp, __ATOMIC_RELAXED))
		return 0;
	int queued = 0;
	if (ioctl(from, SIOCINQ, &queued) < 0 || queued != 0)
		return 0;
	return 1;
}

/* guard makes writes to fd keep wr(fd) - rd(peer) <= limit; under mu. */
static void guard(int fd, int peer, int64_t limit)
{
	struct fdent *e = &tab[fd];
	e->gpeer = peer;
	e->gpeer_gen = tab[peer].gen;
	e->glimit = limit;
	__atomic_store_n(&e->guard, 1, __ATOMIC_RELEASE);
}

int track_write_refused(int fd, size_t n)
{
	if (!in_range(fd) || !__atomic_load_n(&tab[fd].guard, __ATOMIC_ACQUIRE))
		return 0;
	struct fdent *e = &tab[fd];
	int peer = e->gpeer;
	if (!in_range(peer) || __atomic_load_n(&tab[peer].gen, __ATOMIC_RELAXED) != e->gpeer_gen)
		return 0; /* the peer socket is closed: nothing left to protect */
	uint64_t wr = __atomic_load_n(&e->wr, __ATOMIC_RELAXED);
	uint64_t rd = __atomic_load_n(&tab[peer].rd, __ATOMIC_RELAXED);
	int64_t after = (int64_t)(wr + (uint64_t)n - rd);
	if (after <= e->glimit)
		return 0;
	if (!__atomic_exchange_n(&e->refused, 1, __ATOMIC_RELAXED) || dysco_debug)
		dysco_log("fd %d: write of %zu bytes refused (EPIPE): the proxy asked to leave this session, and "
			  "these bytes would change its stream from fd %d by %lld where the request said %lld",
			  fd, n, peer, (long long)after, (long long)e->glimit);
	return 1;
}

void track_splice(int fd_in, int fd_out, ssize_t n)
{
	if (!in_range(fd_in) || !in_range(fd_out))
		return;
	int req_in = -1, req_out = -1;
	int64_t delta = 0, delta_rev = 0;
	DLOG(2, "fd %d -> fd %d: splice %zd", fd_in, fd_out, n);
	/* Fast path, no lock: the socket's pair already had its request. */
	int kin = __atomic_load_n(&tab[fd_in].kind, __ATOMIC_ACQUIRE);
	int kout = __atomic_load_n(&tab[fd_out].kind, __ATOMIC_ACQUIRE);
	if (kin == KIND_TCP && kout == KIND_PIPE && __atomic_load_n(&tab[fd_in].triggered, __ATOMIC_RELAXED)) {
		__atomic_add_fetch(&tab[fd_in].rd_sp, (uint64_t)n, __ATOMIC_RELAXED);
		return;
	}
	if (kin == KIND_PIPE && kout == KIND_TCP && __atomic_load_n(&tab[fd_out].triggered, __ATOMIC_RELAXED)) {
		__atomic_add_fetch(&tab[fd_out].wr_sp, (uint64_t)n, __ATOMIC_RELAXED);
		return;
	}
	pthread_mutex_lock(&mu);
	kin = classify(fd_in);
	kout = classify(fd_out);
	if (kin == KIND_TCP && kout == KIND_PIPE) {
		struct fdent *a = &tab[fd_in], *p = &tab[fd_out];
		__atomic_add_fetch(&a->rd_sp, (uint64_t)n, __ATOMIC_RELAXED);
		if (fd_out > max_pipe_fd)
			max_pipe_fd = fd_out;
		if (!a->triggered && (!p->src_valid || p->src != fd_in || p->src_gen != a->gen)) {
			p->src = fd_in;
			p->src_gen = a->gen;
			p->src_valid = 1;
			DLOG(1, "fd %d: splice into pipe fd %d (inode %llu)", fd_in, fd_out,
			     (unsigned long long)p->ino);
		}
	} else if (kin == KIND_PIPE && kout == KIND_TCP) {
		struct fdent *b = &tab[fd_out];
		__atomic_add_fetch(&b->wr_sp, (uint64_t)n, __ATOMIC_RELAXED);
		if (fd_in > max_pipe_fd)
			max_pipe_fd = fd_in;
		int src = b->triggered ? -1 : pipe_source(fd_in);
		if (src >= 0 && src != fd_out && !tab[src].triggered) {
			struct fdent *a = &tab[src];
			if (!a->to_valid || a->to != fd_out || a->to_gen != b->gen) {
				a->to = fd_out;
				a->to_gen = b->gen;
				a->to_valid = 1;
				DLOG(1, "fd %d -> fd %d: spliced through pipe fd %d", src, fd_out, fd_in);
			}
			if (b->to_valid && b->to == src && b->to_gen == a->gen) {
				/* Both directions spliced; the other one was
				 * known first: it names "in". */
				req_in = fd_out;
				req_out = src;
			} else if (dysco_trigger == TRIGGER_FIRST ||
				   (dysco_trigger == TRIGGER_AUTO && drained(fd_out, src))) {
				req_in = src;
				req_out = fd_out;
			}
			if (req_in >= 0) {
				__atomic_store_n(&a->triggered, 1, __ATOMIC_RELAXED);
				__atomic_store_n(&b->triggered, 1, __ATOMIC_RELAXED);
				delta = delta_of(req_in, req_out);
				delta_rev = delta_of(req_out, req_in);
				guard(req_out, req_in, delta);
				guard(req_in, req_out, delta_rev);
			}
		}
	}
	pthread_mutex_unlock(&mu);
	if (req_in >= 0)
		trigger(req_in, req_out, delta, delta_rev);
}

/* delta_of is what the proxy added to the stream from "from" to "to": what
 * it wrote to "to" minus what it read from "from", with the read and write
 * functions. Spliced bytes pass unchanged and are left out, so bytes still
 * in a pipe do not count. */
static int64_t delta_of(int from, int to)
{
	if (!in_range(from) || !in_range(to))
		return 0;
	uint64_t w = __atomic_load_n(&tab[to].wr, __ATOMIC_RELAXED);
	uint64_t r = __atomic_load_n(&tab[from].rd, __ATOMIC_RELAXED);
	return (int64_t)(w - r);
}

static unsigned long addr_failures;

static void trigger(int in, int out, int64_t delta, int64_t delta_rev)
{
	struct dysco_request r;
	memset(&r, 0, sizeof(r));
	if (tuple_of(in, &r.in) < 0 || tuple_of(out, &r.out) < 0) {
		unsigned long k = __atomic_add_fetch(&addr_failures, 1, __ATOMIC_RELAXED);
		if ((k & (k - 1)) == 0 || dysco_debug)
			dysco_log("cannot name the sockets of spliced fds %d and %d: %s; no request sent "
				  "(%lu times so far)",
				  in, out, strerror(errno), k);
		return;
	}
	r.delta = delta;
	r.delta_rev = delta_rev;
	DLOG(1, "fd %d (%s <- %s) and fd %d (%s -> %s) spliced: asking the agent, delta %lld, delta_rev %lld",
	     in, r.in.local, r.in.remote, out, r.out.local, r.out.remote, (long long)r.delta,
	     (long long)r.delta_rev);
	agent_send_async(&r);
}

int64_t track_explicit(int fd_in, int fd_out)
{
	if (!in_range(fd_in) || !in_range(fd_out))
		return 0;
	pthread_mutex_lock(&mu);
	__atomic_store_n(&tab[fd_in].triggered, 1, __ATOMIC_RELAXED);
	__atomic_store_n(&tab[fd_out].triggered, 1, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&mu);
	return delta_of(fd_out, fd_in);
}
