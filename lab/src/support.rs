//! Small plumbing that the environment and the tests share and that belongs to no stage:
//! the workspace root, the project's built binaries, free loopback ports, an HTTP GET
//! (hyper's client) and reading one series out of Prometheus text (`prometheus-parse`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// A finished command's stdout, or an error naming it (`what`, e.g. "`kubectl get pods`"),
/// with its exit status and its stderr.
pub fn stdout_of(what: impl std::fmt::Display, out: std::process::Output) -> Result<String> {
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The newest directory under `~/.cache/flotilla/tools` whose name starts with `prefix`
/// (`deploy/verify.sh` builds them: helm, controller-gen, the Prometheus CRDs, …).
pub fn cached_tool(prefix: &str) -> Result<PathBuf> {
    let tools =
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/flotilla/tools");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&tools)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    found.sort();
    found.pop().with_context(|| {
        format!(
            "no {prefix}* in {}: run `bash deploy/verify.sh` first (it builds the tools the tests use)",
            tools.display()
        )
    })
}

/// The workspace root, known at compile time (the binaries and the tests live in it).
pub fn workspace_root() -> PathBuf {
    let lab = Path::new(env!("CARGO_MANIFEST_DIR"));
    lab.parent().unwrap_or(lab).to_path_buf()
}

/// Builds the named `(package, binary)` pairs of the workspace (a no-op when they are
/// current) and returns each binary's path by name, as cargo reports it: wherever
/// `CARGO_TARGET_DIR`, `--target-dir` or `.cargo/config` put it.
pub fn cargo_binaries(wanted: &[(&str, &str)]) -> Result<BTreeMap<String, PathBuf>> {
    cargo_binaries_with(wanted, &[])
}

/// Names of the variables cargo set for the crate that runs this process (`cargo run`,
/// `cargo test`). A cargo started from here must not inherit them: build scripts watch
/// some of them (ring's watches `CARGO_MANIFEST_DIR` and `CARGO_PKG_NAME`), so they would
/// differ from the user's cargo and rebuild ring, and all that links rustls, at each step.
pub fn crate_vars() -> Vec<String> {
    std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| is_crate_var(name))
        .collect()
}

fn is_crate_var(name: &str) -> bool {
    [
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_CRATE_",
        "CARGO_BIN_",
    ]
    .iter()
    .any(|prefix| name.starts_with(prefix))
        || matches!(
            name,
            "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "OUT_DIR"
        )
}

/// [`cargo_binaries`] with more `cargo build` arguments (`--release`, `--target ...`).
pub fn cargo_binaries_with(
    wanted: &[(&str, &str)],
    extra: &[&str],
) -> Result<BTreeMap<String, PathBuf>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    for name in crate_vars() {
        cmd.env_remove(name);
    }
    cmd.args(["build", "--message-format", "json-render-diagnostics"]);
    cmd.args(extra);
    for (package, bin) in wanted {
        cmd.args(["-p", package, "--bin", bin]);
    }
    let out = cmd
        .current_dir(workspace_root())
        .stdin(Stdio::null())
        // Compiler diagnostics go to the terminal; only the JSON messages are read.
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}); its output is above", out.status);
    }
    let found = executables(&String::from_utf8_lossy(&out.stdout));
    let mut paths = BTreeMap::new();
    for (_, bin) in wanted {
        let path = found
            .get(*bin)
            .with_context(|| format!("cargo built no executable named {bin}"))?;
        paths.insert(bin.to_string(), path.clone());
    }
    Ok(paths)
}

/// Executable paths by target name, from cargo's `--message-format json` output.
fn executables(messages: &str) -> BTreeMap<String, PathBuf> {
    messages
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .filter_map(|m| {
            let name = m["target"]["name"].as_str()?.to_string();
            let exe = m["executable"].as_str()?;
            Some((name, PathBuf::from(exe)))
        })
        .collect()
}

/// `127.0.0.1:PORT` with a port from [`free_port`].
pub fn free_addr() -> Result<String> {
    Ok(format!("127.0.0.1:{}", free_port()?))
}

/// A port free on loopback right now, never one this process handed out before (the OS
/// may offer a just-released port again, and two components given the same port fail at
/// start: seen with the hub's and an agent's HTTP port), and below the kernel's ephemeral
/// range: components are restarted on their port (an agent after SIGKILL, the hub, an
/// apiserver), and meanwhile any outgoing connection on the machine may take an ephemeral
/// port (seen: a restarted agent failed with "Address already in use").
pub fn free_port() -> Result<u16> {
    static GIVEN: parking_lot::Mutex<std::collections::BTreeSet<u16>> =
        parking_lot::Mutex::new(std::collections::BTreeSet::new());
    let (low, high) = (10_000, ephemeral_start().saturating_sub(1).max(10_999));
    for _ in 0..10_000 {
        let port = fastrand::u16(low..=high);
        if GIVEN.lock().contains(&port) || std::net::TcpListener::bind(("127.0.0.1", port)).is_err()
        {
            continue;
        }
        GIVEN.lock().insert(port);
        return Ok(port);
    }
    anyhow::bail!("no free port in {low}-{high} that this process has not handed out already")
}

/// The first port of the kernel's ephemeral range (Linux's default: 32768).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// An HTTP GET of `http://{addr}{path}`: (status code, body).
pub async fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    let url = format!("http://{addr}{path}");
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let get = async {
        let response = client.get(url.parse()?).await?;
        let code = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::Ok((code, String::from_utf8_lossy(&body).into_owned()))
    };
    get.await.with_context(|| format!("GET {url}"))
}

