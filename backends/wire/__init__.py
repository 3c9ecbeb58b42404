"""Each HTTP API as a translation onto the shared chat request and a wire format of its answers (no
aiohttp here: phi2_server.py reads bodies and writes answers). errors: ApiError and each API's error
body; schema: the request schemas' checker; base: Generation, Context, Wire; native, openai,
completions, chat (the shared chat form), openai_chat, responses (and store), anthropic,
tokenizer, encoders: one API each; bodies: compressed request bodies, bounded."""
