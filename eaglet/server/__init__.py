"""The OpenAI-compatible HTTP server (`eaglet serve`): protocol.py (request and response models, the
OpenAI error shape), batcher.py (the decoding core: rows of one decoder), engine.py (the engine
thread, its bounded queue and cancellation), metrics.py (Prometheus), app.py (FastAPI routes, SSE)."""
