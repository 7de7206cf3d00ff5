"""The HTTP front: `jaxkv serve`'s OpenAI-compatible server on an `AsyncEngine` (`serve` extra).

`app.create_app` builds the FastAPI app (routes, streaming, disconnect aborts); `schema` holds
the request bodies and their translation into `SamplingParams`; `errors` the refusals in
OpenAI's shape; `guard` the body-size and API-key middleware; `tasks` the asyncio helpers;
`logprobs` OpenAI's logprob shapes; `metrics` the Prometheus metrics.
"""
