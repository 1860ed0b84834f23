"""The HTTP API (OpenAI Chat Completions / Completions / Responses, Anthropic Messages) over the engine.

`serving.http.app.HttpFrontEnd` is the server; nothing is imported here, so `serving.config` can nest the
small config types of `models`, `limits` and `accounting` without loading the ASGI stack.
"""
