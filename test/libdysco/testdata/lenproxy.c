/*
 * lenproxy: a proxy modified for Dysco. It reads the client's first line,
 * changes its length, forwards the result to the backend, calls
 * dysco_splice() with the right delta and then relays both directions with
 * plain read and write.
 *
 *   lenproxy LISTEN_HOST BACKEND_HOST BACKEND_PORT add|cut [banner]
 *
 * "add" prefixes the first line with "X-Len: " (delta 7); "cut" drops the
 * first line (delta -its length), as a proxy consuming a PROXY protocol
 * header would. With "banner", it first reads one line from the backend
 * and sends it to the client prefixed with "X-Banner: " (10 bytes), which
 * dysco_splice reports as delta_rev from the library's own counts.
 *
 * The outcome of dysco_splice is printed on stderr:
 * "lenproxy: dysco_splice: ok" or "lenproxy: dysco_splice: <strerror>".
 */
#include "common.h"

#include <poll.h>
#include <signal.h>
#include <sys/uio.h>

#include "dysco.h"

struct dir {
	int src, dst;
	char buf[65536];
	size_t len, off;
	int eof, done;
};

static void step(struct dir *d)
{
	if (d->done)
		return;
	if (d->len == 0 && !d->eof) {
		ssize_t n = read(d->src, d->buf, sizeof(d->buf));
		if (n > 0) {
			d->len = (size_t)n;
			d->off = 0;
		} else if (n == 0 || errno == ECONNRESET) {
			d->eof = 1;
		} else if (errno != EAGAIN && errno != EINTR) {
			die("read");
		}
	}
	while (d->len > 0) {
		ssize_t n = write(d->dst, d->buf + d->off, d->len);
		if (n > 0) {
			d->off += (size_t)n;
			d->len -= (size_t)n;
			continue;
		}
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			break;
		die("write");
	}
	if (d->eof && d->len == 0) {
		shutdown(d->dst, SHUT_WR);
		d->done = 1;
	}
}

static struct dir dirs[2];

int main(int argc, char **argv)
{
	if (argc < 5 || (strcmp(argv[4], "add") != 0 && strcmp(argv[4], "cut") != 0)) {
		fprintf(stderr, "usage: lenproxy LISTEN_HOST BACKEND_HOST BACKEND_PORT add|cut [banner]\n");
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	int ln = listen_on(argv[1]);
	int c = accept(ln, NULL, NULL);
	if (c < 0)
		die("accept");
	close(ln);
	int b = connect_to(argv[2], argv[3]);

	if (argc > 5 && strcmp(argv[5], "banner") == 0) {
		char banner[256];
		size_t linelen, n = read_line(b, banner, sizeof(banner), &linelen);
		if (n != linelen) {
			fprintf(stderr, "lenproxy: data after the banner\n");
			return 1;
		}
		send_all(c, "X-Banner: ", 10);
		send_all(c, banner, n);
	}

	static char first[65536];
	size_t linelen, n = read_line(c, first, sizeof(first), &linelen);
	int delta;
	if (strcmp(argv[4], "add") == 0) {
		struct iovec iov[2] = {{.iov_base = "X-Len: ", .iov_len = 7}, {.iov_base = first, .iov_len = n}};
		ssize_t w = writev(b, iov, 2);
		if (w < 0)
			die("writev");
		if ((size_t)w < 7) {
			fprintf(stderr, "lenproxy: short writev\n");
			return 1;
		}
		send_all(b, first + (w - 7), n - (size_t)(w - 7));
		delta = 7;
	} else {
		send_all(b, first + linelen, n - linelen);
		delta = -(int)linelen;
	}

	if (dysco_splice(c, b, delta) < 0)
		fprintf(stderr, "lenproxy: dysco_splice: %s\n", strerror(errno));
	else
		fprintf(stderr, "lenproxy: dysco_splice: ok\n");

	set_nonblock(c);
	set_nonblock(b);
	dirs[0].src = c, dirs[0].dst = b;
	dirs[1].src = b, dirs[1].dst = c;
	while (!dirs[0].done || !dirs[1].done) {
		struct pollfd pf[2];
		int np = 0;
		for (int i = 0; i < 2; i++) {
			struct dir *d = &dirs[i];
			if (d->done)
				continue;
			if (d->len > 0)
				pf[np++] = (struct pollfd){.fd = d->dst, .events = POLLOUT};
			else if (!d->eof)
				pf[np++] = (struct pollfd){.fd = d->src, .events = POLLIN};
		}
		if (np > 0 && poll(pf, (nfds_t)np, -1) < 0 && errno != EINTR)
			die("poll");
		step(&dirs[0]);
		step(&dirs[1]);
	}
	close(c);
	close(b);
	return 0;
}
