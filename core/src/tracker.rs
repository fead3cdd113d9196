//! What this kas must keep in the registry store (Redis), as transaction batches.
//!
//! The tracker holds the desired state — this kas's agent connections (by agent and by
//! project), the agents it holds tunnels for, and its own instance record — and turns
//! changes into [`Batch`]es of per-key writes. Each [`KeyWrite`] is one Redis transaction:
//! `MULTI; HDEL ..; HSET ..; PEXPIRE ..; PUBLISH ..; EXEC`, so a tunnel event is published
//! only with the write that makes it true. Every `refresh` period everything routing reads is written
//! again (each field with a new `expires_at`), which also restores it all after Redis lost
//! its data; the key itself outlives its fields, so that write renews it only every few
//! periods ([`KeyExpiry`]). A project's connection records are only listed, and listings
//! skip the records of kas that are not alive, so they live longer and are rewritten every
//! [`LISTING_REFRESHES`] periods: an agent alone in its project costs one hash write a
//! period, not two. A failed batch is retried with jittered backoff; at shutdown
//! everything is deleted. A failover's replica may lack the last writes: after
//! [`TrackerInput::RewriteAll`] every record is written and announced again, and every
//! field deleted within a value's lifetime is deleted again.
//!
//! Expired fields are left only by a kas that stopped writing without deleting them: one
//! that died, or restarted under the same id. So the GC does not read every key every
//! period: each `gc` period the tracker asks for the live kas (id and incarnation) and,
//! once the longest-lived fields written before it saw one go, restart or appear (which
//! may follow an incarnation that lived and died between two reads) have expired (a
//! project's connection records, `ttl + 2 refresh`), collects every key it writes. A key it
//! starts writing is collected once its fields' lifetime later, for what a kas that died
//! before this one was watching left in it, even if this kas has let go of it meanwhile:
//! an agent that comes and goes keeps its key alive while holding no field at most moments.
//!
//! This kas's instance record is its liveness: it lives only `liveness` and is rewritten
//! every `liveness / 3`, so readers can skip the records of a kas that died without
//! deleting them (SIGKILL, a lost node) within `liveness`, long before those expire.
//!
//! One batch is in flight at a time; changes made meanwhile go into the next one. The
//! instance record alone may go in a batch of its own beside it: this kas's liveness must
//! not wait behind a slow batch of other writes.
//! Driving contract: feed [`Tracker::handle_input`], drain [`Tracker::poll_output`], call
//! [`Tracker::handle_timeout`] at [`Tracker::poll_timeout`].

use crate::backoff::Backoff;
use crate::expiring;
use crate::fixed_hash::Map;
use crate::ids::{AgentId, ConnectionId, KasId, ProjectId};
use crate::keys::Keys;
use crate::rng::Rng;
use crate::time::{Time, earliest};
use kas_proto::registry::{ConnectedAgentInfo, KasInstanceInfo, TunnelEvent};
use prost::Message;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// What the driver tells the tracker.
#[derive(Clone, Debug, PartialEq)]
pub enum TrackerInput {
    /// An agent replica opened `GetConfiguration` on this kas.
    AgentConnected(Box<ConnectedAgentInfo>),
    /// That stream ended.
    AgentDisconnected {
        /// The agent.
        agent: AgentId,
        /// Its configuration project.
        project: ProjectId,
        /// The stream's connection id.
        connection: ConnectionId,
    },
    /// This kas gained its first or lost its last tunnel of the agent (from the registry).
    TunnelPresence {
        /// The agent.
        agent: AgentId,
        /// Whether this kas now holds a tunnel of it.
        present: bool,
    },
    /// The outcome of the batch with this id.
    BatchResult {
        /// The batch.
        batch: u64,
        /// Whether every transaction in it committed.
        ok: bool,
    },
    /// The store lost its data (e.g. Redis restarted empty): write everything now.
    RewriteAll,
    /// The answer to [`TrackerOutput::ReadKas`]: the live kas ids with their incarnations,
    /// `None` when the read failed.
    LiveKas(Option<BTreeMap<String, u64>>),
    /// The [`TrackerOutput::Gc`] of these keys failed: they are collected next period.
    GcFailed(Vec<String>),
    /// Delete everything this kas wrote, then report [`TrackerOutput::ShutdownComplete`].
    Shutdown,
}

