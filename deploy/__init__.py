"""tether deployment: local launcher, command-line entry point, Kubernetes and Prometheus files."""
