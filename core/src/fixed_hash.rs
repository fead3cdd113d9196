//! Hash maps and sets with a fixed hasher: their iteration order depends only on what was
//! inserted, never on a per-process random seed. With std's `RandomState` two runs of one
//! simulation seed in one process hashed differently, and wherever a map's order reached an
//! output (which tunnel task is woken first, which key is written first) madsim's
//! determinism check failed, depending on how many maps the process had created before.
//! Keys here are ids kas assigns or GitLab vouches for, not free-form client input.

use std::collections::hash_map::DefaultHasher;
use std::hash::BuildHasherDefault;

/// The fixed hasher (SipHash with zero keys).
pub type Fixed = BuildHasherDefault<DefaultHasher>;

/// A `HashMap` with the [`Fixed`] hasher; make one with `Map::default()`.
#[allow(clippy::disallowed_types)] // the fixed hasher is the point: see the module docs
pub type Map<K, V> = std::collections::HashMap<K, V, Fixed>;

/// A `HashSet` with the [`Fixed`] hasher; make one with `Set::default()`.
#[allow(clippy::disallowed_types)] // the fixed hasher is the point: see the module docs
pub type Set<K> = std::collections::HashSet<K, Fixed>;
