//! The reverse tunnels this kas holds, and the calls waiting for one.
//!
//! One registry per kas. Tunnels are idle or claimed by one call; a call for agent A (and
//! optionally connection C) claims an idle tunnel of A (of C), or waits in FIFO order until
//! one is released or opened, or until its deadline. The order is by when the call first
//! asked this kas: a call that gave up waiting to look elsewhere and came back keeps its
//! place, so an agent saturated by short calls does not starve the patient ones. A call for an agent with no tunnel
//! here at all is refused at once ([`RegistryOutput::NoTunnel`]) so that the router can look
//! elsewhere. Tunnels that miss their heartbeats are closed.
//!
//! Sharing: a call may name a [`Holder`] (a Kubernetes API caller). No holder may take
//! more than three quarters of the tunnels the agent may open here ([`share`] of what its
//! connections may open: each the smaller of its replica's pool maximum and
//! [`RegistryConfig::tunnels_per_connection`]), nor the last idle one while it holds any,
//! so one caller cannot deny an agent to the others: a quarter of its tunnels (at least
//! one) stays for them, and the last free tunnel goes to a caller that holds none. An
//! agent that may open one tunnel here keeps it for GitLab's calls. A holder's call beyond
//! that waits like a call for a busy agent, until one of its own calls ends or tunnels
//! open, or until its deadline. GitLab's calls (no holder) are not counted.
//!
//! Driving contract: feed [`TunnelRegistry::handle_input`], drain
//! [`TunnelRegistry::poll_output`], and call [`TunnelRegistry::handle_timeout`] at
//! [`TunnelRegistry::poll_timeout`].
//!
//! Cost: claiming and releasing are O(1) in the number of tunnels (hash maps and
//! `IndexSet::swap_remove`); waiters of one agent are kept in a `BTreeMap` by place, and a
//! released tunnel passes over the waiters of holders at their share (each holder has at
//! most `agent.kubernetes_api.max_requests_per_token_per_agent` calls per routing kas).

use crate::fixed_hash::Map;
use crate::ids::{AgentId, ConnectionId, Holder, RequestId, TunnelId};
use crate::time::{Time, earliest};
use indexmap::IndexSet;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::time::Duration;

/// What the driver tells the registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryInput {
    /// An agent opened a tunnel and sent its descriptor; it is idle.
    TunnelOpened {
        /// The driver's handle of the stream.
        tunnel: TunnelId,
        /// The agent it authenticated as.
        agent: AgentId,
        /// The agent replica's connection.
        connection: ConnectionId,
        /// The most tunnels the replica says it opens on the connection (0: it did not
        /// say); the share counts the smaller of this and
        /// [`RegistryConfig::tunnels_per_connection`].
        max_tunnels: usize,
    },
    /// The tunnel sent a frame (heartbeat or call frame): it is alive.
    TunnelActivity {
        /// The tunnel.
        tunnel: TunnelId,
    },
    /// The tunnel's stream ended. A call on it ends too (the driver sees the broken stream).
    TunnelClosed {
        /// The tunnel.
        tunnel: TunnelId,
    },
    /// A call wants a tunnel of `agent` (of `connection`, when set) until `deadline`.
    Request {
        /// The call.
        request: RequestId,
        /// The wanted agent.
        agent: AgentId,
        /// The wanted replica, if any.
        connection: Option<ConnectionId>,
        /// When to give up waiting.
        deadline: Time,
        /// When the call first asked this kas: its place in the queue.
        since: Time,
        /// Whom the call counts against in the sharing of the agent's tunnels.
        holder: Option<Holder>,
    },
    /// The call is over (answered, failed or cancelled): a waiting call stops waiting, a
    /// claimed tunnel is idle again. Releasing an unknown call does nothing.
    Release {
        /// The call.
        request: RequestId,
    },
}

/// What the registry asks of the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryOutput {
    /// Send the call down this tunnel: it is claimed for the call.
    Matched {
        /// The call.
        request: RequestId,
        /// The claimed tunnel.
        tunnel: TunnelId,
    },
    /// No tunnel of the wanted agent (connection) is here: the call was not delivered.
    NoTunnel {
        /// The call.
        request: RequestId,
    },
    /// The call waited until its deadline for a busy agent: it was not delivered.
    WaitExpired {
        /// The call.
        request: RequestId,
    },
    /// The tunnel missed its heartbeats and is forgotten: close its stream. A call it
    /// carried has been released.
    CloseTunnel {
        /// The tunnel.
        tunnel: TunnelId,
        /// The call it carried, if any (possibly delivered: never retry it).
        request: Option<RequestId>,
    },
    /// This kas gained its first (`true`) or lost its last (`false`) tunnel of the agent.
    AgentPresence {
        /// The agent.
        agent: AgentId,
        /// Whether any tunnel of the agent is here now.
        present: bool,
    },
}

