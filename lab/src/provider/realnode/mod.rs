//! Real-node mode (`up --real-nodes`): beside its KWOK nodes, every cluster gets one real
//! node, `real-node`: a kubelet against the cluster's apiserver, containerd (CRI) with runc,
//! a bridge CNI with host-local IPAM, and kube-proxy for Services.
//!
//! Each node lives in namespaces of its own, like a kind node without Docker. A holder
//! process (`unshare --net --mount`, then `sleep infinity`) owns a network namespace and a
//! private mount namespace; containerd, the kubelet and kube-proxy enter both (`nsenter`).
//! In the mount namespace, the node's directories under `<state dir>/nodes/<cluster>/` are
//! bind-mounted on the paths the kubelet and containerd use (`/var/lib/kubelet`,
//! `/var/lib/containerd`, `/etc/cni/net.d`, `/var/lib/cni`, `/var/log/pods`,
//! `/var/log/containers`) and tmpfs covers `/run/containerd` and `/run/netns`, so that three
//! nodes on one machine share no path, no port (each netns has its own 10250, 10256, ...)
//! and no iptables chain (kube-proxy's rules are the netns's own). Nothing mounted there is
//! seen outside; all of it goes when the last process in the namespaces ends.
//!
//! The network: one Linux bridge per environment on the host, `flo<hash>br`, with
//! `10.213.K.1/24` (K from the state dir's hash, moved on if the host uses that /24); node
//! i's `eth0` is `10.213.K.(10+i)`, its veth's other end on the bridge. The control planes
//! stay on 127.0.0.1, which a node in its own netns cannot reach: a forwarder (`socat`,
//! recorded with the node) listens on the bridge address at the apiserver's port, the
//! kubelet and kube-proxy dial that, and the apiserver advertises it, so the `kubernetes`
//! Service of each cluster sends Pods there too. Pods get `10.(214+i).K.0/24`
//! (masqueraded when they leave the node; the host routes each to its node, so the
//! apiservers reach webhooks at Pod addresses); members reach the host's NodePorts over
//! the bridge.
//!
//! The real node is registered with the taint `flotilla.io/real-node=true:NoSchedule` and
//! the label `flotilla.io/real-node=true`: the MyApps' many pods (no toleration) keep going
//! to the KWOK nodes, which only the KWOK controller manages (it is told to manage the
//! nodes labelled `type=kwok`, not all nodes); only what tolerates the taint and selects
//! the label runs for real (the e2e's install of the hub and the agents does).
//!
//! Processes are recorded by PID and start time in `<state dir>/nodes/<cluster>/node.json`
//! with the namespaces' inodes and the node's cgroup root; `down` stops the kubelet and
//! kube-proxy, then kills every process in the node's cgroups (the containers) and every
//! process in its namespaces (containerd, shims, the holder), removes the cgroups, the
//! bridge and the node's directories.

pub mod oci;
pub mod pods;

use crate::env::Env;
use crate::process::{self, ProcessRecord};
use crate::support::stdout_of;
use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The real node's name in every cluster.
pub const NODE_NAME: &str = "real-node";
/// Taint key and label key of the real node (value `"true"`).
pub const REAL_NODE_KEY: &str = "flotilla.io/real-node";
/// The pod sandbox image every node's containerd is configured with (and gets imported).
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10";
const NODES_DIR: &str = "nodes";
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The environment's bridge and addresses.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Network {
    /// Name of the host-side bridge.
    pub bridge: String,
    /// The /24 is `10.213.{third}.0/24`.
    pub third: u8,
    /// A short hash of the state dir, used in names (bridge, veths, cgroups).
    pub tag: String,
}

impl Network {
    /// The host's address on the bridge: what the control planes bind to.
    pub fn host_ip(&self) -> String {
        format!("10.213.{}.1", self.third)
    }
    pub fn cidr(&self) -> String {
        format!("10.213.{}.0/24", self.third)
    }
    /// Node `i`'s address (i is the cluster's index: host 0, cluster1 1, ...).
    pub fn node_ip(&self, i: usize) -> String {
        format!("10.213.{}.{}", self.third, 10 + i)
    }
    fn veth(&self, i: usize) -> String {
        format!("flo{}n{i}", self.tag)
    }
}

