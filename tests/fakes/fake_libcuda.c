/*
 * A fake libcuda.so.1 for Torpor's tests on machines without a GPU.
 *
 * It exports the driver calls torpor-cuda makes and follows the checkpoint state machine of the
 * real driver (580): lock needs running, checkpoint needs locked, restore needs checkpointed and
 * leaves the process locked, unlock needs locked; any other order returns
 * CUDA_ERROR_ILLEGAL_STATE (401). Like the real driver it answers CUDA_ERROR_NOT_INITIALIZED (3)
 * for a live process that is not a CUDA process and CUDA_ERROR_OPERATING_SYSTEM (304) for a pid
 * that does not exist.
 *
 * Built with `cc -shared -fPIC -o libfakecuda.so fake_libcuda.c`; with -DFAKE_CUDA_NO_CHECKPOINT
 * it lacks the cuCheckpoint* functions, like a driver older than 570. With -DFAKE_CUDA_VMM it
 * also has the virtual memory management, copy and stream calls (see the end of the file), with
 * "device" memory that is memfd-backed host memory, so torpor-device's cuda backend runs without
 * a GPU; without it those symbols are absent, as torpor-cuda's loading tests need.
 *
 * Behaviour is read from the environment at each call, so every process that loads it (a CLI run
 * by a test, say) can be steered:
 *
 *   FAKE_CUDA_PIDS            comma list of pids that are CUDA processes; "*" for every pid.
 *                             Listed pids need not exist. Unlisted ones get 3 or 304 as above.
 *   FAKE_CUDA_STATE_DIR       directory holding one file per pid, named by the pid and holding
 *                             "running", "locked", "checkpointed" or "failed" (a missing file is
 *                             "running"). Tests may write these files themselves. Without it the
 *                             state lives in this process only.
 *   FAKE_CUDA_DEFAULT_STATE   the state of a pid not acted on yet (default "running"); "any":
 *                             whatever state a call needs (state in memory only).
 *   FAKE_CUDA_LOG             file to which one line is appended per lock, checkpoint, restore
 *                             and unlock call, whatever its result:
 *                               lock <pid> timeout_ms=<ms> result=<code>
 *                               checkpoint <pid> result=<code>
 *                               restore <pid> pairs=<n> [<old>><new> ...] result=<code>
 *                               unlock <pid> result=<code>
 *                             UUIDs as GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
 *   FAKE_CUDA_INIT_RESULT     code cuInit returns (e.g. 100, no device).
 *   FAKE_CUDA_LOCK_RESULT     code the lock returns instead of doing it: 600 is what driver 580
 *   FAKE_CUDA_CKPT_RESULT     returns on a timeout. Each of these is either "CODE", for every
 *   FAKE_CUDA_RESTORE_RESULT  pid, or a comma list of "CODE@PID" for the pids named. A forced
 *   FAKE_CUDA_UNLOCK_RESULT   failure leaves the state as it was and is logged.
 *   FAKE_CUDA_STATE_RESULT    code cuCheckpointProcessGetState returns.
 *   FAKE_CUDA_DEVICES         number of GPUs (default 1, at most 16). GPU i is named
 *                             "Fake NVIDIA GPU i" ("Fake NVIDIA GPU" for all with
 *                             FAKE_CUDA_SAME_MODEL set: one model) and has the UUID
 *                             GPU-fa4e0000-0000-0000-0000-0000000000ii (i in hex).
 *   FAKE_CUDA_TOTAL_MEM       bytes of memory of each GPU (default 80 GiB).
 *   FAKE_CUDA_DRIVER_VERSION  what cuDriverGetVersion returns (default 13000).
 *
 * The *_RESULT variables (and FAKE_CUDA_MEM_CREATE_RESULT, FAKE_CUDA_MEM_ALLOC_RESULT,
 * FAKE_CUDA_DEVICES and FAKE_CUDA_PEER below) may also be given as a file named like the variable in the directory this library was loaded
 * from, holding the value: a switch that a test turns on and off while the processes that loaded
 * the library run, and that reaches processes that do not inherit FAKE_CUDA_* variables
 * (torpord's workers keep only CUDA_*, TORPOR_* and a few others). A set variable wins.
 *
 * Arguments are checked as the real driver documents them: reserved fields must be zero and a
 * non-zero pair count needs a pair array, else CUDA_ERROR_INVALID_VALUE (1).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct {
    unsigned char bytes[16];
} CUuuid;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_ILLEGAL_STATE = 401,
};

static int initialized;

static const char *env(const char *name) {
    const char *value = getenv(name);
    return value && *value ? value : NULL;
}

/* A switch: the variable `name`, else the first line of the file `name` beside this library
 * (read at each call, so that a test can flip it; see the header). */
