"""pastry.sdk.args.options: the one JSON object the built-ins take, with exact errors."""

from __future__ import annotations

import json

import pytest

from pastry.sdk.args import options

DEFAULTS = {"model": None, "max_tokens": 16}


def test_options_over_defaults_with_the_prompt_keys():
    assert options([], DEFAULTS) == DEFAULTS
    given = {"prompt_tokens": [1, 2], "max_tokens": 3}
    assert options([json.dumps(given)], DEFAULTS) == {"model": None, **given}
    with pytest.raises(ValueError) as e:
        options(['{"max": 3, "b": 1}'], DEFAULTS)
    assert str(e.value) == (
        "unknown args ['b', 'max']; accepted: prompt, prompt_tokens, model, max_tokens"
    )


def test_options_without_prompt_keys_accept_only_the_defaults():
    own = {"prompt": None, **DEFAULTS}
    assert options(['{"prompt": "hi"}'], own, prompt_keys=()) == {**own, "prompt": "hi"}
    with pytest.raises(ValueError) as e:
        options(['{"prompt_tokens": [1]}'], own, prompt_keys=())
    assert str(e.value) == "unknown args ['prompt_tokens']; accepted: prompt, model, max_tokens"
    with pytest.raises(ValueError) as e:  # a prompt key among the defaults is listed once
        options(['{"x": 1}'], own)
    assert str(e.value) == "unknown args ['x']; accepted: prompt, prompt_tokens, model, max_tokens"


def test_options_must_be_one_json_object():
    with pytest.raises(ValueError, match=r"args must be one JSON object, got '\[1\]'"):
        options(["[1]"], DEFAULTS)