/// A driver mistake: an input that names something the registry does not hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryError {
    /// `TunnelOpened` for an id already open.
    DuplicateTunnel(TunnelId),
    /// An input for a tunnel that is not open.
    UnknownTunnel(TunnelId),
    /// `Request` for an id already waiting or claimed.
    DuplicateRequest(RequestId),
}

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryError::DuplicateTunnel(t) => write!(f, "tunnel {t} is already open"),
            RegistryError::UnknownTunnel(t) => write!(f, "tunnel {t} is not open"),
            RegistryError::DuplicateRequest(r) => write!(f, "request {r} is already registered"),
        }
    }
}

impl std::error::Error for RegistryError {}

/// Registry settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegistryConfig {
    /// A tunnel silent for this long is closed.
    pub heartbeat_timeout: Duration,
    /// The most tunnels kas takes on one agent connection: what an agent may open here is
    /// this (or its replica's smaller pool maximum) for each of its connections, and the
    /// sharing divides that, not the tunnels open now (agentk keeps a couple idle and
    /// opens more as they are taken).
    pub tunnels_per_connection: usize,
}

#[derive(Debug)]
struct Tunnel {
    agent: AgentId,
    connection: ConnectionId,
    claimed_by: Option<RequestId>,
    last_seen: Time,
}

#[derive(Debug)]
struct Waiter {
    agent: AgentId,
    connection: Option<ConnectionId>,
    holder: Option<Holder>,
    place: Place,
    deadline: Time,
}

/// A waiter's place in its queue: when it first asked, then its arrival.
type Place = (Time, u64);

/// A call's tunnel, and the share it counts against.
#[derive(Debug)]
struct Claim {
    tunnel: TunnelId,
    share: Option<(AgentId, Holder)>,
}

/// The most tunnels of an agent that may open `total` here that one holder may hold: all
/// but a quarter, and at least one, stays for the others (none of one tunnel).
fn share(total: usize) -> usize {
    total.saturating_sub((total / 4).max(1))
}

type ConnKey = (AgentId, ConnectionId);

/// Tunnels and waiting calls of one kas. See the module docs.
#[derive(Debug)]
pub struct TunnelRegistry {
    config: RegistryConfig,
    tunnels: Map<TunnelId, Tunnel>,
    /// Tunnel count per agent and per connection (idle and claimed).
    per_agent: Map<AgentId, usize>,
    per_conn: Map<ConnKey, usize>,
    idle_by_agent: Map<AgentId, IndexSet<TunnelId>>,
    idle_by_conn: Map<ConnKey, IndexSet<TunnelId>>,
    claims: Map<RequestId, Claim>,
    /// Tunnels each holder has claimed, per agent.
    held: Map<(AgentId, Holder), usize>,
    /// Waiters per agent, pinned or not.
    waiting: Map<AgentId, usize>,
    /// The most tunnels each connection with tunnels here may open (its replica's pool
    /// maximum, at most kas's limit), and their sum per agent: what the share divides.
    conn_may_open: Map<ConnKey, usize>,
    may_open: Map<AgentId, usize>,
    waiters: Map<RequestId, Waiter>,
    /// Waiters for any connection of an agent, and for one connection, by place.
    queue_by_agent: Map<AgentId, BTreeMap<Place, RequestId>>,
    queue_by_conn: Map<ConnKey, BTreeMap<Place, RequestId>>,
    next_seq: u64,
    /// Deadlines of the waiters there are (each goes with its waiter).
    waiter_deadlines: BTreeSet<(Time, RequestId)>,
    heartbeat_deadlines: BinaryHeap<Reverse<(Time, TunnelId)>>,
    outputs: VecDeque<RegistryOutput>,
}

impl TunnelRegistry {
    /// An empty registry.
    pub fn new(config: RegistryConfig) -> Self {
        TunnelRegistry {
            config,
            tunnels: Map::default(),
            per_agent: Map::default(),
            per_conn: Map::default(),
            idle_by_agent: Map::default(),
            idle_by_conn: Map::default(),
            claims: Map::default(),
            held: Map::default(),
            waiting: Map::default(),
            conn_may_open: Map::default(),
            may_open: Map::default(),
            waiters: Map::default(),
            queue_by_agent: Map::default(),
            queue_by_conn: Map::default(),
            next_seq: 0,
            waiter_deadlines: BTreeSet::new(),
            heartbeat_deadlines: BinaryHeap::new(),
            outputs: VecDeque::new(),
        }
    }

