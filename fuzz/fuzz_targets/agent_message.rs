//! Any bytes an agent (or anyone with a credential) sends on its stream: the hub's decoding
//! and reading of them never panics.
#![no_main]

use flotilla_hub::convert::{capacity_from_pb, report_from_pb};
use flotilla_plan::AppKey;
use flotilla_proto::WireKey;
use flotilla_proto::v1::{self as pb, agent_message};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(message) = pb::AgentMessage::decode(data) else {
        return;
    };
    match message.kind {
        Some(agent_message::Kind::Hello(hello)) => {
            for m in hello.managed {
                let _ = AppKey::from_wire(m.key);
            }
        }
        Some(agent_message::Kind::Status(report)) => {
            let _ = AppKey::from_wire(report.key.clone());
            let report = report_from_pb(report);
            let _ = report.value.held();
        }
        Some(agent_message::Kind::Capacity(c)) => {
            let _ = capacity_from_pb(&c);
        }
        _ => {}
    }
});
