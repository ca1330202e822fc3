//! Memory lent to the kernel: what operations in flight read or write, held by a type that
//! gives it back only once every one of those operations has completed.
//!
//! An io_uring operation carries raw pointers. Between its submission and its (last)
//! completion the kernel may read or write the memory they point to at any moment, so that
//! memory must not be freed, reused or handed to anyone else. [`Lent`] makes this a property
//! of the value rather than of a convention:
//!
//! - [`Lent::lend`] is the only way to point an operation at the value, and it counts one more
//!   operation outstanding;
//! - only [`Lent::complete`], called from the completion path (or when a submission failed,
//!   so the operation never existed), counts one back;
//! - the value is handed out ([`Lent::get_mut`], [`Lent::reclaim`]) only while
//!   no operation is outstanding;
//! - dropped with operations outstanding (a bug), it leaks the value and logs an error rather
//!   than free memory the kernel may still write: a leak instead of a use-after-free.
//!
//! Invariant: `outstanding` is the number of submitted operations that point into the value
//! and whose last completion has not been reaped.

use std::mem::ManuallyDrop;

use tracing::error;

/// A value that operations in flight may point into (see the module documentation).
pub struct Lent<T> {
    /// Dropped in `Drop` only when nothing is outstanding; moved out only by `reclaim`.
    value: ManuallyDrop<T>,
    outstanding: usize,
}

impl<T> Lent<T> {
    /// A value no operation uses yet.
    pub fn new(value: T) -> Lent<T> {
        Lent {
            value: ManuallyDrop::new(value),
            outstanding: 0,
        }
    }

    /// Lends the value to one more operation: `point` takes from it what the operation's
    /// submission entry points at (addresses, lengths, a registered buffer's index). The
    /// caller then submits that entry, or calls [`Lent::complete`] if it cannot.
    pub(super) fn lend<R>(&mut self, point: impl FnOnce(&mut T) -> R) -> R {
        self.outstanding += 1;
        point(&mut self.value)
    }

    /// One operation that was lent the value has completed for the last time (or was never
    /// submitted): the kernel no longer uses the value on its behalf.
    pub fn complete(&mut self) {
        if self.outstanding == 0 {
            error!(
                kind = std::any::type_name::<T>(),
                "a completion for memory that was not lent"
            );
            return;
        }
        self.outstanding -= 1;
    }

    /// Whether an operation in flight still uses the value.
    pub fn is_lent(&self) -> bool {
        self.outstanding > 0
    }

    /// The value, mutably, when no operation uses it.
    pub fn get_mut(&mut self) -> Option<&mut T> {
        if self.is_lent() {
            return None;
        }
        Some(&mut self.value)
    }

    /// The value back, once no operation uses it; otherwise `self` unchanged.
    pub fn reclaim(self) -> Result<T, Lent<T>> {
        if self.is_lent() {
            return Err(self);
        }
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never used again and, being ManuallyDrop, never dropped, so the
        // value is moved out exactly once and not dropped a second time by `Lent::drop`.
        Ok(unsafe { ManuallyDrop::take(&mut this.value) })
    }
}

impl<T> Drop for Lent<T> {
    fn drop(&mut self) {
        if self.is_lent() {
            // The kernel may still read or write this memory: leaking it is the safe choice.
            error!(
                kind = std::any::type_name::<T>(),
                outstanding = self.outstanding,
                "memory dropped while lent to the kernel: leaking it"
            );
            return;
        }
        // SAFETY: `drop` runs once and the value is not used afterwards; `reclaim`, the only
        // other place that takes the value, never lets `Lent::drop` run.
        unsafe { ManuallyDrop::drop(&mut self.value) }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    /// Sets its flag when dropped.
    struct Flag(Rc<Cell<bool>>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.set(true);
        }
    }

    fn flagged() -> (Lent<Flag>, Rc<Cell<bool>>) {
        let dropped = Rc::new(Cell::new(false));
        (Lent::new(Flag(Rc::clone(&dropped))), dropped)
    }

    #[test]
    fn lend_complete_reclaim() {
        let mut lent = Lent::new(vec![1u8, 2, 3]);
        assert!(lent.get_mut().is_some());
        let ptr = lent.lend(|v| v.as_mut_ptr());
        assert!(!ptr.is_null());
        assert!(lent.is_lent());
        assert!(lent.get_mut().is_none());
        let Err(mut lent) = lent.reclaim() else {
            panic!("reclaimed while lent");
        };
        lent.complete();
        assert!(!lent.is_lent());
        assert_eq!(lent.get_mut().map(|v| v.len()), Some(3));
        assert_eq!(lent.reclaim().ok(), Some(vec![1, 2, 3]));
    }

    #[test]
    fn every_operation_must_complete() {
        let mut lent = Lent::new(0u32);
        lent.lend(|_| ());
        lent.lend(|_| ());
        lent.complete();
        assert!(lent.is_lent());
        lent.complete();
        assert!(!lent.is_lent());
        // A stray completion does not underflow the count.
        lent.complete();
        assert!(!lent.is_lent());
    }

    #[test]
    fn dropped_while_lent_leaks_instead_of_freeing() {
        let (mut lent, dropped) = flagged();
        lent.lend(|_| ());
        drop(lent);
        assert!(!dropped.get(), "memory lent to the kernel was freed");
    }

    #[test]
    fn dropped_when_returned_frees() {
        let (mut lent, dropped) = flagged();
        lent.lend(|_| ());
        lent.complete();
        drop(lent);
        assert!(dropped.get());
    }

    #[test]
    fn reclaimed_value_is_dropped_once_by_its_new_owner() {
        let (lent, dropped) = flagged();
        let Ok(flag) = lent.reclaim() else {
            panic!("not lent, yet not reclaimable");
        };
        assert!(!dropped.get());
        drop(flag);
        assert!(dropped.get());
    }
}
