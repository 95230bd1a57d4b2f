"""The router's view of its workers: the registry (health checks, calls), DNS discovery, the policies that pick a
worker of a role (and the prefix tree `cache_aware` keeps), and the list of their metrics endpoints Prometheus
discovers."""
