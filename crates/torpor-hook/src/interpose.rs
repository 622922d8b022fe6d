//! The CUDA allocation calls this library defines, so that with `LD_PRELOAD` it receives the
//! program's calls before libcudart and libcuda do.
//!
//! With `TORPOR_HOOK_CUDA=1`, an allocation of at least the GPU's VMM granularity (2 MiB on an
//! H100) becomes a segment: addresses reserved, exportable memory created and mapped read-write
//! on the GPU of the calling thread's current context. Everything else goes to the next
//! definition (`dlsym(RTLD_NEXT, …)`): smaller allocations, every call without the variable, and
//! any allocation the cuda backend cannot make for a reason other than lack of memory (logged
//! once on stderr; that memory then stays in the driver's checkpoint, which is correct, only
//! slower). Lack of memory is the caller's usual error (`cudaErrorMemoryAllocation`,
//! `CUDA_ERROR_OUT_OF_MEMORY`, both 2), so PyTorch's caching allocator frees its cache and
//! retries as it would.
//!
//! The thread's current context is left as the caller had it. Nothing here unwinds into the
//! caller: a panic becomes an error code.

use std::ffi::{c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use torpor_cuda::CudaError;
use torpor_device::DeviceError;

use crate::error::{set_last_error, HookError};
use crate::hook::{cuda_interposition_enabled, hook};

/// No GPU has a VMM granularity below 2 MiB, so smaller requests skip every driver query.
const SMALLEST_GRANULARITY: usize = 2 << 20;

const SUCCESS: c_int = 0;
/// `cudaErrorInvalidValue`, `CUDA_ERROR_INVALID_VALUE`.
const INVALID_VALUE: c_int = 1;
/// `cudaErrorMemoryAllocation`, `CUDA_ERROR_OUT_OF_MEMORY`.
const OUT_OF_MEMORY: c_int = 2;
/// `cudaErrorInitializationError`, `CUDA_ERROR_NOT_INITIALIZED`: the next definition is absent.
pub(crate) const NOT_INITIALIZED: c_int = 3;

type CudaMalloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type CudaFree = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuMemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type CuMemFree = unsafe extern "C" fn(u64) -> c_int;

/// The next definition of a symbol after this library's, looked up once it is found.
///
/// `dlsym(RTLD_NEXT)` searches the global scope only. A library a Python extension pulled in
/// with `dlopen(RTLD_LOCAL)` (CuPy's libcudart, say) is not there, yet its callers still reach
/// this library's definition first, because the global scope precedes their own. So when
/// `RTLD_NEXT` finds nothing, every loaded object other than this one is asked in turn.
pub(crate) struct Next {
    name: &'static CStr,
    /// 0: not found yet; else the address.
    address: AtomicUsize,
}

impl Next {
    pub(crate) const fn new(name: &'static CStr) -> Self {
        Next {
            name,
            address: AtomicUsize::new(0),
        }
    }

    pub(crate) fn address(&self) -> Option<usize> {
        let address = self.address.load(Ordering::Acquire);
        if address != 0 {
            return Some(address);
        }
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name only looks the symbol up.
        let mut found = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr()) } as usize;
        if found == 0 {
            found = in_any_other_object(self.name).unwrap_or(0);
        }
        // Not cached while absent: the library defining it may be loaded later.
        if found != 0 {
            self.address.store(found, Ordering::Release);
        }
        (found != 0).then_some(found)
    }
}

