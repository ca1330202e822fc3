//! Waiting for replies without a thread of our own: whichever caller thread needs progress
//! becomes the one that waits on the sockets (an epoll set over all connections plus a wake
//! eventfd) while others wait on a condition variable; completions run in the thread that
//! received them, with no lock held, so callbacks may submit more.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{epoll, eventfd, EventfdFlags};

use crate::conn::{Conn, Ready};
use crate::error::{Error, Result};

/// Epoll user data of the wake eventfd (connections use their index).
const WAKE_TOKEN: u64 = u64::MAX;
/// Longest single wait, so a missed wake-up can only ever cost this much.
const WAIT_SLICE: Duration = Duration::from_millis(500);

/// Who is waiting on the sockets, and who on them.
#[derive(Debug, Default)]
struct Room {
    polling: bool,
    waiters: u32,
}

/// A connection and what epoll knows of it.
pub(crate) struct ConnCell {
    pub conn: Mutex<Conn>,
    interest: Mutex<Interest>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Interest {
    output: bool,
    removed: bool,
}

impl ConnCell {
    pub fn new(conn: Conn) -> ConnCell {
        ConnCell {
            conn: Mutex::new(conn),
            interest: Mutex::new(Interest::default()),
        }
    }
}

/// The waiting machinery of one client.
pub(crate) struct Waiter {
    room: Mutex<Room>,
    cv: Condvar,
    epoll: OwnedFd,
    wake: OwnedFd,
    /// Set by [`Waiter::nudge`], taken by the drive it ends.
    nudged: AtomicBool,
}

fn io_err(context: &'static str) -> impl Fn(rustix::io::Errno) -> Error {
    move |e| Error::io(context, e.into())
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic in a completion never leaves our state half-updated (completions run with no
    // lock held), so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Waiter {
    /// An epoll set over `conns`' sockets and a wake eventfd.
    pub fn new(conns: &[ConnCell]) -> Result<Waiter> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(io_err("epoll_create"))?;
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(io_err("eventfd"))?;
        let data = epoll::EventData::new_u64(WAKE_TOKEN);
        epoll::add(&epoll, &wake, data, epoll::EventFlags::IN).map_err(io_err("epoll_ctl"))?;
        for (i, cell) in conns.iter().enumerate() {
            let conn = lock(&cell.conn);
            let data = epoll::EventData::new_u64(i as u64);
            epoll::add(&epoll, conn.fd(), data, epoll::EventFlags::IN)
                .map_err(io_err("epoll_ctl"))?;
        }
        Ok(Waiter {
            room: Mutex::new(Room::default()),
            cv: Condvar::new(),
            epoll,
            wake,
            nudged: AtomicBool::new(false),
        })
    }

    /// The epoll descriptor: readable when a connection has something to do.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.epoll.as_fd()
    }

    /// Wakes the thread waiting on the sockets, if any.
    pub fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// The mask of connections ready now, without waiting (a [`Waiter::wake`] is taken and
    /// marks them all): for a caller that polls [`Waiter::fd`] in an event loop of its own
    /// instead of waiting here.
    pub fn ready_now(&self) -> u64 {
        self.wait(Duration::ZERO)
    }

    /// Ends the drive that checks [`Waiter::take_nudge`], whether it waits on the sockets or
    /// on the condition variable.
    pub fn nudge(&self) {
        self.nudged.store(true, Ordering::Release);
        // Under the room's lock: a thread that saw no nudge is then already waiting.
        let room = lock(&self.room);
        if room.waiters > 0 {
            self.cv.notify_all();
        }
        drop(room);
        self.wake();
    }

    /// Whether [`Waiter::nudge`] was called since the last time this said so.
    pub fn take_nudge(&self) -> bool {
        self.nudged.swap(false, Ordering::AcqRel)
    }

