"""The control layer: per-inferlet resources and handles, command queues, batch scheduling,
exports, messaging and the key-value store (see docs/architecture.md)."""
