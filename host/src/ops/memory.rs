//! The daemon's allocator: mimalloc, and the memory a burst of work freed handed back to the
//! kernel once the thread that did it goes idle.
//!
//! mimalloc keeps the pages a thread freed for that thread to reuse, and returns unused ranges
//! to the kernel only after a delay, on a later call into the allocator. A daemon's threads go
//! idle right after a burst (a plugin of 100,000 devices decoded and applied, a checkpoint of
//! 10,000 allocations rewritten), so what the burst used stayed resident until the next one: a
//! plugin of 100,000 devices added 1.6 MB per 10,000 devices, of which 0.6 MB is its data.
//! Returning everything at once (`MIMALLOC_PURGE_DELAY=0`) made the 10,000-device update 40 %
//! slower; here it happens once, after the burst.
//!
//! [`Trimming`] counts, per thread, the bytes freed in blocks of at least [`LARGE`] (a
//! comparison per free; the small ones ride along with the large buffers of the same burst).
//! [`going_idle`] trims when the thread has freed [`TRIM_AFTER`] or more since it last went idle
//! (one burst; a busy node's steady traffic, a few buffers per call, never adds up to it):
//! it hands the thread's empty pages back to mimalloc's arenas, and a purger thread returns the
//! arenas' unused ranges to the kernel [`PURGE_AFTER`] later. It runs in the runtime workers'
//! park hook and, through [`pluglet_core::idle`], where a thread of its own waits for more work.
//! Hand-written: it is a few lines over mimalloc's own `mi_collect`, which no crate wraps.
//!
//! A plugin of 100,000 devices now adds 0.66–0.88 MB per 10,000 devices, and allocate 1 of
//! 100,000 is as fast as without the trim (BENCHMARKS.md, "a plugin of 100,000 devices").

use std::alloc::{GlobalAlloc, Layout};

use libmimalloc_sys as ffi;
use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Duration;

/// The smallest freed block the count takes in.
pub const LARGE: usize = 16 * 1024;
/// Bytes freed in large blocks after which a thread going idle trims.
pub const TRIM_AFTER: usize = 2 * 1024 * 1024;

thread_local! {
    /// Bytes this thread freed in large blocks since it last went idle. Const-initialized and
    /// without a destructor, so the allocator may touch it at any point of a thread's life.
    static FREED: Cell<usize> = const { Cell::new(0) };
}

/// mimalloc, counting what each thread frees in large blocks.
pub struct Trimming;

impl Trimming {
    /// The allocator.
    pub const fn new() -> Self {
        Self
    }
}

impl Default for Trimming {
    fn default() -> Self {
        Self::new()
    }
}

#[inline]
fn note_freed(size: usize) {
    if size >= LARGE {
        FREED.with(|freed| freed.set(freed.get().saturating_add(size)));
    }
}

/// The alignment every mimalloc block has (its blocks are whole words): a layout that asks for
/// no more is served by mimalloc's plain calls, which skip the aligned calls' checks (about 15
/// instructions on each of the hundred-odd allocations of a device allocation). The `mimalloc`
/// crate's allocator takes the aligned calls for every layout.
const WORD: usize = std::mem::size_of::<usize>();

// SAFETY: every call is forwarded to mimalloc, whose blocks are all aligned to at least a word:
// a layout aligned to a word or less is served by the plain calls (`mi_malloc`, `mi_zalloc`,
// `mi_realloc`), any other by the aligned ones, as the `mimalloc` crate does; `mi_free` frees
// both. The count beside them neither allocates nor touches the blocks.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Trimming {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_malloc(layout.size()).cast()
            } else {
                ffi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_zalloc(layout.size()).cast()
            } else {
                ffi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_freed(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { ffi::mi_free(ptr.cast()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // A large block that grows is usually moved, and the old one freed.
        note_freed(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_realloc(ptr.cast(), new_size).cast()
            } else {
                ffi::mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
            }
        }
    }
}

/// Trims if this thread freed [`TRIM_AFTER`] or more in large blocks since it last went idle,
/// and says whether it did; the count starts again either way. The hook of the runtime
/// workers' park and of [`pluglet_core::idle`].
///
/// The trim hands the thread's empty pages back to mimalloc's arenas (`mi_collect(false)`) and
/// asks the purger for a purge [`PURGE_AFTER`] later. Purging here, at once, made allocate 1 of
/// 100,000 devices 40 % slower: every call's buffers were returned to the kernel and faulted in
/// again by the next.
pub fn going_idle() -> bool {
    let trim = FREED.with(|freed| freed.replace(0) >= TRIM_AFTER);
    if trim {
        collect(false);
        if let Some(purger) = purger() {
            purger.unpark();
        }
    }
    trim
}

/// How long after a trim the purger returns the arenas' unused ranges to the kernel: a busy
/// node, which trims all the time, purges at most twice a second and reuses its buffers in
/// between.
pub const PURGE_AFTER: Duration = Duration::from_millis(500);

/// The thread that purges [`PURGE_AFTER`] after a trim (woken by `unpark`; several trims in
/// that time make one more purge). Started with the first trim; `None` if it cannot be.
fn purger() -> Option<&'static std::thread::Thread> {
    static PURGER: OnceLock<Option<std::thread::Thread>> = OnceLock::new();
    PURGER
        .get_or_init(|| {
            let spawned = std::thread::Builder::new()
                .name("memory-purge".into())
                .stack_size(64 * 1024)
                .spawn(|| {
                    loop {
                        std::thread::park();
                        std::thread::sleep(PURGE_AFTER);
                        collect(true);
                    }
                });
            match spawned {
                Ok(handle) => Some(handle.thread().clone()),
                Err(err) => {
                    tracing::warn!(error = %err, "cannot start the memory purger; freed memory stays with the allocator");
                    None
                }
            }
        })
        .as_ref()
}

/// `mi_collect`: frees this thread's empty pages to the arenas; `force` also returns every
/// unused arena range to the kernel at once instead of after mimalloc's purge delay.
#[allow(unsafe_code)]
fn collect(force: bool) {
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread outside an
    // allocator call.
    unsafe { libmimalloc_sys::mi_collect(force) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a thread of its own, so that the count starts at zero and no other test adds to it.
    fn on_a_fresh_thread(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(f).join().unwrap();
    }

    #[test]
    fn small_frees_are_not_counted_and_do_not_trim() {
        on_a_fresh_thread(|| {
            for _ in 0..TRIM_AFTER {
                note_freed(LARGE - 1);
            }
            assert_eq!(FREED.with(Cell::get), 0);
            assert!(!going_idle());
        });
    }

    #[test]
    fn a_thread_that_freed_enough_in_one_burst_trims_once_as_it_goes_idle() {
        on_a_fresh_thread(|| {
            note_freed(TRIM_AFTER / 2);
            assert!(!going_idle(), "below the mark: no trim");
            assert_eq!(FREED.with(Cell::get), 0, "the next burst counts from zero");
            note_freed(TRIM_AFTER / 2);
            assert!(!going_idle(), "two small bursts are not one large one");
            note_freed(TRIM_AFTER / 2);
            note_freed(TRIM_AFTER / 2);
            assert!(going_idle(), "at the mark: trimmed");
            assert_eq!(FREED.with(Cell::get), 0, "the count starts again");
            assert!(!going_idle(), "and the next idle does not trim again");
        });
    }
}
