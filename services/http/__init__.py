"""The OpenAI-compatible HTTP front end: an aiohttp server inside a detached Ray actor.

    client --HTTP/SSE--> http actor (services.http.server) --wire frames--> router --> decode

    schemas.py        request bodies (pydantic): /v1/chat/completions, /v1/completions -> a
                      GenerateRequest; OpenAIError, the {"error": {...}} answer naming the field
    openai_format.py  response objects and SSE chunks in OpenAI's format, logprobs, usage
    metrics.py        the /metrics registry (Prometheus text) from request timings and the
                      decode actor's figures
    server.py         routes, bearer-key auth, streaming, disconnect -> abort; the Ray actor
"""
