// uffd-wp async + PAGEMAP_SCAN(PAGE_IS_WRITTEN): does this kernel track written pages without
// soft-dirty, and at what cost (docs/checkpoints.md, "Written pages without soft-dirty").
// Build and run as root: gcc -O2 -o /tmp/uffd_wp_probe bench/concurrent/uffd_wp_probe.c && /tmp/uffd_wp_probe
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Debian's linux-libc-dev here is 6.1: define what 6.7 added. */
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#endif
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#endif
#ifndef PAGEMAP_SCAN
struct page_region { uint64_t start, end, categories; };
struct pm_scan_arg {
	uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages,
		category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define PAGE_IS_WPALLOWED (1 << 0)
#define PAGE_IS_WRITTEN (1 << 1)
#define PAGE_IS_FILE (1 << 2)
#define PAGE_IS_PRESENT (1 << 3)
#define PAGE_IS_SWAPPED (1 << 4)
#define PAGE_IS_PFNZERO (1 << 5)
#define PAGE_IS_HUGE (1 << 6)
#define PM_SCAN_WP_MATCHING (1 << 0)
#define PM_SCAN_CHECK_WPASYNC (1 << 1)
#endif

#define PG 4096UL
#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fprintf(stderr, ": %s\n", strerror(errno)); exit(1); } while (0)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }

static int uffd_new(int flags)
{
	int fd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | flags);
	if (fd < 0) DIE("userfaultfd");
	struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED };
	if (ioctl(fd, UFFDIO_API, &api)) DIE("UFFDIO_API(WP_ASYNC|WP_UNPOPULATED)");
	return fd;
}

static void uffd_reg_wp(int fd, void *p, size_t len)
{
	struct uffdio_register r = { .range = { (uintptr_t)p, len }, .mode = UFFDIO_REGISTER_MODE_WP };
	if (ioctl(fd, UFFDIO_REGISTER, &r)) DIE("UFFDIO_REGISTER(WP)");
}

static void uffd_wp(int fd, void *p, size_t len, int on)
{
	struct uffdio_writeprotect w = { .range = { (uintptr_t)p, len }, .mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0 };
	if (ioctl(fd, UFFDIO_WRITEPROTECT, &w)) DIE("UFFDIO_WRITEPROTECT");
}

static struct page_region *vec;
static const size_t VEC_LEN = 1 << 18;

/* Scans [p, p+len) for pages with PAGE_IS_WRITTEN; with reset, write-protects them again
 * in the same walk (PM_SCAN_WP_MATCHING). Returns the number of written pages. */
static long scan_written(int pm, void *p, size_t len, int reset, int print, long *nregions)
{
	long pages = 0, nr = 0;
	uint64_t start = (uintptr_t)p, end = start + len, seen = start;
	while (start < end) {
		struct pm_scan_arg a = { .size = sizeof(a), .start = start, .end = end,
			.flags = reset ? (PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC) : 0,
			.vec = (uintptr_t)vec, .vec_len = VEC_LEN,
			.category_mask = PAGE_IS_WRITTEN, .return_mask = PAGE_IS_WRITTEN | PAGE_IS_HUGE };
		long n = ioctl(pm, PAGEMAP_SCAN, &a);
		if (n < 0) DIE("PAGEMAP_SCAN");
		for (long i = 0; i < n; i++) {
			/* 6.18: a scan that returned every region can still report walk_end < end, and the
			 * next call returns the tail again (seen: the last 32 MiB); skip what was seen. */
			if (vec[i].end <= seen) continue;
			if (vec[i].start < seen) vec[i].start = seen;
			seen = vec[i].end;
			pages += (vec[i].end - vec[i].start) / PG;
			if (print)
				printf("    written: pages %5lu..%5lu%s\n", (unsigned long)((vec[i].start - (uintptr_t)p) / PG),
				       (unsigned long)((vec[i].end - (uintptr_t)p) / PG - 1), vec[i].categories & PAGE_IS_HUGE ? " (huge)" : "");
		}
		nr += n;
		start = a.walk_end;
	}
	if (nregions) *nregions = nr;
	return pages;
}

