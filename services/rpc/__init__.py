"""The gRPC shell every service shares, torch-free: the server (interceptor, drain),
errors as status codes, the wire conversions, security and the cluster token,
metrics, traces, child processes and the settings they read."""
