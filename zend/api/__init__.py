"""Generated gRPC and protobuf stubs (scripts/gen_protos.py)."""
