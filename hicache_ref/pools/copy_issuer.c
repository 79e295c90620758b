/* A native thread that issues copy-engine batches off the caller's thread (copy_issuer.py).
 *
 * The CUDA runtime spends ~0.46 us of CPU per copy inside cudaMemcpyBatchAsync (512 page
 * copies: ~240 us), on whatever thread calls it. Here the caller only enqueues two stream
 * memory operations on its own stream and a queue entry:
 *
 *   caller stream S:  ... | write(ready, seq) | wait(done >= seq) | ...
 *   side stream:            wait(ready >= seq) | batch of copies  | write(done, seq)
 *
 * so S's later work runs after the copies, and the copies after S's earlier work: the same
 * order as a batch issued on S itself. A stepped entry (hc_issue_stepped) of n batches gives S
 * the ready write alone and writes done after each batch; S then waits batch by batch
 * (hc_wait, or hc_wait_record: every wait and each layer's event records in one call), so the batches follow each other on the side stream with no round trip through S. The thread holds no Python lock, so a caller blocked
 * on the GPU while holding Python's GIL cannot stall it.
 *
 * Function pointers (the runtime's batch call, the driver's cuStreamWaitValue64_v2,
 * cuStreamWriteValue64_v2 and, where present, cuStreamBatchMemOp_v2, which enqueues the
 * caller's two operations in one driver call) are handed in by Python, so this file links against nothing but
 * pthreads. A failed call is remembered (first error wins) and the done value is still
 * written, so S never waits forever; Python raises it at the next issue or check.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*batch13_fn)(const void *, const void *, const void *, size_t, void *, void *,
                          size_t, void *);
typedef int (*batch12_fn)(const void *, const void *, const void *, size_t, void *, void *,
                          size_t, size_t *, void *);
typedef int (*value_fn)(void *, uint64_t, uint64_t, unsigned int);
typedef int (*memops_fn)(void *, unsigned int, void *, unsigned int);
typedef int (*record_fn)(void *, void *);

/* CUstreamBatchMemOpParams: a 48-byte union; the wait and write members are laid out as
 * operation (4 bytes + 4 padding), address, value64, flags (4 + 4), alias, then padding. */
#define HC_MEMOP_WORDS 6
#define HC_WAIT_VALUE_64 4
#define HC_WRITE_VALUE_64 5

typedef struct {
    const void *dsts, *srcs, *sizes;
    size_t count;
    void *attrs;
    uint64_t seq;
    size_t repeat; /* batches: the arrays of batch k start k * stride bytes further */
    size_t stride;
    int stepped; /* 1: batch k writes done = seq + k (hc_issue_stepped); 0: done = seq once */
} hc_item;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    pthread_t thread;
    hc_item *ring;
    size_t capacity, head, used;
    int stop, busy;
    void *batch, *wait, *write, *side, *memops;
    int runtime13;
    uint64_t ready, done, seq;
    size_t attr_index;
    int error, error_stage; /* stage: 1 side wait, 2 batch, 3 done write, 4 caller ops */
    uint64_t issued;
} hc_issuer;

static void remember(hc_issuer *q, int code, int stage) {
    if (code != 0 && q->error == 0) {
        q->error = code;
        q->error_stage = stage;
    }
}

