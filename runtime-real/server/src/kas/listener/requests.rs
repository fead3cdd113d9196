//! The timers of an HTTP listener whose requests may rightly stay silent for long (a
//! watch, an upgraded exec session): nginx's `client_header_timeout` and
//! `keepalive_timeout`, applied only while the connection has no request open.
//!
//! A connection is busy while a request it made is open (its response body unread, or
//! its upgraded stream running): then no timer runs, and HTTP/2 keepalive pings judge it.
//! Otherwise it must send a first byte within `first_byte`, a whole request head within
//! `head` of the first byte of one, and stays idle at most `idle`.

use futures::task::AtomicWaker;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Context;
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// The limits, from the listener's configuration.
#[derive(Clone, Copy, Debug)]
pub struct RequestTimeouts {
    /// `listen.handshake_timeout`: the first byte of a new connection.
    pub first_byte: Duration,
    /// `listen.request_head_timeout`: a request head, from its first byte.
    pub head: Duration,
    /// `listen.idle_timeout`: a connection with no request open and nothing sent.
    pub idle: Duration,
}

#[derive(Default)]
struct Open {
    requests: AtomicUsize,
    /// Requests made so far: one that came and went between two reads still counts.
    made: AtomicUsize,
    /// The connection's reader, woken when its last request ends.
    reader: AtomicWaker,
}

/// What one connection has open; handed to its requests (an extension) to hold.
#[derive(Clone, Default)]
pub struct Activity(Arc<Open>);

impl Activity {
    /// Marks one request open until the returned value (and its clones) are dropped.
    pub fn busy(&self) -> Busy {
        self.0.made.fetch_add(1, Ordering::SeqCst);
        self.0.requests.fetch_add(1, Ordering::SeqCst);
        Busy(self.0.clone())
    }

    fn open(&self) -> bool {
        self.0.requests.load(Ordering::SeqCst) > 0
    }

    fn made(&self) -> usize {
        self.0.made.load(Ordering::SeqCst)
    }
}

/// One open request of a connection; each clone counts as one more.
pub struct Busy(Arc<Open>);

impl Clone for Busy {
    fn clone(&self) -> Self {
        Activity(self.0.clone()).busy()
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.requests.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.reader.wake();
        }
    }
}

/// Where a connection with no request open stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waiting {
    /// Nothing read yet.
    FirstByte,
    /// Idle after a request.
    Idle,
    /// Part of a request head read.
    Head,
    /// A request is open.
    Busy,
}

/// One connection's timers.
pub struct RequestClock {
    limits: RequestTimeouts,
    activity: Activity,
    waiting: Waiting,
    /// [`Activity::made`] when last seen.
    made: usize,
    timer: Pin<Box<Sleep>>,
}

impl RequestClock {
    /// A new connection's.
    pub fn new(limits: RequestTimeouts) -> Self {
        RequestClock {
            limits,
            activity: Activity::default(),
            waiting: Waiting::FirstByte,
            made: 0,
            timer: Box::pin(tokio::time::sleep(limits.first_byte)),
        }
    }

    /// The connection's activity, for its requests to hold.
    pub fn activity(&self) -> Activity {
        self.activity.clone()
    }

    /// Notes `n` bytes read.
    pub fn received(&mut self, n: usize) {
        if n == 0 || self.activity.open() {
            return;
        }
        let by = Instant::now() + self.limits.head;
        match self.waiting {
            Waiting::FirstByte | Waiting::Busy => self.timer.as_mut().reset(by),
            Waiting::Idle if by < self.timer.deadline() => self.timer.as_mut().reset(by),
            Waiting::Idle | Waiting::Head => {}
        }
        self.waiting = Waiting::Head;
    }

    /// On a read that must wait: the error that closes the connection once its timer ran
    /// out; otherwise the timer (and the end of its last request) will wake `cx`.
    pub fn expired(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        self.activity.0.reader.register(cx.waker());
        let made = self.activity.made();
        if self.activity.open() {
            self.waiting = Waiting::Busy;
            return None;
        }
        if self.waiting == Waiting::Busy || made != self.made {
            self.made = made;
            self.waiting = Waiting::Idle;
            let by = Instant::now() + self.limits.idle;
            self.timer.as_mut().reset(by);
        }
        self.timer.as_mut().poll(cx).is_ready().then(|| {
            let what = match self.waiting {
                Waiting::FirstByte => "no request within listen.handshake_timeout",
                Waiting::Head => "no whole request head within listen.request_head_timeout",
                Waiting::Idle | Waiting::Busy => "idle for listen.idle_timeout",
            };
            io::Error::new(io::ErrorKind::TimedOut, what)
        })
    }
}