    /// Applies one input at time `now`.
    pub fn handle_input(&mut self, now: Time, input: RegistryInput) -> Result<(), RegistryError> {
        match input {
            RegistryInput::TunnelOpened {
                tunnel,
                agent,
                connection,
                max_tunnels,
            } => {
                if self.tunnels.contains_key(&tunnel) {
                    return Err(RegistryError::DuplicateTunnel(tunnel));
                }
                self.tunnels.insert(
                    tunnel,
                    Tunnel {
                        agent,
                        connection,
                        claimed_by: None,
                        last_seen: now,
                    },
                );
                let tunnels = self.per_conn.entry((agent, connection)).or_default();
                *tunnels += 1;
                if *tunnels == 1 {
                    let limit = self.config.tunnels_per_connection;
                    let may_open = match max_tunnels {
                        0 => limit,
                        n => n.min(limit),
                    };
                    self.conn_may_open.insert((agent, connection), may_open);
                    *self.may_open.entry(agent).or_default() += may_open;
                }
                let count = self.per_agent.entry(agent).or_default();
                *count += 1;
                if *count == 1 {
                    self.outputs.push_back(RegistryOutput::AgentPresence {
                        agent,
                        present: true,
                    });
                }
                self.heartbeat_deadlines
                    .push(Reverse((now + self.config.heartbeat_timeout, tunnel)));
                self.become_idle(tunnel);
            }
            RegistryInput::TunnelActivity { tunnel } => {
                let t = self
                    .tunnels
                    .get_mut(&tunnel)
                    .ok_or(RegistryError::UnknownTunnel(tunnel))?;
                t.last_seen = t.last_seen.max(now);
            }
            RegistryInput::TunnelClosed { tunnel } => {
                if !self.tunnels.contains_key(&tunnel) {
                    return Err(RegistryError::UnknownTunnel(tunnel));
                }
                self.remove_tunnel(tunnel);
            }
            RegistryInput::Request {
                request,
                agent,
                connection,
                deadline,
                since,
                holder,
            } => {
                if self.waiters.contains_key(&request) || self.claims.contains_key(&request) {
                    return Err(RegistryError::DuplicateRequest(request));
                }
                let waiter = Waiter {
                    agent,
                    connection,
                    holder,
                    place: (since, self.next_seq),
                    deadline,
                };
                self.request(now, request, waiter);
            }
            RegistryInput::Release { request } => {
                if let Some(tunnel) = self.unclaim(request) {
                    if let Some(t) = self.tunnels.get_mut(&tunnel) {
                        t.claimed_by = None;
                    }
                    self.become_idle(tunnel);
                } else {
                    self.remove_waiter(request);
                }
            }
        }
        Ok(())
    }

