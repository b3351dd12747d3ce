"""The OpenAI-compatible HTTP API on the router (FastAPI and uvicorn; no torch)."""
