"""One node's daemon (`zend serve`), its parts built and wired by `daemon.Daemon`.

The gRPC services (trainer_service, operator_service, grpc_errors), the jobs and sessions
(jobs), a trainer's submission (trainer_steps, steps) and the node's steps (node_steps), the
agreement on settings and tensors, membership,
settings and the secret, metrics, logs, and the commands `zend serve/status/health/token`.
"""
