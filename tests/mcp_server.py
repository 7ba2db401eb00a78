"""A small MCP server written with the ``mcp`` package, for the MCP tests: started as a
process over stdio (``python tests/mcp_server.py``) or streamable HTTP
(``python tests/mcp_server.py --http PORT``).

Tools: ``lookup_employee(name)`` (a fixed table), ``add(a, b)``, ``fail()`` (always an
error result). Resource: ``memo://policy`` (a line of text)."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

EMPLOYEES = {"alice": "48213", "bob": "90817"}
POLICY = "Employee numbers are five digits and never change."

server = MCPServer("pastry-test-tools")


@server.tool(description="Look up an employee's record by first name")
def lookup_employee(name: str) -> str:
    number = EMPLOYEES.get(name.strip().lower())
    return (
        f"{name.strip().title()}'s employee number is {number}." if number else "no such employee"
    )


@server.tool(description="Add two integers")
def add(a: int, b: int) -> str:
    return str(a + b)


@server.tool(description="Always fails")
def fail() -> str:
    raise ToolError("this tool always fails")


@server.resource("memo://policy", name="policy", description="The records policy")
def policy() -> str:
    return POLICY


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