/// What the tracker asks of the driver.
#[derive(Clone, Debug, PartialEq)]
pub enum TrackerOutput {
    /// Execute the batch and answer with [`TrackerInput::BatchResult`].
    Write(Batch),
    /// Read the live kas records of this hash (ids and `KasInstanceInfo.incarnation`s)
    /// and answer with [`TrackerInput::LiveKas`].
    ReadKas {
        /// The kas instances hash.
        key: String,
    },
    /// Delete the expired (or undecodable) fields of these keys; answer only a failure,
    /// with [`TrackerInput::GcFailed`].
    Gc {
        /// Keys to scan.
        keys: Vec<String>,
    },
    /// Everything this kas wrote is deleted; the tracker is done.
    ShutdownComplete,
}

/// Writes to execute together and report on as one.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Echo it in [`TrackerInput::BatchResult`].
    pub id: u64,
    /// One transaction per key.
    pub writes: Vec<KeyWrite>,
}

/// How a write sets its key's lifetime (`PEXPIRE`).
///
/// A renewal makes the key outlive the fields written by the next [`KEY_REFRESHES`]
/// refreshes too, so a refresh (which rewrites every field with a fresh `expires_at`)
/// renews the key only every `KEY_REFRESHES + 1` periods: when the key would otherwise
/// expire before the fields written now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyExpiry {
    /// No `PEXPIRE`: the write leaves the key none of this kas's fields.
    Keep,
    /// `PEXPIRE key ttl` only if the `set` created a field (the key was new, lost or
    /// collected): the key's lifetime from this kas's last renewal still covers the fields.
    IfCreated(Duration),
    /// `PEXPIRE key ttl`.
    Renew(Duration),
}

impl KeyExpiry {
    /// The `PEXPIRE` to run after a `set` that did or did not create a field.
    pub fn ttl(self, created: bool) -> Option<Duration> {
        match self {
            KeyExpiry::Renew(ttl) => Some(ttl),
            KeyExpiry::IfCreated(ttl) if created => Some(ttl),
            _ => None,
        }
    }
}

/// How many refreshes after its renewal a key still outlives the fields written (see
/// [`KeyExpiry`]). A key that only a dead kas wrote vanishes within
/// `ttl + (KEY_REFRESHES + 1/2) * refresh` of its death.
pub const KEY_REFRESHES: u32 = 2;

/// How many refresh periods apart a project's connection records are rewritten: they
/// live `ttl + (LISTING_REFRESHES - 1) * refresh`, so each write leaves them the margin
/// (`ttl - refresh`) that a routing record has at its next refresh. A listing shows the
/// record of a replica that left a live kas without that kas deleting it (the kas
/// restarted under the same id) that long, not `ttl`.
pub const LISTING_REFRESHES: u32 = 3;

/// One key's transaction, applied in this order: delete, set, expire, publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyWrite {
    /// The hash key.
    pub key: String,
    /// `HDEL key field..`.
    pub delete: Vec<String>,
    /// `HSET key field value..`: values are encoded `ExpiringValue`s.
    pub set: Vec<(String, Vec<u8>)>,
    /// `PEXPIRE key ttl`, always or if the `set` created a field.
    pub expire: KeyExpiry,
    /// `PUBLISH channel payload` (encoded `TunnelEvent`s).
    pub publish: Vec<(String, Vec<u8>)>,
    /// `PUBLISH channel payload` only if the `set` created a field the hash lacked: a
    /// tunnel record that was lost (Redis restart or failover, collected) and is written
    /// again is announced, so routers that wait without polling learn of it. (The agent's
    /// connections share the hash: a connection recorded while this kas holds tunnels of
    /// the agent announces them again, which is true and harmless.) A record that may have
    /// expired in the hash since this kas last wrote it is announced in `publish` instead:
    /// the `set` finds it there.
    pub announce: Vec<(String, Vec<u8>)>,
}

/// Tracker settings. GitLab's kas defaults: ttl 300 s, refresh 240 s, gc 600 s.
#[derive(Clone, Debug, PartialEq)]
pub struct TrackerConfig {
    /// How long a written field lives unless refreshed.
    pub ttl: Duration,
    /// How often everything is written again (less than `ttl`).
    pub refresh: Duration,
    /// How often expired fields are collected.
    pub gc: Duration,
    /// Lifetime of this kas's instance record, its liveness (`ttl` when longer);
    /// rewritten every third of it when shorter than `ttl`, else by the refresh.
    pub liveness: Duration,
    /// Delay between retries of a failed batch.
    pub backoff: Backoff,
    /// Keys per batch at most.
    pub max_keys_per_batch: usize,
}

