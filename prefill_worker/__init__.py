"""The prefill worker: a prefill-role engine behind PrefillService, and its KV export."""