static void *run(void *arg) {
    hc_issuer *q = (hc_issuer *)arg;
    for (;;) {
        pthread_mutex_lock(&q->lock);
        while (q->used == 0 && !q->stop) pthread_cond_wait(&q->changed, &q->lock);
        if (q->used == 0 && q->stop) {
            pthread_mutex_unlock(&q->lock);
            return NULL;
        }
        hc_item item = q->ring[q->head];
        q->busy = 1;
        pthread_mutex_unlock(&q->lock);

        value_fn wait = (value_fn)q->wait, write = (value_fn)q->write;
        int code = wait(q->side, q->ready, item.seq, 0 /* GEQ */);
        int stage = 1;
        int written = 0;
        for (size_t k = 0; code == 0 && k < item.repeat; k++) {
            const char *d = (const char *)item.dsts + k * item.stride;
            const char *s = (const char *)item.srcs + k * item.stride;
            stage = 2;
            if (q->runtime13) {
                code = ((batch13_fn)q->batch)(d, s, item.sizes, item.count, item.attrs,
                                              &q->attr_index, 1, q->side);
            } else {
                size_t fail = 0;
                code = ((batch12_fn)q->batch)(d, s, item.sizes, item.count, item.attrs,
                                              &q->attr_index, 1, &fail, q->side);
            }
            if (code == 0 && item.stepped && k + 1 < item.repeat) {
                /* batch k landed before this write runs: the caller may go on past seq + k */
                written = write(q->side, q->done, item.seq + k, 0);
                if (written != 0) break;
            }
        }
        /* the last value, even after a failure: the caller's stream never waits forever */
        uint64_t last = item.stepped ? item.seq + item.repeat - 1 : item.seq;
        int final = write(q->side, q->done, last, 0);
        if (written == 0) written = final;

        pthread_mutex_lock(&q->lock);
        remember(q, code, stage);
        remember(q, written, 3);
        q->head = (q->head + 1) % q->capacity;
        q->used -= 1;
        q->busy = 0;
        q->issued += 1;
        pthread_cond_broadcast(&q->changed);
        pthread_mutex_unlock(&q->lock);
    }
}

hc_issuer *hc_create(void *batch, int runtime13, void *wait, void *write, void *side,
                     uint64_t ready, uint64_t done, size_t capacity, void *memops) {
    hc_issuer *q = (hc_issuer *)calloc(1, sizeof(hc_issuer));
    if (q == NULL) return NULL;
    q->ring = (hc_item *)calloc(capacity, sizeof(hc_item));
    if (q->ring == NULL) {
        free(q);
        return NULL;
    }
    q->capacity = capacity;
    q->batch = batch;
    q->runtime13 = runtime13;
    q->wait = wait;
    q->write = write;
    q->side = side;
    q->memops = memops;
    q->ready = ready;
    q->done = done;
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->changed, NULL);
    if (pthread_create(&q->thread, NULL, run, q) != 0) {
        free(q->ring);
        free(q);
        return NULL;
    }
    return q;
}

/* Enqueue `repeat` batches of `count` copies (batch k's destination and source arrays start
 * k * stride bytes further; one sizes array for all); the arrays must stay valid until the thread has issued it (Python keeps
 * them alive with the plan). Returns 0, or the first remembered error (nothing enqueued). */
static int enqueue(hc_issuer *q, void *caller_stream, const void *dsts, const void *srcs,
                   const void *sizes, size_t count, void *attrs, size_t repeat, size_t stride,
                   int stepped, uint64_t *first) {
    pthread_mutex_lock(&q->lock); /* held throughout: one caller's stream ops, in order */
    int error = q->error;
    if (error != 0) {
        pthread_mutex_unlock(&q->lock);
        return error;
    }
    while (q->used == q->capacity) pthread_cond_wait(&q->changed, &q->lock);
    uint64_t seq = q->seq + 1;
    int code;
    if (stepped) {
        /* the caller waits batch by batch itself (hc_wait): only the ready write here */
        code = ((value_fn)q->write)(caller_stream, q->ready, seq, 0);
    } else if (q->memops != NULL) {
        uint64_t ops[2 * HC_MEMOP_WORDS] = {0};
        ops[0] = HC_WRITE_VALUE_64;
        ops[1] = q->ready;
        ops[2] = seq;
        ops[HC_MEMOP_WORDS + 0] = HC_WAIT_VALUE_64;
        ops[HC_MEMOP_WORDS + 1] = q->done;
        ops[HC_MEMOP_WORDS + 2] = seq; /* flags word stays 0: CU_STREAM_WAIT_VALUE_GEQ */
        code = ((memops_fn)q->memops)(caller_stream, 2, ops, 0);
    } else {
        value_fn wait = (value_fn)q->wait, write = (value_fn)q->write;
        code = write(caller_stream, q->ready, seq, 0);
        if (code == 0) code = wait(caller_stream, q->done, seq, 0 /* GEQ */);
    }
    if (code != 0) {
        /* the side stream would wait on a ready value that never comes: issue nothing */
        remember(q, code, 4);
        pthread_mutex_unlock(&q->lock);
        return code;
    }
    q->seq = stepped ? seq + repeat - 1 : seq;
    *first = seq;
    hc_item *slot = &q->ring[(q->head + q->used) % q->capacity];
    slot->dsts = dsts;
    slot->srcs = srcs;
    slot->sizes = sizes;
    slot->count = count;
    slot->attrs = attrs;
    slot->seq = seq;
    slot->repeat = repeat;
    slot->stride = stride;
    slot->stepped = stepped;
    q->used += 1;
    pthread_cond_broadcast(&q->changed);
    pthread_mutex_unlock(&q->lock);
    return 0;
}