    /// Expires waiters and silent tunnels due at `now`.
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some(&(at, request)) = self.waiter_deadlines.first() {
            if at > now {
                break;
            }
            self.waiter_deadlines.pop_first();
            if self.waiters.get(&request).is_some_and(|w| w.deadline == at) {
                self.remove_waiter(request);
                self.outputs
                    .push_back(RegistryOutput::WaitExpired { request });
            }
        }
        while let Some(&Reverse((at, tunnel))) = self.heartbeat_deadlines.peek() {
            if at > now {
                break;
            }
            self.heartbeat_deadlines.pop();
            let Some(t) = self.tunnels.get(&tunnel) else {
                continue; // closed since: a stale entry
            };
            let due = t.last_seen + self.config.heartbeat_timeout;
            if due > now {
                self.heartbeat_deadlines.push(Reverse((due, tunnel)));
                continue;
            }
            let request = t.claimed_by;
            self.remove_tunnel(tunnel);
            self.outputs
                .push_back(RegistryOutput::CloseTunnel { tunnel, request });
        }
    }

    /// The next command for the driver.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<RegistryOutput> {
        self.outputs.pop_front()
    }

    /// When to call [`Self::handle_timeout`] next (may be early, never late).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        earliest(
            self.waiter_deadlines.first().map(|t| t.0),
            self.heartbeat_deadlines.peek().map(|r| r.0.0),
        )
    }

    /// Whether a tunnel of the agent (of the connection, when given) is here, idle or not.
    pub fn has_tunnels(&self, agent: AgentId, connection: Option<ConnectionId>) -> bool {
        match connection {
            None => self.per_agent.contains_key(&agent),
            Some(c) => self.per_conn.contains_key(&(agent, c)),
        }
    }

    /// Open tunnels.
    pub fn tunnel_count(&self) -> usize {
        self.tunnels.len()
    }

    /// Whether the call waits for a tunnel.
    pub fn is_waiting(&self, request: RequestId) -> bool {
        self.waiters.contains_key(&request)
    }

    /// Calls waiting for a tunnel.
    pub fn waiter_count(&self) -> usize {
        self.waiters.len()
    }

    /// Calls holding a tunnel.
    pub fn claimed_count(&self) -> usize {
        self.claims.len()
    }

    /// Checks the registry's internal indexes agree with each other (for tests and the
    /// simulation's invariant checker). Returns what is inconsistent.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut per_agent: Map<AgentId, usize> = Map::default();
        let mut idle = 0;
        for (id, t) in &self.tunnels {
            *per_agent.entry(t.agent).or_default() += 1;
            let in_agent = self
                .idle_by_agent
                .get(&t.agent)
                .is_some_and(|s| s.contains(id));
            let in_conn = self
                .idle_by_conn
                .get(&(t.agent, t.connection))
                .is_some_and(|s| s.contains(id));
            match t.claimed_by {
                Some(r) if self.claims.get(&r).map(|c| c.tunnel) != Some(*id) => {
                    return Err(format!("tunnel {id} claimed by {r} without a claim record"));
                }
                Some(_) if in_agent || in_conn => {
                    return Err(format!("claimed tunnel {id} is in an idle set"));
                }
                None if !(in_agent && in_conn) => {
                    return Err(format!("idle tunnel {id} missing from an idle set"));
                }
                None => idle += 1,
                Some(_) => {}
            }
        }
        if per_agent != self.per_agent {
            return Err("per-agent tunnel counts disagree with the tunnels".into());
        }
        let mut may_open: Map<AgentId, usize> = Map::default();
        for key in self.per_conn.keys() {
            let Some(n) = self.conn_may_open.get(key) else {
                return Err(format!("connection {key:?} has tunnels but no maximum"));
            };
            *may_open.entry(key.0).or_default() += n;
        }
        if may_open != self.may_open || self.conn_may_open.len() != self.per_conn.len() {
            return Err("per-agent tunnel maxima disagree with the connections".into());
        }
        let mut held: Map<(AgentId, Holder), usize> = Map::default();
        for share in self.claims.values().filter_map(|c| c.share) {
            *held.entry(share).or_default() += 1;
        }
        if held != self.held {
            return Err("holders' tunnel counts disagree with the claims".into());
        }
        let idle_sets: usize = self.idle_by_agent.values().map(IndexSet::len).sum();
        if idle_sets != idle || self.idle_by_agent.values().any(IndexSet::is_empty) {
            return Err(format!("{idle_sets} tunnels in idle sets, {idle} idle"));
        }
        let queued: usize = self
            .queue_by_agent
            .values()
            .map(BTreeMap::len)
            .sum::<usize>()
            + self
                .queue_by_conn
                .values()
                .map(BTreeMap::len)
                .sum::<usize>();
        if queued != self.waiters.len() {
            return Err(format!(
                "{queued} queue entries for {} waiters",
                self.waiters.len()
            ));
        }
        for (r, w) in &self.waiters {
            if self.claims.contains_key(r) {
                return Err(format!("request {r} both waits and holds a tunnel"));
            }
            let idle_match = match w.connection {
                None => self.idle_by_agent.contains_key(&w.agent),
                Some(c) => self.idle_by_conn.contains_key(&(w.agent, c)),
            };
            if idle_match && self.may_take(w.agent, w.holder, self.idle_count(w.agent)) {
                return Err(format!("request {r} waits while a matching tunnel is idle"));
            }
            if !self.waiter_deadlines.contains(&(w.deadline, *r)) {
                return Err(format!("request {r} waits without a deadline timer"));
            }
        }
        let mut waiting: Map<AgentId, usize> = Map::default();
        for w in self.waiters.values() {
            *waiting.entry(w.agent).or_default() += 1;
        }
        if waiting != self.waiting {
            return Err("per-agent waiter counts disagree with the waiters".into());
        }
        if self.waiter_deadlines.len() != self.waiters.len() {
            return Err(format!(
                "{} waiter deadlines for {} waiters",
                self.waiter_deadlines.len(),
                self.waiters.len()
            ));
        }
        Ok(())
    }

    fn request(&mut self, now: Time, request: RequestId, waiter: Waiter) {
        let (agent, connection) = (waiter.agent, waiter.connection);
        if !self.has_tunnels(agent, connection) {
            self.outputs.push_back(RegistryOutput::NoTunnel { request });
            return;
        }
        let idle = match connection {
            None => self
                .idle_by_agent
                .get(&agent)
                .and_then(|s| s.last().copied()),
            Some(c) => self
                .idle_by_conn
                .get(&(agent, c))
                .and_then(|s| s.last().copied()),
        };
        if let Some(tunnel) =
            idle.filter(|_| self.may_take(agent, waiter.holder, self.idle_count(agent)))
        {
            self.claim(tunnel, request, waiter.holder);
            return;
        }
        if waiter.deadline <= now {
            self.outputs
                .push_back(RegistryOutput::WaitExpired { request });
            return;
        }
        self.next_seq += 1;
        match connection {
            None => self.queue_by_agent.entry(agent).or_default(),
            Some(c) => self.queue_by_conn.entry((agent, c)).or_default(),
        }
        .insert(waiter.place, request);
        self.waiter_deadlines.insert((waiter.deadline, request));
        *self.waiting.entry(agent).or_default() += 1;
        self.waiters.insert(request, waiter);
    }

    /// Idle tunnels of the agent here.
    fn idle_count(&self, agent: AgentId) -> usize {
        self.idle_by_agent.get(&agent).map_or(0, IndexSet::len)
    }

    /// Whether `holder` may take one of the agent's `idle` tunnels (see the module docs).
    fn may_take(&self, agent: AgentId, holder: Option<Holder>, idle: usize) -> bool {
        let Some(holder) = holder else {
            return true;
        };
        let may_open = self.may_open.get(&agent).copied().unwrap_or(0);
        let held = self.held.get(&(agent, holder)).copied().unwrap_or(0);
        held < share(may_open) && (held == 0 || idle > 1)
    }

    /// The oldest waiter in `queue` that may take one of the agent's `idle` tunnels.
    fn first_served(
        &self,
        agent: AgentId,
        queue: Option<&BTreeMap<Place, RequestId>>,
        idle: usize,
    ) -> Option<(Place, RequestId)> {
        queue?
            .iter()
            .find(|(_, r)| {
                self.waiters
                    .get(r)
                    .is_some_and(|w| self.may_take(agent, w.holder, idle))
            })
            .map(|(&place, &r)| (place, r))
    }

    /// Files a newly opened or released tunnel as idle, and hands it (or another idle one)
    /// to the oldest waiter that may take it.
    fn become_idle(&mut self, tunnel: TunnelId) {
        let Some(t) = self.tunnels.get(&tunnel) else {
            return;
        };
        let (agent, conn) = (t.agent, t.connection);
        self.idle_by_agent.entry(agent).or_default().insert(tunnel);
        self.idle_by_conn
            .entry((agent, conn))
            .or_default()
            .insert(tunnel);
        self.serve(agent);
    }

    /// Hands the agent's idle tunnels, oldest waiter first, to the waiters that may take
    /// one now: a holder's count fell, or more of the agent's tunnels are idle.
    fn serve(&mut self, agent: AgentId) {
        while self.waiting.contains_key(&agent) {
            let Some(idle) = self.idle_by_agent.get(&agent) else {
                return;
            };
            let count = idle.len();
            let mut best = self
                .first_served(agent, self.queue_by_agent.get(&agent), count)
                .zip(idle.last().copied());
            let mut connections = Vec::new();
            for &tunnel in idle.iter().rev() {
                let Some(conn) = self.tunnels.get(&tunnel).map(|t| t.connection) else {
                    continue;
                };
                if connections.contains(&conn) {
                    continue;
                }
                connections.push(conn);
                let queue = self.queue_by_conn.get(&(agent, conn));
                if let Some(w) = self.first_served(agent, queue, count)
                    && best.is_none_or(|(b, _)| w.0 < b.0)
                {
                    best = Some((w, tunnel));
                }
            }
            let Some(((_, request), tunnel)) = best else {
                return;
            };
            let holder = self.waiters.get(&request).and_then(|w| w.holder);
            self.remove_waiter(request);
            self.claim(tunnel, request, holder);
        }
    }

    /// Claims `tunnel` for `request`, taking it out of the idle sets if it was there.
    fn claim(&mut self, tunnel: TunnelId, request: RequestId, holder: Option<Holder>) {
        self.unfile_idle(tunnel);
        if let Some(t) = self.tunnels.get_mut(&tunnel) {
            t.claimed_by = Some(request);
            let share = holder.map(|h| (t.agent, h));
            if let Some(share) = share {
                *self.held.entry(share).or_default() += 1;
            }
            self.claims.insert(request, Claim { tunnel, share });
            self.outputs
                .push_back(RegistryOutput::Matched { request, tunnel });
        }
    }

    fn unfile_idle(&mut self, tunnel: TunnelId) {
        let Some(t) = self.tunnels.get(&tunnel) else {
            return;
        };
        let (agent, conn) = (t.agent, t.connection);
        remove_from_set(&mut self.idle_by_agent, agent, tunnel);
        remove_from_set(&mut self.idle_by_conn, (agent, conn), tunnel);
    }

    fn remove_tunnel(&mut self, tunnel: TunnelId) {
        self.unfile_idle(tunnel);
        let Some(t) = self.tunnels.remove(&tunnel) else {
            return;
        };
        if let Some(r) = t.claimed_by {
            self.unclaim(r);
        }
        if decrement(&mut self.per_conn, (t.agent, t.connection))
            && let Some(n) = self.conn_may_open.remove(&(t.agent, t.connection))
        {
            decrease(&mut self.may_open, t.agent, n);
        }
        if decrement(&mut self.per_agent, t.agent) {
            self.outputs.push_back(RegistryOutput::AgentPresence {
                agent: t.agent,
                present: false,
            });
        }
        // Waiters whose target has no tunnel left here can never be served: refuse them now
        // so the router looks elsewhere instead of waiting out its deadline.
        let orphaned: Vec<RequestId> = self
            .queue_by_conn
            .get(&(t.agent, t.connection))
            .filter(|_| !self.per_conn.contains_key(&(t.agent, t.connection)))
            .into_iter()
            .chain(
                self.queue_by_agent
                    .get(&t.agent)
                    .filter(|_| !self.per_agent.contains_key(&t.agent)),
            )
            .flat_map(|q| q.values().copied())
            .collect();
        for request in orphaned {
            self.remove_waiter(request);
            self.outputs.push_back(RegistryOutput::NoTunnel { request });
        }
        // A holder's claim on it, or an idle tunnel of a holder's own, is gone.
        self.serve(t.agent);
    }

    /// Forgets `request`'s claim, and its holder's count of it; returns its tunnel.
    fn unclaim(&mut self, request: RequestId) -> Option<TunnelId> {
        let claim = self.claims.remove(&request)?;
        if let Some(share) = claim.share {
            decrement(&mut self.held, share);
        }
        Some(claim.tunnel)
    }

    fn remove_waiter(&mut self, request: RequestId) {
        let Some(w) = self.waiters.remove(&request) else {
            return;
        };
        self.waiter_deadlines.remove(&(w.deadline, request));
        decrement(&mut self.waiting, w.agent);
        match w.connection {
            None => remove_from_queue(&mut self.queue_by_agent, w.agent, w.place),
            Some(c) => remove_from_queue(&mut self.queue_by_conn, (w.agent, c), w.place),
        }
    }
}