impl TrackerConfig {
    /// How long a project's connection records live (see [`LISTING_REFRESHES`]).
    fn listing_ttl(&self) -> Duration {
        self.ttl + self.refresh * (LISTING_REFRESHES - 1)
    }

    /// How long the fields of a key live, and how often a refresh rewrites them.
    fn life(&self, instance: bool, listing: bool) -> (Duration, Duration) {
        if instance {
            (self.liveness, self.refresh)
        } else if listing {
            (self.listing_ttl(), self.refresh * LISTING_REFRESHES)
        } else {
            (self.ttl, self.refresh)
        }
    }
}

#[derive(Debug, Default)]
struct KeyState {
    /// Only listed (a project's connections): see [`LISTING_REFRESHES`].
    listing: bool,
    fields: BTreeMap<String, Vec<u8>>,
    pending_delete: BTreeSet<String>,
    pending_publish: Vec<(String, Vec<u8>)>,
    /// The event that announces this key's field when a write recreates it.
    announce: Option<(String, Vec<u8>)>,
    /// Until when the key lives at least, by this kas's last committed renewal.
    key_expires: Time,
    /// When the fields of the last committed write expire: a write after that revives
    /// them (the key may still hold them, so the `set` creates nothing).
    fields_expire: Time,
    /// What the write in flight records when it succeeds; none when no write is in flight,
    /// or when a failover made what it did unknown.
    writing: Option<Writing>,
    /// In the queue for the next batch (whether or not a write is in flight).
    queued: bool,
}

/// What a key's write in flight records when it succeeds.
#[derive(Debug, Clone, Copy)]
struct Writing {
    /// Its fields' expiry.
    fields_expire: Time,
    /// Its renewal's `key_expires`, if it renews the key.
    key_expires: Option<Time>,
}

#[derive(Debug)]
struct InFlight {
    id: u64,
    writes: Vec<KeyWrite>,
}

/// The desired registry content of one kas. See the module docs.
#[derive(Debug)]
pub struct Tracker {
    config: TrackerConfig,
    keys: Keys,
    /// `keys.kas_instances()`, which every written key is compared with.
    instances_key: String,
    kas_id: KasId,
    rng: Rng,
    state: Map<String, KeyState>,
    dirty_queue: VecDeque<String>,
    in_flight: Option<InFlight>,
    /// A batch of the instance record alone, sent while `in_flight` was out (`partition`
    /// seed 1706: a batch slowed to 1.5 s held the record past its 2 s life, and this kas's
    /// listings skipped its own agents).
    liveness_in_flight: Option<InFlight>,
    next_batch_id: u64,
    failures: u32,
    retry_at: Option<Time>,
    next_refresh: Time,
    next_gc: Time,
    /// The live kas (id, incarnation) at the last read; `None` before the first.
    live_kas: Option<BTreeMap<String, u64>>,
    /// When to collect every key: `ttl` after a kas was seen to go or restart.
    collect_all_at: BTreeSet<Time>,
    /// Keys this kas started writing, with when to collect them (`ttl` later).
    collect_new_at: VecDeque<(Time, String)>,
    /// Fields this kas deleted, with until when a value written before lives: a failover
    /// that loses the deletion revives them, so a rewrite-all deletes them again.
    deleted: Vec<(Time, String, String)>,
    next_heartbeat: Time,
    stage: Stage,
    outputs: VecDeque<TrackerOutput>,
}

/// How far the tracker is from its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Writing, refreshing and collecting.
    Running,
    /// Deleting what it wrote ([`TrackerInput::Shutdown`]); nothing else.
    Stopping,
    /// Everything deleted, [`TrackerOutput::ShutdownComplete`] reported.
    Stopped,
}

