"""Generated gRPC/protobuf stubs of proto/noloco/v1 (see generate.py); do not edit the *_pb2* files by hand."""
