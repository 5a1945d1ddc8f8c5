"""The OpenAI edge: what `serve` and the gateway both speak, torch-free (tests/test_import_graph.py
keeps torch, `engine/`, `models/`, `disagg/` and `server/` out of it).

| module            | one concept                                                          |
|-------------------|----------------------------------------------------------------------|
| protocol.py       | the request and response models of the OpenAI API (+ our extensions) |
| request_params.py | a request body -> SamplingParams                                     |
| errors.py         | the OpenAI error shape; exceptions -> 4xx/5xx; error handlers        |
| middleware.py     | the API key gate and readiness/draining 503s                         |
| body_limits.py    | size, depth and UTF-8 limits before a route parses a body            |
| disconnect.py     | a client that leaves (499) aborts its work                           |
| defaults.py       | the defaults report: /v1/sampling/defaults and the startup table     |
| metrics.py        | the Prometheus metrics every OpenAI edge keeps                       |
| tools.py          | tools and tool_choice: the prompt, the forced call, the answer rule  |
| tool_parsers.py   | each family's tool-call format: its grammar and its reader           |
| tool_json.py      | the JSON scanning the readers share                                  |
| arguments.py      | the flags `serve` and the gateway share                              |
| config.py         | the settings every edge has (EdgeConfig) and their flags             |
| lifecycle.py      | uvicorn with readiness and a graceful drain                          |
| responses.py      | rules every response follows: its quality, the SSE writers           |
| agents/           | the coding agents' APIs (Responses, Messages) as chat translations   |
"""
