/* Child processes for the Redis tier's unit tests (cache_redis_test, cache_redis_shards_test):
 * redis-server and nutcracker (twemproxy) on free ports of 127.0.0.1, killed with SIGKILL when
 * the test process dies (PR_SET_PDEATHSIG), and a PING to wait for them. */
#ifndef KVSERVE_REDIS_FIXTURE_H
#define KVSERVE_REDIS_FIXTURE_H

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

#endif