impl Network {
    /// Node `i`'s pod subnet, `10.(214+i).K.0/24`: its own in the environment, and K keeps
    /// it apart from other environments' (the host routes each to its node).
    pub fn pod_cidr(&self, i: usize) -> String {
        format!("10.{}.{}.0/24", 214 + i.min(40), self.third)
    }
}

/// `<state dir>/nodes`: each node's directory, the images, the install.
pub fn nodes_dir(dir: &Path) -> PathBuf {
    dir.join(NODES_DIR)
}

/// Where the OCI archives imported into the nodes are written.
pub fn images_dir(dir: &Path) -> PathBuf {
    nodes_dir(dir).join("images")
}

fn net_file(dir: &Path) -> PathBuf {
    nodes_dir(dir).join("network.json")
}

/// The environment's network, picked on first use and recorded.
pub fn network(dir: &Path) -> Result<Network> {
    if let Ok(b) = std::fs::read(net_file(dir)) {
        return serde_json::from_slice(&b).context("parsing the recorded network");
    }
    let hash = fnv(dir.to_string_lossy().as_bytes());
    let tag = format!("{:06x}", hash & 0xff_ffff);
    let used = std::fs::read_to_string("/proc/net/route").unwrap_or_default()
        + &run_out(Command::new("ip").args(["-4", "-o", "addr"])).unwrap_or_default();
    let start = (hash >> 24) as u8;
    let third = (0..=255u8)
        .map(|k| start.wrapping_add(k))
        .find(|k| {
            // /proc/net/route prints destinations in hex, little-endian: 10.213.K.0 = 00KKD50A.
            !used.contains(&format!("10.213.{k}.")) && !used.contains(&format!("{k:02X}D50A"))
        })
        .context("no free 10.213.K.0/24 for the environment's bridge")?;
    let net = Network {
        bridge: format!("flo{tag}br"),
        third,
        tag,
    };
    std::fs::create_dir_all(nodes_dir(dir))?;
    std::fs::write(net_file(dir), serde_json::to_vec_pretty(&net)?)?;
    Ok(net)
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Creates the environment's bridge (idempotent). Before the clusters: they bind to it.
pub fn ensure_bridge(net: &Network) -> Result<()> {
    check_prerequisites()?;
    if Path::new("/sys/class/net").join(&net.bridge).exists() {
        return Ok(());
    }
    run(Command::new("ip").args(["link", "add", &net.bridge, "type", "bridge"]))?;
    run(Command::new("ip").args([
        "addr",
        "add",
        &format!("{}/24", net.host_ip()),
        "dev",
        &net.bridge,
    ]))?;
    run(Command::new("ip").args(["link", "set", &net.bridge, "up"]))?;
    Ok(())
}

/// What real-node mode needs from the machine, checked before anything starts.
fn check_prerequisites() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!("real-node mode runs containerd and kubelets: it needs root");
    }
    let mut missing = Vec::new();
    for tool in [
        "containerd",
        "containerd-shim-runc-v2",
        "runc",
        "ctr",
        "iptables",
        "ip",
        "unshare",
        "nsenter",
        "socat",
    ] {
        if which(tool).is_none() {
            missing.push(tool);
        }
    }
    if !Path::new(CNI_BIN_DIR).join("bridge").exists() {
        missing.push("CNI plugins (/usr/lib/cni/bridge)");
    }
    if !missing.is_empty() {
        bail!(
            "real-node mode needs {}: on Debian, `apt-get install -y containerd runc \
             containernetworking-plugins iptables conntrack socat`",
            missing.join(", ")
        );
    }
    Ok(())
}

const CNI_BIN_DIR: &str = "/usr/lib/cni";

fn which(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

fn run(cmd: &mut Command) -> Result<()> {
    run_out(cmd).map(drop)
}

fn run_out(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    stdout_of(format_args!("{cmd:?}"), out)
}

/// One node's recorded state.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct NodeState {
    pub cluster: String,
    pub holder: Option<ProcessRecord>,
    /// Inodes of the holder's network and mount namespaces (`/proc/<pid>/ns/{net,mnt}`).
    pub netns: Option<u64>,
    pub mntns: Option<u64>,
    /// The kubelet's cgroup root (`/flotilla-<tag>-<cluster>`), in every v1 hierarchy.
    pub cgroup_root: String,
    /// The apiserver forwarder, containerd, kubelet, kube-proxy.
    pub processes: Vec<ProcessRecord>,
}

