//! The simulated Redis Cluster's slots: which shard's master serves each, and a range being
//! moved from one shard to another, as `redis-cli --cluster reshard` does it: keys go over
//! one by one, the source answers `ASK` for those gone, the target serves them only after
//! `ASKING`, and every other node answers `MOVED` to the owner; when all are over, the
//! target owns the range and the source unsubscribes its sharded subscribers of it.

use super::Reply;
use kas_server::store::slot::{SLOTS, slot};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::RangeInclusive;

/// The masters of the cluster; they split the slots in even ranges at the start, as
/// `redis-cli --cluster create` does.
pub const SHARDS: u16 = 3;

/// Where shard `shard`'s first master answers: the nodes kas is configured with.
pub fn shard_address(shard: u16) -> SocketAddr {
    node_address(shard, 0)
}

/// Where node `side` (0 or 1: a master and its replica, which swap on a failover) of
/// shard `shard` answers.
pub fn node_address(shard: u16, side: u8) -> SocketAddr {
    let last = u8::try_from(11 + shard).expect("few shards") + side * 10;
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)), 6379)
}

/// The shard a replica node answers for: none, so that it sends every key to its master
/// with `MOVED`, as a cluster replica does to a client that did not ask for `READONLY`.
pub const REPLICA: u16 = u16::MAX;

/// Why a node does not serve a key: it is elsewhere for good, or (while its slot moves)
/// already at the target.
#[derive(Debug)]
pub enum Refusal {
    /// `MOVED`: the slot and the master serving it.
    Moved(u16, SocketAddr),
    /// `ASK`: the slot and the master the key went to.
    Ask(u16, SocketAddr),
}

impl Refusal {
    /// The error a Redis node answers with: `MOVED slot host:port` or `ASK slot host:port`.
    pub fn reply(&self) -> Reply {
        let (what, slot, address) = match self {
            Refusal::Moved(slot, address) => ("MOVED", slot, address),
            Refusal::Ask(slot, address) => ("ASK", slot, address),
        };
        Reply::Error(format!("{what} {slot} {address}"))
    }
}

/// A range of slots on its way from one shard to another.
#[derive(Debug)]
struct Moving {
    slots: RangeInclusive<u16>,
    from: u16,
    to: u16,
    /// How many keys of 1,000 are over already.
    gone_per_mille: u64,
}

/// Which shard serves each slot.
#[derive(Debug)]
pub struct SlotTable {
    owner: Vec<u16>,
    moving: Option<Moving>,
    /// Which node of each shard is its master.
    sides: Vec<u8>,
}

impl Default for SlotTable {
    fn default() -> Self {
        let owner = (0..SLOTS).map(|s| s / SLOTS.div_ceil(SHARDS)).collect();
        SlotTable {
            owner,
            moving: None,
            sides: vec![0; usize::from(SHARDS)],
        }
    }
}

/// Whether `key` went over already, when `per_mille` of 1,000 have: a fixed hash of it.
fn gone(key: &str, per_mille: u64) -> bool {
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    hash % 1_000 < per_mille
}

impl SlotTable {
    /// The shard serving `key` (or a channel named like it) for good.
    pub fn owner(&self, key: &str) -> u16 {
        self.owner[usize::from(slot(key))]
    }

    /// Which node of shard `shard` is its master.
    pub fn side(&self, shard: u16) -> u8 {
        self.sides[usize::from(shard)]
    }

    /// Where shard `shard`'s master answers.
    pub fn master(&self, shard: u16) -> SocketAddr {
        node_address(shard, self.side(shard))
    }

    /// Shard `shard`'s replica becomes its master, at its own address.
    pub fn swap_sides(&mut self, shard: u16) {
        let side = &mut self.sides[usize::from(shard)];
        *side = 1 - *side;
    }

    /// The shard serving slot `slot` for good.
    pub fn owner_of_slot(&self, slot: u16) -> u16 {
        self.owner[usize::from(slot)]
    }

    /// Whether shard `shard`'s master serves `key` now (`asking`: the command follows an
    /// `ASKING`), or where it sends the client. A key of a moving slot is served at the
    /// source until it went over, and at the target after `ASKING`, gone or not yet.
    pub fn check(&self, shard: u16, key: &str, asking: bool) -> Result<(), Refusal> {
        self.serves(shard, key, asking, |m| gone(key, m.gone_per_mille))
    }

