//! baton-sidecar (skeleton).
