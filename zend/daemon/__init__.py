"""One node's daemon (`zend serve`), its parts built and wired by `daemon.Daemon`.

The gRPC services (trainer_service, operator_service, grpc_errors), the jobs and sessions
(jobs), a trainer's submission (admission, steps) and the node's step (node_step), membership,
settings and the secret, metrics, logs, and the commands `zend serve/status/health/token`.
"""
