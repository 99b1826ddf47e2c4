"""A zen cluster on one machine: N daemons (local.LocalCluster), optionally in network namespaces
behind shaped links (netns.EmulatedCluster), a training job's ranks beside them
(launcher.run_local_job), and the `zend cluster` command (command) with its checking workload
(workload, which every trainer process imports: so this marker imports nothing)."""