impl NodeState {
    fn path(dir: &Path, cluster: &str) -> PathBuf {
        nodes_dir(dir).join(cluster).join("node.json")
    }
    fn load(dir: &Path, cluster: &str) -> Result<Option<NodeState>> {
        match std::fs::read(Self::path(dir, cluster)) {
            Ok(b) => Ok(Some(serde_json::from_slice(&b)?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
    fn save(&self, dir: &Path) -> Result<()> {
        let p = Self::path(dir, &self.cluster);
        std::fs::create_dir_all(p.parent().unwrap_or(dir))?;
        std::fs::write(&p, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", p.display()))
    }
    /// Every recorded process, holder last.
    pub fn all(&self) -> Vec<ProcessRecord> {
        self.processes
            .iter()
            .chain(self.holder.iter())
            .cloned()
            .collect()
    }
    fn running(&self) -> bool {
        self.holder.as_ref().is_some_and(ProcessRecord::alive)
            && self.processes.len() == 4
            && self.processes.iter().all(ProcessRecord::alive)
    }
}

/// The recorded nodes of the environment in `dir` (for `status`).
pub fn nodes(dir: &Path) -> Vec<NodeState> {
    let Ok(entries) = std::fs::read_dir(nodes_dir(dir)) else {
        return Vec::new();
    };
    let mut out: Vec<NodeState> = entries
        .flatten()
        .filter_map(|e| NodeState::load(dir, e.file_name().to_str()?).ok().flatten())
        .collect();
    out.sort_by(|a, b| a.cluster.cmp(&b.cluster));
    out
}

/// The paths the kubelet and containerd use, bind-mounted from the node's directory.
const BIND_DIRS: [&str; 6] = [
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/etc/cni/net.d",
    "/var/lib/cni",
    "/var/log/pods",
    "/var/log/containers",
];

fn holder_script(node: &Path) -> String {
    let n = node.display();
    let binds = BIND_DIRS.join(" ");
    format!(
        "# Written by flotilla-e2e: the namespaces of a real node.\n\
         set -e\n\
         for d in /run/containerd /run/netns {binds}; do mkdir -p \"$d\" \"{n}/root$d\"; done\n\
         mount -t tmpfs -o mode=0755 tmpfs /run/containerd\n\
         mount -t tmpfs -o mode=0755 tmpfs /run/netns\n\
         for d in {binds}; do mount --bind \"{n}/root$d\" \"$d\"; done\n\
         ip link set lo up\n\
         echo 1 > /proc/sys/net/ipv4/ip_forward\n\
         echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables || true\n\
         touch \"{n}/holder.ready\"\n\
         exec sleep infinity\n"
    )
}

fn cni_conflist(pods: &str) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "flotilla",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": true,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": pods}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ],
    })
    .to_string()
}

fn containerd_config(node: &Path) -> String {
    let n = node.display();
    format!(
        "# Written by flotilla-e2e. Paths are the node's mount namespace's.\n\
         version = 2\n\
         root = \"/var/lib/containerd\"\n\
         state = \"/run/containerd\"\n\
         [grpc]\n\
        \x20 address = \"{n}/containerd.sock\"\n\
         [ttrpc]\n\
        \x20 address = \"{n}/containerd.sock.ttrpc\"\n\
         [plugins.\"io.containerd.grpc.v1.cri\"]\n\
        \x20 sandbox_image = \"{PAUSE_IMAGE}\"\n\
        \x20 stream_server_address = \"127.0.0.1\"\n\
        \x20 stream_server_port = \"0\"\n\
        \x20 # Never below containerd's own: lowering it needs CAP_SYS_RESOURCE, which some\n\
        \x20 # sandboxes (ours) drop; runc then fails with \"can't get final child's PID\".\n\
        \x20 restrict_oom_score_adj = true\n\
        \x20 [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n\
        \x20   snapshotter = \"overlayfs\"\n\
        \x20   default_runtime_name = \"runc\"\n\
        \x20   [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n\
        \x20     runtime_type = \"io.containerd.runc.v2\"\n\
        \x20     [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n\
        \x20       SystemdCgroup = false\n\
        \x20 [plugins.\"io.containerd.grpc.v1.cri\".cni]\n\
        \x20   bin_dir = \"{CNI_BIN_DIR}\"\n\
        \x20   conf_dir = \"/etc/cni/net.d\"\n\
        \x20 # Registries: <dir>/<host:port>/hosts.toml, read at each pull (none by default).\n\
        \x20 [plugins.\"io.containerd.grpc.v1.cri\".registry]\n\
        \x20   config_path = \"{hosts}\"\n",
        hosts = registry_hosts_dir(node).display()
    )
}