impl Tracker {
    /// A tracker for kas `kas_id` that registers `instance` at once. `seed` drives jitter.
    pub fn new(
        now: Time,
        config: TrackerConfig,
        keys: Keys,
        kas_id: KasId,
        instance: &KasInstanceInfo,
        seed: u64,
    ) -> Self {
        let config = TrackerConfig {
            liveness: config.liveness.min(config.ttl),
            ..config
        };
        let mut t = Tracker {
            next_refresh: now + config.refresh,
            next_gc: now + config.gc,
            live_kas: None,
            collect_all_at: BTreeSet::new(),
            collect_new_at: VecDeque::new(),
            deleted: Vec::new(),
            next_heartbeat: Self::heartbeat_after(&config, now),
            config,
            instances_key: keys.kas_instances(),
            keys,
            kas_id,
            rng: Rng::new(seed),
            state: Map::default(),
            dirty_queue: VecDeque::new(),
            in_flight: None,
            liveness_in_flight: None,
            next_batch_id: 0,
            failures: 0,
            retry_at: None,
            stage: Stage::Running,
            outputs: VecDeque::new(),
        };
        let key = t.instances_key.clone();
        let field = t.kas_id.0.clone();
        t.set(now, key, field, instance.encode_to_vec());
        t.flush(now);
        t
    }

    /// Applies one input at `now`. Changes after [`TrackerInput::Shutdown`] are ignored.
    pub fn handle_input(&mut self, now: Time, input: TrackerInput) {
        match input {
            TrackerInput::BatchResult { batch, ok } => self.batch_result(now, batch, ok),
            TrackerInput::RewriteAll => {
                // What Redis kept of the keys' lifetimes is unknown too, and so is what it
                // kept of their fields: a replica promoted by a failover lacks the last
                // writes and may hold expired values, which a `set` revives without
                // creating a field. So every record is announced whatever the `set` finds.
                // A batch in flight may have reached the store before it came back: what
                // its success would record is not known to hold either.
                for st in self.state.values_mut() {
                    st.key_expires = Time(0);
                    st.fields_expire = Time(0);
                    st.writing = None;
                }
                // It may also hold fields deleted since: delete again those that may not
                // have expired, and collect every key once whatever was written before
                // has expired.
                self.deleted.retain(|(until, _, _)| *until > now);
                for (_, key, field) in &self.deleted {
                    let st = self.state.entry(key.clone()).or_default();
                    if !st.fields.contains_key(field) {
                        st.pending_delete.insert(field.clone());
                    }
                }
                self.collect_all_at.insert(now + self.config.listing_ttl());
                self.mark_all_dirty();
                // The store answers again: the backoff of the batches that failed while it
                // was away would hold this kas's records (its liveness too) out of it for
                // up to its longest delay (swarm seed 96: 5 s unlisted after a failover).
                self.failures = 0;
                self.retry_at = None;
            }
            TrackerInput::LiveKas(live) => self.collect(now, live),
            TrackerInput::GcFailed(keys) => {
                self.collect_new_at
                    .extend(keys.into_iter().map(|key| (now, key)));
            }
            TrackerInput::Shutdown => self.shutdown(),
            _ if self.stage != Stage::Running => {}
            TrackerInput::AgentConnected(info) => {
                let bytes = info.encode_to_vec();
                let field = connection_field(ConnectionId(info.connection_id), &self.kas_id);
                let by_agent = self.keys.agent(AgentId(info.agent_id));
                let by_project = self.keys.connections_by_project(ProjectId(info.project_id));
                self.set(now, by_agent, field.clone(), bytes.clone());
                self.state.entry(by_project.clone()).or_default().listing = true;
                self.set(now, by_project, field, bytes);
            }
            TrackerInput::AgentDisconnected {
                agent,
                project,
                connection,
            } => {
                let field = connection_field(connection, &self.kas_id);
                self.delete(now, self.keys.agent(agent), field.clone());
                self.delete(now, self.keys.connections_by_project(project), field);
            }
            TrackerInput::TunnelPresence { agent, present } => {
                let key = self.keys.agent(agent);
                let field = self.kas_id.0.clone();
                if present {
                    self.set(now, key.clone(), field, Vec::new());
                } else {
                    self.delete(now, key.clone(), field);
                }
                let event = TunnelEvent {
                    agent_id: agent.0,
                    kas_id: self.kas_id.0.clone(),
                    connected: present,
                };
                let message = (self.keys.tunnel_events(agent), event.encode_to_vec());
                let st = self.state.entry(key).or_default();
                st.announce = present.then(|| message.clone());
                st.pending_publish.push(message);
            }
        }
        self.flush(now);
    }

