//! `flotilla-hub run` is one supervised process: when a task that matters cannot run (here
//! the gRPC listener, on a port already taken), the whole process exits non-zero within
//! seconds, naming the task and the address, instead of serving half a hub.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn a_hub_on_a_taken_port_exits_naming_the_address() {
    let dir = std::env::temp_dir().join(format!("flotilla-supervised-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hub = env!("CARGO_BIN_EXE_flotilla-hub");
    let certs = Command::new(hub)
        .args(["certs", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(certs.status.success(), "{certs:?}");
    // A host apiserver that is never reached: the listener fails first.
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n\
         contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {token: t}}]\n",
    )
    .unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let grpc = taken.local_addr().unwrap().to_string();
    let http = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let started = Instant::now();
    let mut child = Command::new(hub)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["run", "--grpc-addr", &grpc, "--http-addr", &http])
        .arg("--tls-cert")
        .arg(dir.join("tls.crt"))
        .arg("--tls-key")
        .arg(dir.join("tls.key"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            child.kill().unwrap();
            panic!("the hub kept running with its gRPC port taken");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stderr = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("grpc failed: binding the gRPC address {grpc}")),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
    drop(taken);
}