static long count_cat(int pm, void *p, size_t len, uint64_t cat)
{
	struct pm_scan_arg a = { .size = sizeof(a), .start = (uintptr_t)p, .end = (uintptr_t)p + len,
		.vec = (uintptr_t)vec, .vec_len = VEC_LEN, .category_mask = cat, .return_mask = cat };
	long n = ioctl(pm, PAGEMAP_SCAN, &a), pages = 0;
	if (n < 0) DIE("PAGEMAP_SCAN");
	for (long i = 0; i < n; i++) pages += (vec[i].end - vec[i].start) / PG;
	return pages;
}

static void send_fd(int sk, int fd)
{
	char c = 0, buf[CMSG_SPACE(sizeof(int))] = { 0 };
	struct iovec io = { &c, 1 };
	struct msghdr m = { .msg_iov = &io, .msg_iovlen = 1, .msg_control = buf, .msg_controllen = sizeof(buf) };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
	cm->cmsg_level = SOL_SOCKET; cm->cmsg_type = SCM_RIGHTS; cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	if (sendmsg(sk, &m, 0) != 1) DIE("sendmsg");
}

static int recv_fd(int sk)
{
	char c, buf[CMSG_SPACE(sizeof(int))];
	struct iovec io = { &c, 1 };
	struct msghdr m = { .msg_iov = &io, .msg_iovlen = 1, .msg_control = buf, .msg_controllen = sizeof(buf) };
	if (recvmsg(sk, &m, 0) != 1) DIE("recvmsg");
	int fd; memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&m)), sizeof(int));
	return fd;
}

static void *map_anon(size_t len, int advice)
{
	/* 2 MiB-aligned so THP can back it when asked. */
	char *p = mmap(NULL, len + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) DIE("mmap");
	p = (char *)(((uintptr_t)p + (2 << 20) - 1) & ~((uintptr_t)(2 << 20) - 1));
	if (advice >= 0 && madvise(p, len, advice)) DIE("madvise");
	return p;
}

/* 1: the owner tracks its own 64 MiB (half populated, half never touched). */
static void test_self(void)
{
	size_t len = 64UL << 20;
	char *p = map_anon(len, MADV_NOHUGEPAGE);
	memset(p, 1, len / 2);
	int uffd = uffd_new(UFFD_USER_MODE_ONLY); /* the flag an unprivileged process must use */
	int pm = open("/proc/self/pagemap", O_RDONLY);
	uffd_reg_wp(uffd, p, len);
	uffd_wp(uffd, p, len, 1);
	printf("[self] 64 MiB registered WP-async and write-protected; written now: %ld\n", scan_written(pm, p, len, 0, 0, NULL));
	long idx[] = { 0, 1, 2, 100, 8191, 10000 /* populated */, 12000, 16383 /* never touched */ };
	for (size_t i = 0; i < sizeof(idx) / sizeof(idx[0]); i++) p[idx[i] * PG + 7] = 2;
	/* a write by the kernel (read(2) into the buffer) into page 5000: */
	int z = open("/dev/zero", O_RDONLY);
	if (read(z, p + 5000 * PG, 16) != 16) DIE("read into WP page");
	close(z);
	/* a read-only touch must not count: */
	volatile char s = p[3000 * PG]; (void)s; s = p[14000 * PG];
	printf("[self] wrote pages 0,1,2,100,8191,10000 (populated), 12000,16383 (unpopulated), read(2) into 5000, read 3000,14000:\n");
	long n = scan_written(pm, p, len, 1 /* get and re-protect atomically */, 1, NULL);
	printf("[self] %ld written pages reported (expected 9); WPALLOWED pages: %ld\n", n, count_cat(pm, p, len, PAGE_IS_WPALLOWED));
	p[20 * PG] = 3;
	printf("[self] after the reset scan, one more write: %ld written (expected 1)\n", scan_written(pm, p, len, 0, 0, NULL));
	close(pm); close(uffd); munmap(p, len);
}

