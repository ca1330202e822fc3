//! Leases: the rule that a place an engine was given stays that request's until its I/O
//! completes (the seeds' vhost-net patch: a buffer handed to a zero-copy path is released only
//! when the I/O that uses it has completed).
//!
//! An engine holds a file offset across network waits: a write's payload is received into
//! the place its header was mapped to, a read's reply is spliced from the file when the socket
//! takes it. A backend whose maps change while the server runs - a disk image, where imago
//! reallocates a cluster on copy-on-write or on a write to a zero cluster and hands the freed
//! cluster to the next allocation - would otherwise let a late payload land on another
//! client's acknowledged data, or send another client's data. Such a backend answers a
//! [`Leases`] table ([`Backend::leases`](super::Backend::leases)), and the stack then
//! - leases every map it answers ([`Lease`]: the guest range rounded out to the table's
//!   granule, an image's cluster), and answers "not mappable now" (the stack's own methods)
//!   while a change of an overlapping range runs or waits;
//! - registers every operation that may change a map (write, trim, zero through the stack)
//!   as a [`Change`], which starts only once no lease and no other change overlaps it. The
//!   dispatcher parks such a request here without a thread
//!   ([`Leases::when_changeable`]) and hands it to the worker pool when the last lease in its
//!   way ends, so a client that stalls mid-payload holds up only requests to the clusters it
//!   holds, never a worker.
//!
//! Changes of overlapping ranges exclude each other too: trimming computes the file blocks to
//! punch before imago marks the clusters zero and punches them after, and a concurrent write
//! reallocating the same cluster must not free those blocks in between.
//!
//! The table is bounded by the requests in flight (each lease and each waiting change is one
//! request of a connection's in-flight budget), so it needs no limit of its own.
//!
//! What a lease cannot cover: a read spliced from the file ends its lease when the socket has
//! taken the bytes, but the socket keeps a reference to the page cache's page until the peer
//! acknowledges them; if the cluster is reused and rewritten before that, a TCP
//! retransmission carries the new bytes (every sendfile/splice server shares this).
//! `--data-path copy` and the portable engine's copy path copy the bytes out first.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use super::backend::Backend;

/// A change that waits for leases to end, started by whoever ends the last one in its way.
type Job = Box<dyn FnOnce(Change) + Send + 'static>;

/// The leases and changes of one backend whose maps can change.
pub struct Leases {
    /// Ranges are rounded out to multiples of this many bytes (an image's cluster size: a
    /// write to part of a cluster may reallocate all of it).
    granule: u64,
    table: Mutex<Table>,
}

impl fmt::Debug for Leases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.lock();
        f.debug_struct("Leases")
            .field("granule", &self.granule)
            .field("leased", &t.leased.len())
            .field("changing", &t.changing.len())
            .field("waiting", &t.waiting.len())
            .finish()
    }
}

/// A rounded range `[start, end)` and who holds it.
#[derive(Debug, Clone, Copy)]
struct Span {
    id: u64,
    start: u64,
    end: u64,
}

impl Span {
    fn overlaps(&self, other: &Span) -> bool {
        self.start < other.end && other.start < self.end
    }
}

struct Waiter {
    span: Span,
    job: Job,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    /// Engines' leases.
    leased: Vec<Span>,
    /// Changes running.
    changing: Vec<Span>,
    /// Changes waiting, in arrival order (a later one never overtakes an earlier one that
    /// overlaps it).
    waiting: VecDeque<Waiter>,
}

fn any_overlap<'a>(spans: impl IntoIterator<Item = &'a Span>, s: &Span) -> bool {
    spans.into_iter().any(|x| x.overlaps(s))
}

impl Table {
    fn span(&mut self, start: u64, end: u64) -> Span {
        self.next_id += 1;
        Span {
            id: self.next_id,
            start,
            end,
        }
    }

    /// Whether a change of `s` waits: a lease, a change, or an earlier waiter overlaps it.
    fn change_blocked(&self, s: &Span) -> bool {
        any_overlap(&self.leased, s)
            || any_overlap(&self.changing, s)
            || any_overlap(self.waiting.iter().map(|w| &w.span), s)
    }

    /// Moves the waiters nothing blocks any more to the running changes; their jobs are
    /// returned, to be started once the table is unlocked.
    fn promote(&mut self) -> Vec<(Span, Job)> {
        let mut ready = Vec::new();
        let mut i = 0;
        while i < self.waiting.len() {
            let s = self.waiting[i].span;
            let earlier = self.waiting.iter().take(i).map(|w| &w.span);
            let blocked = any_overlap(&self.leased, &s)
                || any_overlap(&self.changing, &s)
                || any_overlap(earlier, &s);
            if blocked {
                i += 1;
                continue;
            }
            if let Some(w) = self.waiting.remove(i) {
                self.changing.push(w.span);
                ready.push((w.span, w.job));
            }
        }
        ready
    }
}

