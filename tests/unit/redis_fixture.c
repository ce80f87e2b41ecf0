/* Child processes for the Redis tier's unit tests: see redis_fixture.h. */
#include "tests/unit/redis_fixture.h"

#include <criterion/criterion.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/unit/tmpdir.h"

int fixture_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
              getsockname(fd, (struct sockaddr *)&a, &len) == 0);
    close(fd);
    return ntohs(a.sin_port);
}

pid_t fixture_spawn(const char *const *argv) {
    pid_t parent = getpid(), pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        if (!freopen("/dev/null", "w", stdout)) _exit(1);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* One PING on a fresh connection: true when +PONG comes back within 200 ms. */
static bool ping(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct timeval tv = {.tv_usec = 200000};
    char buf[8] = {0};
    bool up = fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0 &&
              connect(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
              write(fd, "*1\r\n$4\r\nPING\r\n", 14) == 14 && read(fd, buf, 5) == 5 &&
              memcmp(buf, "+PONG", 5) == 0;
    if (fd >= 0) close(fd);
    return up;
}

bool fixture_ping_within(int port) {
    for (int i = 0; i < 500; i++) {
        if (ping(port)) return true;
        usleep(10000);
    }
    return false;
}

pid_t fixture_redis_start(int port, const char *dir) {
    if (access(REDIS_SERVER, X_OK) != 0) cr_skip_test("redis-server is not installed");
    char p[16];
    snprintf(p, sizeof p, "%d", port);
    const char *argv[] = {
        REDIS_SERVER, "--port",      p,    "--bind", "127.0.0.1", "--save", "", "--appendonly",
        "no",         "--daemonize", "no", "--dir",  dir,         NULL};
    pid_t pid = fixture_spawn(argv);
    cr_assert(fixture_ping_within(port), "redis-server did not start on port %d", port);
    return pid;
}

void fixture_kill(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

void test_redis_start(test_redis *t) {
    if (!t->port) t->port = fixture_free_port();
    if (!t->dir) t->dir = tmpdir_create("kvserve-redis-test-");
    snprintf(t->url, sizeof t->url, "redis://127.0.0.1:%d", t->port);
    t->pid = fixture_redis_start(t->port, t->dir);
}

void test_redis_stop(test_redis *t) {
    fixture_kill(t->pid);
    t->pid = -1;
}

redisContext *test_redis_connect(const test_redis *t) {
    struct timeval tv = {.tv_sec = 1};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", t->port, tv);
    if (c && c->err) {
        redisFree(c);
        return NULL;
    }
    return c;
}
