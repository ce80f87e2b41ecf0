/* A redis-server child for the unit tests (tests/unit/redis_fixture.h). */
#include "tests/unit/redis_fixture.h"

#include <criterion/criterion.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/unit/tmpdir.h"

void test_redis_stop(test_redis *t) {
    if (t->pid <= 0) return;
    kill(t->pid, SIGKILL);
    waitpid(t->pid, NULL, 0);
    t->pid = -1;
}

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
              getsockname(fd, (struct sockaddr *)&a, &len) == 0);
    close(fd);
    return ntohs(a.sin_port);
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

void test_redis_start(test_redis *t) {
    if (access(TEST_REDIS_SERVER, X_OK) != 0) cr_skip_test("redis-server is not installed");
    if (!t->port) t->port = free_port();
    if (!t->dir) t->dir = tmpdir_create("kvserve-redis-test-");
    snprintf(t->url, sizeof t->url, "redis://127.0.0.1:%d", t->port);
    char port[16];
    snprintf(port, sizeof port, "%d", t->port);
    pid_t parent = getpid();
    t->pid = fork();
    cr_assert(t->pid >= 0);
    if (t->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        if (!freopen("/dev/null", "w", stdout)) _exit(1);
        execl(TEST_REDIS_SERVER, TEST_REDIS_SERVER, "--port", port, "--bind", "127.0.0.1", "--save",
              "", "--appendonly", "no", "--daemonize", "no", "--dir", t->dir, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 500; i++) {
        redisContext *c = test_redis_connect(t);
        redisReply *rep = c ? redisCommand(c, "PING") : NULL;
        bool up = rep && rep->type == REDIS_REPLY_STATUS;
        if (rep) freeReplyObject(rep);
        if (c) redisFree(c);
        if (up) return;
        usleep(10000);
    }
    cr_assert_fail("redis-server did not start on port %d", t->port);
}
