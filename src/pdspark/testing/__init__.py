"""Helpers for testing pdspark and benchmarking it, shipped with the package so that the tests, the benchmarks and a
deployment's own checks share one definition of each: starting services and waiting for them to be ready, stub
workers, polling with a deadline, a worker's load and "nothing held", a real Prometheus, a repository script imported
as a module, and the one factor by which every time bound is scaled on a slow or busy machine
(`PDSPARK_TEST_TIME_SCALE`)."""
