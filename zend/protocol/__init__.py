"""The contract between a trainer and its node's daemon, in one place.

- `layout`: how a tensor's gradient lies in a shared buffer (`TensorSpec`);
- `enums`: the proto enums of zen.v1 and zen's names for them, both directions;
- `paths`: the socket folder and the two sockets in it;
- `version`: the daemon's version;
- `health`: whether a daemon serves (grpc.health.v1);
- `session`: the trainer's side of the protocol (`TrainerSession`).
The messages themselves are `proto/zen/v1/zen.proto` (compiled into zend.api); the buffer
socket's wire format is zend.buffers.wire.
"""
