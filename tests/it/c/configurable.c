/*
 * A plugin for the loader's tests. Built as is, it is a correct plugin for the type "c.test" that finishes every
 * task; each -D flag breaks one rule of the ABI, so the tests can check that kmqd refuses it and says why:
 *
 *   -DPLUGIN_SYMBOL=name       export the descriptor under another name (no kmq_plugin_v1)
 *   -DPLUGIN_ABI_VERSION=n     claim another ABI version
 *   -DPLUGIN_STRUCT_SIZE=n     claim a descriptor of n bytes
 *   -DPLUGIN_NO_HANDLE         leave handle NULL
 *   -DPLUGIN_NO_TYPES          claim no task types
 *   -DPLUGIN_TYPE='"t"'        claim the task type t instead of "c.test"
 *   -DPLUGIN_INIT_FAILS        fail init with a message
 *   -DPLUGIN_STATUS=n          return n from handle, whatever the task
 *   -DPLUGIN_RESULT='"{...}"'  hand this JSON on as each task's result (kmq_host.result), when the host offers it;
 *                              with -DPLUGIN_STRUCT_SIZE='offsetof(kmq_plugin, host)' the descriptor has the shape
 *                              of a plugin built before kmq_host, so no host ever offers it
 *   -DPLUGIN_TRACE_RESULT      hand on as each task's result the trace context the host gives it,
 *                              ["TRACEPARENT", "TRACESTATE"] (kmq_host.traceparent and .tracestate)
 */
#include <stdio.h>
#include <string.h>

#include "kmq_plugin.h"

#ifndef PLUGIN_SYMBOL
#define PLUGIN_SYMBOL kmq_plugin_v1
#endif
#ifndef PLUGIN_ABI_VERSION
#define PLUGIN_ABI_VERSION KMQ_ABI_VERSION
#endif
#ifndef PLUGIN_STRUCT_SIZE
#define PLUGIN_STRUCT_SIZE sizeof(kmq_plugin)
#endif
#ifndef PLUGIN_TYPE
#define PLUGIN_TYPE "c.test"
#endif
#ifndef PLUGIN_STATUS
#define PLUGIN_STATUS KMQ_DONE
#endif

#ifdef PLUGIN_NO_TYPES
static const char *const TYPES[] = {NULL};
#else
static const char *const TYPES[] = {PLUGIN_TYPE, NULL};
#endif

static void *init(kmq_str config, kmq_buf *err) {
    static int state;
    (void)config;
#ifdef PLUGIN_INIT_FAILS
    static const char message[] = "cannot reach the license server at 10.0.0.1:7000";
    size_t n = sizeof message - 1 < err->cap ? sizeof message - 1 : err->cap;
    memcpy(err->ptr, message, n);
    err->len = n;
    (void)state;
    return NULL;
#else
    (void)err;
    return &state;
#endif
}

#if defined(PLUGIN_RESULT) || defined(PLUGIN_TRACE_RESULT)
#define PLUGIN_HOST
/* What the host offers; set once, before the first init. */
static const kmq_host *host;
static void on_host(const kmq_host *offer) { host = offer; }
#endif

#ifndef PLUGIN_NO_HANDLE
static kmq_status handle(void *state, const kmq_task *task, kmq_buf *msg) {
    (void)state;
    (void)task;
    (void)msg;
#ifdef PLUGIN_RESULT
    static const char json[] = PLUGIN_RESULT;
    if (host && host->struct_size >= offsetof(kmq_host, result) + sizeof host->result && host->result)
        host->result(task->run, (kmq_str){(const uint8_t *)json, sizeof json - 1});
#endif
#ifdef PLUGIN_TRACE_RESULT
    /* Both functions were appended together: a host whose offer covers the second has both. */
    if (host && host->struct_size >= offsetof(kmq_host, tracestate) + sizeof host->tracestate && host->result) {
        kmq_str parent = host->traceparent(task->run), state = host->tracestate(task->run);
        char json[1024];
        int len = snprintf(json, sizeof json, "[\"%.*s\", \"%.*s\"]", (int)parent.len, (const char *)parent.ptr,
                           (int)state.len, (const char *)state.ptr);
        if (len > 0 && (size_t)len < sizeof json)
            host->result(task->run, (kmq_str){(const uint8_t *)json, (size_t)len});
    }
#endif
    return (kmq_status)PLUGIN_STATUS;
}
#endif

static const kmq_plugin PLUGIN = {
    .abi_version = PLUGIN_ABI_VERSION,
    .struct_size = PLUGIN_STRUCT_SIZE,
    .name = "configurable",
    .types = TYPES,
    .init = init,
#ifdef PLUGIN_NO_HANDLE
    .handle = NULL,
#else
    .handle = handle,
#endif
    .on_dead = NULL,
    .shutdown = NULL,
#ifdef PLUGIN_HOST
    .host = on_host,
#endif
};

const kmq_plugin *PLUGIN_SYMBOL(void);

const kmq_plugin *PLUGIN_SYMBOL(void) {
    return &PLUGIN;
}