    /// Runs refreshes, heartbeats, GC and retries due at `now`.
    pub fn handle_timeout(&mut self, now: Time) {
        if now >= self.next_heartbeat {
            self.next_heartbeat = Self::heartbeat_after(&self.config, now);
            let key = self.instances_key.clone();
            if self.stage == Stage::Running
                && let Some(st) = self.state.get_mut(&key)
            {
                mark_dirty(&mut self.dirty_queue, key, st);
            }
        }
        if now >= self.next_refresh {
            self.next_refresh = now + self.config.refresh;
            self.deleted.retain(|(until, _, _)| *until > now);
            if self.stage == Stage::Running {
                self.mark_refresh_dirty(now);
            }
        }
        if now >= self.next_gc && self.stage == Stage::Running {
            self.next_gc = now + self.config.gc;
            let key = self.instances_key.clone();
            self.outputs.push_back(TrackerOutput::ReadKas { key });
        }
        self.flush(now);
    }

    /// Notes whether a kas went, restarted or appeared since the last read, then asks for the keys due to
    /// be collected (see the module docs).
    fn collect(&mut self, now: Time, live: Option<BTreeMap<String, u64>>) {
        if self.stage != Stage::Running {
            return;
        }
        if let Some(live) = live {
            // A kas that appears counts too: it may follow an incarnation of itself that
            // lived and died between two reads, unseen, and left records.
            if self.live_kas.as_ref().is_some_and(|before| *before != live) {
                // Once the longest-lived fields written before have expired.
                self.collect_all_at.insert(now + self.config.listing_ttl());
            }
            self.live_kas = Some(live);
        }
        // Keys first written a field lifetime ago (or whose GC failed), whether or not this
        // kas holds fields there now: an agent that comes and goes keeps the key alive with
        // fields of its later connections, while what a dead kas left in it would stay
        // expired there for good. Not in time order (lifetimes differ by key), so all due
        // are taken, and taken even when every key is collected below: that collects only
        // the keys this kas holds fields in (kas-crash seed 2729 of 5,000: a greedy agent's
        // key, empty here when every key was collected, kept a dead incarnation's fields).
        let mut keys = Vec::new();
        self.collect_new_at.retain(|(at, key)| {
            let due = *at <= now;
            if due {
                keys.push(key.clone());
            }
            !due
        });
        if self.collect_all_at.first().is_some_and(|&at| at <= now) {
            self.collect_all_at.retain(|&at| at > now);
            keys.extend(
                self.state
                    .iter()
                    .filter(|(_, s)| !s.fields.is_empty())
                    .map(|(k, _)| k.clone()),
            );
        }
        keys.sort();
        keys.dedup();
        if !keys.is_empty() {
            self.outputs.push_back(TrackerOutput::Gc { keys });
        }
    }

    /// When the instance record is next rewritten on its own: a third of its life after
    /// `now`, unless it lives as long as every record and the refresh rewrites it.
    fn heartbeat_after(config: &TrackerConfig, now: Time) -> Time {
        if config.liveness < config.ttl {
            now + config.liveness / 3
        } else {
            Time(u64::MAX)
        }
    }

