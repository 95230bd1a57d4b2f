"""The wire contract: generated protobuf code lives in `pdspark.v1`; `convert` is the only bridge to engine types."""
