/* The encoders' background thread (cache/store/worker.h). */
#include "cache/store/worker.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#define WORKER_NICE 10 /* below the engine's threads */

typedef struct worker_item {
    cache_chunk *c;
    uint64_t tag;
} worker_item;

struct chunk_worker {
    chunk_work_fn fn;
    void (*first)(void *ud);
    void *ud;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    worker_item *q; /* ring [cap] */
    int cap, head, len;
    bool busy; /* fn is running */
    bool stop;
};

static void *worker_thread(void *arg) {
    chunk_worker *w = arg;
    if (setpriority(PRIO_PROCESS, (id_t)gettid(), WORKER_NICE) != 0)
        log_debug("cache: encoder: cannot lower its priority: %s", strerror(errno));
    if (w->first) w->first(w->ud);
    pthread_mutex_lock(&w->mu);
    for (;;) {
        if (w->len && !w->stop) {
            worker_item it = w->q[w->head];
            w->head = (w->head + 1) % w->cap;
            w->len--;
            w->busy = true;
            pthread_mutex_unlock(&w->mu);
            w->fn(w->ud, it.c, it.tag);
            cache_chunk_unref(it.c);
            pthread_mutex_lock(&w->mu);
            w->busy = false;
            pthread_cond_broadcast(&w->idle);
        } else if (w->stop) {
            break;
        } else {
            pthread_cond_wait(&w->work, &w->mu);
        }
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

chunk_worker *chunk_worker_start(int cap, chunk_work_fn fn, void (*first)(void *ud), void *ud,
                                 kv_error *err) {
    chunk_worker *w = calloc(1, sizeof *w);
    if (w) w->q = calloc(cap > 0 ? (size_t)cap : 1, sizeof *w->q);
    if (!w || !w->q) {
        if (w) free(w);
        kv_fail(err, "out of memory");
        return NULL;
    }
    w->fn = fn;
    w->first = first;
    w->ud = ud;
    w->cap = cap > 0 ? cap : 1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->work, NULL);
    pthread_cond_init(&w->idle, NULL);
    if (pthread_create(&w->thread, NULL, worker_thread, w) != 0) {
        kv_fail(err, "cannot start an encoder thread");
        pthread_cond_destroy(&w->idle);
        pthread_cond_destroy(&w->work);
        pthread_mutex_destroy(&w->mu);
        free(w->q);
        free(w);
        return NULL;
    }
    return w;
}

bool chunk_worker_queue(chunk_worker *w, cache_chunk *c, uint64_t tag) {
    pthread_mutex_lock(&w->mu);
    bool ok = w->len < w->cap && !w->stop;
    if (ok) {
        cache_chunk_ref(c);
        w->q[(w->head + w->len) % w->cap] = (worker_item){c, tag};
        w->len++;
        pthread_cond_signal(&w->work);
    }
    pthread_mutex_unlock(&w->mu);
    return ok;
}

void chunk_worker_flush(chunk_worker *w) {
    pthread_mutex_lock(&w->mu);
    while (w->len || w->busy) pthread_cond_wait(&w->idle, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

void chunk_worker_stop(chunk_worker *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    /* what was not begun is not done */
    for (; w->len; w->len--, w->head = (w->head + 1) % w->cap) cache_chunk_unref(w->q[w->head].c);
    pthread_cond_broadcast(&w->work);
    pthread_cond_broadcast(&w->idle);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->idle);
    pthread_cond_destroy(&w->work);
    pthread_mutex_destroy(&w->mu);
    free(w->q);
    free(w);
}
