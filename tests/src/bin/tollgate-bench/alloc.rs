//! A counting global allocator: live heap bytes and blocks, for the memory
//! figures of the embedded backend. Off until [`start`]: then every allocation
//! and free adds to two counters (relaxed atomics); before it, one relaxed load.
// The project's one `unsafe`: a global allocator is an unsafe trait.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

#[derive(Debug)]
pub struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static BYTES: AtomicI64 = AtomicI64::new(0);
static BLOCKS: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is forwarded to `System` unchanged; the counters only
// observe the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() && ON.load(Ordering::Relaxed) {
            BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
            BLOCKS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        if ON.load(Ordering::Relaxed) {
            BYTES.fetch_sub(layout.size() as i64, Ordering::Relaxed);
            BLOCKS.fetch_sub(1, Ordering::Relaxed);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() && ON.load(Ordering::Relaxed) {
            BYTES.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
}

/// Live heap bytes and blocks allocated since [`start`] (frees of blocks
/// allocated before it can make them negative: compare two readings).
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    pub bytes: i64,
    pub blocks: i64,
}

pub fn start() {
    ON.store(true, Ordering::SeqCst);
}

pub fn counting() -> bool {
    ON.load(Ordering::SeqCst)
}

pub fn reading() -> Reading {
    Reading {
        bytes: BYTES.load(Ordering::SeqCst),
        blocks: BLOCKS.load(Ordering::SeqCst),
    }
}
