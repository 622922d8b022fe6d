/*
 * A program that allocates device memory through the driver API the way any CUDA program does:
 * cuMemAlloc_v2 / cuMemFree_v2 resolved by the dynamic linker (linked against libcuda). Run with
 * LD_PRELOAD=libtorpor_hook.so it reaches the hook; it asks the hook's C API (found with
 * dlsym(RTLD_DEFAULT), so it is absent without the preload) what became of each allocation and
 * prints one "key=value" line per fact for the test to check.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size);
CUresult cuMemFree_v2(CUdeviceptr ptr);

struct segment {
    uint64_t va, size, order;
    int64_t first_use;
    uint32_t backend;
    int32_t ordinal;
    uint32_t mapped, read_only;
};

static size_t (*list)(struct segment *, size_t);
static int (*export_fd)(uint64_t);
static int (*release_all)(uint64_t *);
static int (*map_fd)(uint64_t, int, int);
static const char *(*last_error)(void);

static void print_segments(const char *when) {
    struct segment s[8];
    size_t n = list(s, 8);
    printf("%s.segments=%zu\n", when, n);
    for (size_t i = 0; i < n && i < 8; i++)
        printf("%s.segment=%llx,%llu,%u,%d,%u\n", when, (unsigned long long)s[i].va,
               (unsigned long long)s[i].size, s[i].backend, s[i].ordinal, s[i].mapped);
}

/* Threads allocating, writing and freeing segments at once; the failures they saw. */
static CUcontext shared_ctx;
static void *churn(void *arg) {
    long failures = 0;
    unsigned char tag = (unsigned char)(uintptr_t)arg;
    cuCtxSetCurrent(shared_ctx);
    for (int i = 0; i < 25; i++) {
        CUdeviceptr p = 0;
        if (cuMemAlloc_v2(&p, 2 << 20) != 0) {
            failures++;
            continue;
        }
        memset((void *)(uintptr_t)p, tag, 2 << 20);
        sched_yield();
        unsigned char *bytes = (unsigned char *)(uintptr_t)p;
        if (bytes[0] != tag || bytes[(2 << 20) - 1] != tag)
            failures++;
        if (cuMemFree_v2(p) != 0)
            failures++;
    }
    return (void *)failures;
}

static long run_threads(void) {
    pthread_t threads[6];
    long failures = 0;
    for (uintptr_t t = 0; t < 6; t++)
        pthread_create(&threads[t], NULL, churn, (void *)(t + 1));
    for (int t = 0; t < 6; t++) {
        void *result;
        pthread_join(threads[t], &result);
        failures += (long)result;
    }
    return failures;
}

int main(void) {
    list = (size_t(*)(struct segment *, size_t))dlsym(RTLD_DEFAULT, "torpor_hook_list");
    export_fd = (int (*)(uint64_t))dlsym(RTLD_DEFAULT, "torpor_hook_export");
    release_all = (int (*)(uint64_t *))dlsym(RTLD_DEFAULT, "torpor_hook_release_all");
    map_fd = (int (*)(uint64_t, int, int))dlsym(RTLD_DEFAULT, "torpor_hook_map");
    last_error = (const char *(*)(void))dlsym(RTLD_DEFAULT, "torpor_hook_last_error");
    printf("hook=%s\n", list ? "loaded" : "absent");
    if (!list)
        return 0;

    CUdeviceptr early = 0;
    printf("no_context.result=%d\n", cuMemAlloc_v2(&early, 4 << 20));

    CUdevice dev;
    CUcontext ctx, now = NULL;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx))
        return 2;
    CUdeviceptr big = 0, small = 0;
    int big_result = cuMemAlloc_v2(&big, (3 << 20) + 1);
    printf("big.result=%d\n", big_result);
    printf("small.result=%d\n", cuMemAlloc_v2(&small, 4096));
    printf("big=%llx\nsmall=%llx\n", big, small);
    cuCtxGetCurrent(&now);
    printf("context_kept=%d\n", now == ctx);
    print_segments("allocated");
    if (big_result != 0)
        return 0;

    /* The fake's device memory is host memory: write it, export it, look through the fd. */
    memset((void *)(uintptr_t)big, 0xab, (3 << 20) + 1);
    memset((void *)(uintptr_t)small, 0xcd, 4096);
    int fd = export_fd(big);
    unsigned char *view = fd >= 0 ? mmap(NULL, 4 << 20, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    printf("exported=%d\n", view != MAP_FAILED && view[0] == 0xab && view[3 << 20] == 0xab);
    if (view != MAP_FAILED)
        munmap(view, 4 << 20);
    printf("export_small=%d\n", export_fd(small));

    uint64_t bytes = 0;
    int released = release_all(&bytes);
    printf("release.result=%d\nrelease.bytes=%llu\n", released, (unsigned long long)bytes);
    print_segments("released");
    printf("map.result=%d\n", map_fd(big, fd, 0));
    if (fd >= 0)
        close(fd);
    printf("mapped_back=%d\n", ((unsigned char *)(uintptr_t)big)[12345] == 0xab);

    printf("free_big.result=%d\n", cuMemFree_v2(big));
    printf("free_small.result=%d\n", cuMemFree_v2(small));
    print_segments("freed");

    shared_ctx = ctx;
    printf("threads.failures=%ld\n", run_threads());
    print_segments("threads");
    printf("last_error=%s\n", last_error());
    return 0;
}
