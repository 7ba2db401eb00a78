"""OpenAI-compatible HTTP endpoints (being written)."""


def routes(server):
    return []
