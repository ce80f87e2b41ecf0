/* The CPU backend's thread pool: see cpu.h. */
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdlib.h>

#include "kernels/cpu/cpu.h"

/* Spin iterations before a worker sleeps: long enough to bridge the gaps between the ops of one
 * forward pass (sampling, small serial steps), short enough not to burn a core when idle. */
#define THREADPOOL_SPIN 200000

struct threadpool {
    int n_threads;
    pthread_t *threads;
    threadpool_fn fn;
    void *ctx;
    _Atomic uint64_t generation; /* bumped once per job */
    _Atomic int pending;         /* workers still running the current job */
    _Atomic int n_sleeping;
    _Atomic bool stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

typedef struct worker_arg {
    threadpool *tp;
    int ith;
} worker_arg;

/* Spin-waits yield the core every YIELD_EVERY iterations: when more threads are runnable than
 * there are cores (other processes, HTTP threads), a waiter that only spins can hold the core
 * the thread it waits for needs, and a step that takes microseconds takes a time slice. */
#define YIELD_EVERY 1024

static inline void cpu_relax(void) { __builtin_ia32_pause(); }

static inline void spin_wait(int *spins) {
    if ((++*spins & (YIELD_EVERY - 1)) == 0)
        sched_yield();
    else
        cpu_relax();
}

static void *threadpool_worker(void *p) {
    worker_arg arg = *(worker_arg *)p;
    free(p);
    threadpool *tp = arg.tp;
    uint64_t seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load(&tp->generation) == seen && !atomic_load(&tp->stop)) {
            if (spins < THREADPOOL_SPIN) {
                spin_wait(&spins);
                continue;
            }
            /* seq_cst on n_sleeping and generation: either the producer sees us sleeping and
             * broadcasts under the mutex, or we see its new generation before waiting. */
            pthread_mutex_lock(&tp->mu);
            atomic_fetch_add(&tp->n_sleeping, 1);
            while (atomic_load(&tp->generation) == seen && !atomic_load(&tp->stop))
                pthread_cond_wait(&tp->cv, &tp->mu);
            atomic_fetch_sub(&tp->n_sleeping, 1);
            pthread_mutex_unlock(&tp->mu);
        }
        if (atomic_load(&tp->stop)) return NULL;
        seen = atomic_load(&tp->generation);
        tp->fn(tp->ctx, arg.ith, tp->n_threads);
        atomic_fetch_sub_explicit(&tp->pending, 1, memory_order_release);
    }
}

threadpool *threadpool_create(int n_threads, kv_error *err) {
    if (n_threads < 1 || n_threads > 256) {
        kv_fail(err, "threads must be between 1 and 256, got %d", n_threads);
        return NULL;
    }
    threadpool *tp = calloc(1, sizeof *tp);
    if (!tp) goto oom;
    tp->n_threads = n_threads;
    pthread_mutex_init(&tp->mu, NULL);
    pthread_cond_init(&tp->cv, NULL);
    tp->threads = calloc((size_t)n_threads, sizeof *tp->threads);
    if (!tp->threads) goto oom;
    for (int i = 1; i < n_threads; i++) {
        worker_arg *a = malloc(sizeof *a);
        if (!a) goto oom;
        a->tp = tp;
        a->ith = i;
        if (pthread_create(&tp->threads[i], NULL, threadpool_worker, a) != 0) {
            free(a);
            tp->n_threads = i; /* join only the ones started */
            threadpool_destroy(tp);
            kv_fail(err, "could not start worker thread %d", i);
            return NULL;
        }
    }
    return tp;
oom:
    if (tp) {
        free(tp->threads);
        free(tp);
    }
    kv_fail(err, "out of memory creating the thread pool");
    return NULL;
}

void threadpool_destroy(threadpool *tp) {
    if (!tp) return;
    pthread_mutex_lock(&tp->mu);
    atomic_store(&tp->stop, true);
    pthread_cond_broadcast(&tp->cv);
    pthread_mutex_unlock(&tp->mu);
    for (int i = 1; i < tp->n_threads; i++) pthread_join(tp->threads[i], NULL);
    pthread_mutex_destroy(&tp->mu);
    pthread_cond_destroy(&tp->cv);
    free(tp->threads);
    free(tp);
}

int threadpool_size(const threadpool *tp) { return tp->n_threads; }

void threadpool_run(threadpool *tp, threadpool_fn fn, void *ctx) {
    if (tp->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    tp->fn = fn;
    tp->ctx = ctx;
    atomic_store(&tp->pending, tp->n_threads - 1);
    atomic_fetch_add(&tp->generation, 1);
    if (atomic_load(&tp->n_sleeping) > 0) {
        pthread_mutex_lock(&tp->mu);
        pthread_cond_broadcast(&tp->cv);
        pthread_mutex_unlock(&tp->mu);
    }
    fn(ctx, 0, tp->n_threads);
    int spins = 0;
    while (atomic_load_explicit(&tp->pending, memory_order_acquire) > 0) spin_wait(&spins);
}