    /// The next command for the driver.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<TrackerOutput> {
        self.outputs.pop_front()
    }

    /// When to call [`Self::handle_timeout`] next.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        if self.stage != Stage::Running {
            return self.retry_at;
        }
        let periodic = Some(self.next_refresh.min(self.next_gc).min(self.next_heartbeat));
        earliest(periodic, self.retry_at)
    }

    /// Every (key, field, payload) this kas wants in the store (payloads without the
    /// expiry wrapper), sorted. For tests and the simulation's convergence checks.
    pub fn desired(&self) -> Vec<(String, String, Vec<u8>)> {
        let mut all: Vec<_> = self
            .state
            .iter()
            .flat_map(|(k, s)| {
                s.fields
                    .iter()
                    .map(move |(f, v)| (k.clone(), f.clone(), v.clone()))
            })
            .collect();
        all.sort();
        all
    }

    /// True when nothing is waiting to be written and no batch is in flight.
    pub fn is_settled(&self) -> bool {
        self.in_flight.is_none() && self.liveness_in_flight.is_none() && self.dirty_queue.is_empty()
    }

    fn set(&mut self, now: Time, key: String, field: String, value: Vec<u8>) {
        let st = self.state.entry(key.clone()).or_default();
        let (life, _) = self.config.life(key == self.instances_key, st.listing);
        if st.fields.is_empty() {
            // For what a kas that died before this one was watching left in it.
            self.collect_new_at.push_back((now + life, key.clone()));
        }
        st.pending_delete.remove(&field);
        st.fields.insert(field, value);
        mark_dirty(&mut self.dirty_queue, key, st);
    }

    fn delete(&mut self, now: Time, key: String, field: String) {
        let st = self.state.entry(key.clone()).or_default();
        let (life, _) = self.config.life(key == self.instances_key, st.listing);
        self.deleted.push((now + life, key.clone(), field.clone()));
        st.fields.remove(&field);
        st.pending_delete.insert(field);
        mark_dirty(&mut self.dirty_queue, key, st);
    }

    /// Queues what a refresh rewrites: every key but the listing keys whose fields, left
    /// as they are, would still have half the routing records' margin at the next one.
    fn mark_refresh_dirty(&mut self, now: Time) {
        let keep = now + self.config.refresh + (self.config.ttl - self.config.refresh) / 2;
        self.mark_dirty_where(|s| !(s.listing && s.fields_expire >= keep));
    }

    fn mark_all_dirty(&mut self) {
        self.mark_dirty_where(|_| true);
    }

    /// Marks dirty every key with fields or deletions to write that `wanted` accepts.
    fn mark_dirty_where(&mut self, wanted: impl Fn(&KeyState) -> bool) {
        let mut keys: Vec<String> = self
            .state
            .iter()
            .filter(|(_, s)| !s.fields.is_empty() || !s.pending_delete.is_empty())
            .filter(|(_, s)| wanted(s))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort(); // deterministic order regardless of hashing
        for key in keys {
            if let Some(st) = self.state.get_mut(&key) {
                mark_dirty(&mut self.dirty_queue, key, st);
            }
        }
    }

    fn shutdown(&mut self) {
        if self.stage == Stage::Running {
            self.stage = Stage::Stopping;
        }
        let keys: Vec<String> = self.state.keys().cloned().collect();
        for key in keys {
            let st = self.state.get_mut(&key).expect("key listed above");
            let fields = std::mem::take(&mut st.fields);
            st.pending_delete.extend(fields.into_keys());
            st.pending_publish.clear();
            if !st.pending_delete.is_empty() {
                mark_dirty(&mut self.dirty_queue, key, st);
            }
        }
    }

    fn batch_result(&mut self, now: Time, batch: u64, ok: bool) {
        let Some(in_flight) = (self.in_flight.take_if(|f| f.id == batch))
            .or_else(|| self.liveness_in_flight.take_if(|f| f.id == batch))
        else {
            return; // a stale or unknown id: ignore
        };
        for w in in_flight.writes {
            let Some(st) = self.state.get_mut(&w.key) else {
                continue;
            };
            let written = st.writing.take();
            if ok && let Some(written) = written {
                // Answered after the fields it rewrote expired: it may have landed after,
                // reviving them without creating them, so its conditional announcement
                // was not published while readers had seen the record gone (redis-restart
                // seed 217: a slow store held a refresh past the ttl, and a router that
                // looked up in between waited for an event until its callers gave up).
                // Unless a newer event already says what is true.
                let late = now >= st.fields_expire && !w.announce.is_empty();
                st.fields_expire = written.fields_expire;
                st.key_expires = written.key_expires.unwrap_or(st.key_expires);
                if late
                    && st.pending_publish.is_empty()
                    && let Some(announce) = &st.announce
                {
                    st.pending_publish.push(announce.clone());
                    mark_dirty(&mut self.dirty_queue, w.key.clone(), st);
                }
            }
            if !ok {
                for field in w.delete {
                    if !st.fields.contains_key(&field) {
                        st.pending_delete.insert(field);
                    }
                }
                let newer = std::mem::replace(&mut st.pending_publish, w.publish);
                st.pending_publish.extend(newer);
                mark_dirty(&mut self.dirty_queue, w.key, st);
            } else if st.queued {
                // Changed while in flight: it is queued already.
            } else if st.fields.is_empty() && st.pending_delete.is_empty() {
                self.state.remove(&w.key);
            }
        }
        if ok {
            self.failures = 0;
            self.retry_at = None;
        } else {
            let delay = self.config.backoff.delay(self.failures, &mut self.rng);
            self.failures = self.failures.saturating_add(1);
            self.retry_at = Some(now + delay);
        }
    }

    fn flush(&mut self, now: Time) {
        // A retry's time has come for both lanes (one left standing is a timer in the past).
        self.retry_at = self.retry_at.filter(|at| *at > now);
        if self.retry_at.is_none() {
            if self.in_flight.is_none() {
                let mut writes = Vec::new();
                // The instance record waits while a write of it alone is out.
                let mut deferred = None;
                while writes.len() < self.config.max_keys_per_batch.max(1) {
                    let Some(key) = self.dirty_queue.pop_front() else {
                        break;
                    };
                    if key == self.instances_key && self.liveness_in_flight.is_some() {
                        deferred = Some(key);
                        continue;
                    }
                    writes.extend(self.key_write(now, key));
                }
                self.dirty_queue.extend(deferred);
                if !writes.is_empty() {
                    self.in_flight = Some(self.send(writes));
                }
            } else if self.liveness_in_flight.is_none() && self.stage == Stage::Running {
                self.send_liveness(now);
            }
        }
        if self.stage == Stage::Stopping && self.is_settled() {
            self.stage = Stage::Stopped;
            self.outputs.push_back(TrackerOutput::ShutdownComplete);
        }
    }

    /// Sends the instance record alone, when it is due and not in the batch in flight.
    fn send_liveness(&mut self, now: Time) {
        let key = &self.instances_key;
        let due = self.state.get(key).is_some_and(|st| st.queued)
            && !(self.in_flight.iter()).any(|f| f.writes.iter().any(|w| w.key == *key));
        if !due {
            return;
        }
        let key = key.clone();
        self.dirty_queue.retain(|k| *k != key);
        if let Some(write) = self.key_write(now, key) {
            self.liveness_in_flight = Some(self.send(vec![write]));
        }
    }

    /// Outputs a batch of `writes`; what it records on success.
    fn send(&mut self, writes: Vec<KeyWrite>) -> InFlight {
        let id = self.next_batch_id;
        self.next_batch_id += 1;
        self.outputs.push_back(TrackerOutput::Write(Batch {
            id,
            writes: writes.clone(),
        }));
        InFlight { id, writes }
    }

    /// The write of `key` (taken off the queue) at `now`; none when nothing is kept of it.
    fn key_write(&mut self, now: Time, key: String) -> Option<KeyWrite> {
        let st = self.state.get_mut(&key)?;
        st.queued = false;
        let (ttl, every) = self.config.life(key == self.instances_key, st.listing);
        let expires_at = now + ttl;
        // Half a period to spare for batches that run late.
        let key_ttl = ttl + every * KEY_REFRESHES + every / 2;
        let renew = !st.fields.is_empty() && st.key_expires < expires_at;
        let expire = if st.fields.is_empty() {
            KeyExpiry::Keep
        } else if renew {
            KeyExpiry::Renew(key_ttl)
        } else {
            KeyExpiry::IfCreated(key_ttl)
        };
        st.writing = Some(Writing {
            fields_expire: expires_at,
            key_expires: renew.then_some(now + key_ttl),
        });
        let mut publish = std::mem::take(&mut st.pending_publish);
        // An explicit event already says what is true now.
        let mut announce = match &st.announce {
            Some(a) if publish.is_empty() && !st.fields.is_empty() => vec![a.clone()],
            _ => Vec::new(),
        };
        // Fields that expired while the key kept them are revived, not created:
        // announce them whatever the `set` finds.
        if now >= st.fields_expire {
            publish.append(&mut announce);
        }
        Some(KeyWrite {
            delete: std::mem::take(&mut st.pending_delete).into_iter().collect(),
            set: st
                .fields
                .iter()
                .map(|(f, v)| (f.clone(), expiring::encode(v, expires_at)))
                .collect(),
            expire,
            announce,
            publish,
            key,
        })
    }
}

/// The field of a replica's connection record: its connection id and the kas, since a
/// replica connected to several kas has a record from each.
fn connection_field(connection: ConnectionId, kas: &KasId) -> String {
    format!("{connection}@{kas}")
}

/// Queues `key` for the next batch unless it is queued already. A key in flight is queued
/// too: its next write follows the current one.
fn mark_dirty(queue: &mut VecDeque<String>, key: String, st: &mut KeyState) {
    if !st.queued {
        st.queued = true;
        queue.push_back(key);
    }
}

#[cfg(test)]
mod tests;