static const char *switch_value(const char *name) {
    const char *value = env(name);
    if (value)
        return value;
    static __thread char buf[256];
    Dl_info info;
    if (!dladdr((void *)switch_value, &info) || !info.dli_fname)
        return NULL;
    const char *slash = strrchr(info.dli_fname, '/');
    if (!slash)
        return NULL;
    char path[4096];
    int n = snprintf(path, sizeof path, "%.*s/%s", (int)(slash - info.dli_fname), info.dli_fname, name);
    if (n < 0 || (size_t)n >= sizeof path)
        return NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    ssize_t got = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (got <= 0)
        return NULL;
    buf[got] = 0;
    buf[strcspn(buf, "\r\n")] = 0;
    return *buf ? buf : NULL;
}

static long switch_long(const char *name, long fallback) {
    const char *value = switch_value(name);
    return value ? strtol(value, NULL, 10) : fallback;
}

static long env_long(const char *name, long fallback) {
    const char *value = env(name);
    return value ? strtol(value, NULL, 10) : fallback;
}

static void uuid_of(int ordinal, CUuuid *uuid) {
    memset(uuid, 0, sizeof *uuid);
    uuid->bytes[0] = 0xfa;
    uuid->bytes[1] = 0x4e;
    uuid->bytes[15] = (unsigned char)ordinal;
}

static int device_count(void) {
    long n = switch_long("FAKE_CUDA_DEVICES", 1);
    return n < 0 ? 0 : n > 16 ? 16 : (int)n;
}

CUresult cuInit(unsigned int flags) {
    long forced = switch_long("FAKE_CUDA_INIT_RESULT", 0);
    if (forced)
        return (CUresult)forced;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    initialized = 1;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = (int)env_long("FAKE_CUDA_DRIVER_VERSION", 13000);
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    static const struct {
        CUresult code;
        const char *name;
    } names[] = {
        {0, "CUDA_SUCCESS"},
        {1, "CUDA_ERROR_INVALID_VALUE"},
        {2, "CUDA_ERROR_OUT_OF_MEMORY"},
        {3, "CUDA_ERROR_NOT_INITIALIZED"},
        {100, "CUDA_ERROR_NO_DEVICE"},
        {101, "CUDA_ERROR_INVALID_DEVICE"},
        {304, "CUDA_ERROR_OPERATING_SYSTEM"},
        {401, "CUDA_ERROR_ILLEGAL_STATE"},
        {500, "CUDA_ERROR_NOT_FOUND"},
        {600, "CUDA_ERROR_NOT_READY"},
        {801, "CUDA_ERROR_NOT_SUPPORTED"},
        {909, "CUDA_ERROR_TIMEOUT"},
        {999, "CUDA_ERROR_UNKNOWN"},
    };
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (names[i].code == error) {
            *name = names[i].name;
            return CUDA_SUCCESS;
        }
    }
    *name = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDeviceGetCount(int *count) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = device_count();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    /* FAKE_CUDA_SAME_MODEL: every GPU is one model (for moves between GPUs). */
    if (env("FAKE_CUDA_SAME_MODEL"))
        snprintf(name, (size_t)len, "Fake NVIDIA GPU");
    else
        snprintf(name, (size_t)len, "Fake NVIDIA GPU %d", device);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    uuid_of(device, uuid);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice device) { return cuDeviceGetUuid_v2(uuid, device); }

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice device) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    const char *value = env("FAKE_CUDA_TOTAL_MEM");
    *bytes = value ? (size_t)strtoull(value, NULL, 10) : (size_t)80 << 30;
    return CUDA_SUCCESS;
}

