/* Temporary directories for the unit tests, removed with everything in them when the process
 * that made them exits. Criterion runs each test in a process of its own, which exits through
 * exit() after a failed assertion or a skip as after a pass, so an exit handler cleans up in
 * every case but a crash. */
#ifndef KVSERVE_TMPDIR_H
#define KVSERVE_TMPDIR_H

/* Makes a new directory $TMPDIR/<prefix>XXXXXX ($TMPDIR or /tmp) and registers it for removal at
 * exit; the test fails when it cannot be made. Returns its path, malloc'd: the caller's to free.
 * The test may remove the directory itself first. */
char *tmpdir_create(const char *prefix);

#endif
