//! Which client connection a request running on this thread came from, for the layers that
//! keep something per connection (the rate layer's per-connection limit). The dispatcher
//! enters a connection's scope around each request it runs; outside any (the attach queue,
//! the flush at shutdown) there is none.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

thread_local! {
    static CURRENT: Cell<Option<u64>> = const { Cell::new(None) };
}

static NEXT: AtomicU64 = AtomicU64::new(1);

/// A number no other connection of this process has had.
pub fn new_connection_id() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Runs `f` as connection `id`'s (nested scopes restore the outer one).
pub fn within<R>(id: u64, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<u64>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(Some(id))));
    f()
}

/// The connection whose request this thread is running, if any.
pub fn current() -> Option<u64> {
    CURRENT.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_names_its_connection_and_ends_with_it_even_on_panic() {
        assert_eq!(current(), None);
        let (a, b) = (new_connection_id(), new_connection_id());
        assert_ne!(a, b);
        within(a, || {
            assert_eq!(current(), Some(a));
            within(b, || assert_eq!(current(), Some(b)));
            assert_eq!(current(), Some(a));
        });
        let _ = std::panic::catch_unwind(|| within(a, || panic!("x")));
        assert_eq!(current(), None);
    }
}
