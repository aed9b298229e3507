"""streamlog's gRPC service: the network face of the storage engine (see DESIGN.md)."""