    /// Whether shard `shard`'s master serves the sharded channel `channel`: as a key, but a
    /// channel never goes over before its slot does.
    pub fn check_channel(&self, shard: u16, channel: &str, asking: bool) -> Result<(), Refusal> {
        self.serves(shard, channel, asking, |_| false)
    }

    fn serves(
        &self,
        shard: u16,
        name: &str,
        asking: bool,
        over: impl Fn(&Moving) -> bool,
    ) -> Result<(), Refusal> {
        let slot = slot(name);
        let owner = self.owner[usize::from(slot)];
        match &self.moving {
            Some(m) if m.slots.contains(&slot) => match shard {
                s if s == m.from && over(m) => Err(Refusal::Ask(slot, self.master(m.to))),
                s if s == m.from => Ok(()),
                s if s == m.to && asking => Ok(()),
                _ => Err(Refusal::Moved(slot, self.master(m.from))),
            },
            _ if owner == shard => Ok(()),
            _ => Err(Refusal::Moved(slot, self.master(owner))),
        }
    }

    /// The answer to `CLUSTER SLOTS`: each run of slots with its master (a range on its way
    /// is still its source's).
    pub fn slots_reply(&self) -> Reply {
        let mut ranges = Vec::new();
        let mut start = 0;
        for s in 1..=SLOTS {
            if s == SLOTS || self.owner[usize::from(s)] != self.owner[usize::from(start)] {
                let shard = self.owner[usize::from(start)];
                let address = self.master(shard);
                ranges.push(Reply::Array(vec![
                    Reply::Int(i64::from(start)),
                    Reply::Int(i64::from(s - 1)),
                    Reply::Array(vec![
                        Reply::bulk(address.ip().to_string()),
                        Reply::Int(i64::from(address.port())),
                        Reply::bulk(format!("shard{shard}")),
                    ]),
                ]));
                start = s;
            }
        }
        Reply::Array(ranges)
    }

    /// Starts moving `slots` (served by one shard) to shard `to`.
    pub fn start_move(&mut self, slots: RangeInclusive<u16>, to: u16) {
        let from = self.owner[usize::from(*slots.start())];
        self.moving = Some(Moving {
            slots,
            from,
            to,
            gone_per_mille: 0,
        });
    }

    /// Moves more keys over: `per_mille` of 1,000 are over now.
    pub fn advance(&mut self, per_mille: u64) {
        if let Some(m) = &mut self.moving {
            m.gone_per_mille = per_mille;
        }
    }

    /// Ends the move: the target owns the range. Returns the range and its old shard.
    pub fn finish_move(&mut self) -> Option<(RangeInclusive<u16>, u16)> {
        let m = self.moving.take()?;
        for s in m.slots.clone() {
            self.owner[usize::from(s)] = m.to;
        }
        Some((m.slots, m.from))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moving_slot_is_served_by_its_source_until_a_key_goes_then_after_asking_at_its_target() {
        let mut table = SlotTable::default();
        let key = "kas:agent:{agent:7}";
        let from = table.owner(key);
        let to = (from + 1) % SHARDS;
        let s = slot(key);
        assert!(table.check(from, key, false).is_ok());
        let (at_from, at_to) = (shard_address(from), shard_address(to));
        assert!(matches!(table.check(to, key, false), Err(Refusal::Moved(_, o)) if o == at_from));
        assert!(
            matches!(table.check(REPLICA, key, false), Err(Refusal::Moved(_, o)) if o == at_from)
        );
        table.start_move(s..=s, to);
        assert!(table.check(from, key, false).is_ok(), "not over yet");
        table.advance(1_000);
        assert!(matches!(table.check(from, key, false), Err(Refusal::Ask(_, t)) if t == at_to));
        assert!(matches!(table.check(to, key, false), Err(Refusal::Moved(_, o)) if o == at_from));
        assert!(table.check(to, key, true).is_ok());
        assert_eq!(table.finish_move(), Some((s..=s, from)));
        assert!(table.check(to, key, false).is_ok());
        assert!(matches!(table.check(from, key, false), Err(Refusal::Moved(_, o)) if o == at_to));
        table.swap_sides(to);
        let promoted = node_address(to, 1);
        assert!(
            matches!(table.check(from, key, false), Err(Refusal::Moved(_, o)) if o == promoted)
        );
        let Reply::Array(ranges) = table.slots_reply() else {
            panic!("an array");
        };
        let alone = [Reply::Int(s.into()), Reply::Int(s.into())];
        assert!(
            ranges
                .iter()
                .any(|r| matches!(r, Reply::Array(r) if r[..2] == alone)),
            "the moved slot is a range of its own"
        );
    }
}
