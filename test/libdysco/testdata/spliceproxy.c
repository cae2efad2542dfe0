/*
 * spliceproxy: a minimal TCP proxy that relays with splice(2) through
 * pipes, as HAProxy does in TCP mode; it knows nothing of Dysco and is run
 * under LD_PRELOAD=libdysco.so.
 *
 *   spliceproxy LISTEN_HOST BACKEND_HOST BACKEND_PORT [banner | user-request | user-request-add K]
 *
 * It prints its port on stdout, accepts one client, connects to the
 * backend and relays both directions until both are closed. With "banner",
 * it first reads one line from the backend with recv and sends it to the
 * client prefixed with "X-Banner: " (10 bytes added to the backend -> client
 * stream, before splicing). The tests build it with _FORTIFY_SOURCE=3, so that
 * this recv is a call to __recv_chk.
 *
 * With "user-request", the client -> backend direction is relayed with recv
 * and send (as HAProxy does with a small request), and only the backend ->
 * client direction is spliced. "user-request-add K" does the same, but
 * once it has spliced K bytes or more back to the client, it prefixes every
 * chunk it relays to the backend with '+' (a proxy that changes the other
 * direction after splicing one). A failed send ends the proxy with an
 * error, as a write error ends a session in HAProxy.
 */
#include "common.h"

#include <poll.h>
#include <signal.h>

struct dir {
	int src, dst, pr, pw; /* sockets, pipe read and write ends */
	size_t pending;       /* bytes in the pipe (or in buf) */
	int eof, done;
	int user;       /* relay with recv and send instead of splice */
	char buf[65537]; /* user: buf[0] for the '+', the data from buf + 1 */
	size_t off;     /* user: next byte of buf to send */
	size_t spliced; /* bytes spliced to dst so far */
};

static const struct dir *other;  /* the spliced direction (user-request-add) */
static long add_after = -1;      /* user-request-add: K */

static void step_user(struct dir *d)
{
	if (d->done)
		return;
	if (d->pending == 0 && !d->eof) {
		ssize_t n = recv(d->src, d->buf + 1, sizeof(d->buf) - 1, 0);
		if (n > 0) {
			d->off = 1;
			d->pending = (size_t)n;
			if (add_after >= 0 && other->spliced >= (size_t)add_after) {
				d->buf[0] = '+';
				d->off = 0;
				d->pending++;
			}
		} else if (n == 0 || errno == ECONNRESET) {
			d->eof = 1;
		} else if (errno != EAGAIN && errno != EINTR) {
			die("recv");
		}
	}
	while (d->pending > 0) {
		ssize_t n = send(d->dst, d->buf + d->off, d->pending, 0);
		if (n > 0) {
			d->off += (size_t)n;
			d->pending -= (size_t)n;
			continue;
		}
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			break;
		die("send");
	}
	if (d->eof && d->pending == 0) {
		shutdown(d->dst, SHUT_WR);
		d->done = 1;
	}
}

static void step(struct dir *d)
{
	if (d->user) {
		step_user(d);
		return;
	}
	if (d->done)
		return;
	if (d->pending == 0 && !d->eof) {
		ssize_t n = splice(d->src, NULL, d->pw, NULL, 65536, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
		if (n > 0)
			d->pending += (size_t)n;
		else if (n == 0 || errno == ECONNRESET)
			d->eof = 1;
		else if (errno != EAGAIN && errno != EINTR)
			die("splice from socket");
	}
	while (d->pending > 0) {
		ssize_t n = splice(d->pr, NULL, d->dst, NULL, d->pending, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
		if (n > 0) {
			d->pending -= (size_t)n;
			d->spliced += (size_t)n;
			continue;
		}
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			break;
		die("splice to socket");
	}
	if (d->eof && d->pending == 0) {
		shutdown(d->dst, SHUT_WR);
		d->done = 1;
	}
}

int main(int argc, char **argv)
{
	if (argc < 4) {
		fprintf(stderr, "usage: spliceproxy LISTEN_HOST BACKEND_HOST BACKEND_PORT "
				"[banner | user-request | user-request-add K]\n");
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	int ln = listen_on(argv[1]);
	int c = accept4(ln, NULL, NULL, SOCK_CLOEXEC);
	if (c < 0)
		die("accept4");
	close(ln);
	int b = connect_to(argv[2], argv[3]);

	if (argc > 4 && strcmp(argv[4], "banner") == 0) {
		char line[256];
		size_t n = 0;
		while (n == 0 || line[n - 1] != '\n') {
			ssize_t r = recv(b, line + n, sizeof(line) - n, 0);
			if (r <= 0 || n + (size_t)r >= sizeof(line)) {
				fprintf(stderr, "spliceproxy: bad banner\n");
				return 1;
			}
			n += (size_t)r;
		}
		send_all(c, "X-Banner: ", 10);
		send_all(c, line, n);
	}

	set_nonblock(c);
	set_nonblock(b);
	int p1[2], p2[2];
	if (pipe2(p1, O_CLOEXEC | O_NONBLOCK) < 0 || pipe2(p2, O_CLOEXEC | O_NONBLOCK) < 0)
		die("pipe2");
	static struct dir d[2];
	d[0] = (struct dir){.src = c, .dst = b, .pr = p1[0], .pw = p1[1]};
	d[1] = (struct dir){.src = b, .dst = c, .pr = p2[0], .pw = p2[1]};
	if (argc > 4 && strcmp(argv[4], "user-request") == 0)
		d[0].user = 1;
	if (argc > 5 && strcmp(argv[4], "user-request-add") == 0) {
		d[0].user = 1;
		add_after = atol(argv[5]);
	}
	other = &d[1];
	while (!d[0].done || !d[1].done) {
		struct pollfd pf[2];
		int np = 0;
		for (int i = 0; i < 2; i++) {
			if (d[i].done)
				continue;
			if (d[i].pending > 0)
				pf[np++] = (struct pollfd){.fd = d[i].dst, .events = POLLOUT};
			else if (!d[i].eof)
				pf[np++] = (struct pollfd){.fd = d[i].src, .events = POLLIN};
		}
		if (np > 0 && poll(pf, (nfds_t)np, -1) < 0 && errno != EINTR)
			die("poll");
		step(&d[0]);
		step(&d[1]);
	}
	close(p1[0]);
	close(p1[1]);
	close(p2[0]);
	close(p2[1]);
	close(c);
	close(b);
	return 0;
}
