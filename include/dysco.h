/*
 * dysco.h: libdysco, the proxy side of Dysco's "splice" (paper §4.2,
 * "Triggering a reconfiguration using splice").
 *
 * A middlebox that terminates TCP sessions (an L7 load balancer, a TCP
 * proxy) and has nothing more to do with the data of a pair of sockets can
 * ask the local Dysco agent to join the two TCP sessions into one and to
 * remove the middlebox from the path. The agent then translates sequence
 * numbers, acknowledgments, SACK blocks, timestamps and window scaling
 * between the two sessions; the proxy's sockets see no more data.
 *
 * libdysco.so is used in one of two ways:
 *
 * 1. LD_PRELOAD into an unmodified proxy that relays with splice(2), such as
 *    HAProxy in TCP mode with "option splice-request" and
 *    "option splice-response":
 *
 *        LD_PRELOAD=/path/to/libdysco.so haproxy -f haproxy.cfg
 *
 *    The library wraps socket, accept, accept4, connect, read, readv, recv,
 *    recvfrom, recvmsg, write, writev, send, sendto, sendmsg, splice, close,
 *    dup, dup2, dup3, pipe and pipe2 (and the _FORTIFY_SOURCE variants
 *    __read_chk, __recv_chk, __recvfrom_chk). Each wrapper calls the C library's function
 *    first and then records the result: the bytes read from and written to
 *    every TCP socket, and, for splice, which socket feeds which pipe and
 *    which pipe feeds which socket. When one direction between two TCP
 *    sockets A and B has been spliced through a pipe and the other holds
 *    nothing the proxy has yet to relay (by default; see
 *    DYSCO_SPLICE_TRIGGER), it sends one request for the pair to the agent,
 *    from a background thread: the proxy's own calls never wait for the
 *    agent. Bytes that pass through pipes are relayed unchanged and cancel
 *    out; delta is the number of bytes the proxy wrote to B minus the number
 *    it read from A with the read and write functions before the request,
 *    delta_rev the same for B -> A.
 *
 * 2. Linked into a modified proxy (-ldysco), which calls dysco_splice()
 *    below when it is done with a pair of sockets. The wrappers are active
 *    in this mode too (the library's definitions come before the C
 *    library's), which is how dysco_splice() knows delta_rev.
 *
 * Use with prudence: after a request the agent removes the proxy from both
 * sessions, so the proxy must not want to see, add or change any more data
 * on either socket. This holds for L7 load balancers once they have chosen a
 * server, not for an HTTP proxy that keeps persistent connections and looks
 * at every request. Data the proxy has read but not yet written when the
 * request is made is counted as removed.
 *
 * Environment (read once, when the library is loaded):
 *
 *   DYSCO_AGENT_SOCKET    the agent's Unix socket: "@name" for an abstract
 *                         socket, anything else is a path. Default
 *                         "@dysco-agent". Abstract sockets belong to the
 *                         network namespace and work in a chroot.
 *   DYSCO_DEBUG           "1": log every tracked event (new sockets, pipe
 *                         directions, requests and answers) to stderr;
 *                         "2": also every read and write on a TCP socket.
 *   DYSCO_DISABLE         "1": every wrapper is a pure pass-through and no
 *                         request is ever sent automatically; dysco_splice()
 *                         still works (with delta_rev 0).
 *   DYSCO_SPLICE_TRIGGER  "auto" (default): request on the splice call
 *                         that moves data of one direction (socket -> pipe,
 *                         then pipe -> socket, as in the paper) once the
 *                         other direction is drained: every byte read from
 *                         its source written to its destination, nothing in
 *                         the source's receive queue; "both": once both
 *                         directions are spliced; "first": at the first
 *                         spliced direction, whatever the other holds.
 *                         After an automatic request, a write that would
 *                         change either stream beyond the delta sent fails
 *                         with EPIPE.
 *
 * Messages go to stderr and start with "libdysco:". Failures of automatic
 * requests are logged (the first of each kind, then rarely) and change
 * nothing else: the proxy keeps relaying through its sockets.
 *
 * The request is HTTP/1.1 over the Unix socket:
 *
 *   POST /v1/sessions/splice
 *   {"in":{"local":"10.0.0.2:8080","remote":"10.0.0.1:41234"},
 *    "out":{"local":"10.0.1.2:40000","remote":"10.0.1.3:80"},
 *    "delta":0,"delta_rev":0,"wait":false}
 *
 * "in" is the socket the data comes from (fd_in), "out" the socket it goes
 * to (fd_out); IPv6 addresses are written "[2001:db8::1]:80" and
 * IPv4-mapped IPv6 addresses as plain IPv4.
 *
 * Limits: file descriptors from 65536 up are not tracked; descriptors
 * closed by other means than close/dup2/dup3 (fclose, close_range) may keep
 * stale counters until reused by socket, accept or pipe; sendfile,
 * vmsplice, tee, recvmmsg/sendmmsg and io_uring are not seen; MPTCP sockets
 * are not TCP sockets here; the Dysco agent's API accepts root peers only,
 * so a proxy that drops privileges cannot reach it. See docs/libdysco.md.
 */
#ifndef DYSCO_H
#define DYSCO_H

#ifdef __cplusplus
extern "C" {
#endif

/*
 * dysco_splice asks the local Dysco agent to splice the TCP session of
 * fd_in into the TCP session of fd_out and to remove this middlebox from
 * the path. delta is the number of bytes the proxy added to (> 0) or
 * removed from (< 0) the stream read from fd_in before writing it to
 * fd_out. The reverse delta (fd_out -> fd_in) is the difference between
 * the bytes written to fd_in and read from fd_out that the library's
 * wrappers have seen, 0 if they saw nothing.
 *
 * Blocking: the call is synchronous; it connects to the agent, sends the
 * request and reads the whole answer, waiting at most about 5 seconds.
 * It does not wait for the reconfiguration itself ("wait":false): the
 * agent answers once it has taken the request.
 *
 * Thread-safety: safe to call from any thread, concurrently with itself
 * and with the proxy's I/O on other sockets.
 *
 * The pair is marked, whatever the outcome, so that the LD_PRELOAD
 * tracking never sends a request of its own for it.
 *
 * Returns 0 on success, -1 with errno set on failure:
 *   EINVAL        fd_in or fd_out is not a TCP socket (IPv4 or IPv6), or
 *                 they are the same socket
 *   ENOTCONN      a socket is not connected
 *   EBADF         a descriptor is not open
 *   ECONNREFUSED  no agent listens on the agent socket
 *   ETIMEDOUT     the agent did not answer in time
 *   EIO           the agent answered with an error (logged to stderr with
 *                 the agent's message) or with something unreadable
 * The proxy's sockets are never changed by a failed call: it can go on
 * relaying the data itself.
 */
int dysco_splice(int fd_in, int fd_out, int delta);

#ifdef __cplusplus
}
#endif

#endif /* DYSCO_H */