#ifndef FAKE_CUDA_NO_CHECKPOINT

typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    unsigned long long reserved1[7];
} CUcheckpointLockArgs;
typedef struct {
    unsigned long long reserved[8];
} CUcheckpointCheckpointArgs;
typedef struct {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;
typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    unsigned long long reserved1;
} CUcheckpointRestoreArgs;
typedef struct {
    unsigned long long reserved[8];
} CUcheckpointUnlockArgs;
typedef int CUprocessState;

enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2, FAILED = 3 };
static const char *const STATE_NAMES[] = {"running", "locked", "checkpointed", "failed"};

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "CUcheckpointLockArgs is 64 bytes");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "CUcheckpointCheckpointArgs is 64 bytes");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "CUcheckpointRestoreArgs is 64 bytes");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "CUcheckpointUnlockArgs is 64 bytes");

/* Whether `pid` is in the comma list `list` ("*" matches every pid). */
static int pid_listed(const char *list, int pid) {
    if (!list)
        return 0;
    if (strcmp(list, "*") == 0)
        return 1;
    const char *p = list;
    while (*p) {
        char *end;
        long value = strtol(p, &end, 10);
        if (end != p && value == pid)
            return 1;
        p = strchr(p, ',');
        if (!p)
            break;
        p++;
    }
    return 0;
}

/* The result forced by variable `name` for `pid`: "CODE" or a comma list of "CODE@PID". */
static CUresult forced_result(const char *name, int pid) {
    const char *p = switch_value(name);
    char *end, *after;
    while (p && *p) {
        long code = strtol(p, &end, 10);
        if (*end != '@')
            return (CUresult)code;
        long target = strtol(end + 1, &after, 10);
        if (target == pid)
            return (CUresult)code;
        p = strchr(after, ',');
        if (p)
            p++;
    }
    return CUDA_SUCCESS;
}

static int process_exists(int pid) {
    char path[64];
    if (pid <= 0)
        return 0;
    snprintf(path, sizeof path, "/proc/%d", pid);
    return access(path, F_OK) == 0;
}

/* Why `pid` cannot be acted on, or CUDA_SUCCESS. */
static CUresult target_error(int pid) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (pid_listed(env("FAKE_CUDA_PIDS"), pid))
        return CUDA_SUCCESS;
    return process_exists(pid) ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_OPERATING_SYSTEM;
}

/* State kept in memory when FAKE_CUDA_STATE_DIR is unset. */
static struct {
    int pid;
    int state;
} memory_states[256];

/* The state of a pid the fake has not acted on: FAKE_CUDA_DEFAULT_STATE ("checkpointed" for
 * processes that CRIU just restored), else running. */
static int default_state(void) {
    const char *name = env("FAKE_CUDA_DEFAULT_STATE");
    if (name)
        for (int s = RUNNING; s <= FAILED; s++)
            if (strcmp(name, STATE_NAMES[s]) == 0)
                return s;
    return RUNNING;
}