/// The first definition of `name` in a loaded object other than this library.
fn in_any_other_object(name: &CStr) -> Option<usize> {
    struct Search<'a> {
        name: &'a CStr,
        own_base: usize,
        found: Option<usize>,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info and the `data` pointer given below.
        let (info, search) = unsafe { (&*info, &mut *(data as *mut Search<'_>)) };
        if info.dlpi_name.is_null() || info.dlpi_addr as usize == search.own_base {
            return 0;
        }
        // SAFETY: dlpi_name is a NUL-terminated path of a loaded object (empty for the program).
        let path = unsafe { CStr::from_ptr(info.dlpi_name) };
        if path.to_bytes().is_empty() {
            return 0;
        }
        // SAFETY: RTLD_NOLOAD only returns a handle to an object that is already loaded, and the
        // handle's reference is dropped again at once.
        let symbol = unsafe {
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if handle.is_null() {
                return 0;
            }
            let symbol = libc::dlsym(handle, search.name.as_ptr()) as usize;
            libc::dlclose(handle);
            symbol
        };
        if symbol != 0 && object_base(symbol) != Some(search.own_base) {
            search.found = Some(symbol);
            return 1;
        }
        0
    }
    let own_base = object_base(in_any_other_object as *const () as usize)?;
    let mut search = Search {
        name,
        own_base,
        found: None,
    };
    // SAFETY: the callback only reads what dl_iterate_phdr hands it and writes `search`.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut search as *mut Search<'_> as *mut c_void) };
    search.found
}

/// The load address of the object holding `address`.
fn object_base(address: usize) -> Option<usize> {
    // SAFETY: Dl_info is plain data; dladdr fills it or returns 0.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the process's link map.
    let ok = unsafe { libc::dladdr(address as *const c_void, &mut info) };
    (ok != 0).then_some(info.dli_fbase as usize)
}

static NEXT_CUDA_MALLOC: Next = Next::new(c"cudaMalloc");
static NEXT_CUDA_FREE: Next = Next::new(c"cudaFree");
static NEXT_CU_MEM_ALLOC: Next = Next::new(c"cuMemAlloc_v2");
static NEXT_CU_MEM_FREE: Next = Next::new(c"cuMemFree_v2");

macro_rules! next_fn {
    ($next:expr, $ty:ty) => {
        match $next.address() {
            // SAFETY: the symbol of that name in libcudart/libcuda/libnccl has this C
            // signature (cuda_runtime_api.h, cuda.h, nccl.h).
            Some(address) => Some(unsafe { std::mem::transmute::<usize, $ty>(address) }),
            None => None,
        }
    };
}
pub(crate) use next_fn;

fn warn_once(flag: &AtomicBool, what: &str, error: &HookError) {
    if !flag.swap(true, Ordering::Relaxed) {
        eprintln!(
            "torpor-hook: {what}: {error}; allocations go to the CUDA driver as usual (they stay \
             in the driver's checkpoint)"
        );
    }
}

/// What became of an allocation request.
enum Allocation {
    Segment(u64),
    /// Not for the hook: call the next definition.
    PassOn,
    OutOfMemory,
}

fn is_out_of_memory(error: &HookError) -> bool {
    let code = match error {
        HookError::Cuda(CudaError::Call { code, .. }) => *code,
        HookError::Device(DeviceError::Cuda(CudaError::Call { code, .. })) => *code,
        _ => return false,
    };
    code == OUT_OF_MEMORY
}

/// Makes a segment of `size` bytes on the current context's GPU when the hook should.
/// `init_context` makes a context current when none is (the runtime does so lazily).
fn allocate(size: usize, init_context: Option<&dyn Fn()>) -> Allocation {
    static UNAVAILABLE: AtomicBool = AtomicBool::new(false);
    static FAILED: AtomicBool = AtomicBool::new(false);
    if !cuda_interposition_enabled() || size < SMALLEST_GRANULARITY {
        return Allocation::PassOn;
    }
    let hook = hook();
    let vmm = match hook
        .driver()
        .and_then(|driver| driver.vmm().map_err(HookError::from))
    {
        Ok(vmm) => vmm,
        Err(e) => {
            warn_once(&UNAVAILABLE, "cannot use the CUDA driver", &e);
            set_last_error(&e);
            return Allocation::PassOn;
        }
    };
    let ordinal = match (vmm.current_device(), init_context) {
        (Ok(ordinal), _) => ordinal,
        (Err(_), Some(init)) => {
            init();
            match vmm.current_device() {
                Ok(ordinal) => ordinal,
                Err(_) => return Allocation::PassOn,
            }
        }
        // No context: the next definition returns the error the caller expects.
        (Err(_), None) => return Allocation::PassOn,
    };
    let made = hook.keeping_context(|| {
        let device = hook.cuda_device(ordinal)?;
        if size < torpor_device::Device::granularity(&*device) {
            return Ok(None);
        }
        hook.alloc_cuda(&device, ordinal, size).map(Some)
    });
    match made {
        Ok(Some(segment)) => Allocation::Segment(segment.va),
        Ok(None) => Allocation::PassOn,
        Err(e) => {
            set_last_error(&e);
            if is_out_of_memory(&e) {
                Allocation::OutOfMemory
            } else {
                warn_once(&FAILED, "cannot make a segment", &e);
                Allocation::PassOn
            }
        }
    }
}

/// Frees `va` if it is a segment: `None` when it is not (call the next definition).
fn free(va: u64) -> Option<Result<(), HookError>> {
    if va == 0 || !cuda_interposition_enabled() {
        return None;
    }
    let hook = hook();
    if !hook.is_segment(va) {
        return None;
    }
    Some(hook.keeping_context(|| hook.free(va)))
}

fn free_code(result: Result<(), HookError>) -> c_int {
    match result {
        Ok(()) => SUCCESS,
        Err(e) => {
            set_last_error(&e);
            match e {
                HookError::Cuda(CudaError::Call { code, .. })
                | HookError::Device(DeviceError::Cuda(CudaError::Call { code, .. })) => code,
                _ => INVALID_VALUE,
            }
        }
    }
}

/// Runs `f`, turning a panic into `code`.
pub(crate) fn guarded(call: &'static str, code: c_int, f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        set_last_error(&HookError::Panicked { call });
        code
    })
}

