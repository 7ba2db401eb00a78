"""lm-evaluation-harness against a live server: ``local-completions`` (the OpenAI completions
client lm-eval ships) gives exactly the results of lm-eval's own ``hf`` backend (transformers)
on the same weights, for a multiple-choice task (log-likelihoods of echoed prompts) and a
generation task (greedy ``generate_until`` with stop strings).

The tasks are defined here over local JSON files, and lm-eval reads the tokenizer from the
server (``/tokenizer_info``, ``/tokenize``, ``/detokenize``: its ``remote`` tokenizer
backend, detected automatically), so nothing is downloaded. Needs the ``eval`` extra
(``pip install -e '.[eval]'``, done by ``scripts/setup.sh``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from server_util import integrity, running_server

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird"]

MC_TASK = """
task: pastry_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """
task: pastry_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(tmp_path, greedy_answers: list[str] | None = None):
    rng = np.random.default_rng(0)
    mc, gen = [], []
    for i in range(24):
        words = rng.choice(WORDS, 6).tolist()
        choices = [" " + " ".join(rng.choice(WORDS, int(rng.integers(1, 4)))) for _ in range(4)]
        mc.append({"question": " ".join(words) + " is", "choices": choices, "answer": i % 4})
        gen.append({"question": "The " + " ".join(words[:4]), "answer": " " + words[4]})
    (tmp_path / "mc.jsonl").write_text("\n".join(json.dumps(d) for d in mc))
    (tmp_path / "gen.jsonl").write_text("\n".join(json.dumps(d) for d in gen))
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=tmp_path / "mc.jsonl"))
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=tmp_path / "gen.jsonl"))


def evaluate(tmp_path, model: str, model_args: dict) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["pastry_mc", "pastry_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
        batch_size=1,
    )
    return out


def test_local_completions_equal_the_hf_backend(make_tiny, tmp_path, monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    ckpt = make_tiny("llama")
    write_tasks(tmp_path)
    # lm-eval's remote tokenizer encodes without special tokens; the hf backend would add
    # the tiny tokenizer's BOS unless told not to: the same tokens on both sides.
    hf_args = {"pretrained": str(ckpt), "dtype": "float32", "device": "cpu", "add_bos_token": False}
    hf = evaluate(tmp_path, "hf", hf_args)
    with running_server(ckpt, tmp_path / "server") as (url, server):
        ours = evaluate(
            tmp_path,
            "local-completions",
            {"base_url": f"{url}/v1/completions", "model": server.models[0], "num_concurrent": 4},
        )
        assert integrity(server) == (0, 0)
    for task, metric in (("pastry_mc", "acc,none"), ("pastry_gen", "exact_match,none")):
        assert ours["results"][task][metric] == hf["results"][task][metric], task
    # sample by sample: the same log-likelihoods (float32 noise aside) and the same greedy
    # flags for every choice, the same generated text for every prompt
    for a, b in zip(ours["samples"]["pastry_mc"], hf["samples"]["pastry_mc"], strict=True):
        ours_ll, hf_ll = ([r[0] for r in s["resps"]] for s in (a, b))
        np.testing.assert_allclose([x[0] for x in ours_ll], [x[0] for x in hf_ll], atol=2e-3)
        assert [x[1] for x in ours_ll] == [x[1] for x in hf_ll]
    gen_a = [s["resps"] for s in ours["samples"]["pastry_gen"]]
    gen_b = [s["resps"] for s in hf["samples"]["pastry_gen"]]
    assert gen_a == gen_b
    assert any(r[0][0].strip() for r in gen_a)  # something was generated
