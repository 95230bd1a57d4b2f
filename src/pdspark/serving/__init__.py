"""Prefill and decode worker processes: an engine on its own thread behind a gRPC server."""
