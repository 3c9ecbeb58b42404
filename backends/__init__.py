"""Everything behind the HTTP server (phi2_server.py), in rooms. The folder names are the map:

    contract.py   what both runtimes honour (Backend, Decoder, Sampling, ...): types, no runtime
    choose.py     which runtime serves, and loading it (the one module that knows both)

    Rooms by concern (they import no torch, mlx, triton or aiohttp):
    chat/         a chat request as the model serves it: the plan (prompt, stops, parser), tool formats
    decoding/     around the runtime's step: grammars, prompt-lookup drafts, text in and out, a plain loop
    workers/      the threads that own the models: generation (the engine) and encoding
    files/        model files: resolving PHI2_MODEL, architectures, GGUF tables, LoRA adapter folders
    encoders/     embedding and rerank models: items, shapes, limits
    wire/         each HTTP API's translation onto the shared chat request, and its answer's shape

    Rooms by runtime:
    torch/        PyTorch: the runtime, the batched decoder (network, weights, prefill, sampling, KV
                  pages, prompt cache), quant/ (methods, GGUF blocks, stored models), cpu/ (the C++
                  kernels), cuda/ (graphs, Triton kernels)
    mlx/          MLX (mlx-lm): the runtime, GGUF matrices, drafts, LoRA, sampling, the encoder

docs/internals.md walks a request through them.
"""
