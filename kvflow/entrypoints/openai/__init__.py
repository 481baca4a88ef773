"""The OpenAI-compatible HTTP server behind `kvflow serve` (FastAPI on uvicorn), laid out like vLLM's.

api_server.py            the app: routes, error handlers, uvicorn
server_config.py         the server's options and per-request limits (plain data, light for the CLI)
middleware.py            request ids, unexpected errors (500s that keep the connection), body size, API key
protocol.py              pydantic request and response bodies, in OpenAI's and vLLM's shapes
unsupported.py           fields declared but not implemented yet (a 400 naming them unless off); unknown fields
serving_engine.py        what the completion and chat handlers share: ids, limits, prompts, sampling params
streaming.py             the server-sent-event skeleton of both streaming endpoints (usage, errors, [DONE])
serving_completion.py    POST /v1/completions
serving_chat.py          POST /v1/chat/completions
chat_prompt.py           a chat request's prompt text: the one chat renderer plus the server's template trust rules
serving_tokenization.py  POST /tokenize, POST /detokenize
protocol_pooling.py      the pooling endpoints' bodies (--runner pooling), in OpenAI's, vLLM's, Jina's / Cohere's shapes
serving_pooling.py       what the pooling handlers share: runner and task checks, inputs, AsyncLLM.encode runs
serving_embedding.py     POST /v1/embeddings, POST /pooling
serving_classification.py  POST /classify
serving_score.py         POST /v1/score and /score, POST /v1/rerank, /rerank and /v2/rerank
template_sandbox.py      chat templates sent by clients, rendered in a child process with time/memory/output limits
serving_models.py        the served model's name and GET /v1/models
logprobs.py              RequestOutput logprobs in OpenAI's completion and chat shapes
rl.py                    GET /is_paused, and the admin endpoints (pause, resume, prefix cache, aborts, weights, RPC)
metrics.py               Prometheus metrics, fed as an AsyncLLM StatLogger
errors.py                OpenAI's error body, and kvflow's ValueErrors mapped to the field they name
"""
