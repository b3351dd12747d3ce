"""LoRA on the worker's side, in one place: adapter names and the paths a caller may send
(names.py, paths.py: torch- and gRPC-free, the router checks with them too), PEFT
directories read and checked (adapter.py), the adapters an engine holds and their device
slots (registry.py, slots.py), and a worker's adapter reads and its LoadLora / UnloadLora
(calls.py, above the engine: it runs them on the engine's thread). The kernels stay in
kernels/ (lora.py, triton_lora.py)."""
