/*
 * clock_shift.c: an LD_PRELOAD library that shifts a process's wall clock (CLOCK_REALTIME and its variants,
 * gettimeofday, time) by an offset the test changes while the process runs: an NTP step, as Redis's `TIME`
 * sees it. The monotonic clocks are left alone, as a real step leaves them.
 *
 * Why not libfaketime: Debian's redis-server is linked with the system jemalloc, and libfaketime hangs at start
 * in any process that is (its initialisation calls dlsym, which allocates, and jemalloc's initialisation calls
 * clock_gettime back into it: libfaketime issues #130, #327, open for years). This library allocates nothing
 * and resolves nothing: the real clocks are read with the raw system calls, and the offset from a file mapped
 * once at load (KMQD_CLOCK_SHIFT_FILE, 8 bytes: the offset in microseconds, a native-endian i64), so that a
 * write of the file is seen by the next call, without a system call per read.
 *
 * Built by the harness with the system C compiler (harness/src/lib.rs, `clock_shift_library`).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

/* gettimeofday's tv is declared nonnull by glibc, yet callers may pass NULL (with a tz only): checked anyway. */
#pragma GCC diagnostic ignored "-Wnonnull-compare"

static volatile int64_t *offset_us;

__attribute__((constructor)) static void clock_shift_init(void) {
    const char *path = getenv("KMQD_CLOCK_SHIFT_FILE");
    if (path == NULL) {
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return;
    }
    void *map = mmap(NULL, sizeof(int64_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map != MAP_FAILED) {
        offset_us = (volatile int64_t *)map;
    }
}

static int64_t shift_us(void) {
    return offset_us == NULL ? 0 : __atomic_load_n(offset_us, __ATOMIC_RELAXED);
}

static void shift(struct timespec *ts) {
    int64_t offset = shift_us();
    int64_t ns = (int64_t)ts->tv_nsec + offset % 1000000 * 1000;
    int64_t s = (int64_t)ts->tv_sec + offset / 1000000;
    while (ns < 0) {
        ns += 1000000000;
        s -= 1;
    }
    while (ns >= 1000000000) {
        ns -= 1000000000;
        s += 1;
    }
    ts->tv_sec = (time_t)s;
    ts->tv_nsec = (long)ns;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    int result = (int)syscall(SYS_clock_gettime, clock, ts);
    if (result == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        shift(ts);
    }
    return result;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec ts;
    int result = clock_gettime(CLOCK_REALTIME, &ts);
    if (result == 0 && tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return result;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out != NULL) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}
