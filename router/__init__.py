"""The router: public API, per-route policy, load-aware decision, replicas (no torch)."""
