"""The OpenAI-compatible HTTP server (`eaglet serve`): protocol.py (request and response models, the
OpenAI error shape), batcher.py (the decoding core: rows of one decoder), engine.py (the engine
thread, its bounded queue and cancellation), policy.py (speculate or not per batch), steps.py (each setting's step), load.py (the
load it reads), metrics.py
(Prometheus), guard.py (API key, body size), app.py (FastAPI routes, SSE), commands.py (`eaglet serve`, `eaglet bench-serve`)."""

MAX_BODY = 8 << 20  # request body limit (bytes, `serve --max-body-bytes`): a 128k-token context is ~0.5 MB of text
MULTI_STEP = 4  # plain decoding steps a host round trip on the GPU (serve --multi-step; engine.py)
KEEP_OVER_PLAIN = 1.1  # serve --spec-keep-over: a setting keeps a grown batch while predicted this much faster than plain
# serve --spec-switch: a batch moves to the setting chosen for its size when predicted this much faster than its own
# there (the H200 ShareGPT profile's settings lie within 2% of each other at 2-32 requests, where moving at every
# admission would trade steps in flight for nothing)
MOVE_OVER = 1.05
