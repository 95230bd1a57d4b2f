"""The router: OpenAI-compatible HTTP and gRPC front ends over prefill/decode worker pairs."""
