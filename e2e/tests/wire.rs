//! Bad input on the wire, against the real hub over real TLS: each is refused with a
//! reason the caller can read, and the hub keeps serving the agents and everyone else.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use flotilla_e2e::converge;
use flotilla_lab::Env;
use flotilla_lab::federation::{Federation, HUB};
use flotilla_lab::support::http_get;
use flotilla_proto::client;
use flotilla_proto::v1::{self as pb, agent_message};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CLUSTER: &str = "wire-e2e";

fn grpc_addr(f: &Federation) -> String {
    f.hub_grpc.trim_start_matches("https://").to_owned()
}

/// The hub still answers: ready, and a real session gets its SyncComplete.
async fn still_serving(f: &Federation, token: &str, after: &str) -> Result<()> {
    let (code, body) = http_get(&f.launch(HUB)?.http, "/readyz").await?;
    ensure!(code == 200, "after {after}: /readyz {code}: {body}");
    let messages = f
        .session(token, CLUSTER)
        .await?
        .map_err(|s| anyhow::anyhow!("after {after}: session refused: {s:?}"))?;
    ensure!(
        messages
            .last()
            .is_some_and(|m| matches!(m.kind, Some(pb::hub_message::Kind::SyncComplete(_)))),
        "after {after}: no SyncComplete: {messages:?}"
    );
    Ok(())
}

#[tokio::test]
async fn bad_wire_input_is_refused_and_the_hub_keeps_serving() -> Result<()> {
    let env = Env::load_ready().await?;
    let f = Federation::load(&env)?;
    let cli = f.hub_cli(&env)?;
    let token_file = env.dir.join("federation").join(format!("{CLUSTER}.token"));
    cli.join(CLUSTER, &[], &token_file)?;
    let token = std::fs::read_to_string(&token_file)?.trim().to_owned();
    let result = async {
        still_serving(&f, &token, "join").await?;

        // No token, or one that is not <cluster>.<secret>: Unauthenticated.
        for bad in ["", "garbage", "wire-e2e.not-the-secret"] {
            let refused = f
                .session(bad, CLUSTER)
                .await
                .map(|r| r.err())
                .with_context(|| format!("token {bad:?}"))?;
            let status = refused.with_context(|| format!("token {bad:?} was accepted"))?;
            ensure!(
                status.code() == tonic::Code::Unauthenticated,
                "token {bad:?}: {status:?}"
            );
        }

        // A message over the limit ends that session, and only that one.
        let (tx, mut inbound) = f.open_session(&token, CLUSTER).await?;
        let huge = pb::AgentMessage {
            kind: Some(agent_message::Kind::Status(pb::StatusReport {
                apply_error: "x".repeat(client::MAX_MESSAGE + 1),
                ..Default::default()
            })),
        };
        tx.send(huge).await?;
        let ended = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                match inbound.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => break "closed".to_owned(),
                    Err(status) => break format!("{:?}: {}", status.code(), status.message()),
                }
            }
        })
        .await
        .context("the hub kept a session that sent an oversized message")?;
        println!("oversized message: session ended ({ended})");
        drop(tx);
        still_serving(&f, &token, "an oversized message").await?;

        // Garbage instead of a TLS handshake: the hub closes the connection.
        let mut raw = TcpStream::connect(grpc_addr(&f)).await?;
        let garbage: Vec<u8> = (0..65_536u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let _ = raw.write_all(&garbage).await;
        let mut buf = [0u8; 4096];
        let closed = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                match raw.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => continue,
                }
            }
        })
        .await;
        ensure!(
            closed.is_ok(),
            "the hub kept a connection that sent garbage"
        );
        still_serving(&f, &token, "garbage bytes").await?;

        // 1,000 connections that never say anything do not stop anyone else.
        let hub_process = f.process(&env, HUB)?;
        let rss_before = hub_process.rss_bytes().unwrap_or(0);
        let mut idle = Vec::with_capacity(1000);
        for _ in 0..1000 {
            idle.push(TcpStream::connect(grpc_addr(&f)).await?);
        }
        let started = Instant::now();
        still_serving(&f, &token, "1,000 idle connections").await?;
        let rss_after = hub_process.rss_bytes().unwrap_or(0);
        println!(
            "1,000 idle connections: a new session served in {:.2}s; hub RSS {} MiB -> {} MiB",
            started.elapsed().as_secs_f64(),
            rss_before >> 20,
            rss_after >> 20
        );
        drop(idle);
        still_serving(&f, &token, "the idle connections closed").await?;
        anyhow::Ok(())
    }
    .await;
    let removed = cli.run(&["unjoin", CLUSTER]).map(drop);
    result?;
    removed?;
    // Every real member converged throughout.
    converge::wait_converged(&env, Duration::from_secs(60)).await?;
    Ok(())
}