    /// Progresses the connections in `mask` (bit i: connection i; all when `None`) and runs
    /// the completions that finished. Returns how many ran.
    pub fn progress(&self, conns: &[ConnCell], mask: Option<u64>) -> usize {
        let mut ready: Ready = Vec::new();
        for (i, cell) in conns.iter().enumerate() {
            let chosen = mask.is_none_or(|m| i >= 64 || m & (1 << i) != 0);
            let mut conn = lock(&cell.conn);
            if !chosen && !conn.wants_output() && !conn.has_deferred() {
                continue;
            }
            conn.progress(&mut ready);
            self.update_interest(cell, &conn, i);
        }
        self.run(ready)
    }

    /// Runs completions (no lock held) and tells other waiting threads to look.
    pub fn run(&self, ready: Ready) -> usize {
        if ready.is_empty() {
            return 0;
        }
        let n = ready.len();
        for (completer, result) in ready {
            completer(result);
        }
        let room = lock(&self.room);
        if room.polling {
            self.wake();
        }
        if room.waiters > 0 {
            self.cv.notify_all();
        }
        n
    }

    /// Keeps epoll's interest in a connection in step with it: writability only while output
    /// waits, nothing once it is dead (a dead socket would be ready forever).
    pub fn update_interest(&self, cell: &ConnCell, conn: &Conn, index: usize) {
        let mut interest = lock(&cell.interest);
        if interest.removed {
            return;
        }
        if conn.dead().is_some() {
            let _ = epoll::delete(&self.epoll, conn.fd());
            interest.removed = true;
            return;
        }
        let output = conn.wants_output();
        if output != interest.output {
            let mut flags = epoll::EventFlags::IN;
            if output {
                flags |= epoll::EventFlags::OUT;
            }
            let data = epoll::EventData::new_u64(index as u64);
            if epoll::modify(&self.epoll, conn.fd(), data, flags).is_ok() {
                interest.output = output;
            }
        }
    }

    /// Drives the connections until `done()` holds or `timeout` passes (`None`: no limit).
    /// Returns how many completions this thread ran.
    pub fn drive(
        &self,
        conns: &[ConnCell],
        done: &dyn Fn(usize) -> bool,
        timeout: Option<Duration>,
    ) -> usize {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut total = 0;
        let mut mask = None;
        loop {
            total += self.progress(conns, mask.take());
            if done(total) {
                break;
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => break,
                },
                None => WAIT_SLICE,
            };
            let mut room = lock(&self.room);
            // Checked again under the room's lock: a completion that ran since is seen here,
            // or its thread sees us in the room and wakes us.
            if done(total) {
                break;
            }
            if room.polling {
                room.waiters += 1;
                room = self
                    .cv
                    .wait_timeout(room, left.min(WAIT_SLICE))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                room.waiters -= 1;
                continue;
            }
            room.polling = true;
            drop(room);
            mask = Some(self.wait(left.min(WAIT_SLICE)));
            lock(&self.room).polling = false;
        }
        let room = lock(&self.room);
        if room.waiters > 0 {
            self.cv.notify_all();
        }
        total
    }

    /// Waits on the epoll set; returns the mask of connections that are ready.
    fn wait(&self, timeout: Duration) -> u64 {
        // On the stack: this runs per wake-up of a queue that drives its completions.
        let mut space = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 16];
        let ts = rustix::event::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        let events = match epoll::wait(&self.epoll, &mut space, Some(&ts)) {
            Ok((events, _)) => events,
            Err(_) => return u64::MAX,
        };
        let mut mask = 0u64;
        for event in events.iter() {
            match event.data.u64() {
                WAKE_TOKEN => {
                    let mut buf = [0u8; 8];
                    let _ = rustix::io::read(&self.wake, &mut buf);
                    // Woken on purpose (rare): look at every connection.
                    mask = u64::MAX;
                }
                i if i < 64 => mask |= 1 << i,
                _ => mask = u64::MAX,
            }
        }
        mask
    }
}
