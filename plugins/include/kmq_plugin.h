/*
 * kmq_plugin.h: the kmqd handler-plugin ABI, version 1.
 *
 * This header is the source of truth for the ABI. A plugin is a shared library (.so) that exports one symbol,
 * `kmq_plugin_v1`, returning a pointer to a `kmq_plugin` descriptor that lives as long as the library.
 *
 * Rules of the boundary:
 *   - Everything that crosses it is C. No unwinding crosses it: a C++ or Rust plugin catches its own exceptions
 *     and panics (the Rust SDK does this for you).
 *   - The host owns every buffer it passes in; a plugin copies what it keeps past the call. Nothing allocated on
 *     one side is freed on the other.
 *   - `handle` is called from many threads at once and must be thread-safe.
 *   - The host reads `abi_version` before anything else and refuses any version but KMQ_ABI_VERSION. It then reads
 *     only the fields that `struct_size` covers, so fields added later within v1 go at the end of `kmq_plugin`.
 *     An incompatible change is a new symbol, `kmq_plugin_v2`.
 *   - The host never unloads a plugin (no dlclose): threads and thread-locals of the plugin may outlive a call.
 *   - One file may be named by several [plugins.NAME] sections: the library is loaded once, and `init` runs once
 *     per section, with that section's config, one call after another (never two at once). Each call returns a
 *     state of its own, which the host passes back to that instance's calls only; the host reads `types` right
 *     after each `init` returns, before the next one. Keep per-instance data in the state, not in globals. A type
 *     claimed by two sections is refused, as one claimed by two plugins is.
 *   - A reload may load a new version of the file (a new inode at the same path) while the old one still runs
 *     tasks: two instances, each loaded as its own library (its own globals), each with its own init and state.
 *     The old one's shutdown runs once its last call returned, on whichever host thread made that call. A
 *     section kept (same file, same section name) keeps its instance; a section added is one more `init`.
 *   - A plugin that runs tasks elsewhere (other processes, an event loop) may set `start`: the host then hands it
 *     a task and goes on, and the plugin reports the outcome later through the `complete` callback, so that no
 *     host thread waits per task in flight. A plugin without `start` (or whose `start` declines) is called
 *     through `handle`, as before; both count against the queue's `workers`, the most tasks run at once.
 */
#ifndef KMQ_PLUGIN_H
#define KMQ_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KMQ_ABI_VERSION 1

/* A UTF-8 string that is not NUL-terminated. Valid only during the call it is passed to. */
typedef struct {
    const uint8_t *ptr;
    size_t len;
} kmq_str;

/* One run (attempt) of a task. Every pointer is valid only during the call it is passed to. */
typedef struct {
    kmq_str id;                          /* the task id: stable across retries */
    kmq_str queue;                       /* the queue name from the config */
    kmq_str type;                        /* the task type that selected this plugin */
    kmq_str data;                        /* the task's `data` as JSON text ("null" when the producer gave none) */
    uint32_t attempt;                    /* 0 on the first run, 1 on the first retry, ... */
    int64_t created_at_ms;               /* when the task was enqueued, ms since the epoch on Redis's clock (0: unknown) */
    int64_t deadline_ms;                 /* when the execution timeout ends, ms since the epoch on Redis's clock (0: none) */
    /* Becomes non-zero when the host wants the handler to stop early: the execution timeout passed, or the daemon
     * is stopping and its shutdown grace ran out. Written by another thread; the plugin only reads it. */
    const volatile uint32_t *cancel;
    /* Out-parameter for KMQ_RETRY: the delay before the next attempt, in ms. The host sets it to -1 before the
     * call, which means "use the queue's backoff". For KMQ_THROTTLE: how long the queue takes no task, in ms (-1: 1 s;
     * at most 1 h). Ignored for KMQ_DONE and KMQ_FAIL. */
    int64_t *retry_after_ms;
    /* Added within v1: the host's handle for this run, passed back to the calls of `kmq_host` (results,
     * progress). Valid until `handle` returns, or until `complete` is called for a task taken in `start`. Only a
     * host that called the plugin's `host` (below) passes a task this long: read it only then. */
    void *run;
} kmq_task;