fn remove_from_set<K: std::hash::Hash + Eq>(
    sets: &mut Map<K, IndexSet<TunnelId>>,
    key: K,
    tunnel: TunnelId,
) {
    if let Some(set) = sets.get_mut(&key) {
        set.swap_remove(&tunnel);
        if set.is_empty() {
            sets.remove(&key);
        }
    }
}

fn remove_from_queue<K: std::hash::Hash + Eq>(
    queues: &mut Map<K, BTreeMap<Place, RequestId>>,
    key: K,
    place: Place,
) {
    if let Some(q) = queues.get_mut(&key) {
        q.remove(&place);
        if q.is_empty() {
            queues.remove(&key);
        }
    }
}

/// Decrements a count, removing it at zero; true when it reached zero.
fn decrement<K: std::hash::Hash + Eq>(counts: &mut Map<K, usize>, key: K) -> bool {
    decrease(counts, key, 1)
}

/// Takes `by` off a count, removing it at zero; true when it reached zero.
fn decrease<K: std::hash::Hash + Eq>(counts: &mut Map<K, usize>, key: K, by: usize) -> bool {
    match counts.get_mut(&key) {
        Some(n) if *n > by => {
            *n -= by;
            false
        }
        Some(_) => {
            counts.remove(&key);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests;