/// Where the node's containerd reads its registries' configuration: a directory per
/// registry host (`127.0.0.1:5000/hosts.toml`, containerd's `config_path` layout), read at
/// each pull, so that a registry can be added to a running node (e2e/scripts/olm-e2e.sh
/// `--real-nodes` points one at a registry on the host, over plain HTTP). Empty: every
/// pull goes to the registry the image names, over HTTPS.
pub fn registry_hosts_dir(node: &Path) -> PathBuf {
    node.join("certs.d")
}

fn kubelet_config(node: &Path, ip: &str, cgroup_root: &str, client_ca: &Path) -> String {
    format!(
        "# Written by flotilla-e2e.\n\
         apiVersion: kubelet.config.k8s.io/v1beta1\n\
         kind: KubeletConfiguration\n\
         containerRuntimeEndpoint: unix://{sock}\n\
         cgroupDriver: cgroupfs\n\
         cgroupRoot: {cgroup_root}\n\
         failSwapOn: false\n\
         address: {ip}\n\
         readOnlyPort: 0\n\
         healthzBindAddress: 127.0.0.1\n\
         authentication:\n\
        \x20 anonymous: {{enabled: false}}\n\
        \x20 webhook: {{enabled: true}}\n\
        \x20 x509: {{clientCAFile: {ca}}}\n\
         authorization: {{mode: Webhook}}\n\
         clusterDomain: cluster.local\n\
         # A shared build machine's disk: evict only when it is all but full (absolute\n\
         # figures: 1% of a large disk still evicted the hub Pods here), no image GC of the\n\
         # imported images.\n\
         evictionHard: {{memory.available: 100Mi, nodefs.available: 100Mi, imagefs.available: 100Mi, nodefs.inodesFree: 1%}}\n\
         imageGCHighThresholdPercent: 100\n\
         imageGCLowThresholdPercent: 99\n\
         shutdownGracePeriod: 0s\n\
         # Its own oom_score_adj left as it is (lowering it needs CAP_SYS_RESOURCE).\n\
         oomScoreAdj: 0\n\
         maxPods: 30\n\
         registerWithTaints:\n\
         - {{key: {REAL_NODE_KEY}, value: \"true\", effect: NoSchedule}}\n\
         resolvConf: /etc/resolv.conf\n",
        sock = node.join("containerd.sock").display(),
        ca = client_ca.display(),
    )
}

fn kube_proxy_config(kubeconfig: &Path, i: usize, net: &Network) -> String {
    format!(
        "# Written by flotilla-e2e.\n\
         apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
         kind: KubeProxyConfiguration\n\
         clientConnection:\n\
        \x20 kubeconfig: {kc}\n\
         hostnameOverride: {NODE_NAME}\n\
         mode: iptables\n\
         clusterCIDR: {pods}\n\
         metricsBindAddress: 127.0.0.1:10249\n\
         healthzBindAddress: 127.0.0.1:10256\n\
         nodePortAddresses: [\"{cidr}\"]\n\
         oomScoreAdj: 0\n\
         # Leave the machine's conntrack settings alone (global, not the netns's).\n\
         conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}\n",
        kc = kubeconfig.display(),
        pods = net.pod_cidr(i),
        cidr = net.cidr(),
    )
}

/// The cgroup hierarchies (mount points of type `cgroup` and `cgroup2`), where the
/// kubelet's cgroup root must exist before it starts and is removed after.
fn cgroup_hierarchies() -> Vec<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    // v1 hierarchies and, on a hybrid host, the v2 one beside them (runc makes the
    // containers' cgroups there too); on a v2-only host, the one tree.
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            matches!(f.get(2), Some(&"cgroup") | Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .collect()
}

fn make_cgroups(root: &str) -> Result<()> {
    let rel = root.trim_start_matches('/');
    for h in cgroup_hierarchies() {
        let d = h.join(rel);
        std::fs::create_dir_all(&d).with_context(|| format!("creating cgroup {}", d.display()))?;
        // cpuset needs its cpus and mems before a task may join.
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = std::fs::read_to_string(h.join(f))
                && std::fs::read_to_string(d.join(f)).is_ok_and(|c| c.trim().is_empty())
            {
                std::fs::write(d.join(f), v.trim())?;
            }
        }
    }
    Ok(())
}