/* Added within v1: what a host offers a running task besides its status. A host that offers it calls the plugin's
 * `host` once, before the first `init`, with a pointer that lives as long as the process; an older host never
 * does, and its tasks end at `retry_after_ms`. Fields added later go at the end, covered by `struct_size`. */
typedef struct {
    uint32_t struct_size;                /* sizeof(kmq_host) as the host was built */
    /* Attaches a result to the run: JSON text (an object, an array, a string, a number, ...), copied during the
     * call; the last call wins. Kept with the task when the run ends with KMQ_DONE and its queue has
     * `keep_results` (docs/HANDLERS.md, "Results"); ignored otherwise. Callable from any thread while `run` is
     * valid (before `handle` returns or `complete` is called). */
    void (*result)(void *run, kmq_str json);
    /* Added within v1: the outcomes of the tasks the run's task waited for (a flow's `after`: docs/HANDLERS.md,
     * "Flows"), a JSON list of {"queue", "id", "state": "done" | "dead", "result" | "reason"}; empty text for a
     * task that waited for none. Valid while `run` is. Beyond an older host's `struct_size`: its tasks waited
     * for nothing. */
    kmq_str (*dependencies)(void *run);
    /* Added within v1: the W3C trace context of the run (docs/HANDLERS.md, "Tracing"): `traceparent`, the run
     * span's own when kmqd traces (`[daemon] otlp_endpoint`), so that the handler's spans nest under the run, and
     * the producer's as it pushed it otherwise; `tracestate`, the producer's. Empty text when the task has none.
     * Valid while `run` is. Beyond an older host's `struct_size`: no context. */
    kmq_str (*traceparent)(void *run);
    kmq_str (*tracestate)(void *run);
    /* Added within v1: reports how far the run is (docs/HANDLERS.md, "Progress"): `fraction` from 0 to 1 (NaN is
     * ignored, anything else clamped to 0..1) and a short message (UTF-8, copied during the call; its first KiB is
     * kept). The latest report wins; the host writes at most a few a second to Redis, whatever the rate of calls,
     * and only while it holds the task's lease. Callable from any thread while `run` is valid. Beyond an older
     * host's `struct_size`: no progress is shown. */
    void (*progress)(void *run, float fraction, kmq_str message);
} kmq_host;

typedef enum {
    KMQ_DONE = 0,   /* the task is finished: acknowledge it */
    KMQ_RETRY = 1,  /* this attempt failed: the queue's `on_handler_error` decides (retry with backoff by default) */
    KMQ_FAIL = 2,   /* the task can never succeed: dead-letter it now, no more retries */
    /* Added within v1: the upstream said "too many requests" (an HTTP 429, a quota): the task goes back to the
     * head of its queue, its attempt not charged, and no daemon takes a task of the queue for `retry_after_ms`
     * (docs/HANDLERS.md, "Back-pressure"). A host older than it reads it as a status outside the ABI: a handler
     * error, retried with the queue's backoff, which is a safe degradation. */
    KMQ_THROTTLE = 3
} kmq_status;

/* A host-owned output buffer: the plugin writes at most `cap` bytes at `ptr` and sets `len` to what it wrote. */
typedef struct {
    char *ptr;
    size_t cap;
    size_t len;
} kmq_buf;

/* The host's callback for a task a plugin accepted in `start`: called by the plugin exactly once per accepted
 * task, from any thread, when the attempt is over (possibly before `start` returns). `ticket` is what `start` was
 * given; `status` and `msg` mean what `handle`'s return value and message mean (the host copies msg during the
 * call); `retry_after_ms` is `handle`'s out-parameter (-1: the queue's backoff; read for KMQ_RETRY and
 * KMQ_THROTTLE). Quick: it decides the task's settlement and queues it, and never waits for Redis. After it, the
 * task's `cancel` flag may be freed. */
