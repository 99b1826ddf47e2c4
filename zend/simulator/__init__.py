"""The simulator: every scheme on traced embedding gradients, n ranks in one process (`zend simulate`).

- `traces`: which rows each worker's embedding gradient touches, from a real token stream;
- `simulation`: the schemes run over an InProcessCluster, bytes counted per rank;
- `command`: the `zend simulate` subcommand.
"""