/// Every PID in the cgroup tree under `root`, in every hierarchy.
fn cgroup_pids(root: &str) -> Vec<u32> {
    let rel = root.trim_start_matches('/');
    let mut pids = Vec::new();
    for h in cgroup_hierarchies() {
        for d in walk_dirs(&h.join(rel)) {
            if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
                pids.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// `d` and every directory under it, parents before children.
fn walk_dirs(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![d.to_path_buf()];
    while let Some(p) = stack.pop() {
        if !p.is_dir() {
            continue;
        }
        if let Ok(entries) = std::fs::read_dir(&p) {
            stack.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
        out.push(p);
    }
    out
}

fn remove_cgroups(root: &str) -> Result<()> {
    let rel = root.trim_start_matches('/');
    let deadline = Instant::now() + Duration::from_secs(10);
    for h in cgroup_hierarchies() {
        let mut dirs = walk_dirs(&h.join(rel));
        dirs.reverse();
        for d in dirs {
            loop {
                match std::fs::remove_dir(&d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // EBUSY while the last tasks are still exiting.
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100))
                    }
                    Err(e) => {
                        return Err(e).with_context(|| format!("removing cgroup {}", d.display()));
                    }
                }
            }
        }
    }
    Ok(())
}

fn ns_inode(pid: u32, ns: &str) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/{ns}"))
        .ok()
        .map(|m| m.ino())
}

/// Every process in the network namespace `netns` or the mount namespace `mntns`.
fn in_namespaces(netns: Option<u64>, mntns: Option<u64>) -> Vec<u32> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|&pid| {
            (netns.is_some() && ns_inode(pid, "net") == netns)
                || (mntns.is_some() && ns_inode(pid, "mnt") == mntns)
        })
        .collect()
}

fn kill_pids(pids: &[u32]) {
    use rustix::process::{Pid, Signal, kill_process};
    for &pid in pids {
        if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
            let _ = kill_process(pid, Signal::KILL);
        }
    }
}

/// `up --real-nodes`, once the clusters run: the real nodes (with the pause image), then
/// Flotilla itself as Pods on them, from deploy/ and `flotilla-hub join`. `start` is when
/// `up` began, for the log.
pub async fn install(env: &Env, start: Instant) -> Result<()> {
    let bin = crate::provider::local::binaries(true).await?;
    let images = images_dir(&env.dir);
    std::fs::create_dir_all(&images)?;
    let pause = images.join("pause.tar");
    oci::write_archive(&oci::pause_image(&bin.join("pause"), PAUSE_IMAGE), &pause)?;
    up(env, &bin, &[pause])
        .await
        .context("starting the real nodes")?;
    eprintln!(
        "flotilla-e2e: real nodes Ready after {:.1}s",
        start.elapsed().as_secs_f64()
    );
    pods::up(env, &bin)
        .await
        .context("installing flotilla-hub and the agents as Pods")?;
    eprintln!(
        "flotilla-e2e: environment up in {:.1}s, hub and agents as Pods ({})",
        start.elapsed().as_secs_f64(),
        env.dir.display()
    );
    Ok(())
}

/// Starts the real node of every cluster (those already running are kept), imports
/// `images` (OCI archives) into each node's containerd and waits until every node is Ready.
pub async fn up(env: &Env, bin: &Path, images: &[PathBuf]) -> Result<()> {
    let net = network(&env.dir)?;
    ensure_bridge(&net)?;
    for (i, c) in env.clusters.iter().enumerate() {
        let state = NodeState::load(&env.dir, &c.name)?;
        if state.as_ref().is_some_and(NodeState::running) {
            continue;
        }
        if let Some(old) = state {
            // Half-dead from an earlier run: clear it out first.
            stop_node(&env.dir, &old)?;
        }
        start_node(env, &net, bin, i, &c.name, &c.kubeconfig)
            .with_context(|| format!("starting the real node of {}", c.name))?;
    }
    for c in &env.clusters {
        let node = nodes_dir(&env.dir).join(&c.name);
        for image in images {
            import(&node, image)
                .await
                .with_context(|| format!("importing {} into {}", image.display(), c.name))?;
        }
    }
    for c in &env.clusters {
        let nodes: Api<Node> = Api::all(env.client(&c.name).await?);
        crate::wait::await_object(
            &nodes,
            NODE_NAME,
            READY_TIMEOUT,
            &format!("node {NODE_NAME} of {} to be Ready", c.name),
            |n: Option<&Node>| n.is_some_and(crate::cluster::node_ready),
        )
        .await
        .with_context(|| {
            format!(
                "see {}",
                nodes_dir(&env.dir).join(&c.name).join("logs").display()
            )
        })?;
    }
    Ok(())
}

