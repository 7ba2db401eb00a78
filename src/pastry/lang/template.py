"""Role blocks (``system`` / ``user`` / ``assistant``) rendered with the model's own chat
template.

A role's *prefix* (the text that opens it) and *suffix* (the text that closes it) are cut
out of the template's rendering of the conversation so far plus one message whose content
is a sentinel: the prefix is what the new message adds before the sentinel, the suffix
what follows it. So whatever the template does — a default system prompt before the first
message, special tokens, separators — comes out exactly as the model was trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

SENTINEL = "\x00PASTRY-LANG-CONTENT\x00"

Render = Callable[[list[tuple[str, str]]], str]  # messages -> text (no generation prompt)


def prefix_and_suffix(
    render: Render, messages: Sequence[tuple[str, str]], role: str
) -> tuple[str, str]:
    """The text that opens and the text that closes a ``role`` message after
    ``messages`` (the conversation so far, as (role, content) pairs)."""
    before = render(list(messages)) if messages else ""
    full = render([*messages, (role, SENTINEL)])
    at = full.find(SENTINEL)
    if at < 0:
        raise ValueError(
            f"the model's chat template drops the content of a {role!r} message; "
            "pastry.lang cannot render role blocks with it"
        )
    if not full.startswith(before):
        raise ValueError(
            f"the model's chat template renders the conversation differently once a "
            f"{role!r} message follows it; pastry.lang needs each message's text to extend "
            "the previous rendering"
        )
    return full[len(before) : at], full[at + len(SENTINEL) :]
