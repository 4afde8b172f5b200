"""Reference thread-pool inference server: FastAPI sync endpoints on uvicorn, one compiled model shared by the
request threads. See examples/serve/README.md and docs/serving.md."""
