/* Temporary directories for the unit tests (tests/unit/tmpdir.h), each removed at exit by the
 * process that made it (not by a child forked from it). */
#include "tests/unit/tmpdir.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <ftw.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

#define TMPDIR_MAX 64

/* The directories made so far, each with the process that made it: a child forked by a test
 * inherits the list and the exit handler, and must not remove its parent's files when it
 * exits. Tests make their directories from one thread. */
static struct {
    char *path;
    pid_t owner;
} g_dirs[TMPDIR_MAX];
static int g_n_dirs;
static bool g_registered;

static int remove_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    remove(path);
    return 0; /* go on: remove whatever can be removed */
}

static void remove_all(void) {
    for (int i = 0; i < g_n_dirs; i++) {
        if (g_dirs[i].owner != getpid()) continue;
        /* A test may have mounted a file system on it (a full disk: cache_disk_test) and failed
         * before unmounting; without root or a mount this fails, harmlessly. */
        umount2(g_dirs[i].path, MNT_DETACH);
        nftw(g_dirs[i].path, remove_one, 16, FTW_DEPTH | FTW_PHYS);
        free(g_dirs[i].path);
        g_dirs[i].path = NULL;
    }
}

char *tmpdir_create(const char *prefix) {
    const char *base = getenv("TMPDIR");
    if (!base || base[0] != '/') base = "/tmp";
    cr_assert_lt(g_n_dirs, TMPDIR_MAX, "more than %d temporary directories", TMPDIR_MAX);
    char *path = NULL;
    cr_assert_geq(asprintf(&path, "%s/%sXXXXXX", base, prefix), 0, "out of memory");
    cr_assert_not_null(mkdtemp(path), "mkdtemp %s: %s", path, strerror(errno));
    char *copy = strdup(path);
    cr_assert_not_null(copy, "out of memory");
    g_dirs[g_n_dirs].path = copy;
    g_dirs[g_n_dirs].owner = getpid();
    g_n_dirs++;
    if (!g_registered) {
        cr_assert_eq(atexit(remove_all), 0, "atexit failed");
        g_registered = true;
    }
    return path;
}
