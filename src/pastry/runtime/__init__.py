"""The application layer: inferlet runners."""
