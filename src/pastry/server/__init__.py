"""The server: engine processes, the control layer and runner, and the client-facing
endpoints (WebSocket protocol, OpenAI-compatible HTTP)."""
