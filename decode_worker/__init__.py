"""The decode worker: a decode-role engine behind DecodeService, and its KV import."""
