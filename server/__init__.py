"""HTTP server: llama-server and OpenAI compatible routes over the engine."""
