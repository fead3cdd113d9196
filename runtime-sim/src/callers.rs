//! Who GitLab's simulated Kubernetes API callers are: their tokens (kas's
//! `agent.kubernetes_api.tokens_file`), whom kas makes the agent act as for them, and the
//! identity they claim for themselves, which must never get through (inv 12).

/// The agent the greedy caller (see `greedy_caller`) crowds: one replica, whose pool keeps
/// at most [`CROWDED_POOL`] tunnels.
pub const CROWDED: i64 = 59;

/// The most tunnels [`CROWDED`]'s pool opens: half of what kas allows a connection
/// (`greedy::TUNNELS`, 16), so kas must share out the pool's maximum, not its own limit.
pub const CROWDED_POOL: usize = 8;

/// The greedy caller's token (`pat:59:` before it), the agent acting as itself for it.
pub const GREEDY_TOKEN: &str = "greedy-user-token-0123456789";

/// The token GitLab's simulated Kubernetes API callers present (`pat:<agent>:` before it),
/// listed in each kas's `agent.kubernetes_api.tokens_file`.
pub const USER_TOKEN: &str = "sim-user-token-0123456789";

/// The tokens file: the user `sim` reaches any agent, impersonated; the greedy caller
/// reaches its agent, which acts as itself for it.
pub fn tokens_file() -> String {
    // Every agent id the runs use, the absent agent's (99) included: its calls wait for it.
    let agents: Vec<String> = (1..=100).map(|a: i64| a.to_string()).collect();
    format!(
        "tokens:\n  - token: {USER_TOKEN}\n    kind: pat\n    agent_ids: [{}]\n    access_as: user\n    username: sim\n  - token: {}\n    kind: pat\n    agent_ids: [{}]\n    username: greedy\n",
        agents.join(", "),
        GREEDY_TOKEN,
        CROWDED,
    )
}

/// Whom kas tells the agent to act as for [`USER_TOKEN`].
pub const IMPERSONATED: &str = "gitlab:user:sim";

/// What a caller claims about itself in every request, and must never get through.
pub const CLAIMED: &str = "claimed-by-the-caller";
