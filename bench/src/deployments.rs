//! The drain and single pushes on other deployments (a replica with `wait_replicas`, a Redis Cluster).

use super::*;

/// The same drain (1 daemon, safe and default mode) and single pushes on the bench's own Redis, then with a
/// replica attached (`wait_replicas` 0 and 1: what replication and `WAIT` cost per task), then on a Redis Cluster
/// of three masters (what the cluster client costs), in one session.
pub(crate) fn deployments(bench: &Bench) -> Result<Vec<Figure>, String> {
    let mut figures = Vec::new();
    let own = bench.own();
    let labelled = |label: &str, section: String| Target {
        label: Some(label.to_string()),
        section,
        masters: vec![&bench.server],
        holder: &bench.server,
    };
    let single = labelled("one Redis", own.section.clone());
    for mode in ["safe", "default"] {
        figures.push(drain_with(bench, &single, mode, 1, None)?);
    }
    figures.push(single_pushes(bench, &single)?);

    let port = bench
        .server
        .port()
        .ok_or("the bench's Redis listens on TCP")?
        .to_string();
    let mut options = kmqd_harness::Options::new(Listen::Loopback);
    options.extra_args = ["--replicaof", "127.0.0.1", port.as_str()]
        .map(String::from)
        .to_vec();
    let replica = RedisServer::start_with(options)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !replica
        .query_as::<String>(&["INFO", "replication"])?
        .contains("master_link_status:up")
    {
        if Instant::now() > deadline {
            return Err("the replica did not sync within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for wait in [0, 1] {
        let target = labelled(
            &format!("one Redis + 1 replica, wait_replicas = {wait}"),
            format!(
                "{}\nwait_replicas = {wait}\nwait_timeout = \"1s\"",
                own.section
            ),
        );
        for mode in ["safe", "default"] {
            figures.push(drain_with(bench, &target, mode, 1, None)?);
        }
        figures.push(single_pushes(bench, &target)?);
    }
    drop(replica);

    let cluster = kmqd_harness::cluster::Cluster::start(kmqd_harness::cluster::ClusterOptions {
        replicas_per_master: 0,
        ..Default::default()
    })?;
    let seeds: Vec<String> = cluster
        .seeds()?
        .iter()
        .map(|seed| format!("\"{seed}\""))
        .collect();
    let holder = cluster.master_for_key("{q}")?;
    let target = Target {
        label: Some("Redis Cluster, 3 masters".to_string()),
        section: format!("cluster = [{}]", seeds.join(", ")),
        masters: cluster
            .masters()?
            .iter()
            .filter_map(|node| cluster.server(&node.addr))
            .collect(),
        holder: cluster
            .server(&holder.addr)
            .ok_or("the queue's master is ours")?,
    };
    for mode in ["safe", "default"] {
        figures.push(drain_with(bench, &target, mode, 1, None)?);
    }
    figures.push(single_pushes(bench, &target)?);
    Ok(figures)
}