/// `cudaMalloc` (libcudart).
///
/// # Safety
/// As for `cudaMalloc`: `ptr` is null or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    guarded("cudaMalloc", OUT_OF_MEMORY, || {
        let next = next_fn!(NEXT_CUDA_MALLOC, CudaMalloc);
        if !ptr.is_null() {
            // The runtime makes its context current on its first real call; cudaFree(NULL) is
            // the documented way to make it do so.
            let init = || {
                if let Some(next_free) = next_fn!(NEXT_CUDA_FREE, CudaFree) {
                    // SAFETY: cudaFree(NULL) frees nothing; it initialises the runtime.
                    unsafe { next_free(std::ptr::null_mut()) };
                }
            };
            match allocate(size, Some(&init)) {
                Allocation::Segment(va) => {
                    // SAFETY: `ptr` is non-null and, per the contract, writable.
                    unsafe { *ptr = va as *mut c_void };
                    return SUCCESS;
                }
                Allocation::OutOfMemory => return OUT_OF_MEMORY,
                Allocation::PassOn => {}
            }
        }
        match next {
            // SAFETY: the caller's arguments, passed on unchanged.
            Some(next) => unsafe { next(ptr, size) },
            None => NOT_INITIALIZED,
        }
    })
}

/// `cudaFree` (libcudart).
///
/// # Safety
/// As for `cudaFree`.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    guarded("cudaFree", INVALID_VALUE, || {
        if let Some(result) = free(ptr as u64) {
            return free_code(result);
        }
        match next_fn!(NEXT_CUDA_FREE, CudaFree) {
            // SAFETY: the caller's argument, passed on unchanged.
            Some(next) => unsafe { next(ptr) },
            None => NOT_INITIALIZED,
        }
    })
}

/// `cuMemAlloc_v2` (libcuda; what `cuMemAlloc` means in cuda.h).
///
/// # Safety
/// As for `cuMemAlloc_v2`: `ptr` is null or valid for writing one `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut u64, size: usize) -> c_int {
    guarded("cuMemAlloc_v2", OUT_OF_MEMORY, || {
        if !ptr.is_null() {
            match allocate(size, None) {
                Allocation::Segment(va) => {
                    // SAFETY: `ptr` is non-null and, per the contract, writable.
                    unsafe { *ptr = va };
                    return SUCCESS;
                }
                Allocation::OutOfMemory => return OUT_OF_MEMORY,
                Allocation::PassOn => {}
            }
        }
        match next_fn!(NEXT_CU_MEM_ALLOC, CuMemAlloc) {
            // SAFETY: the caller's arguments, passed on unchanged.
            Some(next) => unsafe { next(ptr, size) },
            None => NOT_INITIALIZED,
        }
    })
}

/// `cuMemFree_v2` (libcuda).
///
/// # Safety
/// As for `cuMemFree_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: u64) -> c_int {
    guarded("cuMemFree_v2", INVALID_VALUE, || {
        if let Some(result) = free(ptr) {
            return free_code(result);
        }
        match next_fn!(NEXT_CU_MEM_FREE, CuMemFree) {
            // SAFETY: the caller's argument, passed on unchanged.
            Some(next) => unsafe { next(ptr) },
            None => NOT_INITIALIZED,
        }
    })
}
