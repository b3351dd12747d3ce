"""The torch-free pieces every service uses: the gRPC server (interceptor, drain), errors,
sampling params, wire conversions, the tokenizer, child processes, the default model."""