/// The value of one series in Prometheus text, named as printed (`name{a="x",b="y"}`; the
/// labels in any order); 0 when absent (a counter never incremented is not printed).
/// Counters, gauges and untyped samples (a histogram's `_sum` and `_count` among them).
pub fn sample(metrics: &str, series: &str) -> f64 {
    // The series is parsed as a sample line of its own, so both sides agree on names and labels.
    let Some(wanted) = scrape(&format!("{series} 0")).pop() else {
        return 0.0;
    };
    scrape(metrics)
        .into_iter()
        .find(|s| s.metric == wanted.metric && s.labels == wanted.labels)
        .and_then(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            _ => None,
        })
        .unwrap_or(0.0)
}

fn scrape(text: &str) -> Vec<prometheus_parse::Sample> {
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    // Reading lines from a string cannot fail.
    prometheus_parse::Scrape::parse(lines).map_or_else(|_| Vec::new(), |s| s.samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_running_crate_s_cargo_variables_are_dropped() {
        for name in [
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_CRATE_NAME",
            "CARGO_BIN_NAME",
            "CARGO_PRIMARY_PACKAGE",
            "OUT_DIR",
        ] {
            assert!(is_crate_var(name), "{name}");
        }
        for name in [
            "CARGO",
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_INCREMENTAL",
            "PATH",
        ] {
            assert!(!is_crate_var(name), "{name}");
        }
    }

    #[test]
    fn free_ports_are_below_the_ephemeral_range_and_never_repeat() {
        let ports: std::collections::BTreeSet<u16> =
            (0..50).map(|_| free_port().unwrap()).collect();
        assert_eq!(ports.len(), 50);
        assert!(
            ports.iter().all(|p| *p >= 10_000 && *p < ephemeral_start()),
            "{ports:?}"
        );
    }

    #[test]
    fn sample_reads_the_exact_series_and_nothing_else() {
        let text = "# HELP x_total X.\n# TYPE x_total counter\n\
                    x_total{kind=\"apply\"} 7\n\
                    x_total{kind=\"apply_extra\"} 9\n\
                    x_total_created{kind=\"apply\"} 1.7e9\n\
                    y 2.5 1700000000000\n";
        assert_eq!(sample(text, "x_total{kind=\"apply\"}"), 7.0);
        assert_eq!(sample(text, "x_total{kind=\"apply_extra\"}"), 9.0);
        assert_eq!(sample(text, "y"), 2.5, "a timestamp after the value");
        assert_eq!(sample(text, "x_total{kind=\"delete\"}"), 0.0);
        assert_eq!(sample(text, "x_tot"), 0.0, "a prefix of a name is no match");
        assert_eq!(sample("", "x"), 0.0);
        assert_eq!(sample("x garbage", "x"), 0.0);
        let two = "x{a=\"1\",b=\"2\"} 3\n";
        assert_eq!(
            sample(two, "x{b=\"2\",a=\"1\"}"),
            3.0,
            "labels in any order"
        );
        assert_eq!(
            sample(two, "x{a=\"1\"}"),
            0.0,
            "a subset of the labels is no match"
        );
    }

    /// A server on loopback that answers its first connection with `response` and closes.
    async fn canned(response: &'static str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let _ = conn.read(&mut [0; 1024]).await;
            let _ = conn.write_all(response.as_bytes()).await;
        });
        addr
    }

    #[tokio::test]
    async fn responses_parse_or_fail_naming_what_came() {
        let addr = canned("HTTP/1.1 503 Service Unavailable\r\nA: b\r\n\r\nnot ready").await;
        assert_eq!(
            http_get(&addr, "/readyz").await.unwrap(),
            (503, "not ready".into())
        );
        let addr = canned("HTTP/1.0 200 OK\r\n\r\n").await;
        assert_eq!(http_get(&addr, "/").await.unwrap(), (200, String::new()));
        let addr = canned("HTTP/1.0 204 No Content\r\n\r\n").await;
        assert_eq!(http_get(&addr, "/").await.unwrap(), (204, String::new()));
        for bad in [
            "",
            "garbage",
            "HTTP/1.1 abc\r\n\r\n",
            "SSH-2.0-OpenSSH 200\r\n",
        ] {
            let addr = canned(bad).await;
            let e = http_get(&addr, "/metrics").await.unwrap_err();
            assert!(
                format!("{e:#}").contains(&format!("GET http://{addr}/metrics")),
                "{bad}: {e:#}"
            );
        }
    }

    #[test]
    fn executables_come_from_compiler_artifacts_only() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","target":{"name":"flotilla-hub"},"executable":"/t/debug/flotilla-hub"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"name":"flotilla_hub"},"executable":null}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
            "\nnot json\n"
        );
        let found = executables(messages);
        assert_eq!(
            found,
            BTreeMap::from([(
                "flotilla-hub".into(),
                PathBuf::from("/t/debug/flotilla-hub")
            )])
        );
    }

    #[test]
    fn free_addr_is_bindable_loopback() {
        let addr = free_addr().unwrap();
        assert!(addr.starts_with("127.0.0.1:"), "{addr}");
        std::net::TcpListener::bind(&addr).unwrap();
    }

    #[test]
    fn free_addr_never_hands_out_a_port_twice() {
        let ports: std::collections::BTreeSet<String> =
            (0..300).map(|_| free_addr().unwrap()).collect();
        assert_eq!(ports.len(), 300);
    }
}