typedef void (*kmq_complete_fn)(void *ticket, int32_t status, kmq_str msg, int64_t retry_after_ms);

typedef struct {
    uint32_t abi_version;                /* KMQ_ABI_VERSION; first, and never moves */
    uint32_t struct_size;                /* sizeof(kmq_plugin) as the plugin was built: later v1 fields are appended */
    const char *name;                    /* plugin name, NUL-terminated */
    /* NULL-terminated list of the task types the plugin handles. The host reads it after `init` returns, so a
     * plugin may fill it from its config. A type claimed by two plugins is refused at start. */
    const char *const *types;
    /* Called once per instance (per [plugins.NAME] section naming the file), before anything else of that
     * instance; config is the section's `config` table as JSON ("{}" when absent). Returns the instance's state,
     * passed back to every other call of that instance, or NULL on failure with a message in err. May be NULL:
     * the state is then NULL. */
    void *(*init)(kmq_str config, kmq_buf *err);
    /* Runs one attempt of a task. Called from many threads at once: must be thread-safe. msg: a short reason for
     * KMQ_RETRY or KMQ_FAIL (shown in logs, the dead-letter list and the task's last_error); with KMQ_DONE,
     * optional output (the exec plugin's: the tail of what the command printed), logged with the task's `task done`
     * debug event. Leave it empty for nothing. */
    kmq_status (*handle)(void *state, const kmq_task *task, kmq_buf *msg);
    /* Optional (may be NULL): a task of one of this plugin's types was dead-lettered; reason says why. Called after
     * the task is safely in the dead-letter list: the final-failure pipeline (persist it, alert, ...). Must be quick. */
    void (*on_dead)(void *state, const kmq_task *task, kmq_str reason);
    /* Optional (may be NULL): called once per instance, after its last handle() (and on_dead()) returned: when the
     * daemon stops, or when a reload replaced this instance and its last task finished; from any thread. */
    void (*shutdown)(void *state);
    /* Optional (may be NULL, and absent from a plugin built before it: the host reads it only when struct_size
     * covers it): starts one attempt of a task without waiting for it. Returns 0 when the plugin took the task:
     * it then calls complete(ticket, ...) exactly once, later or before returning, from any thread. Returns
     * non-zero to decline (then it must not call complete): the host runs the task through `handle` instead, so
     * an instance that runs tasks in place (the exec plugin's per_task mode) declines each. Called from many
     * threads at once. It may block while the plugin has no room for the task (the host never starts more than
     * the queue's `workers` at once), but should not run the task itself. The task's strings are valid only
     * during the call (copy what you keep); its `cancel` flag stays valid until complete is called (a plugin
     * watches it as `handle` does, and should complete a cancelled task soon: a task cancelled and never
     * completed holds one of the queue's `workers` until the daemon exits, as a handler that never returns
     * does); its `retry_after_ms` is unused (complete takes the delay). The host calls `shutdown` only once
     * every accepted task was completed. */
    int32_t (*start)(void *state, const kmq_task *task, kmq_complete_fn complete, void *ticket);
    /* Optional (may be NULL; absent from a plugin built before it): the host calls it once, before the first
     * `init` of the library, with what it offers a running task (`kmq_host`: results). A plugin keeps the pointer
     * (it lives as long as the process) and may then read each task's `run`. Never called by an older host: a
     * plugin that was not given a host has no results to hand on (the Rust SDK then drops a result, and says so
     * once on stderr). */
    void (*host)(const kmq_host *host);
} kmq_plugin;

/* The exported symbol; v1 is the ABI version. */
const kmq_plugin *kmq_plugin_v1(void);

#ifdef __cplusplus
}
#endif

#endif /* KMQ_PLUGIN_H */
