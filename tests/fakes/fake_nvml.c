/*
 * A fake libnvidia-ml.so.1 for Torpor's tests on machines without a GPU: the NVML calls
 * torpor-cuda makes, describing the same GPUs as fake_libcuda.c.
 *
 * Built with `cc -shared -fPIC -o libfakenvml.so fake_nvml.c`. Read from the environment:
 *
 *   FAKE_CUDA_DEVICES         number of GPUs (default 1, at most 16); GPU i is "Fake NVIDIA GPU i"
 *                             with UUID GPU-fa4e0000-0000-0000-0000-0000000000ii (i in hex).
 *   FAKE_CUDA_TOTAL_MEM       bytes of memory of each GPU (default 80 GiB).
 *   FAKE_NVML_DRIVER_VERSION  what nvmlSystemGetDriverVersion returns (default "580.159.04").
 *   FAKE_NVML_INIT_RESULT     code nvmlInit_v2 returns (e.g. 9, driver not loaded).
 *   FAKE_NVML_PROCS           comma list of "PID:BYTES" or "PID:BYTES@GPU" (GPU index, default 0):
 *                             the compute processes and their memory; BYTES "-" is "not
 *                             available". Free memory is the total less what they use.
 *   FAKE_NVML_PROCS_FILE      a file holding such a list, read again at every call (so a test can
 *                             name processes that start after the caller loaded NVML); it takes
 *                             the place of FAKE_NVML_PROCS. A missing file lists nothing.
 *   FAKE_NVML_PROCS_MATCH     "TEXT:BYTES": also every running process whose command line holds
 *                             TEXT, with BYTES on GPU 0 (e.g. a daemon's workers, whose pids a
 *                             test cannot know in advance).
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t is 24 bytes");

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
};
#define NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL

static int init_count;

static const char *env(const char *name) {
    const char *value = getenv(name);
    return value && *value ? value : NULL;
}

static unsigned int device_count(void) {
    const char *value = env("FAKE_CUDA_DEVICES");
    long n = value ? strtol(value, NULL, 10) : 1;
    return n < 0 ? 0 : n > 16 ? 16 : (unsigned int)n;
}

static unsigned long long total_memory(void) {
    const char *value = env("FAKE_CUDA_TOTAL_MEM");
    return value ? strtoull(value, NULL, 10) : 80ULL << 30;
}

/* Index of a handle made by nvmlDeviceGetHandleByIndex_v2, or -1. */
static int index_of(nvmlDevice_t device) {
    uintptr_t raw = (uintptr_t)device;
    return raw >= 1 && raw <= device_count() ? (int)(raw - 1) : -1;
}

/* The process list: FAKE_NVML_PROCS_FILE's contents (at most 4095 bytes), else FAKE_NVML_PROCS. */
static const char *process_list(char *buf, size_t size) {
    const char *path = env("FAKE_NVML_PROCS_FILE");
    if (!path)
        return env("FAKE_NVML_PROCS");
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f) {
        size_t n = fread(buf, 1, size - 1, f);
        buf[n] = '\0';
        fclose(f);
    }
    return buf;
}

/* Adds to `out` (up to `room`) every process whose command line holds FAKE_NVML_PROCS_MATCH's
 * text, on GPU 0; returns the count `n` becomes. */
static unsigned int matching_processes(int gpu, nvmlProcessInfo_t *out, unsigned int room, unsigned int n) {
    const char *match = env("FAKE_NVML_PROCS_MATCH");
    const char *colon = match ? strrchr(match, ':') : NULL;
    if (!colon || gpu != 0)
        return n;
    char text[256];
    size_t len = (size_t)(colon - match) < sizeof text - 1 ? (size_t)(colon - match) : sizeof text - 1;
    memcpy(text, match, len);
    text[len] = '\0';
    unsigned long long bytes = strtoull(colon + 1, NULL, 10);
    DIR *proc = opendir("/proc");
    if (!proc)
        return n;
    const struct dirent *e;
    while ((e = readdir(proc))) {
        char *end;
        unsigned long pid = strtoul(e->d_name, &end, 10);
        if (*end || pid == 0)
            continue;
        char path[64], cmd[4096];
        snprintf(path, sizeof path, "/proc/%lu/cmdline", pid);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        size_t got = fread(cmd, 1, sizeof cmd - 1, f);
        fclose(f);
        for (size_t i = 0; i < got; i++)
            if (cmd[i] == '\0')
                cmd[i] = ' ';
        cmd[got] = '\0';
        if (!strstr(cmd, text))
            continue;
        if (out && n < room) {
            nvmlProcessInfo_t info = {0};
            info.pid = (unsigned int)pid;
            info.usedGpuMemory = bytes;
            info.gpuInstanceId = 0xFFFFFFFFu;
            info.computeInstanceId = 0xFFFFFFFFu;
            out[n] = info;
        }
        n++;
    }
    closedir(proc);
    return n;
}

/* Copies up to `room` processes of the list on GPU `gpu` to `out`; returns how many there are. */
static unsigned int for_each_process(int gpu, nvmlProcessInfo_t *out, unsigned int room) {
    char buf[4096];
    const char *p = process_list(buf, sizeof buf);
    unsigned int n = matching_processes(gpu, out, room, 0);
    while (p && *p) {
        char *end;
        nvmlProcessInfo_t info = {0};
        info.pid = (unsigned int)strtoul(p, &end, 10);
        info.gpuInstanceId = 0xFFFFFFFFu;
        info.computeInstanceId = 0xFFFFFFFFu;
        if (*end == ':')
            end++;
        if (*end == '-') {
            info.usedGpuMemory = NOT_AVAILABLE;
            end++;
        } else {
            info.usedGpuMemory = strtoull(end, &end, 10);
        }
        long on = 0;
        if (*end == '@')
            on = strtol(end + 1, &end, 10);
        if (on == gpu) {
            if (out && n < room)
                out[n] = info;
            n++;
        }
        p = strchr(end, ',');
        if (p)
            p++;
    }
    return n;
}

nvmlReturn_t nvmlInit_v2(void) {
    const char *forced = env("FAKE_NVML_INIT_RESULT");
    if (forced && strtol(forced, NULL, 10) != 0)
        return (nvmlReturn_t)strtol(forced, NULL, 10);
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    const char *value = env("FAKE_NVML_DRIVER_VERSION");
    if (!value)
        value = "580.159.04";
    if (!version)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(version, value);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= device_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)(uintptr_t)(index + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    int i = index_of(device);
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !name)
        return NVML_ERROR_INVALID_ARGUMENT;
    int n = getenv("FAKE_CUDA_SAME_MODEL") ? snprintf(name, length, "Fake NVIDIA GPU")
                                           : snprintf(name, length, "Fake NVIDIA GPU %d", i);
    if ((unsigned int)n >= length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    int i = index_of(device);
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !uuid)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((unsigned int)snprintf(uuid, length, "GPU-fa4e0000-0000-0000-0000-0000000000%02x", i) >= length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    int i = index_of(device);
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_t infos[64];
    unsigned int n = for_each_process(i, infos, 64);
    unsigned long long used = 0;
    for (unsigned int k = 0; k < n && k < 64; k++)
        if (infos[k].usedGpuMemory != NOT_AVAILABLE)
            used += infos[k].usedGpuMemory;
    memory->total = total_memory();
    memory->used = used < memory->total ? used : memory->total;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    int i = index_of(device);
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !count || (*count > 0 && !infos))
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int room = *count;
    unsigned int n = for_each_process(i, infos, room);
    *count = n;
    return n > room ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}
