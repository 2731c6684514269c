//! baton-webhook (skeleton).
