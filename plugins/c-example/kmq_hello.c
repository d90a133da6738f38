/*
 * kmq_hello: a kmqd handler plugin in C, using nothing but kmq_plugin.h and the C library.
 *
 * It handles the task type "hello" and reads the task's data (JSON text) as a command:
 *   "fail"    the task can never succeed: KMQ_FAIL, dead-lettered at once;
 *   "retry"   this attempt failed: KMQ_RETRY, asking for the next attempt in 20 ms;
 *   "wait"    runs until the host raises the cancel flag (execution timeout, end of the shutdown grace);
 *   null      (no data) refused as KMQ_FAIL;
 *   anything else is greeted on standard error: KMQ_DONE.
 * Dead-lettered tasks are reported on standard error (on_dead); shutdown reports how many tasks it handled.
 *
 * It takes no config: init refuses anything but an empty table, so a typo in the config fails at start.
 *
 * Build: cc -shared -fPIC -O2 -std=c11 -Wall -Wextra -I../include -o libkmq_hello.so kmq_hello.c
 */
#define _POSIX_C_SOURCE 200809L

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kmq_plugin.h"

/* The state init returns. handle runs on many threads at once, so the counter is atomic. */
struct hello {
    atomic_ulong handled;
};

static const char *const TYPES[] = {"hello", NULL};

/* Copies as much of text as fits into a host buffer: never more than cap bytes. */
static void set_message(kmq_buf *buf, const char *text) {
    size_t n = strlen(text);
    if (n > buf->cap) {
        n = buf->cap;
    }
    memcpy(buf->ptr, text, n);
    buf->len = n;
}

/* Whether a kmq_str (not NUL-terminated) equals text. */
static int equals(kmq_str s, const char *text) {
    size_t n = strlen(text);
    return s.len == n && memcmp(s.ptr, text, n) == 0;
}

static void *hello_init(kmq_str config, kmq_buf *err) {
    if (!equals(config, "{}")) {
        set_message(err, "kmq_hello takes no config: remove the config table of its [plugins.NAME] section");
        return NULL;
    }
    struct hello *state = malloc(sizeof *state);
    if (state == NULL) {
        set_message(err, "kmq_hello: out of memory");
        return NULL;
    }
    atomic_init(&state->handled, 0);
    return state;
}

static kmq_status hello_handle(void *state, const kmq_task *task, kmq_buf *msg) {
    struct hello *hello = state;
    atomic_fetch_add(&hello->handled, 1);
    if (equals(task->data, "null")) {
        set_message(msg, "hello: no data, nobody to greet");
        return KMQ_FAIL;
    }
    if (equals(task->data, "\"fail\"")) {
        set_message(msg, "hello: asked to fail");
        return KMQ_FAIL;
    }
    if (equals(task->data, "\"retry\"")) {
        *task->retry_after_ms = 20;
        set_message(msg, "hello: asked to retry");
        return KMQ_RETRY;
    }
    if (equals(task->data, "\"wait\"")) {
        /* A long handler checks the cancel flag between steps; the host writes it from another thread. */
        const struct timespec step = {0, 1000000};
        while (*task->cancel == 0) {
            nanosleep(&step, NULL);
        }
        set_message(msg, "hello: cancelled");
        return KMQ_RETRY;
    }
    /* One fprintf per line: lines of concurrent tasks do not interleave. %.*s prints a kmq_str. */
    fprintf(stderr, "kmq_hello: hello, %.*s! (task %.*s, attempt %u)\n", (int)task->data.len,
            (const char *)task->data.ptr, (int)task->id.len, (const char *)task->id.ptr, task->attempt);
    return KMQ_DONE;
}

static void hello_on_dead(void *state, const kmq_task *task, kmq_str reason) {
    (void)state;
    fprintf(stderr, "kmq_hello: task %.*s is dead: %.*s\n", (int)task->id.len, (const char *)task->id.ptr,
            (int)reason.len, (const char *)reason.ptr);
}

static void hello_shutdown(void *state) {
    struct hello *hello = state;
    fprintf(stderr, "kmq_hello: handled %lu tasks\n", atomic_load(&hello->handled));
    free(hello);
}

static const kmq_plugin PLUGIN = {
    .abi_version = KMQ_ABI_VERSION,
    .struct_size = sizeof(kmq_plugin),
    .name = "hello",
    .types = TYPES,
    .init = hello_init,
    .handle = hello_handle,
    .on_dead = hello_on_dead,
    .shutdown = hello_shutdown,
};

const kmq_plugin *kmq_plugin_v1(void) {
    return &PLUGIN;
}
