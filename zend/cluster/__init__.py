"""A zen cluster on one machine: N daemons (LocalCluster), optionally in network namespaces behind
shaped links (EmulatedCluster), a training job's ranks beside them (run_local_job), and the
`zend cluster` command with its checking workload."""

from zend.cluster.launcher import rank_env, run_local_job
from zend.cluster.local import LocalCluster, free_port
from zend.cluster.netns import EmulatedCluster

__all__ = ["EmulatedCluster", "LocalCluster", "free_port", "rank_env", "run_local_job"]
