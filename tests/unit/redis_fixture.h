/* A real redis-server for the unit tests of the Redis tier and the shared state: started on a
 * free port of 127.0.0.1 (no RDB or AOF files, its directory a tmpdir_create one), killed by
 * test_redis_stop, and by the kernel when the test process dies. test_redis_start skips the
 * test, saying so, where redis-server is not installed. */
#ifndef KVSERVE_TEST_REDIS_FIXTURE_H
#define KVSERVE_TEST_REDIS_FIXTURE_H

#include <hiredis/hiredis.h>
#include <sys/types.h>

#define TEST_REDIS_SERVER "/usr/bin/redis-server"

typedef struct test_redis {
    pid_t pid; /* -1: not running */
    int port;  /* 0: a free one at the first start, kept by restarts */
    char *dir;
    char url[64];
} test_redis;

/* Starts redis-server on t->port and waits until it answers PING. */
void test_redis_start(test_redis *t);
/* SIGKILL, as a crash would. */
void test_redis_stop(test_redis *t);
/* A plain hiredis connection to it (1 s timeout), or NULL. */
redisContext *test_redis_connect(const test_redis *t);

#endif
