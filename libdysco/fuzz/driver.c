/*
 * driver.c: runs the libFuzzer harness (answer_fuzz.c) over files without
 * libFuzzer, as a regression test: each argument is a file or a directory
 * of files; exits non-zero (the harness aborts) on the first failure.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		perror(path);
		return 1;
	}
	static uint8_t buf[1 << 20];
	size_t n = fread(buf, 1, sizeof(buf), f);
	fclose(f);
	LLVMFuzzerTestOneInput(buf, n);
	return 0;
}

int main(int argc, char **argv)
{
	int runs = 0;
	for (int i = 1; i < argc; i++) {
		struct stat st;
		if (stat(argv[i], &st) < 0) {
			perror(argv[i]);
			return 1;
		}
		if (!S_ISDIR(st.st_mode)) {
			if (run_file(argv[i]))
				return 1;
			runs++;
			continue;
		}
		DIR *d = opendir(argv[i]);
		if (!d) {
			perror(argv[i]);
			return 1;
		}
		struct dirent *e;
		while ((e = readdir(d)) != NULL) {
			if (e->d_name[0] == '.')
				continue;
			char p[4096];
			snprintf(p, sizeof(p), "%s/%s", argv[i], e->d_name);
			if (run_file(p)) {
				closedir(d);
				return 1;
			}
			runs++;
		}
		closedir(d);
	}
	printf("%d inputs\n", runs);
	return 0;
}