fn start_node(
    env: &Env,
    net: &Network,
    bin: &Path,
    i: usize,
    cluster: &str,
    kubeconfig: &Path,
) -> Result<()> {
    let node = nodes_dir(&env.dir).join(cluster);
    // What an earlier node left (its namespaces are gone): start clean.
    if node.exists() {
        std::fs::remove_dir_all(&node).with_context(|| format!("removing {}", node.display()))?;
    }
    let logs = node.join("logs");
    std::fs::create_dir_all(&logs)?;
    let mut state = NodeState {
        cluster: cluster.to_string(),
        cgroup_root: format!("/flotilla-{}-{cluster}", net.tag),
        ..NodeState::default()
    };
    state.save(&env.dir)?;

    // The namespaces.
    std::fs::write(node.join("holder.sh"), holder_script(&node))?;
    let holder = process::spawn_detached(
        "holder",
        Command::new("unshare")
            .args(["--net", "--mount", "--propagation", "private", "--", "sh"])
            .arg(node.join("holder.sh")),
        &logs.join("holder.log"),
    )?;
    state.holder = Some(holder.clone());
    state.save(&env.dir)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !node.join("holder.ready").exists() {
        if !holder.alive() || Instant::now() > deadline {
            bail!(
                "the node's namespace holder did not come up; {}:\n{}",
                logs.join("holder.log").display(),
                std::fs::read_to_string(logs.join("holder.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    state.netns = ns_inode(holder.pid, "net");
    state.mntns = ns_inode(holder.pid, "mnt");
    state.save(&env.dir)?;

    // The link: a veth with `eth0` in the node, the other end on the environment's bridge.
    let veth = net.veth(i);
    delete_link(&veth)?;
    let pid = holder.pid.to_string();
    run(Command::new("ip").args([
        "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &pid,
    ]))?;
    run(Command::new("ip").args(["link", "set", &veth, "master", &net.bridge, "up"]))?;
    let ns = |args: &[&str]| {
        let mut c = Command::new("nsenter");
        c.args(["-t", &pid, "-m", "-n", "--"]).args(args);
        c
    };
    let ip = net.node_ip(i);
    run(&mut ns(&[
        "ip",
        "addr",
        "add",
        &format!("{ip}/24"),
        "dev",
        "eth0",
    ]))?;
    run(&mut ns(&["ip", "link", "set", "eth0", "up"]))?;
    run(&mut ns(&[
        "ip",
        "route",
        "add",
        "default",
        "via",
        &net.host_ip(),
    ]))?;
    // The host (its apiserver calling webhooks at Pod addresses) reaches the node's Pods.
    run(Command::new("ip").args([
        "route",
        "replace",
        &net.pod_cidr(i),
        "via",
        &ip,
        "dev",
        &net.bridge,
    ]))?;

    // Configuration (paths inside the node's mount namespace where they say so).
    std::fs::write(
        node.join("root/etc/cni/net.d/10-flotilla.conflist"),
        cni_conflist(&net.pod_cidr(i)),
    )?;
    std::fs::write(node.join("containerd.toml"), containerd_config(&node))?;
    let pki = env
        .dir
        .join("kwok")
        .join("clusters")
        .join(cluster)
        .join("pki");
    std::fs::write(
        node.join("kubelet.yaml"),
        kubelet_config(&node, &ip, &state.cgroup_root, &pki.join("ca.crt")),
    )?;
    make_cgroups(&state.cgroup_root)?;

    // The apiserver, as the node sees it: its port on the bridge address, forwarded to
    // loopback.
    let port = apiserver_port(kubeconfig)?;
    let node_kubeconfig = node.join("kubeconfig.yaml");
    std::fs::write(
        &node_kubeconfig,
        std::fs::read_to_string(kubeconfig)?.replace(
            &format!("https://127.0.0.1:{port}"),
            &format!("https://{}:{port}", net.host_ip()),
        ),
    )?;
    let forward = process::spawn_detached(
        "apiserver-forward",
        Command::new("socat").args([
            format!("TCP-LISTEN:{port},bind={},fork,reuseaddr", net.host_ip()),
            format!("TCP:127.0.0.1:{port}"),
        ]),
        &logs.join("apiserver-forward.log"),
    )?;
    state.processes.push(forward);
    state.save(&env.dir)?;
    let kubeconfig = node_kubeconfig.as_path();
    std::fs::write(
        node.join("kube-proxy.yaml"),
        kube_proxy_config(kubeconfig, i, net),
    )?;

    let containerd = process::spawn_detached(
        "containerd",
        ns(&["containerd", "--config"]).arg(node.join("containerd.toml")),
        &logs.join("containerd.log"),
    )?;
    state.processes.push(containerd.clone());
    state.save(&env.dir)?;
    let sock = node.join("containerd.sock");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        if !containerd.alive() || Instant::now() > deadline {
            bail!(
                "containerd did not come up; see {}",
                logs.join("containerd.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let kubelet = process::spawn_detached(
        "kubelet",
        ns(&[])
            .arg(bin.join("kubelet"))
            .arg("--config")
            .arg(node.join("kubelet.yaml"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args([
                "--hostname-override",
                NODE_NAME,
                "--node-ip",
                &ip,
                "--node-labels",
                &format!("{REAL_NODE_KEY}=true"),
            ]),
        &logs.join("kubelet.log"),
    )?;
    state.processes.push(kubelet);
    state.save(&env.dir)?;
    let proxy = process::spawn_detached(
        "kube-proxy",
        ns(&[])
            .arg(bin.join("kube-proxy"))
            .arg("--config")
            .arg(node.join("kube-proxy.yaml")),
        &logs.join("kube-proxy.log"),
    )?;
    state.processes.push(proxy);
    state.save(&env.dir)?;
    Ok(())
}

/// The port of `https://127.0.0.1:PORT` in a kwokctl kubeconfig.
fn apiserver_port(kubeconfig: &Path) -> Result<u16> {
    let text = std::fs::read_to_string(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    text.split("https://127.0.0.1:")
        .nth(1)
        .and_then(|rest| {
            rest.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .ok()
        })
        .with_context(|| format!("no https://127.0.0.1:PORT in {}", kubeconfig.display()))
}

/// `ctr images import` of an OCI archive into the node's containerd (namespace `k8s.io`,
/// the CRI's). Importing an image that is there already changes nothing.
pub async fn import(node: &Path, archive: &Path) -> Result<()> {
    let out = tokio::process::Command::new("ctr")
        .arg("--address")
        .arg(node.join("containerd.sock"))
        .args(["-n", "k8s.io", "images", "import"])
        .arg(archive)
        .output()
        .await
        .context("running ctr")?;
    if !out.status.success() {
        bail!(
            "ctr images import {} failed ({}): {}",
            archive.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Imports `archive` into the real node of every cluster of `env`.
pub async fn import_everywhere(env: &Env, archive: &Path) -> Result<()> {
    for c in &env.clusters {
        import(&nodes_dir(&env.dir).join(&c.name), archive)
            .await
            .with_context(|| format!("into the node of {}", c.name))?;
    }
    Ok(())
}

/// Deletes interface `name` if it exists (a veth: both ends go).
fn delete_link(name: &str) -> Result<()> {
    if Path::new("/sys/class/net").join(name).exists() {
        run(Command::new("ip").args(["link", "del", name]))?;
    }
    Ok(())
}

fn stop_node(dir: &Path, state: &NodeState) -> Result<()> {
    // The kubelet and kube-proxy first, so that nothing restarts containers meanwhile.
    let clients: Vec<ProcessRecord> = state
        .processes
        .iter()
        .filter(|p| p.name != "containerd")
        .cloned()
        .collect();
    process::stop_many(&clients, Duration::from_secs(5))?;
    // Then everything else: containers (in the node's cgroups), containerd, the shims and
    // the holder (in its namespaces). SIGKILL: nothing there keeps state we want.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut pids = cgroup_pids(&state.cgroup_root);
        if state.netns.is_some() || state.mntns.is_some() {
            pids.extend(in_namespaces(state.netns, state.mntns));
        }
        pids.extend(state.all().iter().filter(|p| p.alive()).map(|p| p.pid));
        if pids.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "processes of the real node of {} survive SIGKILL: {pids:?}",
                state.cluster
            );
        }
        kill_pids(&pids);
        std::thread::sleep(Duration::from_millis(100));
    }
    remove_cgroups(&state.cgroup_root)?;
    let node = nodes_dir(dir).join(&state.cluster);
    match std::fs::remove_dir_all(&node) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", node.display()))
        }
        _ => Ok(()),
    }
}

/// Stops every real node of the environment in `dir` and removes the bridge and the
/// nodes' state. Nothing to do (and fast) when the environment has none.
pub fn down(dir: &Path) -> Result<()> {
    let root = nodes_dir(dir);
    if !root.exists() {
        return Ok(());
    }
    let nodes = nodes(dir);
    // Every node's kubelet, kube-proxy and forwarder at once (each may take its grace).
    let clients: Vec<ProcessRecord> = nodes
        .iter()
        .flat_map(|n| {
            n.processes
                .iter()
                .filter(|p| p.name != "containerd")
                .cloned()
        })
        .collect();
    process::stop_many(&clients, Duration::from_secs(5))?;
    for state in nodes {
        stop_node(dir, &state)?;
    }
    if let Ok(b) = std::fs::read(net_file(dir)) {
        let net: Network = serde_json::from_slice(&b)?;
        // A node's network namespace has been seen to outlive its last process for a
        // while (its veth stayed): delete the veths by name, then the bridge.
        let veths: Vec<String> = std::fs::read_dir("/sys/class/net")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .filter(|n| n.starts_with(&format!("flo{}n", net.tag)))
                    .collect()
            })
            .unwrap_or_default();
        for v in veths {
            delete_link(&v)?;
        }
        delete_link(&net.bridge)?;
    }
    std::fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_name_the_node_s_own_paths_and_addresses() {
        let net = Network {
            bridge: "floabcdefbr".into(),
            third: 7,
            tag: "abcdef".into(),
        };
        assert_eq!(net.host_ip(), "10.213.7.1");
        assert_eq!(net.node_ip(2), "10.213.7.12");
        assert!(
            net.veth(2).len() <= 15,
            "interface names are at most 15 bytes"
        );
        assert!(net.bridge.len() <= 15);
        let node = Path::new("/e2e/nodes/cluster2");
        let c = containerd_config(node);
        assert!(c.contains("address = \"/e2e/nodes/cluster2/containerd.sock\""));
        assert!(c.contains(PAUSE_IMAGE));
        let toml_value = |key: &str| {
            c.lines()
                .find_map(|l| l.trim().strip_prefix(&format!("{key} = ")))
                .map(|v| v.trim_matches('"').to_string())
        };
        assert_eq!(
            toml_value("config_path").as_deref(),
            Some("/e2e/nodes/cluster2/certs.d")
        );
        assert_eq!(
            registry_hosts_dir(node),
            Path::new("/e2e/nodes/cluster2/certs.d")
        );
        let k: serde_yaml::Value = serde_yaml::from_str(&kubelet_config(
            node,
            "10.213.7.12",
            "/flotilla-abcdef-cluster2",
            Path::new("/ca.crt"),
        ))
        .unwrap();
        assert_eq!(k["cgroupRoot"], "/flotilla-abcdef-cluster2");
        assert_eq!(k["registerWithTaints"][0]["key"], REAL_NODE_KEY);
        assert_eq!(k["registerWithTaints"][0]["effect"], "NoSchedule");
        let cni: serde_json::Value = serde_json::from_str(&cni_conflist(&net.pod_cidr(2))).unwrap();
        assert_eq!(
            cni["plugins"][0]["ipam"]["ranges"][0][0]["subnet"],
            "10.216.7.0/24"
        );
        let p: serde_yaml::Value =
            serde_yaml::from_str(&kube_proxy_config(Path::new("/kc"), 2, &net)).unwrap();
        assert_eq!(p["nodePortAddresses"][0], "10.213.7.0/24");
    }
}
