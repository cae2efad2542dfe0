/*
 * answer.c: reading the agent's answer to a splice request (agent.c).
 *
 * The answer comes from the agent's Unix socket: a status line, headers and
 * a JSON body. Only its beginning is kept (NUL-terminated) and read here:
 * the status code, and for an error the body's "error" string as printable
 * text for the log. Fuzzed by libdysco/fuzz (make fuzz; its corpus runs in
 * go test ./test/libdysco).
 */
#define _GNU_SOURCE
#include "internal.h"

#include <stdio.h>
#include <string.h>

/* error_text copies the "error" string of a JSON body, or the body itself,
 * as printable text. */
static void error_text(const char *body, char *out, size_t outlen)
{
	const char *p = strstr(body, "\"error\"");
	size_t o = 0;
	if (p) {
		p += 7;
		while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
			p++;
		if (*p == ':')
			p++;
		while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
			p++;
		if (*p == '"') {
			for (p++; *p && *p != '"' && o + 1 < outlen; p++) {
				char c = *p;
				if (c == '\\' && p[1]) {
					c = *++p;
					if (c == 'n' || c == 't' || c == 'r')
						c = ' ';
					else if (c == 'u') {
						/* \uXXXX: keep it as a '?' */
						for (int i = 0; i < 4 && p[1]; i++)
							p++;
						c = '?';
					}
				}
				out[o++] = (c >= 32 && c < 127) ? c : '?';
			}
			out[o] = '\0';
			return;
		}
	}
	for (p = body; *p && o + 1 < outlen; p++)
		out[o++] = (*p >= 32 && *p < 127) ? *p : ' ';
	while (o > 0 && out[o - 1] == ' ')
		o--;
	out[o] = '\0';
}

int parse_answer(const char *ans, int *code, char *text, size_t textlen)
{
	*code = 0;
	if (textlen > 0)
		text[0] = '\0';
	if (strncmp(ans, "HTTP/1.", 7) != 0 || sscanf(ans + 7, "%*d %d", code) != 1)
		return ANSWER_BAD;
	if (*code >= 200 && *code <= 299)
		return ANSWER_OK;
	const char *body = strstr(ans, "\r\n\r\n");
	if (textlen > 0)
		error_text(body ? body + 4 : "", text, textlen);
	return ANSWER_REFUSED;
}
