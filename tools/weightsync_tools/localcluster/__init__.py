"""A local Kubernetes cluster from real components (built from Go modules), for the demo and e2e tests."""
