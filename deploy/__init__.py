"""tether deployment: the command line, local clusters and jobs, compare/sweep, export, Kubernetes and Prometheus files."""