int hc_issue(hc_issuer *q, void *caller_stream, const void *dsts, const void *srcs,
             const void *sizes, size_t count, void *attrs, size_t repeat, size_t stride) {
    uint64_t first = 0;
    return enqueue(q, caller_stream, dsts, srcs, sizes, count, attrs, repeat, stride, 0, &first);
}

/* Enqueue `repeat` batches as hc_issue does, but stepped: the caller's stream gets only the
 * ready write, and batch k writes done = first + k as soon as it is issued behind the previous
 * one, so the side stream runs the batches back to back (no round trip through the caller's
 * stream between two of them). The caller then orders its stream after batch k with
 * hc_wait(first + k), in k order, and must wait for the last one before any work that may
 * depend on the copies. Returns first (> 0), or 0 with the error in *error. */
uint64_t hc_issue_stepped(hc_issuer *q, void *caller_stream, const void *dsts, const void *srcs,
                          const void *sizes, size_t count, void *attrs, size_t repeat,
                          size_t stride, int *error) {
    uint64_t first = 0;
    *error = enqueue(q, caller_stream, dsts, srcs, sizes, count, attrs, repeat, stride, 1,
                     &first);
    return *error == 0 ? first : 0;
}

/* Order the caller's stream after the batch whose done value is `value` (hc_issue_stepped). */
int hc_wait(hc_issuer *q, void *caller_stream, uint64_t value) {
    int code = ((value_fn)q->wait)(caller_stream, q->done, value, 0 /* GEQ */);
    if (code != 0) {
        pthread_mutex_lock(&q->lock);
        remember(q, code, 4);
        pthread_mutex_unlock(&q->lock);
    }
    return code;
}

/* hc_wait for each of the batches first .. first + steps - 1 in turn, each followed by the
 * records of its step's events on the caller's stream: events[k * per_step + j] (j < per_step,
 * NULL entries skipped) after batch first + k, with `record` (cuEventRecord's signature). One
 * call for a whole stepped load: the caller's thread pays two driver calls per layer and no
 * Python. After a failure the last batch's wait is still queued (no later work on the caller's
 * stream may pass the copies) and the first error is returned and remembered (stage 4). */
int hc_wait_record(hc_issuer *q, void *caller_stream, uint64_t first, size_t steps,
                   void *const *events, size_t per_step, void *record) {
    value_fn wait = (value_fn)q->wait;
    record_fn rec = (record_fn)record;
    int code = 0;
    size_t k = 0;
    for (; code == 0 && k < steps; k++) {
        code = wait(caller_stream, q->done, first + k, 0 /* GEQ */);
        for (size_t j = 0; code == 0 && j < per_step; j++) {
            void *event = events[k * per_step + j];
            if (event != NULL) code = rec(event, caller_stream);
        }
    }
    if (code != 0) {
        if (steps > 0 && k < steps) wait(caller_stream, q->done, first + steps - 1, 0);
        pthread_mutex_lock(&q->lock);
        remember(q, code, 4);
        pthread_mutex_unlock(&q->lock);
    }
    return code;
}

/* Block until every enqueued batch has been issued (not completed on the GPU). */
void hc_drain(hc_issuer *q) {
    pthread_mutex_lock(&q->lock);
    while (q->used != 0 || q->busy) pthread_cond_wait(&q->changed, &q->lock);
    pthread_mutex_unlock(&q->lock);
}

