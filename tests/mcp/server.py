# An MCP server for the gateway's tests, on port argv[1] (answers as JSON when argv[2] is
# "json", else as event streams): tools that count their executions.
import asyncio
import json
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError

port = int(sys.argv[1])
json_response = len(sys.argv) > 2 and sys.argv[2] == "json"
server = MCPServer("counting")
counts = {}

def count(name):
    counts[name] = counts.get(name, 0) + 1
    return counts[name]

@server.tool()
async def send_mail(to: str, idempotency_key: str = "") -> str:
    """Sends one mail."""
    n = count("send_mail")
    return f"sent to {to} (execution {n})"

@server.tool()
async def slow(ms: int, ctx: Context) -> str:
    """Reports progress, then answers after ms."""
    n = count("slow")
    await ctx.report_progress(1, 2, "halfway")
    await asyncio.sleep(ms / 1000)
    return f"slow done (execution {n})"

@server.tool()
async def fail(code: int) -> str:
    """Fails with the JSON-RPC error code."""
    count("fail")
    raise MCPError(code, f"failed with {code}")

@server.tool()
async def counts_of() -> str:
    """How many times each tool ran."""
    return json.dumps(counts)

asyncio.run(server.run_streamable_http_async(host="127.0.0.1", port=port, json_response=json_response))
