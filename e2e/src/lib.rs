//! End-to-end test support against a real local Kubernetes cluster (skeleton).
