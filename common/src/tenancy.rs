//! The tenancy flags of the hub and the agent: which namespaces are refused besides
//! Kubernetes' own (`flotilla_crds::tenancy` holds the rule itself).

/// Namespaces no FederatedMyApp may be placed from and no MyApp applied into.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct TenancyArgs {
    /// The namespace Flotilla runs in, refused because it holds Flotilla's credentials
    /// (the Pod's own namespace in a cluster).
    #[arg(
        long = "flotilla-namespace",
        env = "POD_NAMESPACE",
        default_value = "flotilla-system"
    )]
    pub flotilla_namespace: String,
    /// Refuse this namespace too, besides kube-system, kube-public, kube-node-lease and
    /// Flotilla's own (repeat or comma-separate). The hub refuses to plan a
    /// FederatedMyApp in it; the agent refuses to apply a MyApp into it.
    #[arg(
        long = "forbidden-namespace",
        value_delimiter = ',',
        env = "FLOTILLA_FORBIDDEN_NAMESPACES"
    )]
    pub forbidden_namespaces: Vec<String>,
}
