# The MCP SDK's client driven by a plan, for the gateway's tests: argv[1] is the gateway's MCP
# URL, argv[2] the server's own (for the execution counts), argv[3] the plan (JSON): a list of
# steps, each a call or a list of calls run at once. A call: {"tool", "args", "key" (in
# _meta.idempotencyKey), "mode" ("auto" or "legacy"), "cancel_after" (seconds: the caller gives
# up, then the call is not awaited)}. Prints one JSON line: the results, and the counts.
import asyncio
import json
import sys

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

gateway, direct, plan = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])


async def call(step):
    meta = {"idempotencyKey": step["key"]} if step.get("key") else None
    try:
        # As an agent that goes away would: without ending its session (no DELETE).
        transport = streamable_http_client(gateway, terminate_on_close=False)
        async with Client(transport, mode=step.get("mode", "auto")) as client:
            call = client.call_tool(step["tool"], step.get("args", {}), meta=meta)
            if "cancel_after" in step:
                try:
                    await asyncio.wait_for(call, step["cancel_after"])
                except asyncio.TimeoutError:
                    return {"cancelled": True}
            result = await call if "cancel_after" not in step else None
            if result is None:
                return {"cancelled": False}
            meta = result.meta or {}
            return {
                "text": result.content[0].text if result.content else None,
                "is_error": result.is_error,
                "replayed": bool(meta.get("io.idemgate/replayed")),
            }
    except BaseException as e:
        e = mcp_error(e)
        return {"code": e.code, "message": e.message, "data": e.data}


def mcp_error(e):
    """The MCPError `e` is, or holds (the client raises it from a task group)."""
    if isinstance(e, MCPError):
        return e
    for inner in getattr(e, "exceptions", ()):
        if (found := mcp_error(inner)) is not None:
            return found
    if isinstance(e, Exception) and not isinstance(e, BaseExceptionGroup):
        return None
    raise e


async def counts():
    async with Client(direct) as client:
        result = await client.call_tool("counts_of", {})
        return json.loads(result.content[0].text)


async def main():
    out = []
    for step in plan:
        if isinstance(step, list):
            out.append(await asyncio.gather(*(call(s) for s in step)))
        else:
            out.append(await call(step))
    print(json.dumps({"results": out, "counts": await counts()}))


asyncio.run(main())
