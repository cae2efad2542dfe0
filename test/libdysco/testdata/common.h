/* Helpers shared by the test proxies: listening, connecting, I/O. */
#ifndef TEST_COMMON_H
#define TEST_COMMON_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static inline void die(const char *what)
{
	fprintf(stderr, "%s: %s\n", what, strerror(errno));
	exit(1);
}

/* listen_on listens on host, any port, and prints the port on stdout: the
 * test's ready signal. "::" listens on IPv4 too. */
static inline int listen_on(const char *host)
{
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICHOST}, *ai;
	int e = getaddrinfo(host, "0", &hints, &ai);
	if (e != 0) {
		fprintf(stderr, "getaddrinfo %s: %s\n", host, gai_strerror(e));
		exit(1);
	}
	int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		die("socket");
	int one = 1, zero = 0;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (ai->ai_family == AF_INET6)
		setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
	if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0)
		die("bind");
	if (listen(fd, 16) < 0)
		die("listen");
	freeaddrinfo(ai);
	struct sockaddr_storage ss;
	socklen_t l = sizeof(ss);
	if (getsockname(fd, (struct sockaddr *)&ss, &l) < 0)
		die("getsockname");
	int port = ss.ss_family == AF_INET ? ntohs(((struct sockaddr_in *)&ss)->sin_port)
					   : ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
	printf("%d\n", port);
	fflush(stdout);
	return fd;
}

static inline int connect_to(const char *host, const char *port)
{
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV}, *ai;
	int e = getaddrinfo(host, port, &hints, &ai);
	if (e != 0) {
		fprintf(stderr, "getaddrinfo %s %s: %s\n", host, port, gai_strerror(e));
		exit(1);
	}
	int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		die("socket");
	if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0)
		die("connect");
	freeaddrinfo(ai);
	return fd;
}

static inline void set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
		die("fcntl");
}

/* read_line reads from fd until a newline, with recv into a fixed buffer;
 * returns the bytes read (the line and what followed it). */
static inline size_t read_line(int fd, char *buf, size_t cap, size_t *linelen)
{
	size_t n = 0;
	for (;;) {
		char *nl = memchr(buf, '\n', n);
		if (nl) {
			*linelen = (size_t)(nl - buf) + 1;
			return n;
		}
		if (n == cap) {
			fprintf(stderr, "line too long\n");
			exit(1);
		}
		ssize_t r = recv(fd, buf + n, cap - n, 0);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			die("recv");
		if (r == 0) {
			fprintf(stderr, "EOF before a full line\n");
			exit(1);
		}
		n += (size_t)r;
	}
}

static inline void send_all(int fd, const char *buf, size_t n)
{
	while (n > 0) {
		ssize_t r = send(fd, buf, n, MSG_NOSIGNAL);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			die("send");
		buf += r;
		n -= (size_t)r;
	}
}

#endif
