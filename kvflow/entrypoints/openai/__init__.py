"""The OpenAI-compatible HTTP server behind `kvflow serve` (FastAPI on uvicorn), laid out like vLLM's.

api_server.py            the app: routes, middleware (API key, X-Request-Id), error handlers, uvicorn
protocol.py              pydantic request and response bodies, in OpenAI's and vLLM's shapes
serving_engine.py        what the completion and chat handlers share: ids, prompts, sampling params, streams
serving_completion.py    POST /v1/completions
serving_chat.py          POST /v1/chat/completions
serving_tokenization.py  POST /tokenize, POST /detokenize
serving_models.py        the served model's name and GET /v1/models
logprobs.py              RequestOutput logprobs in OpenAI's completion and chat shapes
rl.py                    pause / resume and the admin endpoints (prefix cache, aborts, weights, RPC)
metrics.py               Prometheus metrics, fed as an AsyncLLM StatLogger
errors.py                OpenAI's error body, and kvflow's ValueErrors mapped to the field they name
"""
