"""The client protocol over WebSocket (being written)."""


def routes(server):
    return []
