/* Child processes for the unit tests of the Redis tier and the shared state (cache_redis_test,
 * redis_state_test): redis-server and nutcracker (twemproxy) on free ports of 127.0.0.1, killed
 * with SIGKILL when the test process dies (PR_SET_PDEATHSIG), and a PING to wait for them.
 * test_redis is one redis-server that restarts on its port (no RDB or AOF files, its directory
 * a tmpdir_create one); starting one skips the test, saying so, where redis-server is not
 * installed. */
#ifndef KVSERVE_REDIS_FIXTURE_H
#define KVSERVE_REDIS_FIXTURE_H

#include <hiredis/hiredis.h>
#include <stdbool.h>
#include <sys/types.h>

#define REDIS_SERVER "/usr/bin/redis-server"
#define NUTCRACKER "/usr/sbin/nutcracker"

/* A free TCP port of 127.0.0.1 (free when asked: a child binds it right after). */
int fixture_free_port(void);
/* Runs argv[0] with argv (NULL-terminated) as a child, stdout to /dev/null; its pid. */
pid_t fixture_spawn(const char *const *argv);
/* A redis-server without persistence on port, its files in dir; waits until it answers. */
pid_t fixture_redis_start(int port, const char *dir);
/* Waits up to 5 s until 127.0.0.1:port answers PING (RESP, as nutcracker needs); false if not. */
bool fixture_ping_within(int port);
/* SIGKILL and reaps pid (nothing when pid <= 0). */
void fixture_kill(pid_t pid);

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