/* 2: the owner creates the uffd, hands it over SCM_RIGHTS and closes it; another process
 * write-protects through it and scans /proc/PID/pagemap. */
static void test_cross(void)
{
	size_t len = 64UL << 20;
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) DIE("socketpair");
	char *p = map_anon(len, MADV_NOHUGEPAGE); /* same address in the child after fork */
	pid_t pid = fork();
	if (pid == 0) {
		char c;
		close(sv[0]);
		memset(p, 1, len);
		int uffd = uffd_new(UFFD_USER_MODE_ONLY);
		uffd_reg_wp(uffd, p, len);
		send_fd(sv[1], uffd);
		close(uffd); /* the worker keeps no uffd: CRIU would refuse to dump it (files-ext.c dump_unsupp_fd) */
		if (read(sv[1], &c, 1) != 1) _exit(1); /* daemon has write-protected */
		for (int i = 0; i < 5; i++) p[(i * 3000 + 7) * PG] = 9;
		if (write(sv[1], "w", 1) != 1) _exit(1);
		if (read(sv[1], &c, 1) != 1) _exit(1); /* daemon closed its uffd */
		p[40 * PG] = 9;
		if (write(sv[1], "w", 1) != 1) _exit(1);
		if (read(sv[1], &c, 1) != 1) _exit(1);
		_exit(0);
	}
	close(sv[1]);
	char c, path[64];
	int uffd = recv_fd(sv[0]);
	snprintf(path, sizeof(path), "/proc/%d/pagemap", pid);
	int pm = open(path, O_RDONLY);
	if (pm < 0) DIE("open %s", path);
	double t = now();
	uffd_wp(uffd, p, len, 1); /* UFFDIO_WRITEPROTECT on the worker's mm, from another process */
	printf("[cross] daemon write-protected the worker's 64 MiB through the passed uffd in %.2f ms\n", (now() - t) * 1e3);
	if (write(sv[0], "g", 1) != 1 || read(sv[0], &c, 1) != 1) DIE("sync");
	printf("[cross] worker wrote pages 7,3007,6007,9007,12007; daemon's scan of %s:\n", path);
	long n = scan_written(pm, p, len, 1, 1, NULL);
	printf("[cross] %ld written pages (expected 5); WPALLOWED: %ld\n", n, count_cat(pm, p, len, PAGE_IS_WPALLOWED));
	close(uffd);
	if (write(sv[0], "g", 1) != 1 || read(sv[0], &c, 1) != 1) DIE("sync");
	printf("[cross] after the daemon closed the last uffd reference: WPALLOWED %ld, written %ld (registration is gone)\n",
	       count_cat(pm, p, len, PAGE_IS_WPALLOWED), scan_written(pm, p, len, 0, 0, NULL));
	if (write(sv[0], "q", 1) != 1) DIE("sync");
	waitpid(pid, NULL, 0);
	close(pm); munmap(p, len);
}