fn remove_id(spans: &mut Vec<Span>, id: u64) -> bool {
    match spans.iter().position(|s| s.id == id) {
        Some(i) => {
            spans.swap_remove(i);
            true
        }
        None => false,
    }
}

thread_local! {
    /// The changes this thread is running inside ([`Change::enter`]): (table, start, end).
    static ENTERED: RefCell<Vec<(usize, u64, u64)>> = const { RefCell::new(Vec::new()) };
}

impl Leases {
    /// A table whose ranges are rounded out to `granule` bytes (at least 1).
    pub fn new(granule: u64) -> Arc<Leases> {
        Arc::new(Leases {
            granule: granule.max(1),
            table: Mutex::new(Table::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // The table is consistent between statements: a panic elsewhere leaves it usable.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `[offset, offset+len)` rounded out to the granule.
    fn rounded(&self, offset: u64, len: u64) -> (u64, u64) {
        let g = self.granule;
        let start = offset / g * g;
        let end = offset.saturating_add(len.max(1));
        let end = end.div_ceil(g).saturating_mul(g);
        (start, end)
    }

    /// Leases `[offset, offset+len)` for an engine, unless a change of an overlapping range
    /// runs or waits (then `None`: the request goes through the stack's methods).
    pub fn lease(self: &Arc<Self>, offset: u64, len: u64) -> Option<LeaseHold> {
        let (start, end) = self.rounded(offset, len);
        let mut t = self.lock();
        let span = t.span(start, end);
        let blocked = any_overlap(&t.changing, &span)
            || any_overlap(t.waiting.iter().map(|w| &w.span), &span);
        if blocked {
            return None;
        }
        t.leased.push(span);
        Some(LeaseHold {
            table: Arc::clone(self),
            id: span.id,
        })
    }

    /// Runs `job` with a [`Change`] of `[offset, offset+len)` as soon as no lease and no
    /// other change overlaps it: now, on this thread, or later on the thread that ends the
    /// last lease or change in its way. `job` must not block (it hands the work to a pool).
    pub fn when_changeable(
        self: &Arc<Self>,
        offset: u64,
        len: u64,
        job: impl FnOnce(Change) + Send + 'static,
    ) {
        let (start, end) = self.rounded(offset, len);
        let mut t = self.lock();
        let span = t.span(start, end);
        if t.change_blocked(&span) {
            t.waiting.push_back(Waiter {
                span,
                job: Box::new(job),
            });
            return;
        }
        t.changing.push(span);
        drop(t);
        job(self.change_of(span));
    }

    /// A change of `[offset, offset+len)`, waiting (blocking this thread) for the leases and
    /// changes in its way to end; at once if this thread runs inside a change that covers it
    /// ([`Change::enter`]: the dispatcher's worker).
    pub fn change(self: &Arc<Self>, offset: u64, len: u64) -> Change {
        let (start, end) = self.rounded(offset, len);
        if self.entered_covers(start, end) {
            return Change::none();
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.when_changeable(offset, len, move |change| {
            let _ = tx.send(change);
        });
        // The sender lives in the table until the job runs; it runs once the leases in the
        // way end, which never depends on this thread.
        rx.recv().unwrap_or_else(|_| Change::none())
    }

    /// A change of `[offset, offset+len)` if it can start now (no lease, change or waiting
    /// change overlaps it, or this thread runs inside a change that covers it), else `None`:
    /// for work a backend may skip rather than wait for (a cache evicting a block an engine
    /// is reading from).
    pub fn try_change(self: &Arc<Self>, offset: u64, len: u64) -> Option<Change> {
        let (start, end) = self.rounded(offset, len);
        if self.entered_covers(start, end) {
            return Some(Change::none());
        }
        let mut t = self.lock();
        let span = t.span(start, end);
        if t.change_blocked(&span) {
            return None;
        }
        t.changing.push(span);
        drop(t);
        Some(self.change_of(span))
    }

    /// Whether this thread runs inside a change of this table covering `[start, end)`.
    fn entered_covers(self: &Arc<Self>, start: u64, end: u64) -> bool {
        let key = Arc::as_ptr(self) as usize;
        ENTERED.with(|e| {
            e.borrow()
                .iter()
                .any(|&(k, s, x)| k == key && s <= start && end <= x)
        })
    }

    /// Whether a lease overlaps `[offset, offset+len)` (a change must never run then: the
    /// debug check of backends whose maps change).
    pub fn leased(&self, offset: u64, len: u64) -> bool {
        let (start, end) = self.rounded(offset, len);
        let probe = Span { id: 0, start, end };
        any_overlap(&self.lock().leased, &probe)
    }

    fn change_of(self: &Arc<Self>, span: Span) -> Change {
        Change {
            held: Some((Arc::clone(self), span)),
        }
    }

    /// Ends lease or change `id` and starts the changes that were waiting only for it.
    fn end(self: &Arc<Self>, id: u64, lease: bool) {
        let mut t = self.lock();
        let removed = if lease {
            remove_id(&mut t.leased, id)
        } else {
            remove_id(&mut t.changing, id)
        };
        debug_assert!(removed, "a lease or change ended twice");
        if t.waiting.is_empty() {
            return;
        }
        let ready = t.promote();
        drop(t);
        for (span, job) in ready {
            job(self.change_of(span));
        }
    }
}

/// A lease in a [`Leases`] table; ends when dropped.
pub struct LeaseHold {
    table: Arc<Leases>,
    id: u64,
}

impl fmt::Debug for LeaseHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseHold({})", self.id)
    }
}

impl Drop for LeaseHold {
    fn drop(&mut self) {
        self.table.end(self.id, true);
    }
}

/// What an engine holds for the places a map named, from [`Stack::map`](super::Stack::map)
/// until the I/O on them has completed (or will never start): while it lives, the places stay
/// the request's. When it ends, the layers are told of a write to the range whatever became
/// of it (landed, failed, cut short by a disconnect: part of it may have changed), so a dirty
/// bitmap misses nothing. An engine keeps it beside the place, in whatever holds the I/O in
/// flight, and drops it only after the last completion.
#[must_use = "a place stays the request's only while its lease lives"]
#[derive(Default)]
pub struct Lease {
    hold: Option<LeaseHold>,
    /// A write: the stack's top, told of `[offset, offset+len)` when the lease ends.
    told: Option<Arc<dyn Backend>>,
    offset: u64,
    len: u64,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("hold", &self.hold)
            .field("write", &self.told.is_some())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Lease {
    /// No lease: places that never change, or none at all.
    pub fn none() -> Lease {
        Lease::default()
    }

    pub(super) fn new(
        hold: Option<LeaseHold>,
        told: Option<Arc<dyn Backend>>,
        offset: u64,
        len: u64,
    ) -> Lease {
        Lease {
            hold,
            told,
            offset,
            len,
        }
    }

    /// Whether this lease covers `[offset, offset+len)` of the export, or the places it came
    /// with never change (no table): the engines' debug check before I/O on a place.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        match &self.hold {
            None => true,
            Some(_) => {
                self.offset <= offset
                    && offset
                        .checked_add(len)
                        .is_some_and(|e| e <= self.offset + self.len)
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(top) = self.told.take() {
            top.wrote_in_place(self.offset, self.len);
        }
        // The hold ends after the layers were told (its field drops now).
    }
}

/// An operation that may change maps, running over a range: no lease overlaps it while it
/// lives. Ends when dropped.
#[must_use = "a change ends when dropped"]
pub struct Change {
    held: Option<(Arc<Leases>, Span)>,
}

impl fmt::Debug for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Change({:?})", self.held.as_ref().map(|(_, s)| s))
    }
}

impl Change {
    /// No change registered (a backend whose maps never change).
    pub fn none() -> Change {
        Change { held: None }
    }

    /// Runs `f` inside this change: on this thread, [`Leases::change`] of a range it covers
    /// is answered at once (the stack's methods register their own changes, and the
    /// dispatcher has already registered the request's).
    pub fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
        let Some((table, span)) = &self.held else {
            return f();
        };
        let entry = (Arc::as_ptr(table) as usize, span.start, span.end);
        ENTERED.with(|e| e.borrow_mut().push(entry));
        struct Leave;
        impl Drop for Leave {
            fn drop(&mut self) {
                ENTERED.with(|e| e.borrow_mut().pop());
            }
        }
        let _leave = Leave;
        f()
    }
}

impl Drop for Change {
    fn drop(&mut self) {
        if let Some((table, span)) = self.held.take() {
            table.end(span.id, false);
        }
    }
}

#[cfg(test)]
#[path = "lease_tests.rs"]
mod tests;