static int read_state(int pid) {
    const char *dir = env("FAKE_CUDA_STATE_DIR");
    if (!dir) {
        for (size_t i = 0; i < sizeof memory_states / sizeof memory_states[0]; i++)
            if (memory_states[i].pid == pid)
                return memory_states[i].state;
        return default_state();
    }
    char path[4096], word[32] = {0};
    snprintf(path, sizeof path, "%s/%d", dir, pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return default_state();
    int matched = fscanf(f, "%31s", word);
    fclose(f);
    if (matched == 1)
        for (int s = RUNNING; s <= FAILED; s++)
            if (strcmp(word, STATE_NAMES[s]) == 0)
                return s;
    return FAILED;
}

static void write_state(int pid, int state) {
    const char *dir = env("FAKE_CUDA_STATE_DIR");
    if (!dir) {
        size_t free_slot = sizeof memory_states / sizeof memory_states[0];
        for (size_t i = 0; i < sizeof memory_states / sizeof memory_states[0]; i++) {
            if (memory_states[i].pid == pid) {
                memory_states[i].state = state;
                return;
            }
            if (memory_states[i].pid == 0 && free_slot == sizeof memory_states / sizeof memory_states[0])
                free_slot = i;
        }
        if (free_slot < sizeof memory_states / sizeof memory_states[0]) {
            memory_states[free_slot].pid = pid;
            memory_states[free_slot].state = state;
        }
        return;
    }
    /* Written aside and renamed, so a reader in another process never sees half a file. */
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/%d", dir, pid);
    snprintf(tmp, sizeof tmp, "%s/.%d.%d.tmp", dir, pid, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    fprintf(f, "%s\n", STATE_NAMES[state]);
    fclose(f);
    rename(tmp, path);
}

/* FAKE_CUDA_DEFAULT_STATE=any: a pid the fake has not acted on (in this process's memory) is in
 * whatever state the call needs: a daemon locks the workers it boots and restores the ones CRIU
 * brings back, and the test cannot name their pids in advance. */
static int unseen_is_any(int pid) {
    const char *name = env("FAKE_CUDA_DEFAULT_STATE");
    if (!name || strcmp(name, "any") != 0 || env("FAKE_CUDA_STATE_DIR"))
        return 0;
    for (size_t i = 0; i < sizeof memory_states / sizeof memory_states[0]; i++)
        if (memory_states[i].pid == pid)
            return 0;
    return 1;
}

/* Appends `line` and a newline to FAKE_CUDA_LOG in one write, so lines of processes that log at
 * once do not interleave. */
static void log_line(const char *line) {
    const char *path = env("FAKE_CUDA_LOG");
    if (!path)
        return;
    char buf[2048];
    int n = snprintf(buf, sizeof buf, "%s\n", line);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof buf)
        n = sizeof buf - 1;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    ssize_t written = write(fd, buf, (size_t)n);
    (void)written;
    close(fd);
}

static int all_zero(const void *p, size_t len) {
    const unsigned char *bytes = p;
    for (size_t i = 0; i < len; i++)
        if (bytes[i])
            return 0;
    return 1;
}

static void format_uuid(const CUuuid *uuid, char out[41]) {
    const unsigned char *b = uuid->bytes;
    snprintf(out, 41, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
             b[15]);
}

/* The common part of the four actions: checks, the forced result, the state move and the log.
 * `detail` is logged between the pid and the result. */
static CUresult act(const char *op, int pid, const char *detail, const char *force_var, int args_ok, int from,
                    int to) {
    CUresult result = target_error(pid);
    if (result == CUDA_SUCCESS)
        result = forced_result(force_var, pid);
    if (result == CUDA_SUCCESS && !args_ok)
        result = CUDA_ERROR_INVALID_VALUE;
    if (result == CUDA_SUCCESS && !unseen_is_any(pid) && read_state(pid) != from)
        result = CUDA_ERROR_ILLEGAL_STATE;
    if (result == CUDA_SUCCESS)
        write_state(pid, to);
    char line[1900];
    snprintf(line, sizeof line, "%s %d%s%s result=%d", op, pid, *detail ? " " : "", detail, result);
    log_line(line);
    return result;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    char detail[64];
    snprintf(detail, sizeof detail, "timeout_ms=%u", args ? args->timeoutMs : 0u);
    int ok = !args || (args->reserved0 == 0 && all_zero(args->reserved1, sizeof args->reserved1));
    return act("lock", pid, detail, "FAKE_CUDA_LOCK_RESULT", ok, RUNNING, LOCKED);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    int ok = !args || all_zero(args, sizeof *args);
    return act("checkpoint", pid, "", "FAKE_CUDA_CKPT_RESULT", ok, LOCKED, CHECKPOINTED);
}

/* Appends " threads=" and the state letter of every thread of `pid` (tid order as listed), e.g.
 * " threads=S,T,T"; returns the length appended. */
static int thread_states(int pid, char *out, size_t room) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *dir = opendir(path);
    if (!dir || room < 16) {
        if (dir)
            closedir(dir);
        return 0;
    }
    int at = snprintf(out, room, " threads=");
    const struct dirent *e;
    int first = 1;
    while ((e = readdir(dir)) && at < (int)room - 4) {
        if (e->d_name[0] == '.')
            continue;
        char stat_path[128], buf[512] = {0};
        snprintf(stat_path, sizeof stat_path, "/proc/%d/task/%s/stat", pid, e->d_name);
        FILE *f = fopen(stat_path, "r");
        if (!f)
            continue;
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        /* The state follows the command's closing parenthesis. */
        const char *close = strrchr(buf, ')');
        if (!close || close[1] != ' ' || !close[2])
            continue;
        at += snprintf(out + at, room - (size_t)at, "%s%c", first ? "" : ",", close[2]);
        first = 0;
    }
    closedir(dir);
    return at;
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    char detail[1800];
    unsigned int count = args ? args->gpuPairsCount : 0;
    int ok = !args || (all_zero(args->reserved, sizeof args->reserved) && args->reserved1 == 0 &&
                       (count == 0 || args->gpuPairs));
    int at = snprintf(detail, sizeof detail, "pairs=%u", count);
    if (ok && args && args->gpuPairs) {
        for (unsigned int i = 0; i < count && at < (int)sizeof detail - 90; i++) {
            char old_uuid[41], new_uuid[41];
            format_uuid(&args->gpuPairs[i].oldUuid, old_uuid);
            format_uuid(&args->gpuPairs[i].newUuid, new_uuid);
            at += snprintf(detail + at, sizeof detail - (size_t)at, " %s>%s", old_uuid, new_uuid);
        }
    }
    /* FAKE_CUDA_LOG_THREADS=1: the state letter of each thread of the target (/proc/PID/task/TID/
     * stat, in the kernel's listing order) as the restore saw them, e.g. "threads=SS,T,T": what a
     * test needs to see that only the restore thread ran while the driver restored. */
    if (env("FAKE_CUDA_LOG_THREADS"))
        at += thread_states(pid, detail + at, sizeof detail - (size_t)at);
    /* FAKE_CUDA_RESTORE_FLAKY=PATH: the first restore fails with CUDA_ERROR_OPERATING_SYSTEM (and
     * creates PATH), as the real driver's intermittent restore failure does; later ones work. */
    const char *flaky = env("FAKE_CUDA_RESTORE_FLAKY");
    if (flaky && access(flaky, F_OK) != 0) {
        int fd = open(flaky, O_WRONLY | O_CREAT | O_EXCL, 0600);
        if (fd >= 0) {
            close(fd);
            char line[128];
            snprintf(line, sizeof line, "restore %d flaky result=%d", pid, CUDA_ERROR_OPERATING_SYSTEM);
            log_line(line);
            return CUDA_ERROR_OPERATING_SYSTEM;
        }
    }
    return act("restore", pid, detail, "FAKE_CUDA_RESTORE_RESULT", ok, CHECKPOINTED, LOCKED);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    int ok = !args || all_zero(args, sizeof *args);
    return act("unlock", pid, "", "FAKE_CUDA_UNLOCK_RESULT", ok, LOCKED, RUNNING);
}

CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    CUresult result = target_error(pid);
    if (result == CUDA_SUCCESS)
        result = forced_result("FAKE_CUDA_STATE_RESULT", pid);
    if (result == CUDA_SUCCESS && !state)
        result = CUDA_ERROR_INVALID_VALUE;
    if (result == CUDA_SUCCESS)
        *state = read_state(pid);
    return result;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    CUresult result = target_error(pid);
    if (result == CUDA_SUCCESS && !tid)
        result = CUDA_ERROR_INVALID_VALUE;
    if (result == CUDA_SUCCESS)
        *tid = pid;
    return result;
}

#endif /* FAKE_CUDA_NO_CHECKPOINT */

#ifdef FAKE_CUDA_VMM
/*
 * Virtual memory management on host memory. Device addresses are host addresses (as with unified
 * addressing); physical memory is a memfd; a handle is a pointer to its record. Like the real
 * driver: a new mapping has no access until cuMemSetAccess; cuMemUnmap keeps the reservation;
 * copies and memsets to a range that is not mapped with the access they need return
 * CUDA_ERROR_INVALID_VALUE (the real driver refuses a memset through a read-only mapping so);
 * structs must carry the documented values and zero reserved fields.
 *
 * The current context is per thread (cuCtxSetCurrent, cuCtxGetCurrent, cuCtxGetDevice); plain
 * cuMemAlloc_v2/cuMemFree_v2 need one, as on the real driver, and return host memory.
 *
 *   FAKE_CUDA_GRANULARITY     allocation granularity in bytes (default 2 MiB, as on an H100).
 *   FAKE_CUDA_MEM_CREATE_RESULT  code cuMemCreate returns instead of creating (2: out of memory).
 *   FAKE_CUDA_MEM_ALLOC_RESULT   code cuMemAlloc_v2 returns instead of allocating (2: out of memory).
 *   FAKE_CUDA_HOST_ALLOC_SLEEP_MS  cuMemHostAlloc sleeps this long first (a slow pin).
 *   FAKE_CUDA_LOG             also gets one line per copy: "<htod|dtoh|dtod> stream=<id> bytes=<n>".
 *   FAKE_CUDA_PEER            0: no two GPUs reach each other (cuDeviceCanAccessPeer); default:
 *                             every pair of different GPUs does.
 */
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>

typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    int type;
    int id;
} CUmemLocation;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;
typedef struct fake_stream {
    int id;
} *CUstream;
typedef void *CUcontext;

struct allocation {
    int fd;
    size_t size;
    /* Made by cuMemImportFromShareableHandle: the real driver refuses to export it again
       (CUDA_ERROR_INVALID_VALUE, measured on the H100 with driver 580). */
    int imported;
};

#define MAX_MAPPINGS 1024
static struct {
    uintptr_t start;
    size_t size;
    int prot; /* PROT_NONE until cuMemSetAccess */
} mappings[MAX_MAPPINGS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int context_token, next_stream_id;

static void vmm_log(const char *op, CUstream stream, size_t bytes) {
    const char *path = env("FAKE_CUDA_LOG");
    if (!path)
        return;
    char buf[128];
    int n = snprintf(buf, sizeof buf, "%s stream=%d bytes=%zu\n", op, stream ? stream->id : -1, bytes);
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || n < 0)
        return;
    ssize_t written = write(fd, buf, (size_t)n);
    (void)written;
    close(fd);
}

static size_t granularity(void) { return (size_t)env_long("FAKE_CUDA_GRANULARITY", 2 << 20); }

static int prop_ok(const CUmemAllocationProp *prop) {
    static const unsigned char zero[8];
    return prop && prop->type == 1 && prop->requestedHandleTypes == 1 && prop->location.type == 1 &&
           prop->location.id >= 0 && prop->location.id < device_count() &&
           !prop->win32HandleMetaData && memcmp(&prop->allocFlags, zero, sizeof zero) == 0;
}

/* Whether [ptr, ptr+size) lies in one mapping whose protection includes `prot`. */
static int accessible(CUdeviceptr ptr, size_t size, int prot) {
    int ok = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS && !ok; i++)
        ok = mappings[i].size && ptr >= mappings[i].start &&
             ptr + size <= mappings[i].start + mappings[i].size && (mappings[i].prot & prot) == prot;
    pthread_mutex_unlock(&lock);
    return ok;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    *ctx = &context_token;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    return device < 0 || device >= device_count() ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

/* One context per process (every GPU's primary context is the same token); current per thread. */
static __thread CUcontext current_context;

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (ctx != NULL && ctx != &context_token)
        return CUDA_ERROR_INVALID_VALUE;
    current_context = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    *ctx = current_context;
    return CUDA_SUCCESS;
}

/* The context's limits (cuCtxSetLimit/cuCtxGetLimit): stack 1024 bytes per thread as on the H100;
 * a change is logged "limit <pid> <which>=<value>" to FAKE_CUDA_LOG. */
static size_t ctx_limits[3] = {1024, 8650752, 8388608};

CUresult cuCtxSetLimit(int which, size_t value) {
    if (!current_context)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (which < 0 || which > 2)
        return CUDA_ERROR_INVALID_VALUE;
    ctx_limits[which] = value;
    char line[96];
    snprintf(line, sizeof line, "limit %d %d=%zu", (int)getpid(), which, value);
    log_line(line);
    return CUDA_SUCCESS;
}

