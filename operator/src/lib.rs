//! baton-operator (skeleton).
