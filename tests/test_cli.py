"""`pastry generate`: an engine process driven end to end from the command line."""

from __future__ import annotations

import torch

from pastry.cli import main
from pastry.engine.checkpoint import load_checkpoint
from pastry.engine.engine import Engine
from pastry.engine.generate import FusedGenerator, Request
from pastry.wire.config import EngineConfig


def test_generate_matches_in_process_greedy(make_tiny, capsys):
    path = make_tiny("llama")
    assert main(["generate", "--model", str(path), "--max-tokens", "6", "Hello,", "Once"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    # the same greedy continuation from an in-process engine
    tok = load_checkpoint(path).tokenizer
    eng = Engine.load(path, EngineConfig(dtype="auto", num_pages=256, num_embeds=1024))
    reqs = [
        Request(tok.encode(p, add_special_tokens=True), 6, stop_ids=eng.info.eos_token_ids)
        for p in ("Hello,", "Once")
    ]
    FusedGenerator(eng.execute, eng.info, max_running=2).run(reqs)
    for prompt, req, line in zip(("Hello,", "Once"), reqs, lines, strict=True):
        assert line == prompt + tok.decode(req.output, skip_special_tokens=True)
    assert torch.get_default_dtype() == torch.float32


def test_generate_reports_a_bad_model_dir(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 1
    assert "config.json" in capsys.readouterr().err


def test_serve_takes_mcp_servers():
    """`pastry serve --mcp NAME=COMMAND|NAME=URL` (repeatable) registers MCP servers."""
    from pastry.cli import build_parser
    from pastry.control.mcp import McpServer

    args = build_parser().parse_args(
        ["serve", "--mcp", "files=python -m srv --root /tmp", "--mcp", "web=http://h:1/mcp"]
    )
    servers = [McpServer.parse(s) for s in args.mcp]
    assert servers[0].name == "files" and servers[0].command == (
        "python",
        "-m",
        "srv",
        "--root",
        "/tmp",
    )
    assert servers[1].name == "web" and servers[1].url == "http://h:1/mcp"
