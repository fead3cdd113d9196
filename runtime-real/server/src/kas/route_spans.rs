//! A call's routing steps in its trace (kas's `observability.tracing`): the lookup of the
//! agent's tunnels and each wait, with its reason, as spans under the call's `kas.route`
//! span; what the lookup found, what woke the call and each attempt as that span's events,
//! the attempts counted in `kas.attempts`. The node reports steps only while traces are
//! exported, so none of this runs otherwise.

use super::call::Call;
use kas_core::RequestId;
use kas_core::fixed_hash::Map;
use kas_core::router::{RouteStep, Target};
use kas_transport::traces::{self, Context, KeyValue, SpanKind, TraceContextExt};

/// Each routing call's open step span.
#[derive(Default)]
pub struct RouteSpans {
    open: Map<RequestId, Context>,
}

impl RouteSpans {
    /// The call took `step`: the step before ends, a lookup or a wait starts its span.
    /// `call` is the node's payload, `None` once the call ended.
    pub fn step(&mut self, request: RequestId, call: Option<&Call>, step: RouteStep) {
        let before = self.open.remove(&request);
        let Some(call) = call else {
            end(before);
            return;
        };
        let route = call.trace.span();
        match step {
            RouteStep::LookingUp => {
                end(before);
                let lookup = traces::child(
                    "kas",
                    "kas.lookup",
                    SpanKind::Internal,
                    &call.trace,
                    Vec::new,
                );
                self.open.insert(request, lookup);
            }
            RouteStep::Waiting(reason) => {
                end(before);
                let wait =
                    traces::child("kas", "kas.wait", SpanKind::Internal, &call.trace, || {
                        vec![KeyValue::new("kas.wait.reason", reason.as_str())]
                    });
                self.open.insert(request, wait);
            }
            RouteStep::Found { kas, remembered } => {
                let found = vec![
                    KeyValue::new("kas.found", kas.map_or(-1, i64::from)),
                    KeyValue::new("kas.remembered", remembered),
                ];
                match &before {
                    Some(lookup) => lookup.span().set_attributes(found),
                    None => route.add_event("found", found),
                }
                end(before);
            }
            RouteStep::Attempt { target, attempt } => {
                end(before);
                let to = match target {
                    Target::Local => "local".to_string(),
                    Target::Kas(kas) => kas.0,
                };
                route.set_attribute(KeyValue::new("kas.attempts", i64::from(attempt)));
                route.add_event("attempt", vec![KeyValue::new("kas.target", to)]);
            }
            RouteStep::Woken => {
                end(before);
                route.add_event("woken", Vec::new());
            }
        }
    }

    /// The call left its routing (handed to a tunnel here, or ended): its open step ends.
    pub fn left(&mut self, request: RequestId) {
        end(self.open.remove(&request));
    }
}

fn end(step: Option<Context>) {
    if let Some(cx) = step {
        cx.span().end();
    }
}
