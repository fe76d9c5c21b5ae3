"""The OpenAI-compatible HTTP server: `tinyllm serve`, or `create_app(llm)` to embed it."""
