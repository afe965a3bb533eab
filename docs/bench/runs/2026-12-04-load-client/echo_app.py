# A server that answers at once (no model): the HTTP side's own TTFT at 32 closed-loop streams.
import json
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

async def models(req):
    return JSONResponse({"object": "list", "data": [{"id": "echo", "object": "model"}]})

async def completions(req):
    body = await req.json()
    n = body.get("max_tokens", 4)
    async def gen():
        for i in range(n):
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}) + "\n\n"
        yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 128, "completion_tokens": n}}) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(gen(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
