"""SGLang's workloads written in pastry.lang vs the same programs driven from a client
through the OpenAI endpoint, one request per call (the way a vLLM user writes them).

    python benchmarks/lang.py [--quick] [--model DIR] [--concurrency 16] [--trusted]

Workloads (SGLang paper §6, digest §6.4 recipes 1-3, 6-9, 11), greedy, on a live server
(``tests/server_util.running_server``: uvicorn, engine in-process, page size 16):

- ``mmlu``: a 5-shot prefix shared by every program + a question, answer = 1 token.
- ``hellaswag``: a 5-shot prefix + a context, ``select`` over 4 endings.
- ``multi_chain``: a question, 4 reasoning chains (``fork``), then a meta-answer over them.
- ``tree_of_thought``: BFS of breadth 2, depth 2: propose, then judge each branch.
- ``skeleton_of_thought``: the paper's Figure 4 (2 tips, 2 nested expansions, a summary).
- ``branch_solve_merge``: the paper's Figure 1 (3 forks judging an essay, a summary, a
  grade ``select``).
- ``long_doc_json``: a long document, then one ``gen`` per field of a JSON object.

pastry.lang: each program runs from this client process through ``pastry.lang.Endpoint``
(shipped to the server as one inferlet per run: its calls, forks and nested programs run
next to their KV). OpenAI client: the same steps as sequential ``POST /v1/completions``
calls re-sending the whole text (a choice is scored with one ``echo`` + ``logprobs``
request per choice where the endpoint offers them, else with one native ``/generate``
request per choice with ``return_logprob``: the table says which). Throughput: N
programs, ``--concurrency`` at a time (programs/s); latency: one program at a time (mean
seconds). Lines of code: non-blank, non-comment lines of each version's functions.

Without ``--model`` a random-weight tiny llama (the text is gibberish; every stop and
length is the same for both versions, so they do the same work). Uploaded programs run in
the WebAssembly sandbox unless ``--trusted``. The last line is a JSON object with
``throughput_lang_over_openai_client_<workload>`` for each workload.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import pastry.lang as sgl
from machine import cpu_name  # benchmarks/ is on the path (the script's dir)
from pastry.lang import function, gen, select

SHOT = (
    "Question: Which gas do plants take in from the air to make food?\n"
    "A. oxygen B. carbon dioxide C. nitrogen D. helium\nAnswer: B\n\n"
)
FEW_SHOT = SHOT * 5
STORY = "A man is sitting on a roof. He starts pulling up roofing on the roof. " * 5
DOCUMENT = (
    "Paris is the capital and most populous city of France, with an estimated population "
    "of two million residents. Since the 17th century it has been a centre of finance, "
    "diplomacy, commerce, culture, fashion and gastronomy. "
) * 12
FIELDS = ("name", "country", "population", "landmark", "summary")


# ---------------------------------------------------------------------- pastry.lang


@function
def mmlu(s, question):
    s += FEW_SHOT + "Question: " + question + "\nAnswer:"
    s += gen("answer", max_tokens=1)


@function
def hellaswag(s, context, endings):
    s += FEW_SHOT + context
    s += select("ending", choices=endings)


@function
def multi_chain(s, question):
    s += "Question: " + question + "\n"
    forks = s.fork(4)
    for i, f in enumerate(forks):
        f += f"Chain {i}: Let's think step by step." + gen("chain", max_tokens=24)
    for i, f in enumerate(forks):
        s += f"Solution {i}:" + f["chain"] + "\n"
    s += "Considering all solutions, the answer is" + gen("answer", max_tokens=16)


@function
def tree_of_thought(s, question):
    s += "Question: " + question + "\n"
    for level in range(2):
        forks = s.fork(2)
        for f in forks:
            f += f"Step {level}:" + gen("step", max_tokens=16)
            f += "\nIs this step good?" + select("good", choices=[" yes", " no"])
        best = next((f for f in forks if f["good"] == " yes"), forks[0])
        s += f"Step {level}:" + best["step"] + "\n"
    s += "Answer:" + gen("answer", max_tokens=16)


@function
def expand(s, tip):
    s += "Please expand the following tip into a detailed paragraph: " + tip + "\n"
    s += gen("paragraph", max_tokens=32)


@function
def skeleton_of_thought(s, topic):
    s += "Here are 2 concise tips for " + topic + ".\n"
    s += "1." + gen("tip_1", max_tokens=12, stop=["\n", ":", "."]) + "\n"
    s += "2." + gen("tip_2", max_tokens=12, stop=["\n", ":", "."]) + "\n"
    detailed_tip1 = expand(tip=s["tip_1"])
    detailed_tip2 = expand(tip=s["tip_2"])
    s += "Tip 1: " + detailed_tip1["paragraph"] + "\n"
    s += "Tip 2: " + detailed_tip2["paragraph"] + "\n"
    s += "In summary" + gen("summary", max_tokens=24)


@function
def branch_solve_merge(s, essay):
    s += "Please evaluate the following essay. " + essay
    dimensions = ["Clarity", "Originality", "Evidence"]
    forks = s.fork(len(dimensions))
    for f, dim in zip(forks, dimensions, strict=True):
        f += "Evaluate based on the following metric: " + dim + ". "
        f += "End your judgement with the word 'END'"
        f += "Judgment: " + gen("judgment", max_tokens=24, stop="END")
    for f, dim in zip(forks, dimensions, strict=True):
        s += dim + ": " + f["judgment"] + "\n"
    s += "In summary, " + gen("summary", max_tokens=24)
    s += "I give the essay a letter grade of " + select("grade", choices=["A", "B", "C", "D"])


@function
def long_doc_json(s, document):
    s += "Document: " + document + "\nThe city's facts as JSON:\n{"
    for field in FIELDS:
        s += '"' + field + '": "' + gen(field, max_tokens=12, stop='"') + '", '
    s += "}"


LANG = {
    "mmlu": (mmlu, [mmlu]),
    "hellaswag": (hellaswag, [hellaswag]),
    "multi_chain": (multi_chain, [multi_chain]),
    "tree_of_thought": (tree_of_thought, [tree_of_thought]),
    "skeleton_of_thought": (skeleton_of_thought, [skeleton_of_thought, expand]),
    "branch_solve_merge": (branch_solve_merge, [branch_solve_merge]),
    "long_doc_json": (long_doc_json, [long_doc_json]),
}


# ---------------------------------------------------------------------- OpenAI client


class Api:
    """One completion request per call, re-sending the whole text."""

    def __init__(self, url: str, model: str) -> None:
        import openai
        import requests

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        self.url, self.model, self.requests = url, model, requests
        self.scoring = "openai echo+logprobs"
        try:
            self._echo("a", "b")
        except openai.BadRequestError:
            self.scoring = "native /generate per choice (the OpenAI endpoint has no logprobs)"

    def complete(self, prompt: str, max_tokens: int, stop=None) -> str:
        r = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stop=stop
        )
        return r.choices[0].text

    def _echo(self, prompt: str, choice: str) -> float:
        r = self.client.completions.create(
            model=self.model, prompt=prompt + choice, max_tokens=1, echo=True, logprobs=1,
            temperature=0,
        )  # fmt: skip
        lp = r.choices[0].logprobs
        n = len(prompt + choice)
        picked = [x for x, off in zip(lp.token_logprobs, lp.text_offset, strict=True)
                  if x is not None and len(prompt) - 1 <= off < n]  # fmt: skip
        return sum(picked) / max(len(picked), 1)

    def _generate(self, body: dict) -> dict:
        r = self.requests.post(self.url + "/generate", json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.text}")
        return r.json()

    def select(self, prompt: str, choices: list[str]) -> str:
        if self.scoring.startswith("openai"):
            scores = [self._echo(prompt, c) for c in choices]
        else:  # as SGLang's RuntimeEndpoint does: the prompt's length, then each choice
            sp = {"max_new_tokens": 0}
            n = self._generate({"text": prompt, "sampling_params": sp})["meta_info"]
            start = max(n["prompt_tokens"] - 2, 0)
            scores = []
            for c in choices:
                r = self._generate({"text": prompt + c, "sampling_params": sp,
                                    "return_logprob": True, "logprob_start_len": start})  # fmt: skip
                lps = [x[0] for x in r["meta_info"]["input_token_logprobs"][1:]]
                scores.append(sum(lps) / max(len(lps), 1))
        return choices[max(range(len(choices)), key=scores.__getitem__)]


def client_mmlu(api: Api, question):
    s = FEW_SHOT + "Question: " + question + "\nAnswer:"
    return s + api.complete(s, 1)


def client_hellaswag(api: Api, context, endings):
    s = FEW_SHOT + context
    return s + api.select(s, endings)


def client_multi_chain(api: Api, question):
    s = "Question: " + question + "\n"
    chains = []
    for i in range(4):
        p = s + f"Chain {i}: Let's think step by step."
        chains.append(api.complete(p, 24))
    for i, c in enumerate(chains):
        s += f"Solution {i}:" + c + "\n"
    s += "Considering all solutions, the answer is"
    return s + api.complete(s, 16)


def client_tree_of_thought(api: Api, question):
    s = "Question: " + question + "\n"
    for level in range(2):
        branches = []
        for _ in range(2):
            p = s + f"Step {level}:"
            step = api.complete(p, 16)
            good = api.select(p + step + "\nIs this step good?", [" yes", " no"])
            branches.append((step, good))
        best = next((b for b in branches if b[1] == " yes"), branches[0])
        s += f"Step {level}:" + best[0] + "\n"
    s += "Answer:"
    return s + api.complete(s, 16)


def client_skeleton_of_thought(api: Api, topic):
    s = "Here are 2 concise tips for " + topic + ".\n"
    s += "1."
    tip_1 = api.complete(s, 12, ["\n", ":", "."])
    s += tip_1 + "\n2."
    tip_2 = api.complete(s, 12, ["\n", ":", "."])
    s += tip_2 + "\n"
    paragraphs = []
    for tip in (tip_1, tip_2):
        p = "Please expand the following tip into a detailed paragraph: " + tip + "\n"
        paragraphs.append(api.complete(p, 32))
    s += "Tip 1: " + paragraphs[0] + "\n"
    s += "Tip 2: " + paragraphs[1] + "\n"
    s += "In summary"
    return s + api.complete(s, 24)


def client_branch_solve_merge(api: Api, essay):
    s = "Please evaluate the following essay. " + essay
    dimensions = ["Clarity", "Originality", "Evidence"]
    judgments = []
    for dim in dimensions:
        p = s + "Evaluate based on the following metric: " + dim + ". "
        p += "End your judgement with the word 'END'"
        p += "Judgment: "
        judgments.append(api.complete(p, 24, "END"))
    for dim, j in zip(dimensions, judgments, strict=True):
        s += dim + ": " + j + "\n"
    s += "In summary, "
    s += api.complete(s, 24)
    s += "I give the essay a letter grade of "
    return s + api.select(s, ["A", "B", "C", "D"])


def client_long_doc_json(api: Api, document):
    s = "Document: " + document + "\nThe city's facts as JSON:\n{"
    for field in FIELDS:
        s += '"' + field + '": "'
        s += api.complete(s, 12, '"') + '", '
    return s + "}"


CLIENT = {name: globals()["client_" + name] for name in LANG}


def arguments(name: str, i: int) -> dict:
    return {
        "mmlu": {"question": f"What is {i} plus {i + 1}?\nA. {2 * i} B. {2 * i + 1} C. 7 D. 9"},
        "hellaswag": {"context": STORY + f" Then {i}",
                      "endings": [" he falls.", " he sings a song loudly.", " it rains.",
                                  " the roof is finished by noon."]},
        "multi_chain": {"question": f"A farmer has {i + 3} cows and buys 4 more. How many?"},
        "tree_of_thought": {"question": f"How many legs do {i + 2} spiders have?"},
        "skeleton_of_thought": {"topic": f"staying healthy in year {2000 + i}"},
        "branch_solve_merge": {"essay": f"Essay {i}: " + STORY},
        "long_doc_json": {"document": f"({i}) " + DOCUMENT},
    }[name]  # fmt: skip


def loc(functions) -> int:
    n = 0
    for f in functions:
        src = inspect.getsource(getattr(f, "func", f))
        n += sum(
            1 for line in src.splitlines() if line.strip() and not line.strip().startswith("#")
        )
    return n


def measure(run_one, n: int, concurrency: int, latency_reps: int):
    """(programs/s over n programs, concurrency at a time; mean latency of one at a time)."""
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run_one, range(n)))
    throughput = n / (time.perf_counter() - t)
    times = []
    for i in range(latency_reps):
        t = time.perf_counter()
        run_one(10_000 + i)
        times.append(time.perf_counter() - t)
    return throughput, statistics.mean(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions, same shapes")
    p.add_argument("--model", help="checkpoint directory (default: a random tiny llama)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--trusted", action="store_true", help="run uploads trusted, not sandboxed")
    p.add_argument("--workloads", default=",".join(LANG))
    a = p.parse_args(argv)
    n, reps = (a.concurrency, 1) if a.quick else (4 * a.concurrency, 3)

    from pastry.engine.tiny import create_tiny
    from server_util import running_server

    if not a.trusted:
        from pastry.runtime import build_pyrt

        build_pyrt.build()  # the sandbox's runtime, once per version of the guest sources
    tmp = Path(tempfile.mkdtemp(prefix="pastry-lang-bench-"))
    model = a.model or str(create_tiny(tmp / "model", arch="llama"))
    rows, ratios = [], {}
    with running_server(model, tmp / "server", trusted_uploads=a.trusted, num_pages=8192, num_embeds=65536) as (
        url, server,
    ):  # fmt: skip
        ep = sgl.Endpoint(url)
        api = Api(url, server.models[0])
        for name in a.workloads.split(","):
            program, lang_fns = LANG[name]
            client_fn = CLIENT[name]
            program.run(**arguments(name, 0), temperature=0, backend=ep)  # warm up: upload
            client_fn(api, **arguments(name, 0))
            lang = measure(
                lambda i, f=program, w=name: f.run(**arguments(w, i), temperature=0, backend=ep),
                n, a.concurrency, reps,
            )  # fmt: skip
            base = measure(
                lambda i, f=client_fn, w=name: f(api, **arguments(w, i)), n, a.concurrency, reps
            )
            ratios[name] = lang[0] / base[0]
            rows.append((name, lang, base, loc(lang_fns), loc([client_fn])))
        ep.close()

    print(f"machine: {cpu_name()}; model: {model}; "
          f"{n} programs, {a.concurrency} at a time; latency: mean of {reps}; "
          f"uploads {'trusted' if a.trusted else 'sandboxed'}; choices scored by "
          f"{api.scoring}")  # fmt: skip
    head = (f"{'workload':<22}{'lang p/s':>10}{'client p/s':>12}{'ratio':>7}"
            f"{'lang lat s':>12}{'client lat s':>14}{'LoC lang':>10}{'LoC client':>12}")  # fmt: skip
    print(head)
    for name, lang, base, l1, l2 in rows:
        print(f"{name:<22}{lang[0]:>10.2f}{base[0]:>12.2f}{lang[0] / base[0]:>7.2f}"
              f"{lang[1]:>12.3f}{base[1]:>14.3f}{l1:>10}{l2:>12}")  # fmt: skip
    print(json.dumps({f"throughput_lang_over_openai_client_{k}": round(v, 3)
                      for k, v in ratios.items()}))  # fmt: skip


if __name__ == "__main__":
    main()
