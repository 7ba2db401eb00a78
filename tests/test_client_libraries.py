"""The client libraries people use, unchanged, against a live server on the real weights
(SmolLM2-135M-Instruct; skipped without them): ``openai-agents`` (an agent whose run calls
its tool, over chat completions and over the Responses API), ``instructor`` (JSON-schema
and tools modes), ``langchain-openai`` (``with_structured_output``, by JSON schema and by
function calling, over both APIs) and ``litellm`` (as an OpenAI and as an Anthropic
provider). Each is skipped, saying so, when its package is not installed (they are test
dependencies: ``pip install -e '.[test]'``). Nothing here leaves the machine: the
libraries' own telemetry and downloads are switched off."""

from __future__ import annotations

import asyncio
import os

import pytest
from pydantic import BaseModel

from server_util import call, integrity, running_server

EXTRACT = "Paris is a city in France. Extract the city."


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def served(smollm2_gguf, tmp_path_factory):
    with running_server(smollm2_gguf, tmp_path_factory.mktemp("libraries")) as (url, server):
        yield url, server.models[0]
        # what is left is the KV of the responses the Responses API stored (store: true,
        # the SDKs' default): dropped, nothing else is held
        res = server.controller.models[server.models[0]].resources
        names = call(server, lambda: [n for n, _, _ in res.list_exports()])
        assert all(n.startswith("responses/") for n in names)
        call(server, lambda: [res.unexport(None, n, "local") for n in names])
        assert integrity(server) == (0, 0)


def need(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed (a test dependency)")


def check_city(city) -> None:
    assert isinstance(city, City) and city.name == "Paris" and city.country.lower() == "france"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_run_calls_the_tool(served, api):
    agents = need("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # it would send traces to OpenAI
    url, model = served
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kind = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60)
    agent = agents.Agent(name="weather", instructions="Be brief.", tools=[get_weather], model=kind(model, client), model_settings=settings)  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls == ["Paris"]
    assert isinstance(result.final_output, str) and "sunny" in result.final_output


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(served, mode):
    instructor = need("instructor")
    from openai import OpenAI

    url, model = served
    client = instructor.from_openai(OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), mode=getattr(instructor.Mode, mode))  # fmt: skip
    city = client.chat.completions.create(model=model, response_model=City, messages=[{"role": "user", "content": EXTRACT}], temperature=0, max_tokens=60, max_retries=0)  # fmt: skip
    check_city(city)


@pytest.mark.parametrize(
    "method, responses",
    [("json_schema", False), ("function_calling", False), ("json_schema", True)],
)
def test_langchain_with_structured_output(served, method, responses):
    need("langchain_openai")
    from langchain_openai import ChatOpenAI

    url, model = served
    llm = ChatOpenAI(base_url=url + "/v1", api_key="x", model=model, temperature=0, max_tokens=60, max_retries=0, use_responses_api=responses)  # fmt: skip
    check_city(llm.with_structured_output(City, method=method).invoke(EXTRACT))


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_litellm(served, provider):
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # else it downloads one at import
    litellm = need("litellm")
    litellm.telemetry = False
    url, model = served
    base = url + "/v1" if provider == "openai" else url
    r = litellm.completion(model=f"{provider}/{model}", api_base=base, api_key="x", messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=20)  # fmt: skip
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.usage.completion_tokens == 8
