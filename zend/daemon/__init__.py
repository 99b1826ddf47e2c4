"""The per-node daemon: membership, settings, jobs and the service that trainers talk to."""