int hc_error(hc_issuer *q, int *stage) {
    pthread_mutex_lock(&q->lock);
    int error = q->error;
    *stage = q->error_stage;
    pthread_mutex_unlock(&q->lock);
    return error;
}

uint64_t hc_issued(hc_issuer *q) {
    pthread_mutex_lock(&q->lock);
    uint64_t issued = q->issued;
    pthread_mutex_unlock(&q->lock);
    return issued;
}

void hc_destroy(hc_issuer *q) {
    pthread_mutex_lock(&q->lock);
    q->stop = 1;
    pthread_cond_broadcast(&q->changed);
    pthread_mutex_unlock(&q->lock);
    pthread_join(q->thread, NULL);
    pthread_mutex_destroy(&q->lock);
    pthread_cond_destroy(&q->changed);
    free(q->ring);
    free(q);
}

/* CPU stand-ins with the same signatures, for tests without a GPU: a "stream" is ignored,
 * a wait spins on the value, a write stores it, a batch is one memmove per copy. */
int hc_cpu_batch(const void *dsts, const void *srcs, const void *sizes, size_t count,
                 void *attrs, void *attr_index, size_t num_attrs, void *stream) {
    (void)attrs;
    (void)attr_index;
    (void)num_attrs;
    (void)stream;
    const uint64_t *d = (const uint64_t *)dsts, *s = (const uint64_t *)srcs,
                   *n = (const uint64_t *)sizes;
    for (size_t i = 0; i < count; i++) memmove((void *)d[i], (const void *)s[i], n[i]);
    return 0;
}

static uint64_t hc_cpu_caller_waited; /* the value of the last wait on a caller's stream */

int hc_cpu_wait(void *stream, uint64_t addr, uint64_t value, unsigned int flags) {
    (void)flags;
    if (stream != NULL) { /* the caller's stream: a GPU would wait, the CPU must not */
        __atomic_store_n(&hc_cpu_caller_waited, value, __ATOMIC_RELEASE);
        return 0;
    }
    while ((int64_t)(__atomic_load_n((uint64_t *)addr, __ATOMIC_ACQUIRE) - value) < 0) {
    }
    return 0;
}

int hc_cpu_write(void *stream, uint64_t addr, uint64_t value, unsigned int flags) {
    (void)stream;
    (void)flags;
    __atomic_store_n((uint64_t *)addr, value, __ATOMIC_RELEASE);
    return 0;
}

int hc_cpu_memops(void *stream, unsigned int count, void *params, unsigned int flags) {
    (void)flags;
    uint64_t *op = (uint64_t *)params;
    for (unsigned int i = 0; i < count; i++, op += HC_MEMOP_WORDS) {
        int code = (uint32_t)op[0] == HC_WRITE_VALUE_64 ? hc_cpu_write(stream, op[1], op[2], 0)
                                                         : hc_cpu_wait(stream, op[1], op[2], 0);
        if (code != 0) return code;
    }
    return 0;
}

int hc_cpu_fail(const void *dsts, const void *srcs, const void *sizes, size_t count,
                void *attrs, void *attr_index, size_t num_attrs, void *stream) {
    (void)dsts;
    (void)srcs;
    (void)sizes;
    (void)count;
    (void)attrs;
    (void)attr_index;
    (void)num_attrs;
    (void)stream;
    return 1; /* cudaErrorInvalidValue */
}

/* An event "record": the event is a uint64 word, and gets the value the caller's stream last
 * waited for (so a test sees which batch each event was recorded after). */
int hc_cpu_record(void *event, void *stream) {
    (void)stream;
    *(uint64_t *)event = __atomic_load_n(&hc_cpu_caller_waited, __ATOMIC_ACQUIRE);
    return 0;
}

uint64_t hc_cpu_last_caller_wait(void) {
    return __atomic_load_n(&hc_cpu_caller_waited, __ATOMIC_ACQUIRE);
}

int hc_cpu_record_fail(void *event, void *stream) {
    (void)event;
    (void)stream;
    return 400; /* CUDA_ERROR_INVALID_HANDLE */
}
