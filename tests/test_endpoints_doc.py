"""docs/endpoints.md names every request field the HTTP APIs accept (the field sets in the
code are the one definition; the page is checked against them)."""

from __future__ import annotations

import re
from pathlib import Path

from pastry.server import anthropic, responses, sglang_params
from pastry.server.openai_params import CHAT_FIELDS, COMPLETION_FIELDS

DOC = Path(__file__).resolve().parents[1] / "docs" / "endpoints.md"


def test_every_accepted_field_is_documented():
    named = set(re.findall(r"`([a-z_.]+)`", DOC.read_text()))
    named |= {part for n in named for part in n.split(".")}
    fields = {
        "completions": COMPLETION_FIELDS,
        "chat": CHAT_FIELDS,
        "responses": responses.FIELDS,
        "messages": anthropic.FIELDS,
        "sglang": sglang_params.FIELDS | sglang_params.SAMPLING | set(sglang_params.OFF),
    }
    missing = {api: sorted(set(f) - named) for api, f in fields.items() if set(f) - named}
    assert not missing, f"docs/endpoints.md does not name {missing}"
