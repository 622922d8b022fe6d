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
 * it lacks the cuCheckpoint* functions, like a driver older than 570.
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
 *                             "Fake NVIDIA GPU i" and has the UUID
 *                             GPU-fa4e0000-0000-0000-0000-0000000000ii (i in hex).
 *   FAKE_CUDA_TOTAL_MEM       bytes of memory of each GPU (default 80 GiB).
 *   FAKE_CUDA_DRIVER_VERSION  what cuDriverGetVersion returns (default 13000).
 *
 * Arguments are checked as the real driver documents them: reserved fields must be zero and a
 * non-zero pair count needs a pair array, else CUDA_ERROR_INVALID_VALUE (1).
 */
#define _GNU_SOURCE
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
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_ILLEGAL_STATE = 401,
};

static int initialized;

static const char *env(const char *name) {
    const char *value = getenv(name);
    return value && *value ? value : NULL;
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
    long n = env_long("FAKE_CUDA_DEVICES", 1);
    return n < 0 ? 0 : n > 16 ? 16 : (int)n;
}

CUresult cuInit(unsigned int flags) {
    long forced = env_long("FAKE_CUDA_INIT_RESULT", 0);
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
    const char *p = env(name);
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

static int read_state(int pid) {
    const char *dir = env("FAKE_CUDA_STATE_DIR");
    if (!dir) {
        for (size_t i = 0; i < sizeof memory_states / sizeof memory_states[0]; i++)
            if (memory_states[i].pid == pid)
                return memory_states[i].state;
        return RUNNING;
    }
    char path[4096], word[32] = {0};
    snprintf(path, sizeof path, "%s/%d", dir, pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return RUNNING;
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
    if (result == CUDA_SUCCESS && read_state(pid) != from)
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
