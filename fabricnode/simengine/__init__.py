"""A simulated OpenAI-compatible LLM engine: a pure scheduler (``model``) and a trio server."""