/* 3: timings on 1 GiB of populated anonymous memory. */
static void bench(const char *name, int advice)
{
	size_t len = 1UL << 30, npg = len / PG;
	char *p = map_anon(len, advice);
	memset(p, 1, len);
	int pm = open("/proc/self/pagemap", O_RDONLY);
	long huge = count_cat(pm, p, len, PAGE_IS_HUGE);
	int uffd = uffd_new(0);
	double t0 = now(); uffd_reg_wp(uffd, p, len);
	double t1 = now(); uffd_wp(uffd, p, len, 1);
	double t2 = now(); long w = scan_written(pm, p, len, 0, 0, NULL);
	double t3 = now();
	printf("[%s] 1 GiB populated (%ld pages THP-backed): register %.2f ms, UFFDIO_WRITEPROTECT %.2f ms, scan with 0 written %.2f ms (%ld)\n",
	       name, huge, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, w);
	/* every 16th page written */
	t0 = now(); for (size_t i = 0; i < npg; i += 16) p[i * PG] = 2;
	t1 = now(); long nr; w = scan_written(pm, p, len, 0, 0, &nr);
	t2 = now(); long w2 = scan_written(pm, p, len, 1, 0, NULL);
	t3 = now();
	printf("[%s] 16384 pages written (1 in 16): writes %.2f ms (%.2f us/fault), scan %.2f ms (%ld pages, %ld regions returned), scan+re-protect %.2f ms (%ld)\n",
	       name, (t1 - t0) * 1e3, (t1 - t0) * 1e6 / (npg / 16), (t2 - t1) * 1e3, w, nr, (t3 - t2) * 1e3, w2);
	/* every page written */
	t0 = now(); for (size_t i = 0; i < npg; i++) p[i * PG] = 3;
	t1 = now(); w = scan_written(pm, p, len, 0, 0, &nr);
	t2 = now(); w2 = scan_written(pm, p, len, 1, 0, NULL);
	t3 = now();
	printf("[%s] all 262144 pages written: writes %.2f ms (%.2f us/fault), scan %.2f ms (%ld pages, %ld regions), scan+re-protect %.2f ms (%ld)\n",
	       name, (t1 - t0) * 1e3, (t1 - t0) * 1e6 / npg, (t2 - t1) * 1e3, w, nr, (t3 - t2) * 1e3, w2);
	/* for comparison: the same 1 GiB scanned the way CRIU's pmc_fill does it */
	struct pm_scan_arg a = { .size = sizeof(a), .start = (uintptr_t)p, .end = (uintptr_t)p + len, .vec = (uintptr_t)vec,
		.vec_len = VEC_LEN, .category_inverted = PAGE_IS_PFNZERO | PAGE_IS_FILE, .category_mask = PAGE_IS_PFNZERO | PAGE_IS_FILE,
		.category_anyof_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED, .return_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED };
	t0 = now(); long n = ioctl(pm, PAGEMAP_SCAN, &a); t1 = now();
	uint64_t *buf = malloc(npg * 8);
	t2 = now(); if (pread(pm, buf, npg * 8, (uintptr_t)p / PG * 8) != (ssize_t)(npg * 8)) DIE("pread pagemap"); t3 = now();
	printf("[%s] reference: CRIU-style PAGEMAP_SCAN(PRESENT|SWAPPED) %.2f ms (%ld regions); pread of 2 MiB of pagemap %.2f ms\n",
	       name, (t1 - t0) * 1e3, n, (t3 - t2) * 1e3);
	free(buf); close(uffd); close(pm); munmap(p, len);
}

int main(void)
{
	vec = malloc(VEC_LEN * sizeof(*vec));
	int fd = syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
	struct uffdio_api api = { .api = UFFD_API, .features = 0 };
	if (fd < 0 || ioctl(fd, UFFDIO_API, &api)) DIE("userfaultfd probe");
	printf("kernel uffd features 0x%llx: WP_ASYNC %s, WP_UNPOPULATED %s, WP_HUGETLBFS_SHMEM %s\n", (unsigned long long)api.features,
	       api.features & UFFD_FEATURE_WP_ASYNC ? "yes" : "no", api.features & UFFD_FEATURE_WP_UNPOPULATED ? "yes" : "no",
	       api.features & UFFD_FEATURE_WP_HUGETLBFS_SHMEM ? "yes" : "no");
	close(fd);
	test_self();
	test_cross();
	bench("4K", MADV_NOHUGEPAGE);
	bench("THP", MADV_HUGEPAGE);
	return 0;
}
