/*
 * answer_fuzz.c: libFuzzer harness for parse_answer (libdysco/answer.c),
 * libdysco's reading of the agent's answers.
 *
 * The input is what the agent's socket gave, kept as agent.c keeps it: its
 * first 4095 bytes, NUL-terminated. Whatever it is, parse_answer must
 * return one of its three verdicts; a 2xx status is ANSWER_OK and nothing
 * else is; the error text is NUL-terminated inside its buffer and holds
 * only printable ASCII (it goes to the proxy's log); bytes of the buffer
 * past the terminator are never written.
 *
 *   make fuzz                     # libFuzzer, ASan and UBSan (clang)
 *   go test ./test/libdysco       # the corpus as a regression (driver.c)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"

#define CANARY 0x5a

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char ans[4096];
	size_t al = size < sizeof(ans) - 1 ? size : sizeof(ans) - 1;
	memcpy(ans, data, al);
	ans[al] = '\0';
	/* Text buffers of several sizes, with canaries after them. */
	static const size_t sizes[] = {300, 1, 2, 17};
	for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
		size_t tl = sizes[k];
		char text[320];
		memset(text, CANARY, sizeof(text));
		int code = -1;
		int v = parse_answer(ans, &code, text, tl);
		if (v != ANSWER_OK && v != ANSWER_REFUSED && v != ANSWER_BAD)
			abort();
		if ((v == ANSWER_OK) != (code >= 200 && code <= 299 && v != ANSWER_BAD))
			abort();
		if (v == ANSWER_BAD && code != 0)
			abort();
		size_t n = strnlen(text, tl);
		if (n >= tl)
			abort(); /* not terminated inside the buffer */
		for (size_t i = 0; i < n; i++)
			if (text[i] < 32 || text[i] > 126)
				abort();
		for (size_t i = tl; i < sizeof(text); i++)
			if (text[i] != CANARY)
				abort();
	}
	return 0;
}
