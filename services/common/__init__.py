"""The floor every service stands on, torch-free and gRPC-free: sampling params and
their limits, block hashes and KV events, why a request finished, the model source
and the default model, the tokenizer (and chat templating)."""
