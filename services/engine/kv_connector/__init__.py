"""KV connectors: where a request's KV comes from besides this engine's own pool, and
where the pool's KV goes besides it (vLLM v1's connector, split the same way).

    scheduler side (kv_loads.py drives it)          worker side (same process here)
    match(req, hits)  -> tokens it can supply       start_load(...) / poll(...)
    publishable(req)  -> may they be shared         save(blocks) after each step

`base.py` is the interface, `registry.py` builds the named ones (`--kv-connector`),
`transfer_config.py` reads vLLM's `--kv-transfer-config` JSON. This package's
`__init__` imports nothing: `config.py` (torch-free) reads transfer_config from here.
"""