CUresult cuCtxGetLimit(size_t *value, int which) {
    if (!current_context)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!value || which < 0 || which > 2)
        return CUDA_ERROR_INVALID_VALUE;
    *value = ctx_limits[which];
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) {
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!current_context)
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice device, CUdevice peer) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!can)
        return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count() || peer < 0 || peer >= device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    *can = device != peer && switch_long("FAKE_CUDA_PEER", 1) != 0;
    return CUDA_SUCCESS;
}

/* Registers [start, start+size) as a mapping with `prot` (cuMemMap, and plain allocations). */
static CUresult add_mapping(uintptr_t start, size_t size, int prot) {
    CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS; i++) {
        if (!mappings[i].size) {
            mappings[i].start = start;
            mappings[i].size = size;
            mappings[i].prot = prot;
            result = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return result;
}

/* Plain allocations (not VMM): host memory, so a program's writes through the pointer work, and
 * readable and writable by the copies, as on the real driver. */
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
    if (!ptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!current_context)
        return CUDA_ERROR_INVALID_CONTEXT;
    long forced = switch_long("FAKE_CUDA_MEM_ALLOC_RESULT", 0);
    if (forced)
        return (CUresult)forced;
    size_t rounded = (size + 255) / 256 * 256;
    void *p = aligned_alloc(256, rounded);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (add_mapping((uintptr_t)p, rounded, PROT_READ | PROT_WRITE) != CUDA_SUCCESS) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = (uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    if (!current_context)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (mappings[i].size && mappings[i].start == ptr)
            mappings[i].size = 0;
    pthread_mutex_unlock(&lock);
    free((void *)(uintptr_t)ptr);
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) { return CUDA_SUCCESS; }

CUresult cuMemGetAllocationGranularity(size_t *out, const CUmemAllocationProp *prop, int option) {
    if (!out || !prop_ok(prop) || (option != 0 && option != 1))
        return CUDA_ERROR_INVALID_VALUE;
    *out = granularity();
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    size_t g = granularity();
    if (!ptr || flags || size == 0 || size % g || (alignment && alignment % g) || addr % g)
        return CUDA_ERROR_INVALID_VALUE;
    int common = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (addr) {
        void *p = mmap((void *)(uintptr_t)addr, size, PROT_NONE, common | MAP_FIXED_NOREPLACE, -1, 0);
        if (p != MAP_FAILED) {
            *ptr = (uintptr_t)p;
            return CUDA_SUCCESS;
        }
    }
    /* Anywhere, aligned to the granularity: over-reserve, then trim. */
    char *p = mmap(NULL, size + g, PROT_NONE, common, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t start = ((uintptr_t)p + g - 1) / g * g;
    if (start > (uintptr_t)p)
        munmap(p, start - (uintptr_t)p);
    if ((uintptr_t)p + size + g > start + size)
        munmap((void *)(start + size), (uintptr_t)p + size + g - (start + size));
    *ptr = start;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    if (!ptr || size % granularity())
        return CUDA_ERROR_INVALID_VALUE;
    return munmap((void *)(uintptr_t)ptr, size) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
    if (!handle || flags || !prop_ok(prop) || size == 0 || size % granularity())
        return CUDA_ERROR_INVALID_VALUE;
    long forced = switch_long("FAKE_CUDA_MEM_CREATE_RESULT", 0);
    if (forced)
        return (CUresult)forced;
    int fd = memfd_create("fake-cuda-memory", MFD_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct allocation *a = malloc(sizeof *a);
    a->fd = fd;
    a->size = size;
    a->imported = 0;
    *handle = (uintptr_t)a;
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    struct allocation *a = (struct allocation *)(uintptr_t)handle;
    if (!a)
        return CUDA_ERROR_INVALID_VALUE;
    close(a->fd);
    free(a);
    return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    struct allocation *a = (struct allocation *)(uintptr_t)handle;
    if (!a || !ptr || offset || flags || size == 0 || size > a->size || size % granularity())
        return CUDA_ERROR_INVALID_VALUE;
    if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED)
        return CUDA_ERROR_INVALID_VALUE;
    return add_mapping(ptr, size, PROT_NONE);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS; i++) {
        if (mappings[i].size && mappings[i].start == ptr && mappings[i].size == size) {
            mappings[i].size = 0;
            result = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    if (result == CUDA_SUCCESS &&
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
        result = CUDA_ERROR_INVALID_VALUE;
    return result;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    if (!desc || count != 1 || desc->location.type != 1 || desc->location.id < 0 ||
        desc->location.id >= device_count())
        return CUDA_ERROR_INVALID_VALUE;
    int prot = desc->flags == 3 ? PROT_READ | PROT_WRITE : desc->flags == 1 ? PROT_READ : -1;
    if (prot < 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS; i++) {
        if (mappings[i].size && mappings[i].start == ptr && mappings[i].size == size &&
            mprotect((void *)(uintptr_t)ptr, size, prot) == 0) {
            mappings[i].prot = prot;
            result = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return result;
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle, int type,
                                      unsigned long long flags) {
    struct allocation *a = (struct allocation *)(uintptr_t)handle;
    if (!out || !a || type != 1 || flags || a->imported)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    *(int *)out = fd;
    return CUDA_SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle,
                                        int type) {
    int fd = (int)(uintptr_t)os_handle;
    struct stat st;
    if (!handle || type != 1 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    struct allocation *a = malloc(sizeof *a);
    a->fd = own;
    a->size = (size_t)st.st_size;
    a->imported = 1;
    *handle = (uintptr_t)a;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *stream, unsigned int flags) {
    if (!stream || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    *stream = malloc(sizeof **stream);
    pthread_mutex_lock(&lock);
    (*stream)->id = next_stream_id++;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream stream) { return stream ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult cuStreamDestroy_v2(CUstream stream) {
    if (!stream)
        return CUDA_ERROR_INVALID_VALUE;
    free(stream);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream stream) {
    if (!src || !accessible(dst, n, PROT_READ | PROT_WRITE))
        return CUDA_ERROR_INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    vmm_log("htod", stream, n);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream stream) {
    if (!dst || !accessible(src, n, PROT_READ))
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(dst, (const void *)(uintptr_t)src, n);
    vmm_log("dtoh", stream, n);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    if (!accessible(src, n, PROT_READ) || !accessible(dst, n, PROT_READ | PROT_WRITE))
        return CUDA_ERROR_INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    vmm_log("dtod", stream, n);
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    if (!accessible(dst, n, PROT_READ | PROT_WRITE))
        return CUDA_ERROR_INVALID_VALUE;
    memset((void *)(uintptr_t)dst, value, n);
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void **ptr, size_t bytes, unsigned int flags) {
    if (!ptr || bytes == 0 || flags > 7)
        return CUDA_ERROR_INVALID_VALUE;
    /* A slow pin (a real driver pins 4 GiB in ~2 s). */
    const char *sleep_ms = getenv("FAKE_CUDA_HOST_ALLOC_SLEEP_MS");
    if (sleep_ms)
        usleep((useconds_t)atol(sleep_ms) * 1000);
    *ptr = malloc(bytes);
    return *ptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuMemFreeHost(void *ptr) {
    free(ptr);
    return CUDA_SUCCESS;
}

CUresult cuMemHostRegister_v2(void *ptr, size_t bytes, unsigned int flags) {
    return ptr && bytes && flags <= 15 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemHostUnregister(void *ptr) { return ptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
#endif /* FAKE_CUDA_VMM */

/* ---- legacy CUDA IPC and managed memory: enough for the hook's markers (crates/torpor-hook
 * src/markers.rs) to see a success. Imports return a made-up address; nothing is mapped. */

typedef struct {
    char reserved[64];
} CUipcMemHandle;

CUresult cuIpcOpenMemHandle_v2(unsigned long long *dptr, CUipcMemHandle handle, unsigned int flags) {
    (void)handle;
    if (!dptr || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr = 0x7e0000000000ULL;
    return CUDA_SUCCESS;
}

CUresult cuIpcCloseMemHandle(unsigned long long dptr) {
    return dptr == 0x7e0000000000ULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemAllocManaged(unsigned long long *dptr, size_t bytes, unsigned int flags) {
    (void)flags;
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr = 0x7d0000000000ULL;
    return CUDA_SUCCESS;
}
